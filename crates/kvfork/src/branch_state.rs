//! Everything one branch owns besides its KV cells: logits snapshot, sampler chain,
//! grammar, biases, perplexity trackers, accepted history. Guarded by one mutex per branch.

use std::sync::Arc;

use kvfork_core::metrics::{Perplexity, RowSummary};
use kvfork_core::{Biases, Budget, Checkpoints, Utf8Carry};

mod candidates;
mod record;
mod snapshot;
pub(crate) use record::state_error;
pub(crate) use snapshot::LogitsSnapshot;

use candidates::{biased_count, guided_window, legal_window, Candidates};

use crate::adapter::Adapters;
use crate::error::{Error, Result};
use crate::llama_ctx::{Output, OutputRef};
use crate::model::{Model, Token};
use crate::produced::Produced;
use crate::sampling::chain::{Draws, SamplerChain};
use crate::sampling::grammar::{Grammar, GrammarSpec, GrammarUndo};
use crate::sampling::guidance::Guided;
use crate::sampling::SamplingParams;

/// The filtered candidates of the last `sample`, reused by the `accept` that follows so the
/// chain runs once per token. Valid while the snapshot and the sampler state are unchanged.
#[derive(Default)]
struct FilteredCache {
    key: Option<(u64, u64)>,
    /// log-sum-exp over the finite filtered logits.
    lse: f64,
}

/// One branch's state. Changed only through its methods: the engine thread moves it along the
/// sequence (`decoded`, `prefilled`, `sequence_emptied`) and its logits row through the loan
/// protocol (`take_off_row` ... `land_row`, see `engine/loans.rs`); callers change its sampler,
/// grammar and biases.
pub(crate) struct BranchState {
    /// Tokens in the branch's sequence: its next token goes at this position.
    position: i32,
    logits: LogitsSnapshot,
    /// Bumped on every change of sampler, grammar, bias or steer.
    sampler_epoch: u64,
    sampler: SamplerChain,
    grammar: Option<Grammar>,
    /// `accepted[grammar_since..]` are the tokens the grammar has accepted (persistence
    /// replays them to rebuild its parse state).
    grammar_since: usize,
    logit_bias: Biases,
    steer: Biases,
    ppl_model: Perplexity,
    ppl_sampling: Perplexity,
    /// Every accepted token, in order (penalty replay, persistence).
    accepted: Vec<Token>,
    /// Every token decoded into the branch's sequence since it was created or reseeded
    /// (prefills and commits, in order; a fork starts with its parent's). Draft sources read
    /// it; it is saved since state format 2.
    history: Vec<Token>,
    /// A token `Branch::accept` recorded that no commit has decoded yet: a `commit` of the
    /// same token absorbs it (so it is not counted twice), any other token is refused.
    accepted_undecoded: Option<Token>,
    /// An incomplete UTF-8 character carried to the next token's text.
    utf8: Utf8Carry,
    candidates: Candidates,
    cache: FilteredCache,
    /// LoRA adapters and control vector its tokens are decoded under (inherited by forks).
    adapters: Adapters,
    /// The position from which its KV was all decoded under `adapters` (0: all of it; the
    /// tokens before ran under other sets). A prefix cache shares a branch's KV only when
    /// all of it is the one set's (inherited by forks, as the KV is).
    adapters_from: i32,
    /// Copies of a recurrent model's state at chosen positions of `history` (inherited by
    /// forks; see `engine/checkpoints.rs`). Always empty on other models.
    checkpoints: Checkpoints<Arc<[u8]>>,
    /// Device sampling: the branch's rows were read (`Branch::with_whole_row`), so its
    /// outputs are rows from now on, whatever its chain (inherited by forks).
    reads_rows: bool,
}

/// A branch's record of its sequence while the sequence is re-prefilled (`engine/reseed.rs`).
pub(crate) struct SequenceRecord {
    position: i32,
    history: Vec<Token>,
    checkpoints: Checkpoints<Arc<[u8]>>,
    adapters_from: i32,
}

