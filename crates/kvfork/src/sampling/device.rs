//! Sampling on the device (`create_context(device_sampling=True)`): every sequence of the
//! context gets a one-stage backend chain whose stage finds, on the device that computed the
//! logits, each output row's best [`CANDIDATES`] logits with their token ids and the row's
//! log-partition. Only those come back to the host (129 numbers per output), not the row: on
//! a GPU this saves a copy of `n_vocab` floats per branch per step (1 MB on Gemma 3).
//!
//! The branch's own chain then draws from those candidates on the host, with its own RNG,
//! exactly as it draws from a row's top-k today (`Gathering::Top`): greedy and every chain
//! that cuts to its `top_k` first (temperature, top-p, min-p, seeded draws after it) keep
//! their draws, reseeds, hot swaps and forks. The stage itself is stateless, so it follows a
//! branch wherever its lease goes (parking, forks, the scratch context) with nothing to move.
//! A branch whose chain needs the whole row (a grammar, a bias, a draw from the whole
//! vocabulary) has the chain taken off its sequence before its decode
//! ([`DeviceChains::follow`]), and gets the row as without device sampling.

use std::ffi::{c_char, CStr};
use std::ptr::{self, NonNull};
use std::sync::Arc;

use llama_cpp_sys_2 as sys;

use crate::error::{Error, Result};
use crate::model::Token;
use crate::seq::Seq;

/// How many of each row's best logits come back from the device, at most and by default.
pub(crate) const CANDIDATES: usize = 64;

/// The candidates a context's stage keeps: `KVFORK_DEVICE_CANDIDATES` (1 to 64; other values
/// are clamped, anything unreadable is the default), else [`CANDIDATES`]. With 1 the stage is
/// an argmax, cheaper on a GPU than a top-k (a sort of the row there): greedy chains draw on
/// the device, every other chain gets its rows (BENCHMARKS §26).
pub(crate) fn candidates_from_env() -> usize {
    std::env::var("KVFORK_DEVICE_CANDIDATES")
        .ok()
        .and_then(|v| v.trim().parse::<i64>().ok())
        .map_or(CANDIDATES, |k| k.clamp(1, CANDIDATES as i64) as usize)
}

/// What the device kept of one output row: its best logits with their tokens, best first (on
/// ties the lower token first, as the host's `top_k_sorted`), and the row's log-partition
/// (`ln Σ e^x`), from which any of their log-probabilities follows.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Drawn {
    pub best: Arc<[(Token, f32)]>,
    pub log_sum_exp: f64,
}

impl Drawn {
    /// The best token.
    pub fn token(&self) -> Token {
        self.best[0].0
    }

    /// The logit of `token` when it is among the candidates.
    pub fn logit_of(&self, token: Token) -> Option<f32> {
        self.best
            .iter()
            .find(|&&(t, _)| t == token)
            .map(|&(_, l)| l)
    }

    /// Read output `i` of the last decode of `ctx` (a vocabulary of `n_vocab`), whose
    /// sequence carried a chain of [`DeviceChains`] keeping `k` candidates (at most `n_vocab`)
    /// in that decode.
    ///
    /// # Safety
    /// `ctx` is a live context created with those chains, used by this thread only.
    pub unsafe fn read(
        ctx: *mut sys::llama_context,
        i: usize,
        n_vocab: usize,
        k: usize,
    ) -> Result<Self> {
        let i = i as i32;
        // SAFETY: the caller's contract; llama.cpp checks `i` against the last decode's
        // outputs (NULL pointers for one that was not an output).
        let (logits, n_logits, ids, n_ids) = unsafe {
            (
                sys::llama_get_sampled_logits_ith(ctx, i),
                sys::llama_get_sampled_logits_count_ith(ctx, i),
                sys::llama_get_sampled_candidates_ith(ctx, i),
                sys::llama_get_sampled_candidates_count_ith(ctx, i),
            )
        };
        if logits.is_null() || ids.is_null() || n_logits as usize != k + 1 || n_ids as usize != k {
            return Err(Error::Decode(format!(
                "the device kept nothing for output {i} (its backend could not run the \
                 sampling graph?): create the context with device_sampling=False"
            )));
        }
        // SAFETY: non-NULL rows of the counts checked above, valid until the next decode;
        // copied now.
        let (logits, ids) = unsafe {
            (
                std::slice::from_raw_parts(logits, k + 1),
                std::slice::from_raw_parts(ids, k),
            )
        };
        let best = Self::best_first(ids, &logits[..k], n_vocab).ok_or_else(|| {
            Error::Decode(format!(
                "the device returned a token outside the vocabulary for output {i}"
            ))
        })?;
        // The stage's last number is the best logit's log-probability.
        Ok(Drawn {
            log_sum_exp: f64::from(best[0].1) - f64::from(logits[k]),
            best,
        })
    }

