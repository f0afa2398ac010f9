//! `PrefixCache`: branches that share the longest prefix already in the KV cache.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::awaitable::{Call, Discard, OnCancel, Operation};
use crate::convert::{self, Arg, Int};
use crate::errors::IntoPyResult;
use crate::handles::PyContext;
use crate::handles::{wrap, PyBranch};
use crate::params;

/// Automatic prefix reuse on one context: `await cache.branch(tokens, params)` makes a branch
/// positioned at the end of `tokens` by sharing the longest prefix any branch of the cache
/// holds in the KV — an entry handed back with `release`, or a branch still generating (a
/// fork at a position inside it) — and prefilling only the rest (at least the last token, so
/// the snapshot is fresh). A prefix under 16 tokens is shared only when it is half the prompt
/// (a few common first tokens are cheaper to prefill again). Entries are evicted least recently used when a lease or KV cells
/// are needed, or past `max_cached_tokens`; with `host_bytes` (and `disk_dir`, whose
/// `disk_bytes` None leaves unbounded; a positive `disk_bytes` alone is a ValueError, a
/// directory that cannot be made or written to an OSError) an evicted entry without adapters is kept as a snapshot in host memory (then
/// on disk, least recently used first at each level) and copied back into the KV when a
/// prompt shares 16+ more tokens with it than with the cache (~170× faster than prefilling
/// them on a CPU); a restarted cache with the same `disk_dir` finds its entries there (a
/// file of another model, cache layout or kvfork version is left alone; a restored entry
/// keeps its file). Caches may share a `disk_dir`: each numbers its files apart; one opened
/// later also finds the others' files there (of the same model), and a file trimmed by one
/// is gone for the others (their prompts are prefilled, never served another prompt's
/// cells). On recurrent and hybrid
/// models an entry carries its recurrent-state checkpoints: a prompt that parts from it
/// inside gets it back up to the last checkpoint before that point. `fork` adds forks of its branches (a request's
/// other choices), making room the same way. The branches it hands out and its entries are the
/// account of the sequences its users hold (`stats()["live"]`, `stats()["entries"]`). On a
/// `park=True` context it makes room as `Branch.create` does, parking the least recently used
/// branches (its entries and yours alike) rather than evicting entries (`make_room` is then
/// 0); sharing a prefix needs its source and the new branch active at once, so with a single
/// lease a prompt sharing one with a branch handed out raises LeaseExhaustedError (each
/// operation admits its branches). With `max_cached_tokens=0`, a
/// released entry's lease comes back once its background eviction ran (at once for the
/// cache's own `branch`, which waits for it; a `Branch.create` right after may not find it).
///
/// Nothing leaks when an await is cancelled: a `branch` cancelled while its prompt is being
/// prefilled aborts the prefill (rolled back: nothing is kept), a `branch` or `fork` whose
/// work completed anyway is handed back as an entry, and `release` never waits (call it from
/// any clean-up).
#[pyclass(frozen, weakref, module = "kvfork", name = "PrefixCache")]
pub struct PyPrefixCache {
    inner: kvfork::PrefixCache,
}

