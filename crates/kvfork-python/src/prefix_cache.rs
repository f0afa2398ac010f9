//! `PrefixCache`: branches that share the longest prefix already in the KV cache.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::branch::{wrap, PyBranch};
use crate::context::PyContext;
use crate::convert::{self, Arg, Int};
use crate::errors::IntoPyResult;
use crate::params;
use crate::twins::twins;

/// Automatic prefix reuse on one context: `await cache.branch(tokens, params)` makes a branch
/// positioned at the end of `tokens` by sharing the longest prefix any branch of the cache
/// holds in the KV — an entry handed back with `release`, or a branch still generating (a
/// fork at a position inside it) — and prefilling only the rest (at least the last token, so
/// the snapshot is fresh). Entries are evicted least recently used when a lease or KV cells
/// are needed, or past `max_cached_tokens`. The branches it makes are roots.
#[pyclass(frozen, module = "kvfork", name = "PrefixCache")]
pub struct PyPrefixCache {
    inner: kvfork::PrefixCache,
}

#[pymethods]
impl PyPrefixCache {
    #[new]
    #[pyo3(signature = (ctx, *, max_cached_tokens=None))]
    fn new(ctx: Arg<Bound<'_, PyContext>>, max_cached_tokens: Option<Int>) -> PyResult<Self> {
        let max = max_cached_tokens
            .map(|m| {
                m.within("max_cached_tokens", 0, i64::MAX)
                    .map(|m| m as usize)
            })
            .transpose()?;
        Ok(PyPrefixCache {
            inner: kvfork::PrefixCache::new(&ctx.0.get().inner, max),
        })
    }

    /// Hand back a branch `branch` made: its KV stays as an entry for later requests (the
    /// caller's handle is spent: use it no more). ValueError for a branch the cache did not
    /// make or already has.
    fn release(&self, branch: Arg<Bound<'_, PyBranch>>) -> PyResult<()> {
        self.inner.release(&branch.0.get().inner).py()
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

    /// `{"branches", "hit_tokens", "prefilled_tokens", "evictions", "entries",
    /// "cached_tokens", "live"}`: branches handed out, prompt tokens shared from the KV and
    /// prefilled, entries evicted, and the entries, their tokens and the live branches now.
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
        Ok(d)
    }
}

twins! {
    impl PyPrefixCache {
        /// A new root branch positioned at the end of `tokens` with fresh logits, sharing the
        /// longest prefix the cache's branches hold (see the class). LeaseExhaustedError when
        /// every lease is held by branches handed out; ValueError for tokens that leave no room
        /// in the context. `adapters` (`{LoraAdapter: scale}`): the branch decodes under them,
        /// and shares only prefixes computed under the same set.
        #[sync_doc = "returns the Branch. Waits without the GIL; on Ctrl-C a started call \\
                      completes (the branch is made), then KeyboardInterrupt is raised."]
        #[pyo3(signature = (tokens, params=None, *, adapters=None))]
        fn branch / branch_sync(
            &self,
            py,
            tokens: &Bound<'_, PyAny>,
            params: Option<&Bound<'_, PyAny>>,
            adapters: Option<&Bound<'_, PyAny>>,
        ) -> PyBranch {
            let tokens = convert::tokens(tokens, "tokens")?;
            let adapters = match adapters {
                None => kvfork::Adapters::default(),
                Some(a) => kvfork::Adapters::from_loras(
                    self.inner.context().model(),
                    crate::adapter::lora_set(a)?,
                )
                .py()?,
            };
            self.inner.branch_under(tokens, params::extract(params)?, adapters)
        } => |b| Ok(wrap(b));
    }
}
