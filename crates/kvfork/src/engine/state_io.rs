//! Saving and loading branches and whole contexts. A file is sealed by
//! `kvfork_core::state_file` (version, model identity, checksum) and is fully verified and
//! parsed before anything reaches llama.cpp, which trusts the KV bytes it is given.
//!
//! - Branch file: the branch's record, then its sequence's KV cells.
//! - Context file: every live branch (parents first: parent index, fork head, sequence id,
//!   record), then the KV cells of all sequences at once, so shared prefixes stay shared.
//!
//! In-memory snapshots (`Branch::snapshot`, `Context::snapshot`) are the same bytes a file
//! holds, and restoring them runs the same checks.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvfork_core::checkpoints::Checkpoints;
use kvfork_core::state_file::{self, Kind, Reader, Writer};
use kvfork_core::{Handle, Registry};

use super::shared::{BranchCell, Stats};
use super::Worker;
use crate::branch_state::{state_error, BranchState};
use crate::error::{Error, Result};
use crate::model::Token;
use crate::prefix_spill::SpilledCheckpoints;
use crate::seq::Seq;

/// Write `bytes` to `path` through a temporary file, so a failed save never leaves half a file.
/// Through a symbolic link its target is written (made if missing), not the link; a path that
/// exists and is no regular file (a device, a directory) is refused, not replaced by the rename.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let path = link_target(path)?;
    let path = path.as_path();
    if let Ok(meta) = std::fs::metadata(path) {
        if !meta.is_file() {
            let refused = std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "not a regular file: a state file is only written over another",
            );
            return Err(Error::io(path, refused));
        }
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".kvfork-tmp");
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, bytes)
        .and_then(|_| std::fs::rename(&tmp, path))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            Error::io(path, e)
        })
}

/// Where a chain of symbolic links from `path` ends (`path` itself when it is none), whether
/// or not a file is there: the rename of a save must replace that, not a link.
fn link_target(path: &Path) -> Result<PathBuf> {
    let mut at = path.to_path_buf();
    for _ in 0..40 {
        match std::fs::symlink_metadata(&at) {
            Ok(meta) if meta.file_type().is_symlink() => {
                let target = std::fs::read_link(&at).map_err(|e| Error::io(&at, e))?;
                // A relative target is relative to the link's directory.
                at = match at.parent() {
                    Some(dir) => dir.join(target),
                    None => target,
                };
            }
            _ => return Ok(at),
        }
    }
    let looped = std::io::Error::other("too many levels of symbolic links");
    Err(Error::io(path, looped))
}

fn read_file(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| Error::io(path, e))
}

fn check_position(position: i32, n_ctx: u32) -> Result<()> {
    if position as u32 >= n_ctx {
        return Err(Error::State(format!(
            "the saved branch is at position {position}, beyond this context's n_ctx = {n_ctx}"
        )));
    }
    Ok(())
}

/// A live branch as the context file lists it.
struct Listed {
    handle: Handle,
    parent: Option<Handle>,
    fork_head: u32,
    seq: u32,
    cell: Arc<BranchCell>,
}

/// Live branches, each after its parent.
fn tree_order(w: &Worker) -> Vec<Listed> {
    let reg = w.shared().registry();
    let mut out = Vec::with_capacity(reg.len());
    let mut stack: Vec<Handle> = reg
        .iter()
        .filter(|(_, n)| n.parent.is_none())
        .map(|(h, _)| h)
        .collect();
    stack.reverse();
    while let Some(h) = stack.pop() {
        let n = reg.get(h).expect("listed as live");
        out.push(Listed {
            handle: h,
            parent: n.parent,
            fork_head: n.fork_head,
            seq: n.seq,
            cell: n.data.clone(),
        });
        stack.extend(n.children.iter().rev().copied());
    }
    out
}

impl Worker {
    /// `Branch::save`: the branch's record, then its sequence's KV cells.
    pub(crate) fn save_branch(&mut self, cell: &Arc<BranchCell>, path: &Path) -> Result<()> {
        write_atomically(path, &self.branch_bytes(cell)?)
    }

    /// `Branch::snapshot`: what `save_branch` writes, sealed, in memory.
    pub(crate) fn branch_bytes(&mut self, cell: &Arc<BranchCell>) -> Result<Vec<u8>> {
        self.give_leases(&[cell])?;
        let mut out = Writer::new();
        cell.lock().write(&mut out);
        out.bytes(&self.ctx().kv_state(Some(cell.seq()))?);
        let model_id = self.shared().model.identity();
        Ok(state_file::seal(Kind::Branch, model_id, &out.into_bytes()))
    }

