//! `Branch::share_prefix` on the engine thread: a fresh branch takes over the first cells of
//! another branch's sequence (a fork at a position inside it), for the prefix cache.

use std::sync::Arc;

use super::{BranchCell, Worker};
use crate::error::Result;
use crate::model::Token;

impl Worker {
    /// Copy `source`'s cells for `prefix` into `target`'s empty sequence, which then holds
    /// them. False, with nothing done, when `source` was pruned or no longer holds `prefix`
    /// (it was reseeded), or `target` is not empty. Runs between decodes, so the cells
    /// copied are exactly those `source` held for these tokens.
    pub(crate) fn share_prefix(
        &mut self,
        source: &Arc<BranchCell>,
        target: &Arc<BranchCell>,
        prefix: &[Token],
    ) -> Result<bool> {
        if source.is_disposed() || target.is_disposed() {
            return Ok(false);
        }
        {
            let src = source.lock();
            if !src.history().starts_with(prefix) || (src.position() as usize) < prefix.len() {
                return Ok(false);
            }
        }
        if target.lock().position() != 0 {
            return Ok(false);
        }
        self.give_leases(&[source, target])?;
        let mut dst = target.lock();
        self.ctx_mut()
            .seq_cp(source.seq(), target.seq(), 0, prefix.len() as i32)?;
        dst.decoded(prefix);
        Ok(true)
    }
}
