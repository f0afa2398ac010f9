//! Which run the engine is in and which one a caller wants aborted. llama.cpp's abort
//! callback reads it between graph nodes (`LlamaCtx::set_abort_signal`); the engine thread
//! says what runs, a cancel (`engine/pending.rs`) names what to abort.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The engine's current run and the run to abort; atomics only, read from any thread.
#[derive(Default)]
pub(crate) struct AbortSignal {
    /// The run in progress (a job's id, or a gathered group's), 0 between runs.
    current: AtomicU64,
    /// The run a cancel asked to abort.
    target: AtomicU64,
    /// Set by `close()`: abort whatever runs.
    closing: AtomicBool,
}

impl AbortSignal {
    /// Whether the running decode should stop now.
    pub fn should_abort(&self) -> bool {
        if self.closing.load(Ordering::Relaxed) {
            return true;
        }
        let current = self.current.load(Ordering::Relaxed);
        current != 0 && self.target.load(Ordering::Relaxed) == current
    }

    /// The engine starts `run` (0: it runs nothing now).
    pub fn set_running(&self, run: u64) {
        self.current.store(run, Ordering::Relaxed);
    }

    /// Take the current run off (a cancel of it aborts nothing now; `close` still does) and
    /// return it, for `set_running` to put back: a rollback must complete, and the run being
    /// aborted, the reason for most rollbacks, would abort its replay too.
    pub fn pause(&self) -> u64 {
        self.current.swap(0, Ordering::Relaxed)
    }

    /// Abort `run` while it runs.
    pub fn abort(&self, run: u64) {
        self.target.store(run, Ordering::Relaxed);
    }

    /// The context is closing: abort whatever runs, from now on.
    pub fn close(&self) {
        self.closing.store(true, Ordering::Relaxed);
    }

    /// Whether `close` was called (an aborted decode then means "closed", not "cancelled").
    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Relaxed)
    }
}
