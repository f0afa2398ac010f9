//! `Context`, `create_context` and `create_context_sync`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use pyo3::IntoPyObjectExt;

use crate::awaitable::{Call, OnCancel, Operation};
use crate::convert::{self, token_int, wait, Arg, Int};
use crate::embed;
use crate::errors::IntoPyResult;
use crate::handles::{PyBranch, PyContext};
use crate::made;
use crate::model::PyModel;
use crate::twins::twins;

/// What `create_context` was given: a model or a path to load.
enum ModelSource {
    Loaded(Arc<kvfork::Model>),
    Path(PathBuf),
}

struct Options {
    source: ModelSource,
    params: kvfork::ContextParams,
    n_gpu_layers: Option<i32>,
}

#[allow(clippy::too_many_arguments)]
fn options(
    path_or_model: &Bound<'_, PyAny>,
    n_ctx: Int,
    n_batch: Int,
    n_seq_max: Int,
    n_threads: Option<Int>,
    n_threads_batch: Option<Int>,
    type_k: Arg<&str>,
    type_v: Arg<&str>,
    embeddings: Arg<bool>,
    pooling: Option<Arg<&str>>,
    n_gpu_layers: Option<Int>,
    park: Arg<bool>,
    checkpoints: Int,
    checkpoint_bytes: Int,
    recurrent_rollback: Int,
    device_sampling: Arg<bool>,
) -> PyResult<Options> {
    let source = if let Ok(m) = path_or_model.cast::<PyModel>() {
        ModelSource::Loaded(m.get().inner.clone())
    } else {
        ModelSource::Path(path_or_model.extract::<PathBuf>().map_err(|_| {
            crate::errors::type_error("path_or_model must be a Model, str or os.PathLike")
        })?)
    };
    // The ranges `validate` checks, so that a value past the Rust type's names them too.
    let threads = |t: Int, name: &str| t.in_range(name, kvfork::N_THREADS_RANGE);
    let params = kvfork::ContextParams {
        n_ctx: n_ctx.in_range("n_ctx", kvfork::N_CTX_RANGE)?,
        n_batch: n_batch.in_range("n_batch", kvfork::N_BATCH_RANGE)?,
        n_seq_max: n_seq_max
            .in_range("n_seq_max", kvfork::ContextParams::n_seq_max_range(park.0))?,
        n_threads: n_threads.map(|t| threads(t, "n_threads")).transpose()?,
        n_threads_batch: n_threads_batch
            .map(|t| threads(t, "n_threads_batch"))
            .transpose()?,
        type_k: kvfork::CacheType::from_name(type_k.0).py()?,
        type_v: kvfork::CacheType::from_name(type_v.0).py()?,
        embeddings: embeddings.0,
        pooling: pooling
            .map(|p| kvfork::pooling_from_name(p.0))
            .transpose()
            .py()?,
        park: park.0,
        checkpoints: checkpoints.u32("checkpoints", 0)?,
        checkpoint_bytes: checkpoint_bytes.within("checkpoint_bytes", 0, i64::MAX)? as u64,
        recurrent_rollback: recurrent_rollback
            .in_range("recurrent_rollback", kvfork::RECURRENT_ROLLBACK_RANGE)?,
        device_sampling: device_sampling.0,
    };
    params.validate().py()?;
    let n_gpu_layers = n_gpu_layers
        .map(|n| n.in_range("n_gpu_layers", -1..=i32::MAX))
        .transpose()?;
    Ok(Options {
        source,
        params,
        n_gpu_layers,
    })
}

impl Options {
    /// The layers asked onto a GPU for a model this context loads (None for a loaded
    /// `Model`): once the context is built, `warn_if_no_gpu` as `Model.load` does.
    fn gpu_layers_asked(&self) -> Option<i32> {
        let loads = matches!(self.source, ModelSource::Path(_));
        self.n_gpu_layers.filter(|_| loads)
    }
}

