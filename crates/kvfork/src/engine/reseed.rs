//! `Branch::reseed_context` and `Branch::shift_context` on the engine thread (infinite
//! context): the branch's sequence is emptied, then the tokens it keeps are prefilled from
//! position 0, so generation can go on past `n_ctx`. A reseed keeps the caller's sinks and
//! the tail of the branch's tokens; a shift keeps the first `keep` tokens and the most
//! recent half of the rest, as llama.cpp's `--context-shift` does.

use std::sync::Arc;

use super::shared::BranchCell;
use super::{CancelPolicy, CommitReply, CommitRequest, Pending, Ticket, Worker};
use crate::error::{Error, Result};
use crate::model::Token;
use crate::produced::Produced;
use crate::seq::Seq;

/// The branch's tokens in sequence order: its history, and a token `accept`ed but not yet
/// decoded (a re-prefill decodes it). An error for a branch that took over cells the raw
/// layer decoded: its history lacks their tokens, which a re-prefill would silently drop.
fn sequence_tokens(cell: &BranchCell) -> Result<Vec<Token>> {
    let st = cell.lock();
    let known = st.history().len();
    if known < st.position() as usize {
        return Err(Error::Other(format!(
            "this branch took over {} cells the raw layer decoded (Branch.create with \
             seq_id): it knows only the {known} tokens decoded since, so it cannot prefill \
             the others again; decode them through a branch to shift or reseed it",
            st.position() as usize - known
        )));
    }
    let mut tokens = st.history().to_vec();
    tokens.extend(st.accepted_undecoded());
    Ok(tokens)
}

/// What a reseed prefills: `sinks`, then the last `tail` of `tokens` (never the sinks a
/// second time when `tokens` begins with them).
fn reseeded(tokens: &[Token], sinks: &[Token], tail: usize) -> Vec<Token> {
    let after_sinks = if tokens.starts_with(sinks) {
        sinks.len()
    } else {
        0
    };
    let start = tokens.len().saturating_sub(tail).max(after_sinks);
    [sinks, &tokens[start..]].concat()
}

/// What a context shift keeps of `tokens`: the first `keep`, then the most recent half of
/// the rest (the older half goes).
pub(crate) fn shifted(tokens: &[Token], keep: usize) -> Vec<Token> {
    let keep = keep.min(tokens.len());
    let rest = tokens.len() - keep;
    reseeded(tokens, &tokens[..keep], rest - rest / 2)
}

impl Worker {
    /// Empty the sequence, then prefill the sinks and the last `tail` tokens of the
    /// sequence from position 0; a failure is undone (`reprefill`).
    pub(crate) fn reseed_context(
        &mut self,
        cell: &Arc<BranchCell>,
        sinks: &[Token],
        tail: usize,
    ) -> Result<()> {
        let tokens = reseeded(&sequence_tokens(cell)?, sinks, tail);
        self.reprefill(cell, tokens, "sinks/tail")
    }

    /// Empty the sequence, then prefill its first `keep` tokens and the most recent half of
    /// the rest from position 0.
    pub(crate) fn shift_context(&mut self, cell: &Arc<BranchCell>, keep: usize) -> Result<()> {
        let tokens = shifted(&sequence_tokens(cell)?, keep);
        self.reprefill(cell, tokens, "keep")
    }

    /// A context shift, then a generation step (sample, and commit unless it is a stop
    /// token) in the same job: a stream that reached `n_ctx` goes on with one request.
    pub(crate) fn shift_then_step(
        &mut self,
        cell: &Arc<BranchCell>,
        keep: usize,
    ) -> Result<Produced> {
        self.shift_context(cell, keep)?;
        let ticket = Ticket::new(CancelPolicy::Never, self.shared().abort.clone());
        ticket.start();
        let (reply, step) = Pending::channel(None);
        self.run_commits(vec![CommitRequest {
            items: vec![(cell.clone(), -1)],
            reply: CommitReply::Sampled {
                reply,
                commit: true,
            },
            ticket,
        }]);
        // `run_commits` replied before returning: this does not block.
        step.wait()
    }