    /// Candidates (ids and their logits, in any order) best first; None when there are none
    /// or an id is outside the vocabulary.
    pub(crate) fn best_first(
        ids: &[Token],
        logits: &[f32],
        n_vocab: usize,
    ) -> Option<Arc<[(Token, f32)]>> {
        let mut best: Vec<(Token, f32)> = ids.iter().copied().zip(logits.iter().copied()).collect();
        if best.is_empty() || best.iter().any(|&(t, _)| t < 0 || t as usize >= n_vocab) {
            return None;
        }
        best.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        Some(best.into())
    }
}

const NAME: &CStr = c"kvfork-candidates";

/// The stage's name.
unsafe extern "C" fn name(_: *const sys::llama_sampler) -> *const c_char {
    NAME.as_ptr()
}

/// The host path (llama.cpp calls it only when something samples this chain on the CPU, which
/// kvfork never does): the argmax, what a greedy branch would draw.
unsafe extern "C" fn apply(_: *mut sys::llama_sampler, cur: *mut sys::llama_token_data_array) {
    // SAFETY: llama.cpp passes a live array of `size` initialised entries.
    let cur = unsafe { &mut *cur };
    if cur.size == 0 {
        return;
    }
    // SAFETY: as above: `data` holds `size` entries.
    let data = unsafe { std::slice::from_raw_parts(cur.data, cur.size) };
    let best = (1..data.len()).fold(0, |b, i| if data[i].logit > data[b].logit { i } else { b });
    cur.selected = best as i64;
}

/// A copy (the stage's only setting is its count of candidates).
unsafe extern "C" fn clone(stage: *const sys::llama_sampler) -> *mut sys::llama_sampler {
    // SAFETY: llama.cpp passes a live stage of ours.
    new_stage(unsafe { kept(stage) })
}

/// The candidates `stage` keeps, stored in its context pointer (`new_stage`).
///
/// # Safety
/// `stage` is a live stage made by `new_stage`.
unsafe fn kept(stage: *const sys::llama_sampler) -> usize {
    // SAFETY: the caller's contract.
    unsafe { (*stage).ctx as usize }
}

/// Every backend kvfork loads runs the stage's ops (top_k, get_rows, argmax, sub, exp, sum,
/// log, scale, concat); a backend missing one gets it from the scheduler's CPU fallback.
unsafe extern "C" fn backend_init(
    _: *mut sys::llama_sampler,
    _: sys::ggml_backend_buffer_type_t,
    _: u32,
) -> bool {
    true
}

/// The graph, for a row of `n` logits:
/// - its best `k` (`ggml_top_k`, unordered; `ggml_argmax` for one) and their logits;
/// - the best logit's log-probability, `-ln Σ e^(x - max)`, over the row cut into up to 64
///   pieces (a CPU backend splits each op by rows, so the pieces spread the pass over its
///   threads).
///
/// Outputs, which llama.cpp copies back: `candidates` (the `k` token ids) and `logits` (their
/// `k` logits, then the log-probability). Nothing is `sampled` on the device: the branch's
/// chain draws from the candidates on the host, with its own RNG. (Few nodes on purpose:
/// reserving the graph of a stage with twice as many for 512 outputs ran out of the graph
/// allocator's free blocks, which aborts; this one passes up to 8,192 outputs, checked.)
unsafe extern "C" fn backend_apply(
    stage: *mut sys::llama_sampler,
    ctx: *mut sys::ggml_context,
    _: *mut sys::ggml_cgraph,
    data: *mut sys::llama_sampler_data,
) {
    // SAFETY: llama.cpp passes its graph context and this output's data, whose `logits` is
    // a contiguous F32 view of one row (`build_sampling`); each op returns a new node of
    // that context, the reshapes keep element counts, and the top-k takes `k <= n`.
    unsafe {
        let data = &mut *data;
        let n = sys::ggml_nelements(data.logits);
        let k = (kept(stage) as i64).min(n);
        let row = sys::ggml_reshape_1d(ctx, data.logits, n);
        let ids = if k == 1 {
            sys::ggml_argmax(ctx, sys::ggml_reshape_2d(ctx, row, n, 1))
        } else {
            sys::ggml_top_k(ctx, row, k as i32)
        };
        let logits = sys::ggml_get_rows(ctx, sys::ggml_reshape_2d(ctx, row, 1, n), ids);
        let best = sys::ggml_argmax(ctx, sys::ggml_reshape_1d(ctx, logits, k));
        let max = sys::ggml_get_rows(ctx, logits, best);
        let pieces = row_pieces(n);
        let cut = sys::ggml_reshape_2d(ctx, row, n / pieces, pieces);
        let shifted = sys::ggml_exp(ctx, sys::ggml_sub(ctx, cut, max));
        let log_prob = sys::ggml_scale(ctx, sys::ggml_log(ctx, sys::ggml_sum(ctx, shifted)), -1.0);
        let out = sys::ggml_concat(ctx, sys::ggml_reshape_1d(ctx, logits, k), log_prob, 0);
        sys::ggml_set_name(out, c"kvfork_candidate_logits".as_ptr());
        // llama.cpp reads both after the graph ran; unmarked, the allocator handed their
        // memory on to later nodes (garbage on every sequence but 0).
        sys::ggml_set_output(ids);
        sys::ggml_set_output(out);
        data.sampled = ptr::null_mut();
        data.logits = out;
        data.probs = ptr::null_mut();
        data.candidates = ids;
    }
}

