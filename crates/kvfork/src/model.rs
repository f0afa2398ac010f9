//! A loaded GGUF model: weights plus vocabulary. Shared (`Arc<Model>`) by every context on it.

use std::any::{Any, TypeId};
use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_char, CString};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use llama_cpp_sys_2 as sys;

use crate::backend::ensure_backend;
use crate::error::{Error, Result};
use crate::gguf_check::Gguf;

/// A token id.
pub type Token = i32;

/// Options of [`Model::load`].
#[derive(Debug, Clone)]
pub struct ModelParams {
    /// Layers to offload to the GPU (`None`: all when a GPU backend is built, else 0).
    pub n_gpu_layers: Option<i32>,
    /// Map the file instead of reading it into memory.
    pub use_mmap: bool,
}

impl Default for ModelParams {
    fn default() -> Self {
        ModelParams {
            n_gpu_layers: None,
            use_mmap: true,
        }
    }
}

/// Weights and vocabulary. llama.cpp only reads a model after loading, so it is shared freely.
pub struct Model {
    ptr: NonNull<sys::llama_model>,
    vocab: NonNull<sys::llama_vocab>,
    n_vocab: i32,
    path: PathBuf,
    /// Output rows the CPU's output matmul computes per pass (1: no tiling to fill); see
    /// `kvfork_core::output_tile`.
    output_tile: usize,
    /// Every layer computes on the CPU (no GPU offload).
    on_cpu: bool,
    /// What other modules derive from the model once and keep with it (llguidance's index of
    /// the vocabulary), one value per type: the model need not know those modules.
    derived: Mutex<HashMap<TypeId, Arc<dyn Any + Send + Sync>>>,
}

// SAFETY: a loaded llama_model (vocabulary included) has no thread affinity and is only read
// after `llama_model_load_from_file` returns: its getters, tokenizer and detokenizer keep
// per-call state only (llama-server tokenizes from many threads), and contexts read it
// concurrently by design. It is freed once, in `Drop`, when no `Arc` (contexts hold one) is left.
unsafe impl Send for Model {}
// SAFETY: as for `Send`: every `&self` method only reads the model.
unsafe impl Sync for Model {}

impl Drop for Model {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `llama_model_load_from_file` and is freed here only, once;
        // every context on the model holds an `Arc<Model>`, so none is left to read it.
        unsafe { sys::llama_model_free(self.ptr.as_ptr()) }
    }
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("path", &self.path)
            .field("n_vocab", &self.n_vocab)
            .finish()
    }
}

/// GGUF files start with these four bytes; checking them first keeps junk away from llama.cpp.
fn check_gguf_magic(path: &Path) -> Result<()> {
    let fail = |reason: String| Error::ModelLoad {
        path: path.to_path_buf(),
        reason,
    };
    let mut file = std::fs::File::open(path).map_err(|e| fail(e.to_string()))?;
    if file.metadata().map(|m| m.is_dir()).unwrap_or(false) {
        return Err(fail("is a directory".into()));
    }
    let mut magic = [0u8; 4];
    file.read_exact(&mut magic)
        .map_err(|_| fail("file too short to be GGUF".into()))?;
    if &magic != b"GGUF" {
        return Err(fail("not a GGUF file (bad magic)".into()));
    }
    Ok(())
}

/// Output rows per pass of llama.cpp's CPU matmul for this file's output weights: 4 where
/// llamafile's tinyBLAS kernel tiles them (x86 with AVX-512; Q8_0, Q4_0, Q5_0, IQ4_NL
/// weights), measured in `kvfork_core::output_tile`; otherwise 1 (no padding: k-quant and
/// float weights take other kernels, and other CPUs were not measured).
fn cpu_output_tile(output_type: Option<sys::ggml_type>) -> usize {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        let tiled = [
            sys::GGML_TYPE_Q8_0,
            sys::GGML_TYPE_Q4_0,
            sys::GGML_TYPE_Q5_0,
            sys::GGML_TYPE_IQ4_NL,
        ];
        if output_type.is_some_and(|t| tiled.contains(&t)) {
            return 4;
        }
    }
    let _ = output_type;
    1
}

