//! The branch tree: which branches exist, who forked from whom, and which KV
//! sequence each one holds. Structural edits keep leases and links in step.

use std::collections::HashSet;

use crate::{Arena, Handle, LeaseAllocator, TenancyError};

/// One branch. Fields are public for reading; change `seq`, `parent` or
/// `children` only through [`Registry`] methods or the invariants break.
#[derive(Clone, Debug)]
pub struct Node<T> {
    /// KV sequence id leased to this branch.
    pub seq: u32,
    /// Branch this one was forked from; `None` for a root.
    pub parent: Option<Handle>,
    /// Live forks of this branch, in creation order.
    pub children: Vec<Handle>,
    /// Number of the parent's tokens shared at fork time (0 for roots).
    pub fork_head: u32,
    /// What the caller keeps per branch.
    pub data: T,
}

/// What a prune gives back, so the caller can clear `seq` from the KV cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pruned<T> {
    /// The pruned branch (stale from now on).
    pub handle: Handle,
    /// The sequence id it held, now free again.
    pub seq: u32,
    /// Its data, handed back.
    pub data: T,
}

/// Branch tree plus the lease pool it draws sequence ids from.
pub struct Registry<T> {
    nodes: Arena<Node<T>>,
    leases: LeaseAllocator,
}

impl<T> Registry<T> {
    /// An empty tree over sequence ids `0..n_seq_max`.
    pub fn new(n_seq_max: u32) -> Self {
        Registry {
            nodes: Arena::new(),
            leases: LeaseAllocator::new(n_seq_max),
        }
    }

    /// The number of sequence ids.
    pub fn n_seq_max(&self) -> u32 {
        self.leases.n_seq_max()
    }

    /// Sequence ids still free, i.e. how many more branches fit.
    pub fn available(&self) -> u32 {
        self.leases.available()
    }

    /// Number of live branches.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether no branch is live.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The node of `h`; `None` if `h` is stale.
    pub fn get(&self, h: Handle) -> Option<&Node<T>> {
        self.nodes.get(h)
    }

    /// Mutable access, meant for `data`; see [`Node`] for what not to touch.
    pub fn get_mut(&mut self, h: Handle) -> Option<&mut Node<T>> {
        self.nodes.get_mut(h)
    }

    /// Whether `h` names a live branch.
    pub fn contains(&self, h: Handle) -> bool {
        self.nodes.contains(h)
    }

    /// Live branches in slot order.
    pub fn iter(&self) -> impl Iterator<Item = (Handle, &Node<T>)> {
        self.nodes.iter()
    }

    /// `None` if `h` is stale; otherwise the branch's parent (`None` for a root).
    pub fn parent(&self, h: Handle) -> Option<Option<Handle>> {
        self.get(h).map(|n| n.parent)
    }

    /// Live children in creation order; `None` if `h` is stale.
    pub fn children(&self, h: Handle) -> Option<&[Handle]> {
        self.get(h).map(|n| n.children.as_slice())
    }

    /// Sequence id leased to `h`; `None` if `h` is stale.
    pub fn seq(&self, h: Handle) -> Option<u32> {
        self.get(h).map(|n| n.seq)
    }

    /// The data of `h`; `None` if `h` is stale.
    pub fn data(&self, h: Handle) -> Option<&T> {
        self.get(h).map(|n| &n.data)
    }

    /// The data of `h` for change; `None` if `h` is stale.
    pub fn data_mut(&mut self, h: Handle) -> Option<&mut T> {
        self.get_mut(h).map(|n| &mut n.data)
    }

    fn node(&self, h: Handle) -> Result<&Node<T>, TenancyError> {
        self.get(h).ok_or(TenancyError::StaleHandle(h))
    }

    /// New parentless branch with its own sequence id.
    pub fn create_root(&mut self, data: T) -> Result<(Handle, u32), TenancyError> {
        self.create_root_with(|_| data)
    }

    /// `create_root`, with the data made from the sequence id just leased (for data that
    /// holds its own id). `data` is not called when no id is free.
    pub fn create_root_with(
        &mut self,
        data: impl FnOnce(u32) -> T,
    ) -> Result<(Handle, u32), TenancyError> {
        let seq = self.leases.acquire()?;
        let h = self.nodes.insert(Node {
            seq,
            parent: None,
            children: Vec::new(),
            fork_head: 0,
            data: data(seq),
        });
        Ok((h, seq))
    }

    /// New child of `parent`. On error nothing changes.
    pub fn fork(
        &mut self,
        parent: Handle,
        fork_head: u32,
        data: T,
    ) -> Result<(Handle, u32), TenancyError> {
        self.fork_with(parent, fork_head, |_| data)
    }

