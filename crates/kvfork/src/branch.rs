//! `Branch`: one decode sequence (a KV lease) with its own sampler, grammar, biases and metrics.

use crate::adapter::{
    check_layers, AdapterKey, Adapters, ControlVector, LoraAdapter, SteeringVector,
};
use std::sync::Arc;

use kvfork_core::metrics::LogBase;
use kvfork_core::{Handle, Registry};

use crate::branch_state::BranchState;
use crate::context::Context;
use crate::engine::{BranchCell, CancelPolicy, Pending, Prune};
use crate::error::{Error, Result};
use crate::llama_ctx::Output;
use crate::model::Token;
use crate::produced::Produced;
use crate::sampling::chain::SamplerChain;
use crate::sampling::grammar::{Grammar, GrammarSpec};
use crate::sampling::SamplingParams;

/// A handle to one branch. Clones refer to the same branch.
#[derive(Clone)]
pub struct Branch {
    ctx: Context,
    handle: Handle,
    cell: Arc<BranchCell>,
    /// The prefix cache's own handle: the only one that may use the branch once it is an
    /// entry (handed back with `PrefixCache::release`); to every other handle, the one handed
    /// out and those the registry gives (`parent`, `children`), it is disposed.
    cache_owned: bool,
}

impl PartialEq for Branch {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.cell, &other.cell)
    }
}

impl std::fmt::Debug for Branch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Branch({})", self.handle)
    }
}

impl Branch {
    /// A new root branch on a fresh lease, starting at `position`. Does not wait for the
    /// engine: the lease is taken at once and emptying its sequence is queued ahead of any
    /// later work on the branch.
    pub fn create(
        ctx: &Context,
        position: i32,
        params: &SamplingParams,
        grammar: Option<GrammarSpec>,
    ) -> Result<Branch> {
        ctx.shared().check_open()?;
        if position < 0 || position as u32 >= ctx.n_ctx() {
            return Err(Error::invalid(
                "position",
                format!("{position} is not in [0, n_ctx = {})", ctx.n_ctx()),
            ));
        }
        let sampler = SamplerChain::new(params, ctx.model())?;
        let grammar = grammar
            .filter(|g| !g.is_blank())
            .map(|g| Grammar::new(ctx.model(), g))
            .transpose()?;
        let state = BranchState::new(position, sampler, grammar);
        let (handle, cell) = ctx.shared().create_root(state)?;
        if ctx.shared().park.is_some() {
            // The lease may move before a queued clear runs: empty it only if still held.
            if !cell.is_parked() {
                let (held, seq) = (cell.clone(), cell.seq());
                drop(ctx.engine().run_with(CancelPolicy::Never, move |w| {
                    w.clear_if_held(&held, seq);
                    Ok(())
                }));
            }
        } else {
            ctx.engine().clear_seq(cell.seq());
        }
        Ok(Branch::from_parts(ctx.clone(), handle, cell))
    }

    pub(crate) fn from_parts(ctx: Context, handle: Handle, cell: Arc<BranchCell>) -> Branch {
        Branch {
            ctx,
            handle,
            cell,
            cache_owned: false,
        }
    }

    /// The prefix cache's own handle to this branch (see [`Branch::cache_owned`]).
    pub(crate) fn owned_by_cache(&self) -> Branch {
        Branch {
            cache_owned: true,
            ..self.clone()
        }
    }

    /// Refuse a branch of a context other than `ctx` (its handle, or its cell's sequence,
    /// could name one of `ctx`'s): an invalid `arg`.
    pub(crate) fn check_on(&self, ctx: &Context, arg: &'static str) -> Result<()> {
        if self.ctx.shared().id != ctx.shared().id {
            return Err(Error::invalid(
                arg,
                format!("branch {} belongs to another context", self.handle),
            ));
        }
        Ok(())
    }

    /// Whether the branch is a prefix cache's entry and this handle not the cache's.
    fn handed_back(&self) -> bool {
        !self.cache_owned && self.cell.is_entry()
    }

    pub(crate) fn cell(&self) -> &Arc<BranchCell> {
        &self.cell
    }

    /// The context the branch lives on.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// The branch's id in its context (generational: stale once pruned).
    pub fn handle(&self) -> Handle {
        self.handle
    }

