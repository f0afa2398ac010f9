//! Engine replies reach an asyncio event loop in batches, without the engine taking the GIL.
//!
//! Each loop gets one `Delivery`: a queue of operations whose reply has arrived and a pipe
//! the loop watches (`add_reader`). The engine thread (or whoever replies) queues the
//! operation and, if the queue was empty, writes one byte; the loop thread then hands out
//! every queued reply in one callback. So the tasks whose requests shared a decode resume in
//! the same loop iteration and their next requests reach the engine together, and no thread
//! waits for the GIL while the loop runs Python.
//!
//! Where a loop cannot watch a pipe (no `add_reader`, as Windows' proactor loop), a
//! short-lived thread schedules the same callback with `call_soon_threadsafe`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::task::Wake;

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyCFunction, PyTuple};

/// An operation that can take its reply (on the loop thread, with the GIL).
pub trait Deliver: Send + Sync {
    fn deliver(&self, py: Python<'_>);
}

/// How the loop learns that replies are queued.
enum Notify {
    /// One byte in a pipe the loop watches.
    #[cfg(unix)]
    Pipe {
        read: std::fs::File,
        write: std::fs::File,
    },
    /// `loop.call_soon_threadsafe(drain)` from a helper thread (the loop held weakly).
    Threadsafe {
        event_loop: Py<PyAny>,
        drain: Py<PyAny>,
    },
}

pub struct Delivery {
    queue: Mutex<Vec<Arc<dyn Deliver>>>,
    /// A wake-up is on its way (set by the first reply of a batch, cleared by the drain).
    signalled: AtomicBool,
    /// Set once, right after creation.
    notify: OnceLock<Notify>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Keeps a loop's delivery alive as long as the loop (the value of a WeakKeyDictionary).
#[pyclass(frozen, module = "kvfork")]
pub struct LoopDelivery(Arc<Delivery>);

impl Delivery {
    /// The delivery of `event_loop`, created on first use and kept as long as the loop lives.
    pub fn for_loop(py: Python<'_>, event_loop: &Bound<'_, PyAny>) -> PyResult<Arc<Delivery>> {
        static BY_LOOP: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
        let by_loop = BY_LOOP.get_or_try_init(py, || {
            py.import("weakref")?
                .getattr("WeakKeyDictionary")?
                .call0()
                .map(Bound::unbind)
        })?;
        let by_loop = by_loop.bind(py);
        if let Ok(found) = by_loop.get_item(event_loop) {
            if let Ok(d) = found.cast::<LoopDelivery>() {
                return Ok(d.get().0.clone());
            }
        }
        let delivery = Arc::new(Delivery {
            queue: Mutex::new(Vec::new()),
            signalled: AtomicBool::new(false),
            notify: OnceLock::new(),
        });
        let drain = delivery.drain_callback(py)?;
        let weak_loop = py.import("weakref")?.getattr("ref")?.call1((&event_loop,));
        let notify = match weak_loop {
            // Cached per loop: a pipe when the loop can watch one.
            Ok(weak_loop) => {
                by_loop.set_item(event_loop, LoopDelivery(delivery.clone()))?;
                match watch_pipe(py, event_loop, &drain)? {
                    Some(pipe) => pipe,
                    None => Notify::Threadsafe {
                        event_loop: weak_loop.unbind(),
                        drain: drain.into_any().unbind(),
                    },
                }
            }
            // A loop without weak references: a delivery per operation, holding the loop.
            Err(_) => Notify::Threadsafe {
                event_loop: event_loop.clone().unbind(),
                drain: drain.into_any().unbind(),
            },
        };
        let _ = delivery.notify.set(notify);
        Ok(delivery)
    }

