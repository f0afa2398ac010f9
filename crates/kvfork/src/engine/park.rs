//! Parked branches (`park=True` contexts): more branches than KV sequences.
//!
//! # Design
//!
//! A branch's KV is every cell tagged with its sequence: positions `[0, position)`. With a
//! unified cache a fork only tags its parent's cells, so relatives share their common prefix.
//! The bookkeeping lives in `kvfork_core::park` (the KV tree, anchors, LRU); this file does
//! the KV work it implies, on the engine thread, through llama.cpp's per-sequence state
//! (`llama_state_seq_get_data` / `set_data`).
//!
//! - **Park** `v` (evicted, least recently used among the active branches the current
//!   operation does not use): its nearest active ancestor `a` still holds `v`'s first `k`
//!   cells (`k` = the least fork head on the way). `v`'s tags below `k` are dropped
//!   (`seq_rm(v, 0, k)`: the cells stay, `a` holds them), the sequence, now `[k, end)`, is
//!   copied to the host and emptied, and its lease is free. Host memory holds only `v`'s own
//!   cells; shared ones stay in the cache.
//! - **Anchors stay active.** Before `v`'s cells go (parked, `prune(keep_children=True)`,
//!   `reseed_context`), each parked branch anchored on `v` moves to the nearest other active
//!   ancestor `a'` sharing `k' <= k`, and the cells `[k', k)` are first copied from `v` to
//!   the host as its new first segment: through the scratch sequence (`seq_cp(v, scratch,
//!   k', k)`, copy out, empty). So a parked branch never depends on a parked one.
//! - **Unpark** `p` on a free lease `L` (evicting first when none is free): each host
//!   segment is loaded (`set_data` empties its target, so the first goes straight into `L`,
//!   later ones into the scratch sequence, then `seq_cp` into `L`), then the anchor's cells
//!   `[0, k)` are tagged with `L` (`seq_cp(a, L, 0, k)`, no tensor copy), then `L` is cut at
//!   `end` (a rolled-back decode). The cells, their positions and contents are those the
//!   branch had, but not necessarily their order in the buffer (a restored cell may land in
//!   a hole below older ones, as a new cell may after any prune): llama.cpp's attention
//!   sums in cell order, so results equal those with enough leases up to that noise
//!   (tokens up to the first near-tie, as everywhere in kvfork).
//! - **Who is evicted.** Every operation that needs KV admits its branches first
//!   (`Worker::give_leases`); its own branches are never evicted while it runs. An operation over
//!   more branches than leases (a `BranchStore` step or prefill) runs in groups that fit,
//!   admitted one after another, still one rollback unit (see `commit.rs`, `prefill.rs`).
//! - **Sliding-window layers.** llama.cpp may reuse a cell held by one sequence once it is
//!   outside that sequence's window. A parked branch's cells are held by its anchor alone,
//!   so before a decode moves an anchor more than a window past what a dependent still
//!   needs, the dependent is re-anchored (`guard_window`; the rule is that of llama.cpp's
//!   standard window, which Gemma 3 uses).
//!
//! Raw `kv_*` calls bypass all of this (as they bypass tenancy).

use std::collections::HashSet;
use std::sync::Arc;

use kvfork_core::{Handle, Parked, Segment};

use super::shared::{BranchCell, Stats};
use super::Worker;
use crate::error::{Error, Result};
use crate::seq::Seq;

/// Branch slots of a `park` context: how many branches may exist ("slots are how many
/// branches can exist, leases how many can decode").
pub(super) const SLOTS: u32 = 65_536;

impl Worker {
    /// Whether this context parks branches.
    pub(super) fn parks(&self) -> bool {
        self.shared().park.is_some()
    }

    /// The sequence no branch leases, for copies in and out of host memory (`park` only).
    fn scratch(&self) -> Seq {
        Seq::new(self.shared().n_seq_max)
    }

