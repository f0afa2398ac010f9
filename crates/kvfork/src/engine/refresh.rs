//! Device sampling (`sampling/device.rs`): a branch whose chain came to need its whole row
//! after the device drew its last output (a grammar set after the prefill, a fork given a
//! bias), or whose row is read (`logits()`, `entropy()`), gets the row before it samples or
//! is read. Its last token is decoded again, row asked for, on the padding sequence (no
//! branch leases it; it is empty between decodes) made to hold the branch's other tokens
//! (`Worker::rebuild_on`: a copy of its cells; on a recurrent state, its last checkpoint and
//! the tokens after it decoded again), so the branch itself is untouched whether that works
//! or not. The row is the last token's over the same history, as exact as any re-batched row
//! (margin-aware).
//!
//! Without a padding sequence (n_seq_max 256) the branch's sample keeps saying what to do
//! (`LogitsSnapshot::drawn_before_needed`).

use std::sync::Arc;

use super::{BranchCell, Worker};
use crate::error::{Error, Result};
use crate::llama_ctx::Output;
use crate::model::Token;

impl Worker {
    /// Give each of `cells` that needs it its row (see the module). One entry per cell: the
    /// error of a refresh that failed, which its sample reports; None otherwise. Empty (no
    /// allocation) when none needs one.
    pub(super) fn refresh_rows(&mut self, cells: &[Arc<BranchCell>]) -> Vec<Option<Error>> {
        let Some(kept) = self.ctx().device_candidates() else {
            return Vec::new();
        };
        let stale = |cell: &Arc<BranchCell>| {
            let mut st = cell.lock();
            st.logits().drawn().is_some() && st.chain_needs_row(kept)
        };
        if !cells.iter().any(stale) {
            return Vec::new();
        }
        cells
            .iter()
            .map(|cell| stale(cell).then(|| self.refresh_row(cell).err()).flatten())
            .collect()
    }

    /// Give `cell` its row for a caller off the engine thread (`Branch::with_row_decoded`)
    /// when the device drew its output. Nothing where it cannot (see the module): the caller
    /// reports that.
    pub(crate) fn refresh_drawn(&mut self, cell: &Arc<BranchCell>) -> Result<()> {
        let drawn =
            self.ctx().device_candidates().is_some() && cell.lock().logits().drawn().is_some();
        if drawn {
            self.refresh_row(cell)?;
        }
        Ok(())
    }

    /// A branch restored (`Branch::load`, `Branch::restore`, `Context::restore`) into a
    /// context without device sampling from a file saved where the device drew its last
    /// output: its row, so that it reads, samples and commits as this context's branches do.
    /// A refresh that fails (no room for the token decoded again) leaves the draw: the branch
    /// samples from its candidates, and a read says why it has no row.
    pub(super) fn rows_for_restored(&mut self, cell: &Arc<BranchCell>) {
        if self.ctx().device_candidates().is_none() && cell.lock().logits().drawn().is_some() {
            let _ = self.refresh_row(cell);
        }
    }

    /// Before `token` is committed to `cell`: a token outside the candidates the device kept
    /// has no probability to count, so the branch gets its row, and rows from now on (it
    /// commits tokens of its own, as a reader would).
    pub(super) fn refresh_for_commit(
        &mut self,
        cell: &Arc<BranchCell>,
        token: Token,
    ) -> Result<()> {
        if self.ctx().device_candidates().is_none() {
            return Ok(()); // every output is a row: not a lock more per committed token
        }
        let outside = {
            let mut st = cell.lock();
            let outside = st
                .logits()
                .drawn()
                .is_some_and(|d| d.logit_of(token).is_none());
            if outside {
                st.read_rows();
            }
            outside
        };
        if outside {
            self.refresh_row(cell)?;
        }
        Ok(())
    }

    /// Decode `cell`'s last token again on the padding sequence, row asked for, and make
    /// that row the branch's output.
    fn refresh_row(&mut self, cell: &Arc<BranchCell>) -> Result<()> {
        let Some(tmp) = self.shared().params.pad_seq() else {
            return Ok(()); // no sequence to decode on: the sample says what to do
        };
        self.give_leases(&[cell])?;
        let (position, last, adapters) = {
            let st = cell.lock();
            (
                st.position(),
                st.history().last().copied(),
                st.adapters().clone(),
            )
        };
        let Some(last) = last.filter(|_| position > 0) else {
            return Ok(()); // cells the raw layer decoded: no token to decode again
        };
        self.use_adapters(&adapters)?;
        let decoded = self.rebuild_on(cell, tmp, position - 1).and_then(|()| {
            let batch = self.start_batch();
            batch.push(last, position - 1, tmp, true);
            batch.want_row(tmp);
            self.decode_unpadded()?;
            Ok(self.ctx().output_ith(0)?.into_owned())
        });
        self.clear_seq(tmp);
        let row: Output = decoded.map_err(|e| match e {
            Error::KvCacheFull(why) => Error::KvCacheFull(format!(
                "{why}: this branch's row stayed on the device (create_context(\
                 device_sampling=True)), and getting it decodes its last token again, in free \
                 cells"
            )),
            e => e,
        })?;
        cell.lock().set_output(row.as_ref());
        Ok(())
    }
}
