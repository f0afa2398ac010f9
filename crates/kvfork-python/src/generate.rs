//! Token iterators over one branch: Python's iteration protocols over the engine's
//! `kvfork::TokenStream` (each step is one engine request, so many tasks iterating their own
//! branches share decodes), and the speculative rounds' schedule for `kvfork._speculative`.

use std::sync::{Arc, Mutex};

use pyo3::exceptions::{PyStopAsyncIteration, PyStopIteration};
use pyo3::prelude::*;
use pyo3::IntoPyObjectExt;

use crate::awaitable::{Call, OnCancel, Operation};
use crate::convert::{on_full_arg, wait, Int};
use crate::errors::IntoPyResult;
use crate::handles::PyBranch;
use crate::token::PyToken;

/// The engine's stream, shared by the awaitables of its steps.
type Stepper = Arc<kvfork::TokenStream>;

fn stepper(
    branch: kvfork::Branch,
    max_tokens: Option<usize>,
    on_full: kvfork::OnContextFull,
) -> PyResult<Stepper> {
    let stream = kvfork::TokenStream::new(branch, max_tokens).on_context_full(on_full);
    Ok(Arc::new(stream.py()?))
}

fn stop_reason(stepper: &Stepper) -> Option<&'static str> {
    stepper.stop_reason().map(kvfork::StopReason::as_str)
}

/// The call a stream's steps come from (an `async for` always awaits them).
const NEXT_TOKEN: Call = Call("TokenStream", "__anext__");

/// `async for tok in branch.generate(max_tokens)`. A cancelled step either never ran or
/// completed (its token is committed but not yielded).
#[pyclass(frozen, module = "kvfork", name = "TokenStream")]
pub struct PyGenerator {
    stepper: Stepper,
}

impl PyGenerator {
    pub fn new(
        branch: kvfork::Branch,
        max_tokens: Option<usize>,
        on_full: kvfork::OnContextFull,
    ) -> PyResult<Self> {
        Ok(PyGenerator {
            stepper: stepper(branch, max_tokens, on_full)?,
        })
    }
}

#[pymethods]
impl PyGenerator {
    /// Why the stream ended: "stop_token" (an end-of-generation token, not committed),
    /// "max_tokens", or "context_full" (the branch reached n_ctx with
    /// `on_context_full="stop"`: `shift_context` or `reseed_context` makes room); None while
    /// it runs.
    #[getter]
    fn stop_reason(&self) -> Option<&'static str> {
        stop_reason(&self.stepper)
    }

    /// Context shifts so far (`on_context_full="shift"`).
    #[getter]
    fn shifts(&self) -> usize {
        self.stepper.shifts()
    }

    fn __aiter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __anext__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let op = match self.stepper.next_step() {
            None => Operation::new(
                NEXT_TOKEN,
                kvfork::Pending::ready(Ok(())),
                OnCancel::Settle,
                |_, ()| Err(PyStopAsyncIteration::new_err(())),
            ),
            Some(pending) => {
                let stepper = self.stepper.clone();
                Operation::new(
                    NEXT_TOKEN,
                    pending,
                    OnCancel::Settle,
                    move |py, p| match stepper.record(p) {
                        Some(tok) => PyToken::from(tok).into_py_any(py),
                        None => Err(PyStopAsyncIteration::new_err(())),
                    },
                )
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
    pub fn new(
        branch: kvfork::Branch,
        max_tokens: Option<usize>,
        on_full: kvfork::OnContextFull,
    ) -> PyResult<Self> {
        Ok(PyGeneratorSync {
            stepper: stepper(branch, max_tokens, on_full)?,
        })
    }
}

#[pymethods]
impl PyGeneratorSync {
    /// Why the stream ended: "stop_token", "max_tokens" or "context_full"; None while it runs.
    #[getter]
    fn stop_reason(&self) -> Option<&'static str> {
        stop_reason(&self.stepper)
    }

    /// Context shifts so far (`on_context_full="shift"`).
    #[getter]
    fn shifts(&self) -> usize {
        self.stepper.shifts()
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
    /// A schedule for at most `max_tokens` tokens (None: no limit); at the end of the
    /// context the stream stops (`on_context_full="stop"`) or shifts, keeping `keep` tokens
    /// (`"shift"`).
    #[new]
    #[pyo3(signature = (max_tokens=None, *, on_context_full="stop", keep=Int(Some(4))),
           text_signature = "(max_tokens=None, *, on_context_full='stop', keep=4)")]
    fn new(max_tokens: Option<Int>, on_context_full: &str, keep: Int) -> PyResult<Self> {
        let max_tokens = max_tokens
            .map(|m| m.within("max_tokens", 0, i64::MAX).map(|m| m as usize))
            .transpose()?;
        let on_full = on_full_arg(on_context_full, keep)?;
        let schedule = kvfork::SpeculativeSchedule::new(max_tokens).on_context_full(on_full);
        Ok(PySpeculativeSchedule {
            inner: Mutex::new(schedule),
        })
    }

    /// Before a round: the `keep` of the context shift the stream must make first (the
    /// branch is at n_ctx and the stream shifts; counted in `shifts`), else None.
    fn shift_due(&self, branch: &Bound<'_, PyBranch>) -> Option<usize> {
        let branch = branch.get().inner.clone();
        self.with(|s| s.shift_due(&branch))
    }

    /// Context shifts so far.
    #[getter]
    fn shifts(&self) -> usize {
        self.with(|s| s.shifts())
    }

    /// Whether the guess-length policy found that guessing does not pay here (it decodes
    /// the pending token alone, with a short probe now and then).
    #[getter]
    fn resting(&self) -> bool {
        self.with(|s| s.policy().resting())
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

    /// Whether this round asks the drafter even when `guess_len` gave 0: the guess is not
    /// decoded but checked against the tokens the chain draws next (the acceptance measured
    /// for free, while the drafter costs at most a small share of a one-token round).
    #[getter]
    fn shadowing(&self) -> bool {
        self.with(|s| s.shadowing())
    }

    /// The drafter guessed `guess` for a round of `len` guessed tokens (from `guess_len`):
    /// records the drafter's time, keeps the tokens after the draft for shadow checks, and
    /// starts timing the decode. Returns the draft: `guess` cut to `len` (ValueError for a
    /// token in it out of range).
    fn proposed(&self, guess: Vec<Int>, len: Int) -> PyResult<Vec<kvfork::Token>> {
        let len = len.within("len", 0, i64::MAX)? as usize;
        let cut = len.min(guess.len());
        let mut tokens = crate::convert::draft_tokens(&guess[..cut])?;
        // After the draft, a number that is no token is never drawn: the checks stop there.
        tokens.extend(
            guess[cut..]
                .iter()
                .map_while(|t| t.0.and_then(|v| kvfork::Token::try_from(v).ok())),
        );
        Ok(self.with(|s| s.proposed(tokens, len)))
    }

    /// Record a round: `drafted` guessed tokens decoded, `accepted` of them kept, `next` the
    /// token the chain drew after them.
    fn took(&self, drafted: Int, accepted: Int, next: &Bound<'_, PyToken>) -> PyResult<()> {
        let drafted = drafted.within("drafted", 0, i64::MAX)? as usize;
        let accepted = accepted.within("accepted", 0, i64::MAX)? as usize;
        let next = next.get().token;
        self.with(|s| s.took(drafted, accepted, next));
        Ok(())
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
