//! State shared between the engine thread and callers: the branch registry, branch cells, counters.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use kvfork_core::{Handle, ParkLedger, Registry};

use super::outputs::Outputs;
use crate::abort::AbortSignal;
use crate::branch_state::BranchState;
use crate::context_params::ContextParams;
use crate::error::{Error, Result};
use crate::model::Model;
use crate::seq::Seq;

/// `BranchCell::seq` of a parked branch (no sequence; llama.cpp would refuse this id).
const PARKED: u32 = u32::MAX;

/// One branch's state behind its own lock, plus its sequence and the flag `prune` sets at
/// once (both read without the lock).
pub(crate) struct BranchCell {
    /// The KV sequence the branch leases: for its whole life, except on a `park` context,
    /// where the engine thread moves it (`PARKED` while parked).
    seq: AtomicU32,
    /// The branch's handle, set once it is in the registry (the ledger of `park` uses it).
    handle: OnceLock<Handle>,
    state: Mutex<BranchState>,
    disposed: AtomicBool,
    /// Handed back to the prefix cache that made it: an entry other requests share, which
    /// only the cache's own handle may use (`Branch::check_live`).
    entry: AtomicBool,
}

impl BranchCell {
    /// A cell on `seq`, or parked with `None`.
    pub fn new(seq: Option<Seq>, state: BranchState) -> Arc<Self> {
        Arc::new(BranchCell {
            seq: AtomicU32::new(seq.map_or(PARKED, |s| s.id() as u32)),
            handle: OnceLock::new(),
            state: Mutex::new(state),
            disposed: AtomicBool::new(false),
            entry: AtomicBool::new(false),
        })
    }

    /// The KV sequence the branch leases. On the engine thread, valid once the operation
    /// admitted the branch (`Worker::give_leases`); a parked branch's id is out of range, so
    /// llama.cpp is never handed it (`LlamaCtx` checks every id).
    pub fn seq(&self) -> Seq {
        Seq::new(self.seq.load(Ordering::Acquire))
    }

    /// Whether the branch's KV is parked in host memory.
    pub fn is_parked(&self) -> bool {
        self.seq.load(Ordering::Acquire) == PARKED
    }

    /// The branch now holds `seq`, or is parked with `None` (engine thread).
    pub fn set_seq(&self, seq: Option<Seq>) {
        self.seq
            .store(seq.map_or(PARKED, |s| s.id() as u32), Ordering::Release)
    }

    /// The branch's handle (set when it entered the registry).
    pub fn handle(&self) -> Option<Handle> {
        self.handle.get().copied()
    }

    pub fn set_handle(&self, h: Handle) {
        let _ = self.handle.set(h);
    }

    /// Lock the state (a panic elsewhere never poisons kvfork for good).
    pub fn lock(&self) -> MutexGuard<'_, BranchState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn is_disposed(&self) -> bool {
        self.disposed.load(Ordering::Acquire)
    }

    pub fn mark_disposed(&self) {
        self.disposed.store(true, Ordering::Release)
    }

    pub fn is_entry(&self) -> bool {
        self.entry.load(Ordering::Acquire)
    }

    pub fn mark_entry(&self) {
        self.entry.store(true, Ordering::Release)
    }
}

/// Counters since the context was created.
#[derive(Default)]
pub(crate) struct Stats {
    pub decode_calls: AtomicU64,
    pub decoded_tokens: AtomicU64,
    pub decode_ns: AtomicU64,
    /// Rows added to decodes to fill the output matmul's last tile (`Worker::pad_outputs`).
    pub padded_rows: AtomicU64,
    /// Prompt tokens prefilled in the scratch context (`engine/scratch.rs`).
    pub scratch_tokens: AtomicU64,
    /// Decodes that held prompt tokens and streams' steps together (`engine/continuous.rs`).
    pub mixed_decodes: AtomicU64,
    pub commit_requests: AtomicU64,
    /// Wall time of commit groups on the engine thread, up to their replies (decodes in).
    pub commit_ns: AtomicU64,
    /// Recurrent-state checkpoints taken, and their bytes (`engine/checkpoints.rs`).
    pub checkpoints_taken: AtomicU64,
    pub checkpoint_bytes_taken: AtomicU64,
    /// Time spent copying them out.
    pub checkpoint_ns: AtomicU64,
    /// Checkpoints put back (a fork inside a sequence, a rollback).
    pub checkpoint_restores: AtomicU64,
    /// Tokens decoded again after a checkpoint was put back.
    pub replayed_tokens: AtomicU64,
    /// Branches moved to host memory (`park` contexts).
    pub parks: AtomicU64,
    /// Branches brought back from host memory.
    pub unparks: AtomicU64,
}