fn build(o: Options) -> kvfork::Result<kvfork::Context> {
    let model = match o.source {
        ModelSource::Loaded(m) => m,
        ModelSource::Path(p) => kvfork::Model::load(
            &p,
            &kvfork::ModelParams {
                n_gpu_layers: o.n_gpu_layers,
                use_mmap: true,
            },
        )?,
    };
    kvfork::Context::new(model, o.params)
}

/// `create_context` and its blocking twin from one signature: the sixteen options read into
/// [`Options`] by `options`, then `$body` with them as `$o`.
macro_rules! context_creator {
    ($(#[doc = $doc:literal])* fn $name:ident<$py:lifetime>($pyv:ident) -> $ret:ty { |$o:ident| $body:expr }) => {
        $(#[doc = $doc])*
        #[pyfunction]
        #[pyo3(signature = (path_or_model, *, n_ctx=Int(Some(4096)), n_batch=Int(Some(512)),
                            n_seq_max=Int(Some(8)), n_threads=None, n_threads_batch=None,
                            type_k=Arg("f16"), type_v=Arg("f16"), embeddings=Arg(false),
                            pooling=None, n_gpu_layers=None, park=Arg(false),
                            checkpoints=Int(Some(16)), checkpoint_bytes=Int(Some(268435456)),
                            recurrent_rollback=Int(Some(0)), device_sampling=Arg(false)),
               // The defaults written out: pyo3 shows `Int(...)` defaults as `...`.
               text_signature = "(path_or_model, *, n_ctx=4096, n_batch=512, n_seq_max=8, \
                                 n_threads=None, n_threads_batch=None, type_k='f16', \
                                 type_v='f16', embeddings=False, pooling=None, \
                                 n_gpu_layers=None, park=False, checkpoints=16, \
                                 checkpoint_bytes=268435456, recurrent_rollback=0, \
                                 device_sampling=False)")]
        #[allow(clippy::too_many_arguments)]
        pub fn $name<$py>(
            $pyv: Python<$py>,
            path_or_model: &Bound<$py, PyAny>,
            n_ctx: Int,
            n_batch: Int,
            n_seq_max: Int,
            n_threads: Option<Int>,
            n_threads_batch: Option<Int>,
            type_k: Arg<&str>,
            type_v: Arg<&str>,
            embeddings: Arg<bool>,
            pooling: Option<Arg<&str>>,
            n_gpu_layers: Option<Int>,
            park: Arg<bool>,
            checkpoints: Int,
            checkpoint_bytes: Int,
            recurrent_rollback: Int,
            device_sampling: Arg<bool>,
        ) -> $ret {
            let $o = options(
                path_or_model,
                n_ctx,
                n_batch,
                n_seq_max,
                n_threads,
                n_threads_batch,
                type_k,
                type_v,
                embeddings,
                pooling,
                n_gpu_layers,
                park,
                checkpoints,
                checkpoint_bytes,
                recurrent_rollback,
                device_sampling,
            )?;
            $body
        }
    };
}

context_creator! {
    /// Create a context (async): loads the model if given a path, on a thread of its own (the
    /// event loop never waits). Cancelled before it finishes, it creates nothing: the context is
    /// freed as soon as it is built.
    fn create_context<'py>(py) -> PyResult<Bound<'py, PyAny>> {
        |o| {
            let asked = o.gpu_layers_asked();
            let pending = kvfork::Pending::spawn("kvfork-create", move || build(o));
            let call = Call("kvfork", "create_context");
            let op = Operation::new(call, pending, OnCancel::Detach, move |py, ctx| {
                let ctx = PyContext { inner: ctx };
                crate::model::warn_if_no_gpu(py, asked)?;
                ctx.into_py_any(py)
            });
            Bound::new(py, op).map(Bound::into_any)
        }
    }
}

