//! `BranchStore`: one decode for N branches.

use pyo3::prelude::*;

use crate::branch::token_arg;
use crate::convert::{self, Arg, Int};
use crate::handles::PyBranch;
use crate::handles::PyContext;
use crate::scores;
use crate::token::PyToken;
use crate::twins::twins;

/// Batched operations over many branches of one context: `commit`, `prefill` and `step`
/// advance N branches in one llama_decode (ceil(N / n_batch) over more than n_batch), and
/// `retain_only` keeps one branch's KV. `BranchStore(ctx)` is cheap and holds no lease.
#[pyclass(frozen, weakref, module = "kvfork", name = "BranchStore")]
pub struct PyBranchStore {
    inner: kvfork::BranchStore,
}

fn branch(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<kvfork::Branch> {
    Ok(obj
        .cast::<PyBranch>()
        .map_err(|_| crate::errors::type_error(format!("{what}: expected a kvfork.Branch")))?
        .get()
        .inner
        .clone())
}

/// `obj` as an iterator, or a TypeError naming the argument and what it must hold.
fn iterate<'py>(
    obj: &Bound<'py, PyAny>,
    what: &str,
) -> PyResult<Bound<'py, pyo3::types::PyIterator>> {
    obj.try_iter()
        .map_err(|_| crate::errors::type_error(format!("{what}, not {}", obj.get_type())))
}

fn commit_entries(entries: &Bound<'_, PyAny>) -> PyResult<Vec<(kvfork::Branch, i32)>> {
    iterate(
        entries,
        "entries must be an iterable of (Branch, token) pairs",
    )?
    .map(|e| {
        let (b, t): (Bound<'_, PyAny>, Bound<'_, PyAny>) = e?
            .extract()
            .map_err(|_| crate::errors::type_error("entries must be (Branch, token) pairs"))?;
        Ok((branch(&b, "entries")?, token_arg(&t)?))
    })
    .collect()
}

fn prefill_entries(entries: &Bound<'_, PyAny>) -> PyResult<Vec<(kvfork::Branch, Vec<i32>)>> {
    iterate(
        entries,
        "entries must be an iterable of (Branch, tokens) pairs",
    )?
    .map(|e| {
        let (b, toks): (Bound<'_, PyAny>, Bound<'_, PyAny>) = e?
            .extract()
            .map_err(|_| crate::errors::type_error("entries must be (Branch, tokens) pairs"))?;
        Ok((branch(&b, "entries")?, convert::tokens(&toks, "tokens")?))
    })
    .collect()
}

fn branch_list(list: &Bound<'_, PyAny>) -> PyResult<Vec<kvfork::Branch>> {
    iterate(list, "branches must be an iterable of Branch")?
        .map(|b| branch(&b?, "branches"))
        .collect()
}

fn tokens(produced: Vec<kvfork::Produced>) -> PyResult<Vec<PyToken>> {
    Ok(produced.into_iter().map(PyToken::from).collect())
}

#[pymethods]
impl PyBranchStore {
    #[new]
    fn new(ctx: Arg<Bound<'_, PyContext>>) -> Self {
        let ctx = ctx.0;
        PyBranchStore {
            inner: kvfork::BranchStore::new(&ctx.get().inner),
        }
    }

    /// Leases free now (0 once the context is closed).
    #[getter]
    fn available(&self) -> u32 {
        if self.inner.context().is_closed() {
            return 0;
        }
        self.inner.available()
    }
}

twins! {
    impl PyBranchStore {
        /// Accept every `(branch, token)` then ONE llama_decode; all rolled back if it fails.
        /// Over more than n_batch branches it takes ceil(N / n_batch) decodes, one rollback
        /// unit. Cancelled, it either never ran (nothing happened) or had started (it
        /// completed).
        #[sync_doc = "returns None once every token is accepted and decoded (a failed decode \
                      rolls all of them back and raises). Waits without the GIL; on Ctrl-C a \
                      started commit completes, then KeyboardInterrupt is raised."]
        fn commit / commit_sync(&self, py, entries: &Bound<'_, PyAny>) -> Option<()> {
            self.inner.commit(&commit_entries(entries)?)
        } => convert::none;

        /// Decode `(branch, tokens)` runs packed into ceil(total / n_batch) decodes, all or
        /// nothing. Cancelled, it either never ran or was aborted and rolled back.
        #[sync_doc = "returns None once every run is decoded. Waits without the GIL; Ctrl-C \
                      aborts and rolls the whole prefill back, then raises KeyboardInterrupt."]
        fn prefill / prefill_sync(&self, py, entries: &Bound<'_, PyAny>) -> Option<()> {
            self.inner.prefill(prefill_entries(entries)?)
        } => convert::none;

        /// `Branch.score` for many branches: each `(branch, tokens)` run scored as that call
        /// scores it (the first token from the branch's snapshot), the runs packed into the
        /// same decodes, so a handful of short continuations (the answers to rank, forks of
        /// one prompt) take one decode, not one each. All or nothing. Returns one list per
        /// entry, in order: logprobs, or with `top_logprobs=k` (at most 1024) `(logprob,
        /// [(token, logprob), ...])` pairs. Cancelled, it either never ran or completed.
        #[sync_doc = "returns the scores once every run is decoded. Waits without the GIL; on \
                      Ctrl-C a started scoring completes, then KeyboardInterrupt is raised."]
        #[pyo3(signature = (entries, top_logprobs = None))]
        fn score / score_sync(
            &self,
            py,
            entries: &Bound<'_, PyAny>,
            top_logprobs: Option<Int>,
        ) -> Vec<scores::Scores> {
            let top = scores::top_count(top_logprobs.as_ref())?;
            self.inner.score(prefill_entries(entries)?, top)
        } => scores::each(top_logprobs.is_some());

        /// Keep `winner`'s KV only; every other branch of the context is disposed at once, and
        /// the rest always happens, even if the await is cancelled.
        #[sync_doc = "returns None once every other branch is disposed and its lease freed. \
                      Always completes, even on Ctrl-C."]
        fn retain_only / retain_only_sync(&self, py, winner: &Bound<'_, PyAny>) -> Option<()> {
            self.inner.retain_only(&branch(winner, "winner")?)
        } => convert::none;

        /// Sample every branch (in Rust, in parallel) and commit the non-stop tokens in one
        /// decode (ceil(N / n_batch) over more than n_batch branches). Returns one Token per
        /// branch, in order (stop tokens are not committed). Cancelled, it either never ran or
        /// completed. It returns once the decode is queued: on a GPU the device still runs it
        /// while the caller takes the tokens, and a call that reads a branch's new row
        /// (`logits`, `entropy`, `top_logprobs`, the next step) waits for it; `position`,
        /// `perplexity` and the history are up to date at once.
        #[sync_doc = "returns one Token per branch, in order (stop tokens are not committed). \
                      Waits without the GIL; on Ctrl-C a started step completes, then \
                      KeyboardInterrupt is raised."]
        fn step / step_sync(&self, py, branches: &Bound<'_, PyAny>) -> Vec<PyToken> {
            self.inner.step(&branch_list(branches)?)
        } => tokens;
    }
}