/// The most pieces, up to 64, that a row of `n` cuts into evenly.
fn row_pieces(n: i64) -> i64 {
    (1..=64).rev().find(|k| n % k == 0).unwrap_or(1)
}

/// The stage's methods; llama.cpp only reads them.
struct Methods(sys::llama_sampler_i);
// SAFETY: function pointers and NULLs, never written.
unsafe impl Sync for Methods {}

static METHODS: Methods = Methods(sys::llama_sampler_i {
    name: Some(name),
    accept: None,
    apply: Some(apply),
    reset: None,
    clone: Some(clone),
    free: None,
    backend_init: Some(backend_init),
    backend_accept: None,
    backend_apply: Some(backend_apply),
    backend_set_input: None,
    backend_reset: None,
    copy_state: None,
});

/// A stage keeping `k` candidates of each row (`k` rides in the context pointer: nothing to
/// free, as the methods have no `free`).
fn new_stage(k: usize) -> *mut sys::llama_sampler {
    // SAFETY: `METHODS` lives forever and llama.cpp never writes through the pointer (the
    // `*mut` is the C signature's); it never dereferences `ctx`, only our methods read it.
    unsafe {
        sys::llama_sampler_init(
            ptr::addr_of!(METHODS.0).cast_mut(),
            k as *mut std::ffi::c_void,
        )
    }
}

/// A chain of one stage keeping `k` candidates, as llama.cpp takes backend samplers.
fn new_chain(k: usize) -> *mut sys::llama_sampler {
    // SAFETY: plain values in; the chain takes ownership of the stage added.
    unsafe {
        let chain = sys::llama_sampler_chain_init(sys::llama_sampler_chain_default_params());
        sys::llama_sampler_chain_add(chain, new_stage(k));
        chain
    }
}

/// The stage's chains of a context, one per llama.cpp sequence that draws on the device, and
/// which sequences give whole rows instead: a branch whose chain needs the row (a grammar,
/// a bias, a steer, a draw from more than the candidates) has its sequence's chain taken
/// off before its decode, and llama.cpp then copies the rows back as without device
/// sampling. Created before the context (which starts with a chain on every sequence) and
/// dropped after it.
pub(crate) struct DeviceChains {
    /// The chain attached to each sequence; None: the sequence gives rows.
    chains: Vec<Option<NonNull<sys::llama_sampler>>>,
    /// The first chains as the context parameters list them (`attach`): llama.cpp reads
    /// them once, when it creates the context.
    configs: Vec<sys::llama_sampler_seq_config>,
    /// Batch entries of the last decode whose output is a row (their sequence gives rows).
    row_entries: Vec<usize>,
    /// The candidates each stage keeps ([`candidates_from_env`]).
    kept: usize,
}

impl DeviceChains {
    pub fn new(n_seqs: u32) -> Self {
        let kept = candidates_from_env();
        let chains: Vec<_> = (0..n_seqs).map(|_| NonNull::new(new_chain(kept))).collect();
        let configs = chains
            .iter()
            .enumerate()
            .filter_map(|(seq, chain)| {
                chain.map(|c| sys::llama_sampler_seq_config {
                    seq_id: seq as i32,
                    sampler: c.as_ptr(),
                })
            })
            .collect();
        DeviceChains {
            chains,
            configs,
            row_entries: Vec::new(),
            kept,
        }
    }

