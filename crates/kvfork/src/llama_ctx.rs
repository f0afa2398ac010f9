//! Thin owners of a `llama_context` and a `llama_batch`. Only the engine thread touches them.

use std::ptr::NonNull;
use std::sync::Arc;

use llama_cpp_sys_2 as sys;

use crate::engine::AbortSignal;
use crate::error::{Error, Result};
use crate::model::{Model, Token};

/// KV cache element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
}

impl CacheType {
    pub fn from_name(name: &str) -> Result<Self> {
        Ok(match name.to_ascii_lowercase().as_str() {
            "f32" => CacheType::F32,
            "f16" => CacheType::F16,
            "bf16" => CacheType::BF16,
            "q8_0" => CacheType::Q8_0,
            "q4_0" => CacheType::Q4_0,
            other => {
                return Err(Error::invalid(
                    "type_k/type_v",
                    format!("unknown cache type {other:?}"),
                ))
            }
        })
    }

    fn ggml(self) -> sys::ggml_type {
        match self {
            CacheType::F32 => sys::GGML_TYPE_F32,
            CacheType::F16 => sys::GGML_TYPE_F16,
            CacheType::BF16 => sys::GGML_TYPE_BF16,
            CacheType::Q8_0 => sys::GGML_TYPE_Q8_0,
            CacheType::Q4_0 => sys::GGML_TYPE_Q4_0,
        }
    }
}

/// Options of a context (see `create_context` in the Python API).
#[derive(Debug, Clone)]
pub struct ContextParams {
    pub n_ctx: u32,
    pub n_batch: u32,
    pub n_seq_max: u32,
    /// Threads of single-token decodes. `None`: adapt (see `kvfork_core::threads`), between
    /// 1 and the number of cores (at most 8).
    pub n_threads: Option<i32>,
    /// Threads of multi-token decodes (prefill, batched steps). `None`: adapt, likewise.
    pub n_threads_batch: Option<i32>,
    pub type_k: CacheType,
    pub type_v: CacheType,
    pub embeddings: bool,
    /// llama.cpp pooling type for embeddings (`None`: the model's).
    pub pooling: Option<i32>,
}

impl Default for ContextParams {
    fn default() -> Self {
        ContextParams {
            n_ctx: 4096,
            n_batch: 512,
            n_seq_max: 8,
            n_threads: None,
            n_threads_batch: None,
            type_k: CacheType::F16,
            type_v: CacheType::F16,
            embeddings: false,
            pooling: None,
        }
    }
}

/// llama.cpp's limit on sequences per context.
pub const MAX_SEQUENCES: u32 = 256;

impl ContextParams {
    /// Reject values llama.cpp would assert on.
    pub fn validate(&self) -> Result<()> {
        if self.n_seq_max == 0 || self.n_seq_max > MAX_SEQUENCES {
            return Err(Error::invalid(
                "n_seq_max",
                format!("{} is not in [1, {MAX_SEQUENCES}]", self.n_seq_max),
            ));
        }
        if self.n_ctx < 16 || self.n_ctx > 1 << 24 {
            return Err(Error::invalid(
                "n_ctx",
                format!("{} is not in [16, 16777216]", self.n_ctx),
            ));
        }
        if self.n_batch == 0 || self.n_batch > 1 << 16 {
            return Err(Error::invalid(
                "n_batch",
                format!("{} is not in [1, 65536]", self.n_batch),
            ));
        }
        for (name, value) in [
            ("n_threads", self.n_threads),
            ("n_threads_batch", self.n_threads_batch),
        ] {
            if let Some(t) = value {
                if !(1..=512).contains(&t) {
                    return Err(Error::invalid(name, format!("{t} is not in [1, 512]")));
                }
            }
        }
        if let Some(p) = self.pooling {
            if !(-1..=3).contains(&p) {
                return Err(Error::invalid(
                    "pooling",
                    format!("unknown pooling type {p}"),
                ));
            }
        }
        Ok(())
    }

    /// The most threads an adapting decode uses: the number of cores, at most 8.
    pub fn max_threads() -> i32 {
        std::thread::available_parallelism()
            .map(|n| n.get().min(8) as i32)
            .unwrap_or(4)
    }

    /// Whether either thread count adapts to the machine's load.
    pub fn adapts_threads(&self) -> bool {
        self.n_threads.is_none() || self.n_threads_batch.is_none()
    }

    /// (single-token, batch) thread counts when the adaptive choice is `adaptive`.
    pub fn threads_with(&self, adaptive: i32) -> (i32, i32) {
        (
            self.n_threads.unwrap_or(adaptive),
            self.n_threads_batch.unwrap_or(adaptive),
        )
    }
}

