//! `Context.format_chat` and `FormattedChat`.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde_json::Value as Json;

/// A rendered conversation: the prompt to tokenize (with `parse_special=True`) and the strings
/// that end an assistant turn besides end-of-generation tokens.
#[pyclass(frozen, module = "kvfork", name = "FormattedChat")]
pub struct PyFormattedChat {
    /// The rendered text; tokenize it with `parse_special=True` so the template's markup
    /// becomes special tokens.
    #[pyo3(get)]
    prompt: String,
    /// The template's turn-end strings (a list, possibly empty): cut the reply at the first
    /// one. End-of-generation tokens stop generation anyway.
    #[pyo3(get)]
    stop: Vec<String>,
}

impl From<kvfork::FormattedChat> for PyFormattedChat {
    fn from(f: kvfork::FormattedChat) -> Self {
        PyFormattedChat {
            prompt: f.prompt,
            stop: f.stop,
        }
    }
}

#[pymethods]
impl PyFormattedChat {
    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "FormattedChat(prompt={}, stop={})",
            crate::convert::py_repr(py, &self.prompt)?,
            crate::convert::py_repr(py, &self.stop)?
        ))
    }
}

/// How deep a value for a chat template may nest (serde_json's own limit when it parses):
/// deeper, or a value that contains itself, is a ValueError, not a stack overflow.
const MAX_DEPTH: usize = 128;

/// A Python value (dicts, lists, strings, numbers, bools, None) as JSON, dict order kept.
pub fn json(obj: &Bound<'_, PyAny>, path: &str) -> PyResult<Json> {
    json_within(obj, path, MAX_DEPTH)
}

fn json_within(obj: &Bound<'_, PyAny>, path: &str, depth: usize) -> PyResult<Json> {
    if depth == 0 {
        return Err(PyValueError::new_err(format!(
            "{path}: nested deeper than {MAX_DEPTH} levels (or a value that contains itself)"
        )));
    }
    if obj.is_none() {
        return Ok(Json::Null);
    }
    if obj.is_instance_of::<PyBool>() {
        return Ok(Json::Bool(obj.extract()?));
    }
    if obj.is_instance_of::<PyInt>() {
        if let Ok(v) = obj.extract::<i64>() {
            return Ok(v.into());
        }
        return Ok(obj
            .extract::<u64>()
            .map_err(|_| PyValueError::new_err(format!("{path}: the int is too large")))?
            .into());
    }
    if obj.is_instance_of::<PyFloat>() {
        let v: f64 = obj.extract()?;
        return serde_json::Number::from_f64(v)
            .map(Json::Number)
            .ok_or_else(|| PyValueError::new_err(format!("{path}: {v} is not a JSON number")));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Json::String(s.to_str()?.to_owned()));
    }
    if let Ok(d) = obj.cast::<PyDict>() {
        let mut map = serde_json::Map::with_capacity(d.len());
        for (k, v) in d.iter() {
            let key = k.str()?.to_str()?.to_owned();
            let value = json_within(&v, &format!("{path}[{key:?}]"), depth - 1)?;
            map.insert(key, value);
        }
        return Ok(Json::Object(map));
    }
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        return obj
            .try_iter()?
            .enumerate()
            .map(|(i, x)| json_within(&x?, &format!("{path}[{i}]"), depth - 1))
            .collect::<PyResult<Vec<_>>>()
            .map(Json::Array);
    }
    Err(crate::errors::type_error(format!(
        "{path}: {} cannot go into a chat template (use dicts, lists, str, numbers, None)",
        obj.get_type().name()?
    )))
}
