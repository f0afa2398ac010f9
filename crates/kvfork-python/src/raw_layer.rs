//! The raw context layer (lloyal.node's low level: the Node.js library kvfork re-creates) and in-memory snapshots: the
//! methods `Context` and `Branch` gain from them, beside their other methods.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyType};

use crate::awaitable::Call;
use crate::branch::{log_base, token_arg};
use crate::convert::token_int;
use crate::convert::{self, Arg, Int, StateBytes};
use crate::errors::IntoPyResult;
use crate::handles::PyBranch;
use crate::handles::PyContext;
use crate::made;
use crate::twins::twins;

#[pymethods]
impl PyContext {
    /// Entropy of the context's last output (the logits of the last `decode`, or the
    /// snapshot of the branch whose decode ran last), in nats (or bits with `base="bits"`).
    /// KvforkError before any decode; ValueError for another `base`.
    #[pyo3(signature = (base=Arg("nats")), text_signature = "($self, base='nats')")]
    fn model_entropy(&self, py: Python<'_>, base: Arg<&str>) -> PyResult<f64> {
        let base = log_base(base.0)?;
        py.detach(|| self.inner.model_entropy(base)).py()
    }

    /// -log p(`token`) under the context's last output (see `model_entropy`), in nats (or
    /// bits with `base="bits"`); inf for a masked token. KvforkError before any decode;
    /// ValueError for a token id out of range or another `base`.
    #[pyo3(signature = (token, base=Arg("nats")), text_signature = "($self, token, base='nats')")]
    fn model_surprisal(&self, py: Python<'_>, token: Int, base: Arg<&str>) -> PyResult<f64> {
        let (token, base) = (token_int(&token)?, log_base(base.0)?);
        py.detach(|| self.inner.model_surprisal(token, base)).py()
    }
}

twins! {
    impl PyContext {
        /// Raw decode (lloyal.node's `ctx.decode(tokens, position, seqId)`): `tokens` into
        /// sequence `seq_id` from `position`, in ceil(n / n_batch) decodes, keeping the last
        /// token's logits as the sequence's output (`Branch.create(ctx, position, params,
        /// seq_id=...)` then `capture_logits()` takes both over). `position` must follow the
        /// sequence's cells when it has any. ValueError for a sequence a branch holds (decode
        /// through the branch), a bad id, position or token, or no tokens; KvCacheFullError
        /// past n_ctx. All or nothing; cancelled, it either never ran or completed.
        #[sync_doc = "returns None once the tokens are decoded. Waits without the GIL; Ctrl-C \
                      cancels it all-or-nothing, as an await would, and raises \
                      KeyboardInterrupt."]
        fn decode / decode_sync(
            &self,
            py,
            tokens: &Bound<'_, PyAny>,
            position: Int,
            seq_id: Int,
        ) -> Option<()> {
            let tokens = convert::tokens(tokens, "tokens")?;
            let position = position.i32("position", 0)?;
            self.inner.decode(tokens, position, seq_id.i32("seq_id", 0)?)
        } => convert::none;

        /// Every live branch and the whole KV cache as bytes, after queued work: what
        /// `save_state` writes to a file (the same framing and checks), kept in memory.
        #[sync_doc = "returns the snapshot as bytes. Waits without the GIL; Ctrl-C cancels it \
                      all-or-nothing, as an await would, and raises KeyboardInterrupt."]
        fn snapshot / snapshot_sync(&self, py) -> Py<PyBytes> {
            convert::bytes_off_loop(self.inner.snapshot())
        } => Ok;

    }
}

// Not in `twins!`: the branches a cancelled restore made are pruned (`made.rs`).
#[pymethods]
impl PyContext {
    /// Return to a `snapshot` (or a `save_state` file's bytes): the bytes are checked
    /// first, and a corrupt, truncated or foreign snapshot raises StateFileError,
    /// changing nothing. Then every live branch is disposed (its handles raise
    /// BranchDisposedError), the whole KV cache is replaced, and the snapshot's branches
    /// come back as new Branch objects, each after its parent, on the sequences they had
    /// (an await cancelled after they came back prunes them: nobody holds them).
    fn restore<'py>(&self, py: Python<'py>, data: Arg<StateBytes>) -> PyResult<Bound<'py, PyAny>> {
        let pending = self.inner.restore(data.0);
        made::awaitable_branches(py, Call("Context", "restore"), pending)
    }

    /// Blocking twin of `restore`: returns the restored branches, each after its parent;
    /// StateFileError for a corrupt, truncated or foreign snapshot. Waits without the GIL;
    /// Ctrl-C cancels it all-or-nothing, as an await would, and raises KeyboardInterrupt.
    fn restore_sync(&self, py: Python<'_>, data: Arg<StateBytes>) -> PyResult<Vec<PyBranch>> {
        made::wait_branches(py, self.inner.restore(data.0))
    }
}

