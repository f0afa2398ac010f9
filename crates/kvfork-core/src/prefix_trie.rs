//! The token trie behind the prefix cache of `kvfork serve` (`kvfork.PrefixCache`).
//!
//! Concurrent requests often share a long prefix: the same system prompt, the same
//! document asked different questions, a chat history that grew by one turn. Prefilling
//! that prefix again for every request is most of the cost of serving them; forking a
//! branch that already holds it costs next to nothing, because with a unified KV cache
//! the fork shares the cells. This module is the pure bookkeeping half of that cache,
//! with no FFI: for every *holder* (a live branch still generating, or a released branch
//! kept as a cache entry) it records the token sequence the holder has in the KV cache,
//! and answers
//!
//! - which holder shares the longest prefix with a new prompt
//!   ([`PrefixTrie::longest_prefix`]), possibly at a position inside the holder's
//!   sequence (the engine then forks the holder at that position);
//! - which cache entries to evict first ([`PrefixTrie::evict_order`], least recently
//!   used first, only holders marked evictable);
//! - how many KV cells the holders occupy ([`PrefixTrie::unique_tokens`],
//!   [`PrefixTrie::cached_tokens`], [`PrefixTrie::exclusive_tokens`]).
//!
//! Policy stays with the engine: when to touch a holder, when to evict, and that a
//! request needs at least one prefilled token for fresh logits (query with all but the
//! prompt's last token, see [`PrefixTrie::longest_prefix`]).
//!
//! # Cell accounting
//!
//! The trie has one node per distinct prefix of the held sequences, so
//! [`PrefixTrie::unique_tokens`] is the number of KV cells the holders occupy *if every
//! common prefix of two holders sits in shared cells*. That holds for holders made the
//! way the prefix cache makes them: each new branch is forked from the holder with the
//! longest common prefix, so it shares that holder's cells, and by induction any two
//! holders share cells along their whole common prefix. It stops holding when two
//! holders write the same token at the same position independently (two branches that
//! sample the same next token, or a prompt prefilled without forking): the trie counts
//! those cells once while the KV cache holds them twice. The counts are then lower
//! bounds, and exact again once one of the two is truncated or removed.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

/// Index of a node in [`PrefixTrie::nodes`].
type NodeId = u32;

/// The root: the empty prefix, never freed and never counted.
const ROOT: NodeId = 0;

/// The holder chosen by [`PrefixTrie::longest_prefix`] and how much of the query it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Match<K> {
    /// The holder to fork from.
    pub key: K,
    /// Length of the common prefix of the query and the holder's sequence (at least 1).
    /// Forking the holder at `len` gives a branch holding `query[..len]`.
    pub len: usize,
    /// The holder's whole sequence is that prefix (`len` equals its length), so the
    /// fork keeps every cell of the holder; otherwise `len` lies inside its sequence.
    pub exact: bool,
}

/// One distinct prefix: the node for `tokens[..depth]` of every holder passing through.
#[derive(Clone, Debug)]
struct TrieNode<K> {
    /// The prefix's last token.
    token: i32,
    /// The node of the prefix one token shorter ([`ROOT`] at depth 1).
    parent: NodeId,
    /// Longer prefixes by their last token, sorted by token.
    children: Vec<(i32, NodeId)>,
    /// Holders whose sequence has this prefix, in no particular order. Empty exactly
    /// when the node is free (the root excepted, which keeps no list).
    through: Vec<K>,
    /// How many of `through` are not evictable.
    pinned: u32,
}

/// What the trie keeps per holder.
#[derive(Clone, Debug)]
struct Holder {
    /// `steps[i]` = (the node of `tokens[..=i]`, this holder's index in its `through`),
    /// so removal is O(1) per token (swap-remove, then fix the moved holder's index).
    steps: Vec<(NodeId, u32)>,
    /// When it was last used (inserted or touched); unique, increasing.
    stamp: u64,
    /// A released cache entry that may be evicted (live branches are not).
    evictable: bool,
}