    fn drain_callback<'py>(self: &Arc<Self>, py: Python<'py>) -> PyResult<Bound<'py, PyCFunction>> {
        let weak = Arc::downgrade(self);
        PyCFunction::new_closure(py, None, None, move |args: &Bound<'_, PyTuple>, _| {
            if let Some(d) = weak.upgrade() {
                d.drain(args.py());
            }
            Ok::<_, PyErr>(())
        })
    }

    /// Queue `op` (its reply is there) and wake the loop if this starts a batch. Any thread;
    /// never takes the GIL.
    pub fn push(self: &Arc<Self>, op: Arc<dyn Deliver>) {
        lock(&self.queue).push(op);
        if !self.signalled.swap(true, Ordering::AcqRel) {
            self.wake_loop();
        }
    }

    fn wake_loop(self: &Arc<Self>) {
        match self.notify.get() {
            #[cfg(unix)]
            Some(Notify::Pipe { write, .. }) => {
                use std::io::Write;
                // Non-blocking; a full pipe already holds a wake-up.
                let _ = (&*write).write(&[1]);
            }
            Some(Notify::Threadsafe { .. }) => {
                let me = self.clone();
                std::thread::spawn(move || me.schedule_drain());
            }
            None => {}
        }
    }

    /// `loop.call_soon_threadsafe(drain)` (the loop may be held by a weak reference).
    fn schedule_drain(&self) {
        let _ = Python::try_attach(|py| {
            let Some(Notify::Threadsafe { event_loop, drain }) = self.notify.get() else {
                return;
            };
            let mut target = event_loop.bind(py).clone();
            if target.is_instance_of::<pyo3::types::PyWeakrefReference>() {
                match target.call0() {
                    Ok(l) if !l.is_none() => target = l,
                    _ => return,
                }
            }
            // A closed loop raises; nobody is waiting then.
            let _ = target.call_method1("call_soon_threadsafe", (drain.bind(py),));
        });
    }

    /// On the loop thread: hand out every queued reply.
    fn drain(&self, py: Python<'_>) {
        // Empty the pipe BEFORE clearing the flag: a wake-up written after this read then
        // stays in the pipe, so a later reply never finds the flag set with no byte coming.
        #[cfg(unix)]
        if let Some(Notify::Pipe { read, .. }) = self.notify.get() {
            use std::io::Read;
            let mut buf = [0u8; 64];
            while matches!((&*read).read(&mut buf), Ok(n) if n == buf.len()) {}
        }
        self.signalled.store(false, Ordering::Release);
        let ready = std::mem::take(&mut *lock(&self.queue));
        for op in ready {
            op.deliver(py);
        }
    }
}

/// A non-blocking pipe watched by the loop; `None` when the loop cannot watch one.
#[cfg(unix)]
fn watch_pipe(
    py: Python<'_>,
    event_loop: &Bound<'_, PyAny>,
    drain: &Bound<'_, PyCFunction>,
) -> PyResult<Option<Notify>> {
    use std::os::fd::{FromRawFd, OwnedFd};
    let os = py.import("os")?;
    let (r, w): (i32, i32) = os.call_method0("pipe")?.extract()?;
    // SAFETY: os.pipe() returned two fresh descriptors that nothing else owns.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(r), OwnedFd::from_raw_fd(w)) };
    os.call_method1("set_blocking", (r, false))?;
    os.call_method1("set_blocking", (w, false))?;
    match event_loop.call_method1("add_reader", (r, drain)) {
        Ok(_) => Ok(Some(Notify::Pipe {
            read: read.into(),
            write: write.into(),
        })),
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyNotImplementedError>(py) => Ok(None),
        Err(e) => Err(e),
    }
}

#[cfg(not(unix))]
fn watch_pipe(
    _py: Python<'_>,
    _event_loop: &Bound<'_, PyAny>,
    _drain: &Bound<'_, PyCFunction>,
) -> PyResult<Option<Notify>> {
    Ok(None)
}

/// Wakes an operation by queueing it on its loop's delivery.
pub struct DeliveryWaker {
    pub delivery: Arc<Delivery>,
    pub op: Weak<dyn Deliver>,
}

impl Wake for DeliveryWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if let Some(op) = self.op.upgrade() {
            self.delivery.push(op);
        }
    }
}
