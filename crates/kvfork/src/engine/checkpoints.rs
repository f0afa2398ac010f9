//! Recurrent-state checkpoints on the engine thread: what makes forks inside a sequence and
//! rollbacks exact on recurrent and hybrid models.
//!
//! A KV cache holds one cell per position, so a sequence is cut back with `seq_rm` and a fork
//! inside it copies its first cells. A recurrent model (Mamba) or the recurrent layers of a
//! hybrid (LFM2, Nemotron-H, ...) hold one state per sequence, the state after its last token:
//! llama.cpp refuses to cut it (`seq_rm` returns false) and `seq_cp` copies that final state
//! whatever range it is given. So the engine copies the recurrent part aside
//! (`llama_state_seq_get_data_ext(PARTIAL_ONLY)`, host memory) at the end of each prefill
//! decode and before a speculative guess, and keeps a budget of them per branch
//! (`kvfork_core::checkpoints`). To bring a sequence back to position `p`, it puts back the
//! last checkpoint at or before `p`, cuts the KV cells after it, and decodes the tokens between
//! again from the branch's history (`rewind`). A fork inside a sequence takes the source's
//! cells up to the checkpoint and prefills the rest (`share_prefix`).

use std::sync::Arc;

use super::shared::{BranchCell, Stats};
use super::Worker;
use crate::error::{Error, Result};
use crate::model::Token;
use crate::seq::Seq;

/// A recurrent state kept aside: the position after which it was taken, and its bytes.
type Checkpoint = (u32, Arc<[u8]>);

impl Worker {
    /// Whether this context's model keeps a recurrent state (pure or hybrid): then cuts and
    /// forks inside a sequence go through checkpoints.
    pub(super) fn keeps_checkpoints(&self) -> bool {
        self.shared().model.is_recurrent()
    }

    /// Copy `cell`'s recurrent state aside as the checkpoint after `pos` tokens (the
    /// caller knows the sequence holds exactly those). A no-op on attention-only models.
    pub(super) fn take_checkpoint(&mut self, cell: &Arc<BranchCell>, pos: i32) -> Result<()> {
        if !self.keeps_checkpoints() || pos <= 0 {
            return Ok(());
        }
        if cell
            .lock()
            .checkpoint_at_or_before(pos as u32)
            .is_some_and(|(at, _)| at == pos as u32)
        {
            return Ok(()); // the state after these tokens is kept already
        }
        let t0 = std::time::Instant::now();
        let state: Arc<[u8]> = self.ctx().recurrent_state(cell.seq())?.into();
        let bytes = state.len() as u64;
        Stats::add(
            &self.shared().stats.checkpoint_ns,
            t0.elapsed().as_nanos() as u64,
        );
        let budget = self.shared().params.checkpoint_budget();
        if cell.lock().keep_checkpoint(pos as u32, state, budget) {
            let stats = &self.shared().stats;
            Stats::add(&stats.checkpoints_taken, 1);
            Stats::add(&stats.checkpoint_bytes_taken, bytes);
        }
        Ok(())
    }

    /// Make `cell`'s sequence hold exactly the first `pos` tokens of its history again (after
    /// a rejected guess or a failed decode wrote past them). On a KV cache the cells after
    /// `pos` go; on a recurrent state the last checkpoint at or before `pos` is put back and
    /// the tokens after it are decoded again. The branch's own position is the caller's.
    pub(super) fn rewind(&mut self, cell: &Arc<BranchCell>, pos: i32) -> Result<()> {
        let seq = cell.seq();
        if !self.keeps_checkpoints() {
            self.ctx_mut().seq_rm(seq, pos, -1)?;
            return Ok(());
        }
        cell.lock().forget_checkpoints_after(pos.max(0) as u32);
        let (from, replay) = self.replay_plan(cell, pos)?;
        let start = match from {
            Some((at, state)) => {
                self.ctx_mut().set_recurrent_state(seq, &state)?;
                // The KV cells after the checkpoint (a hybrid's attention layers).
                self.ctx_mut().seq_rm(seq, at as i32, -1)?;
                Stats::add(&self.shared().stats.checkpoint_restores, 1);
                at as i32
            }
            None => {
                self.ctx_mut().seq_rm(seq, -1, -1)?;
                0
            }
        };
        // Not abortable: the cancel that failed the run this rolls back would stop the replay
        // and leave the state wherever it stopped.
        let run = self.shared().abort.pause();
        let replayed = self.replay(cell, seq, start, &replay);
        self.shared().abort.set_running(run);
        replayed
    }

    /// Make the empty sequence `target` hold `cell`'s first `pos` tokens, `cell` untouched:
    /// its cells on a KV cache; on a recurrent state, its cells up to the last checkpoint at
    /// or before `pos`, that checkpoint's state, and the tokens after it decoded again. On
    /// failure `target` may hold part of them: the caller empties it.
    pub(super) fn rebuild_on(
        &mut self,
        cell: &Arc<BranchCell>,
        target: Seq,
        pos: i32,
    ) -> Result<()> {
        let seq = cell.seq();
        if !self.keeps_checkpoints() {
            return self.ctx_mut().seq_cp(seq, target, 0, pos);
        }
        let (from, replay) = self.replay_plan(cell, pos)?;
        let start = match from {
            Some((at, state)) => {
                self.ctx_mut().seq_cp(seq, target, 0, at as i32)?;
                self.ctx_mut().set_recurrent_state(target, &state)?;
                Stats::add(&self.shared().stats.checkpoint_restores, 1);
                at as i32
            }
            None => 0,
        };
        self.replay(cell, target, start, &replay)
    }

