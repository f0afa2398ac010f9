//! The branch tree on the engine thread: `Branch::fork`, the prunes and
//! `BranchStore::retain_only`. Leases come from the registry (`Shared::registry`); the KV
//! cells follow here: a fork tags its parent's cells with its own sequence, a prune empties
//! the sequences it freed.

use std::sync::Arc;

use kvfork_core::Handle;

use super::shared::BranchCell;
use super::Worker;
use crate::error::{Error, Result};
use crate::seq::Seq;

/// Which branches a prune takes out of the tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Prune {
    /// The branch alone (it has no live children: `Branch::prune` checked).
    Leaf,
    /// The branch; its children move to its parent (`Branch::prune_keep_children`).
    KeepChildren,
    /// The branch and all its descendants (`Branch::prune_subtree`).
    Subtree,
}

impl Worker {
    /// `Branch::fork`: a child on a fresh lease (the lowest free, or `on`) whose sequence
    /// shares the parent's cells.
    pub(crate) fn fork(
        &mut self,
        parent: Handle,
        parent_cell: &Arc<BranchCell>,
        seed: Option<u32>,
        on: Option<Seq>,
    ) -> Result<(Handle, Arc<BranchCell>)> {
        if self.is_gone(parent_cell) {
            return Err(Error::BranchDisposed(parent.to_string()));
        }
        self.give_leases(&[parent_cell])?;
        let (mut child_state, fork_head) = {
            let p = parent_cell.lock();
            (p.fork_copy(), p.position())
        };
        if let Some(seed) = seed {
            child_state.reseed(seed);
        }
        let lent = child_state.logits().is_lent();
        let (handle, cell) = match on {
            Some(seq) => self
                .shared()
                .fork_on(parent, fork_head as u32, seq, child_state)?,
            None => self.shared().fork(parent, fork_head as u32, child_state)?,
        };
        if lent {
            // The child reads its parent's row in llama.cpp's output buffer too.
            self.loans().record(&cell);
        }
        if cell.is_parked() {
            // No lease free (`park`): the child starts parked on its parent's cells.
            self.born_parked(parent_cell, &cell)?;
            return Ok((handle, cell));
        }
        self.empty_seq(cell.seq())?;
        self.ctx_mut()
            .seq_cp(parent_cell.seq(), cell.seq(), -1, -1)?;
        Ok((handle, cell))
    }

    /// The engine half of every prune: take the branches out of the tree, then empty the
    /// sequences they leased (cells shared with others stay for them). Their cells were
    /// marked disposed by the call (and are here, for forks made since).
    pub(crate) fn prune(&mut self, handle: Handle, how: Prune) -> Result<()> {
        // A fork asked for before a RESTRICT prune and made since is a child the call could
        // not see: it keeps its cells and moves up, as with `keep_children`.
        let how = match how {
            Prune::Leaf
                if self
                    .shared()
                    .registry()
                    .get(handle)
                    .is_some_and(|node| !node.children.is_empty()) =>
            {
                Prune::KeepChildren
            }
            how => how,
        };
        if how == Prune::KeepChildren && self.parks() {
            // Parked descendants anchored on this branch's cells move off them first.
            let cell = self.shared().registry().data(handle).cloned();
            if let Some(cell) = cell {
                self.before_cells_go(&cell)?;
            }
        }
        let pruned: Vec<(Handle, u32)> = {
            let mut registry = self.shared().registry();
            match how {
                Prune::Leaf => vec![registry.prune(handle)?],
                Prune::KeepChildren => vec![registry.prune_keep_children(handle)?],
                Prune::Subtree => registry.prune_subtree(handle)?,
            }
            .into_iter()
            .map(|p| {
                // Marked at the call already, but for a fork made since (asked for before).
                p.data.mark_disposed();
                (p.handle, p.seq)
            })
            .collect()
        };
        for (h, seq) in pruned {
            // With `park` the registry's ids are slots: the ledger knows the sequence.
            let seq = if self.parks() {
                self.forget(h)
            } else {
                Some(Seq::new(seq))
            };
            if let Some(seq) = seq {
                self.empty_seq(seq)?;
            }
        }
        Ok(())
    }

    /// `BranchStore::retain_only`: every branch but `winner` leaves the tree (their cells are
    /// already marked disposed) and the KV cache keeps only the winner's sequence.
    pub(crate) fn retain_only(&mut self, winner: Handle) -> Result<()> {
        let (slot, cell) = self
            .shared()
            .registry()
            .get(winner)
            .map(|n| (n.seq, n.data.clone()))
            .ok_or(Error::BranchDisposed(winner.to_string()))?;
        // A parked winner comes back first (its cells may lean on a loser's).
        self.give_leases(&[&cell])?;
        let losers = self.shared().registry().retain_only(winner)?;
        // `BranchStore::retain_only` marked the losers it saw; a fork made since (asked for
        // before it) is a loser too.
        for loser in &losers {
            loser.data.mark_disposed();
        }
        let seq = match self.shared().ledger() {
            Some(mut l) => {
                l.retain_only(winner)?;
                cell.seq()
            }
            None => Seq::new(slot),
        };
        self.shared().outputs().keep_only(seq);
        self.ctx_mut().seq_keep(seq)
    }
}
