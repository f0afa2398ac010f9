//! Bookkeeping of parked branches: more branches than KV sequences (`park=True` contexts).
//!
//! A branch's KV is the cells of positions `[0, position)` tagged with its sequence. In a
//! unified cache a fork only tags its parent's cells, so a child shares `[0, head)` with its
//! parent (`head` = the fork position). The ledger keeps that *KV tree* (parent, `head`) apart
//! from the branch registry, because it changes differently: a `prune_keep_children` hands the
//! children to the grandparent with `head = min(child head, removed head)`, and a branch that
//! rewrites its cells from the start (`reseed_context`) shares nothing any more (`sever`).
//!
//! A branch is either *active* (it holds one of `n_leases` sequence ids) or *parked*. A parked
//! branch's KV is
//! - an *anchor*: an active ancestor and a length `k` whose cells `[0, k)` it shares, and
//! - *segments*: host copies of its other cells (`[k, end)`), lowest positions first.
//!
//! Invariant: an anchor is always active. Before an anchor's cells go away (it is parked,
//! pruned with `keep_children`, or reseeded), each of its dependents is re-anchored on the
//! nearest other active ancestor, and the cells between the two anchors are copied to the
//! host first (a new front segment); [`ParkLedger::dependents`] lists them.
//!
//! What an engine does with the ledger (the KV operations are the engine's):
//! - park `v` (`anchor_for(v, None)` gives `(a, k)`): drop `v`'s tags below `k`, copy the
//!   rest of its sequence to the host, empty the sequence, [`ParkLedger::park`];
//! - unpark `p` on the lease [`ParkLedger::unpark`] gives: load each segment (through a
//!   scratch sequence but the first), tag the anchor's cells `[0, k)` with the lease, cut at
//!   `end`;
//! - when no lease is free, evict [`ParkLedger::victim`]: the least recently used active
//!   branch outside the set the operation needs.
//!
//! Pure bookkeeping: no KV, no FFI. The engine keeps it under one lock with the registry.

use std::collections::{HashMap, HashSet};

use crate::{Handle, LeaseAllocator, TenancyError};

/// Host copy of a parked branch's cells at positions `[lo, hi)`, in llama.cpp's per-sequence
/// state format.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// First position held.
    pub lo: u32,
    /// One past the last position held.
    pub hi: u32,
    /// The bytes llama.cpp wrote for a sequence holding exactly these cells.
    pub data: Vec<u8>,
}

/// Where a parked branch's KV is: an active ancestor's prefix plus host segments.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Parked {
    /// `(active ancestor, k)`: its cells `[0, k)` are this branch's too.
    pub anchor: Option<(Handle, u32)>,
    /// Host copies of the rest, lowest positions first.
    pub segments: Vec<Segment>,
    /// Cells at or after this position are not the branch's (a rolled-back decode).
    pub end: Option<u32>,
    /// A recurrent model's state after the branch's last token (its own: the anchor's moves
    /// on with the anchor, and copying the anchor's cells brings the anchor's state along).
    pub state: Option<Vec<u8>>,
}

impl Parked {
    /// Bytes held in host memory.
    pub fn bytes(&self) -> usize {
        let state = self.state.as_ref().map_or(0, Vec::len);
        self.segments.iter().map(|s| s.data.len()).sum::<usize>() + state
    }
}

/// Where a branch's KV is now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Place {
    /// On this sequence id.
    Active(u32),
    /// In host memory (and its anchor's cells).
    Parked(Parked),
}

#[derive(Clone, Debug)]
struct Entry {
    parent: Option<Handle>,
    head: u32,
    place: Place,
    last_used: u64,
}

/// Leases, the KV tree and the parked branches of one context.
#[derive(Clone, Debug)]
pub struct ParkLedger {
    leases: LeaseAllocator,
    entries: HashMap<Handle, Entry>,
    clock: u64,
}

