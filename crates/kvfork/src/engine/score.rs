//! `Branch::score` on the engine thread: the tokens decoded into the branch in chunks with
//! an output at every position, each row read for the next token's log-probability before
//! the next chunk's decode overwrites it. All or nothing, as a prefill.

use std::sync::Arc;

use kvfork_core::metrics::{log_sum_exp, top_k_sorted};

use super::shared::BranchCell;
use super::Worker;
use crate::error::{Error, Result};
use crate::llama_ctx::{Output, OutputRef};
use crate::model::Token;
use crate::token_score::TokenScore;

/// Most outputs of one scoring decode. llama.cpp keeps an output buffer of rows × vocabulary
/// floats as large as the largest decode asked for (64 MiB for a 262k vocabulary here).
const SCORE_ROWS: usize = 64;

impl Worker {
    /// Decode `tokens` into `cell` with every row read (see the module).
    pub(crate) fn score(
        &mut self,
        cell: &Arc<BranchCell>,
        tokens: &[Token],
        top: usize,
    ) -> Result<Vec<TokenScore>> {
        let start = self.place(cell, tokens.len())?;
        let Some(&first) = tokens.first() else {
            return Ok(Vec::new());
        };
        let top = top.min(self.ctx().n_vocab);
        self.give_leases(&[cell])?;
        self.guard_window(cell, start + tokens.len() as i32 - 1)?;
        // A row the device drew from holds only its best candidates: the whole row first.
        self.refresh_drawn(cell)?;
        let mut scores = Vec::with_capacity(tokens.len());
        scores.push(score_row(cell.lock().logits().require()?, first, top));
        if !self.parks() {
            // A recurrent state rolls back to a checkpoint: one where the scoring starts.
            self.take_checkpoint(cell, start)?;
        }
        let decoded = self.score_chunks(cell, tokens, start, top, &mut scores);
        let last = match decoded {
            Ok(last) => last,
            Err(e) => {
                self.truncate(cell, start);
                return Err(e);
            }
        };
        cell.lock().prefilled(tokens, Some(&last));
        Ok(scores)
    }

    /// The decodes of `score`: each row but the last scores the token after it; the last
    /// row is returned (the branch's new snapshot). On failure the caller removes what was
    /// written.
    fn score_chunks(
        &mut self,
        cell: &Arc<BranchCell>,
        tokens: &[Token],
        start: i32,
        top: usize,
        scores: &mut Vec<TokenScore>,
    ) -> Result<Output> {
        let seq = cell.seq();
        let adapters = cell.lock().adapters().clone();
        let rows = SCORE_ROWS.min(self.ctx().n_batch as usize).max(1);
        let mut last = None;
        for (c, chunk) in tokens.chunks(rows).enumerate() {
            let first = c * rows;
            self.use_adapters(&adapters)?;
            let batch = self.start_batch();
            for (j, &t) in chunk.iter().enumerate() {
                batch.push(t, start + (first + j) as i32, seq, true);
            }
            // On a device-sampling context: rows, not draws.
            batch.want_row(seq);
            self.decode()?;
            for j in 0..chunk.len() {
                let OutputRef::Row(row) = self.ctx().output_ith(j)? else {
                    return Err(Error::Internal("a scoring decode gave no row".into()));
                };
                match tokens.get(first + j + 1) {
                    Some(&next) => scores.push(score_row(row, next, top)),
                    None => last = Some(Output::Row(row.to_vec())),
                }
            }
            // Recurrent models: a checkpoint where each chunk ends, as a prefill keeps them.
            self.take_checkpoint(cell, start + (first + chunk.len()) as i32)?;
        }
        last.ok_or_else(|| Error::Internal("a scoring run decoded nothing".into()))
    }
}

/// `token`'s log-probability under `row` and the `top` best of it.
fn score_row(row: &[f32], token: Token, top: usize) -> TokenScore {
    let lse = log_sum_exp(row);
    let logit = row[token as usize];
    let logprob = if logit == f32::NEG_INFINITY {
        f64::NEG_INFINITY
    } else {
        f64::from(logit) - lse
    };
    let mut best = Vec::new();
    top_k_sorted(row, top, &mut best);
    TokenScore {
        logprob,
        top: best
            .into_iter()
            .map(|i| (i as Token, f64::from(row[i as usize]) - lse))
            .collect(),
    }
}
