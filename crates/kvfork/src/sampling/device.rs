//! Greedy draws in llama.cpp's graph (`create_context(device_sampling=True)`): every sequence
//! of the context gets a one-stage backend chain whose stage takes the argmax of each output
//! row and the row's log-partition, on the device that computed the logits. Only those come
//! back to the host (three numbers per output), not the row: on a GPU this saves a copy of
//! `n_vocab` floats per branch per step (1 MB on Gemma 3).
//!
//! The stage is stateless, so it follows a branch wherever its lease goes (parking, forks,
//! the scratch context, which has no samplers and hands out whole rows): there is nothing to
//! move, clone or reseed.

use std::ffi::{c_char, CStr};
use std::ptr;

use llama_cpp_sys_2 as sys;

use crate::error::{Error, Result};
use crate::model::Token;

/// What the device drew from one output row: its argmax with that token's logit, and the
/// row's log-partition (`ln Σ e^x`), from which the token's log-probability follows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Drawn {
    pub token: Token,
    pub logit: f32,
    pub log_sum_exp: f64,
}

impl Drawn {
    /// Read output `i` of the last decode of `ctx`, whose sequences all carry the chains
    /// of [`DeviceChains`].
    ///
    /// # Safety
    /// `ctx` is a live context created with those chains, used by this thread only.
    pub unsafe fn read(ctx: *mut sys::llama_context, i: usize) -> Result<Self> {
        let i = i as i32;
        // SAFETY: the caller's contract; llama.cpp checks `i` against the last decode's
        // outputs (NULL token / NULL pointer for one that was not an output).
        let (token, values, count) = unsafe {
            (
                sys::llama_get_sampled_token_ith(ctx, i),
                sys::llama_get_sampled_logits_ith(ctx, i),
                sys::llama_get_sampled_logits_count_ith(ctx, i),
            )
        };
        if token < 0 || values.is_null() || count != 2 {
            return Err(Error::Decode(format!(
                "the device drew nothing for output {i} (its backend could not run the \
                 sampling graph?): create the context with device_sampling=False"
            )));
        }
        // SAFETY: a non-NULL row of `count` (2) floats, valid until the next decode; read now.
        let (logit, log_prob) = unsafe { (*values, *values.add(1)) };
        Ok(Drawn {
            token,
            logit,
            log_sum_exp: f64::from(logit) - f64::from(log_prob),
        })
    }
}

const NAME: &CStr = c"kvfork-greedy";

/// The stage's name.
unsafe extern "C" fn name(_: *const sys::llama_sampler) -> *const c_char {
    NAME.as_ptr()
}

/// The host path (llama.cpp calls it only when something samples this chain on the CPU, which
/// kvfork never does): the same argmax.
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

/// A copy (the stage has no state).
unsafe extern "C" fn clone(_: *const sys::llama_sampler) -> *mut sys::llama_sampler {
    new_stage()
}

/// Every backend kvfork loads runs the stage's ops (argmax, get_rows, sub, exp, sum, log,
/// scale, concat); a backend missing one gets it from the scheduler's CPU fallback.
unsafe extern "C" fn backend_init(
    _: *mut sys::llama_sampler,
    _: sys::ggml_backend_buffer_type_t,
    _: u32,
) -> bool {
    true
}

/// The graph: `sampled` = argmax of the row; `logits` = [its logit, its log-probability].
/// The log-probability is `-ln Σ e^(x - max)`, with the row cut into up to 64 pieces so
/// that a CPU backend spreads its exponentials over its threads (it splits ops by rows; a
/// softmax of one 262,144-wide row ran on one thread and cost 0.74× the host rows' speed
/// at 64 branches).
unsafe extern "C" fn backend_apply(
    _: *mut sys::llama_sampler,
    ctx: *mut sys::ggml_context,
    _: *mut sys::ggml_cgraph,
    data: *mut sys::llama_sampler_data,
) {
    // SAFETY: llama.cpp passes its graph context and this output's data, whose `logits` is
    // a contiguous F32 view of one row (`build_sampling`); each op returns a new node of
    // that context, and the reshapes keep the element count.
    unsafe {
        let data = &mut *data;
        let n = sys::ggml_nelements(data.logits);
        let row = sys::ggml_reshape_1d(ctx, data.logits, n);
        let best = sys::ggml_argmax(ctx, row);
        let logit = sys::ggml_get_rows(ctx, sys::ggml_reshape_2d(ctx, row, 1, n), best);
        let pieces = row_pieces(n);
        let cut = sys::ggml_reshape_2d(ctx, row, n / pieces, pieces);
        let shifted = sys::ggml_exp(ctx, sys::ggml_sub(ctx, cut, logit));
        let log_prob = sys::ggml_scale(ctx, sys::ggml_log(ctx, sys::ggml_sum(ctx, shifted)), -1.0);
        let pair = sys::ggml_concat(ctx, logit, sys::ggml_reshape_2d(ctx, log_prob, 1, 1), 0);
        sys::ggml_set_name(best, c"kvfork_argmax".as_ptr());
        sys::ggml_set_name(pair, c"kvfork_logit_logprob".as_ptr());
        // llama.cpp reads both after the graph ran. `best` feeds later nodes, and unmarked the
        // allocator handed its memory on after them (garbage tokens, seen on sequence 1).
        sys::ggml_set_output(best);
        sys::ggml_set_output(pair);
        data.sampled = best;
        data.logits = pair;
        data.probs = ptr::null_mut();
        data.candidates = ptr::null_mut();
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

fn new_stage() -> *mut sys::llama_sampler {
    // SAFETY: `METHODS` lives forever and llama.cpp never writes through the pointer (the
    // `*mut` is the C signature's); a NULL `ctx` is allowed with no `free`.
    unsafe { sys::llama_sampler_init(ptr::addr_of!(METHODS.0).cast_mut(), ptr::null_mut()) }
}

/// One chain per llama.cpp sequence of a context, alive for as long as the context (which
/// keeps pointers to them): create before it, drop after it.
pub(crate) struct DeviceChains {
    chains: Vec<*mut sys::llama_sampler>,
    configs: Vec<sys::llama_sampler_seq_config>,
}

impl DeviceChains {
    pub fn new(n_seqs: u32) -> Self {
        let chains: Vec<_> = (0..n_seqs)
            .map(|_| {
                // SAFETY: plain values in; the chain takes ownership of the stage added.
                unsafe {
                    let chain =
                        sys::llama_sampler_chain_init(sys::llama_sampler_chain_default_params());
                    sys::llama_sampler_chain_add(chain, new_stage());
                    chain
                }
            })
            .collect();
        let configs = chains
            .iter()
            .enumerate()
            .map(|(seq, &sampler)| sys::llama_sampler_seq_config {
                seq_id: seq as i32,
                sampler,
            })
            .collect();
        DeviceChains { chains, configs }
    }

    /// Hand the chains to the context parameters (valid while `self` is).
    pub fn attach(&mut self, cp: &mut sys::llama_context_params) {
        cp.samplers = self.configs.as_mut_ptr();
        cp.n_samplers = self.configs.len();
    }
}

impl Drop for DeviceChains {
    fn drop(&mut self) {
        for &chain in &self.chains {
            // SAFETY: each chain was created in `new`, is owned here alone (the context that
            // pointed to it is freed first), and is freed once with its stage.
            unsafe { sys::llama_sampler_free(chain) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::row_pieces;

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