    /// A spilling prefix-cache entry's snapshot: of its cells after its first `from` tokens
    /// when `anchor` still holds those (their cells leave the snapshot, then come back from
    /// `anchor`: nobody sees the entry without them), else of all its cells. The bytes, and
    /// the tokens left out (`from` or 0).
    pub(crate) fn spill_bytes(
        &mut self,
        cell: &Arc<BranchCell>,
        from: usize,
        anchor: Option<&Arc<BranchCell>>,
    ) -> Result<(Vec<u8>, usize)> {
        // The prefix copied out first: the entry's lock is not held while the anchor's is taken.
        let prefix = cell.lock().history().get(..from).map(<[Token]>::to_vec);
        let anchor =
            anchor.filter(|a| from > 0 && prefix.as_deref().is_some_and(|p| holds_prefix(a, p)));
        let Some(anchor) = anchor else {
            return Ok((self.branch_bytes(cell)?, 0));
        };
        self.give_leases(&[cell, anchor])?;
        let (seq, from_seq) = (cell.seq(), anchor.seq());
        if !self.ctx_mut().seq_rm(seq, 0, from as i32)? {
            return Ok((self.branch_bytes(cell)?, 0)); // a cache that cannot cut (recurrent)
        }
        let bytes = self.branch_bytes(cell);
        self.ctx_mut().seq_cp(from_seq, seq, 0, from as i32)?;
        Ok((bytes?, from))
    }

    /// `Branch::load`: a saved branch as a new root on a fresh lease.
    pub(crate) fn load_branch(&mut self, path: &Path) -> Result<(Handle, Arc<BranchCell>)> {
        self.restore_branch(&read_file(path)?)
    }

    /// `Branch::restore`: the branch of sealed bytes (a snapshot or a file's contents) as a
    /// new root on a fresh lease.
    pub(crate) fn restore_branch(&mut self, file: &[u8]) -> Result<(Handle, Arc<BranchCell>)> {
        let (state, kv) = self.open_branch_file(file)?;
        check_position(state.position(), self.ctx().n_ctx)?;
        let (handle, cell) = self.shared().create_root(state)?;
        let restored = self.give_leases(&[&cell]).and_then(|_| {
            self.empty_seq(cell.seq())
                .and_then(|_| self.ctx_mut().set_kv_state(Some(cell.seq()), kv))
        });
        if let Err(e) = restored {
            self.shared().registry().prune(handle)?;
            self.forget(handle);
            cell.mark_disposed();
            return Err(e);
        }
        self.rows_for_restored(&cell);
        Ok((handle, cell))
    }