    /// Give every branch of `cells` a lease (unparking those parked, evicting the least
    /// recently used others when none is free) and mark them used. A no-op without `park`.
    /// Fails with `LeaseExhausted` when they are more than the leases.
    pub(super) fn give_leases(&mut self, cells: &[&Arc<BranchCell>]) -> Result<()> {
        if !self.parks() {
            return Ok(());
        }
        let busy: HashSet<Handle> = cells.iter().filter_map(|c| c.handle()).collect();
        for cell in cells {
            let Some(h) = cell.handle() else { continue };
            if cell.is_parked() && !cell.is_disposed() {
                self.make_room(&busy)?;
                self.unpark(h, cell)?;
            }
            if let Some(mut l) = self.shared().ledger() {
                l.touch(h);
            }
        }
        Ok(())
    }

    /// Free a lease when none is: park the least recently used branch not in `busy`.
    fn make_room(&mut self, busy: &HashSet<Handle>) -> Result<()> {
        let victim = {
            let Some(l) = self.shared().ledger() else {
                return Ok(());
            };
            if l.available() > 0 {
                return Ok(());
            }
            // Only when one operation needs more branches at once than there are leases.
            l.victim(busy).ok_or(Error::LeaseExhausted {
                n_seq_max: l.n_leases(),
            })?
        };
        self.park(victim)
    }

    /// The cell of a live branch.
    fn cell_of(&self, h: Handle) -> Result<Arc<BranchCell>> {
        self.shared()
            .registry()
            .data(h)
            .cloned()
            .ok_or_else(|| Error::Internal(format!("branch {h} is in the ledger only")))
    }

    /// Move active branch `v`'s own cells to host memory and free its lease.
    fn park(&mut self, v: Handle) -> Result<()> {
        let cell = self.cell_of(v)?;
        let seq = cell.seq();
        self.release_dependents(v, seq, |_, _, _| true)?;
        let hi = self.ctx().seq_pos_max(seq)? + 1;
        let anchor = self.window_safe(self.ledger_anchor(v, None), hi as i64)?;
        let k = anchor.map_or(0, |(_, k)| k);
        // Taken first: the anchor's cells come with the anchor's state (see `Parked::state`).
        let state = if self.keeps_checkpoints() {
            Some(self.ctx().recurrent_state(seq)?)
        } else {
            None
        };
        let mut segments = Vec::new();
        if hi > k as i32 {
            if k > 0 {
                self.ctx_mut().seq_rm(seq, 0, k as i32)?;
            }
            let data = self.ctx().kv_state(Some(seq))?;
            segments.push(Segment {
                lo: k,
                hi: hi as u32,
                data,
            });
        }
        self.empty_seq(seq)?;
        let record = Parked {
            anchor,
            segments,
            end: None,
            state,
        };
        self.with_ledger(|l| l.park(v, record).map_err(Error::from))?;
        cell.set_seq(None);
        Stats::add(&self.shared().stats.parks, 1);
        Ok(())
    }

    /// Load parked branch `h`'s cells onto a free lease (the caller made room).
    fn unpark(&mut self, h: Handle, cell: &Arc<BranchCell>) -> Result<()> {
        let (seq, record) = self
            .with_ledger(|l| Ok(l.unpark(h)))?
            .ok_or_else(|| Error::Internal(format!("branch {h} could not be unparked")))?;
        let seq = Seq::new(seq);
        match self.load(seq, &record) {
            Ok(()) => {
                cell.set_seq(Some(seq));
                Stats::add(&self.shared().stats.unparks, 1);
                Ok(())
            }
            Err(e) => {
                let _ = self.empty_seq(seq);
                self.with_ledger(|l| l.park(h, record).map_err(Error::from))?;
                Err(e)
            }
        }
    }

    /// Rebuild a parked record's cells in the empty sequence `seq`.
    fn load(&mut self, seq: Seq, record: &Parked) -> Result<()> {
        let scratch = self.scratch();
        for (i, s) in record.segments.iter().enumerate() {
            if i == 0 {
                self.ctx_mut().set_kv_state(Some(seq), &s.data)?;
            } else {
                let ctx = self.ctx_mut();
                let copied = ctx
                    .set_kv_state(Some(scratch), &s.data)
                    .and_then(|_| ctx.seq_cp(scratch, seq, s.lo as i32, s.hi as i32));
                ctx.seq_rm(scratch, -1, -1)?;
                copied?;
            }
        }
        if let Some((a, k)) = record.anchor {
            let holder = self.cell_of(a)?.seq();
            self.ctx_mut().seq_cp(holder, seq, 0, k as i32)?;
        }
        if let Some(state) = &record.state {
            // After the anchor's cells, which bring the anchor's own state along.
            self.ctx_mut().set_recurrent_state(seq, state)?;
        }
        if let Some(end) = record.end {
            self.ctx_mut().seq_rm(seq, end as i32, -1)?;
        }
        Ok(())
    }