impl Stats {
    pub fn add(counter: &AtomicU64, v: u64) {
        counter.fetch_add(v, Ordering::Relaxed);
    }

    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// The thread counts decodes use now, readable from any thread.
#[derive(Default)]
pub(crate) struct ThreadsInUse {
    pub single: std::sync::atomic::AtomicI32,
    pub batch: std::sync::atomic::AtomicI32,
}

impl ThreadsInUse {
    pub fn set(&self, single: i32, batch: i32) {
        self.single.store(single, Ordering::Relaxed);
        self.batch.store(batch, Ordering::Relaxed);
    }

    pub fn get(&self) -> (i32, i32) {
        (
            self.single.load(Ordering::Relaxed),
            self.batch.load(Ordering::Relaxed),
        )
    }
}

pub(crate) struct Shared {
    pub model: Arc<Model>,
    pub registry: Mutex<Registry<Arc<BranchCell>>>,
    /// Leases and parked branches of a `park` context (locked after the registry).
    pub park: Option<Mutex<ParkLedger>>,
    pub stats: Stats,
    pub closed: AtomicBool,
    /// Why the engine stopped on its own (a caught panic), for every later caller.
    pub failure: Mutex<Option<String>>,
    /// Closed in a forked child, where its engine thread is not (`Engine::forsake`).
    pub forked: AtomicBool,
    pub abort: Arc<AbortSignal>,
    pub n_ctx: u32,
    pub n_batch: u32,
    pub n_seq_max: u32,
    /// llama.cpp's pooling type for embeddings (resolved from the model when not given).
    pub pooling: i32,
    /// (single-token, batch) threads in use now; they change as the tuner adapts.
    pub threads: ThreadsInUse,
    /// The options the context was created with.
    pub params: ContextParams,
    /// Distinguishes contexts, so a branch of one is refused by another.
    pub id: u64,
    /// Signals the end of each commit decode to readers waiting for a member's new row.
    pub rows_landed: RowsLanded,
    /// The raw layer's outputs: rows of `Context::decode` and the last decode's output.
    pub outputs: Mutex<Outputs>,
}

/// A counter of commit decodes whose members hold their rows again, with a condition
/// variable for the readers that wait for one (`Branch::with_row`).
#[derive(Default)]
pub(crate) struct RowsLanded {
    landings: Mutex<u64>,
    landed: Condvar,
}

impl RowsLanded {
    /// Landings so far (read before looking at a branch, then passed to `wait_past`).
    pub fn count(&self) -> u64 {
        *self.landings.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The members of a decode hold their rows again.
    pub fn land(&self) {
        *self.landings.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        self.landed.notify_all();
    }

    /// Wait until more than `seen` landings happened, or `timeout` passed.
    pub fn wait_past(&self, seen: u64, timeout: Duration) {
        let guard = self.landings.lock().unwrap_or_else(|e| e.into_inner());
        let _ = self
            .landed
            .wait_timeout_while(guard, timeout, |n| *n <= seen)
            .unwrap_or_else(|e| e.into_inner());
    }
}

impl Shared {
    pub fn registry(&self) -> MutexGuard<'_, Registry<Arc<BranchCell>>> {
        self.registry.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The raw layer's outputs (see `outputs.rs`).
    pub fn outputs(&self) -> MutexGuard<'_, Outputs> {
        self.outputs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The ledger of a `park` context (`None` otherwise).
    pub fn ledger(&self) -> Option<MutexGuard<'_, ParkLedger>> {
        self.park
            .as_ref()
            .map(|m| m.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Leases free now.
    pub fn available(&self) -> u32 {
        match self.ledger() {
            Some(l) => l.available(),
            None => self.registry().available(),
        }
    }

    /// A new root branch holding `state`, on a fresh lease (parked when none is free on a
    /// `park` context).
    pub fn create_root(&self, state: BranchState) -> Result<(Handle, Arc<BranchCell>)> {
        let mut registry = self.registry();
        let park = self.park.is_some();
        let (handle, _) = registry
            .create_root_with(|slot| BranchCell::new((!park).then(|| Seq::new(slot)), state))?;
        let cell = registry.data(handle).expect("just created").clone();
        cell.set_handle(handle);
        if let Some(mut ledger) = self.ledger() {
            cell.set_seq(ledger.add_root(handle).map(Seq::new));
        }
        Ok((handle, cell))
    }

    /// A new root branch holding `state` on the lease of `seq` itself (the raw layer's
    /// takeover); `SeqLeased` when a live branch holds it.
    pub fn create_root_on(
        &self,
        seq: Seq,
        state: BranchState,
    ) -> Result<(Handle, Arc<BranchCell>)> {
        let cell = BranchCell::new(Some(seq), state);
        let handle = self.lease_exact(None, 0, seq, cell.clone())?;
        Ok((handle, cell))
    }

    /// A new child of `parent` holding `state` on the lease of `seq` itself (`fork(seq_id=)`).
    pub fn fork_on(
        &self,
        parent: Handle,
        fork_head: u32,
        seq: Seq,
        state: BranchState,
    ) -> Result<(Handle, Arc<BranchCell>)> {
        let cell = BranchCell::new(Some(seq), state);
        let handle = self.lease_exact(Some(parent), fork_head, seq, cell.clone())?;
        Ok((handle, cell))
    }

    fn lease_exact(
        &self,
        parent: Option<Handle>,
        fork_head: u32,
        seq: Seq,
        cell: Arc<BranchCell>,
    ) -> Result<Handle> {
        if self.park.is_some() {
            // The ledger moves a `park` context's branches between sequences itself.
            return Err(Error::invalid(
                "seq_id",
                "a park=True context assigns its branches' sequences itself".to_string(),
            ));
        }
        let mut registry = self.registry();
        if self.holder_of(&registry, seq).is_some() {
            return Err(Error::SeqLeased { seq: seq.id() });
        }
        let handle = registry.restore(parent, fork_head, seq.id() as u32, cell.clone())?;
        cell.set_handle(handle);
        Ok(handle)
    }

    /// The live branch leasing `seq`, if any (a scan over the live branches; with `park`
    /// the registry's ids are slots, so the branches' own sequences are compared).
    pub fn holder_of(
        &self,
        registry: &Registry<Arc<BranchCell>>,
        seq: Seq,
    ) -> Option<(Handle, Arc<BranchCell>)> {
        registry
            .iter()
            .find(|(_, n)| match self.park {
                Some(_) => !n.data.is_parked() && n.data.seq() == seq,
                None => n.seq as i32 == seq.id(),
            })
            .map(|(h, n)| (h, n.data.clone()))
    }

    /// A new child of `parent` holding `state`, on a fresh lease, or parked on a `park`
    /// context when none is free (its KV cells are the caller's business).
    pub fn fork(
        &self,
        parent: Handle,
        fork_head: u32,
        state: BranchState,
    ) -> Result<(Handle, Arc<BranchCell>)> {
        let mut registry = self.registry();
        let park = self.park.is_some();
        let (handle, _) = registry.fork_with(parent, fork_head, |slot| {
            BranchCell::new((!park).then(|| Seq::new(slot)), state)
        })?;
        let cell = registry.data(handle).expect("just created").clone();
        cell.set_handle(handle);
        if let Some(mut ledger) = self.ledger() {
            cell.set_seq(ledger.add_child(handle, parent, fork_head).map(Seq::new));
        }
        Ok((handle, cell))
    }

    pub fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::Acquire) {
            Err(self.closed_error())
        } else {
            Ok(())
        }
    }

    /// `Closed`, the internal failure that closed the context, or the fork that left it.
    pub fn closed_error(&self) -> Error {
        if self.forked.load(Ordering::Acquire) {
            return Error::Other(
                "the context was made before this process forked: its engine thread is in the \
                 parent process (make contexts after the fork)"
                    .into(),
            );
        }
        match self
            .failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            Some(msg) => Error::Internal(format!("{msg} (the context was closed)")),
            None => Error::Closed,
        }
    }

    /// Close the context after an internal failure.
    pub fn fail(&self, message: String) {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert(message);
        self.closed.store(true, Ordering::Release);
    }
}
