//! kvfork: forkable, batched llama.cpp inference.
//!
//! A [`Context`] owns a llama context on its own engine thread. [`Branch`]es are decode
//! sequences that share KV-cache prefixes (a fork tags cells, it copies no tensors); a
//! [`BranchStore`] advances many branches in one `llama_decode`. Every call that runs the
//! model returns a [`Pending`]: `.wait()` it, or `.await` it.

pub mod backend;
mod branch;
mod branch_state;
pub mod chat;
mod context;
mod embed;
mod engine;
pub mod error;
mod gguf_check;
mod llama_ctx;
pub mod model;
mod persist;
pub mod sampling;
mod store;

pub use backend::{set_log_min_level, set_log_sink, system_info, LogLevel, SystemInfo};
pub use branch::{Branch, Produced};
pub use chat::{format_chat, FormattedChat};
pub use context::{Context, ContextStats};
pub use embed::Embedding;
pub use engine::{Cancel, Canceller, Pending};
pub use error::{Error, Result};
pub use kvfork_core::metrics::LogBase;
pub use kvfork_core::Handle;
pub use llama_ctx::{CacheType, ContextParams, MAX_SEQUENCES};
pub use model::{Model, ModelParams, Token};
pub use sampling::{GrammarSpec, SamplingParams};
pub use store::BranchStore;

/// Deepest JSON nesting accepted by [`json_schema_to_grammar`]: llama.cpp's converter recurses
/// once per level and overflows a thread's stack at ~1,500 schema levels (2 MiB).
pub const MAX_SCHEMA_DEPTH: usize = 256;

/// GBNF grammar for a JSON schema (llama.cpp's converter).
pub fn json_schema_to_grammar(schema_json: &str) -> Result<String> {
    let depth = kvfork_core::json::max_depth(schema_json);
    if depth > MAX_SCHEMA_DEPTH {
        return Err(Error::Grammar(format!(
            "the schema nests {depth} levels deep (at most {MAX_SCHEMA_DEPTH})"
        )));
    }
    backend::ensure_backend()?;
    llama_cpp_2::json_schema_to_grammar(schema_json)
        .map_err(|e| Error::Grammar(format!("bad JSON schema: {e}")))
}