    /// Ok when the branch can be used.
    pub fn check_live(&self) -> Result<()> {
        self.ctx.shared().check_open()?;
        if self.cell.is_disposed() {
            return Err(Error::BranchDisposed(self.handle.to_string()));
        }
        if self.handed_back() {
            return Err(Error::BranchDisposed(format!(
                "{} (handed back to its prefix cache)",
                self.handle
            )));
        }
        Ok(())
    }

    fn state<T>(&self, f: impl FnOnce(&mut BranchState) -> Result<T>) -> Result<T> {
        self.check_live()?;
        f(&mut self.cell.lock())
    }

    /// `state`, for a call that reads the logits row. While a commit of this branch decodes,
    /// its row (lent from llama.cpp's output buffer, which the decode rewrites) is in flight:
    /// the call waits for the decode to land, then reads the new row. Calls that read no row
    /// never wait for a decode.
    fn with_row<T>(&self, f: impl FnOnce(&mut BranchState) -> Result<T>) -> Result<T> {
        let landed = &self.ctx.shared().rows_landed;
        let mut st = loop {
            self.check_live()?;
            let seen = landed.count();
            let st = self.cell.lock();
            if !st.logits().is_in_flight() {
                break st;
            }
            drop(st);
            // A closed context lands nothing: look again now and then.
            landed.wait_past(seen, std::time::Duration::from_millis(20));
        };
        f(&mut st)
    }

    /// `with_row` for a call that needs the row, `f`. On a device-sampling context the row
    /// of an output the device drew stayed there: when `f` cannot answer from what came
    /// back, the last token is decoded again for it (`engine/refresh.rs`) and `f` runs
    /// again. A reader (`reads`) also marks the branch to get rows from now on
    /// (`BranchState::read_rows`). Where no decode can be done (no spare sequence) `f`'s
    /// error stands.
    fn with_row_decoded<T>(
        &self,
        reads: bool,
        f: impl Fn(&mut BranchState) -> Result<T>,
    ) -> Result<T> {
        let answered = self.with_row(|s| match f(s) {
            Err(_) if s.logits().drawn().is_some() => {
                if reads {
                    s.read_rows();
                }
                Ok(None)
            }
            r => r.map(Some),
        })?;
        if let Some(value) = answered {
            return Ok(value);
        }
        let cell = self.cell.clone();
        self.ctx.run(move |w| w.refresh_drawn(&cell)).wait()?;
        self.with_row(f)
    }

    /// `with_row_decoded` for a reader of the row.
    fn with_whole_row<T>(&self, f: impl Fn(&mut BranchState) -> Result<T>) -> Result<T> {
        self.with_row_decoded(true, f)
    }

    // ---- decoding ----

    /// Decode external tokens at the branch's position and capture the last logits.
    /// No accept: penalties and perplexity are untouched.
    pub fn prefill(&self, tokens: Vec<Token>) -> Pending<()> {
        if let Err(e) = self
            .check_live()
            .and_then(|_| check_tokens(&self.ctx, &tokens))
        {
            return Pending::ready(Err(e));
        }
        self.ctx.engine().prefill(vec![(self.cell.clone(), tokens)])
    }

    /// Sample from the snapshot: grammar → logit bias → steer → chain. Runs on the calling
    /// thread on the snapshot as it is now (see `produce` for the engine-ordered version),
    /// except when the chain came to need the row of an output the device drew: the engine
    /// decodes the last token again first, as for `produce` (`engine/refresh.rs`).
    pub fn sample(&self) -> Result<Token> {
        let model = self.ctx.model().clone();
        self.with_row_decoded(false, move |s| s.sample(&model))
    }

    /// Sample and describe the token, on the engine thread after any queued work on this
    /// branch (so it sees the snapshot of a commit still in flight); no KV write.
    pub fn produce(&self) -> Pending<Produced> {
        if let Err(e) = self.check_live() {
            return Pending::ready(Err(e));
        }
        self.ctx.engine().sample(self.cell.clone(), false)
    }

    /// One generation step on the engine thread: sample, and commit the token unless it is a
    /// stop token. Steps of different branches coalesce into one decode like commits.
    pub fn step(&self) -> Pending<Produced> {
        if let Err(e) = self.check_live() {
            return Pending::ready(Err(e));
        }
        self.ctx.engine().sample(self.cell.clone(), true)
    }

