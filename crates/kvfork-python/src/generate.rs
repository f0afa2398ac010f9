//! Token iterators over one branch: Python's iteration protocols over the engine's
//! `kvfork::TokenStream` (each step is one engine request, so many tasks iterating their own
//! branches share decodes), and the speculative rounds' schedule for `kvfork._speculative`.

use std::sync::{Arc, Mutex};

use pyo3::exceptions::{PyStopAsyncIteration, PyStopIteration};
use pyo3::prelude::*;
use pyo3::IntoPyObjectExt;

use crate::awaitable::{OnCancel, Operation};
use crate::branch::PyBranch;
use crate::convert::{wait, Int};
use crate::token::PyToken;

/// The engine's stream, shared by the awaitables of its steps.
type Stepper = Arc<kvfork::TokenStream>;

fn stepper(branch: kvfork::Branch, max_tokens: Option<usize>) -> Stepper {
    Arc::new(kvfork::TokenStream::new(branch, max_tokens))
}

fn stop_reason(stepper: &Stepper) -> Option<&'static str> {
    stepper.stop_reason().map(kvfork::StopReason::as_str)
}

/// `async for tok in branch.generate(max_tokens)`. A cancelled step either never ran or
/// completed (its token is committed but not yielded).
#[pyclass(frozen, module = "kvfork", name = "TokenStream")]
pub struct PyGenerator {
    stepper: Stepper,
}

impl PyGenerator {
    pub fn new(branch: kvfork::Branch, max_tokens: Option<usize>) -> Self {
        PyGenerator {
            stepper: stepper(branch, max_tokens),
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
        stop_reason(&self.stepper)
    }

    fn __aiter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __anext__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let op = match self.stepper.next_step() {
            None => Operation::new(kvfork::Pending::ready(Ok(())), OnCancel::Settle, |_, ()| {
                Err(PyStopAsyncIteration::new_err(()))
            }),
            Some(pending) => {
                let stepper = self.stepper.clone();
                Operation::new(pending, OnCancel::Settle, move |py, p| {
                    match stepper.record(p) {
                        Some(tok) => PyToken::from(tok).into_py_any(py),
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
    stepper: Stepper,
}

impl PyGeneratorSync {
    pub fn new(branch: kvfork::Branch, max_tokens: Option<usize>) -> Self {
        PyGeneratorSync {
            stepper: stepper(branch, max_tokens),
        }
    }
}

#[pymethods]
impl PyGeneratorSync {
    /// Why the stream ended: "stop_token", "max_tokens" or "context_full"; None while it runs.
    #[getter]
    fn stop_reason(&self) -> Option<&'static str> {
        stop_reason(&self.stepper)
    }

    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<PyToken> {
        let Some(pending) = self.stepper.next_step() else {
            return Err(PyStopIteration::new_err(()));
        };
        self.stepper
            .record(wait(py, pending)?)
            .map(PyToken::from)
            .ok_or_else(|| PyStopIteration::new_err(()))
    }
}

/// The budget and guess length of speculative rounds (`kvfork::SpeculativeSchedule`), for the
/// streams of `kvfork._speculative`, which only await the drafter and the engine.
#[pyclass(frozen, module = "kvfork", name = "SpeculativeSchedule")]
pub struct PySpeculativeSchedule {
    inner: Mutex<kvfork::SpeculativeSchedule>,
}

impl PySpeculativeSchedule {
    fn with<R>(&self, f: impl FnOnce(&mut kvfork::SpeculativeSchedule) -> R) -> R {
        f(&mut self.inner.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

#[pymethods]
impl PySpeculativeSchedule {
    /// A schedule for at most `max_tokens` tokens (None: no limit).
    #[new]
    #[pyo3(signature = (max_tokens=None))]
    fn new(max_tokens: Option<Int>) -> PyResult<Self> {
        let max_tokens = max_tokens
            .map(|m| m.within("max_tokens", 0, i64::MAX).map(|m| m as usize))
            .transpose()?;
        Ok(PySpeculativeSchedule {
            inner: Mutex::new(kvfork::SpeculativeSchedule::new(max_tokens)),
        })
    }

    /// Count one token handed to the caller.
    fn yielded_one(&self) {
        self.with(|s| s.yielded_one());
    }

    /// Whether the stream is over before another round (setting `stop_reason`).
    fn ended(&self) -> bool {
        self.with(|s| s.ended())
    }

    /// How many guessed tokens this round may decode after `pending` on `branch` (0: decode
    /// `pending` alone), or None when the stream ends at `pending` (a stop token, or a full
    /// context).
    fn guess_len(
        &self,
        branch: &Bound<'_, PyBranch>,
        pending: &Bound<'_, PyToken>,
    ) -> Option<usize> {
        let produced = pending.get().produced();
        let branch = branch.get().inner.clone();
        self.with(|s| s.guess_len(&branch, &produced))
    }

    /// Record a round: `drafted` guessed tokens decoded, `accepted` of them kept.
    fn took(&self, drafted: usize, accepted: usize) {
        self.with(|s| s.took(drafted, accepted));
    }

    /// Why the stream ended: "stop_token", "max_tokens" or "context_full"; None while it runs.
    #[getter]
    fn stop_reason(&self) -> Option<&'static str> {
        self.with(|s| s.stop_reason().map(kvfork::StopReason::as_str))
    }

    /// Rounds run (decodes of a pending token plus its guess).
    #[getter]
    fn rounds(&self) -> usize {
        self.with(|s| s.rounds())
    }

    /// Guessed tokens decoded over all rounds.
    #[getter]
    fn drafted(&self) -> usize {
        self.with(|s| s.drafted())
    }

    /// Guessed tokens the chain drew too.
    #[getter]
    fn accepted(&self) -> usize {
        self.with(|s| s.accepted())
    }

    /// Share of guessed tokens the chain drew too (0 before any guess).
    #[getter]
    fn acceptance(&self) -> f64 {
        self.with(|s| s.acceptance())
    }
}
