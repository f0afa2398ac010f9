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
        if parent_cell.is_disposed() {
            return Err(Error::BranchDisposed(parent.to_string()));
        }
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
        self.empty_seq(cell.seq())?;
        self.ctx_mut()
            .seq_cp(parent_cell.seq(), cell.seq(), -1, -1)?;
        Ok((handle, cell))
    }

    /// The engine half of every prune: take the branches out of the tree, then empty the
    /// sequences they leased (cells shared with others stay for them). Their cells are
    /// already marked disposed.
    pub(crate) fn prune(&mut self, handle: Handle, how: Prune) -> Result<()> {
        let seqs: Vec<u32> = {
            let mut registry = self.shared().registry();
            match how {
                Prune::Leaf => vec![registry.prune(handle)?.seq],
                Prune::KeepChildren => vec![registry.prune_keep_children(handle)?.seq],
                Prune::Subtree => registry
                    .prune_subtree(handle)?
                    .into_iter()
                    .map(|p| p.seq)
                    .collect(),
            }
        };
        for seq in seqs {
            self.shared().outputs().emptied(Seq::new(seq));
            self.ctx_mut().seq_rm(Seq::new(seq), 0, -1)?;
        }
        Ok(())
    }

    /// `BranchStore::retain_only`: every branch but `winner` leaves the tree (their cells are
    /// already marked disposed) and the KV cache keeps only the winner's sequence.
    pub(crate) fn retain_only(&mut self, winner: Handle) -> Result<()> {
        let seq = self
            .shared()
            .registry()
            .get(winner)
            .map(|n| n.seq)
            .ok_or(Error::BranchDisposed(winner.to_string()))?;
        self.shared().registry().retain_only(winner)?;
        self.shared().outputs().keep_only(Seq::new(seq));
        self.ctx_mut().seq_keep(Seq::new(seq))
    }
}
