//! kvfork: forkable, batched llama.cpp inference.
//!
//! A [`Context`] owns a llama context on its own engine thread. [`Branch`]es are decode
//! sequences that share KV-cache prefixes (a fork tags cells, it copies no tensors); a
//! [`BranchStore`] advances many branches in one `llama_decode`. Every call that runs the
//! model returns a [`Pending`]: `.wait()` it, or `.await` it.

mod abort;
pub mod adapter;
pub mod backend;
mod branch;
mod branch_state;
pub mod chat;
mod context;
mod context_params;
mod embed;
mod engine;
pub mod error;
mod generate;
mod gguf_check;
mod llama_ctx;
pub mod model;
mod prefix_cache;
mod prefix_spill;
mod produced;
mod raw_layer;
pub mod sampling;
mod save_load;
mod score;
mod seq;
mod speculate;
mod store;
mod token_score;

pub use adapter::{Adapters, ControlVector, LoraAdapter, SteeringVector};
pub use backend::{
    set_log_min_level, set_log_sink, set_module_dirs, system_info, LogLevel, SystemInfo,
};
pub use branch::Branch;
pub use chat::{format_chat, FormattedChat};
pub use context::{Context, ContextStats};
pub use context_params::{
    pooling_from_name, CacheType, ContextParams, MAX_SEQUENCES, N_BATCH_RANGE, N_CTX_RANGE,
    N_THREADS_RANGE, RECURRENT_ROLLBACK_RANGE,
};
pub use embed::Embedding;
pub use engine::{
    close_all, forsake_all_after_fork, set_blocking_wrapper, Cancel, Canceller, Pending,
};
pub use error::{Error, Result};
pub use generate::{
    Drafter, OnContextFull, SpeculativeSchedule, SpeculativeStream, StopReason, TokenStream,
};
pub use kvfork_core::metrics::LogBase;
pub use kvfork_core::Handle;
pub use model::{Memory, Model, ModelParams, Token};
pub use prefix_cache::{PrefixCache, PrefixCacheStats};
pub use prefix_spill::{LevelStats, SpillConfig};
pub use produced::Produced;
pub use raw_layer::Created;
pub use sampling::json_schema::{json_schema_to_grammar, MAX_SCHEMA_DEPTH};
pub use sampling::{GrammarSpec, SamplingParams};
pub use speculate::Speculated;
pub use store::BranchStore;
pub use token_score::TokenScore;