    /// Record a token as accepted (penalty window, grammar, perplexity) without decoding it.
    /// All or nothing: a refused token leaves the branch as it was.
    /// A later `commit` of the same token only decodes it (nothing is counted twice); a
    /// commit of another token is refused while this one is pending.
    pub fn accept(&self, token: Token) -> Result<()> {
        let model = self.ctx.model().clone();
        self.with_whole_row(|s| s.accept_ahead(&model, token))
    }

    /// Accept, then decode `token` and capture logits; rolled back entirely if the decode fails.
    pub fn commit(&self, token: Token) -> Pending<()> {
        if let Err(e) = self
            .check_live()
            .and_then(|_| self.ctx.model().check_token(token))
        {
            return Pending::ready(Err(e));
        }
        self.ctx.engine().commit(vec![(self.cell.clone(), token)])
    }

    /// Infinite context: empty the branch's KV sequence, then prefill `sinks` followed by the
    /// last `tail` tokens of its sequence (prompt included; a sequence that begins with
    /// `sinks` gives its tail from after them), from position 0, so generation can go on past
    /// `n_ctx`. Sampler, grammar, biases and metrics carry on. If the prefill fails the
    /// branch's cells come back from a host copy, or, when they no longer fit, it is left
    /// empty with no logits (`engine/reseed.rs`).
    pub fn reseed_context(&self, sinks: Vec<Token>, tail: usize) -> Pending<()> {
        if let Err(e) = self
            .check_live()
            .and_then(|_| check_tokens(&self.ctx, &sinks))
        {
            return Pending::ready(Err(e));
        }
        let cell = self.cell.clone();
        self.ctx.run(move |w| w.reseed_context(&cell, &sinks, tail))
    }

    /// Context shift (llama.cpp's `--context-shift`): empty the branch's KV sequence, then
    /// prefill its first `keep` tokens and the most recent half of the rest from position 0.
    /// Sampler, grammar, biases and metrics carry on; a failed prefill is undone as
    /// `reseed_context`'s. `keep` must leave room: at most `n_ctx - 2`.
    pub fn shift_context(&self, keep: usize) -> Pending<()> {
        if let Err(e) = self.check_live().and_then(|_| check_keep(&self.ctx, keep)) {
            return Pending::ready(Err(e));
        }
        let cell = self.cell.clone();
        self.ctx.run(move |w| w.shift_context(&cell, keep))
    }

    /// A context shift, then a generation step, as one request (a stream at `n_ctx`).
    pub(crate) fn shift_then_step(&self, keep: usize) -> Pending<Produced> {
        if let Err(e) = self.check_live().and_then(|_| check_keep(&self.ctx, keep)) {
            return Pending::ready(Err(e));
        }
        let cell = self.cell.clone();
        self.ctx.run(move |w| w.shift_then_step(&cell, keep))
    }

    // ---- tree ----

    /// A new branch on a fresh lease sharing this branch's whole KV prefix (no tensor copy).
    /// Without `seed` the child's sampler (RNG state included) equals the parent's: it samples
    /// the same tokens until reseeded.
    pub fn fork(&self, seed: Option<u32>) -> Pending<Branch> {
        self.fork_on(seed, None)
    }

    /// `fork` onto the lease of `seq_id` itself (lloyal.node's `fork(newSeqId)`), or the
    /// lowest free one without it. `SeqLeased` when a branch holds that sequence; cells it
    /// held are replaced by the parent's.
    pub fn fork_on(&self, seed: Option<u32>, seq_id: Option<i32>) -> Pending<Branch> {
        let on = match seq_id.map(|s| self.context().seq_arg(s)).transpose() {
            Ok(on) => on,
            Err(e) => return Pending::ready(Err(e)),
        };
        if let Err(e) = self.check_live() {
            return Pending::ready(Err(e));
        }
        let (ctx, parent, parent_cell) =
            (self.context().clone(), self.handle(), self.cell().clone());
        self.context().run(move |w| {
            let (handle, cell) = w.fork(parent, &parent_cell, seed, on)?;
            Ok(Branch::from_parts(ctx, handle, cell))
        })
    }

    /// Ready when a prune has nothing to do (already pruned) or cannot run (closed context).
    fn prune_settled(&self) -> Option<Pending<()>> {
        if self.disposed() {
            return Some(Pending::ready(Ok(())));
        }
        self.ctx
            .shared()
            .check_open()
            .err()
            .map(|e| Pending::ready(Err(e)))
    }