#[pymethods]
impl PyBranch {
    /// The context's last output for this branch's sequence becomes its logits snapshot
    /// (lloyal.node's `captureLogits()`): the logits a `ctx.decode` into the sequence left
    /// before this branch took it over. A branch that decoded since already holds that
    /// output (nothing changes). KvforkError when the sequence has no output at all.
    fn capture_logits(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.capture_logits()).py()
    }

    /// Release the handle and the KV lease but keep the cells (lloyal.node's `destroy()`:
    /// carry on with `ctx.decode` on `seq_id`, or take the cells over again with
    /// `Branch.create(ctx, position, params, seq_id=...)`). RESTRICT like `prune`:
    /// KvforkError while it has live children. `disposed` is True at once; a second call is
    /// a no-op.
    fn destroy(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.destroy()).py()
    }

    /// A new root branch on a fresh lease of `ctx` (any context of the same model), restored
    /// from `snapshot()` bytes (or a `save` file's): it continues exactly as the snapshot's
    /// branch would have. StateFileError for corrupt, truncated or foreign bytes.
    #[classmethod]
    fn restore<'py>(
        _cls: &Bound<'py, PyType>,
        py: Python<'py>,
        ctx: Arg<Bound<'py, PyContext>>,
        data: Arg<StateBytes>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let pending = kvfork::Branch::restore(&ctx.0.get().inner, data.0);
        made::awaitable_branch(py, Call("Branch", "restore"), pending)
    }

    /// Blocking twin of `restore`: returns the restored Branch; StateFileError for corrupt,
    /// truncated or foreign bytes. Waits without the GIL; Ctrl-C cancels it all-or-nothing,
    /// as an await would, and raises KeyboardInterrupt.
    #[classmethod]
    fn restore_sync(
        _cls: &Bound<'_, PyType>,
        py: Python<'_>,
        ctx: Arg<Bound<'_, PyContext>>,
        data: Arg<StateBytes>,
    ) -> PyResult<PyBranch> {
        let pending = kvfork::Branch::restore(&ctx.0.get().inner, data.0);
        made::wait_branch(py, pending)
    }
}

twins! {
    impl PyBranch {
        /// Decode `token` (an int or a Token) at the branch's position and capture its
        /// logits, without accepting it (penalties, grammar and perplexity untouched; the
        /// reference's `decodeAndCaptureOne`). A token `accept`ed just before is decoded by
        /// it (`accept` + this = `commit`). Cancelled, it either never ran or was aborted
        /// and rolled back.
        #[sync_doc = "returns None once the token is decoded. Waits without the GIL; Ctrl-C \
                      aborts and rolls it back, then raises KeyboardInterrupt."]
        fn decode_and_capture_one / decode_and_capture_one_sync(
            &self,
            py,
            token: &Bound<'_, PyAny>,
        ) -> Option<()> {
            self.inner.decode_and_capture_one(token_arg(token)?)
        } => convert::none;

        /// The branch as bytes, after queued work on it: what `save` writes to a file (its
        /// KV cells, position, history, sampler and RNG state, grammar, biases, metrics; the
        /// same framing and checks), kept in memory. `Branch.restore(ctx, data)` brings it
        /// back.
        #[sync_doc = "returns the snapshot as bytes. Waits without the GIL; Ctrl-C cancels it \
                      all-or-nothing, as an await would, and raises KeyboardInterrupt."]
        fn snapshot / snapshot_sync(&self, py) -> Py<PyBytes> {
            convert::bytes_off_loop(self.inner.snapshot())
        } => Ok;
    }
}