    /// Re-anchor the parked branches anchored on active `v` (on `seq`) before its cells go,
    /// copying to the host the cells between their new anchor and `v`; only those for which
    /// `needs(dependent, k)` holds.
    fn release_dependents(
        &mut self,
        v: Handle,
        seq: Seq,
        needs: impl Fn(&Self, Handle, u32) -> bool,
    ) -> Result<()> {
        let dependents = self.with_ledger(|l| Ok(l.dependents(v)))?;
        for d in dependents {
            let anchored = self.with_ledger(|l| Ok(l.parked(d).and_then(|p| p.anchor)))?;
            let Some((_, k)) = anchored else { continue };
            if !needs(self, d, k) {
                continue;
            }
            let pos = self.cell_of(d)?.lock().position() as i64;
            let next = self.ledger_anchor(d, Some(v)).map(|(a, k2)| (a, k2.min(k)));
            let next = self.window_safe(next, pos)?;
            let lo = next.map_or(0, |(_, k2)| k2);
            let front = if lo < k {
                Some(self.capture(seq, lo, k)?)
            } else {
                None
            };
            self.with_ledger(|l| {
                l.reanchor(d, next, front);
                Ok(())
            })?;
        }
        Ok(())
    }

    /// The anchor `(a, k)` found for a branch at `pos`, with `k` cut to what `a` still holds
    /// for it (None when nothing is left). On a model with sliding-window layers the branch
    /// still reads its first `k` cells there from `pos - n_swa` on; an anchor that already
    /// moved a window past them may have lost them (only its tag held them, and llama.cpp
    /// reuses such cells), so the branch keeps its own copy from that point. (`guard_window`
    /// keeps an anchor from moving past later; this is an anchor chosen after it moved.)
    fn window_safe(&self, found: Option<(Handle, u32)>, pos: i64) -> Result<Option<(Handle, u32)>> {
        let Some((a, k)) = found else {
            return Ok(None);
        };
        let n_swa = self.shared().model.n_swa() as i64;
        let floor = (pos - n_swa).max(0);
        let k = if n_swa == 0 || floor >= k as i64 {
            k
        } else {
            let last = self.ctx().seq_pos_max(self.cell_of(a)?.seq())? as i64;
            // One past the highest position llama.cpp may have reused (as in `guard_window`).
            let reusable_below = last + 2 - n_swa;
            if reusable_below <= floor {
                k
            } else {
                floor as u32
            }
        };
        Ok((k > 0).then_some((a, k)))
    }

    /// Host copy of `seq`'s cells at `[lo, hi)`, through the scratch sequence.
    fn capture(&mut self, seq: Seq, lo: u32, hi: u32) -> Result<Segment> {
        let scratch = self.scratch();
        self.ctx_mut().seq_cp(seq, scratch, lo as i32, hi as i32)?;
        let data = self.ctx().kv_state(Some(scratch));
        self.ctx_mut().seq_rm(scratch, -1, -1)?;
        Ok(Segment {
            lo,
            hi,
            data: data?,
        })
    }

    fn ledger_anchor(&self, h: Handle, skip: Option<Handle>) -> Option<(Handle, u32)> {
        self.shared().ledger().and_then(|l| l.anchor_for(h, skip))
    }

    fn with_ledger<T>(
        &self,
        f: impl FnOnce(&mut kvfork_core::ParkLedger) -> Result<T>,
    ) -> Result<T> {
        let mut l = self
            .shared()
            .ledger()
            .ok_or_else(|| Error::Internal("no ledger on this context".into()))?;
        f(&mut l)
    }