impl Model {
    /// Load a GGUF file.
    pub fn load(path: impl AsRef<Path>, params: &ModelParams) -> Result<Arc<Model>> {
        let path = path.as_ref();
        check_gguf_magic(path)?;
        ensure_backend()?;
        // Read once (metadata only, freed before llama.cpp loads the file) for the checks and
        // the output weights' type.
        let output_type = match Gguf::open(path) {
            Some(g) => {
                crate::gguf_check::check(&g).map_err(|reason| Error::ModelLoad {
                    path: path.to_path_buf(),
                    reason: format!("malformed GGUF: {reason}"),
                })?;
                g.output_weight_type()
            }
            None => None,
        };
        let fail = |reason: &str| Error::ModelLoad {
            path: path.to_path_buf(),
            reason: reason.into(),
        };
        let c_path = CString::new(path.to_string_lossy().as_bytes())
            .map_err(|_| fail("path contains a NUL byte"))?;
        // SAFETY: returns a struct by value; reads no state.
        let mut mp = unsafe { sys::llama_model_default_params() };
        let default_layers = if crate::backend::backend_name() == "cpu" {
            0
        } else {
            -1
        };
        mp.n_gpu_layers = params.n_gpu_layers.unwrap_or(default_layers);
        mp.load_mode = if params.use_mmap {
            sys::LLAMA_LOAD_MODE_MMAP
        } else {
            sys::LLAMA_LOAD_MODE_NONE
        };
        // SAFETY: `c_path` is a NUL-terminated string alive for the call; `mp` is llama.cpp's
        // defaults with two plain fields set. The backend is initialised (`ensure_backend`)
        // and the file passed the checks of the values llama.cpp would abort on (NULL on
        // any other failure: it catches its own exceptions here).
        let raw = unsafe { sys::llama_model_load_from_file(c_path.as_ptr(), mp) };
        let ptr = NonNull::new(raw)
            .ok_or_else(|| fail("llama.cpp could not load it (see the kvfork log)"))?;
        // SAFETY: a getter of the model just loaded; the vocabulary is owned by the model and
        // lives exactly as long (`Model` keeps both pointers and frees only the model).
        let vocab = unsafe { sys::llama_model_get_vocab(ptr.as_ptr()) };
        // Kept as `NonNull` (a `*mut`) for convenience only: kvfork never writes through it.
        let vocab =
            NonNull::new(vocab.cast_mut()).ok_or_else(|| fail("model has no vocabulary"))?;
        // SAFETY: a getter of the vocabulary just obtained.
        let n_vocab = unsafe { sys::llama_vocab_n_tokens(vocab.as_ptr()) };
        let on_cpu = default_layers == 0 || mp.n_gpu_layers == 0;
        Ok(Arc::new(Model {
            ptr,
            vocab,
            n_vocab,
            output_tile: if on_cpu {
                cpu_output_tile(output_type)
            } else {
                1
            },
            on_cpu,
            path: path.to_path_buf(),
            derived: Mutex::default(),
        }))
    }

