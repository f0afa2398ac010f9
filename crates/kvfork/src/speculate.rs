//! Exact speculative decoding: the token a branch sampled last and a guess of the tokens after
//! it are decoded in ONE `llama_decode` with logits at every position; the branch's own chain
//! then samples position by position and keeps the guess while it agrees. The tokens come out
//! as plain generation would draw them (same chain, same order of random draws, same accepts),
//! up to the rounding of a batched decode.

use std::sync::Arc;

use crate::branch::Branch;
use crate::engine::{BranchCell, Pending, Worker};
use crate::error::{Error, Result};
use crate::model::Token;
use crate::produced::Produced;

/// What one round of `Branch::speculate` gives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Speculated {
    /// Draft tokens the chain drew too, in order: accepted and decoded.
    pub accepted: Vec<Produced>,
    /// The token the chain drew after them: sampled, not accepted (the next round's pending
    /// token, or a stop token).
    pub next: Produced,
}

impl Branch {
    /// One round of speculative decoding. `pending` is the token the branch's sampler drew
    /// last (from `produce`, not committed); `draft` guesses the tokens that follow it.
    ///
    /// Accepts `pending`, decodes it with the draft in one `llama_decode`, then samples the
    /// branch's chain at each position: a sample equal to the draft's next token is accepted
    /// (it is decoded already); the first that differs, or the one after the whole draft, is
    /// returned as `next` and the KV cells of the rejected draft tokens are removed. A draft
    /// longer than fits the batch or the context is cut. If the decode fails, `pending` is
    /// not accepted and nothing changed.
    pub fn speculate(&self, pending: Token, draft: Vec<Token>) -> Pending<Speculated> {
        let model = self.context().model();
        if let Err(e) = self
            .check_live()
            .and_then(|_| model.check_token(pending))
            .and_then(|_| draft.iter().try_for_each(|&t| model.check_token(t)))
        {
            return Pending::ready(Err(e));
        }
        let cell = self.cell().clone();
        self.context()
            .run(move |w| w.speculate(&cell, pending, draft))
    }
}

impl Worker {
    fn speculate(
        &mut self,
        cell: &Arc<BranchCell>,
        pending: Token,
        mut draft: Vec<Token>,
    ) -> Result<Speculated> {
        if cell.is_disposed() {
            return Err(Error::BranchDisposed("in speculate".into()));
        }
        let model = self.shared.model.clone();
        let (seq, start, before) = {
            let mut st = cell.lock();
            let room = self.shared.n_ctx as i32 - st.position;
            if room < 1 {
                return Err(Error::KvCacheFull(format!(
                    "position {} reached n_ctx = {}",
                    st.position, self.shared.n_ctx
                )));
            }
            let fits = (room as usize).min(self.ctx.n_batch as usize);
            draft.truncate(fits - 1);
            let snap = st.snapshot();
            if let Err(e) = st.accept_for_commit(&model, pending) {
                st.restore(snap);
                return Err(e);
            }
            (st.seq, st.position, snap)
        };
        self.batch.clear();
        for (i, &t) in std::iter::once(&pending).chain(&draft).enumerate() {
            self.batch.push(t, start + i as i32, seq, true);
        }
        if let Err(e) = self.decode() {
            cell.lock().restore(before);
            return Err(e);
        }
        let mut st = cell.lock();
        let mut accepted = Vec::new();
        // Position by position, as plain generation would: snapshot, sample, accept.
        let drawn: Result<Produced> = (|| {
            for i in 0..=draft.len() {
                let top_k = st.top_hint();
                let row = self.ctx.logits_ith(i)?;
                // SAFETY: `row` is in llama.cpp's output buffer, which only a decode rewrites
                // or moves; `decode` gave back every loan before this one and gives this one
                // back before the next (the cell is recorded below). The cell stays locked
                // meanwhile.
                unsafe { st.logits.lend(row, top_k) };
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
        let kept = start + 1 + accepted.len() as i32;
        st.position = kept;
        st.history.push(pending);
        st.history.extend(accepted.iter().map(|p| p.token));
        drop(st);
        self.loans.record(cell);
        self.ctx.seq_rm(seq, kept, -1)?;
        Ok(Speculated {
            accepted,
            next: drawn?,
        })
    }
}
