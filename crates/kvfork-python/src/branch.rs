//! `Branch`: one decode sequence with its own sampler, grammar, biases and metrics.

use std::path::PathBuf;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBool, PyDict, PyString, PyType};
use pyo3::IntoPyObjectExt;

use crate::adapter::{lora_set, PyControlVector, PyLoraAdapter};
use crate::awaitable::Call;
use crate::convert::token_int;
use crate::convert::{self, draft_tokens, wait, Arg, Int};
use crate::errors::IntoPyResult;
use crate::generate::{PyGenerator, PyGeneratorSync};
use crate::handles::{wrap, PyBranch, PyContext};
use crate::made;
use crate::params;
use crate::scores;
use crate::token::PyToken;
use crate::twins::twins;

pub(crate) fn log_base(base: &str) -> PyResult<kvfork::LogBase> {
    kvfork::LogBase::from_name(base).ok_or_else(|| {
        PyValueError::new_err(format!("base must be 'nats' or 'bits', not {base:?}"))
    })
}

/// A token argument: an int id or a `Token`.
pub fn token_arg(obj: &Bound<'_, PyAny>) -> PyResult<i32> {
    if let Ok(t) = obj.cast::<PyToken>() {
        return Ok(t.get().token);
    }
    let id: Int = obj.extract().map_err(|_| {
        crate::errors::type_error(format!(
            "token must be an int or a kvfork.Token, got {}",
            obj.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ))
    })?;
    token_int(&id)
}

/// `max_tokens`: None (no limit) or an int >= 0.
fn max_count(max_tokens: Option<Int>) -> PyResult<Option<usize>> {
    max_tokens
        .map(|m| m.within("max_tokens", 0, i64::MAX).map(|m| m as usize))
        .transpose()
}

impl PyBranch {
    /// `fork`'s arguments checked and its work queued.
    fn fork_pending(
        &self,
        seed: Option<Int>,
        seq_id: Option<Int>,
    ) -> PyResult<kvfork::Pending<kvfork::Branch>> {
        let seed = seed.map(|s| s.u32("seed", 0)).transpose()?;
        let seq_id = seq_id.map(|s| s.i32("seq_id", 0)).transpose()?;
        Ok(self.inner.fork_on(seed, seq_id))
    }

    fn pruning(&self, keep_children: bool) -> kvfork::Pending<()> {
        if keep_children {
            self.inner.prune_keep_children()
        } else {
            self.inner.prune()
        }
    }
}

