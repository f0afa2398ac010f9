//! The candidate list a branch's sampler chain runs over, gathered from its snapshot in
//! llama.cpp's FFI layout: the argmax alone, the top k, the top k a constraint allows, a
//! constraint's allowed set, or the whole vocabulary, with logit bias and steer applied.

use kvfork_core::bias::{self, Biases};
use llama_cpp_sys_2 as sys;

use super::LogitsSnapshot;
use crate::model::Token;
use crate::sampling::grammar::Grammar;
use crate::sampling::guidance::Guided;

#[derive(Default)]
pub(crate) struct Candidates {
    pub data: Vec<sys::llama_token_data>,
    scratch: Vec<u32>,
}

/// Logit bias then steer: the two bias lists of a branch.
pub(crate) type BiasLists<'a> = [&'a Biases; 2];

fn is_biased(lists: &BiasLists<'_>, t: Token) -> bool {
    lists.iter().any(|l| l.contains(t))
}

/// How many tokens the two lists bias (a token in both counts twice: an upper bound).
pub(crate) fn biased_count(lists: &BiasLists<'_>) -> usize {
    lists[0].len() + lists[1].len()
}

/// The window of best raw logits `top_legal` tries a llama.cpp grammar on, for the chain's `k`.
pub(crate) fn legal_window(k: usize) -> usize {
    (8 * k).max(256)
}

/// The window of best raw logits `top_guided` tries a llguidance constraint on: `k` legal ones
/// plus at most `k / 4 + 4` refusals.
pub(crate) fn guided_window(k: usize) -> usize {
    k + guided_refusals(k) + 1
}

fn guided_refusals(k: usize) -> usize {
    k / 4 + 4
}

impl Candidates {
    /// The best `k` of the candidates the device kept (`sampling/device.rs`), best first.
    pub fn drawn(&mut self, best: &[(Token, f32)], k: usize) {
        self.data.clear();
        self.data
            .extend(best[..k].iter().map(|&(t, logit)| token_data(t, logit)));
    }

    /// The argmax alone (greedy, unbiased, unconstrained).
    pub fn argmax(&mut self, logits: &[f32], i: usize) {
        self.data.clear();
        self.data.push(token_data(i as Token, logits[i]));
    }

    /// The `k` best raw logits among unbiased tokens, best first, then every biased token (so
    /// the chain's own top-k still sees the true top-k of the biased logits). Returns how many
    /// unbiased ones lead the list.
    pub fn top(
        &mut self,
        snap: &LogitsSnapshot,
        logits: &[f32],
        k: usize,
        lists: &BiasLists<'_>,
    ) -> usize {
        snap.best(k + biased_count(lists), &mut self.scratch);
        self.data.clear();
        for &i in &self.scratch {
            if self.data.len() < k && !is_biased(lists, i as Token) {
                self.data.push(token_data(i as Token, logits[i as usize]));
            }
        }
        let kept = self.data.len();
        for &(t, _) in lists[0].pairs() {
            self.data.push(token_data(t, logits[t as usize]));
        }
        for &(t, _) in lists[1].pairs() {
            if !lists[0].contains(t) {
                self.data.push(token_data(t, logits[t as usize]));
            }
        }
        kept
    }

