//! `Context`, `create_context` and `create_context_sync`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::IntoPyObjectExt;

use crate::convert::{self, wait};
use crate::errors::IntoPyResult;
use crate::model::PyModel;

/// A llama context: owns a unified KV cache and the engine thread that runs every decode.
#[pyclass(frozen, module = "kvfork", name = "Context")]
pub struct PyContext {
    pub inner: kvfork::Context,
}

/// What `create_context` was given: a model or a path to load.
enum ModelSource {
    Loaded(Arc<kvfork::Model>),
    Path(PathBuf),
}

struct Options {
    source: ModelSource,
    params: kvfork::ContextParams,
    n_gpu_layers: Option<i32>,
}

fn pooling_type(name: Option<&str>) -> PyResult<Option<i32>> {
    Ok(match name {
        None => None,
        Some("none") => Some(0),
        Some("mean") => Some(1),
        Some("cls") => Some(2),
        Some("last") => Some(3),
        Some("rank") => Some(4),
        Some(other) => {
            return Err(PyValueError::new_err(format!(
                "pooling: unknown pooling {other:?}"
            )))
        }
    })
}

#[allow(clippy::too_many_arguments)]
fn options(
    path_or_model: &Bound<'_, PyAny>,
    n_ctx: u32,
    n_batch: u32,
    n_seq_max: u32,
    n_threads: Option<i32>,
    type_k: &str,
    type_v: &str,
    embeddings: bool,
    pooling: Option<&str>,
    n_gpu_layers: Option<i32>,
) -> PyResult<Options> {
    let source = if let Ok(m) = path_or_model.cast::<PyModel>() {
        ModelSource::Loaded(m.get().inner.clone())
    } else {
        ModelSource::Path(path_or_model.extract::<PathBuf>().map_err(|_| {
            PyTypeError::new_err("path_or_model must be a Model, str or os.PathLike")
        })?)
    };
    let params = kvfork::ContextParams {
        n_ctx,
        n_batch,
        n_seq_max,
        n_threads,
        type_k: kvfork::CacheType::from_name(type_k).py()?,
        type_v: kvfork::CacheType::from_name(type_v).py()?,
        embeddings,
        pooling: pooling_type(pooling)?,
    };
    params.validate().py()?;
    Ok(Options {
        source,
        params,
        n_gpu_layers,
    })
}

fn build(o: Options) -> kvfork::Result<kvfork::Context> {
    let model = match o.source {
        ModelSource::Loaded(m) => m,
        ModelSource::Path(p) => kvfork::Model::load(
            &p,
            &kvfork::ModelParams {
                n_gpu_layers: o.n_gpu_layers,
                use_mmap: true,
            },
        )?,
    };
    kvfork::Context::new(model, o.params)
}

/// Create a context (async): loads the model if given a path. Runs off the event loop.
#[pyfunction]
#[pyo3(signature = (path_or_model, *, n_ctx=4096, n_batch=512, n_seq_max=8, n_threads=None,
                    type_k="f16", type_v="f16", embeddings=false, pooling=None, n_gpu_layers=None))]
#[allow(clippy::too_many_arguments)]
pub fn create_context<'py>(
    py: Python<'py>,
    path_or_model: &Bound<'py, PyAny>,
    n_ctx: u32,
    n_batch: u32,
    n_seq_max: u32,
    n_threads: Option<i32>,
    type_k: &str,
    type_v: &str,
    embeddings: bool,
    pooling: Option<&str>,
    n_gpu_layers: Option<i32>,
) -> PyResult<Bound<'py, PyAny>> {
    let o = options(
        path_or_model,
        n_ctx,
        n_batch,
        n_seq_max,
        n_threads,
        type_k,
        type_v,
        embeddings,
        pooling,
        n_gpu_layers,
    )?;
    pyo3_async_runtimes::tokio::future_into_py(py, async move {
        let ctx = tokio::task::spawn_blocking(move || build(o))
            .await
            .map_err(|e| crate::errors::KvforkError::new_err(e.to_string()))?
            .py()?;
        Ok(PyContext { inner: ctx })
    })
}

/// Create a context (blocking twin of `create_context`).
#[pyfunction]
#[pyo3(signature = (path_or_model, *, n_ctx=4096, n_batch=512, n_seq_max=8, n_threads=None,
                    type_k="f16", type_v="f16", embeddings=false, pooling=None, n_gpu_layers=None))]
#[allow(clippy::too_many_arguments)]
pub fn create_context_sync(
    py: Python<'_>,
    path_or_model: &Bound<'_, PyAny>,
    n_ctx: u32,
    n_batch: u32,
    n_seq_max: u32,
    n_threads: Option<i32>,
    type_k: &str,
    type_v: &str,
    embeddings: bool,
    pooling: Option<&str>,
    n_gpu_layers: Option<i32>,
) -> PyResult<PyContext> {
    let o = options(
        path_or_model,
        n_ctx,
        n_batch,
        n_seq_max,
        n_threads,
        type_k,
        type_v,
        embeddings,
        pooling,
        n_gpu_layers,
    )?;
    Ok(PyContext {
        inner: py.detach(|| build(o)).py()?,
    })
}

impl PyContext {
    fn open(&self) -> PyResult<&kvfork::Context> {
        if self.inner.is_closed() {
            return Err(crate::errors::KvforkError::new_err("the context is closed"));
        }
        Ok(&self.inner)
    }
}

