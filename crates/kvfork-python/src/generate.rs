//! Token iterators over one branch. Each step is one engine request — sample, then commit
//! unless it is a stop token — so many tasks iterating their own branches share decodes, and
//! sampling never runs on the event loop's thread.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use pyo3::exceptions::{PyStopAsyncIteration, PyStopIteration};
use pyo3::prelude::*;
use pyo3::IntoPyObjectExt;

use crate::awaitable::{OnCancel, Operation};
use crate::convert::wait;
use crate::token::PyToken;

/// The state shared by the steps of one iteration.
struct Stepper {
    branch: kvfork::Branch,
    max_tokens: Option<usize>,
    produced: AtomicUsize,
    /// Why the iteration ended (`stop_reason`): the first reason set wins.
    stop: OnceLock<&'static str>,
}

impl Stepper {
    fn new(branch: kvfork::Branch, max_tokens: Option<usize>) -> Arc<Self> {
        Arc::new(Stepper {
            branch,
            max_tokens,
            produced: AtomicUsize::new(0),
            stop: OnceLock::new(),
        })
    }

    fn finish(&self, reason: &'static str) {
        let _ = self.stop.set(reason);
    }

    /// Queue the next step, or `None` when the iteration is over: at a stop token, after
    /// `max_tokens`, or when the branch's position reached `n_ctx` (no room for a token).
    fn next(&self) -> Option<kvfork::Pending<kvfork::Produced>> {
        if self.stop.get().is_some() {
            return None;
        }
        if self
            .max_tokens
            .is_some_and(|m| self.produced.load(Ordering::Relaxed) >= m)
        {
            self.finish("max_tokens");
            return None;
        }
        let n_ctx = self.branch.context().n_ctx();
        if self.branch.position().is_ok_and(|p| p as u32 >= n_ctx) {
            self.finish("context_full");
            return None;
        }
        Some(self.branch.step())
    }

    /// The token to yield, or `None` at a stop token.
    fn record(&self, p: kvfork::Produced) -> Option<PyToken> {
        if p.is_stop {
            self.finish("stop_token");
            return None;
        }
        self.produced.fetch_add(1, Ordering::Relaxed);
        Some(p.into())
    }

    fn stop_reason(&self) -> Option<&'static str> {
        self.stop.get().copied()
    }
}

/// `async for tok in branch.generate(max_tokens)`. A cancelled step either never ran or
/// completed (its token is committed but not yielded).
#[pyclass(frozen, module = "kvfork", name = "TokenStream")]
pub struct PyGenerator {
    stepper: Arc<Stepper>,
}

impl PyGenerator {
    pub fn new(branch: kvfork::Branch, max_tokens: Option<usize>) -> Self {
        PyGenerator {
            stepper: Stepper::new(branch, max_tokens),
        }
    }
}

#[pymethods]
impl PyGenerator {
    /// Why the stream ended: "stop_token" (an end-of-generation token, not committed),
    /// "max_tokens", or "context_full" (the branch reached n_ctx: `reseed_context` makes
    /// room); None while it runs.
    #[getter]
    fn stop_reason(&self) -> Option<&'static str> {
        self.stepper.stop_reason()
    }

    fn __aiter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __anext__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let op = match self.stepper.next() {
            None => Operation::new(kvfork::Pending::ready(Ok(())), OnCancel::Settle, |_, ()| {
                Err(PyStopAsyncIteration::new_err(()))
            }),
            Some(pending) => {
                let stepper = self.stepper.clone();
                Operation::new(pending, OnCancel::Settle, move |py, p| {
                    match stepper.record(p) {
                        Some(tok) => tok.into_py_any(py),
                        None => Err(PyStopAsyncIteration::new_err(())),
                    }
                })
            }
        };
        Bound::new(py, op).map(Bound::into_any)
    }
}

/// `for tok in branch.generate_sync(max_tokens)`.
#[pyclass(frozen, module = "kvfork", name = "TokenStreamSync")]
pub struct PyGeneratorSync {
    stepper: Arc<Stepper>,
}

impl PyGeneratorSync {
    pub fn new(branch: kvfork::Branch, max_tokens: Option<usize>) -> Self {
        PyGeneratorSync {
            stepper: Stepper::new(branch, max_tokens),
        }
    }
}

#[pymethods]
impl PyGeneratorSync {
    /// Why the stream ended: "stop_token", "max_tokens" or "context_full"; None while it runs.
    #[getter]
    fn stop_reason(&self) -> Option<&'static str> {
        self.stepper.stop_reason()
    }

    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<PyToken> {
        let Some(pending) = self.stepper.next() else {
            return Err(PyStopIteration::new_err(()));
        };
        self.stepper
            .record(wait(py, pending)?)
            .ok_or_else(|| PyStopIteration::new_err(()))
    }
}