#[pymethods]
impl PyBranch {
    /// Branches come from `Branch.create(ctx, ...)` or `branch.fork()`.
    #[new]
    #[pyo3(signature = (*_args, **_kwargs))]
    fn new(_args: &Bound<'_, PyAny>, _kwargs: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        Err(crate::errors::type_error(
            "kvfork.Branch cannot be constructed directly: use Branch.create(ctx, position, params) \
             or branch.fork()",
        ))
    }

    /// A new root branch on a fresh KV lease. At position 0 (the usual start: prefill the
    /// prompt next) it is cheap and non-blocking: no decode, and no wait for the engine
    /// (emptying the lease is queued ahead of the branch's own work).
    ///
    /// Past 0 or with `seq_id` it takes cells over (the raw layer: after
    /// `await ctx.decode(prompt, 0, seq)`), waiting without the GIL for the engine to check
    /// them after queued work. `seq_id` leases that very sequence, whose cells must end at
    /// `position - 1` (ValueError otherwise; LeaseExhaustedError when a branch holds it).
    /// Without `seq_id` the lowest free lease is taken, its cells kept when they end at
    /// `position - 1`, else emptied with a KvforkWarning (nothing would be behind the
    /// branch). LeaseExhaustedError when all `n_seq_max` leases are taken; ValueError for a
    /// bad argument. A blank `grammar` means none.
    #[classmethod]
    #[pyo3(signature = (ctx, position=Int(Some(0)), params=None, *, grammar=None, seq_id=None),
           text_signature = "($cls, ctx, position=0, params=None, *, grammar=None, seq_id=None)")]
    fn create(
        _cls: &Bound<'_, PyType>,
        ctx: Arg<Bound<'_, PyContext>>,
        position: Int,
        params: Option<&Bound<'_, PyAny>>,
        grammar: Option<Arg<String>>,
        seq_id: Option<Int>,
    ) -> PyResult<Self> {
        let position = position.i32("position", 0)?;
        let seq_id = seq_id.map(|s| s.i32("seq_id", 0)).transpose()?;
        let params = params::extract(params)?;
        let grammar = grammar.map(|Arg(gbnf)| kvfork::GrammarSpec::Eager { gbnf });
        let ctx = ctx.0;
        if position == 0 && seq_id.is_none() {
            let branch =
                kvfork::Branch::create(&ctx.get().inner, position, &params, grammar).py()?;
            return Ok(wrap(branch));
        }
        let py = ctx.py();
        let over =
            kvfork::Branch::create_over(&ctx.get().inner, position, &params, grammar, seq_id);
        let created = wait(py, over)?;
        if position > 0 && !created.kept_cells {
            warn_nothing_behind(py, position)?;
        }
        Ok(wrap(created.branch))
    }

    // ---- sampling and accepting by hand ----

    /// Sample a token id (low level: no state change but the sampler RNG).
    fn sample(&self, py: Python<'_>) -> PyResult<i32> {
        py.detach(|| self.inner.sample()).py()
    }

    /// Accept a token into penalties, grammar and perplexity without decoding it (low level).
    fn accept(&self, py: Python<'_>, token: &Bound<'_, PyAny>) -> PyResult<()> {
        let token = token_arg(token)?;
        py.detach(|| self.inner.accept(token)).py()
    }

    /// The tokens decoded into the branch's sequence since it was created (or reseeded):
    /// prefills and commits in order, a fork's starting with its parent's. Saved by `save`.
    #[getter]
    fn history(&self) -> PyResult<Vec<i32>> {
        self.inner.history().py()
    }

    // ---- generation ----

    /// Async iterator of Tokens: commit-before-yield, ends at a stop token (not committed).
    /// Each step samples and commits on the engine thread (steps of concurrent tasks share
    /// decodes). A cancelled step either never ran or completed (committed, not yielded).
    /// With `draft` (e.g. `kvfork.PromptLookup()`, or any object with
    /// `propose(tokens) -> list[int]`): exact speculative decoding, the same tokens drawn more
    /// decodes at a time (see `kvfork.SpeculativeStream`). At the end of the context the
    /// stream stops (`on_context_full="stop"`, stop_reason "context_full") or shifts the
    /// context and goes on (`"shift"`, as llama.cpp's --context-shift: the first `keep`
    /// tokens of the branch's sequence and the most recent half of the rest are kept;
    /// `stream.shifts` counts the shifts). The end of the context is the branch's position
    /// reaching n_ctx: cells other branches hold fill the same cache, so with neighbours a
    /// step may raise KvCacheFullError first (the branch as it was: free cells, or call
    /// `shift_context`, and go on).
    #[pyo3(signature = (max_tokens=None, *, draft=None, on_context_full="stop", keep=Int(Some(4))),
           text_signature = "($self, max_tokens=None, *, draft=None, on_context_full='stop', keep=4)")]
    fn generate(
        slf: &Bound<'_, Self>,
        max_tokens: Option<Int>,
        draft: Option<Bound<'_, PyAny>>,
        on_context_full: &str,
        keep: Int,
    ) -> PyResult<Py<PyAny>> {
        let limit = max_count(max_tokens)?;
        let on_full = on_full(&slf.get().inner, on_context_full, keep)?;
        match draft {
            Some(draft) => speculative_stream(slf, false, limit, draft, on_context_full, on_full),
            None => {
                PyGenerator::new(slf.get().inner.clone(), limit, on_full)?.into_py_any(slf.py())
            }
        }
    }

    /// Blocking twin of `generate`: a TokenStreamSync for `for tok in b.generate_sync(...)`.
    /// Each step waits without the GIL; on Ctrl-C a started step completes (its token is
    /// committed, not yielded), then KeyboardInterrupt is raised.
    #[pyo3(signature = (max_tokens=None, *, draft=None, on_context_full="stop", keep=Int(Some(4))),
           text_signature = "($self, max_tokens=None, *, draft=None, on_context_full='stop', keep=4)")]
    fn generate_sync(
        slf: &Bound<'_, Self>,
        max_tokens: Option<Int>,
        draft: Option<Bound<'_, PyAny>>,
        on_context_full: &str,
        keep: Int,
    ) -> PyResult<Py<PyAny>> {
        let limit = max_count(max_tokens)?;
        let on_full = on_full(&slf.get().inner, on_context_full, keep)?;
        match draft {
            Some(draft) => speculative_stream(slf, true, limit, draft, on_context_full, on_full),
            None => {
                PyGeneratorSync::new(slf.get().inner.clone(), limit, on_full)?.into_py_any(slf.py())
            }
        }
    }

    fn __aiter__(&self) -> PyResult<PyGenerator> {
        PyGenerator::new(self.inner.clone(), None, kvfork::OnContextFull::Stop)
    }

    // ---- loading a saved branch ----

    /// A new root branch on a fresh lease of `ctx` (any context of the same model), restored
    /// from a file `save` wrote; it continues exactly as the saved branch would have.
    /// A corrupt, truncated or foreign file raises StateFileError.
    #[classmethod]
    fn load<'py>(
        _cls: &Bound<'py, PyType>,
        py: Python<'py>,
        ctx: Arg<Bound<'py, PyContext>>,
        path: Arg<PathBuf>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let pending = kvfork::Branch::load(&ctx.0.get().inner, path.0);
        made::awaitable_branch(py, Call("Branch", "load"), pending)
    }

    /// Blocking twin of `load`: returns the restored Branch; StateFileError for a corrupt,
    /// truncated or foreign file. Waits without the GIL; Ctrl-C cancels it all-or-nothing, as
    /// an await would, and raises KeyboardInterrupt.
    #[classmethod]
    fn load_sync(
        _cls: &Bound<'_, PyType>,
        py: Python<'_>,
        ctx: Arg<Bound<'_, PyContext>>,
        path: Arg<PathBuf>,
    ) -> PyResult<Self> {
        made::wait_branch(py, kvfork::Branch::load(&ctx.0.get().inner, path.0))
    }

    // ---- forks ----

    /// A child on a new lease sharing the whole KV prefix; clones sampler (with RNG),
    /// grammar, perplexity, logits and logit bias; not steer. Cancelled, it either never
    /// ran (no lease taken) or the child it made is pruned (nobody holds it).
    ///
    /// Without `seed` the child samples exactly like its parent until reseeded: forks made
    /// for diversity need `seed=` (or `reseed_sampler`). LeaseExhaustedError when no lease
    /// is free. `seq_id` (lloyal.node's `fork(newSeqId)`) puts the child on that very
    /// sequence: LeaseExhaustedError when a branch holds it; cells it held are replaced.
    #[pyo3(signature = (*, seed=None, seq_id=None))]
    fn fork<'py>(
        &self,
        py: Python<'py>,
        seed: Option<Int>,
        seq_id: Option<Int>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let pending = self.fork_pending(seed, seq_id)?;
        made::awaitable_branch(py, Call("Branch", "fork"), pending)
    }

    /// Blocking twin of `fork`: returns the child Branch; LeaseExhaustedError when no lease
    /// is free. Waits without the GIL; on Ctrl-C a fork made is pruned, and
    /// KeyboardInterrupt is raised.
    #[pyo3(signature = (*, seed=None, seq_id=None))]
    fn fork_sync(&self, py: Python<'_>, seed: Option<Int>, seq_id: Option<Int>) -> PyResult<Self> {
        made::wait_branch(py, self.fork_pending(seed, seq_id)?)
    }

    // ---- tree and state ----

    /// The Branch this one was forked from, or None for a root (and for a disposed branch).
    #[getter]
    fn parent(&self) -> Option<Self> {
        self.inner.parent().map(wrap)
    }

    /// The live branches forked from this one, as a list (empty for a leaf or a disposed
    /// branch).
    #[getter]
    fn children(&self) -> Vec<Self> {
        self.inner.children().into_iter().map(wrap).collect()
    }

    /// True when the branch has no live children (also True once it is disposed).
    #[getter]
    fn is_leaf(&self) -> bool {
        self.inner.is_leaf()
    }

    /// True while the branch holds its KV lease; False once it is pruned or its context closed.
    #[getter]
    fn is_active(&self) -> bool {
        self.inner.is_active()
    }

    /// True once the branch is disposed (by `prune`, `prune_subtree`, `retain_only` or the
    /// context's `close`, or this handle by `PrefixCache.release`), from the moment the call
    /// is made; any use then raises BranchDisposedError (KvforkError "the context is closed"
    /// after a close).
    #[getter]
    fn disposed(&self) -> bool {
        self.inner.disposed()
    }

    /// The position at which this branch was forked from its parent (0 for a root).
    /// Raises BranchDisposedError once the branch is pruned.
    #[getter]
    fn fork_head(&self) -> PyResult<u32> {
        self.inner.fork_head().py()
    }

    /// The context the branch lives in (a handle to the same context as the one it was made
    /// with).
    #[getter]
    fn context(&self) -> PyContext {
        PyContext {
            inner: self.inner.context().clone(),
        }
    }

    /// Tokens in the branch's KV sequence: the position its next token is decoded at (the
    /// `position` it was created at, before any prefill). Raises BranchDisposedError once pruned.
    #[getter]
    fn position(&self) -> PyResult<i32> {
        self.inner.position().py()
    }

    /// A stable integer id (index and generation of the branch's slot).
    #[getter]
    fn handle(&self) -> u64 {
        self.inner.handle().to_u64()
    }

    /// The KV sequence id leased by this branch.
    #[getter]
    fn seq_id(&self) -> PyResult<i32> {
        self.inner.seq_id().py()
    }

    /// The branch's current SamplingParams (from `create` or the last `set_sampler_params`).
    /// Raises BranchDisposedError once pruned.
    #[getter]
    fn params(&self) -> PyResult<crate::params::PySamplingParams> {
        Ok(crate::params::PySamplingParams {
            inner: self.inner.sampler_params().py()?,
        })
    }

    // ---- sampler, constraints, adapters, biases ----

    /// Restart the sampler's RNG stream from `seed` (an int in [0, 2**32)), keeping the params,
    /// penalty/DRY history and Mirostat state. Forks sample like their parent until reseeded.
    /// ValueError for a seed out of range.
    fn reseed_sampler(&self, seed: Int) -> PyResult<()> {
        self.inner.reseed_sampler(seed.u32("seed", 0)?).py()
    }

    /// Rebuild the sampler chain from `params` (a SamplingParams or a dict); a no-op when equal.
    /// The RNG stream, penalty/DRY history and Mirostat state carry on, unless `params` names a
    /// new seed. ValueError (naming the field) for a bad value.
    fn set_sampler_params(&self, params: &Bound<'_, PyAny>) -> PyResult<()> {
        let params = params::extract(Some(params))?;
        self.inner.set_sampler_params(&params).py()
    }

    /// Replace the GBNF grammar, or remove it with None or "" (a blank grammar, as the
    /// reference's `setGrammar("")`).
    #[pyo3(signature = (gbnf))]
    fn set_grammar(&self, gbnf: Option<Arg<String>>) -> PyResult<()> {
        self.inner
            .set_grammar(gbnf.map(|Arg(gbnf)| kvfork::GrammarSpec::Eager { gbnf }))
            .py()
    }

    /// Constrain the output to a JSON schema (a dict, or its JSON text), through llguidance:
    /// the same slot as `set_grammar` (one constraint at a time), cloned on fork. The first
    /// use on a model indexes its vocabulary (a fraction of a second, once).
    fn set_json_schema(&self, py: Python<'_>, schema: &Bound<'_, PyAny>) -> PyResult<()> {
        let schema = match schema.extract::<String>() {
            Ok(text) => text,
            Err(_) => py
                .import("json")?
                .call_method1("dumps", (schema,))?
                .extract::<String>()?,
        };
        self.set_constraint(py, kvfork::GrammarSpec::JsonSchema { schema })
    }

    /// Constrain the whole output to match a regular expression (Rust `regex` syntax), through
    /// llguidance; the same slot as `set_grammar`.
    fn set_regex(&self, py: Python<'_>, pattern: Arg<String>) -> PyResult<()> {
        let Arg(pattern) = pattern;
        self.set_constraint(py, kvfork::GrammarSpec::Regex { pattern })
    }

    /// Constrain the output to a grammar in llguidance's Lark syntax (`start` is the root
    /// rule; `%json {...}` embeds a JSON schema); the same slot as `set_grammar`.
    fn set_lark(&self, py: Python<'_>, grammar: Arg<String>) -> PyResult<()> {
        let Arg(grammar) = grammar;
        self.set_constraint(py, kvfork::GrammarSpec::Lark { grammar })
    }

    /// Grammar that stays inactive until a trigger fires. `triggers`: strings are trigger
    /// words, ints are token ids; `patterns`: regexes searched in the output since the grammar
    /// was set, the grammar starting at the first non-empty capture group (else at the match),
    /// as llama.cpp's lazy grammars (words first, then patterns: the first that matches
    /// fires). Patterns are in Rust `regex` syntax (Unicode-aware; no look-around or
    /// back-references: GrammarError; an empty word too); after each token all are searched
    /// in one pass over the output since the grammar was set (time linear in it, so a long
    /// wait costs more per token). A token whose text would fire a trigger on text the
    /// grammar refuses is never drawn (masked, as an active grammar masks the tokens it
    /// refuses).
    #[pyo3(signature = (gbnf, triggers, *, patterns=None))]
    fn set_grammar_lazy(
        &self,
        gbnf: Arg<String>,
        triggers: &Bound<'_, PyAny>,
        patterns: Option<Arg<Vec<String>>>,
    ) -> PyResult<()> {
        let (Arg(gbnf), patterns) = (gbnf, patterns.map(|p| p.0));
        if triggers.is_instance_of::<PyString>() {
            // Iterated, it was one trigger per character.
            return Err(crate::errors::type_error(
                "triggers is a list of words and token ids, not a str: [word] for one word",
            ));
        }
        let (mut words, mut tokens) = (Vec::new(), Vec::new());
        for t in triggers.try_iter()? {
            let t = t?;
            if t.is_instance_of::<PyBool>() {
                return Err(crate::errors::type_error(
                    "triggers must be strings (words) or ints (token ids), not bool",
                ));
            }
            if let Ok(w) = t.extract::<String>() {
                words.push(w);
            } else {
                tokens.push(token_int(&t.extract::<Int>().map_err(|_| {
                    crate::errors::type_error(
                        "triggers must be strings (words) or ints (token ids)",
                    )
                })?)?);
            }
        }
        let spec = kvfork::GrammarSpec::Lazy {
            gbnf,
            words,
            patterns: patterns.unwrap_or_default(),
            tokens,
        };
        self.inner.set_grammar(Some(spec)).py()
    }

    /// Decode under these LoRA adapters from now on: `{adapter: scale}` replaces the set
    /// (scale 0 is the same as leaving the adapter out). Inherited on fork. A commit or step
    /// over branches with different sets decodes one group per distinct set.
    fn set_adapters(&self, adapters: &Bound<'_, PyAny>) -> PyResult<()> {
        self.inner.set_adapters(lora_set(adapters)?).py()
    }

    /// Back to the base model: no LoRA adapter and no control vector (for this branch and the
    /// forks made after).
    fn clear_adapters(&self) -> PyResult<()> {
        self.inner.clear_adapters().py()
    }

    /// `{adapter: scale}` of the LoRA adapters this branch decodes under.
    #[getter]
    fn adapters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for (a, scale) in self.inner.adapters().py()?.loras() {
            out.set_item(PyLoraAdapter { inner: a.clone() }, *scale)?;
        }
        Ok(out)
    }

    /// Add `cv` × `scale` to the outputs of the rows `layers = (start, end)` (0-based, end
    /// exclusive; all when None) from now on; `cv=None` removes the control vector.
    /// Inherited on fork; grouped like adapters.
    #[pyo3(signature = (cv, scale=Arg(1.0), layers=None),
           text_signature = "($self, cv, scale=1.0, layers=None)")]
    fn set_control_vector(
        &self,
        cv: Option<PyRef<'_, PyControlVector>>,
        scale: Arg<f32>,
        layers: Option<Arg<(Int, Int)>>,
    ) -> PyResult<()> {
        let layers = match layers {
            None => None,
            Some(Arg((start, end))) => Some((start.u32("layers", 0)?, end.u32("layers", 0)?)),
        };
        self.inner
            .set_control_vector(cv.map(|c| c.inner.clone()), scale.0, layers)
            .py()
    }

    /// Static biases {token: bias} added to the logits (-inf bans); inherited on fork.
    fn set_logit_bias(&self, bias: &Bound<'_, PyAny>) -> PyResult<()> {
        self.inner.set_logit_bias(convert::bias_map(bias)?).py()
    }

    /// Remove every static bias set by `set_logit_bias`.
    fn clear_logit_bias(&self) -> PyResult<()> {
        self.inner.set_logit_bias(Vec::new()).py()
    }

    /// Dynamic biases {token: bias} applied after the logit bias; NOT inherited on fork.
    fn steer(&self, bias: &Bound<'_, PyAny>) -> PyResult<()> {
        self.inner.steer(convert::bias_map(bias)?).py()
    }

    /// Remove every dynamic bias set by `steer`.
    fn clear_steer(&self) -> PyResult<()> {
        self.inner.steer(Vec::new()).py()
    }

    // ---- metrics ----

    /// exp(mean surprisal) of the accepted tokens under the raw logits (model level);
    /// prefilled tokens do not count. inf before any accepted token.
    #[getter]
    fn perplexity(&self) -> PyResult<f64> {
        self.inner.perplexity().py()
    }

    /// Like `perplexity`, under the filtered distribution the sampler drew from (grammar,
    /// biases and chain applied): inf before any accepted token, and once a token it had
    /// filtered out was accepted.
    #[getter]
    fn sampling_perplexity(&self) -> PyResult<f64> {
        self.inner.sampling_perplexity().py()
    }

    /// Entropy of the raw logits snapshot, in nats (or bits with `base="bits"`). Raises
    /// KvforkError before the first prefill or commit, ValueError for another `base`.
    #[pyo3(signature = (base=Arg("nats")), text_signature = "($self, base='nats')")]
    fn entropy(&self, py: Python<'_>, base: Arg<&str>) -> PyResult<f64> {
        let base = log_base(base.0)?;
        py.detach(|| self.inner.entropy(base)).py()
    }

    /// -log p(`token`) under the raw logits snapshot, in nats (or bits with `base="bits"`);
    /// inf for a masked token. Raises KvforkError before the first prefill or commit,
    /// ValueError for a token id out of range or another `base`.
    #[pyo3(signature = (token, base=Arg("nats")), text_signature = "($self, token, base='nats')")]
    fn surprisal(&self, py: Python<'_>, token: Int, base: Arg<&str>) -> PyResult<f64> {
        let (token, base) = (token_int(&token)?, log_base(base.0)?);
        py.detach(|| self.inner.surprisal(token, base)).py()
    }

    /// Natural-log probability of `token` under the raw snapshot: log-softmax of the logits,
    /// computed in Rust (no copy of the row). -inf for a masked token. Raises KvforkError
    /// before the first prefill or commit (no snapshot yet).
    fn logprob(&self, py: Python<'_>, token: Int) -> PyResult<f64> {
        let token = token_int(&token)?;
        py.detach(|| self.inner.logprob(token)).py()
    }

    /// The `k` most likely tokens of the raw snapshot as `[(token, logprob), ...]`, best
    /// first, natural log. One pass over the row in Rust; fewer pairs when fewer logits are
    /// finite. Raises KvforkError before the first prefill or commit.
    fn top_logprobs(&self, py: Python<'_>, k: Int) -> PyResult<Vec<(i32, f64)>> {
        let k = k.within("k", 0, i64::from(i32::MAX))? as usize;
        py.detach(|| self.inner.top_logprobs(k)).py()
    }

    /// A copy of the raw logits snapshot, float32 of shape (vocab_size,). Raises KvforkError
    /// before the first prefill or commit. On a `device_sampling` context a row the device
    /// kept is decoded again first (one decode), and the branch gets rows from then on.
    fn logits<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        // The snapshot is shared out first: no Python runs under the branch lock. Detached:
        // the read may wait for a decode (a row in flight, or one the device kept).
        match py.detach(|| self.inner.logits_shared()).py()? {
            Some(row) => convert::f32_array(py, &row),
            None => Err(crate::errors::KvforkError::new_err(
                "the branch has no logits yet: prefill or commit first",
            )),
        }
    }

    /// Replace the snapshot with a float32 array of shape (vocab_size,).
    fn set_logits(&self, logits: &Bound<'_, PyAny>) -> PyResult<()> {
        let v = convert::f32_vec(logits, "logits")?;
        self.inner.set_logits(&v).py()
    }

    // ---- identity ----

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<PyBranch>()
            .is_ok_and(|o| o.get().inner == self.inner)
    }

    fn __hash__(&self) -> u64 {
        self.inner.handle().to_u64()
    }

    fn __repr__(&self) -> String {
        match self.inner.position() {
            Ok(p) => format!("Branch(handle={}, position={p})", self.inner.handle()),
            Err(_) => format!("Branch(handle={}, disposed)", self.inner.handle()),
        }
    }
}