#[pymethods]
impl PyContext {
    #[getter]
    fn model(&self) -> PyModel {
        PyModel {
            inner: self.inner.model().clone(),
        }
    }

    #[getter]
    fn n_ctx(&self) -> u32 {
        self.inner.n_ctx()
    }

    #[getter]
    fn n_batch(&self) -> u32 {
        self.inner.n_batch()
    }

    #[getter]
    fn n_seq_max(&self) -> u32 {
        self.inner.n_seq_max()
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_closed()
    }

    /// Tokenize with llama.cpp's tokenizer.
    #[pyo3(signature = (text, add_special=true, parse_special=false))]
    fn tokenize(
        &self,
        py: Python<'_>,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> PyResult<Vec<i32>> {
        let ctx = self.open()?;
        py.detach(|| ctx.tokenize(text, add_special, parse_special))
            .py()
    }

    #[pyo3(signature = (tokens, *, remove_special=false, unparse_special=false))]
    fn detokenize(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        remove_special: bool,
        unparse_special: bool,
    ) -> PyResult<String> {
        let tokens = convert::tokens(tokens, "tokens")?;
        let ctx = self.open()?;
        py.detach(|| ctx.detokenize(&tokens, remove_special, unparse_special))
            .py()
    }

    fn token_to_text(&self, token: i64) -> PyResult<String> {
        self.open()?.token_to_text(token_id(token)?).py()
    }

    fn is_stop_token(&self, token: i64) -> PyResult<bool> {
        self.inner.is_stop_token(token_id(token)?).py()
    }

    #[getter]
    fn eog_token(&self) -> Option<i32> {
        self.inner.model().eos()
    }

    #[getter]
    fn bos_token(&self) -> Option<i32> {
        self.inner.model().bos()
    }

    /// Copy cells of `src` into `dst` (positions [p0, p1), -1 = open). Bypasses branch tenancy.
    #[pyo3(signature = (src, dst, p0=0, p1=-1))]
    fn kv_seq_copy(&self, py: Python<'_>, src: i32, dst: i32, p0: i32, p1: i32) -> PyResult<()> {
        wait(py, self.open()?.kv_seq_copy(src, dst, p0, p1))
    }

    /// Remove every cell not of `seq`. Bypasses branch tenancy.
    fn kv_seq_keep(&self, py: Python<'_>, seq: i32) -> PyResult<()> {
        wait(py, self.open()?.kv_seq_keep(seq))
    }

    /// Remove the cells of `seq` in [p0, p1). Returns False if a partial removal is impossible.
    #[pyo3(signature = (seq, p0=0, p1=-1))]
    fn kv_seq_remove(&self, py: Python<'_>, seq: i32, p0: i32, p1: i32) -> PyResult<bool> {
        wait(py, self.open()?.kv_seq_remove(seq, p0, p1))
    }

    /// Largest position stored for `seq` (-1 when empty).
    fn kv_seq_pos_max(&self, py: Python<'_>, seq: i32) -> PyResult<i32> {
        wait(py, self.open()?.kv_seq_pos_max(seq))
    }

    /// Empty the whole KV cache. Bypasses branch tenancy.
    fn kv_clear(&self, py: Python<'_>) -> PyResult<()> {
        wait(py, self.open()?.kv_clear())
    }

    /// Counters since creation: decode_calls, decoded_tokens, decode_seconds, commit_requests.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let s = self.inner.stats();
        let mut d: BTreeMap<&str, Py<PyAny>> = BTreeMap::new();
        d.insert("decode_calls", s.decode_calls.into_py_any(py)?);
        d.insert("decoded_tokens", s.decoded_tokens.into_py_any(py)?);
        d.insert(
            "decode_seconds",
            (s.decode_ns as f64 / 1e9).into_py_any(py)?,
        );
        d.insert("commit_requests", s.commit_requests.into_py_any(py)?);
        d.into_bound_py_any(py)
    }

    /// Free the context (after queued work). Idempotent; later use raises KvforkError.
    fn close(&self, py: Python<'_>) {
        py.detach(|| self.inner.close());
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (_exc_type=None, _exc=None, _tb=None))]
    fn __exit__(
        &self,
        py: Python<'_>,
        _exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> bool {
        self.close(py);
        false
    }

    fn __aenter__<'py>(slf: Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let me: Py<Self> = slf.unbind();
        crate::awaitable::Ready::new(me.into_any()).into_bound_py_any(py)
    }

    #[pyo3(signature = (_exc_type=None, _exc=None, _tb=None))]
    fn __aexit__<'py>(
        &self,
        py: Python<'py>,
        _exc_type: Option<Py<PyAny>>,
        _exc: Option<Py<PyAny>>,
        _tb: Option<Py<PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let ctx = self.inner.clone();
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            tokio::task::spawn_blocking(move || ctx.close()).await.ok();
            Ok(false)
        })
    }

    fn __repr__(&self) -> String {
        format!(
            "Context(model={:?}, n_ctx={}, n_seq_max={}, closed={})",
            self.inner.model().name(),
            self.inner.n_ctx(),
            self.inner.n_seq_max(),
            self.inner.is_closed()
        )
    }
}

pub fn token_id(token: i64) -> PyResult<i32> {
    i32::try_from(token)
        .map_err(|_| PyValueError::new_err(format!("token: token id {token} is out of range")))
}
