//! The per-branch llama.cpp sampler chain: filters (penalties → DRY → top-n-σ → top-k →
//! typical → top-p → min-p → XTC → temperature) then a terminal that draws the token.

use std::ffi::CString;

use llama_cpp_sys_2 as sys;

use super::llama_sampler::RawSampler;
use super::params::SamplingParams;
use super::stochastic::{self, Rng};
use crate::error::{Error, Result};
use crate::model::{Model, Token};

/// Sequence breakers of DRY (llama.cpp's defaults).
const DRY_BREAKERS: [&str; 4] = ["\n", ":", "\"", "*"];

/// A branch's sampler chain. Cloning copies all state, the RNG included.
#[derive(Clone)]
pub(crate) struct SamplerChain {
    params: SamplingParams,
    seed: u32,
    /// The deterministic llama.cpp filters (penalties … min-p); None when there are none.
    filters: Option<RawSampler>,
    /// Draws of XTC and the terminal (see `stochastic.rs`).
    rng: Rng,
    /// XTC's roll of a step (the branch's sampler epoch), drawn once however often that
    /// step's candidates are filtered (a row replaced between `produce` and `commit` is
    /// filtered again): the RNG stream stays that of one draw a step.
    xtc_roll: Option<(u64, f64)>,
    /// Mirostat's running target (2·tau at the start).
    mu: f32,
    n_vocab: usize,
}

/// The random and adaptive state of a chain, as `Branch.save` writes it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct DrawState {
    pub seed: u32,
    pub rng: [u64; 4],
    pub mu: f32,
}

/// What a draw changes in a chain (its RNG, XTC's roll, Mirostat's mu): taken before a draw,
/// it undoes it (`SamplerChain::rewind`).
#[derive(Clone, Copy)]
pub(crate) struct Draws {
    rng: Rng,
    xtc_roll: Option<(u64, f64)>,
    mu: f32,
}

/// A penalty window: -1 means the whole context (`whole` tokens).
/// The longest penalty window: 8 MiB of DRY's ring buffer a branch.
const MAX_WINDOW: u32 = 1 << 20;

/// A penalty window for llama.cpp: -1 is `whole` (the training context), and so is anything
/// longer (its samplers allocate their whole window up front: 2**31 would be gigabytes per
/// branch, and an allocation failure aborts the process).
fn resolve_window(last_n: i32, whole: i32) -> i32 {
    if last_n < 0 {
        whole
    } else {
        last_n.min(whole)
    }
}

/// A fresh random seed (for `seed=None`).
pub(crate) fn random_seed() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
    );
    h.finish() as u32
}

impl SamplerChain {
    pub fn new(params: &SamplingParams, model: &Model) -> Result<Self> {
        params.validate()?;
        let seed = params.seed.unwrap_or_else(random_seed);
        Ok(Self::build(params, seed, model))
    }

