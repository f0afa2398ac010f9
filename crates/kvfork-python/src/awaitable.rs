//! Awaitables over engine replies.
//!
//! `Operation` is awaited by asyncio without a trip through `asyncio.Future` wrappers: it
//! yields a loop future that a tokio task resolves when the engine replies. It keeps the
//! spec's cancellation rule — when a cancelled `await` hands control back, the operation has
//! fully happened or not at all: a job still queued is dropped (nothing happened); a running
//! prefill is aborted and rolled back; any other running job is waited for (everything
//! happened) before `CancelledError` is raised.
//!
//! `Ready` is an awaitable that is already done (no trip through the event loop).

use std::sync::{Arc, Mutex, MutexGuard};

use pyo3::exceptions::{PyRuntimeError, PyStopIteration};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyCFunction, PyTuple};

use crate::errors::to_py;
use kvfork::{Cancel, Canceller, Pending};

/// The converted reply and the loop future the awaiting task sleeps on.
#[derive(Default)]
struct Slot {
    result: Option<PyResult<Py<PyAny>>>,
    waiter: Option<Py<PyAny>>,
    /// The result was handed out (a second await is an error).
    taken: bool,
}

/// What a cancel does to the work behind an `Operation`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum OnCancel {
    /// Engine work: dropped, aborted or waited for (see the module doc).
    Settle,
    /// Work that cannot be stopped and has no effect until its result is used (creating a
    /// context): raise at once; the result is dropped (and freed) when it arrives.
    Detach,
}

#[pyclass(frozen, module = "kvfork", name = "Operation")]
pub struct Operation {
    slot: Arc<Mutex<Slot>>,
    canceller: Canceller,
    on_cancel: OnCancel,
    /// The exception of a cancel that had to wait for the job, raised once it is done.
    deferred: Mutex<Option<PyErr>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// `loop.call_soon_threadsafe(_wake, fut)`: resolves the future unless it was cancelled.
fn wake(py: Python<'_>, fut: Py<PyAny>) {
    static WAKE: PyOnceLock<Py<PyCFunction>> = PyOnceLock::new();
    let wake = WAKE.get_or_try_init(py, || {
        PyCFunction::new_closure(py, None, None, |args: &Bound<'_, PyTuple>, _| {
            let fut = args.get_item(0)?;
            if !fut.call_method0("done")?.is_truthy()? {
                fut.call_method1("set_result", (args.py().None(),))?;
            }
            Ok::<_, PyErr>(())
        })
        .map(Bound::unbind)
    });
    let Ok(wake) = wake else { return };
    let fut = fut.bind(py);
    // A closed loop raises here; nobody is waiting then.
    if let Ok(event_loop) = fut.call_method0("get_loop") {
        let _ = event_loop.call_method1("call_soon_threadsafe", (wake.bind(py), fut));
    }
}

impl Operation {
    /// Await `pending` and convert its value with `convert` (with the GIL) when it arrives.
    pub fn new<T: Send + 'static>(
        pending: Pending<T>,
        on_cancel: OnCancel,
        convert: impl FnOnce(Python<'_>, T) -> PyResult<Py<PyAny>> + Send + 'static,
    ) -> Self {
        let slot = Arc::new(Mutex::new(Slot::default()));
        let canceller = pending.canceller();
        let delivered = slot.clone();
        pyo3_async_runtimes::tokio::get_runtime().spawn(async move {
            let reply = pending.await;
            // At interpreter shutdown nobody can receive it; the reply is dropped.
            let _ = Python::try_attach(|py| {
                let value = reply.map_err(to_py).and_then(|v| convert(py, v));
                let waiter = {
                    let mut s = lock(&delivered);
                    s.result = Some(value);
                    s.waiter.take()
                };
                if let Some(fut) = waiter {
                    wake(py, fut);
                }
            });
        });
        Operation {
            slot,
            canceller,
            on_cancel,
            deferred: Mutex::new(None),
        }
    }

    /// One step of the await: the result (as StopIteration or the error), or a loop future
    /// to sleep on until it comes.
    fn step(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        // No Python runs while the slot is locked: it could release the GIL to the tokio
        // thread that delivers the reply (which takes the GIL, then the slot).
        let ready = { lock(&self.slot).result.is_some() };
        let fut = if ready {
            None
        } else {
            let fut = py
                .import("asyncio")?
                .call_method0("get_running_loop")?
                .call_method0("create_future")?;
            // asyncio's Task accepts a yielded future only with this flag set (as `await` does).
            fut.setattr("_asyncio_future_blocking", true)?;
            Some(fut.unbind())
        };
        let mut slot = lock(&self.slot);
        if slot.taken {
            return Err(PyRuntimeError::new_err(
                "this kvfork operation was already awaited",
            ));
        }
        if let Some(result) = slot.result.take() {
            slot.taken = true;
            drop(slot);
            if let Some(err) = lock(&self.deferred).take() {
                return Err(err);
            }
            let value = result?;
            return Err(PyStopIteration::new_err((value,)));
        }
        let fut = fut.expect("created above: the result was not there");
        slot.waiter = Some(fut.clone_ref(py));
        Ok(fut)
    }
}

fn exception(typ: &Bound<'_, PyAny>, val: Option<&Bound<'_, PyAny>>) -> PyResult<PyErr> {
    if typ.is_instance_of::<pyo3::exceptions::PyBaseException>() {
        return Ok(PyErr::from_value(typ.clone()));
    }
    let value = match val {
        Some(v) if v.is_instance_of::<pyo3::exceptions::PyBaseException>() => v.clone(),
        Some(v) if !v.is_none() => typ.call1((v,))?,
        _ => typ.call0()?,
    };
    Ok(PyErr::from_value(value))
}

#[pymethods]
impl Operation {
    fn __await__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.step(py)
    }

    fn send(&self, py: Python<'_>, _value: Py<PyAny>) -> PyResult<Py<PyAny>> {
        self.step(py)
    }

    /// Called by asyncio with CancelledError when the awaiting task is cancelled.
    #[pyo3(signature = (typ, val=None, _tb=None))]
    fn throw(
        &self,
        py: Python<'_>,
        typ: &Bound<'_, PyAny>,
        val: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let err = exception(typ, val)?;
        {
            let mut slot = lock(&self.slot);
            if slot.result.is_some() || slot.taken {
                // Done already: it fully happened.
                slot.taken = true;
                return Err(err);
            }
        }
        let cancel = self.canceller.cancel();
        if cancel == Cancel::Prevented || self.on_cancel == OnCancel::Detach {
            lock(&self.slot).taken = true;
            return Err(err);
        }
        // Running: wait for it (aborted and rolled back, or completed), then raise.
        lock(&self.deferred).get_or_insert(err);
        self.step(py)
    }

    /// Called when the awaiting coroutine is closed: stop the job if it has not started.
    fn close(&self) {
        let _ = self.canceller.cancel();
    }

    /// Whether the reply has arrived.
    fn done(&self) -> bool {
        let slot = lock(&self.slot);
        slot.result.is_some() || slot.taken
    }
}

#[pyclass(frozen, module = "kvfork")]
pub struct Ready {
    value: Py<PyAny>,
}

impl Ready {
    pub fn new(value: Py<PyAny>) -> Self {
        Ready { value }
    }
}

#[pymethods]
impl Ready {
    fn __await__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        Err(PyStopIteration::new_err((self.value.clone_ref(py),)))
    }
}