    /// A sealed branch file's state and KV bytes, checked (framing, checksum, this model).
    fn open_branch_file<'f>(&self, file: &'f [u8]) -> Result<(BranchState, &'f [u8])> {
        let model = &self.shared().model;
        let payload =
            state_file::open(file, Kind::Branch, model.identity()).map_err(state_error)?;
        let mut r = Reader::new(payload);
        let state = BranchState::read(&mut r, model)?;
        let kv = r.bytes().map_err(state_error)?;
        r.finish().map_err(state_error)?;
        Ok((state, kv))
    }

    /// `Branch::restore_prefix`: the KV of `prefix`, the first tokens of a branch snapshot,
    /// into `cell`'s empty sequence (a prefix-cache entry brought back from host memory or
    /// disk), with the `checkpoints` it was spilled with; a snapshot of other tokens is an
    /// error (corrupt). On a recurrent state inside the snapshot, up to the last checkpoint at
    /// or before the prefix's end (the state is known there only). A
    /// snapshot of the cells after an `anchor` (`spill_bytes`) gets the first ones from
    /// `anchor_cell` (`seq_cp`, after its own cells: attention goes by position); without a
    /// branch that holds them it is refused (0).
    pub(crate) fn restore_prefix(
        &mut self,
        cell: &Arc<BranchCell>,
        file: &[u8],
        prefix: &[Token],
        checkpoints: SpilledCheckpoints,
        (anchor, anchor_cell): (usize, Option<Arc<BranchCell>>),
    ) -> Result<usize> {
        let (state, kv) = self.open_branch_file(file)?;
        let history = state.history();
        let len = prefix.len();
        // The tokens the entry was indexed under are in its file's header, outside the
        // snapshot's checksum: a snapshot of other tokens is another prompt's cells.
        if history.len() != state.position() as usize || !history.starts_with(prefix) {
            return Err(Error::State(
                "a spilled entry's snapshot holds other tokens than it was indexed under".into(),
            ));
        }
        if len == 0 || cell.lock().position() != 0 {
            return Ok(0);
        }
        // A snapshot without its first cells: they come from a branch that holds them.
        let anchor_cell = match anchor_cell {
            _ if anchor == 0 => None,
            Some(a) if len > anchor && holds_prefix(&a, &history[..anchor]) => Some(a),
            _ => return Ok(0),
        };
        let recurrent = self.keeps_checkpoints();
        let (at, state_at) = match () {
            _ if !recurrent || len == history.len() => (len, None),
            _ => match checkpoints
                .iter()
                .filter(|(p, _)| *p > 0 && *p as usize <= len)
                .max_by_key(|(p, _)| *p)
            {
                Some((p, st)) => (*p as usize, Some(st.clone())),
                None => return Ok(0),
            },
        };
        let cells: Vec<&Arc<BranchCell>> = std::iter::once(cell).chain(&anchor_cell).collect();
        self.give_leases(&cells)?;
        let seq = cell.seq();
        self.empty_seq(seq)?;
        // The bytes passed the model and checksum checks: what fails now is room.
        if self.ctx_mut().set_kv_state(Some(seq), kv).is_err() {
            return Err(Error::KvCacheFull(format!(
                "no room for the {} cells of a restored prefix-cache entry",
                history.len()
            )));
        }
        if !self.window_restored(seq, at, anchor, anchor_cell.as_ref())? {
            self.empty_seq(seq)?;
            return Ok(0);
        }
        if let Some(a) = &anchor_cell {
            if let Err(e) = self.ctx_mut().seq_cp(a.seq(), seq, 0, anchor as i32) {
                self.empty_seq(seq)?;
                return Err(e);
            }
        }
        if let Some(st) = state_at {
            // The checkpoint's state replaces the snapshot's final one.
            if let Err(e) = self.ctx_mut().set_recurrent_state(seq, &st) {
                self.empty_seq(seq)?;
                return Err(e);
            }
            Stats::add(&self.shared().stats.checkpoint_restores, 1);
        }
        if at < history.len() && !self.ctx_mut().seq_rm(seq, at as i32, -1)? {
            self.empty_seq(seq)?;
            return Ok(0);
        }
        let mut st = cell.lock();
        st.decoded(&history[..at]);
        if recurrent {
            let budget = self.shared().params.checkpoint_budget();
            let mut kept = Checkpoints::default();
            for (pos, state) in checkpoints.into_iter().filter(|(p, _)| *p as usize <= at) {
                kept.insert(pos, state.len(), state, budget);
            }
            st.set_checkpoints(kept);
        }
        Ok(at)
    }

    /// Whether a restored entry cut at `len` has every cell its sliding window attends to
    /// (`window_start`): `seq` holds the snapshot's (from `anchor` on, once restored), the
    /// anchor branch the first `anchor` tokens'. Either may lack the oldest ones there.
    fn window_restored(
        &self,
        seq: Seq,
        len: usize,
        anchor: usize,
        anchor_cell: Option<&Arc<BranchCell>>,
    ) -> Result<bool> {
        let Some(start) = self.window_start(len) else {
            return Ok(true);
        };
        let shared = match anchor_cell {
            Some(a) if start < anchor as i64 => self.holds_from(a.seq(), start)?,
            _ => true,
        };
        Ok(shared && self.holds_from(seq, start.max(anchor as i64))?)
    }

    /// Whole-context files record each branch's sequence: a `park` context's branches have
    /// none while parked.
    fn refuse_parking(&self, call: &str) -> Result<()> {
        if self.shared().park.is_some() {
            return Err(Error::Other(format!(
                "{call} is not available on a park=True context; save branches one by one \
                 (Branch.save / Branch.load)"
            )));
        }
        Ok(())
    }

    /// `Context::save_state`: every live branch, parents first, then all KV cells at once.
    pub(crate) fn save_context(&mut self, path: &Path) -> Result<()> {
        self.refuse_parking("save_state")?;
        write_atomically(path, &self.context_bytes()?)
    }

    /// `Context::snapshot`: what `save_context` writes, sealed, in memory.
    pub(crate) fn context_bytes(&mut self) -> Result<Vec<u8>> {
        self.refuse_parking("snapshot")?;
        let branches = tree_order(self);
        let index = |h: Handle| branches.iter().position(|b| b.handle == h);
        let mut out = Writer::new();
        out.u64(branches.len() as u64);
        for b in &branches {
            let parent = b.parent.and_then(index).map_or(-1, |i| i as i32);
            out.i32(parent).u32(b.fork_head).u32(b.seq);
            b.cell.lock().write(&mut out);
        }
        out.bytes(&self.ctx().kv_state(None)?);
        let model_id = self.shared().model.identity();
        Ok(state_file::seal(Kind::Context, model_id, &out.into_bytes()))
    }

    /// `Context::load_state`: the branches of a context file, each after its parent, on the
    /// sequences they had. The context must have no live branch.
    pub(crate) fn load_context(&mut self, path: &Path) -> Result<Vec<(Handle, Arc<BranchCell>)>> {
        self.refuse_parking("load_state")?;
        if !self.shared().registry().is_empty() {
            return Err(Error::Other(
                "load_state needs a context without live branches: prune them first".into(),
            ));
        }
        self.restore_context(&read_file(path)?)
    }

    /// `Context::restore`: the branches of sealed bytes (a snapshot or a file's contents),
    /// each after its parent, on the sequences they had. Everything is checked first; then
    /// every live branch is disposed and the whole cache replaced.
    pub(crate) fn restore_context(
        &mut self,
        file: &[u8],
    ) -> Result<Vec<(Handle, Arc<BranchCell>)>> {
        self.refuse_parking("restore")?;
        let model = self.shared().model.clone();
        let payload =
            state_file::open(file, Kind::Context, model.identity()).map_err(state_error)?;
        let mut r = Reader::new(payload);
        let n = r.u64().map_err(state_error)?;
        let mut saved = Vec::new();
        let mut seqs = std::collections::HashSet::new();
        for i in 0..n {
            let parent = r.i32().map_err(state_error)?;
            let fork_head = r.u32().map_err(state_error)?;
            let seq = r.u32().map_err(state_error)?;
            if parent >= i as i32 || parent < -1 {
                return Err(Error::State("a branch's parent comes after it".into()));
            }
            // The leases' ids only: those above are the engine's own (park, padding).
            let n_seq_max = self.shared().n_seq_max;
            if seq >= n_seq_max || !seqs.insert(seq) {
                return Err(Error::State(format!(
                    "the file needs sequence {seq}: this context has n_seq_max = {n_seq_max}"
                )));
            }
            let state = BranchState::read(&mut r, &model)?;
            check_position(state.position(), self.ctx().n_ctx)?;
            saved.push((parent, fork_head, seq, state));
        }
        let kv = r.bytes().map_err(state_error)?;
        r.finish().map_err(state_error)?;
        self.shared().outputs().clear();
        // The registry stays locked from the disposal to the last branch restored: a
        // `Branch::create` on another thread cannot lease a sequence the file needs between
        // them (it waits, then leases a free one).
        let shared = self.shared_handle();
        let mut reg = shared.registry();
        dispose_all(&mut reg);
        self.ctx_mut().set_kv_state(None, kv)?;
        let mut restored: Vec<(Handle, Arc<BranchCell>)> = Vec::with_capacity(saved.len());
        for (parent, fork_head, seq, state) in saved {
            let parent = usize::try_from(parent).ok().map(|i| restored[i].0);
            let cell = BranchCell::new(Some(Seq::new(seq)), state);
            match reg.restore(parent, fork_head, seq, cell.clone()) {
                Ok(h) => {
                    cell.set_handle(h);
                    restored.push((h, cell));
                }
                Err(e) => {
                    // No handle will reach a caller: give back what was restored so far.
                    dispose_all(&mut reg);
                    return Err(e.into());
                }
            }
        }
        drop(reg);
        for (_, cell) in &restored {
            self.rows_for_restored(cell);
        }
        Ok(restored)
    }
}

/// Dispose every live branch of `reg` (their cells are about to be replaced): each handle
/// turns disposed at once, and work queued on them fails.
fn dispose_all(reg: &mut Registry<Arc<BranchCell>>) {
    let roots: Vec<Handle> = reg
        .iter()
        .filter(|(_, n)| n.parent.is_none())
        .map(|(h, _)| h)
        .collect();
    for root in roots {
        for pruned in reg.prune_subtree(root).unwrap_or_default() {
            pruned.data.mark_disposed();
        }
    }
}

/// Whether `cell` (not pruned) holds the cells of `prefix`, its first tokens.
fn holds_prefix(cell: &Arc<BranchCell>, prefix: &[Token]) -> bool {
    if cell.is_disposed() {
        return false;
    }
    let st = cell.lock();
    st.history().starts_with(prefix) && st.position() as usize >= prefix.len()
}
