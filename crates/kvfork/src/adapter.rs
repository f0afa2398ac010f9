//! LoRA adapters and control vectors, chosen per branch.
//!
//! llama.cpp applies adapters to a whole context, not to a sequence, so a branch only records
//! the set it decodes under ([`Adapters`]); the engine decodes the branches of each distinct
//! set as a group of their own, with that set applied to the context (`engine/adapters.rs`).
//!
//! An adapter is never freed before its model: llama.cpp keeps pointers to the adapters a
//! context last used, and frees every adapter of a model with it.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use llama_cpp_sys_2 as sys;

use crate::error::{Error, Result};
use crate::gguf_check::Gguf;
use crate::model::Model;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn load_error(path: &Path, reason: impl Into<String>) -> Error {
    Error::ModelLoad {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// A LoRA adapter (GGUF, `general.type = "adapter"`, `adapter.type = "lora"`) for one model.
pub struct LoraAdapter {
    ptr: NonNull<sys::llama_adapter_lora>,
    model: Arc<Model>,
    path: PathBuf,
    fingerprint: u64,
    id: u64,
}

// SAFETY: after `llama_adapter_lora_init` returns, an adapter is only read (by the decodes of
// contexts it is applied to, on their engine threads); it is freed with its model, which this
// value keeps alive.
unsafe impl Send for LoraAdapter {}
// SAFETY: as for `Send`: no `&self` method writes to it.
unsafe impl Sync for LoraAdapter {}

impl std::fmt::Debug for LoraAdapter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoraAdapter")
            .field("path", &self.path)
            .finish()
    }
}

impl LoraAdapter {
    /// Load `path` for `model` (the adapter already loaded from the same unchanged file, if
    /// any). A file of another architecture, with tensors whose shapes do not fit the model,
    /// truncated, or not an adapter is refused with [`Error::ModelLoad`].
    pub fn load(model: &Arc<Model>, path: impl AsRef<Path>) -> Result<Arc<LoraAdapter>> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| load_error(path, e.to_string()))?;
        if !bytes.starts_with(b"GGUF") {
            return Err(load_error(path, "not a GGUF file (bad magic)"));
        }
        let fingerprint = kvfork_core::state_file::checksum(&bytes);
        let registry = model.derived(|_| LoadedLoras::default());
        let mut loaded = registry.0.lock().unwrap_or_else(|e| e.into_inner());
        loaded.retain(|w| w.strong_count() > 0);
        if let Some(same) = loaded
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .find(|a| a.path == path && a.fingerprint == fingerprint)
        {
            return Ok(same);
        }
        check_lora(model, path, bytes.len())?;
        let c_path = CString::new(path.to_string_lossy().as_bytes())
            .map_err(|_| load_error(path, "path contains a NUL byte"))?;
        // SAFETY: the model is live (held by `model`); `c_path` is NUL-terminated and alive
        // for the call. llama.cpp catches its own exceptions here and returns NULL for a file
        // it refuses; the checks above refuse what it would not check (see `check_lora`).
        let raw = unsafe { sys::llama_adapter_lora_init(model.as_ptr(), c_path.as_ptr()) };
        let ptr = NonNull::new(raw).ok_or_else(|| {
            load_error(
                path,
                "llama.cpp refused the adapter (see the kvfork log): is it for this model?",
            )
        })?;
        let adapter = Arc::new(LoraAdapter {
            ptr,
            model: model.clone(),
            path: path.to_path_buf(),
            fingerprint,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        });
        loaded.push(Arc::downgrade(&adapter));
        Ok(adapter)
    }

    /// The file it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A checksum of the file's bytes (saved with a branch that uses the adapter).
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// The model it belongs to.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::llama_adapter_lora {
        self.ptr.as_ptr()
    }
}

/// The adapters loaded for a model, by file: loading the same unchanged file again (a saved
/// branch restored, say) gives the same adapter, so its branches decode in the same group.
/// Weak: the model must not keep its adapters (each keeps the model) alive.
#[derive(Default)]
struct LoadedLoras(std::sync::Mutex<Vec<std::sync::Weak<LoraAdapter>>>);

/// Tensor types an adapter's matrices may have (what llama.cpp's converter writes).
const LORA_TYPES: [sys::ggml_type; 4] = [
    sys::GGML_TYPE_F32,
    sys::GGML_TYPE_F16,
    sys::GGML_TYPE_BF16,
    sys::GGML_TYPE_Q8_0,
];

