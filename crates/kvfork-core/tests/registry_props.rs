//! Model-based tests: random operation sequences run against both the
//! `Registry` and a deliberately naive model, compared after every step.

use std::collections::{BTreeSet, HashMap, HashSet};

use kvfork_core::{Handle, Pruned, Registry, TenancyError};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    CreateRoot,
    /// Targets pick a live (or, for `Stale`, dead) handle by index modulo count.
    Fork(usize, u32),
    Prune(usize),
    PruneSubtree(usize),
    RetainOnly(usize),
    Stale(usize, u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => Just(Op::CreateRoot),
        6 => (any::<usize>(), 0u32..1000).prop_map(|(s, h)| Op::Fork(s, h)),
        3 => any::<usize>().prop_map(Op::Prune),
        1 => any::<usize>().prop_map(Op::PruneSubtree),
        1 => any::<usize>().prop_map(Op::RetainOnly),
        1 => (any::<usize>(), 0u8..6).prop_map(|(s, k)| Op::Stale(s, k)),
    ]
}

struct MNode {
    parent: Option<Handle>,
    children: Vec<Handle>,
    seq: u32,
    fork_head: u32,
    id: u64,
}

/// The obvious implementation: a map of nodes and a set of used sequence ids.
struct Model {
    n_seq_max: u32,
    nodes: HashMap<Handle, MNode>,
    /// Live handles in creation order, so target selection is deterministic.
    live: Vec<Handle>,
    dead: Vec<Handle>,
    used: BTreeSet<u32>,
    next_id: u64,
}

impl Model {
    fn new(n_seq_max: u32) -> Self {
        Model {
            n_seq_max,
            nodes: HashMap::new(),
            live: Vec::new(),
            dead: Vec::new(),
            used: BTreeSet::new(),
            next_id: 0,
        }
    }

    fn lowest_free(&self) -> Option<u32> {
        (0..self.n_seq_max).find(|s| !self.used.contains(s))
    }

    fn pick_live(&self, sel: usize) -> Option<Handle> {
        (!self.live.is_empty()).then(|| self.live[sel % self.live.len()])
    }

    fn add(&mut self, h: Handle, parent: Option<Handle>, seq: u32, fork_head: u32, id: u64) {
        assert!(
            !self.nodes.contains_key(&h),
            "handle {h} reissued while live"
        );
        assert!(!self.dead.contains(&h), "handle {h} reissued after removal");
        self.nodes.insert(
            h,
            MNode {
                parent,
                children: Vec::new(),
                seq,
                fork_head,
                id,
            },
        );
        if let Some(p) = parent {
            self.nodes.get_mut(&p).unwrap().children.push(h);
        }
        self.live.push(h);
        self.used.insert(seq);
    }

    fn remove(&mut self, h: Handle) -> MNode {
        let node = self.nodes.remove(&h).unwrap();
        if let Some(p) = node.parent.and_then(|p| self.nodes.get_mut(&p)) {
            p.children.retain(|&c| c != h);
        }
        self.live.retain(|&l| l != h);
        self.dead.push(h);
        self.used.remove(&node.seq);
        node
    }

    fn post_order(&self, h: Handle, out: &mut Vec<Handle>) {
        for &c in &self.nodes[&h].children {
            self.post_order(c, out);
        }
        out.push(h);
    }

    fn fresh_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id - 1
    }
}

fn expect_pruned(model: &mut Model, got: &Pruned<u64>, h: Handle) {
    assert_eq!(got.handle, h);
    let node = model.remove(h);
    assert_eq!((got.seq, got.data), (node.seq, node.id), "pruned {h}");
}