    /// Queue the engine half of a prune (`engine/tree.rs`). `disposed` is already visible,
    /// so it always happens, even if the caller cancels. A prune of the branch alone (a leaf,
    /// or one whose children stay) empties its own sequence only: the cells it shares with
    /// its children keep their sequences too, and the children only change parents in the
    /// registry. The others' gatherings run it in passing: a server's finished request, or a
    /// prefix cache's eviction, does not hold up the streams still stepping nor the first
    /// tokens of the prompts being decoded (an eviction stopped a continuous prefill from
    /// pulling the queue, and a prompt's first token waited for every prompt after it).
    fn release(&self, how: Prune) -> Pending<()> {
        let handle = self.handle;
        let prune = move |w: &mut crate::engine::Worker| w.prune(handle, how);
        if how != Prune::Subtree {
            let writes = vec![self.cell.clone()];
            self.ctx
                .engine()
                .run_light(CancelPolicy::Never, Vec::new(), writes, prune)
        } else {
            self.ctx.engine().run_with(CancelPolicy::Never, prune)
        }
    }

    /// Dispose (RESTRICT: fails while live children exist). Frees the lease and the branch's
    /// own KV cells; shared prefix cells stay for their other owners. A second call is a no-op.
    pub fn prune(&self) -> Pending<()> {
        if let Some(settled) = self.prune_settled() {
            return settled;
        }
        let how = {
            let reg = self.ctx.shared().registry();
            let Some(node) = reg.get(self.handle) else {
                return Pending::ready(Ok(()));
            };
            let live = live_children(&reg, &node.children).count();
            if live > 0 {
                return Pending::ready(Err(Error::Other(format!(
                    "branch {} has {live} live children: prune them first, or use \
                     prune_subtree",
                    self.handle
                ))));
            }
            self.cell.mark_disposed();
            if node.children.is_empty() {
                Prune::Leaf
            } else {
                // The disposed children leave by their own prunes; the prefix cache's entries
                // stay, their cells kept, under this branch's parent.
                Prune::KeepChildren
            }
        };
        self.release(how)
    }

    /// Dispose this branch but not its children: its lease is freed at once, the children
    /// keep every KV cell they share with it (cells carry their own sequence ids) and move to
    /// this branch's parent (or become roots). For beam search, where a dropped beam's
    /// forks survive it.
    pub fn prune_keep_children(&self) -> Pending<()> {
        if let Some(settled) = self.prune_settled() {
            return settled;
        }
        self.cell.mark_disposed();
        self.release(Prune::KeepChildren)
    }

    /// Dispose this branch and all its descendants (children first).
    pub fn prune_subtree(&self) -> Pending<()> {
        if let Some(settled) = self.prune_settled() {
            return settled;
        }
        {
            let reg = self.ctx.shared().registry();
            let mut stack = vec![self.handle];
            while let Some(h) = stack.pop() {
                if let Some(node) = reg.get(h) {
                    node.data.mark_disposed();
                    stack.extend(node.children.iter().copied());
                }
            }
        }
        self.release(Prune::Subtree)
    }

    fn wrap(&self, handle: Handle) -> Option<Branch> {
        let cell = self.ctx.shared().registry().get(handle)?.data.clone();
        Some(Branch::from_parts(self.ctx.clone(), handle, cell))
    }

    /// The branch this one was forked from, if it is still live (`None` for a root, and
    /// for a disposed branch or one handed back to its prefix cache).
    pub fn parent(&self) -> Option<Branch> {
        if self.disposed() {
            return None;
        }
        let reg = self.ctx.shared().registry();
        let mut parent = reg.get(self.handle)?.parent?;
        // A parent being pruned (`disposed`, its engine half queued) is gone already: its
        // children move up (`prune(keep_children=True)`), or go with it. One handed back to
        // its prefix cache is the cache's entry, no caller's branch: skipped alike.
        while !is_live(&reg.get(parent)?.data) {
            parent = reg.get(parent)?.parent?;
        }
        drop(reg);
        self.wrap(parent)
    }

    /// Live forks of this branch, in creation order (a fork being pruned is not live: its
    /// `disposed` is already true; nor is one handed back to its prefix cache). None for a
    /// disposed branch or one handed back.
    pub fn children(&self) -> Vec<Branch> {
        if self.disposed() {
            return Vec::new();
        }
        let live: Vec<Handle> = {
            let reg = self.ctx.shared().registry();
            match reg.get(self.handle) {
                Some(node) => live_children(&reg, &node.children).collect(),
                None => return Vec::new(),
            }
        };
        // (`wrap` locks the registry itself.)
        live.into_iter().filter_map(|h| self.wrap(h)).collect()
    }