    /// Where a recurrent state for `cell`'s first `pos` tokens starts from (its last
    /// checkpoint at or before `pos`, or nothing: position 0) and the tokens of its history
    /// to decode after it.
    fn replay_plan(
        &self,
        cell: &Arc<BranchCell>,
        pos: i32,
    ) -> Result<(Option<Checkpoint>, Vec<Token>)> {
        let st = cell.lock();
        let from = st.checkpoint_at_or_before(pos as u32);
        let at = from.as_ref().map_or(0, |(at, _)| *at as usize);
        // The history ends at the branch's position; a branch the raw layer made over
        // existing cells lacks its first tokens.
        let history = st.history();
        let offset = (st.position() as usize).saturating_sub(history.len());
        if at < offset || pos as usize > offset + history.len() {
            let family = self.shared().model.family();
            return Err(Error::Other(format!(
                "cannot bring this branch's recurrent state back to position {pos} on a \
                 {family} model: its tokens before position {offset} are unknown (a branch \
                 over cells the raw layer decoded); make such branches with prefill"
            )));
        }
        Ok((from, history[at - offset..pos as usize - offset].to_vec()))
    }

    /// Decode `tokens` into `seq` from position `start` again, without logits, under the
    /// branch's adapters.
    fn replay(
        &mut self,
        cell: &Arc<BranchCell>,
        seq: Seq,
        start: i32,
        tokens: &[Token],
    ) -> Result<()> {
        if tokens.is_empty() {
            return Ok(());
        }
        let adapters = cell.lock().adapters().clone();
        self.use_adapters(&adapters)?;
        let n_batch = self.ctx().n_batch as usize;
        for (c, chunk) in tokens.chunks(n_batch).enumerate() {
            let first = start + (c * n_batch) as i32;
            let batch = self.start_batch();
            for (j, &t) in chunk.iter().enumerate() {
                batch.push(t, first + j as i32, seq, false);
            }
            // No outputs, so nothing to pad: `seq` may be the padding sequence (`refresh.rs`).
            self.decode_unpadded()?;
        }
        Stats::add(&self.shared().stats.replayed_tokens, tokens.len() as u64);
        Ok(())
    }

    /// The first position the token at position `n` attends to in sliding-window layers
    /// (`n - n_swa + 1`, at least 0); None on a model without them.
    pub(super) fn window_start(&self, n: usize) -> Option<i64> {
        let n_swa = self.shared().model.n_swa() as i64;
        (n_swa > 0).then(|| (n as i64 - n_swa + 1).max(0))
    }

    /// Whether `seq` still holds its cells from position `pos` on. In sliding-window layers
    /// llama.cpp may have reused the cells a window behind the sequence's end, dropping every
    /// older one with them (so what it holds there starts at its least position).
    pub(super) fn holds_from(&self, seq: Seq, pos: i64) -> Result<bool> {
        Ok(self.ctx().seq_pos_min(seq)? as i64 <= pos)
    }

    /// Whether `seq`'s cells still hold what a branch of its first `n` tokens attends to.
    fn window_holds(&self, seq: Seq, n: usize) -> Result<bool> {
        self.window_start(n)
            .map_or(Ok(true), |start| self.holds_from(seq, start))
    }

    /// Give `target` (empty) `source`'s cells and state for the first `n` tokens of
    /// `prefix`, where `n` is `prefix.len()` on a KV cache and, on a recurrent state, the
    /// last point where it is known: the source's end when the prefix is all of it, else its
    /// last checkpoint at or before. Returns `n` (0: nothing shared).
    pub(super) fn copy_prefix(
        &mut self,
        source: &Arc<BranchCell>,
        target: &Arc<BranchCell>,
        prefix: &[Token],
    ) -> Result<usize> {
        let (src_seq, dst_seq) = (source.seq(), target.seq());
        if !self.keeps_checkpoints() {
            if !self.window_holds(src_seq, prefix.len())? {
                return Ok(0);
            }
            self.ctx_mut()
                .seq_cp(src_seq, dst_seq, 0, prefix.len() as i32)?;
            return Ok(prefix.len());
        }
        let (end, checkpoint) = {
            let src = source.lock();
            (
                src.position() as usize,
                src.checkpoint_at_or_before(prefix.len() as u32),
            )
        };
        // The whole sequence: its final state is the one wanted. Inside it: the cells up to
        // the last checkpoint (and the source's final state, which the checkpoint replaces).
        let (at, state) = match checkpoint {
            _ if prefix.len() == end => (end as u32, None),
            Some((at, state)) => (at, Some(state)),
            None => return Ok(0),
        };
        self.ctx_mut().seq_cp(src_seq, dst_seq, 0, at as i32)?;
        if let Some(state) = state {
            if let Err(e) = self.ctx_mut().set_recurrent_state(dst_seq, &state) {
                let _ = self.ctx_mut().seq_rm(dst_seq, -1, -1);
                return Err(e);
            }
            Stats::add(&self.shared().stats.checkpoint_restores, 1);
        }
        let inherited = source.lock().checkpoints_upto(at);
        target.lock().set_checkpoints(inherited);
        Ok(at as usize)
    }
}