context_creator! {
    /// Create a context (blocking twin of `create_context`).
    fn create_context_sync<'py>(py) -> PyResult<PyContext> {
        |o| {
            let asked = o.gpu_layers_asked();
            let pending = kvfork::Pending::spawn("kvfork-create", move || build(o));
            let ctx = PyContext {
                inner: wait(py, pending)?,
            };
            crate::model::warn_if_no_gpu(py, asked)?;
            Ok(ctx)
        }
    }
}

impl PyContext {
    fn open(&self) -> PyResult<&kvfork::Context> {
        if self.inner.is_closed() {
            return Err(crate::errors::KvforkError::new_err("the context is closed"));
        }
        Ok(&self.inner)
    }
}

#[pymethods]
impl PyContext {
    /// Contexts come from `create_context(...)` / `create_context_sync(...)`.
    #[new]
    #[pyo3(signature = (*_args, **_kwargs))]
    fn new(_args: &Bound<'_, PyAny>, _kwargs: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        Err(crate::errors::type_error(
            "kvfork.Context cannot be constructed directly: use \
             `await kvfork.create_context(path_or_model, ...)` or create_context_sync(...)",
        ))
    }

    // ---- what it is ----

    /// The Model this context runs (possibly shared with other contexts).
    #[getter]
    fn model(&self) -> PyModel {
        PyModel {
            inner: self.inner.model().clone(),
        }
    }

    /// Size of the unified KV cache in cells, shared by all branches (a shared prefix counts
    /// once); also the furthest position a branch can reach. llama.cpp rounds the `n_ctx`
    /// asked for up to a multiple of 256: this is the size it made (64 asked gives 256).
    #[getter]
    fn n_ctx(&self) -> u32 {
        self.inner.n_ctx()
    }

    /// Most tokens one llama_decode takes; longer prefills and wider commits are split into
    /// ceil(total / n_batch) decodes.
    #[getter]
    fn n_batch(&self) -> u32 {
        self.inner.n_batch()
    }

    /// Number of KV sequences (leases): how many branches can be live at once.
    #[getter]
    fn n_seq_max(&self) -> u32 {
        self.inner.n_seq_max()
    }

    /// Number of tokens in the model's vocabulary (the length of a logits row).
    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    /// True when the context samples on the device (`create_context(device_sampling=True)`):
    /// a branch's row is decoded again the first time it is read, and a grammar, logit bias
    /// or steer set before the decode whose output it samples spares that decode.
    #[getter]
    fn device_sampling(&self) -> bool {
        self.inner.device_sampling()
    }

    /// True once the context is closed (by `close`, leaving a `with` block, or an internal
    /// error); most calls then raise KvforkError.
    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_closed()
    }

    // ---- tokens ----

    /// Token ids of `text`, exactly as llama.cpp tokenizes it. `add_special` adds BOS etc. as
    /// the model asks; `parse_special` reads special-token text (e.g. "<|im_start|>") as those
    /// tokens. Raises KvforkError when the context is closed.
    #[pyo3(signature = (text, add_special=Arg(true), parse_special=Arg(false)),
           text_signature = "($self, text, add_special=True, parse_special=False)")]
    fn tokenize(
        &self,
        py: Python<'_>,
        text: Arg<&str>,
        add_special: Arg<bool>,
        parse_special: Arg<bool>,
    ) -> PyResult<Vec<i32>> {
        let ctx = self.open()?;
        py.detach(|| ctx.tokenize(text.0, add_special.0, parse_special.0))
            .py()
    }

    /// The text of `tokens`, as llama.cpp detokenizes it. `remove_special` drops the BOS/EOS the
    /// model adds; `unparse_special` renders special tokens as their text. Raises
    /// KvforkError when the context is closed, ValueError for a token id out of range.
    #[pyo3(signature = (tokens, *, remove_special=Arg(false), unparse_special=Arg(false)),
           text_signature = "($self, tokens, *, remove_special=False, unparse_special=False)")]
    fn detokenize(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        remove_special: Arg<bool>,
        unparse_special: Arg<bool>,
    ) -> PyResult<String> {
        let tokens = convert::tokens(tokens, "tokens")?;
        let ctx = self.open()?;
        py.detach(|| ctx.detokenize(&tokens, remove_special.0, unparse_special.0))
            .py()
    }

    /// The text piece of one token (special tokens rendered, invalid UTF-8 replaced). Raises
    /// KvforkError when the context is closed, ValueError for a token id out of range.
    fn token_to_text(&self, token: Int) -> PyResult<String> {
        self.open()?.token_to_text(token_int(&token)?).py()
    }

    /// The raw bytes of one token's piece (special tokens rendered): a piece may be part of a
    /// UTF-8 character, which `token_to_text` replaces. Raises KvforkError when the context is
    /// closed, ValueError for a token id out of range.
    fn token_to_bytes<'py>(&self, py: Python<'py>, token: Int) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = self
            .open()?
            .model()
            .token_to_bytes(token_int(&token)?, true)
            .py()?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// True when `token` ends generation in this vocabulary (EOS, end-of-turn and the other
    /// end-of-generation tokens). ValueError for a token id out of range.
    fn is_stop_token(&self, token: Int) -> PyResult<bool> {
        self.inner.is_stop_token(token_int(&token)?).py()
    }

    /// The model's end-of-sequence token id, or None if the vocabulary has none. Other tokens
    /// may also end generation (e.g. end-of-turn): test with `is_stop_token`.
    #[getter]
    fn eog_token(&self) -> Option<i32> {
        self.inner.model().eos()
    }

    /// The model's beginning-of-sequence token id, or None if the vocabulary has none.
    #[getter]
    fn bos_token(&self) -> Option<i32> {
        self.inner.model().bos()
    }

    // ---- raw KV operations ----

    /// Copy cells of `src` into `dst` (positions [p0, p1), -1 = open). Bypasses branch tenancy.
    /// Queued in order with all engine work; returns without waiting. On a recurrent or
    /// hybrid model only the whole sequence can be copied: a part is a ValueError.
    #[pyo3(signature = (src, dst, p0=Int(Some(0)), p1=Int(Some(-1))),
           text_signature = "($self, src, dst, p0=0, p1=-1)")]
    fn kv_seq_copy(&self, src: Int, dst: Int, p0: Int, p1: Int) -> PyResult<()> {
        let (src, dst) = (seq_arg(&src, "src")?, seq_arg(&dst, "dst")?);
        let (p0, p1) = range_arg(&p0, &p1)?;
        queued(self.open()?.kv_seq_copy(src, dst, p0, p1))
    }

    /// Remove every cell not of `seq`. Bypasses branch tenancy. Returns without waiting.
    fn kv_seq_keep(&self, seq: Int) -> PyResult<()> {
        queued(self.open()?.kv_seq_keep(seq_arg(&seq, "seq")?))
    }

    /// Remove the cells of `seq` in [p0, p1) (-1 = open). Returns False, removing nothing, when
    /// a partial removal is impossible (recurrent models). Returns without waiting.
    #[pyo3(signature = (seq, p0=Int(Some(0)), p1=Int(Some(-1))),
           text_signature = "($self, seq, p0=0, p1=-1)")]
    fn kv_seq_remove(&self, seq: Int, p0: Int, p1: Int) -> PyResult<bool> {
        let seq = seq_arg(&seq, "seq")?;
        let (p0, p1) = range_arg(&p0, &p1)?;
        let ctx = self.open()?;
        if !ctx.kv_can_remove(p0, p1) {
            return Ok(false);
        }
        queued(ctx.kv_seq_remove(seq, p0, p1)).map(|_| true)
    }

    /// Empty the whole KV cache. Bypasses branch tenancy. Returns without waiting.
    fn kv_clear(&self) -> PyResult<()> {
        queued(self.open()?.kv_clear())
    }

    // ---- embeddings ----

    /// Width of the vectors `embed` returns.
    #[getter]
    fn embedding_dim(&self) -> PyResult<usize> {
        Ok(self.open()?.embedding_dim())
    }

    /// Embedding of one text (str) or token list, as a float32 array of `embedding_dim`
    /// (shape `(n_tokens, embedding_dim)` on a context with pooling "none"). Needs a context
    /// created with `embeddings=True` and no live branches.
    #[pyo3(signature = (text_or_tokens, *, normalize=Arg(true)),
           text_signature = "($self, text_or_tokens, *, normalize=True)")]
    fn embed<'py>(
        &self,
        py: Python<'py>,
        text_or_tokens: &Bound<'py, PyAny>,
        normalize: Arg<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        embed::Request::one(self.open()?, text_or_tokens, normalize.0)?
            .awaitable(py, Call("Context", "embed"))
    }

    /// Blocking twin of `embed`: returns the float32 array. KvforkError on a context without
    /// `embeddings=True`. Waits without the GIL; Ctrl-C cancels it all-or-nothing, as an await
    /// would, and raises KeyboardInterrupt.
    #[pyo3(signature = (text_or_tokens, *, normalize=Arg(true)),
           text_signature = "($self, text_or_tokens, *, normalize=True)")]
    fn embed_sync<'py>(
        &self,
        py: Python<'py>,
        text_or_tokens: &Bound<'py, PyAny>,
        normalize: Arg<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        embed::Request::one(self.open()?, text_or_tokens, normalize.0)?.wait(py)
    }

    /// Embeddings of many texts (str or token lists), shape `(len(texts), embedding_dim)`,
    /// packed into as few decodes as fit (one text per sequence, each text whole in a batch).
    #[pyo3(signature = (texts, *, normalize=Arg(true)),
           text_signature = "($self, texts, *, normalize=True)")]
    fn embed_batch<'py>(
        &self,
        py: Python<'py>,
        texts: &Bound<'py, PyAny>,
        normalize: Arg<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        embed::Request::many(self.open()?, texts, normalize.0)?
            .awaitable(py, Call("Context", "embed_batch"))
    }

    /// Blocking twin of `embed_batch`: returns a float32 array of shape
    /// `(len(texts), embedding_dim)`. Waits without the GIL; Ctrl-C cancels it all-or-nothing,
    /// as an await would, and raises KeyboardInterrupt.
    #[pyo3(signature = (texts, *, normalize=Arg(true)),
           text_signature = "($self, texts, *, normalize=True)")]
    fn embed_batch_sync<'py>(
        &self,
        py: Python<'py>,
        texts: &Bound<'py, PyAny>,
        normalize: Arg<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        embed::Request::many(self.open()?, texts, normalize.0)?.wait(py)
    }

    // ---- chat templates ----

    /// Render `messages` (OpenAI-style dicts: role, content, optional tool_calls /
    /// tool_call_id) with the model's own chat template (GGUF `tokenizer.chat_template`, as
    /// Hugging Face's `apply_chat_template` renders it), or with `template`: a Jinja string or
    /// a llama.cpp built-in name such as "chatml". Extra keyword arguments become template
    /// variables. Raises ChatTemplateError for a bad message, a template error, or a model
    /// without a template when none is given.
    #[pyo3(signature = (messages, *, add_generation_prompt=Arg(true), tools=None, template=None, **kwargs),
           text_signature = "($self, messages, *, add_generation_prompt=True, tools=None, template=None, **kwargs)")]
    fn format_chat(
        &self,
        py: Python<'_>,
        messages: &Bound<'_, PyAny>,
        add_generation_prompt: Arg<bool>,
        tools: Option<&Bound<'_, PyAny>>,
        template: Option<Arg<String>>,
        kwargs: Option<&Bound<'_, pyo3::types::PyDict>>,
    ) -> PyResult<crate::chat::PyFormattedChat> {
        let messages = crate::chat::json(messages, "messages")?;
        let tools = tools
            .filter(|t| !t.is_none())
            .map(|t| crate::chat::json(t, "tools"))
            .transpose()?;
        let extra = kwargs
            .map(|k| crate::chat::json(k.as_any(), "kwargs"))
            .transpose()?;
        let model = self.open()?.model().clone();
        let formatted = py
            .detach(|| {
                kvfork::format_chat(
                    &model,
                    &messages,
                    add_generation_prompt.0,
                    tools.as_ref(),
                    template.as_ref().map(|t| t.0.as_str()),
                    extra.as_ref(),
                )
            })
            .py()?;
        Ok(formatted.into())
    }

    // ---- the engine: threads, counters, life ----

    /// Make the engine thread panic (tests of the panic path only).
    fn _debug_panic(&self, py: Python<'_>) -> PyResult<()> {
        wait(py, self.open()?.debug_panic())
    }

    /// Threads single-token decodes use now. Unless `create_context` fixed `n_threads`, the
    /// count adapts to the machine's load: it drops while other processes take the cores
    /// (busy-waiting threads would only slow each other down) and comes back when they leave.
    #[getter]
    fn n_threads(&self) -> i32 {
        self.inner.n_threads()
    }

    /// Threads multi-token decodes (prefills, batched steps) use now; adapts like
    /// `n_threads` unless `create_context` fixed `n_threads_batch`.
    #[getter]
    fn n_threads_batch(&self) -> i32 {
        self.inner.n_threads_batch()
    }

    /// Counters since the context was created:
    /// - `decode_calls`: `llama_decode` invocations (one per BranchStore step or coalesced
    ///   group of commits, ceil(tokens / n_batch) per prefill, one per embed group);
    /// - `decoded_tokens`: tokens those decodes wrote (failed decodes not counted);
    /// - `decode_seconds`: wall time spent in `llama_decode` (on a GPU, until its outputs
    ///   are ready);
    /// - `padded_rows`: rows added to decodes (their logits unread) so that the outputs fill
    ///   whole tiles of the CPU's output matmul, where that is cheaper (x86 with AVX-512 and
    ///   Q8_0/Q4_0/Q5_0/IQ4_NL output weights; `KVFORK_NO_OUTPUT_PADDING` turns it off);
    /// - `scratch_tokens`: tokens of new prompts prefilled in a scratch context that holds
    ///   only them (a busy cache slows every prefill decode; `KVFORK_NO_SCRATCH_PREFILL`
    ///   turns it off), then moved into the cache;
    /// - `mixed_decodes`: decodes that held the next chunk of prompts being prefilled and
    ///   one token of each stream stepping meanwhile (continuous prefill;
    ///   `KVFORK_NO_CONTINUOUS_PREFILL` turns it off);
    /// - `commit_requests`: commit requests served — each `commit` or generation step, and
    ///   each `store.commit` / `store.step` (one request for all its branches); concurrent
    ///   requests coalesced into one decode each count;
    /// - `commit_seconds`: wall time the engine thread spent on groups of those requests,
    ///   their decodes included: with `decode_seconds`, the engine's own time per step, and
    ///   what a caller's step takes besides (the hand-over to the engine thread and back,
    ///   Python). A step replies once its decode is queued, and the engine then waits for
    ///   the decode's rows and reads them while the caller goes on (a row read waits for
    ///   them; `KVFORK_LAND_BEFORE_REPLY` reads them first): that part is counted, in both
    ///   counters, when it ends, so stats read right after a step may not hold it yet;
    /// - `parked_branches`, `parked_bytes`: branches parked in host memory now and the bytes
    ///   of KV cells they hold there (`park=True` contexts; 0 otherwise);
    /// - `parks`, `unparks`: times a branch was moved to host memory and brought back;
    /// - `checkpoints`, `checkpoint_bytes`: recurrent-state checkpoints the live branches
    ///   hold now and their bytes in host memory (recurrent and hybrid models; 0 otherwise);
    /// - `checkpoints_taken`, `checkpoint_bytes_taken`: checkpoints taken so far (at the end
    ///   of each prefill decode and before a speculative guess) and their bytes;
    ///   `checkpoint_seconds`: time spent copying them out;
    /// - `checkpoint_restores`: checkpoints put back (a fork inside a sequence, a rejected
    ///   guess, a rolled-back decode); `replayed_tokens`: tokens decoded again after them.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let s = self.inner.stats();
        let mut d: BTreeMap<&str, Py<PyAny>> = BTreeMap::new();
        d.insert("decode_calls", s.decode_calls.into_py_any(py)?);
        d.insert("decoded_tokens", s.decoded_tokens.into_py_any(py)?);
        d.insert(
            "decode_seconds",
            (s.decode_ns as f64 / 1e9).into_py_any(py)?,
        );
        d.insert("padded_rows", s.padded_rows.into_py_any(py)?);
        d.insert("scratch_tokens", s.scratch_tokens.into_py_any(py)?);
        d.insert("mixed_decodes", s.mixed_decodes.into_py_any(py)?);
        d.insert("commit_requests", s.commit_requests.into_py_any(py)?);
        d.insert(
            "commit_seconds",
            (s.commit_ns as f64 / 1e9).into_py_any(py)?,
        );
        d.insert("parked_branches", s.parked_branches.into_py_any(py)?);
        d.insert("parked_bytes", s.parked_bytes.into_py_any(py)?);
        d.insert("checkpoints", s.checkpoints.into_py_any(py)?);
        d.insert("checkpoint_bytes", s.checkpoint_bytes.into_py_any(py)?);
        d.insert("checkpoints_taken", s.checkpoints_taken.into_py_any(py)?);
        d.insert(
            "checkpoint_bytes_taken",
            s.checkpoint_bytes_taken.into_py_any(py)?,
        );
        d.insert(
            "checkpoint_restores",
            s.checkpoint_restores.into_py_any(py)?,
        );
        d.insert(
            "checkpoint_seconds",
            (s.checkpoint_ns as f64 / 1e9).into_py_any(py)?,
        );
        d.insert("replayed_tokens", s.replayed_tokens.into_py_any(py)?);
        d.insert("parks", s.parks.into_py_any(py)?);
        d.insert("unparks", s.unparks.into_py_any(py)?);
        d.into_bound_py_any(py)
    }

    /// Free the context (after queued work). Idempotent; later use raises KvforkError.
    fn close(&self, py: Python<'_>) {
        py.detach(|| self.inner.close());
    }

    /// A closed context is refused here, not at its first call inside the block.
    fn __enter__(slf: Bound<'_, Self>) -> PyResult<Bound<'_, Self>> {
        slf.get().open()?;
        Ok(slf)
    }

    #[pyo3(signature = (_exc_type=None, _exc=None, _tb=None))]
    fn __exit__(
        &self,
        py: Python<'_>,
        _exc_type: Option<&Bound<'_, PyAny>>,
        _exc: Option<&Bound<'_, PyAny>>,
        _tb: Option<&Bound<'_, PyAny>>,
    ) -> bool {
        self.close(py);
        false
    }

    fn __aenter__<'py>(slf: Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        slf.get().open()?;
        let py = slf.py();
        let me: Py<Self> = slf.unbind();
        crate::awaitable::Ready::new(me.into_any()).into_bound_py_any(py)
    }

    #[pyo3(signature = (_exc_type=None, _exc=None, _tb=None))]
    fn __aexit__<'py>(
        &self,
        py: Python<'py>,
        _exc_type: Option<Py<PyAny>>,
        _exc: Option<Py<PyAny>>,
        _tb: Option<Py<PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let ctx = self.inner.clone();
        let closing = kvfork::Pending::spawn("kvfork-close", move || {
            ctx.close();
            Ok(())
        });
        convert::awaitable(py, Call("Context", "__aexit__"), closing, |()| Ok(false))
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "Context(model={}, n_ctx={}, n_seq_max={}, closed={})",
            crate::convert::py_repr(py, self.inner.model().name())?,
            self.inner.n_ctx(),
            self.inner.n_seq_max(),
            if self.inner.is_closed() {
                "True"
            } else {
                "False"
            }
        ))
    }
}