#[pymethods]
impl PyPrefixCache {
    #[new]
    #[pyo3(signature = (ctx, *, max_cached_tokens=None, host_bytes=None, disk_dir=None,
                        disk_bytes=None))]
    fn new(
        ctx: Arg<Bound<'_, PyContext>>,
        max_cached_tokens: Option<Int>,
        host_bytes: Option<Int>,
        disk_dir: Option<std::path::PathBuf>,
        disk_bytes: Option<Int>,
    ) -> PyResult<Self> {
        let max = max_cached_tokens
            .map(|m| {
                m.within("max_cached_tokens", 0, i64::MAX)
                    .map(|m| m as usize)
            })
            .transpose()?;
        let disk_limit = disk_bytes
            .map(|b| b.within("disk_bytes", 0, i64::MAX).map(|b| b as usize))
            .transpose()?;
        if disk_dir.is_none() && disk_limit.is_some_and(|b| b > 0) {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "disk_bytes bounds the entries kept in disk_dir: give disk_dir too",
            ));
        }
        let spill = kvfork::SpillConfig {
            host_bytes: bytes(host_bytes, "host_bytes", 0)?,
            disk_dir,
            disk_bytes: disk_limit.unwrap_or(usize::MAX),
        };
        Ok(PyPrefixCache {
            inner: kvfork::PrefixCache::with_spill(&ctx.0.get().inner, max, spill).py()?,
        })
    }

    /// A new root branch positioned at the end of `tokens` with fresh logits, sharing the
    /// longest prefix the cache's branches hold (see the class). LeaseExhaustedError when
    /// every lease is held by branches handed out; ValueError for tokens that leave no room
    /// in the context. `adapters` (`{LoraAdapter: scale}`): the branch decodes under them,
    /// and shares only prefixes computed under the same set. Cancelled during its prefill, the
    /// prefill is aborted and rolled back (the engine is free at once); cancelled after the
    /// branch was made, it is handed back as an entry.
    #[pyo3(signature = (tokens, params=None, *, adapters=None))]
    fn branch<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        params: Option<&Bound<'py, PyAny>>,
        adapters: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let pending = self.branching(tokens, params, adapters)?;
        self.handing_out(py, Call("PrefixCache", "branch"), pending)
    }

    /// Blocking twin of `branch`: returns the Branch. Waits without the GIL; on Ctrl-C a
    /// started call completes (the branch is made and handed back as an entry), then
    /// KeyboardInterrupt is raised.
    #[pyo3(signature = (tokens, params=None, *, adapters=None))]
    fn branch_sync(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        params: Option<&Bound<'_, PyAny>>,
        adapters: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyBranch> {
        let pending = self.branching(tokens, params, adapters)?;
        self.waiting(py, pending)
    }

    /// Hand back a branch `branch` or `fork` made: its KV stays as an entry for later requests
    /// (the caller's handle is spent: it raises BranchDisposedError as a pruned one, and its
    /// `prune` does nothing). Never waits: safe in the clean-up of a cancelled task.
    /// ValueError for a branch the cache did not make or already has, and for one pruned
    /// already (the cache forgets it: it holds no KV to keep).
    fn release(&self, branch: Arg<Bound<'_, PyBranch>>) -> PyResult<()> {
        self.inner.release(&branch.0.get().inner).py()
    }

    /// A fork of `branch` (a branch of the cache's context, usually one it handed out) on a
    /// lease made free by evicting entries when none is: the other choices of a request. It
    /// is handed out like a `branch` result (`release` keeps it as an entry).
    /// LeaseExhaustedError when branches handed out hold every lease. Cancelled after the fork
    /// was made, the fork is handed back as an entry.
    #[pyo3(signature = (branch, *, seed=None))]
    fn fork<'py>(
        &self,
        py: Python<'py>,
        branch: Arg<Bound<'py, PyBranch>>,
        seed: Option<Int>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let seed = seed.map(|s| s.u32("seed", 0)).transpose()?;
        let pending = self.inner.fork(&branch.0.get().inner, seed);
        self.handing_out(py, Call("PrefixCache", "fork"), pending)
    }

    /// Blocking twin of `fork`: returns the Branch. Waits without the GIL; on Ctrl-C a started
    /// fork completes (and is handed back as an entry), then KeyboardInterrupt is raised.
    #[pyo3(signature = (branch, *, seed=None))]
    fn fork_sync(
        &self,
        py: Python<'_>,
        branch: Arg<Bound<'_, PyBranch>>,
        seed: Option<Int>,
    ) -> PyResult<PyBranch> {
        let seed = seed.map(|s| s.u32("seed", 0)).transpose()?;
        let pending = self.inner.fork(&branch.0.get().inner, seed);
        self.waiting(py, pending)
    }

    /// Evict entries, least recently used first, until `n` leases are free (room for a
    /// request's `n` branches); resolves to how many were evicted. LeaseExhaustedError when
    /// the entries are not enough (branches handed out hold the rest); KvforkError once the
    /// context is closed.
    fn make_room<'py>(&self, py: Python<'py>, n: Int) -> PyResult<Bound<'py, PyAny>> {
        let pending = self.inner.make_room(n.u32("n", 0)?);
        convert::awaitable(py, Call("PrefixCache", "make_room"), pending, Ok)
    }

    /// Blocking twin of `make_room`: returns how many entries were evicted. Waits without the
    /// GIL; evictions always complete, even on Ctrl-C.
    fn make_room_sync(&self, py: Python<'_>, n: Int) -> PyResult<usize> {
        convert::wait(py, self.inner.make_room(n.u32("n", 0)?))
    }

    /// Evict the least recently used entry: its cells that no other branch shares go back to
    /// the KV (room for the next decode of a branch handed out, which raised
    /// KvCacheFullError); resolves to False when no entry is left. KvforkError once the
    /// context is closed.
    fn evict_oldest<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let pending = self.inner.evict_oldest();
        convert::awaitable(py, Call("PrefixCache", "evict_oldest"), pending, Ok)
    }

    /// Blocking twin of `evict_oldest`: returns whether an entry was evicted. Waits without
    /// the GIL; the eviction always completes, even on Ctrl-C.
    fn evict_oldest_sync(&self, py: Python<'_>) -> PyResult<bool> {
        convert::wait(py, self.inner.evict_oldest())
    }

    /// How many of `branch`'s prompt tokens came from the KV cache when it was made (shared,
    /// not prefilled); None for a branch the cache did not make or no longer holds.
    fn shared_tokens(&self, branch: Arg<Bound<'_, PyBranch>>) -> Option<usize> {
        self.inner.shared_tokens(&branch.0.get().inner)
    }

    /// Prune every entry (branches handed out stay).
    fn clear(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.clear()).py()
    }

    /// Evict every entry into host memory and disk (`host_bytes`, `disk_dir`), then write
    /// those in host memory to disk, so that a cache opened later on the same `disk_dir`
    /// finds them (a server's shutdown); how many entries are on disk then. Without a spill
    /// level it prunes every entry, as `clear` does. Blocking; branches handed out stay.
    fn spill_all(&self, py: Python<'_>) -> PyResult<usize> {
        py.detach(|| self.inner.spill_all()).py()
    }

    /// `{"branches", "hit_tokens", "prefilled_tokens", "evictions", "entries",
    /// "cached_tokens", "live", "host", "disk"}`: branches handed out, prompt tokens shared
    /// from the KV and prefilled, entries evicted, and the entries, their tokens and the live
    /// branches now; `host` and `disk`, for entries spilled there when evicted
    /// (`host_bytes`, `disk_dir`): `{"entries", "bytes", "hits", "restored_tokens"}`, the
    /// entries and bytes held now, the entries brought back and the prompt tokens they held
    /// (restored instead of prefilled).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("branches", s.branches)?;
        d.set_item("hit_tokens", s.hit_tokens)?;
        d.set_item("prefilled_tokens", s.prefilled_tokens)?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("entries", s.entries)?;
        d.set_item("cached_tokens", s.cached_tokens)?;
        d.set_item("live", s.live)?;
        for (name, level) in [("host", s.host), ("disk", s.disk)] {
            let l = PyDict::new(py);
            l.set_item("entries", level.entries)?;
            l.set_item("bytes", level.bytes)?;
            l.set_item("hits", level.hits)?;
            l.set_item("restored_tokens", level.restored_tokens)?;
            d.set_item(name, l)?;
        }
        Ok(d)
    }
}