/// The token sequences held in a KV cache, by holder, in a trie of token edges.
///
/// `K` is the caller's key for a holder, e.g. a branch handle. Every holder is either
/// live (the default: a branch still in use, never offered for eviction) or evictable
/// (a released cache entry), and carries a last-use time for least-recently-used eviction.
///
/// Costs, with `n` the number of tokens an operation adds or removes, `b` the branching
/// at a node and `h` the number of holders through the matched node:
/// [`insert`](Self::insert), [`extend`](Self::extend): O(n log b);
/// [`remove`](Self::remove), [`truncate`](Self::truncate): O(n) (expected, hashing);
/// [`longest_prefix`](Self::longest_prefix): O(len(query) log b + h);
/// [`touch`](Self::touch): O(log holders); [`set_evictable`](Self::set_evictable):
/// O(length of the holder's sequence).
///
/// ```
/// use kvfork_core::PrefixTrie;
///
/// let mut trie = PrefixTrie::new();
/// let system = [1, 2, 3, 4];
/// trie.insert("a", &[&system[..], &[10, 11]].concat());
/// trie.set_evictable("a", true); // released: a cache entry now
///
/// // A new request with the same system prompt forks "a" after 4 tokens.
/// let prompt = [&system[..], &[20, 21]].concat();
/// let m = trie.longest_prefix(&prompt[..prompt.len() - 1]).unwrap();
/// assert_eq!((m.key, m.len, m.exact), ("a", 4, false));
/// trie.touch("a");
/// trie.insert("b", &prompt); // forked at 4, prefilled 2
/// assert_eq!(trie.unique_tokens(), 8); // 4 shared + 2 + 2
/// assert_eq!(trie.cached_tokens(), 2); // only "a"'s own tail is held by cache entries alone
/// assert_eq!(trie.evict_order(), ["a"]);
/// ```
#[derive(Clone, Debug)]
pub struct PrefixTrie<K> {
    /// Node arena; index 0 is [`ROOT`]. Free slots have an empty `through`.
    nodes: Vec<TrieNode<K>>,
    /// Free slots of `nodes`, reused first.
    free: Vec<NodeId>,
    holders: HashMap<K, Holder>,
    /// Evictable holders by last-use stamp, least recent first.
    lru: BTreeMap<u64, K>,
    /// Last stamp handed out.
    clock: u64,
    /// Live nodes, the root excepted.
    unique: usize,
    /// Live nodes (root excepted) with `pinned == 0`.
    cached: usize,
}

impl<K: Copy + Eq + Hash> Default for PrefixTrie<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: Copy + Eq + Hash> PrefixTrie<K> {
    /// An empty trie.
    pub fn new() -> Self {
        PrefixTrie {
            nodes: vec![TrieNode {
                token: 0,
                parent: ROOT,
                children: Vec::new(),
                through: Vec::new(),
                pinned: 0,
            }],
            free: Vec::new(),
            holders: HashMap::new(),
            lru: BTreeMap::new(),
            clock: 0,
            unique: 0,
            cached: 0,
        }
    }

    /// Number of holders (live and evictable).
    pub fn len(&self) -> usize {
        self.holders.len()
    }

    /// No holders at all.
    pub fn is_empty(&self) -> bool {
        self.holders.is_empty()
    }

    /// `key` holds a sequence here (possibly an empty one).
    pub fn contains(&self, key: K) -> bool {
        self.holders.contains_key(&key)
    }

    /// Length of `key`'s sequence; `None` for an unknown key.
    pub fn seq_len(&self, key: K) -> Option<usize> {
        self.holders.get(&key).map(|h| h.steps.len())
    }

    /// `key`'s sequence, rebuilt from the trie in O(length); `None` for an unknown key.
    pub fn tokens(&self, key: K) -> Option<Vec<i32>> {
        let h = self.holders.get(&key)?;
        Some(h.steps.iter().map(|&(n, _)| self.node(n).token).collect())
    }

    /// Whether `key` is an evictable cache entry; `None` for an unknown key.
    pub fn is_evictable(&self, key: K) -> Option<bool> {
        self.holders.get(&key).map(|h| h.evictable)
    }

