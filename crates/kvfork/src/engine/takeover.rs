//! The raw layer on the engine thread: `Context::decode` (tokens into a sequence no branch
//! holds, its last logits kept in `outputs.rs`) and `Branch::create_over` (a branch taking a
//! sequence's cells over). Both check the sequence's cells here, after the work queued before
//! them, so a caller's view of the cache never races the engine.

use std::sync::Arc;

use kvfork_core::Handle;

use super::shared::BranchCell;
use super::Worker;
use crate::branch_state::BranchState;
use crate::error::{Error, Result};
use crate::model::Token;
use crate::seq::Seq;

/// Refuse `seq` when a live branch leases it: its cells and snapshot are the branch's.
pub(crate) fn check_unleased(shared: &super::Shared, seq: Seq) -> Result<()> {
    let registry = shared.registry();
    match shared.holder_of(&registry, seq) {
        Some((handle, _)) => Err(Error::invalid(
            "seq_id",
            format!(
                "sequence {} is held by branch {handle}: decode through the branch, or \
                 destroy() it first",
                seq.id()
            ),
        )),
        None => Ok(()),
    }
}

impl Worker {
    /// `Context::decode`: `tokens` into `seq` from `position` (which must follow the
    /// sequence's cells, if it has any), in ceil(n / n_batch) decodes; the last token's
    /// logits become the sequence's raw output. All or nothing: on failure the cells written
    /// are removed.
    pub(crate) fn raw_decode(&mut self, tokens: &[Token], position: i32, seq: Seq) -> Result<()> {
        check_unleased(self.shared(), seq)?;
        let end = self.ctx().seq_pos_max(seq)?;
        if end >= 0 && position != end + 1 {
            return Err(Error::invalid(
                "position",
                format!(
                    "sequence {}'s cells end at position {end}: the next token goes at {}, \
                     not {position}",
                    seq.id(),
                    end + 1
                ),
            ));
        }
        let n_ctx = self.shared().n_ctx;
        if position as u64 + tokens.len() as u64 > n_ctx as u64 {
            return Err(Error::KvCacheFull(format!(
                "decode of {} tokens at position {position} exceeds n_ctx = {n_ctx}",
                tokens.len()
            )));
        }
        // A raw sequence belongs to no branch: it decodes under no adapter.
        self.use_no_adapters()?;
        let n_batch = self.ctx().n_batch as usize;
        let chunks = tokens.len().div_ceil(n_batch);
        let mut at = position;
        for (k, chunk) in tokens.chunks(n_batch).enumerate() {
            let batch = self.start_batch();
            for (j, &t) in chunk.iter().enumerate() {
                let last = k + 1 == chunks && j + 1 == chunk.len();
                batch.push(t, at + j as i32, seq, last);
            }
            // A raw output is a whole row even with device sampling: the raw layer knows no
            // history to decode its token again from when its row is read.
            batch.want_row(seq);
            if let Err(e) = self.decode() {
                let _ = self.ctx_mut().seq_rm(seq, position, -1);
                return Err(e);
            }
            at += chunk.len() as i32;
        }
        let last = tokens.len() - (chunks - 1) * n_batch - 1;
        let output = self.ctx().output_ith(last)?;
        self.shared().outputs().raw(seq, output);
        Ok(())
    }

    /// `Branch::create_over`: a root branch holding `state` on the lease of `seq` (or the
    /// lowest free one), keeping the sequence's cells when they end at `position - 1`.
    /// With `seq`, other cells are refused (`InvalidArgument`); without, they are emptied.
    /// Returns the branch and whether it kept the cells.
    pub(crate) fn create_over(
        &mut self,
        state: BranchState,
        position: i32,
        seq: Option<Seq>,
    ) -> Result<(Handle, Arc<BranchCell>, bool)> {
        if let Some(seq) = seq {
            let end = self.ctx().seq_pos_max(seq)?;
            // A held sequence is refused first (LeaseExhausted), whatever its cells.
            let (handle, cell) = self.shared().create_root_on(seq, state)?;
            if end != position - 1 {
                self.shared().registry().prune(handle)?;
                cell.mark_disposed();
                return Err(Error::invalid(
                    "position",
                    format!(
                        "sequence {}'s cells end at position {end}: a branch taking it over \
                         starts at {} (its next token's position), not {position}",
                        seq.id(),
                        end + 1
                    ),
                ));
            }
            self.checkpoint_taken_over(&cell, position);
            return Ok((handle, cell, true));
        }
        let (handle, cell) = self.shared().create_root(state)?;
        let keep = self.ctx().seq_pos_max(cell.seq())? == position - 1;
        if keep {
            self.checkpoint_taken_over(&cell, position);
        } else {
            self.empty_seq(cell.seq())?;
        }
        Ok((handle, cell, keep))
    }

    /// On a recurrent state, keep the state of cells a branch took over as its first
    /// checkpoint: the branch knows none of their tokens, so it is the only point its state
    /// can be rebuilt from (a rollback, a fork inside it, a row decoded again for device
    /// sampling). A no-op elsewhere. Without it those report what they lack, so a failure
    /// to copy the state here is left to them.
    fn checkpoint_taken_over(&mut self, cell: &Arc<BranchCell>, position: i32) {
        let _ = self.take_checkpoint(cell, position);
    }
}