    /// `fork`, with the data made from the sequence id just leased. On error nothing changes
    /// and `data` is not called.
    pub fn fork_with(
        &mut self,
        parent: Handle,
        fork_head: u32,
        data: impl FnOnce(u32) -> T,
    ) -> Result<(Handle, u32), TenancyError> {
        self.node(parent)?;
        let seq = self.leases.acquire()?;
        let h = self.nodes.insert(Node {
            seq,
            parent: Some(parent),
            children: Vec::new(),
            fork_head,
            data: data(seq),
        });
        self.nodes
            .get_mut(parent)
            .expect("parent checked live above")
            .children
            .push(h);
        Ok((h, seq))
    }

    /// Re-creates a saved branch on the sequence id it had (`parent` must be live). On error
    /// nothing changes.
    pub fn restore(
        &mut self,
        parent: Option<Handle>,
        fork_head: u32,
        seq: u32,
        data: T,
    ) -> Result<Handle, TenancyError> {
        if let Some(p) = parent {
            self.node(p)?;
        }
        self.leases.acquire_exact(seq)?;
        let h = self.nodes.insert(Node {
            seq,
            parent,
            children: Vec::new(),
            fork_head: if parent.is_some() { fork_head } else { 0 },
            data,
        });
        if let Some(p) = parent {
            self.nodes
                .get_mut(p)
                .expect("parent checked live above")
                .children
                .push(h);
        }
        Ok(h)
    }

    /// Removes a childless branch. Refuses (changing nothing) if it has
    /// children, so a prune can never silently take descendants with it.
    pub fn prune(&mut self, h: Handle) -> Result<Pruned<T>, TenancyError> {
        let children = self.node(h)?.children.len();
        if children > 0 {
            return Err(TenancyError::HasChildren {
                handle: h,
                children,
            });
        }
        Ok(self.remove_leaf(h))
    }

    /// Removes `h` but not its children: they take its place under its parent (in its slot
    /// of the parent's child list, in order), or become roots. Their `fork_head` is kept:
    /// their KV cells carry their own sequence ids, so nothing they hold is lost.
    pub fn prune_keep_children(&mut self, h: Handle) -> Result<Pruned<T>, TenancyError> {
        let node = self.node(h)?;
        let (parent, children) = (node.parent, node.children.clone());
        for &c in &children {
            self.nodes.get_mut(c).expect("live child").parent = parent;
        }
        if let Some(p) = parent {
            let siblings = &mut self.nodes.get_mut(p).expect("live parent").children;
            let at = siblings.iter().position(|&c| c == h).expect("listed");
            siblings.splice(at..=at, children);
        }
        let node = self.nodes.get_mut(h).expect("checked above");
        node.children.clear();
        node.parent = None;
        Ok(self.remove_leaf(h))
    }

    /// Removes `h` and all its descendants, children before parents (siblings
    /// in creation order), which is the order the results are returned in.
    pub fn prune_subtree(&mut self, h: Handle) -> Result<Vec<Pruned<T>>, TenancyError> {
        self.node(h)?;
        let order = self.post_order(h);
        Ok(order.into_iter().map(|n| self.remove_leaf(n)).collect())
    }

    /// Keeps only `winner`, which becomes a root; every other branch is
    /// removed and returned in slot order.
    pub fn retain_only(&mut self, winner: Handle) -> Result<Vec<Pruned<T>>, TenancyError> {
        let seq = self.node(winner)?.seq;
        let losers: Vec<Handle> = self.nodes.handles();
        let pruned = losers
            .into_iter()
            .filter(|&h| h != winner)
            .map(|h| {
                let node = self.nodes.remove(h).expect("handle listed as live");
                Pruned {
                    handle: h,
                    seq: node.seq,
                    data: node.data,
                }
            })
            .collect();
        self.leases.retain_only(seq);
        let node = self.nodes.get_mut(winner).expect("winner checked live");
        node.parent = None;
        node.children.clear();
        Ok(pruned)
    }

    /// Subtree of `root` in post-order, computed with an explicit stack so a
    /// deep chain of forks cannot overflow the call stack.
    fn post_order(&self, root: Handle) -> Vec<Handle> {
        let mut order = Vec::new();
        // (node, index of the next child to visit)
        let mut stack = vec![(root, 0usize)];
        while let Some(&(h, next)) = stack.last() {
            let children = &self.nodes.get(h).expect("subtree nodes are live").children;
            if let Some(&child) = children.get(next) {
                stack.last_mut().expect("stack is non-empty").1 += 1;
                stack.push((child, 0));
            } else {
                order.push(h);
                stack.pop();
            }
        }
        order
    }