    /// All holders, in no particular order.
    pub fn keys(&self) -> impl Iterator<Item = K> + '_ {
        self.holders.keys().copied()
    }

    /// Records that `key` holds `tokens`, as a live (not evictable), most recently used
    /// holder. A key already present is replaced, its old sequence, flag and last use
    /// dropped; returns whether that happened.
    pub fn insert(&mut self, key: K, tokens: &[i32]) -> bool {
        let replaced = self.remove(key);
        let stamp = self.bump();
        self.holders.insert(
            key,
            Holder {
                steps: Vec::with_capacity(tokens.len()),
                stamp,
                evictable: false,
            },
        );
        self.extend(key, tokens);
        replaced
    }

    /// Forgets `key` (an evicted entry, a pruned branch), freeing the nodes no other
    /// holder passes through. Returns whether `key` was held.
    pub fn remove(&mut self, key: K) -> bool {
        let Some(h) = self.holders.remove(&key) else {
            return false;
        };
        if h.evictable {
            self.lru.remove(&h.stamp);
        }
        for (depth, &(n, slot)) in h.steps.iter().enumerate().rev() {
            self.detach(n, depth, slot, h.evictable);
        }
        true
    }

    /// Appends `more` to `key`'s sequence (a live branch that decoded tokens). Does not
    /// change its last use: call [`touch`](Self::touch) for that. Returns whether `key`
    /// is held (an unknown key changes nothing).
    pub fn extend(&mut self, key: K, more: &[i32]) -> bool {
        let Some(h) = self.holders.get_mut(&key) else {
            return false;
        };
        let evictable = h.evictable;
        let mut steps = std::mem::take(&mut h.steps);
        let mut cur = steps.last().map_or(ROOT, |&(n, _)| n);
        steps.reserve(more.len());
        for &token in more {
            cur = self.child_or_insert(cur, token);
            let slot = self.attach(cur, key, evictable);
            steps.push((cur, slot));
        }
        self.holder_mut(key).steps = steps;
        true
    }

    /// Cuts `key`'s sequence to its first `len` tokens (a branch rewound, its cells past
    /// `len` removed); a `len` at or past the end changes nothing. Does not change its
    /// last use. Returns whether `key` is held.
    pub fn truncate(&mut self, key: K, len: usize) -> bool {
        let Some(h) = self.holders.get_mut(&key) else {
            return false;
        };
        if len >= h.steps.len() {
            return true;
        }
        let evictable = h.evictable;
        let mut steps = std::mem::take(&mut h.steps);
        for (depth, &(n, slot)) in steps.iter().enumerate().skip(len).rev() {
            self.detach(n, depth, slot, evictable);
        }
        steps.truncate(len);
        self.holder_mut(key).steps = steps;
        true
    }

    /// The holder sharing the longest common prefix with `query`, and that prefix's
    /// length; `None` when no holder shares even the first token.
    ///
    /// The length may be less than the holder's own (fork at a position inside its
    /// sequence) and may be all of `query`. A caller that must prefill at least one token
    /// (to get logits for the last one) asks with `&query[..query.len() - 1]`, which
    /// picks the best holder under that cap with the same tie rule.
    ///
    /// Ties (several holders sharing the longest prefix) go to a holder whose whole
    /// sequence is that prefix ([`Match::exact`]: forking it wastes no cells and the
    /// entry could be taken over whole), and among those, or when there is none, to the
    /// most recently used one. Stamps are unique, so the choice is deterministic.
    /// Read-only: it does not touch the holder it returns.
    pub fn longest_prefix(&self, query: &[i32]) -> Option<Match<K>> {
        let mut cur = ROOT;
        let mut len = 0;
        for &token in query {
            match self.child(cur, token) {
                Some(n) => {
                    cur = n;
                    len += 1;
                }
                None => break,
            }
        }
        if len == 0 {
            return None;
        }
        let (exact, _, key) = self
            .node(cur)
            .through
            .iter()
            .map(|&k| {
                let h = &self.holders[&k];
                (h.steps.len() == len, h.stamp, k)
            })
            .max_by_key(|&(exact, stamp, _)| (exact, stamp))?;
        Some(Match { key, len, exact })
    }

    /// Marks `key` used now (most recently used). Returns whether `key` is held.
    pub fn touch(&mut self, key: K) -> bool {
        let stamp = self.bump();
        let Some(h) = self.holders.get_mut(&key) else {
            return false;
        };
        let old = std::mem::replace(&mut h.stamp, stamp);
        if h.evictable {
            self.lru.remove(&old);
            self.lru.insert(stamp, key);
        }
        true
    }

    /// Marks `key` as an evictable cache entry (`true`, a released branch) or as live
    /// (`false`, taken back into use). Does not change its last use. Returns whether
    /// `key` is held.
    pub fn set_evictable(&mut self, key: K, evictable: bool) -> bool {
        let Some(h) = self.holders.get_mut(&key) else {
            return false;
        };
        if h.evictable == evictable {
            return true;
        }
        h.evictable = evictable;
        if evictable {
            self.lru.insert(h.stamp, key);
        } else {
            self.lru.remove(&h.stamp);
        }
        for &(n, _) in &h.steps {
            let node = &mut self.nodes[n as usize];
            if evictable {
                node.pinned -= 1;
                if node.pinned == 0 {
                    self.cached += 1;
                }
            } else {
                if node.pinned == 0 {
                    self.cached -= 1;
                }
                node.pinned += 1;
            }
        }
        true
    }

    /// Evictable holders, least recently used first: the order to evict cache entries in.
    /// O(evictable holders); [`least_recently_used`](Self::least_recently_used) gives the
    /// first alone in O(log holders).
    pub fn evict_order(&self) -> Vec<K> {
        self.lru.values().copied().collect()
    }

    /// The least recently used evictable holder, the next one to evict; O(log holders).
    pub fn least_recently_used(&self) -> Option<K> {
        self.lru.values().next().copied()
    }

    /// Distinct prefixes over all held sequences (trie nodes): the KV cells the holders
    /// occupy when common prefixes share cells (see the module docs).
    pub fn unique_tokens(&self) -> usize {
        self.unique
    }

    /// Distinct prefixes that only evictable holders have: the KV cells the cache
    /// entries keep on top of what live branches need, i.e. what evicting every entry
    /// would free. This is the figure to hold under a `max_cached_tokens` budget.
    pub fn cached_tokens(&self) -> usize {
        self.cached
    }

    /// Prefixes of `key`'s sequence that no other holder has: the KV cells removing
    /// `key` would free. O(that count); `None` for an unknown key.
    pub fn exclusive_tokens(&self, key: K) -> Option<usize> {
        let h = self.holders.get(&key)?;
        Some(
            h.steps
                .iter()
                .rev()
                .take_while(|&&(n, _)| self.node(n).through.len() == 1)
                .count(),
        )
    }

    /// Panics with a description of the first broken invariant. For tests and debug
    /// assertions; O(nodes + total length of the held sequences).
    pub fn check_invariants(&self) {
        let mut steps_total = 0;
        let mut evictable = 0;
        for (&key, h) in &self.holders {
            assert!(h.stamp <= self.clock, "stamp from the future");
            if h.evictable {
                evictable += 1;
                assert!(
                    self.lru.get(&h.stamp) == Some(&key),
                    "evictable holder missing from the LRU order"
                );
            }
            let mut parent = ROOT;
            for &(n, slot) in &h.steps {
                let node = self.node(n);
                assert_eq!(node.parent, parent, "node {n} not under the previous step");
                assert!(
                    node.through.get(slot as usize) == Some(&key),
                    "node {n} slot {slot} does not list its holder"
                );
                parent = n;
            }
            steps_total += h.steps.len();
        }
        assert_eq!(
            self.lru.len(),
            evictable,
            "LRU order lists non-evictable keys"
        );

        let mut live = 0;
        let mut cached = 0;
        let mut through_total = 0;
        let mut reached = 0;
        let mut stack = vec![ROOT];
        while let Some(n) = stack.pop() {
            let node = self.node(n);
            if n != ROOT {
                reached += 1;
                assert!(!node.through.is_empty(), "reachable node {n} is free");
            }
            assert!(
                node.children.windows(2).all(|w| w[0].0 < w[1].0),
                "children of {n} not sorted by token"
            );
            for &(token, c) in &node.children {
                let child = self.node(c);
                assert_eq!(
                    (child.parent, child.token),
                    (n, token),
                    "child link {n}->{c}"
                );
                stack.push(c);
            }
        }
        for (i, node) in self.nodes.iter().enumerate().skip(1) {
            if node.through.is_empty() {
                assert!(node.children.is_empty(), "free node {i} has children");
                continue;
            }
            live += 1;
            through_total += node.through.len();
            let pinned = node
                .through
                .iter()
                .filter(|k| !self.holders[*k].evictable)
                .count();
            assert_eq!(node.pinned as usize, pinned, "pinned count of node {i}");
            cached += usize::from(pinned == 0);
        }
        assert_eq!(reached, live, "live nodes unreachable from the root");
        assert_eq!(
            through_total, steps_total,
            "node lists and holder steps disagree"
        );
        assert_eq!(self.unique, live, "unique_tokens count");
        assert_eq!(self.cached, cached, "cached_tokens count");
        assert_eq!(
            self.free.len() + live + 1,
            self.nodes.len(),
            "free list size"
        );
    }

    fn node(&self, n: NodeId) -> &TrieNode<K> {
        &self.nodes[n as usize]
    }

    fn holder_mut(&mut self, key: K) -> &mut Holder {
        self.holders
            .get_mut(&key)
            .expect("holder listed in the trie")
    }

    fn bump(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn child(&self, parent: NodeId, token: i32) -> Option<NodeId> {
        let children = &self.node(parent).children;
        children
            .binary_search_by_key(&token, |&(t, _)| t)
            .ok()
            .map(|i| children[i].1)
    }

    /// The child of `parent` for `token`, made (free, unpinned) if missing.
    fn child_or_insert(&mut self, parent: NodeId, token: i32) -> NodeId {
        let children = &self.node(parent).children;
        match children.binary_search_by_key(&token, |&(t, _)| t) {
            Ok(i) => children[i].1,
            Err(i) => {
                let node = TrieNode {
                    token,
                    parent,
                    children: Vec::new(),
                    through: Vec::new(),
                    pinned: 0,
                };
                let id = match self.free.pop() {
                    Some(id) => {
                        self.nodes[id as usize] = node;
                        id
                    }
                    None => {
                        let id = NodeId::try_from(self.nodes.len())
                            .expect("more than u32::MAX trie nodes");
                        self.nodes.push(node);
                        id
                    }
                };
                self.nodes[parent as usize].children.insert(i, (token, id));
                self.unique += 1;
                self.cached += 1;
                id
            }
        }
    }

    /// Lists `key` in node `n`; returns its index there.
    fn attach(&mut self, n: NodeId, key: K, evictable: bool) -> u32 {
        let node = &mut self.nodes[n as usize];
        let slot = u32::try_from(node.through.len()).expect("more than u32::MAX holders");
        node.through.push(key);
        if !evictable {
            if node.pinned == 0 {
                self.cached -= 1;
            }
            node.pinned += 1;
        }
        slot
    }

    /// Unlists the holder at `slot` of node `n` (its step `depth`), freeing the node
    /// when nobody is left. The holder's own steps must be out of `holders` or taken
    /// out of its entry: the holder moved into `slot` is always another one.
    fn detach(&mut self, n: NodeId, depth: usize, slot: u32, evictable: bool) {
        let node = &mut self.nodes[n as usize];
        node.through.swap_remove(slot as usize);
        if let Some(&moved) = node.through.get(slot as usize) {
            self.holders
                .get_mut(&moved)
                .expect("holder listed in a node")
                .steps[depth]
                .1 = slot;
        }
        let node = &mut self.nodes[n as usize];
        if !evictable {
            node.pinned -= 1;
            if node.pinned == 0 {
                self.cached += 1;
            }
        }
        if node.through.is_empty() {
            debug_assert!(node.children.is_empty(), "freed node {n} has children");
            let (parent, token) = (node.parent, node.token);
            node.children = Vec::new();
            node.through = Vec::new();
            let siblings = &mut self.nodes[parent as usize].children;
            let i = siblings
                .binary_search_by_key(&token, |&(t, _)| t)
                .expect("node listed under its parent");
            siblings.remove(i);
            self.free.push(n);
            self.unique -= 1;
            self.cached -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trie(entries: &[(u32, &[i32])]) -> PrefixTrie<u32> {
        let mut t = PrefixTrie::new();
        for &(k, tokens) in entries {
            assert!(!t.insert(k, tokens));
        }
        t.check_invariants();
        t
    }

    fn m(key: u32, len: usize, exact: bool) -> Option<Match<u32>> {
        Some(Match { key, len, exact })
    }

    #[test]
    fn empty_trie_matches_nothing() {
        let t: PrefixTrie<u32> = PrefixTrie::new();
        assert!(t.is_empty());
        assert_eq!(t.longest_prefix(&[1, 2]), None);
        assert_eq!(t.longest_prefix(&[]), None);
        assert_eq!((t.unique_tokens(), t.cached_tokens()), (0, 0));
        assert_eq!(t.least_recently_used(), None);
        t.check_invariants();
    }

    #[test]
    fn insert_and_read_back() {
        let mut t = trie(&[(1, &[5, 6, 7]), (2, &[5, 6, 8, 9])]);
        assert_eq!(t.len(), 2);
        assert!(t.contains(1) && !t.contains(3));
        assert_eq!(t.tokens(2), Some(vec![5, 6, 8, 9]));
        assert_eq!(t.seq_len(1), Some(3));
        assert_eq!(t.tokens(3), None);
        assert_eq!(t.is_evictable(1), Some(false));
        assert_eq!(t.unique_tokens(), 5); // 5, 56, 567, 568, 5689
        let mut keys: Vec<_> = t.keys().collect();
        keys.sort_unstable();
        assert_eq!(keys, [1, 2]);
        // Replacing a key drops its old sequence.
        assert!(t.insert(1, &[9]));
        assert_eq!(t.tokens(1), Some(vec![9]));
        assert_eq!(t.unique_tokens(), 5); // 5, 56, 568, 5689, 9
        t.check_invariants();
    }

    #[test]
    fn empty_sequence_is_a_holder_that_matches_nothing() {
        let mut t = trie(&[(1, &[])]);
        assert!(t.contains(1));
        assert_eq!(t.seq_len(1), Some(0));
        assert_eq!(t.longest_prefix(&[1]), None);
        assert_eq!(t.exclusive_tokens(1), Some(0));
        assert!(t.extend(1, &[4, 4]));
        assert_eq!(t.longest_prefix(&[4, 4, 4]), m(1, 2, true));
        t.check_invariants();
    }

    #[test]
    fn match_inside_a_holder_and_at_the_full_query() {
        let t = trie(&[(1, &[1, 2, 3, 4, 5])]);
        assert_eq!(t.longest_prefix(&[1, 2, 9]), m(1, 2, false));
        assert_eq!(t.longest_prefix(&[1, 2, 3]), m(1, 3, false));
        assert_eq!(t.longest_prefix(&[1, 2, 3, 4, 5]), m(1, 5, true));
        assert_eq!(t.longest_prefix(&[1, 2, 3, 4, 5, 6]), m(1, 5, true));
        assert_eq!(t.longest_prefix(&[2, 1]), None);
        // The caller's "prefill at least one token": ask without the last token.
        let q = [1, 2, 3, 4, 5];
        assert_eq!(t.longest_prefix(&q[..q.len() - 1]), m(1, 4, false));
    }

    #[test]
    fn ties_prefer_an_exact_holder_then_the_most_recent() {
        // 1 and 3 both run past [7, 8]; 2 is exactly [7, 8].
        let mut t = trie(&[(1, &[7, 8, 9]), (2, &[7, 8]), (3, &[7, 8, 1])]);
        assert_eq!(t.longest_prefix(&[7, 8, 5]), m(2, 2, true));
        t.touch(1); // recency does not beat exactness
        assert_eq!(t.longest_prefix(&[7, 8, 5]), m(2, 2, true));
        // Without an exact holder, the most recently used wins.
        t.remove(2);
        assert_eq!(t.longest_prefix(&[7, 8, 5]), m(1, 2, false));
        t.touch(3);
        assert_eq!(t.longest_prefix(&[7, 8, 5]), m(3, 2, false));
        // Two exact holders of the same sequence: the more recent one.
        t.insert(4, &[7]);
        t.insert(5, &[7]);
        assert_eq!(t.longest_prefix(&[7, 0]), m(5, 1, true));
        t.touch(4);
        assert_eq!(t.longest_prefix(&[7, 0]), m(4, 1, true));
        // A longer match beats any tie rule.
        assert_eq!(t.longest_prefix(&[7, 8, 9]), m(1, 3, true));
        t.check_invariants();
    }

    #[test]
    fn holder_that_is_a_prefix_of_another() {
        let mut t = trie(&[(1, &[1, 2]), (2, &[1, 2, 3, 4])]);
        assert_eq!(t.unique_tokens(), 4);
        assert_eq!(t.exclusive_tokens(1), Some(0));
        assert_eq!(t.exclusive_tokens(2), Some(2));
        assert_eq!(t.longest_prefix(&[1, 2]), m(1, 2, true));
        assert_eq!(t.longest_prefix(&[1, 2, 3]), m(2, 3, false));
        // Removing the longer one keeps the shared prefix.
        assert!(t.remove(2));
        assert_eq!(t.unique_tokens(), 2);
        assert_eq!(t.exclusive_tokens(1), Some(2));
        assert_eq!(t.longest_prefix(&[1, 2, 3]), m(1, 2, true));
        t.check_invariants();
        // Removing the prefix holder instead keeps the longer one whole.
        let mut t = trie(&[(1, &[1, 2]), (2, &[1, 2, 3, 4])]);
        assert!(t.remove(1));
        assert_eq!(t.unique_tokens(), 4);
        assert_eq!(t.longest_prefix(&[1, 2]), m(2, 2, false));
        t.check_invariants();
    }

    #[test]
    fn removal_prunes_dead_nodes_and_reuses_them() {
        let mut t = trie(&[(1, &[1, 2, 3]), (2, &[1, 5, 6, 7])]);
        assert_eq!(t.unique_tokens(), 6);
        assert!(t.remove(2));
        assert!(!t.remove(2));
        assert_eq!(t.unique_tokens(), 3);
        assert_eq!(t.longest_prefix(&[1, 5, 6]), m(1, 1, false));
        t.check_invariants();
        let slots = t.nodes.len();
        t.insert(3, &[1, 9, 9]);
        assert_eq!(t.nodes.len(), slots, "freed nodes reused");
        assert!(t.remove(1) && t.remove(3));
        assert_eq!(t.unique_tokens(), 0);
        assert!(t.is_empty());
        t.check_invariants();
    }

    #[test]
    fn extend_and_truncate() {
        let mut t = trie(&[(1, &[1, 2]), (2, &[1, 2, 3])]);
        assert!(t.extend(1, &[3, 4]));
        assert_eq!(t.tokens(1), Some(vec![1, 2, 3, 4]));
        assert_eq!(t.unique_tokens(), 4, "[1, 2, 3] now shared");
        assert_eq!(t.exclusive_tokens(1), Some(1));
        assert_eq!(t.longest_prefix(&[1, 2, 3, 4, 5]), m(1, 4, true));
        assert!(t.truncate(1, 10), "past the end: no change");
        assert_eq!(t.seq_len(1), Some(4));
        assert!(t.truncate(1, 1));
        assert_eq!(t.tokens(1), Some(vec![1]));
        assert_eq!(t.unique_tokens(), 3);
        assert_eq!(t.longest_prefix(&[1, 7]), m(1, 1, true));
        assert!(t.truncate(2, 0));
        assert_eq!(t.tokens(2), Some(vec![]));
        assert_eq!(t.unique_tokens(), 1);
        assert!(!t.extend(9, &[1]) && !t.truncate(9, 0));
        t.check_invariants();
    }

    #[test]
    fn evict_order_is_lru_among_evictable() {
        let mut t = trie(&[(1, &[1]), (2, &[2]), (3, &[3]), (4, &[4])]);
        assert_eq!(t.evict_order().len(), 0, "live by default");
        for k in [4, 1, 3] {
            assert!(t.set_evictable(k, true));
        }
        // Insertion order is the use order until touched; setting the flag is no use.
        assert_eq!(t.evict_order(), [1, 3, 4]);
        t.touch(1);
        t.touch(2); // live: not listed
        assert_eq!(t.evict_order(), [3, 4, 1]);
        assert_eq!(t.evict_order().last(), Some(&1));
        assert_eq!(t.least_recently_used(), Some(3));
        assert!(t.set_evictable(3, false)); // taken back into use
        assert_eq!(t.least_recently_used(), Some(4));
        assert!(t.remove(4));
        assert_eq!(t.evict_order(), [1]);
        assert!(!t.touch(9) && !t.set_evictable(9, true));
        // Extending or truncating is no use either.
        t.set_evictable(2, true);
        t.extend(1, &[5]);
        t.truncate(1, 1);
        assert_eq!(t.evict_order(), [1, 2]);
        // Re-inserting makes a fresh live holder.
        t.insert(1, &[6]);
        assert_eq!(t.is_evictable(1), Some(false));
        assert_eq!(t.evict_order(), [2]);
        t.check_invariants();
    }

    #[test]
    fn cached_tokens_count_cells_only_entries_hold() {
        // A live branch and a released entry sharing a 3-token prompt.
        let mut t = trie(&[(1, &[1, 2, 3, 4, 5]), (2, &[1, 2, 3, 9])]);
        assert_eq!(t.cached_tokens(), 0);
        t.set_evictable(1, true);
        assert_eq!(t.cached_tokens(), 2, "[.., 4] and [.., 4, 5]");
        assert_eq!(t.exclusive_tokens(1), Some(2));
        t.set_evictable(2, true);
        assert_eq!(t.cached_tokens(), t.unique_tokens());
        assert_eq!(t.cached_tokens(), 6);
        // The live branch grows: its new cells are not cached ones.
        t.set_evictable(2, false);
        t.extend(2, &[8, 8]);
        assert_eq!((t.unique_tokens(), t.cached_tokens()), (8, 2));
        // An evictable holder that grows adds cached cells.
        t.extend(1, &[6]);
        assert_eq!(t.cached_tokens(), 3);
        t.truncate(1, 3);
        assert_eq!((t.unique_tokens(), t.cached_tokens()), (6, 0));
        t.remove(2);
        assert_eq!((t.unique_tokens(), t.cached_tokens()), (3, 3));
        t.remove(1);
        assert_eq!((t.unique_tokens(), t.cached_tokens()), (0, 0));
        t.check_invariants();
    }

    #[test]
    fn many_holders_through_one_node_survive_swap_removal() {
        let mut t = PrefixTrie::new();
        for k in 0..50u32 {
            let k_tok = i32::try_from(k).unwrap();
            t.insert(k, &[1, 2, 3, k_tok % 7, k_tok]);
        }
        t.check_invariants();
        for k in (0..50u32).step_by(3) {
            assert!(t.remove(k));
            t.check_invariants();
        }
        for k in (1..50u32).step_by(3) {
            assert!(t.truncate(k, 2));
        }
        t.check_invariants();
        assert_eq!(t.longest_prefix(&[1, 2, 3, 2, 2]), m(2, 5, true));
        assert_eq!(t.longest_prefix(&[1, 2, 9]).map(|m| m.len), Some(2));
    }
}