/// A byte budget: `none` when not given, else at least 0.
fn bytes(value: Option<Int>, name: &str, none: usize) -> PyResult<usize> {
    value.map_or(Ok(none), |v| Ok(v.within(name, 0, i64::MAX)? as usize))
}

impl PyPrefixCache {
    /// The engine call of `branch` and `branch_sync`.
    fn branching(
        &self,
        tokens: &Bound<'_, PyAny>,
        params: Option<&Bound<'_, PyAny>>,
        adapters: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<kvfork::Pending<kvfork::Branch>> {
        let tokens = convert::tokens(tokens, "tokens")?;
        let adapters = match adapters {
            None => kvfork::Adapters::default(),
            Some(a) => kvfork::Adapters::from_loras(
                self.inner.context().model(),
                crate::adapter::lora_set(a)?,
            )
            .py()?,
        };
        Ok(self
            .inner
            .branch_under(tokens, params::extract(params)?, adapters))
    }

    /// Hand a branch nobody received back as an entry (its maker's await was cancelled).
    fn hand_back(cache: &kvfork::PrefixCache, branch: &kvfork::Branch) {
        // The cache made it and it is live: release cannot refuse it.
        let _ = cache.release(branch);
    }

    /// An awaitable of a branch handed out: cancelled after it was made, it is handed back.
    fn handing_out<'py>(
        &self,
        py: Python<'py>,
        call: Call,
        pending: kvfork::Pending<kvfork::Branch>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let cache = self.inner.clone();
        let discard: Discard = Box::new(move |py, made| {
            if let Ok(branch) = made.bind(py).cast::<PyBranch>() {
                Self::hand_back(&cache, &branch.get().inner);
            }
        });
        let op = Operation::new(call, pending, OnCancel::Settle, |py, b| {
            Bound::new(py, wrap(b)).map(|b| b.into_any().unbind())
        })
        .with_discard(discard);
        Bound::new(py, op).map(Bound::into_any)
    }

    /// The blocking wait of a branch handed out: interrupted after it was made, it is handed
    /// back.
    fn waiting(
        &self,
        py: Python<'_>,
        pending: kvfork::Pending<kvfork::Branch>,
    ) -> PyResult<PyBranch> {
        let cache = self.inner.clone();
        convert::wait_or_discard(py, pending, move |b| Self::hand_back(&cache, &b)).map(wrap)
    }
}
