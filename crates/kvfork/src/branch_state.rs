//! Everything one branch owns besides its KV cells: logits snapshot, sampler chain,
//! grammar, biases, perplexity trackers, accepted history. Guarded by one mutex per branch.

use std::sync::Arc;

use llama_cpp_sys_2 as sys;

mod persist;
pub(crate) use persist::state_error;

use kvfork_core::metrics::{self, Perplexity, RowSummary};

use crate::error::{Error, Result};
use crate::model::{Model, Token};
use crate::sampling::chain::SamplerChain;
use crate::sampling::grammar::{Grammar, GrammarUndo};

/// The filtered candidates of the last `sample`, reused by the `accept` that follows so the
/// chain runs once per token. Valid while the snapshot and the sampler state are unchanged.
#[derive(Default)]
struct FilteredCache {
    key: Option<(u64, u64)>,
    /// log-sum-exp over the finite filtered logits.
    lse: f64,
}

pub(crate) struct BranchState {
    pub seq: i32,
    pub position: i32,
    /// Shared with forks until either side gets new logits (a fork copies no row).
    logits: Arc<[f32]>,
    has_logits: bool,
    /// Bumped on every new snapshot.
    logits_version: u64,
    /// Bumped on every change of sampler, grammar, bias or steer.
    sampler_epoch: u64,
    /// Log-partition and argmax of the snapshot (valid with `has_logits`).
    summary: RowSummary,
    pub sampler: SamplerChain,
    pub grammar: Option<Grammar>,
    /// `accepted[grammar_since..]` are the tokens the grammar has accepted (persistence
    /// replays them to rebuild its parse state).
    grammar_since: usize,
    logit_bias: Vec<(Token, f32)>,
    steer: Vec<(Token, f32)>,
    pub ppl_model: Perplexity,
    pub ppl_sampling: Perplexity,
    /// Every accepted token, in order (penalty replay, persistence).
    pub accepted: Vec<Token>,
    /// A token `Branch::accept` recorded that no commit has decoded yet: a `commit` of the
    /// same token absorbs it (so it is not counted twice), any other token is refused.
    pub accepted_undecoded: Option<Token>,
    /// Bytes of an incomplete UTF-8 character carried to the next token's text.
    utf8_carry: Vec<u8>,
    candidates: Vec<sys::llama_token_data>,
    scratch: Vec<u32>,
    cache: FilteredCache,
}

/// What `commit` restores when the decode fails.
pub(crate) struct Snapshot {
    sampler: SamplerChain,
    grammar: Option<GrammarUndo>,
    ppl_model: Perplexity,
    ppl_sampling: Perplexity,
    accepted_len: usize,
    accepted_undecoded: Option<Token>,
    utf8_carry: Vec<u8>,
    sampler_epoch: u64,
}

impl BranchState {
    pub fn new(seq: i32, position: i32, sampler: SamplerChain, grammar: Option<Grammar>) -> Self {
        BranchState {
            seq,
            position,
            logits: Arc::from(Vec::new()),
            has_logits: false,
            logits_version: 0,
            sampler_epoch: 0,
            summary: RowSummary {
                log_sum_exp: f64::NEG_INFINITY,
                argmax: 0,
            },
            sampler,
            grammar,
            grammar_since: 0,
            logit_bias: Vec::new(),
            steer: Vec::new(),
            ppl_model: Perplexity::default(),
            ppl_sampling: Perplexity::default(),
            accepted: Vec::new(),
            accepted_undecoded: None,
            utf8_carry: Vec::new(),
            candidates: Vec::new(),
            scratch: Vec::new(),
            cache: FilteredCache::default(),
        }
    }

