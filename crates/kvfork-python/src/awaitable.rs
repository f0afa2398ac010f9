//! Awaitables over engine replies.
//!
//! `Operation` is awaited by asyncio without a trip through `asyncio.Future` wrappers or a
//! helper thread: it yields a loop future, and the engine's reply reaches the loop through
//! its `Delivery` (see `delivery.rs`), which resolves the future on the loop thread. It keeps
//! kvfork's cancellation rule (`docs/concepts.md`, "Cancellation") — when a cancelled `await` hands control back, the operation
//! has fully happened or not at all: a job still queued is dropped (nothing happened); a
//! running prefill is aborted and rolled back; any other running job is waited for
//! (everything happened) before `CancelledError` is raised.
//!
//! An `Operation` that is never awaited (nor closed) warns when it is dropped, as a
//! never-awaited coroutine does: its work still happens, but its result and any error are
//! lost. One whose result would make something the caller then owns (a branch of a
//! `PrefixCache`) can be given a `Discard`: what it made is handed back when a cancelled await
//! drops the result.
//!
//! `Ready` is an awaitable that is already done (no trip through the event loop).

use std::ffi::CString;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Poll, Waker};

use pyo3::exceptions::{PyRuntimeError, PyRuntimeWarning, PyStopIteration};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;

use crate::delivery::{Deliver, Delivery, DeliveryWaker};
use crate::errors::to_py;
use kvfork::{Cancel, Canceller, Pending};