    /// Whether no live fork hangs off this branch (true once it is disposed or handed back).
    pub fn is_leaf(&self) -> bool {
        if self.disposed() {
            return true;
        }
        let reg = self.ctx.shared().registry();
        reg.get(self.handle)
            .is_none_or(|n| live_children(&reg, &n.children).next().is_none())
    }

    /// True while the branch holds a KV lease (false once pruned, and while parked in host
    /// memory on a `park` context).
    pub fn is_active(&self) -> bool {
        !self.disposed()
            && !self.cell.is_parked()
            && self.ctx.shared().registry().contains(self.handle)
    }

    /// Whether the branch was pruned (true as soon as `prune` is called), or this handle was
    /// handed back to the prefix cache that made it.
    pub fn disposed(&self) -> bool {
        self.cell.is_disposed() || self.handed_back()
    }

    /// Position at which this branch was forked (0 for a root).
    pub fn fork_head(&self) -> Result<u32> {
        self.check_live()?;
        Ok(self
            .ctx
            .shared()
            .registry()
            .get(self.handle)
            .map_or(0, |n| n.fork_head))
    }

    /// Tokens in this branch's sequence (its next token goes at this position).
    pub fn position(&self) -> Result<i32> {
        self.state(|s| Ok(s.position()))
    }

    /// The KV sequence id this branch leases; -1 while it is parked (a `park` context).
    pub fn seq_id(&self) -> Result<i32> {
        self.check_live()?;
        if self.cell.is_parked() {
            return Ok(-1);
        }
        Ok(self.cell.seq().id())
    }

    // ---- sampler control ----

    /// The parameters of the branch's sampler chain.
    pub fn sampler_params(&self) -> Result<SamplingParams> {
        self.state(|s| Ok(s.sampler_params().clone()))
    }

    /// Restart the chain's RNG from `seed`; penalty history and Mirostat state carry on.
    pub fn reseed_sampler(&self, seed: u32) -> Result<()> {
        self.state(|s| {
            s.reseed(seed);
            Ok(())
        })
    }

    /// Rebuild the chain with new params; no-op when equal.
    pub fn set_sampler_params(&self, params: &SamplingParams) -> Result<()> {
        let model = self.ctx.model().clone();
        self.state(|s| s.set_sampler_params(params, &model))
    }

    /// Replace (or remove, with `None` or a blank GBNF grammar, as llama.cpp reads "") the
    /// grammar.
    pub fn set_grammar(&self, grammar: Option<GrammarSpec>) -> Result<()> {
        let grammar = grammar
            .filter(|g| !g.is_blank())
            .map(|g| Grammar::new(self.ctx.model(), g))
            .transpose()?;
        self.state(|s| {
            s.set_grammar(grammar);
            Ok(())
        })
    }

    /// The tokens decoded into the branch's sequence since it was created (or reseeded):
    /// prefills and commits in order, a fork's starting with its parent's. Saved by `save`.
    pub fn history(&self) -> Result<Vec<Token>> {
        self.state(|s| Ok(s.history().to_vec()))
    }

    /// The constraint set on the branch, as declared.
    pub fn grammar(&self) -> Result<Option<GrammarSpec>> {
        self.state(|s| Ok(s.grammar_spec().cloned()))
    }

    /// Replace the logit bias (added to the raw logits before the chain; inherited by forks).
    pub fn set_logit_bias(&self, bias: Vec<(Token, f32)>) -> Result<()> {
        check_bias(&self.ctx, &bias)?;
        self.state(|s| {
            s.set_logit_bias(bias);
            Ok(())
        })
    }

    /// Decode under these LoRA adapters and scales from now on (replacing the set; a scale of
    /// 0 is the same as leaving the adapter out). Forks inherit the set. Tokens already
    /// decoded keep the KV computed under the adapters of their time.
    pub fn set_adapters(&self, adapters: Vec<(Arc<LoraAdapter>, f32)>) -> Result<()> {
        let set = Adapters::from_loras(&self.ctx.shared().model, adapters)?;
        self.state(|s| {
            let cvec = s.adapters().control_vector().cloned();
            let mut set = set;
            set.set_cvec(cvec);
            s.change_adapters(|a| *a = set);
            Ok(())
        })
    }

