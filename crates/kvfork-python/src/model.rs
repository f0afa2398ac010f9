//! `Model`: loaded weights, shareable by several contexts.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;

use crate::errors::IntoPyResult;

#[pyclass(frozen, module = "kvfork", name = "Model")]
pub struct PyModel {
    pub inner: Arc<kvfork::Model>,
}

pub fn load(
    py: Python<'_>,
    path: PathBuf,
    n_gpu_layers: Option<i32>,
    use_mmap: bool,
) -> PyResult<Arc<kvfork::Model>> {
    let params = kvfork::ModelParams {
        n_gpu_layers,
        use_mmap,
    };
    py.detach(|| kvfork::Model::load(&path, &params)).py()
}

#[pymethods]
impl PyModel {
    /// Load a GGUF model (blocking; weights are memory-mapped by default).
    #[staticmethod]
    #[pyo3(signature = (path, *, n_gpu_layers=None, use_mmap=true))]
    fn load(
        py: Python<'_>,
        path: PathBuf,
        n_gpu_layers: Option<i32>,
        use_mmap: bool,
    ) -> PyResult<Self> {
        Ok(PyModel {
            inner: load(py, path, n_gpu_layers, use_mmap)?,
        })
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    #[getter]
    fn n_ctx_train(&self) -> u32 {
        self.inner.n_ctx_train()
    }

    #[getter]
    fn n_embd(&self) -> usize {
        self.inner.n_embd()
    }

    #[getter]
    fn name(&self) -> String {
        self.inner.name()
    }

    #[getter]
    fn path(&self) -> PathBuf {
        self.inner.path().to_path_buf()
    }

    #[getter]
    fn metadata(&self) -> BTreeMap<String, String> {
        self.inner.metadata()
    }

    #[getter]
    fn chat_template(&self) -> Option<String> {
        self.inner.chat_template()
    }

    fn __repr__(&self) -> String {
        format!(
            "Model(name={:?}, path={:?})",
            self.inner.name(),
            self.inner.path()
        )
    }
}
