//! `Branch::score` and `BranchStore::score` on the engine thread: each branch's tokens
//! decoded with an output at every position, the branches' runs packed together into decodes
//! of at most `SCORE_ROWS` outputs, each row read for the next token's log-probability before
//! the next decode overwrites it. All or nothing, as a prefill.

use std::sync::Arc;

use kvfork_core::metrics;

use super::adapters::group_by_adapters;
use super::shared::BranchCell;
use super::{PrefillItem, Worker};
use crate::branch_state::LogitsSnapshot;
use crate::error::{Error, Result};
use crate::llama_ctx::{Output, OutputRef};
use crate::model::Token;
use crate::token_score::TokenScore;

/// Most outputs of one scoring decode. llama.cpp keeps an output buffer of rows × vocabulary
/// floats as large as the largest decode asked for (64 MiB for a 262k vocabulary here).
const SCORE_ROWS: usize = 64;

/// What a score has gathered so far: each item's scores and last row.
struct Scored {
    scores: Vec<Vec<TokenScore>>,
    lasts: Vec<Option<Output>>,
}

impl Worker {
    /// Decode each item's tokens into its branch with every row read (see the module).
    pub(crate) fn score(
        &mut self,
        items: &[PrefillItem],
        top: usize,
    ) -> Result<Vec<Vec<TokenScore>>> {
        let mut starts = Vec::with_capacity(items.len());
        for (cell, tokens) in items {
            starts.push(self.place(cell, tokens.len())?);
        }
        // A first token is scored from its branch's snapshot: refused before any decode.
        for (cell, tokens) in items {
            if !tokens.is_empty() && !cell.lock().logits().has_output() {
                return Err(LogitsSnapshot::no_logits_yet());
            }
        }
        let top = top.min(self.ctx().n_vocab);
        let live: Vec<usize> = (0..items.len())
            .filter(|&i| !items[i].1.is_empty())
            .collect();
        let mut got = Scored {
            scores: items
                .iter()
                .map(|(_, t)| Vec::with_capacity(t.len()))
                .collect(),
            lasts: vec![None; items.len()],
        };
        // With `park`, at most as many branches at a time as there are leases.
        let room = if self.parks() {
            self.shared().n_seq_max as usize
        } else {
            live.len().max(1)
        };
        let decoded = live
            .chunks(room)
            .try_for_each(|group| self.score_group(items, &starts, group, top, &mut got));
        if let Err(e) = decoded {
            for &i in &live {
                self.truncate(&items[i].0, starts[i]);
            }
            return Err(e);
        }
        for &i in &live {
            let (cell, tokens) = &items[i];
            cell.lock().prefilled(tokens, got.lasts[i].as_ref());
        }
        Ok(got.scores)
    }

    /// The decodes of `score` for `group` (indices into `items`, all holding a lease at
    /// once). On failure the caller removes what was written.
    fn score_group(
        &mut self,
        items: &[PrefillItem],
        starts: &[i32],
        group: &[usize],
        top: usize,
        got: &mut Scored,
    ) -> Result<()> {
        let cells: Vec<&Arc<BranchCell>> = group.iter().map(|&i| &items[i].0).collect();
        self.give_leases(&cells)?;
        for &i in group {
            let (cell, tokens) = &items[i];
            self.guard_window(cell, starts[i] + tokens.len() as i32 - 1)?;
            // A row the device drew from holds only its best candidates: the whole row first.
            self.refresh_drawn(cell)?;
            let first = score_row(cell.lock().logits().require()?, tokens[0], top);
            got.scores[i].push(first);
            if !self.parks() {
                // A recurrent state rolls back to a checkpoint: one where the scoring starts.
                self.take_checkpoint(cell, starts[i])?;
            }
        }
        let rows = SCORE_ROWS.min(self.ctx().n_batch as usize).max(1);
        // Branches under different adapters are decoded apart.
        for (set, members) in group_by_adapters(&cells) {
            // Every (item, token) of the members, each item's run in order.
            let entries: Vec<(usize, usize)> = members
                .iter()
                .flat_map(|&m| (0..items[group[m]].1.len()).map(move |j| (group[m], j)))
                .collect();
            for chunk in entries.chunks(rows) {
                self.use_adapters(&set)?;
                let batch = self.start_batch();
                for &(i, j) in chunk {
                    let (cell, tokens) = &items[i];
                    batch.push(tokens[j], starts[i] + j as i32, cell.seq(), true);
                    // On a device-sampling context: rows, not draws.
                    batch.want_row(cell.seq());
                }
                self.decode()?;
                for (k, &(i, j)) in chunk.iter().enumerate() {
                    let OutputRef::Row(row) = self.ctx().output_ith(k)? else {
                        return Err(Error::Internal("a scoring decode gave no row".into()));
                    };
                    match items[i].1.get(j + 1) {
                        Some(&next) => got.scores[i].push(score_row(row, next, top)),
                        None => got.lasts[i] = Some(Output::Row(row.to_vec())),
                    }
                }
                // Recurrent models: a checkpoint where each run's part of the chunk ends, as a
                // prefill keeps them.
                for (k, &(i, j)) in chunk.iter().enumerate() {
                    if chunk.get(k + 1).is_none_or(|&(next, _)| next != i) {
                        self.take_checkpoint(&items[i].0, starts[i] + j as i32 + 1)?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// `token`'s log-probability under `row` and the `top` best of it: one pass over the row
/// (`metrics::summarize`, the snapshot's own summary: the same numbers as `logprob` and
/// `top_logprobs` on a branch holding that row).
fn score_row(row: &[f32], token: Token, top: usize) -> TokenScore {
    let mut best = Vec::new();
    let lse = metrics::summarize(row, top, &mut best).log_sum_exp;
    let logit = row[token as usize];
    let logprob = if logit == f32::NEG_INFINITY {
        f64::NEG_INFINITY
    } else {
        f64::from(logit) - lse
    };
    TokenScore {
        logprob,
        top: best
            .into_iter()
            .map(|i| (i as Token, f64::from(row[i as usize]) - lse))
            .collect(),
    }
}
