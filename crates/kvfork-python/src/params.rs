//! `SamplingParams`: immutable, comparable, with `replace(**changes)`; a dict is accepted too.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::IntoPyResult;

/// Generates the class from one field list so names, defaults and kwargs never drift apart.
macro_rules! sampling_params {
    ($($field:ident : $ty:ty),* $(,)?) => {
        /// Parameters of a branch's sampler chain. `temperature <= 0` means greedy; `seed=None`
        /// draws a fresh random seed. Order: penalties → DRY → top-n-sigma → top-k → typical →
        /// top-p → min-p → XTC → temperature → draw (Mirostat replaces the truncations).
        #[pyclass(frozen, module = "kvfork", name = "SamplingParams")]
        #[derive(Clone)]
        pub struct PySamplingParams {
            pub inner: kvfork::SamplingParams,
        }

        impl PySamplingParams {
            /// Apply keyword values over `base`; unknown keys are a ValueError naming them.
            fn with_changes(base: &kvfork::SamplingParams, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
                let mut p = base.clone();
                if let Some(kw) = kwargs {
                    for (key, value) in kw.iter() {
                        let key: String = key.extract()?;
                        match key.as_str() {
                            $(stringify!($field) => {
                                p.$field = value.extract::<$ty>().map_err(|_| {
                                    field_error(&key, stringify!($ty), &value)
                                })?;
                            })*
                            _ => return Err(PyValueError::new_err(format!("SamplingParams has no field {key:?}"))),
                        }
                    }
                }
                p.validate().py()?;
                Ok(PySamplingParams { inner: p })
            }

            fn fields<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
                let d = PyDict::new(py);
                $(d.set_item(stringify!($field), self.inner.$field.clone())?;)*
                Ok(d)
            }
        }

        #[pymethods]
        impl PySamplingParams {
            $(#[getter] fn $field(&self) -> $ty { self.inner.$field.clone() })*

            #[new]
            #[pyo3(signature = (**kwargs))]
            fn new(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
                Self::with_changes(&kvfork::SamplingParams::default(), kwargs)
            }

            /// A copy with some fields changed.
            #[pyo3(signature = (**changes))]
            fn replace(&self, changes: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
                Self::with_changes(&self.inner, changes)
            }

            /// The fields as a dict.
            fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
                self.fields(py)
            }

            fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
                other.cast::<PySamplingParams>().is_ok_and(|o| o.get().inner == self.inner)
            }

            fn __hash__(&self) -> u64 {
                use std::hash::{Hash, Hasher};
                let mut h = std::collections::hash_map::DefaultHasher::new();
                format!("{:?}", self.inner).hash(&mut h);
                h.finish()
            }

            fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
                let parts: Vec<String> = self
                    .fields(py)?
                    .iter()
                    .map(|(k, v)| Ok(format!("{}={}", k, v.repr()?)))
                    .collect::<PyResult<_>>()?;
                Ok(format!("SamplingParams({})", parts.join(", ")))
            }
        }
    };
}

sampling_params! {
    temperature: f32, top_k: i32, top_p: f32, min_p: f32, typical_p: f32, top_n_sigma: f32,
    seed: Option<u32>, repeat_penalty: f32, frequency_penalty: f32, presence_penalty: f32,
    penalty_last_n: i32, mirostat: i32, mirostat_tau: f32, mirostat_eta: f32,
    dry_multiplier: f32, dry_base: f32, dry_allowed_length: i32, dry_penalty_last_n: i32,
    xtc_probability: f32, xtc_threshold: f32,
}

/// A TypeError (wrong type) or ValueError (an int out of range) naming the field.
fn field_error(key: &str, rust_type: &str, value: &Bound<'_, PyAny>) -> PyErr {
    let expected = match rust_type {
        "f32" => "a float",
        "i32" => "an int in [-2**31, 2**31)",
        "Option<u32>" => "an int in [0, 2**32) or None",
        other => other,
    };
    let type_name = value
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_default();
    let is_int = value.is_instance_of::<pyo3::types::PyInt>();
    let msg = if is_int && rust_type != "f32" {
        format!("SamplingParams.{key}: expected {expected}, got {value}")
    } else {
        format!("SamplingParams.{key}: expected {expected}, got {type_name}")
    };
    if is_int && rust_type != "f32" {
        PyValueError::new_err(msg)
    } else {
        PyTypeError::new_err(msg)
    }
}

/// `None` → defaults, a `SamplingParams`, or a dict of the same keys.
pub fn extract(obj: Option<&Bound<'_, PyAny>>) -> PyResult<kvfork::SamplingParams> {
    match obj {
        None => Ok(kvfork::SamplingParams::default()),
        Some(o) if o.is_none() => Ok(kvfork::SamplingParams::default()),
        Some(o) => {
            if let Ok(p) = o.cast::<PySamplingParams>() {
                return Ok(p.get().inner.clone());
            }
            if let Ok(d) = o.cast::<PyDict>() {
                return Ok(PySamplingParams::with_changes(
                    &kvfork::SamplingParams::default(),
                    Some(d),
                )?
                .inner);
            }
            Err(PyTypeError::new_err(
                "params must be a SamplingParams, a dict or None",
            ))
        }
    }
}