impl ParkLedger {
    /// No branch yet; sequence ids `0..n_leases` free.
    pub fn new(n_leases: u32) -> Self {
        ParkLedger {
            leases: LeaseAllocator::new(n_leases),
            entries: HashMap::new(),
            clock: 0,
        }
    }

    /// Leases free now.
    pub fn available(&self) -> u32 {
        self.leases.available()
    }

    /// Number of sequence ids.
    pub fn n_leases(&self) -> u32 {
        self.leases.n_seq_max()
    }

    /// Whether `h` is known.
    pub fn contains(&self, h: Handle) -> bool {
        self.entries.contains_key(&h)
    }

    /// The sequence `h` holds, `None` when parked or unknown.
    pub fn seq(&self, h: Handle) -> Option<u32> {
        match self.entries.get(&h)?.place {
            Place::Active(s) => Some(s),
            Place::Parked(_) => None,
        }
    }

    /// The parked record of `h`, `None` when active or unknown.
    pub fn parked(&self, h: Handle) -> Option<&Parked> {
        match &self.entries.get(&h)?.place {
            Place::Parked(p) => Some(p),
            Place::Active(_) => None,
        }
    }

    fn parked_mut(&mut self, h: Handle) -> Option<&mut Parked> {
        match &mut self.entries.get_mut(&h)?.place {
            Place::Parked(p) => Some(p),
            Place::Active(_) => None,
        }
    }

