//! The public options of a context: sizes, threads, cache element types, embeddings and
//! pooling, parking — each checked before llama.cpp sees it (`ContextParams::validate`), and
//! the names callers give them (`CacheType::from_name`, `pooling_from_name`).

use std::fmt::Display;
use std::ops::RangeInclusive;

use llama_cpp_sys_2 as sys;

use crate::error::{Error, Result};
use crate::seq::Seq;

/// llama.cpp's `LLAMA_POOLING_TYPE_NONE`: embeddings are one vector per token.
pub(crate) const POOLING_NONE: i32 = 0;
/// llama.cpp's `LLAMA_POOLING_TYPE_RANK`: a reranker's scores per text.
pub(crate) const POOLING_RANK: i32 = 4;

/// KV cache element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheType {
    /// 32-bit float.
    F32,
    /// 16-bit float (the default).
    F16,
    /// bfloat16.
    BF16,
    /// 8-bit blocks (llama.cpp's `q8_0`).
    Q8_0,
    /// 4-bit blocks (llama.cpp's `q4_0`).
    Q4_0,
}

impl CacheType {
    /// By name: `f32`, `f16`, `bf16`, `q8_0` or `q4_0` (any case).
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

    pub(crate) fn ggml(self) -> sys::ggml_type {
        match self {
            CacheType::F32 => sys::GGML_TYPE_F32,
            CacheType::F16 => sys::GGML_TYPE_F16,
            CacheType::BF16 => sys::GGML_TYPE_BF16,
            CacheType::Q8_0 => sys::GGML_TYPE_Q8_0,
            CacheType::Q4_0 => sys::GGML_TYPE_Q4_0,
        }
    }
}

/// llama.cpp's pooling type for embeddings by name: `none`, `mean`, `cls` or `last`.
pub fn pooling_from_name(name: &str) -> Result<i32> {
    Ok(match name {
        "none" => POOLING_NONE,
        "mean" => 1,
        "cls" => 2,
        "last" => 3,
        other => {
            return Err(Error::invalid(
                "pooling",
                format!("unknown pooling {other:?} (none, mean, cls or last)"),
            ))
        }
    })
}

/// Options of a context (see `create_context` in the Python API).
#[derive(Debug, Clone)]
pub struct ContextParams {
    /// KV cache size in tokens, shared by all sequences.
    pub n_ctx: u32,
    /// Most tokens one decode takes.
    pub n_batch: u32,
    /// Number of KV sequences (live branches at once), at most [`MAX_SEQUENCES`].
    pub n_seq_max: u32,
    /// Threads of single-token decodes. `None`: adapt (see `kvfork_core::threads`), between
    /// 1 and the number of cores (at most 8).
    pub n_threads: Option<i32>,
    /// Threads of multi-token decodes (prefill, batched steps). `None`: adapt, likewise.
    pub n_threads_batch: Option<i32>,
    /// Element type of the cached keys.
    pub type_k: CacheType,
    /// Element type of the cached values.
    pub type_v: CacheType,
    /// Compute embeddings, for `Context::embed`.
    pub embeddings: bool,
    /// llama.cpp pooling type for embeddings (`None`: the model's).
    pub pooling: Option<i32>,
    /// More branches than leases: a branch without a lease is parked in host memory
    /// (`engine/park.rs`). llama.cpp then gets one more sequence, the engine's scratch.
    pub park: bool,
    /// Recurrent-state checkpoints a branch of a recurrent or hybrid model keeps at most
    /// (`engine/checkpoints.rs`); 0 keeps none (forks inside a sequence then prefill it all).
    pub checkpoints: u32,
    /// Bytes those checkpoints may take per branch (host memory).
    pub checkpoint_bytes: u64,
    /// Tokens a recurrent state can drop from the end of a decode without a checkpoint
    /// (llama.cpp's per-token snapshots, `n_rs_seq`, on the architectures that have them:
    /// LFM2, Qwen3.5, Nemotron-H, ...): a rejected speculative guess that long is undone at
    /// once instead of decoded again. 0: none.
    pub recurrent_rollback: u32,
    /// Sampling on the device (`sampling/device.rs`): a decode hands back each output's best
    /// 64 logits and log-partition instead of its logits row, and branches draw from those
    /// (chains that cut to `top_k <= 64` first); they have no rows to read. A branch whose
    /// chain needs the row gets it (`Batch::want_row`).
    pub device_sampling: bool,
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
            park: false,
            checkpoints: 16,
            checkpoint_bytes: 256 << 20,
            recurrent_rollback: 0,
            device_sampling: false,
        }
    }
}

