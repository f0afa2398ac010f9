//! `Branch::speculate` on the engine thread: `pending` and the draft in one decode, then the
//! branch's chain samples position by position and keeps the draft while it agrees; the KV
//! cells of the rejected draft tokens are removed (a recurrent state goes back to the
//! checkpoint taken before the guess and decodes the kept tokens again).

use std::sync::Arc;

use super::shared::BranchCell;
use super::summaries;
use super::Worker;
use crate::error::{Error, Result};
use crate::model::Token;
use crate::produced::Produced;

impl Worker {
    /// One round: accept `pending`, decode it with `draft`, keep the draft while the chain
    /// agrees. Returns the accepted draft tokens and the token drawn after them.
    pub(crate) fn speculate(
        &mut self,
        cell: &Arc<BranchCell>,
        pending: Token,
        mut draft: Vec<Token>,
    ) -> Result<(Vec<Produced>, Produced)> {
        if self.is_gone(cell) {
            return Err(Error::BranchDisposed("in speculate".into()));
        }
        self.give_leases(&[cell])?;
        // A chain that came to need its whole row after the device drew the last output (a
        // hot swap mid-stream) gets the row first, as `produce` and `step` do (`refresh.rs`).
        if let Some(Some(e)) = self.refresh_rows(std::slice::from_ref(cell)).pop() {
            return Err(e);
        }
        // The draft cut to what fits first: the window guard below sees only what decodes.
        let position = cell.lock().position();
        let room = self.shared().n_ctx as i32 - position;
        if room < 1 {
            return Err(Error::KvCacheFull(format!(
                "position {position} reached n_ctx = {}",
                self.shared().n_ctx
            )));
        }
        draft.truncate((room as usize).min(self.ctx().n_batch as usize) - 1);
        self.guard_window(cell, position + draft.len() as i32)?;
        let model = self.shared().model.clone();
        let (seq, start, before) = {
            let mut st = cell.lock();
            let snap = st.snapshot();
            if let Err(e) = st.accept_for_commit(&model, pending) {
                st.restore(snap);
                return Err(e);
            }
            (cell.seq(), st.position(), snap)
        };
        // A recurrent state cannot drop rejected guesses afterwards, unless llama.cpp keeps
        // per-token snapshots long enough (`n_rs_seq`): it goes back to a checkpoint of the
        // state before them (`checkpoints.rs`).
        let rolls_back = draft.len() <= self.ctx().n_rs_seq as usize;
        if !rolls_back {
            self.take_checkpoint(cell, start)?;
        }
        let adapters = cell.lock().adapters().clone();
        // A decode of at most n_seq_max outputs neither moves llama.cpp's output buffer nor
        // writes it unless it succeeds (`loans.rs`): the branch keeps its lent row through it
        // (in flight) instead of copying it aside, as a commit's members do.
        let keep_loan = draft.len() < self.ctx().n_seq_max as usize;
        let decoded = self.use_adapters(&adapters).and_then(|()| {
            if keep_loan {
                self.loans().give_back_except(&[cell]);
                cell.lock().take_off_row();
            } else {
                self.loans().give_back_all();
            }
            let wants_row = self.wants_row(cell);
            let batch = self.start_batch();
            for (i, &t) in std::iter::once(&pending).chain(&draft).enumerate() {
                batch.push(t, start + i as i32, seq, true);
            }
            if wants_row {
                batch.want_row(seq);
            }
            self.decode_batch()
        });
        if let Err(e) = decoded {
            {
                let mut st = cell.lock();
                st.restore(before);
                st.land_row();
            }
            if self.keeps_checkpoints() {
                // A failed decode may have written part of the state.
                self.rewind(cell, start)?;
            }
            return Err(e);
        }
        let mut st = cell.lock();
        // Under the lock until the loop below lends the new row: nobody reads the old one.
        st.land_row();
        let mut accepted = Vec::new();
        // Position by position, as plain generation would: snapshot, sample, accept.
        let drawn: Result<Produced> = (|| {
            for i in 0..=draft.len() {
                let output = self.ctx().output_ith(i)?;
                // SAFETY: a row is in llama.cpp's output buffer, which only a decode rewrites
                // or moves; `decode` gave back every loan before this one and gives this one
                // back before the next (the cell is recorded below). The cell stays locked
                // meanwhile.
                unsafe { summaries::lend(&mut [&mut *st], vec![output], self.team_threads()) };
                let produced = st.produce(&model)?;
                let token = produced.token;
                if i == draft.len() || token != draft[i] || produced.is_stop {
                    return Ok(produced);
                }
                st.accept(&model, token)?;
                accepted.push(produced);
            }
            unreachable!("the last position returns")
        })();
        // The KV keeps `pending` and the accepted draft tokens; the rest of the guess goes.
        let kept: Vec<Token> = std::iter::once(pending)
            .chain(accepted.iter().map(|p| p.token))
            .collect();
        st.decoded(&kept);
        drop(st);
        self.loans().record(cell);
        if kept.len() < 1 + draft.len() {
            let end = start + kept.len() as i32;
            // The per-token snapshots of this decode drop the rejected tokens at once;
            // otherwise `rewind` cuts the KV cells or goes back to the checkpoint.
            let rolled_back = rolls_back && self.ctx_mut().seq_rm(seq, end, -1)?;
            if !rolled_back {
                self.rewind(cell, end)?;
            }
        }
        Ok((accepted, drawn?))
    }
}