    /// Add `vector` × `scale` to the outputs of its rows `layers` (0-based, end exclusive;
    /// all rows when `None`) from now on; `None` removes the control vector. Inherited by forks.
    pub fn set_control_vector(
        &self,
        vector: Option<Arc<ControlVector>>,
        scale: f32,
        layers: Option<(u32, u32)>,
    ) -> Result<()> {
        let model = &self.ctx.shared().model;
        let steering = match vector {
            None => None,
            Some(vector) => {
                if vector.n_embd() != model.n_embd() || vector.n_layers() != model.n_layer() {
                    return Err(Error::invalid(
                        "vector",
                        format!(
                            "shape ({}, {}), this model takes ({}, {})",
                            vector.n_layers(),
                            vector.n_embd(),
                            model.n_layer(),
                            model.n_embd()
                        ),
                    ));
                }
                if !scale.is_finite() {
                    return Err(Error::invalid("scale", format!("{scale} is not finite")));
                }
                let layers = layers.unwrap_or((0, model.n_layer() as u32));
                check_layers(model, layers)?;
                Some(SteeringVector {
                    vector,
                    scale,
                    layers,
                })
            }
        };
        self.state(|s| {
            s.change_adapters(|a| a.set_cvec(steering));
            Ok(())
        })
    }

    /// Back to the base model: no LoRA adapter, no control vector.
    pub fn clear_adapters(&self) -> Result<()> {
        self.state(|s| {
            s.change_adapters(|a| *a = Adapters::default());
            Ok(())
        })
    }

    /// Replace the whole adapter set (LoRA adapters and control vector) with `adapters`,
    /// checked already (a set read from another branch of the same context).
    pub(crate) fn set_all_adapters(&self, adapters: Adapters) -> Result<()> {
        self.state(|s| {
            s.change_adapters(|a| *a = adapters);
            Ok(())
        })
    }

    /// The adapters and control vector the branch decodes under.
    pub fn adapters(&self) -> Result<Adapters> {
        self.state(|s| Ok(s.adapters().clone()))
    }

    /// Its position, the key of its adapter set, and whether all of its KV was decoded under
    /// that set (what a prefix cache may share), read at once.
    pub(crate) fn kv_under_one_set(&self) -> Result<(i32, AdapterKey, bool)> {
        self.state(|s| {
            Ok((
                s.position(),
                s.adapters().key().clone(),
                s.adapters_from() == 0,
            ))
        })
    }

    /// The logit bias, sorted by token.
    pub fn logit_bias(&self) -> Result<Vec<(Token, f32)>> {
        self.state(|s| Ok(s.logit_bias().to_vec()))
    }

    /// Replace the steer biases (added after the logit bias; not inherited by forks).
    pub fn steer(&self, bias: Vec<(Token, f32)>) -> Result<()> {
        check_bias(&self.ctx, &bias)?;
        self.state(|s| {
            s.set_steer(bias);
            Ok(())
        })
    }

    /// The steer biases, sorted by token.
    pub fn steer_biases(&self) -> Result<Vec<(Token, f32)>> {
        self.state(|s| Ok(s.steer().to_vec()))
    }

    // ---- metrics ----

    /// exp(mean model-level surprisal) of accepted tokens; ∞ before any accept.
    pub fn perplexity(&self) -> Result<f64> {
        self.state(|s| Ok(s.perplexity()))
    }

    /// Like `perplexity`, from the filtered (post-chain) distribution.
    pub fn sampling_perplexity(&self) -> Result<f64> {
        self.state(|s| Ok(s.sampling_perplexity()))
    }

    /// Entropy of the raw snapshot's distribution (softmax of the logits), in `base`.
    pub fn entropy(&self, base: LogBase) -> Result<f64> {
        self.with_whole_row(|s| Ok(base.convert(s.logits().entropy()?)))
    }

    /// Surprisal of `token` under the raw snapshot (minus its log-probability), in `base`.
    pub fn surprisal(&self, token: Token, base: LogBase) -> Result<f64> {
        self.ctx.model().check_token(token)?;
        self.with_whole_row(|s| Ok(base.convert(s.logits().surprisal(token)?)))
    }