fn step(reg: &mut Registry<u64>, model: &mut Model, op: &Op) {
    let full = model.used.len() as u32 == model.n_seq_max;
    let exhausted = TenancyError::LeaseExhausted {
        n_seq_max: model.n_seq_max,
    };
    match *op {
        Op::CreateRoot => {
            let id = model.fresh_id();
            match reg.create_root(id) {
                Ok((h, seq)) => {
                    assert_eq!(Some(seq), model.lowest_free(), "lowest free seq first");
                    model.add(h, None, seq, 0, id);
                }
                Err(e) => {
                    assert!(full, "create_root refused with room: {e}");
                    assert_eq!(e, exhausted);
                }
            }
        }
        Op::Fork(sel, fork_head) => {
            let Some(p) = model.pick_live(sel) else {
                return;
            };
            let id = model.fresh_id();
            match reg.fork(p, fork_head, id) {
                Ok((h, seq)) => {
                    assert_eq!(Some(seq), model.lowest_free(), "lowest free seq first");
                    model.add(h, Some(p), seq, fork_head, id);
                }
                Err(e) => {
                    assert!(full, "fork refused with room: {e}");
                    assert_eq!(e, exhausted);
                }
            }
        }
        Op::Prune(sel) => {
            let Some(h) = model.pick_live(sel) else {
                return;
            };
            let children = model.nodes[&h].children.len();
            match reg.prune(h) {
                Ok(p) => {
                    assert_eq!(children, 0, "pruned a node with children");
                    expect_pruned(model, &p, h);
                }
                Err(e) => assert_eq!(
                    e,
                    TenancyError::HasChildren {
                        handle: h,
                        children
                    }
                ),
            }
        }
        Op::PruneSubtree(sel) => {
            let Some(h) = model.pick_live(sel) else {
                return;
            };
            let mut order = Vec::new();
            model.post_order(h, &mut order);
            let got = reg.prune_subtree(h).expect("live handle");
            let got_handles: Vec<Handle> = got.iter().map(|p| p.handle).collect();
            assert_eq!(got_handles, order, "post-order, siblings in creation order");
            for (p, &h) in got.iter().zip(&order) {
                expect_pruned(model, p, h);
            }
        }
        Op::RetainOnly(sel) => {
            let Some(w) = model.pick_live(sel) else {
                return;
            };
            let got = reg.retain_only(w).expect("live handle");
            let got_set: HashSet<Handle> = got.iter().map(|p| p.handle).collect();
            let want: HashSet<Handle> = model.live.iter().copied().filter(|&h| h != w).collect();
            assert_eq!(got.len(), got_set.len(), "duplicates in retain_only result");
            assert_eq!(got_set, want);
            for (p, n) in got.iter().map(|p| (p, &model.nodes[&p.handle])) {
                assert_eq!((p.seq, p.data), (n.seq, n.id));
            }
            for p in &got {
                model.nodes.remove(&p.handle);
                model.dead.push(p.handle);
            }
            model.live = vec![w];
            let node = model.nodes.get_mut(&w).unwrap();
            node.parent = None;
            node.children.clear();
            model.used = BTreeSet::from([node.seq]);
        }
        Op::Stale(sel, kind) => {
            if model.dead.is_empty() {
                return;
            }
            let h = model.dead[sel % model.dead.len()];
            let stale: Result<(), _> = Err(TenancyError::StaleHandle(h));
            match kind {
                0 => assert_eq!(reg.fork(h, 0, u64::MAX).map(|_| ()), stale),
                1 => assert_eq!(reg.prune(h).map(|_| ()), stale),
                2 => assert_eq!(reg.prune_subtree(h).map(|_| ()), stale),
                3 => assert_eq!(reg.retain_only(h).map(|_| ()), stale),
                4 => assert!(reg.get(h).is_none() && reg.get_mut(h).is_none()),
                _ => assert!(
                    !reg.contains(h) && reg.parent(h).is_none() && reg.children(h).is_none()
                ),
            }
        }
    }
}

fn compare(reg: &Registry<u64>, model: &Model) {
    reg.check_invariants();
    assert_eq!(reg.len(), model.live.len());
    assert_eq!(reg.available(), model.n_seq_max - reg.len() as u32);
    for (&h, m) in &model.nodes {
        let n = reg
            .get(h)
            .unwrap_or_else(|| panic!("model node {h} missing"));
        assert_eq!(n.seq, m.seq);
        assert_eq!(n.parent, m.parent);
        assert_eq!(n.children, m.children);
        assert_eq!(n.fork_head, m.fork_head);
        assert_eq!(n.data, m.id);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn registry_matches_model(
        n_seq_max in 1u32..=16,
        ops in prop::collection::vec(op(), 0..200),
    ) {
        let mut reg = Registry::new(n_seq_max);
        let mut model = Model::new(n_seq_max);
        for op in &ops {
            step(&mut reg, &mut model, op);
            compare(&reg, &model);
        }
    }
}

#[test]
fn thousand_cycles_leave_nothing_behind() {
    let n = 8;
    let mut reg = Registry::new(n);
    for cycle in 0..1000u32 {
        let (root, _) = reg.create_root(cycle).unwrap();
        let (a, _) = reg.fork(root, 1, cycle).unwrap();
        let mut tip = a;
        while reg.available() > 0 {
            tip = reg.fork(tip, 2, cycle).unwrap().0;
        }
        assert_eq!(reg.len(), n as usize);
        match cycle % 3 {
            0 => {
                reg.prune_subtree(root).unwrap();
            }
            1 => {
                // Restrict prune, leaves first.
                loop {
                    let leaf = reg.iter().find(|(_, n)| n.children.is_empty());
                    let Some((leaf, _)) = leaf else { break };
                    reg.prune(leaf).unwrap();
                }
            }
            _ => {
                let winner = reg.retain_only(tip).unwrap();
                assert_eq!(winner.len(), n as usize - 1);
                reg.prune(tip).unwrap();
            }
        }
        reg.check_invariants();
    }
    assert_eq!(reg.len(), 0);
    assert_eq!(reg.available(), n);
}
