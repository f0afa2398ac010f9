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

/// The candidates a context's stage keeps: `KVFORK_DEVICE_CANDIDATES` (1 to 64), else
/// [`CANDIDATES`]; any other value is an error naming it (0 or junk quietly became the
/// argmax mode, or the default). With 1 the stage is an argmax, cheaper on a GPU than a
/// top-k (a sort of the row there): greedy chains draw on the device, every other chain gets
/// its rows (BENCHMARKS §26).
pub(crate) fn candidates_from_env() -> Result<usize> {
    let Ok(text) = std::env::var("KVFORK_DEVICE_CANDIDATES") else {
        return Ok(CANDIDATES);
    };
    match text.trim().parse::<usize>() {
        Ok(k) if (1..=CANDIDATES).contains(&k) => Ok(k),
        _ => Err(Error::invalid(
            "KVFORK_DEVICE_CANDIDATES",
            format!("{text:?} is not a count in [1, {CANDIDATES}]"),
        )),
    }
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
        // Two getters, not four: each synchronizes with the device (a stream sync on a GPU,
        // paid per output row), and the counts are the stage's own `k` and `k + 1` — a row
        // has its logits exactly when the stage ran for it, and then its candidates too
        // (`backend_apply` sets both).
        // SAFETY: the caller's contract; llama.cpp checks `i` against the last decode's
        // outputs (NULL logits for one that was not an output or got no stage).
        let logits = unsafe { sys::llama_get_sampled_logits_ith(ctx, i) };
        if logits.is_null() {
            return Err(Error::Decode(format!(
                "the device kept nothing for output {i} (its backend could not run the \
                 sampling graph?): create the context with device_sampling=False"
            )));
        }
        // SAFETY: as above; with the logits present the candidates are the stage's, not
        // llama.cpp's whole-vocabulary fallback.
        let ids = unsafe { sys::llama_get_sampled_candidates_ith(ctx, i) };
        debug_assert_eq!(
            // SAFETY: as above (debug builds only: a further synchronization each).
            unsafe { sys::llama_get_sampled_logits_count_ith(ctx, i) } as usize,
            k + 1
        );
        // SAFETY: rows of the stage's `k + 1` logits and `k` ids (`backend_apply` makes them
        // so), valid until the next decode; copied now.
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
        // The stage's last number is the best token's probability, 1 / Σ e^(x - max): the
        // log-partition is max + ln Σ e^(x - max).
        Ok(Drawn {
            log_sum_exp: f64::from(best[0].1) - f64::from(logits[k]).ln(),
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

/// Every backend kvfork loads runs the stage's ops (top_k, argmax, get_rows, soft_max,
/// concat); a backend missing one gets it from the scheduler's CPU fallback.
unsafe extern "C" fn backend_init(
    _: *mut sys::llama_sampler,
    _: sys::ggml_backend_buffer_type_t,
    _: u32,
) -> bool {
    true
}

/// Output rows that share one set of the stage's nodes. The nodes' kernels are as many for
/// one row as for 64 (what matters on a GPU: 64 rows through nodes of their own were ~640
/// small kernels, 3 ms of a 10 ms step, BENCHMARKS §29), while their buffers grow with the
/// rows: 64 rows of Gemma 3's 262,144 logits take 64 MiB a buffer, and the graph's allocator
/// reuses them for the next 64 (all of 2,048 rows at once took 2 GiB more compute buffer).
const ROWS_A_GROUP: i64 = 64;

/// The stage's nodes in the graph being built ([`backend_apply`]): for the logits tensor
/// of a graph context, each group of [`ROWS_A_GROUP`] rows that some row has asked for.
struct Built {
    ctx: *mut sys::ggml_context,
    logits: *mut sys::ggml_tensor,
    k: i64,
    groups: Vec<Option<Group>>,
}

/// One group's outputs: the candidates' ids (`[k, rows]`) and their logits, each row's
/// followed by its best token's probability (`[k + 1, rows]`).
#[derive(Clone, Copy)]
struct Group {
    ids: *mut sys::ggml_tensor,
    out: *mut sys::ggml_tensor,
}

thread_local! {
    /// The nodes of the graph this thread is building. llama.cpp builds a graph on the thread
    /// that decodes, resets every stage first ([`backend_reset`], which forgets them), then
    /// asks each sequence's chain for its rows, one row a call.
    static BUILT: std::cell::RefCell<Option<Built>> = const { std::cell::RefCell::new(None) };
}

/// A new graph is being built: the nodes of the last one are gone with it.
unsafe extern "C" fn backend_reset(_: *mut sys::llama_sampler) {
    BUILT.set(None);
}

/// The graph, for one output row of `n` logits. llama.cpp gives a stage one row a call, a
/// view of the decode's logits; the nodes are made once for a group of rows of that tensor
/// ([`ROWS_A_GROUP`], when the first of them asks) and each row gets views of their
/// outputs. Over `[n, rows]`:
/// - each row's best `k` (`ggml_top_k`, unordered; `ggml_argmax` for one) and their logits;
/// - each row's best token's probability, from `ggml_soft_max` (one fused kernel on a GPU,
///   the row spread over the SMs when it is long; vectorized on a CPU), from which the host
///   has the log-partition.
///
/// Outputs, which llama.cpp copies back row by row: `candidates` (the `k` token ids) and
/// `logits` (their `k` logits, then the best token's probability). Nothing is `sampled` on the
/// device: the branch's chain draws from the candidates on the host, with its own RNG.
/// Rows of the group whose sequence gives its whole row (no chain) are computed too, unread.
unsafe extern "C" fn backend_apply(
    stage: *mut sys::llama_sampler,
    ctx: *mut sys::ggml_context,
    _: *mut sys::ggml_cgraph,
    data: *mut sys::llama_sampler_data,
) {
    // SAFETY: llama.cpp passes its graph context and this output's data, whose `logits` is
    // a contiguous F32 view of one row of the decode's logits (`build_sampling`); every node
    // made here belongs to that context, and views stay inside the tensors they view.
    unsafe {
        let data = &mut *data;
        let (logits, row) = rows_of(ctx, data.logits);
        let k = (kept(stage) as i64).min((*logits).ne[0]);
        let (group, in_group) = (row / ROWS_A_GROUP, row % ROWS_A_GROUP);
        let made = BUILT.with_borrow_mut(|built| {
            let fresh = !matches!(built, Some(b) if b.ctx == ctx && b.logits == logits && b.k == k);
            if fresh {
                let groups = ((*logits).ne[1] as usize).div_ceil(ROWS_A_GROUP as usize);
                *built = Some(Built {
                    ctx,
                    logits,
                    k,
                    groups: vec![None; groups],
                });
            }
            let slot = &mut built.as_mut().expect("set above").groups[group as usize];
            *slot.get_or_insert_with(|| build_group(ctx, logits, k, group))
        });
        let ids = sys::ggml_view_1d(ctx, made.ids, k, in_group as usize * (*made.ids).nb[1]);
        let out = sys::ggml_view_1d(ctx, made.out, k + 1, in_group as usize * (*made.out).nb[1]);
        data.sampled = ptr::null_mut();
        data.logits = out;
        data.probs = ptr::null_mut();
        data.candidates = ids;
    }
}

/// The logits tensor (`[n, rows]`, contiguous) whose row `data_logits` views, and the row's
/// index; a view of anything else counts as a tensor of one row.
///
/// # Safety
/// `data_logits` is a live contiguous tensor of `ctx`.
unsafe fn rows_of(
    ctx: *mut sys::ggml_context,
    data_logits: *mut sys::ggml_tensor,
) -> (*mut sys::ggml_tensor, i64) {
    // SAFETY: the caller's contract; `view_src`, when set, is a live tensor of the graph.
    unsafe {
        let view = &*data_logits;
        let n = sys::ggml_nelements(data_logits);
        let src = view.view_src;
        if !src.is_null() {
            let s = &*src;
            let row = (view.view_offs / s.nb[1]) as i64;
            let is_row = s.type_ == view.type_
                && s.ne[0] == n
                && s.ne[2] == 1
                && s.ne[3] == 1
                && sys::ggml_is_contiguous(src)
                && view.view_offs.is_multiple_of(s.nb[1])
                && row < s.ne[1];
            if is_row {
                return (unpadded(src, row).unwrap_or(src), row);
            }
        }
        (sys::ggml_reshape_2d(ctx, data_logits, n, 1), 0)
    }
}

/// The logits `padded` was made from when it is llama.cpp's copy of them with one row of
/// zeros added (`build_sampling` pads them so that a graph of one output keeps its shape
/// whichever sequences sample) and `row` is one of theirs. Reading the logits themselves
/// leaves the copy out of the graph: on a CPU, ggml's pad took ~0.2 ms a step of one
/// 49,152-logit row, as long as the rest of the stage (BENCHMARKS §30).
///
/// # Safety
/// `padded` is a live tensor of the graph.
unsafe fn unpadded(padded: *mut sys::ggml_tensor, row: i64) -> Option<*mut sys::ggml_tensor> {
    // SAFETY: the caller's contract; a PAD node's first source is a live tensor.
    unsafe {
        let p = &*padded;
        let src = p.src[0];
        if p.op != sys::GGML_OP_PAD || src.is_null() {
            return None;
        }
        let s = &*src;
        let same = s.type_ == p.type_
            && s.ne[0] == p.ne[0]
            && s.ne[1] + 1 == p.ne[1]
            && s.ne[2] == 1
            && s.ne[3] == 1
            && row < s.ne[1]
            && sys::ggml_is_contiguous(src);
        same.then_some(src)
    }
}

/// The stage's nodes over group `group` of the rows of `logits` (`[n, rows]`), keeping
/// `k <= n` a row.
///
/// # Safety
/// `logits` is a live contiguous F32 matrix of `ctx` with a row in that group.
unsafe fn build_group(
    ctx: *mut sys::ggml_context,
    logits: *mut sys::ggml_tensor,
    k: i64,
    group: i64,
) -> Group {
    // SAFETY: the caller's contract; the view holds whole rows inside `logits`; each op
    // returns a new node of `ctx`, reshapes keep element counts and take contiguous
    // tensors, and the top-k takes `k <= n`.
    unsafe {
        let n = (*logits).ne[0];
        let first = group * ROWS_A_GROUP;
        let rows = ROWS_A_GROUP.min((*logits).ne[1] - first);
        let nb1 = (*logits).nb[1];
        let logits = sys::ggml_view_2d(ctx, logits, n, rows, nb1, first as usize * nb1);
        let found = if k == 1 {
            sys::ggml_argmax(ctx, logits)
        } else {
            sys::ggml_top_k(ctx, logits, k as i32)
        };
        let ids = sys::ggml_reshape_2d(ctx, found, k, rows);
        // Each row's candidates' logits, [1, k, rows]: row r's get_rows reads row r.
        let by_token = sys::ggml_reshape_3d(ctx, logits, 1, n, rows);
        let best_logits = sys::ggml_get_rows(ctx, by_token, ids);
        // The best token: the argmax, or found again beside the top-k's unordered ids.
        let best = if k == 1 {
            ids
        } else {
            sys::ggml_reshape_2d(ctx, sys::ggml_argmax(ctx, logits), 1, rows)
        };
        let probs = sys::ggml_soft_max(ctx, logits);
        let best_prob = sys::ggml_get_rows(ctx, sys::ggml_reshape_3d(ctx, probs, 1, n, rows), best);
        let out = sys::ggml_concat(
            ctx,
            sys::ggml_reshape_2d(ctx, best_logits, k, rows),
            sys::ggml_reshape_2d(ctx, best_prob, 1, rows),
            0,
        );
        sys::ggml_set_name(out, c"kvfork_candidate_logits".as_ptr());
        // llama.cpp reads both (through the rows' views) after the graph ran; unmarked, the
        // allocator handed their memory on to later nodes.
        sys::ggml_set_output(found);
        sys::ggml_set_output(out);
        Group { ids, out }
    }
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
    backend_reset: Some(backend_reset),
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
    /// The candidates each stage keeps.
    kept: usize,
}

impl DeviceChains {
    /// Chains for `n_seqs` sequences whose stages keep `kept` candidates (1 to
    /// [`CANDIDATES`]; a context's is [`candidates_from_env`] when it is created).
    pub fn new(n_seqs: u32, kept: usize) -> Self {
        let kept = kept.clamp(1, CANDIDATES);
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
    use super::Drawn;

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
}