/// An owned `llama_context`. `!Sync`; lives on the engine thread.
pub(crate) struct LlamaCtx {
    ptr: NonNull<sys::llama_context>,
    mem: sys::llama_memory_t,
    pub n_ctx: u32,
    pub n_batch: u32,
    pub n_seq_max: u32,
    pub n_vocab: usize,
    /// The most threads an adapting decode uses (resolved once, when created).
    pub max_threads: i32,
    /// Read by llama.cpp's abort callback; dropped after the context (field order).
    abort_signal: Option<Arc<AbortSignal>>,
    // Keeps the weights alive for as long as the context.
    _model: Arc<Model>,
}

// SAFETY: the context is created, used and freed by the engine thread only; Send is
// needed to move it into that thread.
unsafe impl Send for LlamaCtx {}

impl Drop for LlamaCtx {
    fn drop(&mut self) {
        unsafe { sys::llama_free(self.ptr.as_ptr()) }
    }
}

impl LlamaCtx {
    pub fn new(model: Arc<Model>, p: &ContextParams) -> Result<Self> {
        p.validate()?;
        let mut cp = unsafe { sys::llama_context_default_params() };
        cp.n_ctx = p.n_ctx;
        // With embeddings, llama.cpp reserves its pooling graph for n_ubatch tokens rounded up
        // to a multiple of n_seq_max, but for only n_ubatch outputs: unless n_ubatch is such a
        // multiple, the mean-pooling matmul's shapes disagree and GGML_ASSERT aborts the
        // process (n_seq_max = 3, 5, 6, ... with n_batch = 512). Round n_batch up instead.
        let n_batch = if p.embeddings {
            p.n_batch.div_ceil(p.n_seq_max) * p.n_seq_max
        } else {
            p.n_batch
        };
        if p.embeddings && p.n_ctx < n_batch && p.n_ctx % p.n_seq_max != 0 {
            return Err(Error::invalid(
                "n_ctx",
                format!(
                    "{} is below n_batch ({n_batch}): with embeddings it must then be a \
                     multiple of n_seq_max ({})",
                    p.n_ctx, p.n_seq_max
                ),
            ));
        }
        cp.n_batch = n_batch;
        // One physical batch per logical batch: one llama_decode == one graph run.
        cp.n_ubatch = n_batch;
        // llama.cpp reserves outputs for max(batch outputs, n_seq_max) rows and asserts that
        // this fits n_outputs_max (default n_batch): n_seq_max > n_batch would abort.
        cp.n_outputs_max = n_batch.max(p.n_seq_max);
        cp.n_seq_max = p.n_seq_max;
        let max_threads = ContextParams::max_threads();
        let (threads, threads_batch) = p.threads_with(max_threads);
        cp.n_threads = threads;
        cp.n_threads_batch = threads_batch;
        cp.type_k = p.type_k.ggml();
        cp.type_v = p.type_v.ggml();
        cp.embeddings = p.embeddings;
        if let Some(pool) = p.pooling {
            cp.pooling_type = pool;
        }
        // Forks share prefix cells only when the cache is unified (seq_cp just tags cells).
        cp.kv_unified = true;
        // Keep every position of sliding-window layers so partial seq_rm / forks stay exact.
        cp.swa_full = true;
        cp.no_perf = true;
        let raw = unsafe { sys::llama_init_from_model(model.as_ptr(), cp) };
        let ptr = NonNull::new(raw).ok_or_else(|| {
            Error::Decode(
                "llama.cpp could not create the context (out of memory? see the kvfork log)".into(),
            )
        })?;
        let mem = unsafe { sys::llama_get_memory(ptr.as_ptr()) };
        Ok(LlamaCtx {
            ptr,
            mem,
            n_ctx: unsafe { sys::llama_n_ctx(ptr.as_ptr()) },
            n_batch: unsafe { sys::llama_n_batch(ptr.as_ptr()) },
            n_seq_max: unsafe { sys::llama_n_seq_max(ptr.as_ptr()) },
            n_vocab: model.vocab_size(),
            max_threads,
            abort_signal: None,
            _model: model,
        })
    }

