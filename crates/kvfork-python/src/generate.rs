//! Token iterators over one branch. Each step is one engine request — sample, then commit
//! unless it is a stop token — so many tasks iterating their own branches share decodes, and
//! sampling never runs on the event loop's thread.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

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
    /// A stop token was seen (it stays uncommitted; iteration is over).
    finished: AtomicBool,
}

impl Stepper {
    fn new(branch: kvfork::Branch, max_tokens: Option<usize>) -> Arc<Self> {
        Arc::new(Stepper {
            branch,
            max_tokens,
            produced: AtomicUsize::new(0),
            finished: AtomicBool::new(false),
        })
    }

    /// Queue the next step, or `None` when the iteration is over.
    fn next(&self) -> Option<kvfork::Pending<kvfork::Produced>> {
        let limit = self
            .max_tokens
            .is_some_and(|m| self.produced.load(Ordering::Relaxed) >= m);
        if limit || self.finished.load(Ordering::Relaxed) {
            return None;
        }
        Some(self.branch.step())
    }

    /// The token to yield, or `None` at a stop token.
    fn record(&self, p: kvfork::Produced) -> Option<PyToken> {
        if p.is_stop {
            self.finished.store(true, Ordering::Relaxed);
            return None;
        }
        self.produced.fetch_add(1, Ordering::Relaxed);
        Some(p.into())
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