twins! {
    impl PyBranch {
        /// Decode external tokens at the branch's position (no accept); captures the last
        /// logits. Prefills of other tasks issued at the same time are packed into the same
        /// decodes. Cancelled, it either never ran or was aborted and rolled back: nothing
        /// happened.
        #[sync_doc = "returns None once the tokens are decoded. Waits without the GIL; Ctrl-C \
                      aborts and rolls the prefill back, then raises KeyboardInterrupt."]
        fn prefill / prefill_sync(&self, py, tokens: &Bound<'_, PyAny>) -> Option<()> {
            self.inner.prefill(convert::tokens(tokens, "tokens")?)
        } => convert::none;

        /// Prefill `tokens` (as `prefill`: no accept, the last logits become the snapshot) and
        /// score each: its natural-log probability given the branch's tokens and those before
        /// it, under the raw logits (model level: no grammar, bias or chain; -inf for a masked
        /// token). `sum(await b.score(continuation))` is the continuation's log-likelihood.
        /// The first token is scored from the snapshot: KvforkError before the first prefill
        /// or commit (prefill a text's first token, BOS, then score the rest). With
        /// `top_logprobs=k` (at most 1024), each entry is `(logprob, [(token, logprob), ...])`,
        /// the `k` most likely tokens at its position, best first. Costs about a prefill plus
        /// the output layer at every position; on failure nothing changed. Cancelled, it
        /// either never ran or completed.
        #[sync_doc = "returns the scores once the tokens are decoded. Waits without the GIL; \
                      on Ctrl-C a started scoring completes, then KeyboardInterrupt is raised."]
        #[pyo3(signature = (tokens, top_logprobs = None))]
        fn score / score_sync(
            &self,
            py,
            tokens: &Bound<'_, PyAny>,
            top_logprobs: Option<Int>,
        ) -> scores::Scores {
            let top = scores::top_count(top_logprobs.as_ref())?;
            self.inner.score(convert::tokens(tokens, "tokens")?, top)
        } => scores::one(top_logprobs.is_some());

        /// Sample a token from the snapshot on the engine thread, after any queued work on
        /// this branch (no KV write, no accept; only a stochastic sampler's RNG moves).
        #[sync_doc = "returns the sampled Token, not committed. Waits without the GIL; Ctrl-C \
                      cancels it all-or-nothing, as an await would, and raises \
                      KeyboardInterrupt."]
        fn produce / produce_sync(&self, py) -> PyToken {
            self.inner.produce()
        } => |p| Ok(PyToken::from(p));

        /// Accept `token` (an int or a Token), decode it, capture logits; rolled back if the
        /// decode fails. Cancelled, it either never ran (nothing happened) or had started (it
        /// completed).
        #[sync_doc = "returns None once the token is accepted and decoded (a failed decode is \
                      rolled back and raised). Waits without the GIL; on Ctrl-C a started \
                      commit completes, then KeyboardInterrupt is raised."]
        fn commit / commit_sync(&self, py, token: &Bound<'_, PyAny>) -> Option<()> {
            self.inner.commit(token_arg(token)?)
        } => convert::none;

        /// One round of exact speculative decoding (low level; `generate(draft=...)` drives
        /// it). `pending`: the token the sampler drew last (from `produce`, not committed);
        /// `draft`: guessed tokens after it. Decodes both in one llama_decode, then samples the
        /// branch's chain position by position, accepting while it agrees with the draft.
        /// Returns `(accepted, next)`: the draft Tokens drawn (committed, with `pending`) and
        /// the Token drawn after them (sampled, not committed).
        #[sync_doc = "returns `(accepted, next)`. Waits without the GIL; on Ctrl-C a started \
                      round completes, then KeyboardInterrupt is raised."]
        fn speculate / speculate_sync(
            &self,
            py,
            pending: &Bound<'_, PyAny>,
            draft: Arg<Vec<Int>>,
        ) -> (Vec<PyToken>, PyToken) {
            self.inner.speculate(token_arg(pending)?, draft_tokens(&draft.0)?)
        } => speculated;

        /// Save the branch to `path` (its KV cells, position, history, sampler params and RNG
        /// state, grammar, biases, steer, perplexity accumulators), after queued work on it.
        #[sync_doc = "returns None once the file is written. Waits without the GIL; Ctrl-C \
                      cancels it all-or-nothing, as an await would, and raises \
                      KeyboardInterrupt."]
        fn save / save_sync(&self, py, path: Arg<PathBuf>) -> Option<()> {
            self.inner.save(path.0)
        } => convert::none;

        /// Infinite context: empty the branch's KV, then prefill `sinks` (e.g. the prompt's
        /// first tokens) followed by the last `tail` tokens of its sequence (prompt included;
        /// a sequence that begins with `sinks` gives its tail from after them), from position
        /// 0. Sampler, grammar, biases and metrics carry on. When the prefill fails
        /// (KvCacheFullError), the branch's cells come back from a host copy: it keeps its
        /// tokens and logits. Only when the cache cannot hold them again is it left empty at
        /// position 0, with no logits (prefill it again); the error says which. Cells it shared
        /// with forks come back as copies of their own, so a branch whose forks share much of
        /// a full cache (the case where the prefill found no room: their cells stay theirs)
        /// is most often left empty.
        #[sync_doc = "returns None once `sinks` and the tail are prefilled. Waits without the \
                      GIL; Ctrl-C cancels it all-or-nothing, as an await would, and raises \
                      KeyboardInterrupt."]
        fn reseed_context / reseed_context_sync(
            &self,
            py,
            sinks: &Bound<'_, PyAny>,
            tail: Int,
        ) -> Option<()> {
            let sinks = convert::tokens(sinks, "sinks")?;
            let tail = tail.within("tail", 0, i64::from(i32::MAX))? as usize;
            self.inner.reseed_context(sinks, tail)
        } => convert::none;

        /// Context shift (llama.cpp's --context-shift): empty the branch's KV, then prefill
        /// the first `keep` tokens of its sequence and the most recent half of the rest, from
        /// position 0. Sampler, grammar, biases and metrics carry on. `keep` is at most
        /// n_ctx - 2 (ValueError). `generate(on_context_full="shift")` calls it at n_ctx. A
        /// failed prefill puts the branch back as `reseed_context` does.
        #[sync_doc = "returns None once the kept tokens are prefilled. Waits without the GIL; \
                      Ctrl-C cancels it all-or-nothing, as an await would, and raises \
                      KeyboardInterrupt."]
        #[pyo3(signature = (keep=Int(Some(4))), text_signature = "($self, keep=4)")]
        fn shift_context / shift_context_sync(&self, py, keep: Int) -> Option<()> {
            let keep = keep.within("keep", 0, i64::from(i32::MAX))? as usize;
            self.inner.shift_context(keep)
        } => convert::none;

        /// Dispose the branch and free its KV lease; siblings and the shared prefix are
        /// untouched. RESTRICT by default: raises KvforkError while it has live children.
        /// `keep_children=True` frees the lease anyway: the children keep the cells they share
        /// with it and move to its parent (or become roots) — e.g. a dropped beam whose forks
        /// survive. `disposed` is True at once and the rest always happens, even if the await
        /// is cancelled; a second prune is a no-op.
        #[sync_doc = "returns None once the lease is freed; KvforkError while the branch has \
                      live children, unless `keep_children=True`. Always completes, even on \
                      Ctrl-C."]
        #[pyo3(signature = (*, keep_children=Arg(false)),
               text_signature = "($self, *, keep_children=False)")]
        fn prune / prune_sync(&self, py, keep_children: Arg<bool>) -> Option<()> {
            self.pruning(keep_children.0)
        } => convert::none;

        /// Dispose this branch and its whole subtree (CASCADE). Always completes once called.
        #[sync_doc = "returns None once the branch and all its descendants are disposed. Waits \
                      without the GIL; always completes, even on Ctrl-C."]
        fn prune_subtree / prune_subtree_sync(&self, py) -> Option<()> {
            self.inner.prune_subtree()
        } => convert::none;
    }
}