    /// Run one `llama_decode`. On failure llama.cpp restores the memory state (codes 1, -1).
    pub fn decode(&mut self, batch: &Batch) -> Result<()> {
        if batch.len() == 0 {
            return Ok(());
        }
        let code = unsafe { sys::llama_decode(self.ptr.as_ptr(), batch.raw) };
        match code {
            0 => Ok(()),
            1 => Err(Error::KvCacheFull(format!(
                "no KV slot for a batch of {} tokens (n_ctx = {})",
                batch.len(),
                self.n_ctx
            ))),
            2 => Err(Error::Cancelled("the decode was aborted".into())),
            -1 => Err(Error::Decode(
                "llama.cpp rejected the batch (inconsistent positions or sequence ids)".into(),
            )),
            c => Err(Error::Decode(format!("llama_decode returned {c}"))),
        }
    }

    /// Let `signal` abort a running `llama_decode` (between graph nodes; llama.cpp then
    /// removes the aborted batch's cells and returns 2). The signal outlives the context:
    /// the engine's `Shared` holds it for as long as the worker that owns this context.
    pub fn set_abort_signal(&mut self, signal: Arc<AbortSignal>) {
        unsafe extern "C" fn should_abort(data: *mut std::ffi::c_void) -> bool {
            // SAFETY: `data` is the `AbortSignal` kept alive in `self.abort_signal`.
            let signal = unsafe { &*(data as *const AbortSignal) };
            signal.should_abort()
        }
        let data = Arc::as_ptr(&signal) as *mut std::ffi::c_void;
        // SAFETY: the context is live; the callback only reads atomics through `data`.
        unsafe { sys::llama_set_abort_callback(self.ptr.as_ptr(), Some(should_abort), data) };
        self.abort_signal = Some(signal);
    }

    /// Logits row of batch entry `i` (which must have been marked for output).
    pub fn logits_ith(&self, i: usize) -> Result<&[f32]> {
        let p = unsafe { sys::llama_get_logits_ith(self.ptr.as_ptr(), i as i32) };
        if p.is_null() {
            return Err(Error::Decode(format!("no logits at batch index {i}")));
        }
        Ok(unsafe { std::slice::from_raw_parts(p, self.n_vocab) })
    }

    fn check_seq(&self, seq: i32) -> Result<()> {
        check_seq(seq, self.n_seq_max)
    }

    /// Threads of single-token and of multi-token decodes from now on.
    pub fn set_threads(&mut self, threads: i32, threads_batch: i32) {
        unsafe { sys::llama_set_n_threads(self.ptr.as_ptr(), threads, threads_batch) }
    }

    /// The pooling llama.cpp applies to embeddings (`LLAMA_POOLING_TYPE_*`).
    pub fn pooling(&self) -> i32 {
        unsafe { sys::llama_pooling_type(self.ptr.as_ptr()) }
    }

    /// The pooled embedding of `seq` after the last decode (pooled contexts only).
    pub fn embeddings_seq(&self, seq: i32, n_embd: usize) -> Result<&[f32]> {
        self.check_seq(seq)?;
        let p = unsafe { sys::llama_get_embeddings_seq(self.ptr.as_ptr(), seq) };
        if p.is_null() {
            return Err(Error::Decode(format!(
                "no pooled embedding for sequence {seq}"
            )));
        }
        Ok(unsafe { std::slice::from_raw_parts(p, n_embd) })
    }

    /// The embedding of batch entry `i` (contexts without pooling).
    pub fn embeddings_ith(&self, i: usize, n_embd: usize) -> Result<&[f32]> {
        let p = unsafe { sys::llama_get_embeddings_ith(self.ptr.as_ptr(), i as i32) };
        if p.is_null() {
            return Err(Error::Decode(format!("no embedding at batch index {i}")));
        }
        Ok(unsafe { std::slice::from_raw_parts(p, n_embd) })
    }

    pub fn seq_cp(&mut self, src: i32, dst: i32, p0: i32, p1: i32) -> Result<()> {
        self.check_seq(src)?;
        self.check_seq(dst)?;
        check_range(p0, p1)?;
        if src != dst {
            unsafe { sys::llama_memory_seq_cp(self.mem, src, dst, p0, p1) };
        }
        Ok(())
    }

    pub fn seq_rm(&mut self, seq: i32, p0: i32, p1: i32) -> Result<bool> {
        self.check_seq(seq)?;
        check_range(p0, p1)?;
        Ok(unsafe { sys::llama_memory_seq_rm(self.mem, seq, p0, p1) })
    }

    /// Empty a freshly leased sequence. A free lease holds no cells unless raw `kv_*` calls
    /// put some there, so the O(n_ctx) scan of `seq_rm` is skipped when it is already empty.
    pub fn clear_seq(&mut self, seq: i32) -> Result<()> {
        if self.seq_pos_max(seq)? >= 0 {
            self.seq_rm(seq, 0, -1)?;
        }
        Ok(())
    }