    /// Copy for a fork: everything but steer (dynamic, per branch) and scratch space.
    pub fn fork_copy(&self, seq: i32) -> Self {
        BranchState {
            seq,
            position: self.position,
            logits: self.logits.clone(),
            has_logits: self.has_logits,
            logits_version: self.logits_version,
            sampler_epoch: self.sampler_epoch + 1,
            summary: self.summary,
            sampler: self.sampler.clone(),
            grammar: self.grammar.clone(),
            grammar_since: self.grammar_since,
            logit_bias: self.logit_bias.clone(),
            steer: Vec::new(),
            ppl_model: self.ppl_model,
            ppl_sampling: self.ppl_sampling,
            accepted: self.accepted.clone(),
            accepted_undecoded: self.accepted_undecoded,
            utf8_carry: self.utf8_carry.clone(),
            candidates: Vec::new(),
            scratch: Vec::new(),
            cache: FilteredCache::default(),
        }
    }

    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            sampler: self.sampler.clone(),
            grammar: self.grammar.as_ref().map(Grammar::undo_point),
            ppl_model: self.ppl_model,
            ppl_sampling: self.ppl_sampling,
            accepted_len: self.accepted.len(),
            accepted_undecoded: self.accepted_undecoded,
            utf8_carry: self.utf8_carry.clone(),
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
        self.utf8_carry = s.utf8_carry;
        // A new epoch: the cache may describe the accepted (now undone) state.
        self.sampler_epoch = s.sampler_epoch.max(self.sampler_epoch) + 1;
    }

    // ---- logits snapshot ----

    pub fn logits(&self) -> Option<&[f32]> {
        self.has_logits.then_some(&self.logits[..])
    }

    pub fn logits_shared(&self) -> Option<Arc<[f32]>> {
        self.has_logits.then(|| self.logits.clone())
    }

    fn require_logits(&self) -> Result<&[f32]> {
        self.logits().ok_or_else(|| {
            Error::Other("the branch has no logits yet: prefill or commit a token first".into())
        })
    }

    /// Take a new snapshot; its log-partition and argmax come from the same pass as the copy.
    pub fn set_logits(&mut self, row: &[f32]) {
        let own = match Arc::get_mut(&mut self.logits) {
            Some(own) if own.len() == row.len() => own,
            // Shared with a fork (or first use): start a buffer of our own.
            _ => {
                self.logits = Arc::from(vec![0.0; row.len()]);
                Arc::get_mut(&mut self.logits).expect("a fresh Arc is unique")
            }
        };
        self.summary = metrics::copy_and_summarize(row, own);
        self.has_logits = true;
        self.logits_version += 1;
    }

    /// Model-level surprisal of `token` in nats, from the raw snapshot.
    pub fn surprisal(&self, token: Token) -> Result<f64> {
        let logit = self.require_logits()?[token as usize] as f64;
        Ok(if logit == f64::NEG_INFINITY {
            f64::INFINITY
        } else {
            self.summary.log_sum_exp - logit
        })
    }

    /// The `k` most likely tokens of the raw snapshot with their natural-log probabilities,
    /// best first (ties: lower token id first). Fewer when fewer logits are finite.
    pub fn top_logprobs(&self, k: usize) -> Result<Vec<(Token, f64)>> {
        let logits = self.require_logits()?;
        let mut idx = Vec::new();
        metrics::top_k_indices(logits, k.min(logits.len()), &mut idx);
        let lse = self.summary.log_sum_exp;
        let mut out: Vec<(Token, f64)> = idx
            .into_iter()
            .map(|i| (i as Token, f64::from(logits[i as usize]) - lse))
            .collect();
        out.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        Ok(out)
    }

    /// Entropy of the raw snapshot in nats.
    pub fn entropy(&self) -> Result<f64> {
        Ok(metrics::entropy(self.require_logits()?))
    }

    /// After `n` external tokens were decoded into the branch (`row`: the last one's logits).
    /// A token `accept`ed before is no longer waiting for its decode: the prefill was it.
    pub fn prefilled(&mut self, n: usize, row: Option<&[f32]>) {
        if let Some(row) = row {
            self.set_logits(row);
        }
        self.position += n as i32;
        self.accepted_undecoded = None;
    }

    /// Replace (or remove) the grammar; it starts from the tokens accepted from now on.
    pub fn set_grammar(&mut self, grammar: Option<Grammar>) {
        self.grammar = grammar;
        self.grammar_since = self.accepted.len();
        self.touch_sampler();
    }

    // ---- biases ----

    pub fn set_logit_bias(&mut self, bias: Vec<(Token, f32)>) {
        self.logit_bias = normalize_bias(bias);
        self.sampler_epoch += 1;
    }

    pub fn logit_bias(&self) -> &[(Token, f32)] {
        &self.logit_bias
    }

    pub fn set_steer(&mut self, steer: Vec<(Token, f32)>) {
        self.steer = normalize_bias(steer);
        self.sampler_epoch += 1;
    }

    pub fn steer(&self) -> &[(Token, f32)] {
        &self.steer
    }

    /// A new RNG seed for the sampler, keeping everything else.
    pub fn reseed(&mut self, seed: u32) {
        self.sampler.reseed(seed);
        self.touch_sampler();
    }

    /// Call after replacing the sampler or grammar.
    pub fn touch_sampler(&mut self) {
        self.sampler_epoch += 1;
    }

    // ---- sampling ----

    /// Push the `k` best raw logits among unbiased tokens, then every biased token (so the
    /// chain's own top-k still sees the true top-k of the biased logits). Returns how many
    /// unbiased ones lead the list.
    fn gather_top(&mut self, k: usize) -> usize {
        let logits = self.logits.clone();
        let n_biased = self.logit_bias.len() + self.steer.len();
        metrics::top_k_indices(&logits, k + n_biased, &mut self.scratch);
        self.candidates.clear();
        for &i in &self.scratch {
            if self.candidates.len() < k && !self.is_biased(i as Token) {
                self.candidates
                    .push(token_data(i as Token, logits[i as usize]));
            }
        }
        let kept = self.candidates.len();
        for &(t, _) in &self.logit_bias {
            self.candidates.push(token_data(t, logits[t as usize]));
        }
        for &(t, _) in &self.steer {
            if find_bias(&self.logit_bias, t).is_none() {
                self.candidates.push(token_data(t, logits[t as usize]));
            }
        }
        kept
    }

    fn is_biased(&self, t: Token) -> bool {
        find_bias(&self.logit_bias, t).is_some() || find_bias(&self.steer, t).is_some()
    }

    fn gather_all(&mut self) {
        self.candidates.clear();
        let logits = &self.logits;
        self.candidates.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &l)| token_data(i as Token, l)),
        );
    }

    /// Mask grammar-invalid candidates (in place, order kept); how many of the first `lead`
    /// stay finite.
    fn apply_grammar(&mut self, lead: usize) -> usize {
        if let Some(g) = self.grammar.as_mut() {
            g.apply(&mut self.candidates);
        }
        self.candidates[..lead.min(self.candidates.len())]
            .iter()
            .filter(|c| c.logit.is_finite())
            .count()
    }

    /// The k best grammar-valid tokens without running the grammar over the whole vocabulary
    /// (tens of milliseconds for 262k tokens) when a window of the best raw logits already
    /// holds k valid unbiased tokens: every token outside it scores lower, so the chain's
    /// top-k is unchanged. Otherwise (few legal tokens, e.g. JSON punctuation under a large
    /// top_k) the whole vocabulary. Returns whether it took the whole vocabulary.
    fn gather_top_valid(&mut self, k: usize) -> bool {
        let window = (8 * k).max(256);
        if window < self.logits.len() / 4 {
            let kept = self.gather_top(window);
            if self.apply_grammar(kept) >= k {
                return false;
            }
        }
        self.gather_all();
        self.apply_grammar(0);
        true
    }

    /// The k best tokens a llguidance constraint allows, plus the biased ones it allows: the
    /// best raw logits are tried one by one (microseconds each) until k are legal. Where the
    /// constraint allows few tokens (JSON punctuation, digits) more than `k / 4 + 4` refusals
    /// send it to the mask's allowed set instead. Exact: every token left out scores lower.
    fn gather_guided(&mut self, k: usize) {
        let budget = k / 4 + 4;
        let window = k + budget + 1;
        if window < self.logits.len() / 4 {
            let kept = self.gather_top(window);
            let g = self
                .grammar
                .as_mut()
                .and_then(Grammar::guided)
                .expect("guided");
            let head = &mut self.candidates[..kept];
            head.sort_unstable_by(|a, b| b.logit.total_cmp(&a.logit));
            let (mut legal, mut refused) = (0, 0);
            for read in 0..kept {
                if legal == k || refused > budget {
                    break;
                }
                let c = self.candidates[read];
                if g.allows(c.id) {
                    self.candidates[legal] = c;
                    legal += 1;
                } else {
                    refused += 1;
                }
            }
            if legal == k {
                let biased: Vec<_> = self.candidates[kept..]
                    .iter()
                    .copied()
                    .filter(|c| g.allows(c.id))
                    .collect();
                self.candidates.truncate(legal);
                self.candidates.extend(biased);
                return;
            }
        }
        self.gather_allowed();
    }

    /// Every token a llguidance constraint allows (its mask's set, usually small).
    fn gather_allowed(&mut self) {
        let g = self
            .grammar
            .as_mut()
            .and_then(Grammar::guided)
            .expect("guided");
        let logits = &self.logits;
        let candidates = &mut self.candidates;
        candidates.clear();
        g.allowed(|t| candidates.push(token_data(t, logits[t as usize])));
    }

    /// Fill `self.candidates` with grammar → bias → steer → filter chain applied.
    fn filter_candidates(&mut self) -> Result<()> {
        self.require_logits()?;
        let n_vocab = self.logits.len();
        let unbiased = self.logit_bias.is_empty() && self.steer.is_empty();
        // Whether the candidates are the whole vocabulary in token order.
        let guided = self.grammar.as_mut().is_some_and(|g| g.guided().is_some());
        let whole = match (self.sampler.prefilter_k(), self.grammar.is_some()) {
            (Some(k), true) if guided && k < n_vocab => {
                self.gather_guided(k);
                false
            }
            (_, true) if guided => {
                self.gather_allowed();
                false
            }
            // Greedy: the argmax was found while the snapshot was copied.
            (Some(1), false) if unbiased => {
                let i = self.summary.argmax;
                self.candidates.clear();
                self.candidates.push(token_data(i as Token, self.logits[i]));
                false
            }
            (Some(k), false) if k < n_vocab => {
                self.gather_top(k);
                false
            }
            (Some(k), true) if k < n_vocab => self.gather_top_valid(k),
            _ => {
                self.gather_all();
                self.apply_grammar(0);
                true
            }
        };
        let mut cur = token_array(&mut self.candidates);
        let data = unsafe { std::slice::from_raw_parts_mut(cur.data, cur.size) };
        apply_biases(&self.logit_bias, &self.steer, whole, data);
        // llama.cpp's filters drop -inf candidates and then assert on an empty array.
        if !data.iter().any(|c| c.logit.is_finite()) {
            return Err(self.nothing_to_sample());
        }
        self.sampler.filter(&mut cur);
        // Samplers may shrink the array (they only move `data` within our buffer).
        let (start, size) = (
            unsafe { cur.data.offset_from(self.candidates.as_ptr()) } as usize,
            cur.size,
        );
        self.candidates.truncate(start + size);
        self.candidates.drain(..start);
        if !self.candidates.iter().any(|c| c.logit.is_finite()) {
            return Err(self.nothing_to_sample());
        }
        let lse = log_sum_exp_candidates(&self.candidates);
        self.cache = FilteredCache {
            key: Some((self.logits_version, self.sampler_epoch)),
            lse,
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

    /// Whether sampling walks the whole vocabulary (grammar, or a chain that cannot be cut to
    /// its top-k first): milliseconds per token instead of microseconds.
    pub fn sampling_is_heavy(&self) -> bool {
        self.grammar.is_some() || self.sampler.prefilter_k().is_none()
    }

    /// Draw a token from the snapshot. Mutates only the RNG of stochastic terminals.
    pub fn sample(&mut self) -> Result<Token> {
        self.filter_candidates()?;
        let mut cur = token_array(&mut self.candidates);
        let token = self.sampler.select(&mut cur);
        Ok(token)
    }

    /// Surprisal of `token` under the filtered distribution (0 if one candidate, ∞ if filtered out).
    fn sampling_surprisal(&mut self, token: Token) -> Result<f64> {
        if self.cache.key != Some((self.logits_version, self.sampler_epoch)) {
            self.filter_candidates()?;
        }
        let finite = self
            .candidates
            .iter()
            .filter(|c| c.logit.is_finite())
            .count();
        match self
            .candidates
            .iter()
            .find(|c| c.id == token && c.logit.is_finite())
        {
            None => Ok(f64::INFINITY),
            Some(_) if finite == 1 => Ok(0.0),
            Some(c) => Ok(self.cache.lse - c.logit as f64),
        }
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
                    "token {t} was accept()ed but never decoded, and now {token} is being \
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
        let model_s = self.surprisal(token)?;
        let sampling_s = self.sampling_surprisal(token)?;
        if let Some(g) = self.grammar.as_mut() {
            g.accept(token)?;
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
    pub fn token_text(&mut self, model: &Model, token: Token, commit: bool) -> Result<String> {
        let piece = model.token_to_bytes(token, false)?;
        let mut bytes = self.utf8_carry.clone();
        bytes.extend_from_slice(&piece);
        let valid = match std::str::from_utf8(&bytes) {
            Ok(_) => bytes.len(),
            Err(e) if e.error_len().is_none() && bytes.len() - e.valid_up_to() < 4 => {
                e.valid_up_to()
            }
            Err(_) => bytes.len(), // invalid, not merely unfinished: emit lossily
        };
        let text = String::from_utf8_lossy(&bytes[..valid]).into_owned();
        if commit {
            self.utf8_carry = bytes[valid..].to_vec();
        }
        Ok(text)
    }
}

/// Add logit bias and steer (each sorted by token) to the candidates: by index when they are
/// the `whole` vocabulary in token order, else by binary search.
fn apply_biases(
    logit_bias: &[(Token, f32)],
    steer: &[(Token, f32)],
    whole: bool,
    data: &mut [sys::llama_token_data],
) {
    if logit_bias.is_empty() && steer.is_empty() {
        return;
    }
    if whole {
        for &(t, b) in logit_bias.iter().chain(steer) {
            data[t as usize].logit += b;
        }
        return;
    }
    for c in data.iter_mut() {
        c.logit +=
            find_bias(logit_bias, c.id).unwrap_or(0.0) + find_bias(steer, c.id).unwrap_or(0.0);
    }
}

/// The bias of `t` in a token-sorted bias list.
fn find_bias(list: &[(Token, f32)], t: Token) -> Option<f32> {
    list.binary_search_by_key(&t, |&(b, _)| b)
        .ok()
        .map(|i| list[i].1)
}

fn token_data(id: Token, logit: f32) -> sys::llama_token_data {
    sys::llama_token_data { id, logit, p: 0.0 }
}

fn token_array(c: &mut [sys::llama_token_data]) -> sys::llama_token_data_array {
    sys::llama_token_data_array {
        data: c.as_mut_ptr(),
        size: c.len(),
        selected: -1,
        sorted: false,
    }
}

fn log_sum_exp_candidates(c: &[sys::llama_token_data]) -> f64 {
    let max = c.iter().map(|c| c.logit).fold(f32::NEG_INFINITY, f32::max) as f64;
    if max == f64::NEG_INFINITY {
        return max;
    }
    let sum: f64 = c
        .iter()
        .filter(|c| c.logit.is_finite())
        .map(|c| (c.logit as f64 - max).exp())
        .sum();
    max + sum.ln()
}

/// Sort by token, last value wins for duplicates, zero biases dropped.
fn normalize_bias(mut bias: Vec<(Token, f32)>) -> Vec<(Token, f32)> {
    bias.reverse();
    bias.sort_by_key(|&(t, _)| t);
    bias.dedup_by_key(|&mut (t, _)| t);
    bias.retain(|&(_, b)| b != 0.0);
    bias
}