    /// How many of each row's best logits the stages keep (before the vocabulary's size).
    pub fn kept(&self) -> usize {
        self.kept
    }

    /// Hand the chains to the context parameters (valid while `self` is).
    pub fn attach(&mut self, cp: &mut sys::llama_context_params) {
        cp.samplers = self.configs.as_mut_ptr();
        cp.n_samplers = self.configs.len();
    }

    /// Before a decode: give each output's sequence (`outputs`: batch entry and sequence)
    /// what it needs, whole rows for the sequences in `rows`, the device's candidates for the
    /// others. A sequence keeps its mode until an output wants the other: each switch makes
    /// llama.cpp reserve its graph again at the next decode (10-13 ms on a 2-core CPU beside
    /// a 60 ms step of 8 Gemma 3 branches; a decode holding a row copies every output's row,
    /// 3-8 % dearer there).
    ///
    /// # Safety
    /// `ctx` is the live context created with these chains, used by this thread only, not
    /// decoding.
    pub unsafe fn follow(
        &mut self,
        ctx: *mut sys::llama_context,
        outputs: impl Iterator<Item = (usize, Seq)>,
        rows: &[Seq],
    ) {
        self.row_entries.clear();
        for (entry, seq) in outputs {
            let Some(chain) = self.chains.get_mut(seq.id() as usize) else {
                continue; // llama.cpp refuses the batch itself
            };
            let wants_row = rows.contains(&seq);
            match (chain.is_some(), wants_row) {
                (true, true) => {
                    // SAFETY: the caller's contract. NULL takes the chain off the sequence;
                    // llama.cpp keeps no pointer to it (a graph built with it is not reused:
                    // its chains differ from the context's now), so it is freed here.
                    unsafe {
                        sys::llama_set_sampler(ctx, seq.id(), ptr::null_mut());
                        sys::llama_sampler_free(chain.take().expect("attached").as_ptr());
                    }
                }
                (false, false) => {
                    // A fresh chain: llama.cpp initialises a chain once.
                    let fresh = new_chain(self.kept);
                    // SAFETY: the caller's contract; `fresh` is a chain of the stage, owned
                    // here from now on (llama.cpp keeps a pointer while it is attached).
                    if unsafe { sys::llama_set_sampler(ctx, seq.id(), fresh) } {
                        *chain = NonNull::new(fresh);
                    } else {
                        // Refused (a tensor-split model): the sequence keeps giving rows.
                        // SAFETY: not attached, owned here alone.
                        unsafe { sys::llama_sampler_free(fresh) };
                    }
                }
                _ => {}
            }
            if chain.is_none() {
                self.row_entries.push(entry);
            }
        }
    }

    /// Whether batch entry `entry` of the last decode gave its row (not candidates).
    pub fn gave_row(&self, entry: usize) -> bool {
        self.row_entries.contains(&entry)
    }
}

impl Drop for DeviceChains {
    fn drop(&mut self) {
        for chain in self.chains.iter().flatten() {
            // SAFETY: each chain was created here, is owned here alone (the context that
            // pointed to it is freed first), and is freed once with its stage.
            unsafe { sys::llama_sampler_free(chain.as_ptr()) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{row_pieces, Drawn};

    #[test]
    fn candidates_come_best_first_with_ties_to_the_lower_token() {
        let best = Drawn::best_first(&[7, 3, 9, 5], &[1.0, 2.5, 2.5, -1.0], 10).unwrap();
        assert_eq!(&*best, &[(3, 2.5), (9, 2.5), (7, 1.0), (5, -1.0)]);
        let d = Drawn {
            best,
            log_sum_exp: 2.75,
        };
        assert_eq!(d.token(), 3);
        assert_eq!(d.logit_of(7), Some(1.0));
        assert_eq!(d.logit_of(4), None);
        assert!(Drawn::best_first(&[1, 10], &[0.0, 0.0], 10).is_none());
        assert!(Drawn::best_first(&[-1], &[0.0], 10).is_none());
        assert!(Drawn::best_first(&[], &[], 10).is_none());
    }

    #[test]
    fn a_row_is_cut_into_even_pieces() {
        assert_eq!(row_pieces(262_144), 64);
        assert_eq!(row_pieces(49_152), 64);
        assert_eq!(row_pieces(32_000), 64);
        assert_eq!(row_pieces(151_936), 64);
        assert_eq!(row_pieces(50_257), 29);
        assert_eq!(row_pieces(7), 7);
        assert_eq!(row_pieces(65_537), 1);
    }
}