    /// (parked branches, bytes they hold in host memory).
    pub fn parked_totals(&self) -> (usize, usize) {
        self.entries
            .values()
            .filter_map(|e| match &e.place {
                Place::Parked(p) => Some(p.bytes()),
                Place::Active(_) => None,
            })
            .fold((0, 0), |(n, b), bytes| (n + 1, b + bytes))
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn insert(&mut self, h: Handle, parent: Option<Handle>, head: u32) -> Option<u32> {
        let place = match self.leases.acquire() {
            Ok(seq) => Place::Active(seq),
            Err(_) => Place::Parked(Parked::default()),
        };
        let last_used = self.tick();
        self.entries.insert(
            h,
            Entry {
                parent,
                head,
                place,
                last_used,
            },
        );
        let seq = self.seq(h);
        if seq.is_none() {
            let anchor = self.anchor_for(h, None);
            self.parked_mut(h).expect("just parked").anchor = anchor;
        }
        seq
    }

    /// A new root: on a free lease (its id returned), or parked with no cells.
    pub fn add_root(&mut self, h: Handle) -> Option<u32> {
        self.insert(h, None, 0)
    }

    /// A new child of `parent` sharing its cells `[0, head)`: on a free lease (its id
    /// returned), or parked and anchored on its nearest active ancestor.
    pub fn add_child(&mut self, h: Handle, parent: Handle, head: u32) -> Option<u32> {
        self.insert(h, Some(parent), head)
    }

    /// The nearest active ancestor of `h` other than `skip`, and how many of `h`'s first
    /// cells it shares (the least `head` on the way); `None` when none shares any.
    pub fn anchor_for(&self, h: Handle, skip: Option<Handle>) -> Option<(Handle, u32)> {
        let mut k = u32::MAX;
        let mut at = h;
        loop {
            let e = self.entries.get(&at)?;
            let parent = e.parent?;
            k = k.min(e.head);
            if k == 0 {
                return None;
            }
            at = parent;
            if Some(at) != skip && self.seq(at).is_some() {
                return Some((at, k));
            }
        }
    }

    /// Mark `h` as just used (eviction takes the least recently used first).
    pub fn touch(&mut self, h: Handle) {
        let t = self.tick();
        if let Some(e) = self.entries.get_mut(&h) {
            e.last_used = t;
        }
    }

    /// The least recently used active branch not in `busy`.
    pub fn victim(&self, busy: &HashSet<Handle>) -> Option<Handle> {
        self.entries
            .iter()
            .filter(|(h, e)| matches!(e.place, Place::Active(_)) && !busy.contains(h))
            .min_by_key(|(_, e)| e.last_used)
            .map(|(&h, _)| h)
    }

    /// Parked branches anchored on `h`.
    pub fn dependents(&self, h: Handle) -> Vec<Handle> {
        let mut out: Vec<Handle> = self
            .entries
            .iter()
            .filter(|(_, e)| {
                matches!(&e.place, Place::Parked(p) if p.anchor.is_some_and(|(a, _)| a == h))
            })
            .map(|(&d, _)| d)
            .collect();
        out.sort_by_key(|d| (d.index(), d.generation()));
        out
    }

    /// Move dependent `d` off its anchor onto `anchor`, with `front` (the cells between the
    /// two anchors, copied by the caller) as its new first segment.
    pub fn reanchor(&mut self, d: Handle, anchor: Option<(Handle, u32)>, front: Option<Segment>) {
        if let Some(p) = self.parked_mut(d) {
            p.anchor = anchor;
            if let Some(s) = front {
                p.segments.insert(0, s);
            }
        }
    }

    /// Keep `state` as parked `h`'s own recurrent state (a fork born parked: its parent's
    /// state now, which the parent leaves behind as it goes on).
    pub fn keep_state(&mut self, h: Handle, state: Vec<u8>) {
        if let Some(p) = self.parked_mut(h) {
            p.state = Some(state);
        }
    }

    /// `h` (active) is parked as `record`; its lease is free again and returned.
    pub fn park(&mut self, h: Handle, record: Parked) -> Result<u32, TenancyError> {
        let e = self
            .entries
            .get_mut(&h)
            .ok_or(TenancyError::StaleHandle(h))?;
        let Place::Active(seq) = e.place else {
            return Err(TenancyError::StaleHandle(h));
        };
        // The lease first: a failed release leaves the entry active, as it was.
        self.leases.release(seq)?;
        e.place = Place::Parked(record);
        Ok(seq)
    }

    /// `h` (parked) takes a free lease; its record is handed back for the caller to load.
    /// `None` when no lease is free or `h` is not parked.
    pub fn unpark(&mut self, h: Handle) -> Option<(u32, Parked)> {
        self.parked(h)?;
        let seq = self.leases.acquire().ok()?;
        let t = self.tick();
        let e = self.entries.get_mut(&h).expect("parked above");
        e.last_used = t;
        match std::mem::replace(&mut e.place, Place::Active(seq)) {
            Place::Parked(p) => Some((seq, p)),
            Place::Active(_) => unreachable!("checked parked above"),
        }
    }

    /// Cut `h`'s KV at `pos` (a rolled-back decode): cells from `pos` on are not its own. Only
    /// parked branches need this; an active one's sequence is cut by the caller.
    pub fn truncate(&mut self, h: Handle, pos: u32) {
        if let Some(p) = self.parked_mut(h) {
            p.end = Some(p.end.map_or(pos, |e| e.min(pos)));
        }
    }

    /// Forget `h` (pruned); its lease, if any, is free again and returned. Its children move
    /// to its parent sharing `min(their head, its head)` (`prune_keep_children`; a childless
    /// branch has none to move).
    pub fn remove(&mut self, h: Handle) -> Option<u32> {
        let e = self.entries.remove(&h)?;
        self.reparent_children(h, e.parent, e.head);
        match e.place {
            Place::Active(seq) => {
                let _ = self.leases.release(seq);
                Some(seq)
            }
            Place::Parked(_) => None,
        }
    }

    /// `h` rewrote its cells from position 0 (`reseed_context`): it becomes a root of the KV
    /// tree sharing nothing, and its children, whose cells are the old ones, move to its
    /// parent as in [`ParkLedger::remove`] (so anchors reached through `h` stay right). `h`
    /// must be active and its own dependents re-anchored first.
    pub fn sever(&mut self, h: Handle) {
        let Some(e) = self.entries.get(&h) else {
            return;
        };
        let (parent, head) = (e.parent, e.head);
        self.reparent_children(h, parent, head);
        let e = self.entries.get_mut(&h).expect("checked above");
        e.parent = None;
        e.head = 0;
    }

    /// The children of `of` move to `parent`, sharing `min(their head, head)` of its cells
    /// (nothing when `parent` is none: they become roots).
    fn reparent_children(&mut self, of: Handle, parent: Option<Handle>, head: u32) {
        for c in self.entries.values_mut().filter(|c| c.parent == Some(of)) {
            c.parent = parent;
            c.head = if parent.is_some() {
                c.head.min(head)
            } else {
                0
            };
        }
    }

    /// Only `h` stays (active, a root); every other branch is forgotten, every other lease
    /// free. `h` must be active.
    pub fn retain_only(&mut self, h: Handle) -> Result<(), TenancyError> {
        let seq = self.seq(h).ok_or(TenancyError::StaleHandle(h))?;
        let mut e = self.entries.remove(&h).expect("active above");
        e.parent = None;
        e.head = 0;
        self.entries.clear();
        self.entries.insert(h, e);
        self.leases.retain_only(seq);
        Ok(())
    }

    /// Panics with the first broken invariant (tests).
    pub fn check_invariants(&self) {
        let mut seqs = HashSet::new();
        for (h, e) in &self.entries {
            if let Some(p) = e.parent {
                assert!(self.entries.contains_key(&p), "{h}: dead parent {p}");
            }
            match &e.place {
                Place::Active(s) => {
                    assert!(self.leases.is_leased(*s), "{h}: seq {s} not leased");
                    assert!(seqs.insert(*s), "seq {s} held twice");
                }
                Place::Parked(p) => {
                    if let Some((a, k)) = p.anchor {
                        assert!(self.seq(a).is_some(), "{h}: anchor {a} not active");
                        assert!(k > 0, "{h}: empty anchor");
                        let mut at = *h;
                        let mut shared = u32::MAX;
                        while at != a {
                            let n = &self.entries[&at];
                            shared = shared.min(n.head);
                            at = n
                                .parent
                                .unwrap_or_else(|| panic!("{h}: anchor {a} not an ancestor"));
                        }
                        assert!(k <= shared, "{h}: anchor shares {shared} < {k}");
                    }
                    for w in p.segments.windows(2) {
                        assert!(w[0].hi <= w[1].lo, "{h}: segments overlap");
                    }
                }
            }
        }
        assert_eq!(
            seqs.len() as u32 + self.leases.available(),
            self.leases.n_seq_max(),
            "leases leaked"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Arena;
    use proptest::prelude::*;

    fn handles(n: usize) -> Vec<Handle> {
        let mut arena = Arena::new();
        (0..n).map(|i| arena.insert(i)).collect()
    }

    fn seg(lo: u32, hi: u32) -> Segment {
        Segment {
            lo,
            hi,
            data: vec![0; (hi - lo) as usize],
        }
    }

    #[test]
    fn a_child_without_a_lease_is_parked_on_its_parent() {
        let h = handles(3);
        let mut l = ParkLedger::new(1);
        assert_eq!(l.add_root(h[0]), Some(0));
        assert_eq!(l.add_child(h[1], h[0], 10), None);
        assert_eq!(l.parked(h[1]).unwrap().anchor, Some((h[0], 10)));
        assert_eq!(l.dependents(h[0]), vec![h[1]]);
        // A grandchild forked at 15 from the parked child shares only 10 with the root.
        assert_eq!(l.add_child(h[2], h[1], 15), None);
        assert_eq!(l.parked(h[2]).unwrap().anchor, Some((h[0], 10)));
        l.check_invariants();
    }

    #[test]
    fn a_root_without_a_lease_is_parked_empty() {
        let h = handles(2);
        let mut l = ParkLedger::new(1);
        l.add_root(h[0]);
        assert_eq!(l.add_root(h[1]), None);
        assert_eq!(l.parked(h[1]), Some(&Parked::default()));
        assert_eq!(l.parked_totals(), (1, 0));
    }

    #[test]
    fn victims_are_least_recently_used_and_never_busy() {
        let h = handles(3);
        let mut l = ParkLedger::new(3);
        for &x in &h {
            l.add_root(x);
        }
        l.touch(h[0]);
        assert_eq!(l.victim(&HashSet::new()), Some(h[1]));
        assert_eq!(l.victim(&HashSet::from([h[1]])), Some(h[2]));
        assert_eq!(l.victim(&HashSet::from(h.clone().map_into())), None);
    }

    trait MapInto {
        fn map_into(self) -> [Handle; 3];
    }
    impl MapInto for Vec<Handle> {
        fn map_into(self) -> [Handle; 3] {
            [self[0], self[1], self[2]]
        }
    }

    #[test]
    fn park_and_unpark_move_the_lease() {
        let h = handles(2);
        let mut l = ParkLedger::new(1);
        l.add_root(h[0]);
        l.add_root(h[1]);
        let rec = Parked {
            segments: vec![seg(0, 4)],
            ..Parked::default()
        };
        assert_eq!(l.park(h[0], rec.clone()), Ok(0));
        assert_eq!(l.parked_totals(), (2, 4));
        assert_eq!(l.unpark(h[1]), Some((0, Parked::default())));
        assert_eq!(l.unpark(h[0]), None, "no lease free");
        l.truncate(h[0], 3);
        assert_eq!(l.parked(h[0]).unwrap().end, Some(3));
        l.check_invariants();
    }

    #[test]
    fn reanchoring_moves_to_the_next_active_ancestor() {
        let h = handles(3);
        let mut l = ParkLedger::new(2);
        l.add_root(h[0]);
        l.add_child(h[1], h[0], 8);
        l.add_child(h[2], h[1], 20);
        assert_eq!(l.parked(h[2]).unwrap().anchor, Some((h[1], 20)));
        // h1 is about to be parked: h2 moves to the root, sharing 8, with [8, 20) copied.
        assert_eq!(l.anchor_for(h[2], Some(h[1])), Some((h[0], 8)));
        l.reanchor(h[2], Some((h[0], 8)), Some(seg(8, 20)));
        l.park(h[1], Parked::default()).unwrap();
        assert_eq!(l.parked(h[2]).unwrap().segments[0].lo, 8);
        assert!(l.dependents(h[1]).is_empty());
        l.check_invariants();
    }

    #[test]
    fn keep_children_shares_the_smaller_head_and_sever_shares_nothing() {
        let h = handles(3);
        let mut l = ParkLedger::new(1);
        l.add_root(h[0]);
        l.add_child(h[1], h[0], 5);
        l.add_child(h[2], h[1], 9);
        l.remove(h[1]);
        assert_eq!(l.anchor_for(h[2], None), Some((h[0], 5)));
        l.sever(h[0]);
        assert_eq!(l.anchor_for(h[2], None), None);
        // A middle branch reseeded: its child still shares the root's first cells.
        let g = handles(6);
        let mut l = ParkLedger::new(1);
        l.add_root(g[3]);
        l.add_child(g[4], g[3], 7);
        l.add_child(g[5], g[4], 12);
        l.sever(g[4]);
        assert_eq!(l.anchor_for(g[5], None), Some((g[3], 7)));
        assert_eq!(l.anchor_for(g[4], None), None);
    }

    #[test]
    fn retain_only_keeps_one_root() {
        let h = handles(3);
        let mut l = ParkLedger::new(2);
        l.add_root(h[0]);
        l.add_child(h[1], h[0], 3);
        l.add_child(h[2], h[0], 3);
        l.retain_only(h[1]).unwrap();
        assert_eq!(l.available(), 1);
        assert!(!l.contains(h[0]) && !l.contains(h[2]));
        assert_eq!(l.anchor_for(h[1], None), None);
        l.check_invariants();
    }

    #[derive(Clone, Debug)]
    enum Op {
        Root,
        Child(usize, u32),
        Park(usize),
        Unpark(usize),
        Remove(usize),
        Sever(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            Just(Op::Root),
            (any::<usize>(), 0u32..40).prop_map(|(p, h)| Op::Child(p, h)),
            any::<usize>().prop_map(Op::Park),
            any::<usize>().prop_map(Op::Unpark),
            any::<usize>().prop_map(Op::Remove),
            any::<usize>().prop_map(Op::Sever),
        ]
    }

    proptest! {
        /// Driving the ledger as an engine does (dependents re-anchored before their anchor
        /// parks or leaves, evicting when no lease is free) keeps every invariant: anchors
        /// active ancestors sharing what they claim, no lease leaked or held twice.
        #[test]
        fn engine_protocol_keeps_invariants(ops in proptest::collection::vec(op(), 1..80), n in 1u32..4) {
            let mut arena = Arena::new();
            let mut live: Vec<Handle> = Vec::new();
            let mut l = ParkLedger::new(n);
            for op in ops {
                let pick = |i: usize| live[i % live.len()];
                match op {
                    Op::Root => {
                        let h = arena.insert(());
                        l.add_root(h);
                        live.push(h);
                    }
                    Op::Child(p, head) if !live.is_empty() => {
                        let h = arena.insert(());
                        l.add_child(h, pick(p), head);
                        live.push(h);
                    }
                    Op::Park(i) if !live.is_empty() => {
                        let v = pick(i);
                        if l.seq(v).is_some() {
                            for d in l.dependents(v) {
                                let k = l.parked(d).unwrap().anchor.unwrap().1;
                                let next = l.anchor_for(d, Some(v)).map(|(a, k2)| (a, k2.min(k)));
                                let lo = next.map_or(0, |(_, k2)| k2);
                                l.reanchor(d, next, (lo < k).then(|| seg(lo, k)));
                            }
                            let anchor = l.anchor_for(v, None);
                            let lo = anchor.map_or(0, |(_, k)| k);
                            l.park(v, Parked { anchor, segments: vec![seg(lo, lo + 1)], ..Parked::default() }).unwrap();
                        }
                    }
                    Op::Unpark(i) if !live.is_empty() => {
                        let p = pick(i);
                        if l.parked(p).is_some() {
                            if l.available() == 0 {
                                let busy = HashSet::from([p]);
                                let v = l.victim(&busy).expect("some lease is held");
                                for d in l.dependents(v) {
                                    let k = l.parked(d).unwrap().anchor.unwrap().1;
                                    let next = l.anchor_for(d, Some(v)).map(|(a, k2)| (a, k2.min(k)));
                                    l.reanchor(d, next, None);
                                }
                                let anchor = l.anchor_for(v, None);
                                l.park(v, Parked { anchor, ..Parked::default() }).unwrap();
                            }
                            prop_assert!(l.unpark(p).is_some());
                        }
                    }
                    Op::Remove(i) if !live.is_empty() => {
                        let v = pick(i);
                        for d in l.dependents(v) {
                            let next = l.anchor_for(d, Some(v));
                            l.reanchor(d, next, None);
                        }
                        l.remove(v);
                        live.retain(|&x| x != v);
                    }
                    // The engine reseeds an active branch only.
                    Op::Sever(i) if !live.is_empty() && l.seq(pick(i)).is_some() => {
                        let v = pick(i);
                        for d in l.dependents(v) {
                            l.reanchor(d, None, None);
                        }
                        l.sever(v);
                    }
                    _ => {}
                }
                l.check_invariants();
            }
        }
    }
}