    fn build(p: &SamplingParams, seed: u32, model: &Model) -> Self {
        let n_vocab = model.vocab_size() as i32;
        // llama.cpp clamps a window of -1 to 0 (disabled); we mean "the whole context" (what
        // the model was trained on, which a GGUF could make absurd: bounded).
        let whole = model.n_ctx_train().clamp(1, MAX_WINDOW) as i32;
        let mut stages: Vec<*mut sys::llama_sampler> = Vec::new();
        // SAFETY: each init takes plain values (`validate` checked them) and returns a new
        // sampler that `stages` owns until the chain below takes it. DRY reads the live
        // vocabulary and copies the breaker strings, NUL-terminated and alive for the call in
        // `breakers`, with `ptrs` giving their count.
        unsafe {
            if !p.penalties_neutral() {
                stages.push(sys::llama_sampler_init_penalties(
                    n_vocab,
                    resolve_window(p.penalty_last_n, whole),
                    p.repeat_penalty,
                    p.frequency_penalty,
                    p.presence_penalty,
                ));
            }
            if p.dry_enabled() {
                let breakers: Vec<CString> = DRY_BREAKERS
                    .iter()
                    .map(|s| CString::new(*s).unwrap())
                    .collect();
                let mut ptrs: Vec<*const std::ffi::c_char> =
                    breakers.iter().map(|s| s.as_ptr()).collect();
                stages.push(sys::llama_sampler_init_dry(
                    model.vocab_ptr(),
                    p.dry_multiplier,
                    p.dry_base,
                    p.dry_allowed_length,
                    resolve_window(p.dry_penalty_last_n, whole),
                    ptrs.as_mut_ptr(),
                    ptrs.len(),
                ));
            }
            // The truncation filters; XTC and temperature follow in Rust (`filter`).
            if !p.is_greedy() && p.mirostat == 0 {
                if p.top_n_sigma > 0.0 {
                    stages.push(sys::llama_sampler_init_top_n_sigma(p.top_n_sigma));
                }
                if p.top_k > 0 {
                    stages.push(sys::llama_sampler_init_top_k(p.top_k));
                }
                if p.typical_p < 1.0 {
                    stages.push(sys::llama_sampler_init_typical(p.typical_p, 1));
                }
                if p.top_p < 1.0 {
                    stages.push(sys::llama_sampler_init_top_p(p.top_p, 1));
                }
                if p.min_p > 0.0 {
                    stages.push(sys::llama_sampler_init_min_p(p.min_p, 1));
                }
            }
        }
        let filters = if stages.is_empty() {
            None
        } else {
            // SAFETY: returns default params by value, then a new empty chain we own.
            let chain = unsafe {
                let mut cp = sys::llama_sampler_chain_default_params();
                cp.no_perf = true;
                sys::llama_sampler_chain_init(cp)
            };
            for s in stages {
                // SAFETY: `chain` is the live chain just made; `s` a live sampler owned by no
                // one else, whose ownership passes to the chain (it frees its members).
                unsafe { sys::llama_sampler_chain_add(chain, s) };
            }
            // SAFETY: `chain` is live and owned by nothing else (its members belong to it).
            unsafe { RawSampler::from_raw(chain) }
        };
        SamplerChain {
            params: p.clone(),
            seed,
            filters,
            rng: Rng::from_seed(seed),
            xtc_roll: None,
            mu: 2.0 * p.mirostat_tau,
            n_vocab: model.vocab_size(),
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Whether the candidates may be cut to the `top_k` best before the chain runs
    /// without changing its result (nothing before top-k rewrites logits).
    pub fn prefilter_k(&self) -> Option<usize> {
        let p = &self.params;
        let rewrites_first = !p.penalties_neutral() || p.dry_enabled() || p.mirostat != 0;
        if rewrites_first {
            return None;
        }
        if p.is_greedy() {
            return Some(1);
        }
        (p.top_k > 0 && p.top_n_sigma <= 0.0).then_some(p.top_k as usize)
    }

    /// Run the filters over `cur` (in place): llama.cpp's, then XTC and temperature. `step`
    /// is the branch's sampler epoch (one per accepted token).
    pub fn filter(&mut self, cur: &mut sys::llama_token_data_array, step: u64) {
        if let Some(f) = self.filters.as_mut() {
            f.apply(cur);
        }
        let p = &self.params;
        if p.is_greedy() {
            return;
        }
        if p.mirostat == 0 {
            let (rng, memo) = (&mut self.rng, &mut self.xtc_roll);
            let roll = || match *memo {
                Some((at, roll)) if at == step => roll,
                _ => {
                    let roll = rng.uniform();
                    *memo = Some((step, roll));
                    roll
                }
            };
            let cut = stochastic::xtc(window(cur), p.xtc_probability, p.xtc_threshold, roll);
            // SAFETY: `xtc` returns 0 or less than the window's length, so `data + cut` stays
            // inside the buffer `cur` describes and `size - cut` entries remain after it.
            cur.data = unsafe { cur.data.add(cut) };
            cur.size -= cut;
        }
        stochastic::temperature(window(cur), p.temperature);
    }

    /// Draw the token from filtered candidates (at least one finite).
    pub fn select(&mut self, cur: &mut sys::llama_token_data_array) -> Token {
        let p = &self.params;
        let c = window(cur);
        let i = match p.mirostat {
            _ if p.is_greedy() => stochastic::argmax(c),
            0 => stochastic::dist(c, &mut self.rng),
            1 => stochastic::mirostat_v1(
                c,
                self.n_vocab,
                p.mirostat_tau,
                p.mirostat_eta,
                &mut self.mu,
                &mut self.rng,
            ),
            _ => stochastic::mirostat_v2(
                c,
                p.mirostat_tau,
                p.mirostat_eta,
                &mut self.mu,
                &mut self.rng,
            ),
        };
        c[i].id
    }

    /// Feed an accepted token to the stateful filters (penalty window, DRY).
    pub fn accept(&mut self, token: Token) {
        if let Some(f) = self.filters.as_mut() {
            f.accept(token);
        }
    }

    /// New RNG seed; everything else (penalty/DRY history, Mirostat's mu) carries on.
    pub fn reseed(&mut self, seed: u32) {
        self.seed = seed;
        self.rng = Rng::from_seed(seed);
        self.xtc_roll = None;
    }

    /// Take new params. The RNG stream and Mirostat's mu carry on, unless the params name a
    /// new seed (a fresh stream) or switch Mirostat on (mu starts at 2·tau). Only what changed
    /// is rebuilt: params that llama.cpp's filters do not read (temperature, XTC, Mirostat's
    /// tau and eta, seed) keep the filters as they are, penalty and DRY state included; other
    /// changes rebuild the filters and replay `history` into them.
    pub fn rebuild(
        &mut self,
        params: &SamplingParams,
        model: &Model,
        history: &[Token],
    ) -> Result<()> {
        params.validate()?;
        let new_seed = params.seed.filter(|_| params.seed != self.params.seed);
        if filter_key(params) == filter_key(&self.params) {
            self.params = params.clone();
            if let Some(seed) = new_seed {
                self.reseed(seed);
            }
            return Ok(());
        }
        let mut next = Self::build(params, new_seed.unwrap_or(self.seed), model);
        if new_seed.is_none() {
            next.rng = self.rng;
            next.xtc_roll = self.xtc_roll;
        }
        if self.params.mirostat != 0 && params.mirostat != 0 {
            next.mu = self.mu;
        }
        next.replay(history);
        *self = next;
        Ok(())
    }

    /// What the next draws change, to `rewind` them.
    pub fn draws(&self) -> Draws {
        Draws {
            rng: self.rng,
            xtc_roll: self.xtc_roll,
            mu: self.mu,
        }
    }

    /// Undo the draws since `before`: the next draws repeat them (a step that failed leaves a
    /// seeded branch drawing what it would have drawn without it).
    pub fn rewind(&mut self, before: Draws) {
        self.rng = before.rng;
        self.xtc_roll = before.xtc_roll;
        self.mu = before.mu;
    }

    pub fn draw_state(&self) -> DrawState {
        DrawState {
            seed: self.seed,
            rng: self.rng.state(),
            mu: self.mu,
        }
    }

    /// A chain in the state `draw_state` described, its filters fed `history`.
    pub fn restore(
        params: &SamplingParams,
        state: DrawState,
        model: &Model,
        history: &[Token],
    ) -> Result<Self> {
        params.validate()?;
        let rng = Rng::from_state(state.rng)
            .ok_or_else(|| Error::Other("the saved RNG state is invalid".into()))?;
        let mut chain = Self::build(params, state.seed, model);
        chain.rng = rng;
        chain.mu = state.mu;
        chain.replay(history);
        Ok(chain)
    }

    fn replay(&mut self, history: &[Token]) {
        let window = self
            .params
            .penalty_last_n
            .max(self.params.dry_penalty_last_n);
        let start = if window < 0 {
            0
        } else {
            history.len().saturating_sub(window as usize)
        };
        if let Some(f) = self.filters.as_mut() {
            for &t in &history[start..] {
                f.accept(t);
            }
        }
    }
}

/// `p` reduced to what `SamplerChain::build` reads for llama.cpp's filters: equal keys build
/// equal filters. (Temperature matters only as greedy or not.)
fn filter_key(p: &SamplingParams) -> SamplingParams {
    SamplingParams {
        temperature: if p.is_greedy() { 0.0 } else { 1.0 },
        seed: None,
        mirostat_tau: 0.0,
        mirostat_eta: 0.0,
        xtc_probability: 0.0,
        xtc_threshold: 0.0,
        ..p.clone()
    }
}

/// The candidates of `cur` as a slice. `cur` describes `size` initialised entries of a buffer
/// borrowed for at least as long as `cur` (as `RawSampler::apply` requires: kvfork builds every
/// such array from a live slice right before sampling).
fn window(cur: &mut sys::llama_token_data_array) -> &mut [sys::llama_token_data] {
    // SAFETY: by the contract above `data` is valid for `size` entries; llama.cpp's filters and
    // `filter` only shrank `size` or moved `data` forward within the buffer. The slice borrows
    // `cur` mutably, so no second slice of the same entries exists while it lives.
    unsafe { std::slice::from_raw_parts_mut(cur.data, cur.size) }
}
