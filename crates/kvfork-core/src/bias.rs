//! Logit biases by token: a sorted list, so a candidate finds its bias by binary search and
//! the whole vocabulary takes them by index.

/// `(token, bias)` pairs sorted by token, one per token, no zero biases.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Biases(Vec<(i32, f32)>);

impl Biases {
    /// From any list: sorted by token, the last value of a repeated token wins, zeros dropped.
    pub fn new(mut pairs: Vec<(i32, f32)>) -> Self {
        pairs.reverse(); // a stable sort then keeps the last value first
        pairs.sort_by_key(|&(t, _)| t);
        pairs.dedup_by_key(|&mut (t, _)| t);
        pairs.retain(|&(_, b)| b != 0.0);
        Biases(pairs)
    }

    /// Whether no token has a bias.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Number of biased tokens.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// The pairs, sorted by token.
    pub fn pairs(&self) -> &[(i32, f32)] {
        &self.0
    }

    /// The bias of `token`, if it has one.
    pub fn get(&self, token: i32) -> Option<f32> {
        self.0
            .binary_search_by_key(&token, |&(t, _)| t)
            .ok()
            .map(|i| self.0[i].1)
    }

    /// Whether `token` has a bias.
    pub fn contains(&self, token: i32) -> bool {
        self.get(token).is_some()
    }
}

/// The summed bias of `token` over `lists`.
pub fn total(lists: &[&Biases], token: i32) -> f32 {
    lists.iter().map(|l| l.get(token).unwrap_or(0.0)).sum()
}

#[cfg(test)]
mod tests {
    use super::{total, Biases};
    use proptest::prelude::*;

    #[test]
    fn last_value_wins_and_zeros_go() {
        let b = Biases::new(vec![(5, 1.0), (2, -1.0), (5, 3.0), (7, 0.0)]);
        assert_eq!(b.pairs(), &[(2, -1.0), (5, 3.0)]);
        assert_eq!(b.get(5), Some(3.0));
        assert_eq!(b.get(7), None);
        assert!(!b.contains(3));
    }

    proptest! {
        /// By index over the vocabulary or by lookup per token: the same logits.
        #[test]
        fn lookup_equals_indexing(
            a in prop::collection::vec((0i32..64, -4.0f32..4.0), 0..20),
            s in prop::collection::vec((0i32..64, -4.0f32..4.0), 0..20),
        ) {
            let (a, s) = (Biases::new(a), Biases::new(s));
            let mut by_index = vec![0.5f32; 64];
            for &(t, b) in a.pairs().iter().chain(s.pairs()) {
                by_index[t as usize] += b;
            }
            for (t, &logit) in by_index.iter().enumerate() {
                prop_assert!((logit - (0.5 + total(&[&a, &s], t as i32))).abs() < 1e-5);
            }
        }
    }
}
