//! The structs of the Python classes that are handles of engine objects — `Branch` and
//! `Context` — and the wrapping of an engine branch. Each class's methods are in the file
//! named after it (`branch.rs`, `context.rs`); the structs live here so that those files can
//! name each other's types without importing each other.

use pyo3::prelude::*;

/// A llama context: owns a unified KV cache and the engine thread that runs every decode.
#[pyclass(frozen, weakref, module = "kvfork", name = "Context")]
pub struct PyContext {
    pub inner: kvfork::Context,
}

/// One decode sequence on its own KV lease, with its own sampler chain, grammar, logit bias,
/// steer, logits snapshot and perplexity trackers; forks share their parent's KV prefix.
/// Made by `Branch.create(ctx, ...)` or `fork()`; it holds its lease until `prune()`, and any
/// use after that raises BranchDisposedError.
#[pyclass(frozen, weakref, module = "kvfork", name = "Branch")]
pub struct PyBranch {
    pub inner: kvfork::Branch,
}

pub(crate) fn wrap(b: kvfork::Branch) -> PyBranch {
    PyBranch { inner: b }
}
