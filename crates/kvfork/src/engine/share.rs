//! `Branch::share_prefix` on the engine thread: a fresh branch takes over the first cells of
//! another branch's sequence (a fork at a position inside it), for the prefix cache.

use std::sync::Arc;

use super::{BranchCell, Worker};
use crate::error::Result;
use crate::model::Token;

impl Worker {
    /// Copy `source`'s cells for `prefix` into `target`'s empty sequence, which then holds
    /// them; how many tokens of it were shared: all on a KV cache, on a recurrent state
    /// those up to its last checkpoint inside the prefix (`checkpoints.rs`). 0, with nothing
    /// done, when `source` was pruned or no longer holds `prefix` (it was reseeded), or
    /// `target` is not empty. Runs between decodes, so the cells copied are exactly those
    /// `source` held for these tokens.
    pub(crate) fn share_prefix(
        &mut self,
        source: &Arc<BranchCell>,
        target: &Arc<BranchCell>,
        prefix: &[Token],
    ) -> Result<usize> {
        if source.is_disposed() || target.is_disposed() {
            return Ok(0);
        }
        {
            let src = source.lock();
            if !src.history().starts_with(prefix) || (src.position() as usize) < prefix.len() {
                return Ok(0);
            }
        }
        if target.lock().position() != 0 {
            return Ok(0);
        }
        self.give_leases(&[source, target])?;
        let shared = self.copy_prefix(source, target, prefix)?;
        target.lock().decoded(&prefix[..shared]);
        Ok(shared)
    }
}