/// What `commit` restores when the decode fails.
pub(crate) struct Snapshot {
    sampler: SamplerChain,
    grammar: Option<GrammarUndo>,
    ppl_model: Perplexity,
    ppl_sampling: Perplexity,
    accepted_len: usize,
    accepted_undecoded: Option<Token>,
    utf8: Utf8Carry,
    sampler_epoch: u64,
}

impl BranchState {
    pub fn new(position: i32, sampler: SamplerChain, grammar: Option<Grammar>) -> Self {
        BranchState {
            position,
            logits: LogitsSnapshot::empty(),
            sampler_epoch: 0,
            sampler,
            grammar,
            grammar_since: 0,
            logit_bias: Biases::default(),
            steer: Biases::default(),
            ppl_model: Perplexity::default(),
            ppl_sampling: Perplexity::default(),
            accepted: Vec::new(),
            history: Vec::new(),
            accepted_undecoded: None,
            utf8: Utf8Carry::default(),
            candidates: Candidates::default(),
            cache: FilteredCache::default(),
            adapters: Adapters::default(),
            adapters_from: 0,
            checkpoints: Checkpoints::default(),
            reads_rows: false,
        }
    }

    /// Copy for a fork: everything but steer (dynamic, per branch) and scratch space.
    pub fn fork_copy(&self) -> Self {
        BranchState {
            position: self.position,
            logits: self.logits.clone(),
            sampler_epoch: self.sampler_epoch + 1,
            sampler: self.sampler.clone(),
            grammar: self.grammar.clone(),
            grammar_since: self.grammar_since,
            logit_bias: self.logit_bias.clone(),
            steer: Biases::default(),
            ppl_model: self.ppl_model,
            ppl_sampling: self.ppl_sampling,
            accepted: self.accepted.clone(),
            history: self.history.clone(),
            accepted_undecoded: self.accepted_undecoded,
            utf8: self.utf8.clone(),
            candidates: Candidates::default(),
            cache: FilteredCache::default(),
            adapters: self.adapters.clone(),
            adapters_from: self.adapters_from,
            checkpoints: self.checkpoints.clone(),
            reads_rows: self.reads_rows,
        }
    }

    /// The adapters its decodes run under.
    pub fn adapters(&self) -> &Adapters {
        &self.adapters
    }

    /// Change the adapter set with `change`; a different set applies from the position
    /// now on (`adapters_from`).
    pub fn change_adapters(&mut self, change: impl FnOnce(&mut Adapters)) {
        let before = self.adapters.key().clone();
        change(&mut self.adapters);
        if *self.adapters.key() != before {
            self.adapters_from = self.position;
        }
    }

