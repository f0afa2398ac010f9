//! `Model`: loaded weights, shareable by several contexts.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;

use crate::adapter::{self, PyControlVector, PyLoraAdapter};
use crate::convert::Arg;
use crate::errors::IntoPyResult;

/// Loaded GGUF weights and vocabulary, shareable by several contexts (loaded once).
/// Load with `Model.load(path)`, or pass a path straight to `create_context`.
#[pyclass(frozen, weakref, module = "kvfork", name = "Model")]
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
    let model = py.detach(|| kvfork::Model::load(&path, &params)).py()?;
    warn_if_no_gpu(py, n_gpu_layers)?;
    Ok(model)
}

/// Layers were asked onto a GPU (`n_gpu_layers` not None or 0) but kvfork found no GPU
/// backend: the model runs on the CPU (llama.cpp says nothing), so say which backends there
/// are and how to get one. Call it once the model is loaded (`system_info` loads the backends).
pub(crate) fn warn_if_no_gpu(py: Python<'_>, n_gpu_layers: Option<i32>) -> PyResult<()> {
    let Some(n_gpu_layers) = n_gpu_layers.filter(|&n| n != 0) else {
        return Ok(());
    };
    let info = kvfork::system_info().py()?;
    if info.backend != "cpu" {
        return Ok(());
    }
    let msg = format!(
        "n_gpu_layers={n_gpu_layers} asks for a GPU, but kvfork found no GPU backend \
         (backends: {}); the model runs on the CPU. The wheel's GPU backends come with \
         `pip install kvfork[cuda]` or `kvfork[vulkan]` and need the GPU's driver",
        info.backends.join("; ")
    );
    crate::errors::warn(py, msg)
}

#[pymethods]
impl PyModel {
    /// Load a GGUF model (blocking; weights are memory-mapped by default). `n_gpu_layers`:
    /// layers to offload to the GPU (None: all on a GPU build, else 0). Raises ModelLoadError
    /// for a file that cannot be loaded.
    #[staticmethod]
    #[pyo3(signature = (path, *, n_gpu_layers=None, use_mmap=Arg(true)),
           text_signature = "(path, *, n_gpu_layers=None, use_mmap=True)")]
    fn load(
        py: Python<'_>,
        path: Arg<PathBuf>,
        n_gpu_layers: Option<Arg<i32>>,
        use_mmap: Arg<bool>,
    ) -> PyResult<Self> {
        Ok(PyModel {
            inner: load(py, path.0, n_gpu_layers.map(|n| n.0), use_mmap.0)?,
        })
    }

    /// Number of tokens in the vocabulary (the length of a logits row).
    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    /// The context length the model was trained with (GGUF metadata), in tokens.
    #[getter]
    fn n_ctx_train(&self) -> u32 {
        self.inner.n_ctx_train()
    }

    /// Width of the model's hidden state (the embedding size).
    #[getter]
    fn n_embd(&self) -> usize {
        self.inner.n_embd()
    }

    /// The GGUF `general.name`, or the file name without its extension when that is missing.
    #[getter]
    fn name(&self) -> String {
        self.inner.name()
    }

    /// The path the model was loaded from.
    #[getter]
    fn path(&self) -> PathBuf {
        self.inner.path().to_path_buf()
    }

    /// Every GGUF metadata key with its value as a string (llama.cpp summarises arrays).
    #[getter]
    fn metadata(&self) -> BTreeMap<String, String> {
        self.inner.metadata()
    }

    /// The GGUF's Jinja chat template (`tokenizer.chat_template`), or None when it has none.
    #[getter]
    fn chat_template(&self) -> Option<String> {
        self.inner.chat_template()
    }

    /// Transformer blocks (layers).
    #[getter]
    fn n_layer(&self) -> usize {
        self.inner.n_layer()
    }

    /// The model's family: `"transformer"`, `"recurrent"` (Mamba, RWKV) or `"hybrid"`
    /// (attention beside recurrent or convolution layers: LFM2, Granite 4 hybrids, Jamba,
    /// Nemotron-H), with `"+sliding-window"` and `"+moe"` where they apply. On a recurrent or
    /// hybrid model a fork inside a sequence or a rollback goes through recurrent-state
    /// checkpoints (see the model-families table in the docs).
    #[getter]
    fn family(&self) -> String {
        self.inner.family()
    }

    /// Whether the model keeps a recurrent state, alone (`"recurrent"`) or beside a KV cache
    /// (`"hybrid"`).
    #[getter]
    fn is_recurrent(&self) -> bool {
        self.inner.is_recurrent()
    }

    /// The window of its sliding-window attention layers; 0 when it has none.
    #[getter]
    fn n_swa(&self) -> u32 {
        self.inner.n_swa()
    }

    /// Experts of a mixture-of-experts model; 0 for a dense one.
    #[getter]
    fn n_expert(&self) -> u32 {
        self.inner.n_expert()
    }

    /// Load a LoRA adapter (GGUF) for this model (blocking). Raises ModelLoadError for a
    /// file of another architecture, with shapes that do not fit, truncated, or not a LoRA.
    fn load_lora(&self, py: Python<'_>, path: Arg<PathBuf>) -> PyResult<PyLoraAdapter> {
        adapter::load_lora(py, &self.inner, path.0)
    }

    /// A control vector from a GGUF file (llama.cpp's `direction.N` tensors) or from an
    /// array of shape `(n_layer, n_embd)`.
    fn load_control_vector(
        &self,
        py: Python<'_>,
        source: &Bound<'_, PyAny>,
    ) -> PyResult<PyControlVector> {
        adapter::load_control_vector(py, &self.inner, source)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "Model(name={}, path={})",
            crate::convert::py_repr(py, self.inner.name())?,
            crate::convert::py_repr(py, self.inner.path())?
        ))
    }
}
