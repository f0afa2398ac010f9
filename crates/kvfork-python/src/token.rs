//! `Token`: an immutable `(token, text, is_stop)` that unpacks like a tuple.

use pyo3::exceptions::PyIndexError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::convert::Arg;

/// A sampled token: immutable `(token, text, is_stop)` that unpacks and indexes like a tuple
/// (`tok, text, stop = t`). Returned by `produce`, `generate` and `BranchStore.step`, and
/// accepted wherever a token id is.
#[pyclass(frozen, eq, hash, module = "kvfork", name = "Token")]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PyToken {
    /// The token id.
    #[pyo3(get)]
    pub token: i32,
    /// The token's text piece (special tokens rendered; invalid UTF-8 replaced).
    #[pyo3(get)]
    text: String,
    /// True for an end-of-generation token (as `Context.is_stop_token`); generation stops
    /// there without committing it.
    #[pyo3(get)]
    is_stop: bool,
}

impl PyToken {
    /// The engine's view of this token.
    pub fn produced(&self) -> kvfork::Produced {
        kvfork::Produced {
            token: self.token,
            text: self.text.clone(),
            is_stop: self.is_stop,
        }
    }
}

impl From<kvfork::Produced> for PyToken {
    fn from(p: kvfork::Produced) -> Self {
        PyToken {
            token: p.token,
            text: p.text,
            is_stop: p.is_stop,
        }
    }
}

#[pymethods]
impl PyToken {
    #[new]
    fn new(token: Arg<i32>, text: Arg<String>, is_stop: Arg<bool>) -> Self {
        PyToken {
            token: token.0,
            text: text.0,
            is_stop: is_stop.0,
        }
    }

    fn __len__(&self) -> usize {
        3
    }

    /// Pickling (Ray jobs return tokens): `Token(token, text, is_stop)` again.
    fn __getnewargs__(&self) -> (i32, String, bool) {
        (self.token, self.text.clone(), self.is_stop)
    }

    fn __getitem__(&self, py: Python<'_>, index: isize) -> PyResult<Py<PyAny>> {
        use pyo3::IntoPyObjectExt;
        match index {
            0 | -3 => self.token.into_py_any(py),
            1 | -2 => self.text.clone().into_py_any(py),
            2 | -1 => self.is_stop.into_py_any(py),
            _ => Err(PyIndexError::new_err("Token index out of range")),
        }
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let t = PyTuple::new(
            py,
            [
                self.token.into_pyobject(py)?.into_any(),
                self.text.clone().into_pyobject(py)?.into_any(),
                pyo3::types::PyBool::new(py, self.is_stop)
                    .to_owned()
                    .into_any(),
            ],
        )?;
        Ok(t.as_any().try_iter()?.into_any())
    }

    fn __repr__(&self) -> String {
        format!(
            "Token(token={}, text={:?}, is_stop={})",
            self.token,
            self.text,
            if self.is_stop { "True" } else { "False" }
        )
    }
}