    /// The position from which its KV was all decoded under its adapter set (0: all of it).
    pub fn adapters_from(&self) -> i32 {
        self.adapters_from
    }

    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            sampler: self.sampler.clone(),
            grammar: self.grammar.as_ref().map(Grammar::undo_point),
            ppl_model: self.ppl_model,
            ppl_sampling: self.ppl_sampling,
            accepted_len: self.accepted.len(),
            accepted_undecoded: self.accepted_undecoded,
            utf8: self.utf8.clone(),
            sampler_epoch: self.sampler_epoch,
        }
    }

    pub fn restore(&mut self, s: Snapshot) {
        self.sampler = s.sampler;
        if let Some(undo) = s.grammar {
            Grammar::undo(&mut self.grammar, undo);
        }
        self.ppl_model = s.ppl_model;
        self.ppl_sampling = s.ppl_sampling;
        self.accepted.truncate(s.accepted_len);
        self.accepted_undecoded = s.accepted_undecoded;
        self.utf8 = s.utf8;
        // A new epoch: the cache may describe the accepted (now undone) state.
        self.sampler_epoch = s.sampler_epoch.max(self.sampler_epoch) + 1;
    }

    // ---- reading ----

    /// Tokens in the branch's sequence (its next token goes at this position).
    pub fn position(&self) -> i32 {
        self.position
    }

    /// The tokens decoded into the sequence since it was created or reseeded.
    pub fn history(&self) -> &[Token] {
        &self.history
    }

    /// Every accepted token, in order.
    pub fn accepted(&self) -> &[Token] {
        &self.accepted
    }

    /// A token `accept`ed ahead of its decode, still waiting for it.
    pub fn accepted_undecoded(&self) -> Option<Token> {
        self.accepted_undecoded
    }

    /// The logits snapshot, to read.
    pub fn logits(&self) -> &LogitsSnapshot {
        &self.logits
    }

    /// The parameters of the sampler chain.
    pub fn sampler_params(&self) -> &SamplingParams {
        self.sampler.params()
    }

    /// The constraint, as declared.
    pub fn grammar_spec(&self) -> Option<&GrammarSpec> {
        self.grammar.as_ref().map(Grammar::spec)
    }

    /// exp(mean model-level surprisal) of the accepted tokens.
    pub fn perplexity(&self) -> f64 {
        self.ppl_model.value()
    }

    /// exp(mean surprisal under the filtered distribution) of the accepted tokens.
    pub fn sampling_perplexity(&self) -> f64 {
        self.ppl_sampling.value()
    }

    // ---- the sequence (engine thread) ----

    /// `tokens` were decoded into the branch's sequence after its last position.
    pub fn decoded(&mut self, tokens: &[Token]) {
        self.position += tokens.len() as i32;
        self.history.extend_from_slice(tokens);
    }

    /// After `tokens` were prefilled into the branch (`row`: the last one's logits). A token
    /// `accept`ed before is no longer waiting for its decode: the prefill was it. Other
    /// tokens are not the branch's output: a character its output left unfinished (a reply
    /// cut inside an emoji) is not finished by what comes after them, so its carried bytes
    /// are dropped (they would turn the next output's first character into U+FFFD).
    pub fn prefilled(&mut self, tokens: &[Token], output: Option<&Output>) {
        if let Some(output) = output {
            self.logits.set_output(output.as_ref());
        }
        let the_accepted_one = tokens.len() == 1 && self.accepted_undecoded == Some(tokens[0]);
        self.decoded(tokens);
        self.accepted_undecoded = None;
        if !the_accepted_one {
            self.utf8 = Utf8Carry::default();
        }
    }

    /// The unfinished character carried to the next token's text (`prefilled` drops it).
    pub fn utf8_carry(&self) -> Utf8Carry {
        self.utf8.clone()
    }

    /// Carry `carry` again: a re-prefill of the branch's own tokens (`reseed_context`)
    /// leaves its output where it was.
    pub fn set_utf8_carry(&mut self, carry: Utf8Carry) {
        self.utf8 = carry;
    }

    /// The branch's KV sequence was emptied: it starts again at position 0 (sampler,
    /// grammar, biases and metrics carry on). Returns the record of what it held, for
    /// `sequence_restored` should the sequence's cells be put back.
    pub fn sequence_emptied(&mut self) -> SequenceRecord {
        SequenceRecord {
            position: std::mem::replace(&mut self.position, 0),
            history: std::mem::take(&mut self.history),
            checkpoints: std::mem::take(&mut self.checkpoints),
            // What is prefilled again runs under the current set.
            adapters_from: std::mem::replace(&mut self.adapters_from, 0),
        }
    }

    /// The cells `sequence_emptied` removed are back (a failed re-prefill undone).
    pub fn sequence_restored(&mut self, record: SequenceRecord) {
        self.position = record.position;
        self.history = record.history;
        self.checkpoints = record.checkpoints;
        self.adapters_from = record.adapters_from;
    }

    /// The sequence's cells are gone for good, and the logits read from them with them: the
    /// branch has none until its next prefill.
    pub fn forget_logits(&mut self) {
        self.logits.forget();
    }

    // ---- recurrent-state checkpoints (engine thread) ----

    /// Keep `state`, the recurrent state after `pos` tokens of the history; false when it
    /// alone is over `budget`.
    pub fn keep_checkpoint(&mut self, pos: u32, state: Arc<[u8]>, budget: Budget) -> bool {
        let bytes = state.len();
        self.checkpoints.insert(pos, bytes, state, budget)
    }

    /// Forget the checkpoints after `pos` (a decode past it was rolled back).
    pub fn forget_checkpoints_after(&mut self, pos: u32) {
        self.checkpoints.truncate(pos);
    }

    /// The last checkpoint at or before `pos`: its position and state.
    pub fn checkpoint_at_or_before(&self, pos: u32) -> Option<(u32, Arc<[u8]>)> {
        self.checkpoints
            .at_or_before(pos)
            .map(|c| (c.pos, c.state.clone()))
    }

    /// The checkpoints up to `pos`, for a branch that shares this one's first `pos` tokens
    /// (the states are shared, not copied).
    pub fn checkpoints_upto(&self, pos: u32) -> Checkpoints<Arc<[u8]>> {
        let mut c = self.checkpoints.clone();
        c.truncate(pos);
        c
    }

    /// Take checkpoints `checkpoints_upto` gave (the sequence shares those tokens).
    pub fn set_checkpoints(&mut self, checkpoints: Checkpoints<Arc<[u8]>>) {
        self.checkpoints = checkpoints;
    }

    /// The states of the checkpoints kept (forks share them).
    pub fn checkpoint_states(&self) -> impl Iterator<Item = &Arc<[u8]>> {
        self.checkpoints.iter().map(|c| &c.state)
    }

    // ---- the logits row ----

    /// Replace the snapshot with a copy of `row`.
    pub fn set_logits(&mut self, row: &[f32]) {
        self.logits.set(row);
    }

    /// Replace the snapshot with a decode's output (a row, copied, or a device draw).
    pub fn set_output(&mut self, output: OutputRef<'_>) {
        self.logits.set_output(output);
    }

    /// The snapshot as a buffer of its own (a lent row is copied out first).
    pub fn logits_shared(&mut self) -> Option<Arc<[f32]>> {
        self.logits.shared()
    }

    /// A decode of this branch is about to rewrite llama.cpp's output buffer: a lent row is
    /// in flight (not read) until `land_row`.
    pub fn take_off_row(&mut self) {
        self.logits.take_off();
    }

    /// The decode was queued and its step answered before its outputs land: no row is
    /// readable until `land_row` (`engine/landing.rs`).
    pub fn hold_row(&mut self) {
        self.logits.hold();
    }

    /// The decode is over: the row (new, or the old one of a failed decode) is readable.
    pub fn land_row(&mut self) {
        self.logits.land();
    }

    /// Read a decode's row where llama.cpp wrote it instead of copying it, with its summary
    /// and its best `top_k` logits for the sampler (`top`, best first).
    ///
    /// # Safety
    /// As for `LogitsSnapshot::lend`: the row stays valid, and unwritten while the snapshot is
    /// not in flight, until the engine gives the loan back (`engine/loans.rs`).
    pub unsafe fn lend_row(
        &mut self,
        row: &[f32],
        top_k: usize,
        summary: RowSummary,
        top: Vec<u32>,
    ) {
        // SAFETY: the caller keeps the contract of `lend`, which is this function's.
        unsafe { self.logits.lend(row, top_k, summary, top) }
    }

    /// A lent row becomes a copy of its own (before a decode overwrites it).
    pub fn give_back_row(&mut self) {
        self.logits.give_back();
    }

    /// Forget a lent row that is no longer valid: no logits until the next decode.
    pub fn forget_row_loan(&mut self) {
        self.logits.forget_loan();
    }

    // ---- sampler, grammar, biases ----

    /// Rebuild the chain with new params (a no-op when equal); the penalty window is
    /// replayed from the accepted tokens.
    pub fn set_sampler_params(&mut self, params: &SamplingParams, model: &Model) -> Result<()> {
        if self.sampler.params() == params {
            return Ok(());
        }
        let r = self.sampler.rebuild(params, model, &self.accepted);
        self.touch_sampler();
        r
    }

    /// Replace (or remove) the grammar; it starts from the tokens accepted from now on.
    pub fn set_grammar(&mut self, grammar: Option<Grammar>) {
        self.grammar = grammar;
        self.grammar_since = self.accepted.len();
        self.touch_sampler();
    }

    pub fn set_logit_bias(&mut self, bias: Vec<(Token, f32)>) {
        self.logit_bias = Biases::new(bias);
        self.sampler_epoch += 1;
    }

    pub fn logit_bias(&self) -> &[(Token, f32)] {
        self.logit_bias.pairs()
    }

    pub fn set_steer(&mut self, steer: Vec<(Token, f32)>) {
        self.steer = Biases::new(steer);
        self.sampler_epoch += 1;
    }

    pub fn steer(&self) -> &[(Token, f32)] {
        self.steer.pairs()
    }

    /// A new RNG seed for the sampler, keeping everything else.
    pub fn reseed(&mut self, seed: u32) {
        self.sampler.reseed(seed);
        self.touch_sampler();
    }

    /// Call after replacing the sampler or grammar.
    fn touch_sampler(&mut self) {
        self.sampler_epoch += 1;
    }

    // ---- sampling ----

    /// Fill the candidates with constraint → bias → steer → filter chain applied.
    fn filter_candidates(&mut self) -> Result<()> {
        if let Some(d) = self.logits.drawn() {
            let best = d.best.clone();
            return self.take_drawn(&best);
        }
        let logits = self.logits.require()?;
        let snap = &self.logits;
        let lists = [&self.logit_bias, &self.steer];
        let c = &mut self.candidates;
        // Whether the candidates are the whole vocabulary in token order.
        let whole = match Gathering::of(&self.sampler, self.grammar.as_mut(), &lists, logits.len())
        {
            Gathering::Argmax => {
                c.argmax(logits, snap.argmax());
                false
            }
            Gathering::Top(k) => {
                c.top(snap, logits, k, &lists);
                false
            }
            Gathering::Guided(k, g) => {
                let best = snap.argmax();
                match k {
                    // Greedy whose best raw token is legal: no pass over the row at all.
                    1 if lists.iter().all(|l| l.is_empty()) && g.allows(best as Token) => {
                        c.argmax(logits, best)
                    }
                    _ => c.top_guided(snap, logits, k, &lists, g),
                }
                false
            }
            Gathering::Allowed(g) => {
                c.allowed(logits, g);
                false
            }
            Gathering::TopLegal(k, g) => c.top_legal(snap, logits, k, &lists, g),
            Gathering::Whole(g) => {
                c.whole(logits);
                c.constrain(g, 0);
                true
            }
        };
        c.add_biases(&lists, whole);
        self.filter_gathered()
    }

    /// `filter_candidates` after a device draw: the best `k` the device kept, for a chain
    /// that draws from them (`device_k`), as `Gathering::Top` takes them from a row. Any
    /// other chain needs the row, which a decode gives when asked before (`needs_row`); this
    /// output was drawn before the chain needed it.
    fn take_drawn(&mut self, best: &[(Token, f32)]) -> Result<()> {
        let k = self
            .device_k(best.len())
            .ok_or_else(LogitsSnapshot::drawn_before_needed)?;
        self.candidates.drawn(best, k);
        self.filter_gathered()
    }

    /// How many of the `kept` candidates a device keeps of a row this branch's chain draws
    /// from (greedy: 1), or None when it needs the whole row: a grammar, a bias or steer (a
    /// biased token's raw logit may lie outside the candidates), or a chain that draws from
    /// more than `kept` (`top_k` 0 or above it).
    fn device_k(&mut self, kept: usize) -> Option<usize> {
        let lists = [&self.logit_bias, &self.steer];
        if lists.iter().any(|l| !l.is_empty()) {
            return None;
        }
        match Gathering::of(&self.sampler, self.grammar.as_mut(), &lists, usize::MAX) {
            Gathering::Argmax => Some(1),
            Gathering::Top(k) if k <= kept => Some(k),
            _ => None,
        }
    }

    /// Whether the branch's chain needs a whole row to sample from, in a device-sampling
    /// context that keeps `kept` candidates of each row (see `device_k`).
    pub fn chain_needs_row(&mut self, kept: usize) -> bool {
        self.device_k(kept).is_none()
    }

    /// Whether the branch's next output must be a whole row: its chain needs one, or its
    /// rows are read.
    pub fn needs_row(&mut self, kept: usize) -> bool {
        self.reads_rows || self.chain_needs_row(kept)
    }

    /// Its rows are read: its outputs are rows from now on.
    pub fn read_rows(&mut self) {
        self.reads_rows = true;
    }

    /// Run the chain's filters over the gathered candidates and cache their log-partition.
    fn filter_gathered(&mut self) -> Result<()> {
        let c = &mut self.candidates;
        // llama.cpp's filters drop -inf candidates and then assert on an empty array.
        if !c.any_finite() {
            return Err(self.nothing_to_sample());
        }
        let mut cur = c.array();
        self.sampler.filter(&mut cur, self.sampler_epoch);
        c.keep(&cur);
        if !c.any_finite() {
            return Err(self.nothing_to_sample());
        }
        self.cache = FilteredCache {
            key: Some((self.logits.version(), self.sampler_epoch)),
            lse: c.log_sum_exp(),
        };
        Ok(())
    }

    fn nothing_to_sample(&self) -> Error {
        if self.grammar.is_some() {
            Error::Grammar("no token satisfies the grammar at this point".into())
        } else {
            Error::Other(
                "every candidate token is masked (all logits -inf, or logit bias / steer of -inf)"
                    .into(),
            )
        }
    }

    /// How many of the best raw logits the next `sample` reads (0: none, or all of them), so a
    /// decode's summary pass can collect them while the row is in cache.
    pub fn top_hint(&mut self) -> usize {
        let lists = [&self.logit_bias, &self.steer];
        let n_vocab = self.logits.row().map_or(usize::MAX, <[f32]>::len);
        let window = match Gathering::of(&self.sampler, self.grammar.as_mut(), &lists, n_vocab) {
            Gathering::Top(k) => k,
            Gathering::Guided(k, _) => guided_window(k),
            Gathering::TopLegal(k, _) => legal_window(k),
            Gathering::Argmax | Gathering::Allowed(_) | Gathering::Whole(_) => return 0,
        };
        // `Candidates::top` asks for the window plus the biased tokens.
        window + biased_count(&lists)
    }

    /// Whether sampling walks the whole vocabulary (grammar, or a chain that cannot be cut to
    /// its top-k first): milliseconds per token instead of microseconds.
    pub fn sampling_is_heavy(&self) -> bool {
        self.grammar.is_some() || self.sampler.prefilter_k().is_none()
    }

    /// What the next draws change (`rewind_draws` undoes them).
    pub fn draws(&self) -> Draws {
        self.sampler.draws()
    }

    /// Undo the draws since `before` (a failed step's: see `SamplerChain::rewind`).
    pub fn rewind_draws(&mut self, before: Draws) {
        self.sampler.rewind(before);
    }

    /// Draw a token from the snapshot. Mutates only the RNG of stochastic terminals (and a
    /// waiting lazy grammar's set of refused tokens).
    pub fn sample(&mut self, model: &Model) -> Result<Token> {
        loop {
            self.filter_candidates()?;
            let before = self.sampler.draws();
            let mut cur = self.candidates.array();
            let token = self.sampler.select(&mut cur);
            // The token would fire a lazy grammar's trigger on text the grammar refuses: it is
            // masked now (as an active grammar masks), so draw again without it. Each round
            // masks one more token, so the loop ends (at worst "no token satisfies").
            let refused = match self.grammar.as_mut() {
                Some(g) => g.trigger_refuses(model, token)?,
                None => false,
            };
            if !refused {
                return Ok(token);
            }
            // The same random number picks among the rest.
            self.sampler.rewind(before);
        }
    }

    /// `sample`, with the token's text and whether it ends generation (the text is a
    /// preview: the UTF-8 carry is not consumed).
    pub fn produce(&mut self, model: &Model) -> Result<Produced> {
        let token = self.sample(model)?;
        Ok(Produced {
            token,
            text: self.token_text(model, token, false)?,
            is_stop: model.is_eog(token),
        })
    }

    /// Surprisal of `token` under the filtered distribution (0 if one candidate, ∞ if filtered out).
    fn sampling_surprisal(&mut self, token: Token) -> Result<f64> {
        if self.cache.key != Some((self.logits.version(), self.sampler_epoch)) {
            self.filter_candidates()?;
        }
        let data = &self.candidates.data;
        let finite = data.iter().filter(|c| c.logit.is_finite()).count();
        match data.iter().find(|c| c.id == token && c.logit.is_finite()) {
            None => Ok(f64::INFINITY),
            Some(_) if finite == 1 => Ok(0.0),
            Some(c) => Ok(self.cache.lse - c.logit as f64),
        }
    }

    /// `Branch::accept`: accept `token` now, decode it later (a commit of the same token then
    /// only decodes it). All or nothing: a refused token leaves the branch as it was.
    pub fn accept_ahead(&mut self, model: &Model, token: Token) -> Result<()> {
        let before = self.snapshot();
        self.accept(model, token)
            .inspect_err(|_| self.restore(before))?;
        self.accepted_undecoded = Some(token);
        Ok(())
    }

    /// The accept half of a commit: `accept`, unless `Branch::accept` already took this
    /// very token (then it is only decoded). Refuses a different token while one is pending.
    pub fn accept_for_commit(&mut self, model: &Model, token: Token) -> Result<()> {
        match self.accepted_undecoded.take() {
            None => self.accept(model, token),
            Some(t) if t == token => Ok(()),
            Some(t) => {
                self.accepted_undecoded = Some(t);
                Err(Error::Other(format!(
                    "token {t} was accept()ed (on this branch, or on the one it was forked \
                     from before the fork) but never decoded, and now {token} is being \
                     committed: commit({t}) decodes it without counting it twice (or use \
                     commit alone, which accepts and decodes)"
                )))
            }
        }
    }

    /// Record an accepted token: grammar, both perplexities, penalty window, history.
    /// On error nothing is changed except possibly the grammar (callers restore a snapshot).
    pub fn accept(&mut self, model: &Model, token: Token) -> Result<()> {
        model.check_token(token)?;
        let model_s = self.logits.surprisal(token)?;
        let sampling_s = self.sampling_surprisal(token)?;
        if let Some(g) = self.grammar.as_mut() {
            g.accept(model, token)?;
        }
        self.sampler.accept(token);
        self.token_text(model, token, true)?;
        self.ppl_model.add(model_s);
        self.ppl_sampling.add(sampling_s);
        self.accepted.push(token);
        self.sampler_epoch += 1;
        Ok(())
    }

    /// The text a token adds to this branch's output: complete UTF-8 characters only, with an
    /// unfinished multi-byte character carried over to the next token. `commit` says whether
    /// the carry is updated (accepted tokens) or left alone (a preview in `produce`).
    fn token_text(&mut self, model: &Model, token: Token, commit: bool) -> Result<String> {
        Ok(self.utf8.push(&model.token_to_bytes(token, false)?, commit))
    }
}