/// An engine reply and how to turn it into a Python value (type-erased).
trait Reply: Send {
    fn is_ready(&self) -> bool;
    /// Ask for `waker` to be woken when the reply comes; true if it is already there.
    fn register(&mut self, waker: &Waker) -> bool;
    /// The converted reply; call only once `is_ready`.
    fn convert(self: Box<Self>, py: Python<'_>) -> PyResult<Py<PyAny>>;
}

struct Typed<T, F> {
    pending: Pending<T>,
    /// The value, once a poll has taken it out of `pending`.
    value: Option<kvfork::Result<T>>,
    convert: F,
}

impl<T, F> Reply for Typed<T, F>
where
    T: Send + 'static,
    F: FnOnce(Python<'_>, T) -> PyResult<Py<PyAny>> + Send + 'static,
{
    fn is_ready(&self) -> bool {
        self.value.is_some() || self.pending.is_ready()
    }

    fn register(&mut self, waker: &Waker) -> bool {
        if self.is_ready() {
            return true;
        }
        let mut cx = std::task::Context::from_waker(waker);
        match Pin::new(&mut self.pending).poll(&mut cx) {
            // It came in between: keep it (the Pending gives it out once).
            Poll::Ready(v) => {
                self.value = Some(v);
                true
            }
            Poll::Pending => false,
        }
    }

    fn convert(self: Box<Self>, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let Typed {
            pending,
            value,
            convert,
        } = *self;
        // Ready: the wait does not block.
        let value = value.unwrap_or_else(|| pending.wait()).map_err(to_py)?;
        convert(py, value)
    }
}

/// The reply (until converted), the converted result and the loop future the awaiting task
/// sleeps on.
#[derive(Default)]
struct State {
    reply: Option<Box<dyn Reply>>,
    result: Option<PyResult<Py<PyAny>>>,
    waiter: Option<Py<PyAny>>,
    /// The result was handed out (a second await is an error).
    taken: bool,
}

struct Shared {
    state: Mutex<State>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    /// Convert the reply if it is there (the lock is not held while Python runs).
    fn settle(&self, py: Python<'_>) {
        let reply = {
            let mut st = lock(&self.state);
            match st.reply.take() {
                Some(r) if st.result.is_none() && r.is_ready() => Some(r),
                other => {
                    st.reply = other;
                    None
                }
            }
        };
        if let Some(r) = reply {
            let value = r.convert(py);
            lock(&self.state).result = Some(value);
        }
    }
}

impl Deliver for Shared {
    /// On the loop thread: convert the reply and wake the awaiting task.
    fn deliver(&self, py: Python<'_>) {
        self.settle(py);
        let waiter = {
            let mut st = lock(&self.state);
            if st.result.is_some() {
                st.waiter.take()
            } else {
                None
            }
        };
        if let Some(fut) = waiter {
            let fut = fut.bind(py);
            if matches!(
                fut.call_method0("done").and_then(|d| d.is_truthy()),
                Ok(false)
            ) {
                let _ = fut.call_method1("set_result", (py.None(),));
            }
        }
    }
}

/// What to do with a result that a cancelled await leaves behind (nobody will receive it).
pub type Discard = Box<dyn FnOnce(Python<'_>, Py<PyAny>) + Send>;

/// The Python call an operation came from (`Class.method`), for the never-awaited warning.
#[derive(Clone, Copy)]
pub struct Call(pub &'static str, pub &'static str);

/// The awaitable of a call that runs on the engine (a `Branch`, `BranchStore`, `Context` or
/// `PrefixCache` method without `_sync`). The work is queued when the call is made; awaiting
/// it gives the result. Cancelled, it either never ran, was rolled back, or completed. Never
/// awaited (nor closed), it warns with a RuntimeWarning when dropped, as a never-awaited
/// coroutine does: its work still happens, but its result and any error are lost.
#[pyclass(frozen, module = "kvfork", name = "Operation")]
pub struct Operation {
    shared: Arc<Shared>,
    canceller: Canceller,
    on_cancel: OnCancel,
    /// The exception of a cancel that had to wait for the job, raised once it is done.
    deferred: Mutex<Option<PyErr>>,
    call: Call,
    /// Python drove it (awaited, cancelled or closed): dropped otherwise, it warns.
    driven: AtomicBool,
    discard: Mutex<Option<Discard>>,
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

impl Operation {
    /// Await `pending` (the work of `call`) and convert its value with `convert` (with the
    /// GIL) when it arrives.
    pub fn new<T: Send + 'static>(
        call: Call,
        pending: Pending<T>,
        on_cancel: OnCancel,
        convert: impl FnOnce(Python<'_>, T) -> PyResult<Py<PyAny>> + Send + 'static,
    ) -> Self {
        let canceller = pending.canceller();
        let state = State {
            reply: Some(Box::new(Typed {
                pending,
                value: None,
                convert,
            })),
            ..State::default()
        };
        Operation {
            shared: Arc::new(Shared {
                state: Mutex::new(state),
            }),
            canceller,
            on_cancel,
            deferred: Mutex::new(None),
            call,
            driven: AtomicBool::new(false),
            discard: Mutex::new(None),
        }
    }

    /// `discard` receives the converted result when a cancelled await drops it.
    pub fn with_discard(self, discard: Discard) -> Self {
        *lock(&self.discard) = Some(discard);
        self
    }

    /// A result taken out for nobody (the await was cancelled): hand it to the discard.
    fn drop_result(&self, py: Python<'_>, result: Option<PyResult<Py<PyAny>>>) {
        if let Some(Ok(value)) = result {
            if let Some(discard) = lock(&self.discard).take() {
                discard(py, value);
            }
        }
    }

    fn drive(&self) {
        self.driven.store(true, Ordering::Relaxed);
    }

    /// One step of the await: the result (as StopIteration or the error), or a loop future
    /// to sleep on until it comes.
    fn step(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.shared.settle(py);
        {
            let mut st = lock(&self.shared.state);
            if st.taken {
                return Err(PyRuntimeError::new_err(
                    "this kvfork operation was already awaited",
                ));
            }
            if let Some(result) = st.result.take() {
                st.taken = true;
                drop(st);
                if let Some(err) = lock(&self.deferred).take() {
                    self.drop_result(py, Some(result));
                    return Err(err);
                }
                let value = result?;
                return Err(PyStopIteration::new_err((value,)));
            }
        }
        // A second task awaiting while the first still waits would take the wake-up from it
        // (the first then sleeps forever): refused, as a coroutine awaited twice is.
        let waiting = lock(&self.shared.state)
            .waiter
            .as_ref()
            .map(|w| w.clone_ref(py));
        if let Some(w) = waiting {
            if !w.bind(py).call_method0("done")?.is_truthy()? {
                return Err(PyRuntimeError::new_err(
                    "this kvfork operation is already being awaited by another task",
                ));
            }
        }
        static GET_RUNNING_LOOP: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
        let event_loop = GET_RUNNING_LOOP
            .get_or_try_init(py, || {
                py.import("asyncio")?
                    .getattr("get_running_loop")
                    .map(Bound::unbind)
            })?
            .bind(py)
            .call0()?;
        let delivery = Delivery::for_loop(py, &event_loop)?;
        let fut = event_loop.call_method0("create_future")?;
        // asyncio's Task accepts a yielded future only with this flag set (as `await` does).
        fut.setattr("_asyncio_future_blocking", true)?;
        let fut = fut.unbind();
        let op: Arc<dyn Deliver> = self.shared.clone();
        let waker = Waker::from(Arc::new(DeliveryWaker {
            delivery: delivery.clone(),
            op: Arc::downgrade(&op),
        }));
        let arrived = {
            let mut st = lock(&self.shared.state);
            st.waiter = Some(fut.clone_ref(py));
            st.reply.as_mut().is_some_and(|r| r.register(&waker))
        };
        if arrived {
            // It came between the check above and the registration: deliver it as usual.
            delivery.push(op);
        }
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
        self.drive();
        self.step(py)
    }

    /// Called by asyncio as it drives the await (the value sent in is not used).
    fn send(&self, py: Python<'_>, _value: Py<PyAny>) -> PyResult<Py<PyAny>> {
        self.drive();
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
        self.drive();
        let err = exception(typ, val)?;
        self.shared.settle(py);
        {
            let mut st = lock(&self.shared.state);
            if st.result.is_some() || st.taken {
                // Done already: it fully happened.
                st.taken = true;
                let result = st.result.take();
                drop(st);
                self.drop_result(py, result);
                return Err(err);
            }
        }
        let cancel = self.canceller.cancel();
        if cancel == Cancel::Prevented || self.on_cancel == OnCancel::Detach {
            lock(&self.shared.state).taken = true;
            return Err(err);
        }
        // Running: wait for it (aborted and rolled back, or completed), then raise.
        lock(&self.deferred).get_or_insert(err);
        self.step(py)
    }

    /// Called when the awaiting coroutine is closed: stop the job if it has not started.
    fn close(&self) {
        self.drive();
        let _ = self.canceller.cancel();
    }

    /// Whether the reply has arrived.
    fn done(&self) -> bool {
        let st = lock(&self.shared.state);
        st.result.is_some() || st.taken || st.reply.as_ref().is_some_and(|r| r.is_ready())
    }
}

impl Drop for Operation {
    /// Never awaited: warn as a never-awaited coroutine does (the work happened or happens;
    /// its result and any error are lost).
    fn drop(&mut self) {
        if self.driven.load(Ordering::Relaxed) {
            return;
        }
        let Call(owner, method) = self.call;
        // A dunder has no twin (a stream's `__anext__`: `generate_sync` iterates).
        let twin = if method.starts_with("__") {
            "the blocking twin".to_string()
        } else {
            format!("{method}_sync")
        };
        let message = CString::new(format!(
            "kvfork operation {owner}.{method}() was never awaited (await it, or call {twin} \
             in blocking code)"
        ))
        .unwrap_or_default();
        Python::attach(|py| {
            // Dropped while an exception propagates (a temporary of an expression that
            // raised): the warning must not run with it set, and it goes on after, as
            // CPython does for a coroutine.
            let raising = RaisedException::set_aside();
            let category = py.get_type::<PyRuntimeWarning>();
            if let Err(err) = PyErr::warn(py, &category, &message, 1) {
                // Warnings as errors: reported as an unraisable error, as for a coroutine.
                err.write_unraisable(py, None);
            }
            raising.restore();
        });
    }
}

/// The exception being raised, if any, taken out of the thread's error indicator (not
/// through `PyErr::take`, which resumes a PanicException's panic).
struct RaisedException([*mut pyo3::ffi::PyObject; 3]);

impl RaisedException {
    /// Take it out (the GIL is held).
    #[allow(deprecated)] // PyErr_Fetch: in every version the crate builds for
    fn set_aside() -> Self {
        let mut parts = [std::ptr::null_mut(); 3];
        let [t, v, tb] = &mut parts;
        // SAFETY: the GIL is held; PyErr_Fetch moves the indicator's references to us.
        unsafe { pyo3::ffi::PyErr_Fetch(t, v, tb) };
        RaisedException(parts)
    }

    /// Put it back (the GIL is held), replacing any error set meanwhile.
    #[allow(deprecated)]
    fn restore(self) {
        let [t, v, tb] = self.0;
        if !t.is_null() {
            // SAFETY: the GIL is held; PyErr_Restore takes back the references fetched.
            unsafe { pyo3::ffi::PyErr_Restore(t, v, tb) };
        }
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