/// What llama.cpp does not check before it builds a graph with the adapter: the kind of file
/// and the tensor types; also that A's rank equals B's for every pair, with a clear error (it
/// checks the other dimensions against the model itself, and the ranks except for the token
/// embedding).
fn check_lora(model: &Model, path: &Path, file_len: usize) -> Result<()> {
    let fail = |reason: String| load_error(path, reason);
    let g = Gguf::open(path).ok_or_else(|| fail("not a readable GGUF file".into()))?;
    if g.string("general.type").as_deref() != Some("adapter")
        || g.string("adapter.type").as_deref() != Some("lora")
    {
        return Err(fail(
            "not a LoRA adapter (general.type / adapter.type)".into(),
        ));
    }
    let arch = g.string("general.architecture").unwrap_or_default();
    let model_arch = model.meta("general.architecture").unwrap_or_default();
    if arch != model_arch {
        return Err(fail(format!(
            "an adapter for architecture {arch:?}, the model is {model_arch:?}"
        )));
    }
    let tensors: Vec<(String, sys::ggml_type, [i64; 2])> = g.tensors_with_shape().collect();
    if tensors.is_empty() {
        return Err(fail("the adapter has no tensors".into()));
    }
    if let Some(name) = g.tensor_past_end(file_len) {
        return Err(fail(format!(
            "tensor {name} lies past the end of the file (truncated?)"
        )));
    }
    for (name, ty, ne) in &tensors {
        if !LORA_TYPES.contains(ty) {
            return Err(fail(format!(
                "tensor {name} has an unsupported type ({ty})"
            )));
        }
        if let Some(base) = name.strip_suffix(".lora_a") {
            let b = format!("{base}.lora_b");
            let Some((_, _, ne_b)) = tensors.iter().find(|(n, _, _)| *n == b) else {
                return Err(fail(format!("tensor {name} has no {b}")));
            };
            // The token embedding's pair is stored flipped (both rank-first, as llama.cpp's
            // `llm_build_inp_embd` reads them), and llama.cpp checks no rank there.
            let (rank_a, rank_b) = if base.starts_with("token_embd") {
                (ne[0], ne_b[0])
            } else {
                (ne[1], ne_b[0])
            };
            if rank_a != rank_b {
                return Err(fail(format!(
                    "the ranks of {name} ({rank_a}) and {b} ({rank_b}) differ"
                )));
            }
        }
    }
    Ok(())
}

/// A control vector: one direction per layer, added to the layer's output (activation
/// steering). Row `r` holds llama.cpp's layer `r + 1` (its layer 0 takes none), the layout of
/// the `direction.{r + 1}` tensors of a control-vector GGUF.
pub struct ControlVector {
    /// `n_layer` rows of `n_embd`.
    data: Vec<f32>,
    n_embd: usize,
    path: Option<PathBuf>,
    id: u64,
}

impl std::fmt::Debug for ControlVector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlVector")
            .field("layers", &self.n_layers())
            .field("path", &self.path)
            .finish()
    }
}

impl ControlVector {
    /// From `data`: `model.n_layer()` rows of `model.n_embd()` values, row-major.
    pub fn from_rows(model: &Model, data: Vec<f32>) -> Result<Arc<ControlVector>> {
        ControlVector::new(model, data, None)
    }

    fn new(model: &Model, data: Vec<f32>, path: Option<PathBuf>) -> Result<Arc<ControlVector>> {
        let (n_layer, n_embd) = (model.n_layer(), model.n_embd());
        if data.len() != n_layer * n_embd {
            return Err(Error::invalid(
                "data",
                format!(
                    "a control vector for this model has shape ({n_layer}, {n_embd}): \
                     {} values given",
                    data.len()
                ),
            ));
        }
        if let Some(i) = data.iter().position(|v| !v.is_finite()) {
            return Err(Error::invalid(
                "data",
                format!("value {i} (row {}) is not finite", i / n_embd.max(1)),
            ));
        }
        Ok(Arc::new(ControlVector {
            data,
            n_embd,
            path,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
        }))
    }

