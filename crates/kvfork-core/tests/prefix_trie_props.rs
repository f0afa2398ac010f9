//! Model-based tests: random operation sequences run against both the
//! `PrefixTrie` and a plain model (a map of sequences, a brute-force
//! longest-common-prefix search and a list in use order), compared after every
//! step. Tokens come from 0..4 so prefixes collide often.

use std::collections::{BTreeMap, BTreeSet};

use kvfork_core::prefix_trie::Match;
use kvfork_core::PrefixTrie;
use proptest::prelude::*;

type Key = u8;

#[derive(Clone, Debug)]
enum Op {
    Insert(Key, Vec<i32>),
    Remove(Key),
    Extend(Key, Vec<i32>),
    Truncate(Key, usize),
    Touch(Key),
    SetEvictable(Key, bool),
    /// Any query.
    Query(Vec<i32>),
    /// A held sequence (picked by index modulo count), cut, plus a tail: near misses.
    QueryNear(usize, usize, Vec<i32>),
}

fn tokens(max: usize) -> impl Strategy<Value = Vec<i32>> {
    prop::collection::vec(0i32..4, 0..max)
}

/// Keys 0..6, so operations also hit keys that are not held.
fn key() -> impl Strategy<Value = Key> {
    0u8..6
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (key(), tokens(9)).prop_map(|(k, t)| Op::Insert(k, t)),
        1 => key().prop_map(Op::Remove),
        3 => (key(), tokens(4)).prop_map(|(k, t)| Op::Extend(k, t)),
        2 => (key(), 0usize..10).prop_map(|(k, n)| Op::Truncate(k, n)),
        2 => key().prop_map(Op::Touch),
        3 => (key(), any::<bool>()).prop_map(|(k, e)| Op::SetEvictable(k, e)),
        2 => tokens(10).prop_map(Op::Query),
        2 => (any::<usize>(), any::<usize>(), tokens(3))
            .prop_map(|(s, c, t)| Op::QueryNear(s, c, t)),
    ]
}

/// The obvious implementation.
#[derive(Default)]
struct Model {
    /// Sequence and evictable flag per holder.
    seqs: BTreeMap<Key, (Vec<i32>, bool)>,
    /// Holders in use order, least recent first.
    recency: Vec<Key>,
}

impl Model {
    fn use_now(&mut self, k: Key) {
        self.recency.retain(|&r| r != k);
        self.recency.push(k);
    }

    fn prefixes<'a>(seqs: impl Iterator<Item = &'a Vec<i32>>) -> BTreeSet<Vec<i32>> {
        seqs.flat_map(|s| (1..=s.len()).map(|n| s[..n].to_vec()))
            .collect()
    }

    fn prefixes_where(&self, pred: impl Fn(Key, bool) -> bool) -> BTreeSet<Vec<i32>> {
        Self::prefixes(
            self.seqs
                .iter()
                .filter(|&(&k, (_, e))| pred(k, *e))
                .map(|(_, (s, _))| s),
        )
    }
}