impl PyBranch {
    fn set_constraint(&self, py: Python<'_>, spec: kvfork::GrammarSpec) -> PyResult<()> {
        py.detach(|| self.inner.set_grammar(Some(spec))).py()
    }
}

/// The speculative stream classes of `kvfork._speculative` (async, sync), handed over by the
/// package when it is imported: the native module never imports the package.
static SPECULATIVE_STREAMS: PyOnceLock<(Py<PyAny>, Py<PyAny>)> = PyOnceLock::new();

/// Called once by `kvfork._speculative` with its `SpeculativeStream` and
/// `SpeculativeStreamSync` classes.
#[pyfunction]
pub fn _use_speculative_streams(
    py: Python<'_>,
    async_stream: Py<PyAny>,
    sync_stream: Py<PyAny>,
) -> PyResult<()> {
    let _ = SPECULATIVE_STREAMS.set(py, (async_stream, sync_stream));
    Ok(())
}

/// `kvfork.SpeculativeStream(branch, max_tokens, draft, on_context_full=..., keep=...)` (or
/// its sync twin); `on_full` is checked already.
fn speculative_stream(
    branch: &Bound<'_, PyBranch>,
    sync: bool,
    max_tokens: Option<usize>,
    draft: Bound<'_, PyAny>,
    on_context_full: &str,
    on_full: kvfork::OnContextFull,
) -> PyResult<Py<PyAny>> {
    let py = branch.py();
    let (async_stream, sync_stream) = SPECULATIVE_STREAMS.get(py).ok_or_else(|| {
        pyo3::exceptions::PyRuntimeError::new_err(
            "speculative streams come with the kvfork package: import kvfork, not only kvfork._native",
        )
    })?;
    let class = if sync { sync_stream } else { async_stream };
    let kwargs = pyo3::types::PyDict::new(py);
    kwargs.set_item("on_context_full", on_context_full)?;
    if let kvfork::OnContextFull::Shift { keep } = on_full {
        kwargs.set_item("keep", keep)?;
    }
    Ok(class
        .bind(py)
        .call((branch, max_tokens, draft), Some(&kwargs))?
        .unbind())
}