    /// Whether every layer computes on the CPU (no GPU offload).
    pub(crate) fn on_cpu(&self) -> bool {
        self.on_cpu
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::llama_model {
        self.ptr.as_ptr()
    }

    pub(crate) fn vocab_ptr(&self) -> *const sys::llama_vocab {
        self.vocab.as_ptr()
    }

    /// The value of type `T` derived from this model: `build` runs on first use, later
    /// calls share its result (concurrent first calls wait for the one build).
    pub(crate) fn derived<T: Any + Send + Sync>(&self, build: impl FnOnce(&Model) -> T) -> Arc<T> {
        let value = self
            .derived
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(TypeId::of::<T>())
            .or_insert_with(|| Arc::new(build(self)))
            .clone();
        value.downcast().expect("stored under its own type")
    }

    /// Output rows per pass of the CPU's output matmul (1: none to fill).
    pub(crate) fn output_tile(&self) -> usize {
        self.output_tile
    }

    /// The GGUF file the model was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tokens in the vocabulary (the width of a logits row).
    pub fn vocab_size(&self) -> usize {
        self.n_vocab as usize
    }

    /// The context length the model was trained with.
    pub fn n_ctx_train(&self) -> u32 {
        // SAFETY: a getter of the loaded model, which lives as long as `self`.
        unsafe { sys::llama_model_n_ctx_train(self.as_ptr()) }.max(0) as u32
    }

    /// The window of the model's sliding-window attention layers, 0 without such layers.
    pub fn n_swa(&self) -> u32 {
        // SAFETY: a getter of the loaded model, which lives as long as `self`.
        unsafe { sys::llama_model_n_swa(self.as_ptr()) }.max(0) as u32
    }

    /// The hidden size (`embedding_length`).
    pub fn n_embd(&self) -> usize {
        // SAFETY: a getter of the loaded model, which lives as long as `self`.
        unsafe { sys::llama_model_n_embd(self.as_ptr()) }.max(0) as usize
    }

    /// Transformer blocks (layers).
    pub fn n_layer(&self) -> usize {
        // SAFETY: a getter of the loaded model.
        unsafe { sys::llama_model_n_layer(self.as_ptr()) }.max(0) as usize
    }

    /// The width of the embeddings llama.cpp returns (`embedding_length_out`, else `n_embd`).
    pub fn n_embd_out(&self) -> usize {
        // SAFETY: a getter of the loaded model, which lives as long as `self`.
        unsafe { sys::llama_model_n_embd_out(self.as_ptr()) }.max(0) as usize
    }

    /// Scores per text of a reranker (rank pooling).
    pub(crate) fn n_cls_out(&self) -> usize {
        // SAFETY: a getter of the loaded model, which lives as long as `self`.
        let n = unsafe { sys::llama_model_n_cls_out(self.as_ptr()) };
        n as usize
    }

    /// `general.name`, else the file stem.
    pub fn name(&self) -> String {
        self.meta("general.name").unwrap_or_else(|| {
            self.path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default()
        })
    }

    /// One metadata value as a string.
    pub fn meta(&self, key: &str) -> Option<String> {
        let key = CString::new(key).ok()?;
        // SAFETY: the model is live, `key` a NUL-terminated string alive for the call, and
        // `read_c_string` passes a buffer writable for `len` bytes; llama.cpp writes at most
        // that many (snprintf) and returns the full length.
        read_c_string(|buf, len| unsafe {
            sys::llama_model_meta_val_str(self.as_ptr(), key.as_ptr(), buf, len)
        })
    }

    /// All GGUF metadata as strings (arrays are summarised by llama.cpp).
    pub fn metadata(&self) -> BTreeMap<String, String> {
        // SAFETY: a getter of the loaded model, which lives as long as `self`.
        let n = unsafe { sys::llama_model_meta_count(self.as_ptr()) };
        (0..n)
            .filter_map(|i| {
                // SAFETY: `i` is below the entry count (llama.cpp returns -1 otherwise) and
                // `b` is writable for `l` bytes, llama.cpp's limit (see `meta`).
                let key = read_c_string(|b, l| unsafe {
                    sys::llama_model_meta_key_by_index(self.as_ptr(), i, b, l)
                })?;
                // SAFETY: as for the key.
                let val = read_c_string(|b, l| unsafe {
                    sys::llama_model_meta_val_str_by_index(self.as_ptr(), i, b, l)
                })?;
                Some((key, val))
            })
            .collect()
    }

    /// A fingerprint of the weights (metadata, parameter count and size): state files carry
    /// it so a file saved with another model is refused.
    pub fn identity(&self) -> u64 {
        let mut w = kvfork_core::state_file::Writer::new();
        for (k, v) in self.metadata() {
            w.str(&k).str(&v);
        }
        // SAFETY: getters of the loaded model, which lives as long as `self`.
        let (n_params, size) = unsafe {
            (
                sys::llama_model_n_params(self.as_ptr()),
                sys::llama_model_size(self.as_ptr()),
            )
        };
        w.u64(n_params).u64(size);
        w.u64(self.n_vocab as u64);
        kvfork_core::state_file::checksum(&w.into_bytes())
    }

    /// The Jinja chat template of the GGUF (`tokenizer.chat_template`), if any.
    pub fn chat_template(&self) -> Option<String> {
        // SAFETY: the model is live; NULL asks for the default template.
        let raw = unsafe { sys::llama_model_chat_template(self.as_ptr(), std::ptr::null()) };
        if raw.is_null() {
            return None;
        }
        Some(
            // SAFETY: a non-NULL result is a NUL-terminated string in the model's metadata,
            // alive as long as the model; it is copied out at once.
            unsafe { std::ffi::CStr::from_ptr(raw) }
                .to_string_lossy()
                .into_owned(),
        )
    }

    /// What the model keeps per sequence: a KV cache, a recurrent state, or both.
    pub fn memory(&self) -> Memory {
        // SAFETY: getters of the loaded model, which lives as long as `self`.
        let (recurrent, hybrid) = unsafe {
            (
                sys::llama_model_is_recurrent(self.as_ptr()),
                sys::llama_model_is_hybrid(self.as_ptr()),
            )
        };
        match (recurrent, hybrid) {
            (_, true) => Memory::Hybrid,
            (true, false) => Memory::Recurrent,
            (false, false) => Memory::Attention,
        }
    }

    /// Experts of a mixture-of-experts model (`{arch}.expert_count`), 0 for a dense one.
    pub fn n_expert(&self) -> u32 {
        let arch = self.meta("general.architecture").unwrap_or_default();
        self.meta(&format!("{arch}.expert_count"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }

    /// The model's family in words: its memory (`transformer`, `recurrent`, `hybrid`), with
    /// `+sliding-window` and `+moe` where they apply (e.g. `hybrid+sliding-window`).
    pub fn family(&self) -> String {
        let mut family = match self.memory() {
            Memory::Attention => "transformer",
            Memory::Recurrent => "recurrent",
            Memory::Hybrid => "hybrid",
        }
        .to_string();
        if self.n_swa() > 0 {
            family.push_str("+sliding-window");
        }
        if self.n_expert() > 0 {
            family.push_str("+moe");
        }
        family
    }

    /// Whether the model keeps a recurrent state (Mamba, RWKV), alone or beside a KV cache
    /// (a hybrid).
    pub fn is_recurrent(&self) -> bool {
        self.memory() != Memory::Attention
    }

    /// `Ok` when `token` is a valid id of this vocabulary.
    pub fn check_token(&self, token: Token) -> Result<()> {
        if token < 0 || token >= self.n_vocab {
            return Err(Error::invalid(
                "token",
                format!("token id {token} is out of range [0, {})", self.n_vocab),
            ));
        }
        Ok(())
    }

    /// Tokenize exactly as llama.cpp does.
    pub fn tokenize(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<Token>> {
        let len =
            i32::try_from(text.len()).map_err(|_| Error::invalid("text", "longer than 2 GiB"))?;
        let mut out: Vec<Token> = vec![0; text.len() + 2];
        for _ in 0..2 {
            // SAFETY: `text` is readable for `len` bytes and `out` writable for `out.len()`
            // tokens, the limit passed; llama.cpp writes nothing when the tokens do not fit
            // and returns minus their count (negative limits included, they never fit).
            let n = unsafe {
                sys::llama_tokenize(
                    self.vocab_ptr(),
                    text.as_ptr().cast::<c_char>(),
                    len,
                    out.as_mut_ptr(),
                    out.len() as i32,
                    add_special,
                    parse_special,
                )
            };
            if n >= 0 {
                out.truncate(n as usize);
                return Ok(out);
            }
            if n == i32::MIN {
                break;
            }
            out.resize((-n) as usize, 0);
        }
        Err(Error::Other("tokenization failed".into()))
    }

    /// Raw bytes of one token's piece.
    pub fn token_to_bytes(&self, token: Token, special: bool) -> Result<Vec<u8>> {
        self.check_token(token)?;
        let mut buf = vec![0u8; 32];
        loop {
            // SAFETY: `token` is a vocabulary id (checked above: llama.cpp throws through the
            // FFI on others) and `buf` is writable for the length passed; llama.cpp writes
            // nothing when the piece does not fit and returns minus its length.
            let n = unsafe {
                sys::llama_token_to_piece(
                    self.vocab_ptr(),
                    token,
                    buf.as_mut_ptr().cast::<c_char>(),
                    buf.len() as i32,
                    0,
                    special,
                )
            };
            if n >= 0 {
                buf.truncate(n as usize);
                return Ok(buf);
            }
            buf.resize((-n) as usize, 0);
        }
    }

    /// One token's piece as text (special tokens rendered; invalid UTF-8 replaced).
    pub fn token_to_text(&self, token: Token) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.token_to_bytes(token, true)?).into_owned())
    }

    /// Detokenize as llama.cpp does.
    pub fn detokenize(
        &self,
        tokens: &[Token],
        remove_special: bool,
        unparse_special: bool,
    ) -> Result<String> {
        for &t in tokens {
            self.check_token(t)?;
        }
        let n_tokens =
            i32::try_from(tokens.len()).map_err(|_| Error::invalid("tokens", "too many tokens"))?;
        // The buffer length is passed as an i32 (a negative one aborts in llama.cpp).
        let mut buf = vec![
            0u8;
            tokens
                .len()
                .saturating_mul(8)
                .saturating_add(16)
                .min(i32::MAX as usize)
        ];
        loop {
            // SAFETY: every token is a vocabulary id (checked above), `tokens` readable for
            // `n_tokens` ids and `buf` writable for its length, at most i32::MAX (a negative
            // length aborts llama.cpp); it returns minus the length needed when short.
            let n = unsafe {
                sys::llama_detokenize(
                    self.vocab_ptr(),
                    tokens.as_ptr(),
                    n_tokens,
                    buf.as_mut_ptr().cast::<c_char>(),
                    buf.len() as i32,
                    remove_special,
                    unparse_special,
                )
            };
            if n >= 0 {
                buf.truncate(n as usize);
                return Ok(String::from_utf8_lossy(&buf).into_owned());
            }
            buf.resize((-n) as usize, 0);
        }
    }

    /// End-of-generation token (EOS, EOT, …) per the vocabulary.
    pub fn is_eog(&self, token: Token) -> bool {
        token >= 0
            && token < self.n_vocab
            // SAFETY: the vocabulary lives as long as `self`; the id is in range (above).
            && unsafe { sys::llama_vocab_is_eog(self.vocab_ptr(), token) }
    }

    /// End-of-sequence token, if the vocabulary has one.
    pub fn eos(&self) -> Option<Token> {
        // SAFETY: a getter of the vocabulary, which lives as long as `self`.
        Some(unsafe { sys::llama_vocab_eos(self.vocab_ptr()) }).filter(|&t| t >= 0)
    }

    /// End-of-turn token (chat models), if the vocabulary has one.
    pub fn eot(&self) -> Option<Token> {
        // SAFETY: a getter of the vocabulary, which lives as long as `self`.
        Some(unsafe { sys::llama_vocab_eot(self.vocab_ptr()) }).filter(|&t| t >= 0)
    }

    /// Beginning-of-sequence token, if the vocabulary has one.
    pub fn bos(&self) -> Option<Token> {
        // SAFETY: a getter of the vocabulary, which lives as long as `self`.
        Some(unsafe { sys::llama_vocab_bos(self.vocab_ptr()) }).filter(|&t| t >= 0)
    }
}

/// Call a llama.cpp "write into buf, return length" function, growing the buffer as needed.
fn read_c_string(mut f: impl FnMut(*mut c_char, usize) -> i32) -> Option<String> {
    let mut buf = vec![0u8; 256];
    loop {
        let n = f(buf.as_mut_ptr().cast::<c_char>(), buf.len());
        if n < 0 {
            return None;
        }
        if (n as usize) < buf.len() {
            buf.truncate(n as usize);
            return Some(String::from_utf8_lossy(&buf).into_owned());
        }
        buf.resize(n as usize + 1, 0);
    }
}

/// What a model keeps per sequence (see [`Model::memory`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Memory {
    /// A KV cache: one cell per position, cut and shared at any position.
    Attention,
    /// A recurrent state only (Mamba, RWKV): the state after the last token.
    Recurrent,
    /// Attention layers with a KV cache beside recurrent or convolution layers (LFM2,
    /// Granite 4 hybrids, Nemotron-H, Jamba, Qwen3.5).
    Hybrid,
}