    /// Removes a live, childless node, unlinking it and freeing its lease.
    fn remove_leaf(&mut self, h: Handle) -> Pruned<T> {
        let node = self.nodes.remove(h).expect("caller checked h is live");
        debug_assert!(node.children.is_empty());
        if let Some(p) = node.parent.and_then(|p| self.nodes.get_mut(p)) {
            p.children.retain(|&c| c != h);
        }
        self.leases
            .release(node.seq)
            .expect("a live node's sequence is leased");
        Pruned {
            handle: h,
            seq: node.seq,
            data: node.data,
        }
    }

    /// Panics with a description of the first broken invariant. For tests and
    /// debug assertions; O(n·depth).
    pub fn check_invariants(&self) {
        let mut seqs = HashSet::new();
        for (h, node) in self.iter() {
            assert!(
                self.leases.is_leased(node.seq),
                "branch {h} holds seq {} which is not leased",
                node.seq
            );
            assert!(
                seqs.insert(node.seq),
                "seq {} held by two branches",
                node.seq
            );
            if let Some(p) = node.parent {
                let parent = self
                    .get(p)
                    .unwrap_or_else(|| panic!("branch {h} has dead parent {p}"));
                let links = parent.children.iter().filter(|&&c| c == h).count();
                assert_eq!(links, 1, "parent {p} lists child {h} {links} times");
            }
            for &c in &node.children {
                let child = self
                    .get(c)
                    .unwrap_or_else(|| panic!("branch {h} has dead child {c}"));
                assert_eq!(
                    child.parent,
                    Some(h),
                    "child {c} does not point back to {h}"
                );
            }
            // Walking up must reach a root within len() steps.
            let mut cur = node.parent;
            let mut steps = 0;
            while let Some(p) = cur {
                steps += 1;
                assert!(steps <= self.len(), "cycle through branch {h}");
                cur = self.get(p).and_then(|n| n.parent);
            }
        }
        let leased = self.n_seq_max() - self.available();
        assert_eq!(
            leased as usize,
            self.len(),
            "{leased} leases held but {} live branches",
            self.len()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seqs(p: &[Pruned<&str>]) -> Vec<u32> {
        p.iter().map(|p| p.seq).collect()
    }

    #[test]
    fn restore_takes_the_saved_seq_and_links_the_parent() {
        let mut r = Registry::new(4);
        let root = r.restore(None, 7, 2, "root").unwrap();
        let child = r.restore(Some(root), 5, 0, "child").unwrap();
        assert_eq!((r.seq(root), r.seq(child)), (Some(2), Some(0)));
        assert_eq!(r.get(root).unwrap().fork_head, 0);
        assert_eq!(r.get(child).unwrap().fork_head, 5);
        assert_eq!(r.children(root), Some(&[child][..]));
        assert!(r.restore(None, 0, 2, "taken").is_err());
        assert_eq!(r.len(), 2);
        assert_eq!(r.create_root("next").unwrap().1, 1);
        r.check_invariants();
    }

    #[test]
    fn prune_keep_children_reparents_in_place() {
        let mut r = Registry::new(6);
        let (root, _) = r.create_root("root").unwrap();
        let (a, _) = r.fork(root, 3, "a").unwrap();
        let (mid, mid_seq) = r.fork(root, 4, "mid").unwrap();
        let (z, _) = r.fork(root, 5, "z").unwrap();
        let (k1, _) = r.fork(mid, 7, "k1").unwrap();
        let (k2, _) = r.fork(mid, 8, "k2").unwrap();
        let pruned = r.prune_keep_children(mid).unwrap();
        assert_eq!((pruned.seq, pruned.data), (mid_seq, "mid"));
        assert_eq!(r.children(root), Some(&[a, k1, k2, z][..]));
        assert_eq!(r.parent(k1), Some(Some(root)));
        assert_eq!(r.get(k2).unwrap().fork_head, 8);
        assert_eq!(r.available(), 1);
        r.check_invariants();
        // A root's children become roots.
        r.prune_keep_children(root).unwrap();
        assert_eq!(r.parent(a), Some(None));
        assert_eq!(r.parent(z), Some(None));
        r.check_invariants();
        assert!(r.prune_keep_children(mid).is_err());
    }

    #[test]
    fn fork_and_prune() {
        let mut r = Registry::new(4);
        let (root, s0) = r.create_root("root").unwrap();
        let (a, s1) = r.fork(root, 10, "a").unwrap();
        let (b, s2) = r.fork(root, 12, "b").unwrap();
        assert_eq!((s0, s1, s2), (0, 1, 2));
        assert_eq!(r.children(root), Some(&[a, b][..]));
        assert_eq!(r.parent(a), Some(Some(root)));
        assert_eq!(r.parent(root), Some(None));
        assert_eq!(r.get(b).unwrap().fork_head, 12);
        assert_eq!(
            r.prune(root).unwrap_err(),
            TenancyError::HasChildren {
                handle: root,
                children: 2
            }
        );
        let p = r.prune(a).unwrap();
        assert_eq!((p.handle, p.seq, p.data), (a, 1, "a"));
        assert_eq!(r.children(root), Some(&[b][..]));
        assert_eq!(r.prune(a).unwrap_err(), TenancyError::StaleHandle(a));
        assert_eq!(r.parent(a), None);
        assert_eq!(r.available(), 2);
        r.check_invariants();
    }

    #[test]
    fn data_made_with_the_leased_seq() {
        let mut r = Registry::new(2);
        let (root, s0) = r.create_root_with(|seq| seq * 10).unwrap();
        let (child, s1) = r.fork_with(root, 3, |seq| seq * 10).unwrap();
        assert_eq!(
            (r.data(root), r.data(child)),
            (Some(&(s0 * 10)), Some(&(s1 * 10)))
        );
        // No free id: the data is never made.
        let made = std::cell::Cell::new(false);
        assert!(r
            .fork_with(root, 0, |seq| {
                made.set(true);
                seq
            })
            .is_err());
        assert!(r
            .create_root_with(|seq| {
                made.set(true);
                seq
            })
            .is_err());
        assert!(!made.get());
        r.check_invariants();
    }

    #[test]
    fn exhaustion_changes_nothing() {
        let mut r = Registry::new(2);
        let (root, _) = r.create_root(()).unwrap();
        r.fork(root, 0, ()).unwrap();
        let err = r.fork(root, 0, ()).unwrap_err();
        assert_eq!(err, TenancyError::LeaseExhausted { n_seq_max: 2 });
        assert_eq!(r.children(root).unwrap().len(), 1);
        assert_eq!(r.len(), 2);
        assert!(r.create_root(()).is_err());
        r.check_invariants();
    }

    #[test]
    fn fork_from_stale_parent() {
        let mut r = Registry::new(2);
        let (root, _) = r.create_root(()).unwrap();
        r.prune(root).unwrap();
        assert_eq!(r.fork(root, 0, ()), Err(TenancyError::StaleHandle(root)));
        assert_eq!(r.available(), 2);
    }

    #[test]
    fn prune_subtree_is_post_order() {
        // root -> a -> (a1, a2), root -> b
        let mut r = Registry::new(8);
        let (root, _) = r.create_root("root").unwrap();
        let (a, _) = r.fork(root, 1, "a").unwrap();
        r.fork(root, 1, "b").unwrap();
        r.fork(a, 2, "a1").unwrap();
        r.fork(a, 2, "a2").unwrap();
        let names: Vec<_> = r.prune_subtree(a).unwrap().iter().map(|p| p.data).collect();
        assert_eq!(names, ["a1", "a2", "a"]);
        r.check_invariants();
        let all = r.prune_subtree(root).unwrap();
        assert_eq!(
            all.iter().map(|p| p.data).collect::<Vec<_>>(),
            ["b", "root"]
        );
        assert!(r.is_empty());
        assert_eq!(r.available(), 8);
    }

    #[test]
    fn deep_chain_does_not_recurse() {
        let n = 100_000;
        let mut r = Registry::new(n);
        let (mut tip, _) = r.create_root(()).unwrap();
        let root = tip;
        for i in 1..n {
            tip = r.fork(tip, i, ()).unwrap().0;
        }
        let pruned = r.prune_subtree(root).unwrap();
        assert_eq!(pruned.len(), n as usize);
        assert_eq!(pruned[0].handle, tip);
        assert!(r.is_empty());
    }

    #[test]
    fn retain_only_keeps_winner_as_root() {
        let mut r = Registry::new(5);
        let (root, _) = r.create_root("root").unwrap();
        let (a, _) = r.fork(root, 3, "a").unwrap();
        let (w, ws) = r.fork(a, 5, "w").unwrap();
        r.fork(w, 7, "w1").unwrap();
        r.create_root("other").unwrap();
        let pruned = r.retain_only(w).unwrap();
        let mut s = seqs(&pruned);
        s.sort();
        assert_eq!(s, [0, 1, 3, 4]);
        assert_eq!(r.len(), 1);
        assert_eq!(r.parent(w), Some(None));
        assert_eq!(r.children(w), Some(&[][..]));
        assert_eq!(r.seq(w), Some(ws));
        assert_eq!(r.get(w).unwrap().fork_head, 5);
        r.check_invariants();
        // Freed ids come back lowest first.
        assert_eq!(r.create_root("new").unwrap().1, 0);
        assert_eq!(r.retain_only(a), Err(TenancyError::StaleHandle(a)));
    }

    #[test]
    #[should_panic(expected = "does not point back")]
    fn invariants_catch_broken_links() {
        let mut r = Registry::new(3);
        let (root, _) = r.create_root(()).unwrap();
        let (a, _) = r.fork(root, 0, ()).unwrap();
        r.get_mut(a).unwrap().parent = None;
        r.check_invariants();
    }
}