/// `on_context_full` and `keep` as the engine's choice, checked against the branch's context.
fn on_full(branch: &kvfork::Branch, name: &str, keep: Int) -> PyResult<kvfork::OnContextFull> {
    let on_full = crate::convert::on_full_arg(name, keep)?;
    on_full.check(branch).py()?;
    Ok(on_full)
}

/// The lease taken holds no cells ending at `position - 1`: a branch created there would
/// generate from an empty cache (lloyal.node users write `Branch.create(ctx, len(prompt),
/// params)` after decoding the prompt on the context, which `ctx.decode` does here too).
fn warn_nothing_behind(py: Python<'_>, position: i32) -> PyResult<()> {
    let msg = format!(
        "Branch.create at position {position}: the branch's sequence is empty, so it would \
         generate from nothing behind it; create it at 0 and prefill the prompt \
         (`b = Branch.create(ctx, 0, params); await b.prefill(tokens)`), or decode the \
         prompt into a sequence first (`await ctx.decode(tokens, 0, seq_id)`)"
    );
    crate::errors::warn(py, msg)
}

fn speculated(s: kvfork::Speculated) -> PyResult<(Vec<PyToken>, PyToken)> {
    Ok((
        s.accepted.into_iter().map(PyToken::from).collect(),
        s.next.into(),
    ))
}