    /// Every token, in token order.
    pub fn whole(&mut self, logits: &[f32]) {
        self.data.clear();
        self.data.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &l)| token_data(i as Token, l)),
        );
    }

    /// Mask the candidates `grammar` forbids (in place, order kept); how many of the first
    /// `lead` stay finite.
    pub fn constrain(&mut self, grammar: Option<&mut Grammar>, lead: usize) -> usize {
        if let Some(g) = grammar {
            g.apply(&mut self.data);
        }
        self.data[..lead.min(self.data.len())]
            .iter()
            .filter(|c| c.logit.is_finite())
            .count()
    }

    /// The k best tokens a llama.cpp grammar allows without running it over the whole
    /// vocabulary (tens of milliseconds for 262k tokens) when a window of the best raw logits
    /// already holds k legal unbiased tokens: every token outside it scores lower, so the
    /// chain's top-k is unchanged. Otherwise (few legal tokens, e.g. JSON punctuation under a
    /// large top_k) the whole vocabulary. Returns whether it took the whole vocabulary.
    pub fn top_legal(
        &mut self,
        snap: &LogitsSnapshot,
        logits: &[f32],
        k: usize,
        lists: &BiasLists<'_>,
        grammar: &mut Grammar,
    ) -> bool {
        let window = legal_window(k);
        if window < logits.len() / 4 {
            let kept = self.top(snap, logits, window, lists);
            if self.constrain(Some(&mut *grammar), kept) >= k {
                return false;
            }
        }
        self.whole(logits);
        self.constrain(Some(grammar), 0);
        true
    }

    /// The k best tokens a llguidance constraint allows, plus the biased ones it allows: the
    /// best raw logits are tried one by one (microseconds each) until k are legal. Where the
    /// constraint allows few tokens (JSON punctuation, digits) more than `k / 4 + 4` refusals
    /// send it to the mask's allowed set instead. Exact: every token left out scores lower.
    pub fn top_guided(
        &mut self,
        snap: &LogitsSnapshot,
        logits: &[f32],
        k: usize,
        lists: &BiasLists<'_>,
        g: &mut Guided,
    ) {
        let budget = guided_refusals(k);
        let window = guided_window(k);
        if window < logits.len() / 4 {
            // Best first already (`LogitsSnapshot::best`).
            let kept = self.top(snap, logits, window, lists);
            let (mut legal, mut refused) = (0, 0);
            for read in 0..kept {
                if legal == k || refused > budget {
                    break;
                }
                let c = self.data[read];
                if g.allows(c.id) {
                    self.data[legal] = c;
                    legal += 1;
                } else {
                    refused += 1;
                }
            }
            if legal == k {
                let biased: Vec<_> = self.data[kept..]
                    .iter()
                    .copied()
                    .filter(|c| g.allows(c.id))
                    .collect();
                self.data.truncate(legal);
                self.data.extend(biased);
                return;
            }
        }
        self.allowed(logits, g);
    }

    /// Every token a llguidance constraint allows (its mask's set, usually small).
    pub fn allowed(&mut self, logits: &[f32], g: &mut Guided) {
        let data = &mut self.data;
        data.clear();
        g.allowed(|t| data.push(token_data(t, logits[t as usize])));
    }

    /// Add logit bias and steer: by index when the candidates are the `whole` vocabulary in
    /// token order, else by lookup.
    pub fn add_biases(&mut self, lists: &BiasLists<'_>, whole: bool) {
        if lists.iter().all(|l| l.is_empty()) {
            return;
        }
        if whole {
            for &(t, b) in lists.iter().flat_map(|l| l.pairs()) {
                self.data[t as usize].logit += b;
            }
            return;
        }
        for c in &mut self.data {
            c.logit += bias::total(lists, c.id);
        }
    }

    pub fn any_finite(&self) -> bool {
        self.data.iter().any(|c| c.logit.is_finite())
    }

    /// The candidates as llama.cpp's array (valid while `self.data` is not resized).
    pub fn array(&mut self) -> sys::llama_token_data_array {
        sys::llama_token_data_array {
            data: self.data.as_mut_ptr(),
            size: self.data.len(),
            selected: -1,
            sorted: false,
        }
    }

    /// Keep what a llama.cpp sampler left in `cur` (samplers may shrink the array, moving
    /// its start within our buffer). `cur` must come from `array()`, with `data` not resized
    /// since.
    pub fn keep(&mut self, cur: &sys::llama_token_data_array) {
        // SAFETY: `cur` came from `array()` on this buffer, which has not been resized since
        // (the caller filters in between, touching `self.data` only through `cur`); samplers
        // only move `data` forward within it, so both pointers lie in one allocation, a whole
        // number of entries apart, and `start + cur.size <= len`.
        let start = unsafe { cur.data.offset_from(self.data.as_ptr()) } as usize;
        self.data.truncate(start + cur.size);
        self.data.drain(..start);
    }

    /// log-sum-exp over the finite logits.
    pub fn log_sum_exp(&self) -> f64 {
        let max = self
            .data
            .iter()
            .map(|c| c.logit)
            .fold(f32::NEG_INFINITY, f32::max) as f64;
        if max == f64::NEG_INFINITY {
            return max;
        }
        let sum: f64 = self
            .data
            .iter()
            .filter(|c| c.logit.is_finite())
            .map(|c| (c.logit as f64 - max).exp())
            .sum();
        max + sum.ln()
    }
}

fn token_data(id: Token, logit: f32) -> sys::llama_token_data {
    sys::llama_token_data { id, logit, p: 0.0 }
}
