//! `LoraAdapter` and `ControlVector`: loaded once per model, applied per branch
//! (`Branch.set_adapters`, `Branch.set_control_vector`).

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::convert;
use crate::errors::{type_error, IntoPyResult};

/// A LoRA adapter (GGUF) loaded for one model: `model.load_lora(path)`. Apply it to branches
/// with `branch.set_adapters({adapter: scale})`; it lives as long as its model.
#[pyclass(frozen, module = "kvfork", name = "LoraAdapter", eq, hash)]
pub struct PyLoraAdapter {
    pub inner: Arc<kvfork::LoraAdapter>,
}

impl PartialEq for PyLoraAdapter {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl std::hash::Hash for PyLoraAdapter {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        Arc::as_ptr(&self.inner).hash(state);
    }
}

#[pymethods]
impl PyLoraAdapter {
    /// The file it was loaded from.
    #[getter]
    fn path(&self) -> PathBuf {
        self.inner.path().to_path_buf()
    }

    /// A checksum of the file's bytes (saved with the branches that use it).
    #[getter]
    fn fingerprint(&self) -> u64 {
        self.inner.fingerprint()
    }

    fn __repr__(&self) -> String {
        format!("LoraAdapter(path={:?})", self.inner.path())
    }
}

/// A control vector (activation steering): one direction per layer, shape
/// `(n_layer, n_embd)`, row r added to the output of llama.cpp's layer r + 1 (its layer 0
/// takes none). `model.load_control_vector(path_or_array)`; apply it with
/// `branch.set_control_vector(cv, scale, layers=(start, end))`.
#[pyclass(frozen, module = "kvfork", name = "ControlVector")]
pub struct PyControlVector {
    pub inner: Arc<kvfork::ControlVector>,
}

#[pymethods]
impl PyControlVector {
    /// `(n_layer, n_embd)`.
    #[getter]
    fn shape(&self) -> (usize, usize) {
        (self.inner.n_layers(), self.inner.n_embd())
    }

    /// The directions as a float32 numpy array of `shape` (a copy).
    fn to_numpy<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        convert::f32_array(py, self.inner.data())?.call_method1("reshape", (self.shape(),))
    }

    /// The file it was loaded from, or None (made from an array).
    #[getter]
    fn path(&self) -> Option<PathBuf> {
        self.inner.path().map(PathBuf::from)
    }

    fn __repr__(&self) -> String {
        let (l, e) = self.shape();
        format!(
            "ControlVector(shape=({l}, {e}), path={:?})",
            self.inner.path()
        )
    }
}

/// `{LoraAdapter: scale}` as the engine takes it.
pub fn lora_set(adapters: &Bound<'_, PyAny>) -> PyResult<Vec<(Arc<kvfork::LoraAdapter>, f32)>> {
    let wrong = || crate::errors::type_error("adapters must be a dict {LoraAdapter: scale}");
    let dict = adapters.cast::<PyDict>().map_err(|_| wrong())?;
    let mut set = Vec::with_capacity(dict.len());
    for (k, v) in dict.iter() {
        let adapter = k.cast::<PyLoraAdapter>().map_err(|_| wrong())?;
        let scale: f32 = v
            .extract()
            .map_err(|_| crate::errors::type_error("an adapter's scale must be a number"))?;
        set.push((adapter.get().inner.clone(), scale));
    }
    Ok(set)
}

/// Load a LoRA adapter for `model` (blocking).
pub fn load_lora(
    py: Python<'_>,
    model: &Arc<kvfork::Model>,
    path: PathBuf,
) -> PyResult<PyLoraAdapter> {
    let inner = py.detach(|| kvfork::LoraAdapter::load(model, &path)).py()?;
    Ok(PyLoraAdapter { inner })
}

/// A control vector from a GGUF path or an array of shape `(n_layer, n_embd)`.
pub fn load_control_vector(
    py: Python<'_>,
    model: &Arc<kvfork::Model>,
    source: &Bound<'_, PyAny>,
) -> PyResult<PyControlVector> {
    if let Ok(path) = source.extract::<PathBuf>() {
        let inner = py
            .detach(|| kvfork::ControlVector::load(model, &path))
            .py()?;
        return Ok(PyControlVector { inner });
    }
    let np = py.import("numpy")?;
    let array = np
        .call_method1("asarray", (source,))
        .map_err(|_| PyValueError::new_err("source must be a path or an array of numbers"))?;
    let kind: String = array.getattr("dtype")?.getattr("kind")?.extract()?;
    if !matches!(kind.as_str(), "b" | "i" | "u" | "f") {
        return Err(type_error(format!(
            "source must be a path or an array of numbers, not {}",
            source.get_type().name()?
        )));
    }
    let shape: Vec<usize> = array.getattr("shape")?.extract()?;
    let want = (model.n_layer(), model.n_embd());
    if shape != [want.0, want.1] {
        return Err(PyValueError::new_err(format!(
            "a control vector for this model has shape {want:?}, got {shape:?}"
        )));
    }
    let flat = np.call_method1(
        "ascontiguousarray",
        (array.call_method0("ravel")?, np.getattr("float32")?),
    )?;
    let data = convert::f32_vec(&flat, "source")?;
    let inner = kvfork::ControlVector::from_rows(model, data).py()?;
    Ok(PyControlVector { inner })
}
