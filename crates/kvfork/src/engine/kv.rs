//! The raw KV operations of `Context::kv_*` on the engine thread. They bypass branch
//! tenancy: the caller checked the sequence ids and positions, nothing else.

use super::Worker;
use crate::error::Result;
use crate::seq::Seq;

impl Worker {
    /// `Context::kv_seq_copy`: tag the cells of `src` in `[p0, p1)` as also `dst`'s.
    pub(crate) fn kv_seq_copy(&mut self, src: Seq, dst: Seq, p0: i32, p1: i32) -> Result<()> {
        self.ctx_mut().seq_cp(src, dst, p0, p1)
    }

    /// `Context::kv_seq_keep`: remove every sequence but `seq`.
    pub(crate) fn kv_seq_keep(&mut self, seq: Seq) -> Result<()> {
        self.shared().outputs().keep_only(seq);
        self.ctx_mut().seq_keep(seq)
    }

    /// `Context::kv_seq_remove`: remove `seq`'s cells in `[p0, p1)`; false when the model
    /// cannot.
    pub(crate) fn kv_seq_remove(&mut self, seq: Seq, p0: i32, p1: i32) -> Result<bool> {
        self.ctx_mut().seq_rm(seq, p0, p1)
    }

    /// `Context::kv_seq_pos_max`: the largest position `seq` holds, -1 when empty.
    pub(crate) fn kv_seq_pos_max(&self, seq: Seq) -> Result<i32> {
        self.ctx().seq_pos_max(seq)
    }

    /// `Context::kv_clear`: empty the whole cache.
    pub(crate) fn kv_clear(&mut self) {
        self.shared().outputs().clear();
        self.ctx_mut().clear();
    }
}
