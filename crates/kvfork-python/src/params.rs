//! `SamplingParams`: immutable, comparable, with `replace(**changes)`; a dict is accepted too.
#![allow(
    unsafe_op_in_unsafe_fn,
    reason = "pyo3's richcmp trampoline for `__eq__` calls an `unsafe fn` without an inner \
              block, and expanded from this module's `macro_rules!` it counts as our code; \
              the module writes no unsafe code itself"
)]

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::errors::IntoPyResult;

/// Generates the class from one field list so names, defaults and kwargs never drift apart.
macro_rules! sampling_params {
    ($($(#[$doc:meta])* $field:ident : $ty:ty),* $(,)?) => {
        /// Parameters of a branch's sampler chain. `temperature <= 0` means greedy; `seed=None`
        /// draws a fresh random seed. Order: penalties → DRY → top-n-sigma → top-k → typical →
        /// top-p → min-p → XTC → temperature → draw (Mirostat replaces the truncations).
        /// Immutable: `replace(**changes)` makes a copy; a bad value raises TypeError or
        /// ValueError naming the field.
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
            $($(#[$doc])* #[getter] fn $field(&self) -> $ty { self.inner.$field.clone() })*

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

            /// Pickling (Ray job arguments): `SamplingParams(**fields)` again.
            fn __getnewargs_ex__<'py>(
                &self,
                py: Python<'py>,
            ) -> PyResult<(Bound<'py, PyTuple>, Bound<'py, PyDict>)> {
                Ok((PyTuple::empty(py), self.fields(py)?))
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
    /// Divides the logits before the draw: higher is more random. `<= 0` keeps only the most
    /// likely token: greedy (with Mirostat on, after its filters, as llama.cpp's). Default 0.8.
    temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables. Default 40.
    top_k: i32,
    /// Nucleus sampling: keep the most likely tokens until their probabilities sum to
    /// `top_p`; 1.0 disables. Default 0.95.
    top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 disables.
    /// Default 0.05.
    min_p: f32,
    /// Locally typical sampling: keep the tokens whose surprisal is closest to the entropy,
    /// up to this total probability; 1.0 disables (the default).
    typical_p: f32,
    /// Keep tokens whose logit is within `top_n_sigma` standard deviations of the best;
    /// `<= 0` disables (default -1.0).
    top_n_sigma: f32,
    /// Seed of the branch's RNG (XTC, the draw, Mirostat), an int in [0, 2**32); None (the
    /// default) draws a fresh random seed.
    seed: Option<u32>,
    /// Divides positive logits (multiplies negative ones) of tokens in the penalty window;
    /// 1.0 disables (the default).
    repeat_penalty: f32,
    /// Subtracted from a token's logit once per occurrence in the penalty window; 0 disables
    /// (the default).
    frequency_penalty: f32,
    /// Subtracted from the logit of every token present in the penalty window; 0 disables
    /// (the default).
    presence_penalty: f32,
    /// The penalty window: how many recently accepted tokens the repeat, frequency and
    /// presence penalties look at; -1 = the whole context, 0 disables them. Default 64. A
    /// window longer than the model's training context is that long.
    penalty_last_n: i32,
    /// Mirostat: 0 off (the default), 1 Mirostat, 2 Mirostat 2.0. When on it replaces the
    /// truncation filters (top-k, typical, top-p, min-p) and XTC, and aims at a steady surprise.
    mirostat: i32,
    /// Mirostat's target surprise, in bits; its threshold `mu` starts at 2 * tau. Default 5.0.
    mirostat_tau: f32,
    /// Mirostat's learning rate: how fast `mu` moves towards the target. Default 0.1.
    mirostat_eta: f32,
    /// Strength of the DRY penalty on tokens that would extend a repeated sequence; 0 disables
    /// (the default).
    dry_multiplier: f32,
    /// DRY's penalty grows as `dry_base` to the power of the repeat's length past
    /// `dry_allowed_length`; must be >= 1. Default 1.75.
    dry_base: f32,
    /// Repeats up to this many tokens long go unpenalised by DRY. Default 2.
    dry_allowed_length: i32,
    /// How many recent tokens DRY scans for repeats (at most the model's training context);
    /// -1 = the whole context (the default),
    /// 0 disables DRY.
    dry_penalty_last_n: i32,
    /// XTC: the chance, per draw, that it removes the top choices; 0 disables (the default).
    xtc_probability: f32,
    /// XTC removes every token at least this likely except the least likely of them; above
    /// 0.5 it never fires. Default 0.1.
    xtc_threshold: f32,
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
        crate::errors::type_error(msg)
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
            Err(crate::errors::type_error(
                "params must be a SamplingParams, a dict or None",
            ))
        }
    }
}
