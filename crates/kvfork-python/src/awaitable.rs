//! An awaitable that is already done: `await` on it returns at once, without a trip through
//! the event loop. Used by cheap async methods such as `produce()`.

use pyo3::exceptions::PyStopIteration;
use pyo3::prelude::*;

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