    /// Natural-log probability of `token` under the raw snapshot (log-softmax); -inf for a
    /// token whose logit is -inf.
    pub fn logprob(&self, token: Token) -> Result<f64> {
        self.ctx.model().check_token(token)?;
        self.with_whole_row(|s| Ok(-s.logits().surprisal(token)?))
    }

    /// The `k` most likely tokens of the raw snapshot with their natural-log probabilities,
    /// best first.
    pub fn top_logprobs(&self, k: usize) -> Result<Vec<(Token, f64)>> {
        self.with_whole_row(|s| s.logits().top_logprobs(k))
    }

    /// A copy of the logits snapshot (None before the first prefill/commit).
    pub fn logits(&self) -> Result<Option<Vec<f32>>> {
        self.with_whole_row(|s| {
            s.logits().refuse_drawn()?;
            Ok(s.logits().row().map(<[f32]>::to_vec))
        })
    }

    /// The snapshot itself, shared (no copy; the branch lock is not held while it is used).
    pub fn logits_shared(&self) -> Result<Option<Arc<[f32]>>> {
        self.with_whole_row(|s| {
            s.logits().refuse_drawn()?;
            Ok(s.logits_shared())
        })
    }

    /// Replace the snapshot (must have vocab_size entries).
    pub fn set_logits(&self, logits: &[f32]) -> Result<()> {
        let n = self.ctx.vocab_size();
        if logits.len() != n {
            return Err(Error::invalid(
                "logits",
                format!("expected {n} values, got {}", logits.len()),
            ));
        }
        if logits.iter().any(|v| v.is_nan() || *v == f32::INFINITY) {
            return Err(Error::invalid("logits", "contains NaN or +inf"));
        }
        self.with_row(|s| {
            s.set_logits(logits);
            Ok(())
        })
    }

    /// The last output (a row copied out, or a device draw), for the raw layer; None before
    /// any.
    pub(crate) fn output(&self) -> Result<Option<Output>> {
        self.with_row(|s| Ok(s.logits().output()))
    }

    /// Replace the snapshot with an output (`Context::decode`'s, taken over).
    pub(crate) fn set_output(&self, output: &Output) -> Result<()> {
        self.with_row(|s| {
            s.set_output(output.as_ref());
            Ok(())
        })
    }

    /// Tokens accepted so far.
    pub fn accepted_tokens(&self) -> Result<Vec<Token>> {
        self.state(|s| Ok(s.accepted().to_vec()))
    }
}

/// A context shift's `keep` must leave at least one free cell after the shift: at most
/// `n_ctx - 2` (a shift keeps `keep` plus the larger half of the rest).
pub(crate) fn check_keep(ctx: &Context, keep: usize) -> Result<()> {
    let n_ctx = ctx.n_ctx() as usize;
    if keep.saturating_add(2) > n_ctx {
        return Err(Error::invalid(
            "keep",
            format!("keep = {keep} leaves no room to shift in n_ctx = {n_ctx}: at most n_ctx - 2"),
        ));
    }
    Ok(())
}

pub(crate) fn check_tokens(ctx: &Context, tokens: &[Token]) -> Result<()> {
    let model = ctx.model();
    tokens.iter().try_for_each(|&t| model.check_token(t))
}

fn check_bias(ctx: &Context, bias: &[(Token, f32)]) -> Result<()> {
    for &(t, b) in bias {
        ctx.model().check_token(t)?;
        if b.is_nan() || b == f32::INFINITY {
            return Err(Error::invalid(
                "bias",
                format!("bias for token {t} must be finite or -inf"),
            ));
        }
    }
    Ok(())
}

/// The children among `children` that are live ([`is_live`]).
fn live_children<'a>(
    reg: &'a Registry<Arc<BranchCell>>,
    children: &'a [Handle],
) -> impl Iterator<Item = Handle> + 'a {
    children
        .iter()
        .copied()
        .filter(|&c| reg.get(c).is_some_and(|n| is_live(&n.data)))
}

/// Whether a branch is a caller's live branch: one already pruned (`disposed`, its engine
/// half still queued) is not, so a prune that was not awaited shows at once, everywhere; nor
/// is one handed back to its prefix cache (the cache's entry: a RESTRICT prune of its parent
/// leaves it to the cache, its cells kept, as `prune(keep_children=True)` does).
fn is_live(cell: &BranchCell) -> bool {
    !cell.is_disposed() && !cell.is_entry()
}
