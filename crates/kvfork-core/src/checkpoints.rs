//! Which recurrent-state checkpoints of one sequence are kept, under a budget.
//!
//! A recurrent (or hybrid) model keeps one state per sequence, the state after its last
//! token: it cannot be cut back to an earlier position as a KV cache can. The engine copies
//! that state aside at chosen positions (a *checkpoint*); a fork inside the sequence, or a
//! rollback, restarts from the last checkpoint at or before the position it needs and decodes
//! the tokens after it again. This module only decides which checkpoints stay: the state
//! itself is opaque (`T`).
//!
//! When the budget (a count and bytes) is exceeded, the checkpoint whose removal opens the
//! smallest gap between its neighbours goes, never the newest: what stays is spread over the
//! sequence, so the tokens decoded again after a restore stay few wherever it forks.

/// A checkpoint: the state after `pos` tokens (positions `[0, pos)` are in it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Checkpoint<T> {
    /// Tokens in the state.
    pub pos: u32,
    /// Its size, counted against the budget.
    pub bytes: usize,
    /// The state itself.
    pub state: T,
}

/// The most a sequence keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget {
    /// Checkpoints kept at most.
    pub count: usize,
    /// Their bytes at most.
    pub bytes: usize,
}

/// One sequence's checkpoints, in position order (positions unique).
#[derive(Clone, Debug)]
pub struct Checkpoints<T> {
    items: Vec<Checkpoint<T>>,
}

impl<T> Default for Checkpoints<T> {
    fn default() -> Self {
        Checkpoints { items: Vec::new() }
    }
}

impl<T> Checkpoints<T> {
    /// Keep `state` as the checkpoint at `pos` (replacing one there), then thin to `budget`.
    /// False, with nothing kept, when it alone is over the budget.
    pub fn insert(&mut self, pos: u32, bytes: usize, state: T, budget: Budget) -> bool {
        if budget.count == 0 || bytes > budget.bytes {
            return false;
        }
        let at = self.items.partition_point(|c| c.pos < pos);
        let checkpoint = Checkpoint { pos, bytes, state };
        if self.items.get(at).is_some_and(|c| c.pos == pos) {
            self.items[at] = checkpoint;
        } else {
            self.items.insert(at, checkpoint);
        }
        while self.items.len() > budget.count || self.bytes() > budget.bytes {
            let victim = self.thinnest(pos);
            self.items.remove(victim);
        }
        true
    }

    /// The index whose removal opens the smallest gap, never the checkpoint at `keep` (the
    /// one just inserted): there are at least two when the budget is exceeded.
    fn thinnest(&self, keep: u32) -> usize {
        let gap = |i: usize| {
            let before = if i == 0 { 0 } else { self.items[i - 1].pos };
            let after = self.items.get(i + 1).map_or(self.items[i].pos, |c| c.pos);
            after - before
        };
        (0..self.items.len())
            .filter(|&i| self.items[i].pos != keep)
            .min_by_key(|&i| (gap(i), i))
            .expect("a budget of at least one keeps the inserted checkpoint")
    }

    /// The last checkpoint at or before `pos`.
    pub fn at_or_before(&self, pos: u32) -> Option<&Checkpoint<T>> {
        let after = self.items.partition_point(|c| c.pos <= pos);
        after.checked_sub(1).map(|i| &self.items[i])
    }

    /// Forget the checkpoints after `pos` (the sequence was cut back there).
    pub fn truncate(&mut self, pos: u32) {
        let keep = self.items.partition_point(|c| c.pos <= pos);
        self.items.truncate(keep);
    }

    /// Forget them all.
    pub fn clear(&mut self) {
        self.items.clear();
    }

    /// Checkpoints kept.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether none is kept.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Bytes of every state kept.
    pub fn bytes(&self) -> usize {
        self.items.iter().map(|c| c.bytes).sum()
    }

    /// The checkpoints kept, in position order.
    pub fn iter(&self) -> impl Iterator<Item = &Checkpoint<T>> {
        self.items.iter()
    }

    /// Positions kept, in order.
    pub fn positions(&self) -> impl Iterator<Item = u32> + '_ {
        self.items.iter().map(|c| c.pos)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROOMY: Budget = Budget {
        count: 8,
        bytes: 1 << 20,
    };

    fn positions(c: &Checkpoints<()>) -> Vec<u32> {
        c.positions().collect()
    }

    #[test]
    fn finds_the_last_at_or_before() {
        let mut c = Checkpoints::default();
        for pos in [10, 30, 20] {
            assert!(c.insert(pos, 1, (), ROOMY));
        }
        assert_eq!(positions(&c), [10, 20, 30]);
        assert_eq!(c.at_or_before(9), None);
        assert_eq!(c.at_or_before(10).map(|c| c.pos), Some(10));
        assert_eq!(c.at_or_before(29).map(|c| c.pos), Some(20));
        assert_eq!(c.at_or_before(99).map(|c| c.pos), Some(30));
    }

    #[test]
    fn thins_the_densest_spot_and_keeps_the_newest() {
        let budget = Budget {
            count: 3,
            bytes: 100,
        };
        let mut c = Checkpoints::default();
        for pos in [100, 110, 400] {
            c.insert(pos, 1, (), budget);
        }
        c.insert(800, 1, (), budget);
        // Without 110 the gap is 100..400; without 100 it is 0..110: 100 goes.
        assert_eq!(positions(&c), [110, 400, 800]);
        // Position 0 needs no checkpoint: without 110 the gap is 0..400, without 800 400..805.
        c.insert(805, 1, (), budget);
        assert_eq!(positions(&c), [400, 800, 805]);
    }

    #[test]
    fn bytes_bound_too_and_one_too_big_is_refused() {
        let budget = Budget {
            count: 10,
            bytes: 25,
        };
        let mut c = Checkpoints::default();
        for pos in 1..=5 {
            assert!(c.insert(pos * 10, 10, (), budget));
        }
        assert_eq!(c.len(), 2);
        assert!(c.bytes() <= 25);
        assert!(!c.insert(99, 26, (), budget));
        assert_eq!(c.at_or_before(99).map(|c| c.pos), Some(50));
    }

    #[test]
    fn truncate_forgets_what_lies_after() {
        let mut c = Checkpoints::default();
        for pos in [5, 10, 15] {
            c.insert(pos, 1, (), ROOMY);
        }
        c.truncate(10);
        assert_eq!(positions(&c), [5, 10]);
        c.insert(10, 2, (), ROOMY);
        assert_eq!(c.bytes(), 3);
    }
}
