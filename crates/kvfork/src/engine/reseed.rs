//! `Branch::reseed_context` on the engine thread (infinite context): the branch's sequence
//! is emptied, then its sink tokens and the tail of its accepted tokens are prefilled from
//! position 0, so generation can go on past `n_ctx`.

use std::sync::Arc;

use super::shared::BranchCell;
use super::Worker;
use crate::error::{Error, Result};
use crate::model::Token;

impl Worker {
    /// Empty the sequence, then prefill the sinks and the last `tail` accepted tokens from
    /// position 0. If the prefill fails the branch is left empty at position 0.
    pub(crate) fn reseed_context(
        &mut self,
        cell: &Arc<BranchCell>,
        sinks: &[Token],
        tail: usize,
    ) -> Result<()> {
        let tokens = {
            let st = cell.lock();
            let accepted = st.accepted();
            let kept = &accepted[accepted.len().saturating_sub(tail)..];
            [sinks, kept].concat()
        };
        if tokens.is_empty() {
            return Err(Error::invalid(
                "sinks/tail",
                "nothing to re-prefill: give sink tokens or a tail > 0",
            ));
        }
        let n_ctx = self.shared().n_ctx;
        if tokens.len() >= n_ctx as usize {
            return Err(Error::invalid(
                "sinks/tail",
                format!(
                    "{} sink + tail tokens leave no room in n_ctx = {n_ctx}",
                    tokens.len(),
                ),
            ));
        }
        self.give_leases(&[cell])?;
        // Parked branches anchored on the cells about to go move off them first.
        self.before_cells_go(cell)?;
        self.ctx_mut().seq_rm(cell.seq(), -1, -1)?;
        self.sever(cell);
        cell.lock().sequence_emptied();
        self.prefill(&[&(cell.clone(), tokens)])
    }
}