    /// A fork `child` was born parked on `parent`'s cells: on a recurrent model it keeps the
    /// parent's state now, which the parent's cells no longer hold once it goes on.
    pub(super) fn born_parked(
        &mut self,
        parent: &Arc<BranchCell>,
        child: &Arc<BranchCell>,
    ) -> Result<()> {
        let Some(h) = child.handle() else {
            return Ok(());
        };
        if self.keeps_checkpoints() {
            let state = self.ctx().recurrent_state(parent.seq())?;
            self.with_ledger(|l| {
                l.keep_state(h, state);
                Ok(())
            })?;
        }
        Ok(())
    }

    /// Before `cell` (active) loses its cells (`prune_keep_children`, `reseed_context`):
    /// its dependents move to other anchors. A no-op without `park`.
    pub(super) fn before_cells_go(&mut self, cell: &Arc<BranchCell>) -> Result<()> {
        match cell.handle() {
            Some(h) if self.parks() && !cell.is_parked() => {
                self.release_dependents(h, cell.seq(), |_, _, _| true)
            }
            _ => Ok(()),
        }
    }

    /// A decode is about to put `cell`'s cells up to position `last`. On a model with
    /// sliding-window layers llama.cpp may then reuse, in those layers, cells that only
    /// `cell` holds once they are a window behind `last` (with a standard window: positions
    /// up to `last + 1 - n_swa`). A dependent at position `pos` still reads its anchor's
    /// cells from `pos - n_swa` to `k` there, so one that needs any cell that may be reused is
    /// re-anchored (its cells copied out) first. A no-op without `park`.
    pub(super) fn guard_window(&mut self, cell: &Arc<BranchCell>, last: i32) -> Result<()> {
        if !self.parks() || cell.is_parked() {
            return Ok(()); // (every decode of a context without `park` passes here)
        }
        let n_swa = self.shared().model.n_swa() as i64;
        let Some(h) = cell.handle() else {
            return Ok(());
        };
        if n_swa == 0 {
            return Ok(());
        }
        // One past the highest position that may be reused.
        let reusable_below = last as i64 + 2 - n_swa;
        if reusable_below <= 0 {
            return Ok(());
        }
        self.release_dependents(h, cell.seq(), |w, d, k| {
            let pos = w.cell_of(d).map_or(0, |c| c.lock().position()) as i64;
            let floor = (pos - n_swa).max(0);
            floor < k as i64 && floor < reusable_below
        })
    }

    /// `cell` emptied its sequence to fill it anew (`reseed_context`): it shares no cell
    /// with its relatives any more. A no-op without `park`.
    pub(super) fn sever(&mut self, cell: &Arc<BranchCell>) {
        if let (Some(h), Some(mut l)) = (cell.handle(), self.shared().ledger()) {
            l.sever(h);
        }
    }

    /// Cut `cell`'s KV at `pos` after a failed decode: its sequence if active, its parked
    /// record otherwise.
    pub(super) fn truncate(&mut self, cell: &Arc<BranchCell>, pos: i32) {
        if cell.is_parked() {
            if let (Some(h), Some(mut l)) = (cell.handle(), self.shared().ledger()) {
                l.truncate(h, pos.max(0) as u32);
            }
        } else {
            // Best effort, as a rollback: a recurrent state decodes from a checkpoint again.
            let _ = self.rewind(cell, pos);
        }
    }

    /// Take `h` out of the ledger (pruned); its sequence, if it held one, is returned to be
    /// emptied.
    pub(super) fn forget(&mut self, h: Handle) -> Option<Seq> {
        self.shared()
            .ledger()
            .and_then(|mut l| l.remove(h))
            .map(Seq::new)
    }

    /// Empty `seq` for `cell`'s fresh lease, unless the lease moved since (`Branch::create`).
    pub(crate) fn clear_if_held(&mut self, cell: &Arc<BranchCell>, seq: Seq) {
        if !cell.is_disposed() && !cell.is_parked() && cell.seq() == seq {
            let _ = self.empty_seq(seq);
        }
    }

    /// How many branches one decode may hold: `n_batch`, and the leases with `park`.
    pub(super) fn decode_room(&self) -> usize {
        let n_batch = self.ctx().n_batch as usize;
        if self.parks() {
            n_batch.min(self.shared().n_seq_max as usize)
        } else {
            n_batch
        }
    }
}
