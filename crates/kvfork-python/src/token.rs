//! `Token`: an immutable `(token, text, is_stop)` that unpacks like a tuple.

use pyo3::basic::CompareOp;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::convert::{token_int, Arg, Int};

/// A sampled token: immutable `(token, text, is_stop)` that unpacks, indexes, slices,
/// compares and hashes like that tuple, as a NamedTuple does (`tok, text, stop = t`;
/// `t == (tok, text, stop)`). Returned by `produce`, `generate` and `BranchStore.step`, and
/// accepted wherever a token id is.
#[pyclass(frozen, module = "kvfork", name = "Token")]
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
    /// `(token, text, is_stop)`.
    fn as_tuple<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        (self.token, self.text.as_str(), self.is_stop).into_pyobject(py)
    }

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
    fn new(token: Int, text: Arg<String>, is_stop: Arg<bool>) -> PyResult<Self> {
        Ok(PyToken {
            token: token_int(&token)?,
            text: text.0,
            is_stop: is_stop.0,
        })
    }

    /// The token id, where an int is asked for (`operator.index`): a Token is taken wherever
    /// a token id is, in lists of them too.
    fn __index__(&self) -> i32 {
        self.token
    }

    fn __len__(&self) -> usize {
        3
    }

    /// Pickling (Ray jobs return tokens): `Token(token, text, is_stop)` again.
    fn __getnewargs__(&self) -> (i32, String, bool) {
        (self.token, self.text.clone(), self.is_stop)
    }

    /// An index or a slice, as of the tuple (`tuple`'s own errors for anything else).
    fn __getitem__<'py>(&self, key: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        self.as_tuple(key.py())?.as_any().get_item(key)
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(self.as_tuple(py)?.as_any().try_iter()?.into_any())
    }

    /// Compared as the tuple, with another Token or a tuple (NotImplemented otherwise).
    fn __richcmp__<'py>(
        &self,
        other: &Bound<'py, PyAny>,
        op: CompareOp,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = other.py();
        let other = match other.cast::<PyToken>() {
            Ok(token) => token.get().as_tuple(py)?.into_any(),
            Err(_) if other.is_instance_of::<PyTuple>() => other.clone(),
            Err(_) => return Ok(py.NotImplemented().into_bound(py)),
        };
        self.as_tuple(py)?.as_any().rich_compare(other, op)
    }

    /// The tuple's hash: equal tokens and tuples hash alike.
    fn __hash__(&self, py: Python<'_>) -> PyResult<isize> {
        self.as_tuple(py)?.hash()
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "Token(token={}, text={}, is_stop={})",
            self.token,
            crate::convert::py_repr(py, &self.text)?,
            if self.is_stop { "True" } else { "False" }
        ))
    }
}
