//! A branch's logits snapshot: the row of its last decode, shared with forks until either
//! side takes a new one (a fork copies no row), with its log-partition and argmax computed
//! in the same pass as the copy.

use std::sync::Arc;

use kvfork_core::metrics::{self, RowSummary};

use crate::error::{Error, Result};
use crate::model::Token;

#[derive(Clone)]
pub(crate) struct LogitsSnapshot {
    row: Arc<[f32]>,
    present: bool,
    /// Bumped on every new row.
    version: u64,
    /// Log-partition and argmax of `row` (valid with `present`).
    summary: RowSummary,
}

impl LogitsSnapshot {
    pub fn empty() -> Self {
        LogitsSnapshot {
            row: Arc::from(Vec::new()),
            present: false,
            version: 0,
            summary: RowSummary {
                log_sum_exp: f64::NEG_INFINITY,
                argmax: 0,
            },
        }
    }

    pub fn row(&self) -> Option<&[f32]> {
        self.present.then_some(&self.row[..])
    }

    pub fn shared(&self) -> Option<Arc<[f32]>> {
        self.present.then(|| self.row.clone())
    }

    pub fn require(&self) -> Result<&[f32]> {
        self.row().ok_or_else(|| {
            Error::Other("the branch has no logits yet: prefill or commit a token first".into())
        })
    }

    pub fn version(&self) -> u64 {
        self.version
    }

    /// The best raw token (valid once a row is present).
    pub fn argmax(&self) -> usize {
        self.summary.argmax
    }

    /// Take a new row.
    pub fn set(&mut self, row: &[f32]) {
        let own = match Arc::get_mut(&mut self.row) {
            Some(own) if own.len() == row.len() => own,
            // Shared with a fork (or first use): start a buffer of our own.
            _ => {
                self.row = Arc::from(vec![0.0; row.len()]);
                Arc::get_mut(&mut self.row).expect("a fresh Arc is unique")
            }
        };
        self.summary = metrics::copy_and_summarize(row, own);
        self.present = true;
        self.version += 1;
    }

    /// Model-level surprisal of `token` in nats.
    pub fn surprisal(&self, token: Token) -> Result<f64> {
        let logit = f64::from(self.require()?[token as usize]);
        Ok(if logit == f64::NEG_INFINITY {
            f64::INFINITY
        } else {
            self.summary.log_sum_exp - logit
        })
    }

    /// The `k` most likely tokens with their natural-log probabilities, best first (ties:
    /// lower token id first). Fewer when fewer logits are finite.
    pub fn top_logprobs(&self, k: usize) -> Result<Vec<(Token, f64)>> {
        let logits = self.require()?;
        let mut idx = Vec::new();
        metrics::top_k_indices(logits, k.min(logits.len()), &mut idx);
        let lse = self.summary.log_sum_exp;
        let mut out: Vec<(Token, f64)> = idx
            .into_iter()
            .map(|i| (i as Token, f64::from(logits[i as usize]) - lse))
            .collect();
        out.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        Ok(out)
    }

    /// Entropy in nats.
    pub fn entropy(&self) -> Result<f64> {
        Ok(metrics::entropy(self.require()?))
    }
}
