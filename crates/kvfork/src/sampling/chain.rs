//! The per-branch llama.cpp sampler chain: filters (penalties → DRY → top-n-σ → top-k →
//! typical → top-p → min-p → XTC → temperature) then a terminal that draws the token.

use std::ffi::CString;

use llama_cpp_sys_2 as sys;

use super::params::SamplingParams;
use super::raw::RawSampler;
use crate::error::Result;
use crate::model::{Model, Token};

/// Sequence breakers of DRY (llama.cpp's defaults).
const DRY_BREAKERS: [&str; 4] = ["\n", ":", "\"", "*"];

/// Draws the token from the filtered candidates.
#[derive(Clone)]
enum Terminal {
    /// Argmax, done in Rust.
    Greedy,
    /// `dist` or a Mirostat sampler (stateful: RNG, mu).
    Llama(RawSampler),
}

/// A branch's sampler chain. Cloning copies all state, the RNG included.
#[derive(Clone)]
pub(crate) struct SamplerChain {
    params: SamplingParams,
    seed: u32,
    filters: Option<RawSampler>,
    terminal: Terminal,
}

/// A penalty window: -1 means the whole context (`whole` tokens).
fn resolve_window(last_n: i32, whole: i32) -> i32 {
    if last_n < 0 {
        whole
    } else {
        last_n
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
        // llama.cpp clamps a window of -1 to 0 (disabled); we mean "the whole context".
        let whole = model.n_ctx_train().max(1) as i32;
        let mut stages: Vec<*mut sys::llama_sampler> = Vec::new();
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
            if !p.is_greedy() {
                if p.mirostat == 0 {
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
                    if p.xtc_probability > 0.0 {
                        stages.push(sys::llama_sampler_init_xtc(
                            p.xtc_probability,
                            p.xtc_threshold,
                            1,
                            seed,
                        ));
                    }
                }
                stages.push(sys::llama_sampler_init_temp(p.temperature.max(0.0)));
            }
        }
        let filters = if stages.is_empty() {
            None
        } else {
            let chain = unsafe {
                let mut cp = sys::llama_sampler_chain_default_params();
                cp.no_perf = true;
                sys::llama_sampler_chain_init(cp)
            };
            for s in stages {
                unsafe { sys::llama_sampler_chain_add(chain, s) };
            }
            RawSampler::from_raw(chain)
        };
        let terminal = match (p.is_greedy(), p.mirostat) {
            (true, _) => Terminal::Greedy,
            (false, 1) => Terminal::Llama(
                RawSampler::from_raw(unsafe {
                    sys::llama_sampler_init_mirostat(
                        n_vocab,
                        seed,
                        p.mirostat_tau,
                        p.mirostat_eta,
                        100,
                    )
                })
                .expect("mirostat init"),
            ),
            (false, 2) => Terminal::Llama(
                RawSampler::from_raw(unsafe {
                    sys::llama_sampler_init_mirostat_v2(seed, p.mirostat_tau, p.mirostat_eta)
                })
                .expect("mirostat_v2 init"),
            ),
            _ => Terminal::Llama(
                RawSampler::from_raw(unsafe { sys::llama_sampler_init_dist(seed) })
                    .expect("dist init"),
            ),
        };
        SamplerChain {
            params: p.clone(),
            seed,
            filters,
            terminal,
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

    /// Run the filters over `cur` (in place).
    pub fn filter(&mut self, cur: &mut sys::llama_token_data_array) {
        if let Some(f) = self.filters.as_mut() {
            f.apply(cur);
        }
    }

    /// Draw the token from filtered candidates (at least one finite).
    pub fn select(&mut self, cur: &mut sys::llama_token_data_array) -> Token {
        let data = unsafe { std::slice::from_raw_parts(cur.data, cur.size) };
        match &mut self.terminal {
            Terminal::Greedy => {
                let mut best = 0;
                for (i, c) in data.iter().enumerate() {
                    if c.logit > data[best].logit {
                        best = i;
                    }
                }
                data[best].id
            }
            Terminal::Llama(t) => {
                cur.selected = -1;
                t.apply(cur);
                let data = unsafe { std::slice::from_raw_parts(cur.data, cur.size) };
                let i = usize::try_from(cur.selected)
                    .ok()
                    .filter(|&i| i < data.len())
                    .unwrap_or(0);
                data[i].id
            }
        }
    }

    /// Feed an accepted token to the stateful stages (penalty window, DRY, Mirostat).
    pub fn accept(&mut self, token: Token) {
        if let Some(f) = self.filters.as_mut() {
            f.accept(token);
        }
        if let Terminal::Llama(t) = &mut self.terminal {
            t.accept(token);
        }
    }

    /// New RNG seed, keeping the penalty/DRY history (`history` is replayed into the rebuilt chain).
    pub fn reseed(&mut self, seed: u32, model: &Model, history: &[Token]) {
        *self = Self::build(&self.params.clone(), seed, model);
        self.replay(history);
    }

    /// Rebuild for new params (same seed unless the params name one), replaying history.
    pub fn rebuild(
        &mut self,
        params: &SamplingParams,
        model: &Model,
        history: &[Token],
    ) -> Result<()> {
        params.validate()?;
        let seed = params.seed.unwrap_or(self.seed);
        *self = Self::build(params, seed, model);
        self.replay(history);
        Ok(())
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