/// Where a branch's candidates come from, given its chain, constraint and biases.
enum Gathering<'g> {
    /// Greedy, unbiased, unconstrained: the argmax the summary pass found.
    Argmax,
    /// The chain cuts to its top `k` first.
    Top(usize),
    /// A llguidance constraint under a chain that cuts to `k`.
    Guided(usize, &'g mut Guided),
    /// A llguidance constraint under a chain over the whole vocabulary: the mask's set.
    Allowed(&'g mut Guided),
    /// A llama.cpp grammar under a chain that cuts to `k`.
    TopLegal(usize, &'g mut Grammar),
    /// The whole vocabulary, under the grammar if any.
    Whole(Option<&'g mut Grammar>),
}

impl<'g> Gathering<'g> {
    fn of(
        sampler: &SamplerChain,
        grammar: Option<&'g mut Grammar>,
        lists: &[&Biases; 2],
        n_vocab: usize,
    ) -> Self {
        let unbiased = lists.iter().all(|l| l.is_empty());
        match (sampler.prefilter_k(), grammar) {
            (k, Some(g)) if g.is_guided() => {
                let g = g.guided().expect("checked");
                match k {
                    Some(k) if k < n_vocab => Gathering::Guided(k, g),
                    _ => Gathering::Allowed(g),
                }
            }
            (Some(1), None) if unbiased => Gathering::Argmax,
            (Some(k), None) if k < n_vocab => Gathering::Top(k),
            (Some(k), Some(g)) if k < n_vocab => Gathering::TopLegal(k, g),
            (_, g) => Gathering::Whole(g),
        }
    }
}
