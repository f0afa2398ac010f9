//! The one error type of the crate. Each variant maps onto one Python exception.

use std::path::PathBuf;

use kvfork_core::TenancyError;

/// Everything that can go wrong in kvfork.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// A model or LoRA adapter file could not be loaded (missing, unreadable, not GGUF,
    /// rejected by llama.cpp).
    #[error("failed to load {path}: {reason}")]
    ModelLoad {
        /// The file asked for.
        path: PathBuf,
        /// Why it was refused.
        reason: String,
    },
    /// `llama_decode` (or context creation) failed for a reason other than a full KV cache.
    #[error("decode failed: {0}")]
    Decode(String),
    /// No room left in the KV cache for the batch (llama_decode returned 1, or a position ≥ n_ctx).
    #[error("KV cache is full: {0}")]
    KvCacheFull(String),
    /// Every sequence id of the context is leased.
    #[error(
        "no free KV sequence: all {n_seq_max} leases are in use; prune a branch or raise n_seq_max"
    )]
    LeaseExhausted {
        /// The number of sequences of the context.
        n_seq_max: u32,
    },
    /// A sequence asked for by its id is leased by a live branch.
    #[error("KV sequence {seq} is held by a live branch: prune or destroy that branch first")]
    SeqLeased {
        /// The sequence id asked for.
        seq: i32,
    },
    /// The branch was pruned (or its handle is stale).
    #[error("branch {0} is disposed")]
    BranchDisposed(String),
    /// A grammar failed to parse, or has no legal continuation.
    #[error("grammar error: {0}")]
    Grammar(String),
    /// A chat template is missing or failed to render.
    #[error("chat template error: {0}")]
    ChatTemplate(String),
    /// A caller-supplied value is out of range; `name` is the argument's name.
    #[error("invalid {name}: {message}")]
    InvalidArgument {
        /// The argument's name, as the Python API spells it.
        name: &'static str,
        /// What is wrong with its value.
        message: String,
    },
    /// A state file (`save`/`load`) is corrupt, truncated, foreign or from another model.
    #[error("cannot load the state file: {0}")]
    State(String),
    /// Reading or writing a file failed.
    #[error("{path}: {message}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error's kind (mapped onto `FileNotFoundError`, `PermissionError`, ...).
        kind: std::io::ErrorKind,
        /// The OS error's text.
        message: String,
    },
    /// The context was closed.
    #[error("the context is closed")]
    Closed,
    /// The operation was cancelled before it happened (or aborted and rolled back).
    #[error("cancelled: {0}")]
    Cancelled(String),
    /// A bug inside kvfork (a caught panic); the context it happened in is closed.
    #[error("internal error in kvfork: {0}")]
    Internal(String),
    /// Any other failure of the library (a rule of the tree, an I/O failure, …).
    #[error("{0}")]
    Other(String),
}

impl Error {
    pub(crate) fn invalid(name: &'static str, message: impl Into<String>) -> Self {
        Error::InvalidArgument {
            name,
            message: message.into(),
        }
    }
}

impl Error {
    /// The same error with `note` after its message, for the kinds whose message is free
    /// text (what a failure left behind); others as they are.
    pub(crate) fn noted(self, note: &str) -> Self {
        match self {
            Error::KvCacheFull(m) => Error::KvCacheFull(format!("{m}; {note}")),
            Error::Decode(m) => Error::Decode(format!("{m}; {note}")),
            Error::Cancelled(m) => Error::Cancelled(format!("{m}; {note}")),
            Error::Other(m) => Error::Other(format!("{m}; {note}")),
            other => other,
        }
    }

    pub(crate) fn io(path: &std::path::Path, err: std::io::Error) -> Self {
        Error::Io {
            path: path.to_path_buf(),
            kind: err.kind(),
            message: err.to_string(),
        }
    }
}

impl From<TenancyError> for Error {
    fn from(err: TenancyError) -> Self {
        match err {
            TenancyError::LeaseExhausted { n_seq_max } => Error::LeaseExhausted { n_seq_max },
            TenancyError::StaleHandle(h) => Error::BranchDisposed(h.to_string()),
            other => Error::Other(other.to_string()),
        }
    }
}

/// Result alias of the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