    pub fn seq_keep(&mut self, seq: i32) -> Result<()> {
        self.check_seq(seq)?;
        unsafe { sys::llama_memory_seq_keep(self.mem, seq) };
        Ok(())
    }

    pub fn seq_pos_max(&self, seq: i32) -> Result<i32> {
        self.check_seq(seq)?;
        Ok(unsafe { sys::llama_memory_seq_pos_max(self.mem, seq) })
    }

    pub fn clear(&mut self) {
        unsafe { sys::llama_memory_clear(self.mem, true) }
    }

    /// The KV cells of `seq`, or of every sequence with `seq = -1` (shared cells once, with
    /// all their sequence ids), in llama.cpp's own layout.
    pub fn kv_state(&self, seq: i32) -> Result<Vec<u8>> {
        if seq != -1 {
            self.check_seq(seq)?;
        }
        let ctx = self.ptr.as_ptr();
        let size = unsafe { sys::llama_state_seq_get_size(ctx, seq) };
        let mut buf = vec![0u8; size];
        let written = unsafe { sys::llama_state_seq_get_data(ctx, buf.as_mut_ptr(), size, seq) };
        if written == 0 && size != 0 {
            return Err(Error::Other(
                "llama.cpp could not copy the KV cells out".into(),
            ));
        }
        buf.truncate(written);
        Ok(buf)
    }

    /// Restore cells written by `kv_state` into `seq` (which must be empty), or replace every
    /// sequence with `seq = -1`. Bytes must be kvfork-verified first: llama.cpp trusts them.
    /// On failure the target is left empty.
    pub fn set_kv_state(&mut self, seq: i32, data: &[u8]) -> Result<()> {
        if seq != -1 {
            self.check_seq(seq)?;
        }
        let ctx = self.ptr.as_ptr();
        let read = unsafe { sys::llama_state_seq_set_data(ctx, data.as_ptr(), data.len(), seq) };
        if read == data.len() {
            return Ok(());
        }
        // A failed restore can leave cells behind (iSWA models).
        if seq == -1 {
            self.clear();
        } else {
            self.seq_rm(seq, -1, -1)?;
        }
        Err(Error::State(
            "llama.cpp refused the saved KV cells (saved from a context with other cache \
             types, or too large for this context's n_ctx; see the kvfork log)"
                .into(),
        ))
    }
}

/// A sequence id must lie in [0, n_seq_max): llama.cpp aborts on ids outside [0, 256).
pub(crate) fn check_seq(seq: i32, n_seq_max: u32) -> Result<()> {
    if seq < 0 || seq as u32 >= n_seq_max {
        return Err(Error::invalid(
            "seq",
            format!("sequence id {seq} is not in [0, n_seq_max = {n_seq_max})"),
        ));
    }
    Ok(())
}

/// KV positions are >= 0, or -1 for an open end.
pub(crate) fn check_range(p0: i32, p1: i32) -> Result<()> {
    if p0 < -1 || p1 < -1 {
        return Err(Error::invalid(
            "p0/p1",
            "positions must be >= 0 (or -1 for 'open')",
        ));
    }
    Ok(())
}

/// A reusable `llama_batch` holding up to `capacity` tokens, one sequence id each.
pub(crate) struct Batch {
    raw: sys::llama_batch,
    capacity: usize,
}

// SAFETY: plain heap buffers owned by this value.
unsafe impl Send for Batch {}

impl Drop for Batch {
    fn drop(&mut self) {
        unsafe { sys::llama_batch_free(self.raw) }
    }
}

impl Batch {
    pub fn new(capacity: usize) -> Self {
        let raw = unsafe { sys::llama_batch_init(capacity as i32, 0, 1) };
        Batch { raw, capacity }
    }

    pub fn len(&self) -> usize {
        self.raw.n_tokens as usize
    }

    pub fn clear(&mut self) {
        self.raw.n_tokens = 0;
    }

    /// Append one token. Callers keep `len() < capacity` (checked: a panic here is a bug).
    pub fn push(&mut self, token: Token, pos: i32, seq: i32, logits: bool) {
        let i = self.len();
        assert!(i < self.capacity, "batch overflow");
        unsafe {
            *self.raw.token.add(i) = token;
            *self.raw.pos.add(i) = pos;
            *self.raw.n_seq_id.add(i) = 1;
            *(*self.raw.seq_id.add(i)) = seq;
            *self.raw.logits.add(i) = logits as i8;
        }
        self.raw.n_tokens += 1;
    }
}