    /// Empty `cell`'s sequence and prefill `tokens` into it from position 0. When the prefill
    /// fails (no room for it, most often: cells the branch shared with others stay theirs),
    /// the old cells come back from a host copy taken first, and the branch is as it was;
    /// the copy is skipped when room is certain. Cells shared with other sequences come back
    /// as copies of their own, so they may not fit again: the branch is then left empty and
    /// without logits, never with logits its cache no longer holds.
    fn reprefill(
        &mut self,
        cell: &Arc<BranchCell>,
        tokens: Vec<Token>,
        what: &'static str,
    ) -> Result<()> {
        if tokens.is_empty() {
            return Err(Error::invalid(
                what,
                "nothing to re-prefill: give sink tokens or a tail > 0",
            ));
        }
        let n_ctx = self.shared().n_ctx;
        if tokens.len() >= n_ctx as usize {
            return Err(Error::invalid(
                what,
                format!(
                    "{} kept tokens leave no room in n_ctx = {n_ctx}",
                    tokens.len(),
                ),
            ));
        }
        self.give_leases(&[cell])?;
        // Parked branches anchored on the cells about to go move off them first.
        self.before_cells_go(cell)?;
        let seq = cell.seq();
        let undo = if self.room_is_certain(seq, tokens.len()) {
            None
        } else {
            Some(self.ctx().kv_state(Some(seq))?)
        };
        self.empty_seq(seq)?;
        self.sever(cell);
        let record = cell.lock().sequence_emptied();
        let carry = cell.lock().utf8_carry();
        let Err(e) = self.prefill(&[&(cell.clone(), tokens)]) else {
            cell.lock().set_utf8_carry(carry);
            return Ok(());
        };
        let restored = undo.is_some_and(|cells| {
            self.empty_seq(seq).is_ok() && self.ctx_mut().set_kv_state(Some(seq), &cells).is_ok()
        });
        let mut st = cell.lock();
        if restored {
            st.sequence_restored(record);
            Err(e.noted("the branch is unchanged"))
        } else {
            st.forget_logits();
            Err(e.noted("the branch is now empty, at position 0: prefill it again"))
        }
    }

    /// Whether `n` tokens surely find cells once `seq` is emptied: the other sequences'
    /// cells (counted per sequence, shared ones more than once: an upper bound) leave room,
    /// and no sliding-window layer places cells by rules of its own.
    fn room_is_certain(&self, seq: Seq, n: usize) -> bool {
        let own = self
            .ctx()
            .seq_pos_max(seq)
            .map_or(0, |max| (max + 1).max(0) as usize);
        let others = self.cells_in_use().saturating_sub(own);
        self.shared().model.n_swa() == 0 && others + n <= self.shared().n_ctx as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reseed_keeps_the_sinks_and_the_tail_of_the_whole_sequence() {
        let tokens = [1, 2, 3, 4, 5, 6, 7, 8];
        assert_eq!(reseeded(&tokens, &[9], 3), [9, 6, 7, 8]);
        // Sinks the sequence starts with are not repeated by a long tail.
        assert_eq!(reseeded(&tokens, &[1, 2], 3), [1, 2, 6, 7, 8]);
        assert_eq!(reseeded(&tokens, &[1, 2], 100), tokens);
        assert_eq!(reseeded(&tokens, &[], 0), Vec::<Token>::new());
    }

    #[test]
    fn a_shift_keeps_the_first_tokens_and_the_recent_half_of_the_rest() {
        let tokens: Vec<Token> = (0..10).collect();
        assert_eq!(shifted(&tokens, 4), [0, 1, 2, 3, 7, 8, 9]);
        assert_eq!(shifted(&tokens, 0), [5, 6, 7, 8, 9]);
        assert_eq!(shifted(&tokens, 9), tokens);
        assert_eq!(shifted(&tokens, 20), tokens);
        assert_eq!(shifted(&[], 4), Vec::<Token>::new());
    }
}
