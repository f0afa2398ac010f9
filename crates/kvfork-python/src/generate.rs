//! Token iterators over one branch: produce → (stop? end) → commit → yield.
//! Each step's commit goes through the engine's coalescing queue, so many tasks iterating
//! their own branches share decodes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use pyo3::exceptions::{PyStopAsyncIteration, PyStopIteration};
use pyo3::prelude::*;

use crate::errors::{to_py, IntoPyResult};
use crate::token::PyToken;

/// What one step does; `None` when generation is over.
struct Stepper {
    branch: kvfork::Branch,
    max_tokens: Option<usize>,
    produced: AtomicUsize,
}

impl Stepper {
    /// Sample and queue the commit; the caller waits on the returned Pending.
    fn start(&self) -> kvfork::Result<Option<(kvfork::Produced, kvfork::Pending<()>)>> {
        if self
            .max_tokens
            .is_some_and(|m| self.produced.load(Ordering::Relaxed) >= m)
        {
            return Ok(None);
        }
        let p = self.branch.produce()?;
        if p.is_stop {
            return Ok(None);
        }
        self.produced.fetch_add(1, Ordering::Relaxed);
        let pending = self.branch.commit(p.token);
        Ok(Some((p, pending)))
    }
}

/// `async for tok in branch.generate(max_tokens)`.
#[pyclass(frozen, module = "kvfork", name = "TokenStream")]
pub struct PyGenerator {
    stepper: Arc<Stepper>,
}

impl PyGenerator {
    pub fn new(branch: kvfork::Branch, max_tokens: Option<usize>) -> Self {
        PyGenerator {
            stepper: Arc::new(Stepper {
                branch,
                max_tokens,
                produced: AtomicUsize::new(0),
            }),
        }
    }
}

#[pymethods]
impl PyGenerator {
    fn __aiter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __anext__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let stepper = self.stepper.clone();
        // Sampling runs here (cheap, GIL released); the decode runs on the engine thread.
        let started = py.detach(move || stepper.start()).py()?;
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            let Some((produced, pending)) = started else {
                return Err(PyStopAsyncIteration::new_err(()));
            };
            pending.await.map_err(to_py)?;
            Ok(PyToken::from(produced))
        })
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
            stepper: Arc::new(Stepper {
                branch,
                max_tokens,
                produced: AtomicUsize::new(0),
            }),
        }
    }
}

#[pymethods]
impl PyGeneratorSync {
    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<PyToken> {
        let stepper = self.stepper.clone();
        let produced = py
            .detach(move || -> kvfork::Result<Option<kvfork::Produced>> {
                match stepper.start()? {
                    None => Ok(None),
                    Some((p, pending)) => pending.wait().map(|_| Some(p)),
                }
            })
            .py()?;
        produced
            .map(PyToken::from)
            .ok_or_else(|| PyStopIteration::new_err(()))
    }
}