fn lcp(a: &[i32], b: &[i32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn check_query(trie: &PrefixTrie<Key>, model: &Model, q: &[i32]) {
    let best = model
        .seqs
        .values()
        .map(|(s, _)| lcp(s, q))
        .max()
        .unwrap_or(0);
    let got = trie.longest_prefix(q);
    if best == 0 {
        assert_eq!(got, None, "query {q:?}");
        return;
    }
    let got = got.unwrap_or_else(|| panic!("no match for {q:?}, model has {best}"));
    assert_eq!(got.len, best, "query {q:?}");
    let seq = &model.seqs[&got.key].0;
    assert_eq!(lcp(seq, q), best, "returned key does not share the prefix");
    assert_eq!(got.exact, seq.len() == best, "exact flag");
    // Tie rule: an exact holder first, then the most recently used.
    let tied: Vec<Key> = model
        .recency
        .iter()
        .rev()
        .copied()
        .filter(|k| lcp(&model.seqs[k].0, q) == best)
        .collect();
    let want = tied
        .iter()
        .copied()
        .find(|k| model.seqs[k].0.len() == best)
        .unwrap_or(tied[0]);
    assert_eq!(
        got,
        Match {
            key: want,
            len: best,
            exact: model.seqs[&want].0.len() == best
        },
        "tie rule for {q:?} among {tied:?}"
    );
}

fn step(trie: &mut PrefixTrie<Key>, model: &mut Model, op: &Op) {
    match op {
        Op::Insert(k, t) => {
            let had = model.seqs.insert(*k, (t.clone(), false)).is_some();
            model.use_now(*k);
            assert_eq!(trie.insert(*k, t), had);
        }
        Op::Remove(k) => {
            let had = model.seqs.remove(k).is_some();
            model.recency.retain(|r| r != k);
            assert_eq!(trie.remove(*k), had);
        }
        Op::Extend(k, t) => {
            let had = model.seqs.get_mut(k).map(|(s, _)| s.extend(t)).is_some();
            assert_eq!(trie.extend(*k, t), had);
        }
        Op::Truncate(k, n) => {
            let had = model.seqs.get_mut(k).map(|(s, _)| s.truncate(*n)).is_some();
            assert_eq!(trie.truncate(*k, *n), had);
        }
        Op::Touch(k) => {
            let had = model.seqs.contains_key(k);
            if had {
                model.use_now(*k);
            }
            assert_eq!(trie.touch(*k), had);
        }
        Op::SetEvictable(k, e) => {
            let had = model.seqs.get_mut(k).map(|(_, f)| *f = *e).is_some();
            assert_eq!(trie.set_evictable(*k, *e), had);
        }
        Op::Query(q) => check_query(trie, model, q),
        Op::QueryNear(sel, cut, tail) => {
            if model.seqs.is_empty() {
                return;
            }
            let s = &model.seqs.values().nth(sel % model.seqs.len()).unwrap().0;
            let mut q = s[..cut % (s.len() + 1)].to_vec();
            q.extend(tail);
            check_query(trie, model, &q);
        }
    }
}

fn compare(trie: &PrefixTrie<Key>, model: &Model) {
    trie.check_invariants();
    assert_eq!(trie.len(), model.seqs.len());
    for (&k, (s, e)) in &model.seqs {
        assert_eq!(trie.tokens(k).as_ref(), Some(s), "tokens of {k}");
        assert_eq!(trie.seq_len(k), Some(s.len()));
        assert_eq!(trie.is_evictable(k), Some(*e));
        let others = model.prefixes_where(|o, _| o != k);
        let own = Model::prefixes(std::iter::once(s));
        assert_eq!(
            trie.exclusive_tokens(k),
            Some(own.difference(&others).count()),
            "exclusive tokens of {k}"
        );
    }
    let evict: Vec<Key> = model
        .recency
        .iter()
        .copied()
        .filter(|k| model.seqs[k].1)
        .collect();
    assert_eq!(trie.evict_order(), evict);
    assert_eq!(trie.least_recently_used(), evict.first().copied());
    let all = model.prefixes_where(|_, _| true);
    assert_eq!(trie.unique_tokens(), all.len(), "distinct prefixes");
    let live = model.prefixes_where(|_, e| !e);
    assert_eq!(
        trie.cached_tokens(),
        all.difference(&live).count(),
        "prefixes only evictable holders have"
    );
    // Every held sequence, and each with one token changed at the end, as queries.
    for (s, _) in model.seqs.values() {
        check_query(trie, model, s);
        if let Some((&last, head)) = s.split_last() {
            check_query(trie, model, &[head, &[(last + 1) % 4]].concat());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn prefix_trie_matches_model(ops in prop::collection::vec(op(), 0..120)) {
        let mut trie = PrefixTrie::new();
        let mut model = Model::default();
        for op in &ops {
            step(&mut trie, &mut model, op);
            compare(&trie, &model);
        }
    }
}

/// A long run of a serving loop: requests fork the best match, generate, are
/// released, and the oldest entries are evicted under a token budget.
#[test]
fn serving_churn_stays_within_budget_and_leaves_nothing_behind() {
    let budget = 64;
    let mut trie: PrefixTrie<u32> = PrefixTrie::new();
    let mut rng = 0x2545_f491_4f6c_dd1d_u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let system: Vec<i32> = (0..16).collect();
    let mut live: Vec<u32> = Vec::new();
    let mut hits = 0;
    for id in 0..3000u32 {
        // A prompt: the shared system prompt (most of the time) plus a short question.
        let mut prompt = if next() % 4 == 0 {
            Vec::new()
        } else {
            system.clone()
        };
        prompt.extend((0..1 + next() % 4).map(|_| (next() % 3) as i32 + 100));
        if let Some(m) = trie.longest_prefix(&prompt[..prompt.len() - 1]) {
            assert!(m.len < prompt.len());
            assert_eq!(trie.tokens(m.key).unwrap()[..m.len], prompt[..m.len]);
            trie.touch(m.key);
            hits += m.len;
        }
        trie.insert(id, &prompt);
        live.push(id);
        // Live branches decode a few tokens; some finish and are released.
        for &k in &live {
            trie.extend(k, &[(next() % 5) as i32 + 200]);
        }
        while live.len() > 4 || (!live.is_empty() && next() % 3 == 0) {
            let k = live.remove((next() as usize) % live.len());
            trie.touch(k);
            trie.set_evictable(k, true);
        }
        while trie.cached_tokens() > budget {
            let lru = trie
                .least_recently_used()
                .expect("cached tokens need an entry");
            assert!(trie.remove(lru));
        }
        if id % 500 == 0 {
            trie.check_invariants();
        }
    }
    assert!(hits > 3000 * 8, "the system prompt is reused: {hits}");
    trie.check_invariants();
    let keys: Vec<u32> = trie.keys().collect();
    for k in keys {
        assert!(trie.remove(k));
    }
    assert!(trie.is_empty());
    assert_eq!((trie.unique_tokens(), trie.cached_tokens()), (0, 0));
    assert_eq!(trie.longest_prefix(&system), None);
    trie.check_invariants();
}