/// llama.cpp's limit on sequences per context.
pub const MAX_SEQUENCES: u32 = 256;

/// The `n_ctx` a context takes.
pub const N_CTX_RANGE: RangeInclusive<u32> = 16..=1 << 24;

/// The `n_batch` a context takes.
pub const N_BATCH_RANGE: RangeInclusive<u32> = 1..=1 << 16;

/// The `n_threads` and `n_threads_batch` a context takes.
pub const N_THREADS_RANGE: RangeInclusive<i32> = 1..=512;

/// The `recurrent_rollback` a context takes.
pub const RECURRENT_ROLLBACK_RANGE: RangeInclusive<u32> = 0..=64;

/// `value` within `range`, or an invalid-argument error naming `name` and the range.
fn check_range<T: PartialOrd + Display>(
    name: &'static str,
    value: T,
    range: RangeInclusive<T>,
) -> Result<()> {
    if range.contains(&value) {
        return Ok(());
    }
    Err(Error::invalid(
        name,
        format!("{value} is not in [{}, {}]", range.start(), range.end()),
    ))
}

impl ContextParams {
    /// The `n_seq_max` a context takes: with `park`, llama.cpp gets one more sequence (the
    /// scratch) than branches lease.
    pub fn n_seq_max_range(park: bool) -> RangeInclusive<u32> {
        1..=MAX_SEQUENCES - park as u32
    }

    /// Reject values llama.cpp would assert on.
    pub fn validate(&self) -> Result<()> {
        check_range(
            "n_seq_max",
            self.n_seq_max,
            Self::n_seq_max_range(self.park),
        )?;
        if self.park && self.embeddings {
            return Err(Error::invalid(
                "park",
                "parking is for generation contexts, not embeddings=True",
            ));
        }
        if self.device_sampling && self.embeddings {
            return Err(Error::invalid(
                "device_sampling",
                "device sampling is for drawing tokens; an embeddings=True context draws none",
            ));
        }
        check_range("n_ctx", self.n_ctx, N_CTX_RANGE)?;
        check_range(
            "recurrent_rollback",
            self.recurrent_rollback,
            RECURRENT_ROLLBACK_RANGE,
        )?;
        check_range("n_batch", self.n_batch, N_BATCH_RANGE)?;
        for (name, value) in [
            ("n_threads", self.n_threads),
            ("n_threads_batch", self.n_threads_batch),
        ] {
            if let Some(t) = value {
                check_range(name, t, N_THREADS_RANGE)?;
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

    /// Sequences llama.cpp holds: the leases, plus the scratch sequence of `park`, plus the
    /// padding sequence when there is one.
    pub fn llama_seqs(&self) -> u32 {
        self.n_seq_max + self.park as u32 + self.pad_seq().is_some() as u32
    }

    /// The sequence no branch leases whose rows pad a decode's outputs to whole tiles of the
    /// CPU's output matmul (`kvfork_core::output_tile`); emptied after every decode. None
    /// for embeddings, or when llama.cpp's sequence limit leaves no room for it.
    pub(crate) fn pad_seq(&self) -> Option<Seq> {
        let first_free = self.n_seq_max + self.park as u32;
        (!self.embeddings && first_free < MAX_SEQUENCES).then(|| Seq::new(first_free))
    }

    /// The checkpoints one branch keeps at most.
    pub(crate) fn checkpoint_budget(&self) -> kvfork_core::Budget {
        kvfork_core::Budget {
            count: self.checkpoints as usize,
            bytes: usize::try_from(self.checkpoint_bytes).unwrap_or(usize::MAX),
        }
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