    /// From a control-vector GGUF (llama.cpp's format: `direction.N` f32 tensors of
    /// `n_embd` values, N from 1); layers without a tensor get zeros.
    pub fn load(model: &Model, path: impl AsRef<Path>) -> Result<Arc<ControlVector>> {
        let path = path.as_ref();
        let fail = |reason: String| load_error(path, reason);
        let (n_layer, n_embd) = (model.n_layer(), model.n_embd());
        // Read first: a missing or unreadable file says so, not "not GGUF".
        let bytes = std::fs::read(path).map_err(|e| fail(e.to_string()))?;
        let g = Gguf::open(path)
            .ok_or_else(|| fail("not a readable GGUF file (truncated or not GGUF)".into()))?;
        let mut data = vec![0.0f32; n_layer * n_embd];
        let mut found = 0;
        for (i, (name, ty, ne)) in g.tensors_with_shape().enumerate() {
            let Some(layer) = name.strip_prefix("direction.") else {
                continue;
            };
            let layer: usize = layer
                .parse()
                .map_err(|_| fail(format!("tensor {name}: not a layer number")))?;
            if layer == 0 || layer > n_layer {
                return Err(fail(format!(
                    "tensor {name}: layers run from 1 to {n_layer}"
                )));
            }
            if ty != sys::GGML_TYPE_F32 || ne != [n_embd as i64, 1] {
                return Err(fail(format!(
                    "tensor {name} must be {n_embd} f32 values (type {ty}, shape {ne:?})"
                )));
            }
            let raw = g
                .tensor_data_offset(i)
                .and_then(|start| bytes.get(start..start.checked_add(4 * n_embd)?))
                .ok_or_else(|| fail(format!("tensor {name} lies past the end of the file")))?;
            let row = &mut data[(layer - 1) * n_embd..layer * n_embd];
            for (v, b) in row.iter_mut().zip(raw.chunks_exact(4)) {
                *v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
            found += 1;
        }
        if found == 0 {
            return Err(fail("no direction.N tensors: not a control vector".into()));
        }
        ControlVector::new(model, data, Some(path.to_path_buf())).map_err(|e| fail(e.to_string()))
    }

    /// Rows (layers) it holds.
    pub fn n_layers(&self) -> usize {
        self.data.len() / self.n_embd.max(1)
    }

    /// Values per row.
    pub fn n_embd(&self) -> usize {
        self.n_embd
    }

    /// The rows, row-major.
    pub fn data(&self) -> &[f32] {
        &self.data
    }

    /// The file it was loaded from, if any.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }
}

/// A control vector as a branch uses it.
#[derive(Clone, Debug)]
pub struct SteeringVector {
    /// The directions.
    pub vector: Arc<ControlVector>,
    /// Multiplies every direction.
    pub scale: f32,
    /// Rows applied: `start..end` (0-based, end exclusive).
    pub layers: (u32, u32),
}

/// The adapters a branch decodes under (inherited by forks).
#[derive(Clone, Debug, Default)]
pub struct Adapters {
    /// LoRA adapters and their scales, in the order of their ids; none with scale 0.
    loras: Vec<(Arc<LoraAdapter>, f32)>,
    cvec: Option<SteeringVector>,
    /// What the set is, for grouping: kept with the set (the engine compares it for every
    /// branch of every decode), updated by each setter.
    key: AdapterKey,
}

/// What makes two branches' adapter sets the same: ids, scales (bits) and layer ranges.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct AdapterKey {
    loras: Vec<(u64, u32)>,
    cvec: Option<(u64, u32, u32, u32)>,
}

impl AdapterKey {
    pub fn is_empty(&self) -> bool {
        self.loras.is_empty() && self.cvec.is_none()
    }

    /// Whether the LoRA part and whether the control-vector part differ from `other`'s.
    pub fn differs_from(&self, other: &AdapterKey) -> (bool, bool) {
        (self.loras != other.loras, self.cvec != other.cvec)
    }
}

impl Adapters {
    /// A set of LoRA adapters for branches of `model` (each loaded for that model object,
    /// each scale finite); see [`Adapters::set_loras`] for duplicates and zero scales.
    pub fn from_loras(model: &Arc<Model>, loras: Vec<(Arc<LoraAdapter>, f32)>) -> Result<Adapters> {
        for (a, scale) in &loras {
            if !Arc::ptr_eq(a.model(), model) {
                return Err(Error::invalid(
                    "adapters",
                    format!(
                        "{} was loaded for another model object than this context's",
                        a.path().display()
                    ),
                ));
            }
            if !scale.is_finite() {
                return Err(Error::invalid(
                    "adapters",
                    format!("the scale of {} is {scale}", a.path().display()),
                ));
            }
        }
        let mut set = Adapters::default();
        set.set_loras(loras);
        Ok(set)
    }

    /// Set the LoRA adapters (an adapter given twice keeps its last scale; scale 0 drops it,
    /// which decodes exactly as without it).
    pub(crate) fn set_loras(&mut self, loras: Vec<(Arc<LoraAdapter>, f32)>) {
        let mut set: Vec<(Arc<LoraAdapter>, f32)> = Vec::with_capacity(loras.len());
        for (a, scale) in loras {
            set.retain(|(b, _)| b.id != a.id);
            set.push((a, scale));
        }
        set.retain(|(_, s)| *s != 0.0);
        set.sort_by_key(|(a, _)| a.id);
        self.key.loras = set.iter().map(|(a, s)| (a.id, s.to_bits())).collect();
        self.loras = set;
    }

    pub(crate) fn set_cvec(&mut self, cvec: Option<SteeringVector>) {
        self.cvec = cvec.filter(|c| c.scale != 0.0 && c.layers.0 < c.layers.1);
        self.key.cvec = self
            .cvec
            .as_ref()
            .map(|c| (c.vector.id, c.scale.to_bits(), c.layers.0, c.layers.1));
    }

    /// The LoRA adapters and scales.
    pub fn loras(&self) -> &[(Arc<LoraAdapter>, f32)] {
        &self.loras
    }

    /// The control vector, if any.
    pub fn control_vector(&self) -> Option<&SteeringVector> {
        self.cvec.as_ref()
    }

    pub(crate) fn key(&self) -> &AdapterKey {
        &self.key
    }
}

/// Check a layer range for a model: `start < end <= n_layer`.
pub(crate) fn check_layers(model: &Model, layers: (u32, u32)) -> Result<()> {
    let n = model.n_layer() as u32;
    if layers.0 >= layers.1 || layers.1 > n {
        return Err(Error::invalid(
            "layers",
            format!(
                "({}, {}) is not a range of layers: need start < end <= {n}",
                layers.0, layers.1
            ),
        ));
    }
    Ok(())
}