// The calls with a blocking twin: a raw KV read, saving and loading the whole context.
twins! {
    impl PyContext {
        /// Largest position stored for `seq` (-1 when empty), after all queued work.
        #[sync_doc = "returns the position. Waits without the GIL; Ctrl-C cancels it \
                      all-or-nothing and raises KeyboardInterrupt."]
        fn kv_seq_pos_max / kv_seq_pos_max_sync(&self, py, seq: Int) -> i32 {
            let seq = seq_arg(&seq, "seq")?;
            self.open()?.kv_seq_pos_max(seq)
        } => Ok;

        /// Save every live branch (its record and tree links) and the whole KV cache to
        /// `path`, after queued work. Shared prefixes are stored once.
        #[sync_doc = "returns None once the file is written. Waits without the GIL; Ctrl-C \
                      cancels it all-or-nothing, as an await would, and raises \
                      KeyboardInterrupt."]
        fn save_state / save_state_sync(&self, py, path: Arg<PathBuf>) -> Option<()> {
            self.open()?.save_state(path.0)
        } => convert::none;

    }
}

// Not in `twins!`: the branches a cancelled load made are pruned (`made.rs`).
#[pymethods]
impl PyContext {
    /// Restore a `save_state` file into this context, which must have no live branch; the
    /// model must be the same. Returns the restored branches, each after its parent (an await
    /// cancelled after they came back prunes them: nobody holds them).
    /// A corrupt, truncated or foreign file raises StateFileError.
    fn load_state<'py>(&self, py: Python<'py>, path: Arg<PathBuf>) -> PyResult<Bound<'py, PyAny>> {
        let pending = self.open()?.load_state(path.0);
        made::awaitable_branches(py, Call("Context", "load_state"), pending)
    }

    /// Blocking twin of `load_state`: returns the restored branches, each after its parent;
    /// StateFileError for a corrupt, truncated or foreign file. Waits without the GIL; Ctrl-C
    /// cancels it all-or-nothing, as an await would, and raises KeyboardInterrupt.
    fn load_state_sync(&self, py: Python<'_>, path: Arg<PathBuf>) -> PyResult<Vec<PyBranch>> {
        made::wait_branches(py, self.open()?.load_state(path.0))
    }
}

/// A sequence id argument (range against n_seq_max is checked by the engine call).
fn seq_arg(v: &Int, name: &str) -> PyResult<i32> {
    v.i32(name, 0)
}

/// A position argument: >= 0, or -1 for "open".
fn pos_arg(v: &Int, name: &str) -> PyResult<i32> {
    v.i32(name, -1)
}

/// Positions [p0, p1) of a raw KV call (-1: open at that end); refused backwards (it did
/// nothing, and said nothing).
fn range_arg(p0: &Int, p1: &Int) -> PyResult<(i32, i32)> {
    let (p0, p1) = (pos_arg(p0, "p0")?, pos_arg(p1, "p1")?);
    if p1 >= 0 && p0 > p1 {
        return Err(PyValueError::new_err(format!(
            "p0 ({p0}) is after p1 ({p1}): the positions are [p0, p1)"
        )));
    }
    Ok((p0, p1))
}

/// A queued job nobody waits for: report an error found before queuing, else let it run.
fn queued<T>(pending: kvfork::Pending<T>) -> PyResult<()> {
    if pending.is_ready() {
        pending.wait().py()?;
    }
    Ok(())
}
