//! Thin owners of a `llama_context` and a `llama_batch`. Only the engine thread touches them.
//! (The options a context is made with, public, are `context_params.rs`.)

use std::ptr::NonNull;
use std::sync::Arc;

use llama_cpp_sys_2 as sys;

use crate::abort::AbortSignal;
use crate::adapter::LoraAdapter;
use crate::context_params::ContextParams;
use crate::error::{Error, Result};
use crate::model::{Model, Token};
use crate::sampling::device::{candidates_from_env, DeviceChains, Drawn, CANDIDATES};
use crate::seq::Seq;

/// One output of the last decode: its logits row, or what device sampling drew from it.
#[derive(Clone)]
pub(crate) enum OutputRef<'a> {
    Row(&'a [f32]),
    Drawn(Drawn),
}

impl OutputRef<'_> {
    /// A copy that outlives the next decode.
    pub fn into_owned(self) -> Output {
        match self {
            OutputRef::Row(row) => Output::Row(row.to_vec()),
            OutputRef::Drawn(d) => Output::Drawn(d),
        }
    }
}

/// An output kept past the next decode.
#[derive(Clone)]
pub(crate) enum Output {
    Row(Vec<f32>),
    Drawn(Drawn),
}

impl Output {
    pub fn as_ref(&self) -> OutputRef<'_> {
        match self {
            Output::Row(row) => OutputRef::Row(row),
            Output::Drawn(d) => OutputRef::Drawn(d.clone()),
        }
    }
}

/// An owned `llama_context`. Neither `Send` nor `Sync` (raw pointers): the engine thread
/// creates it, uses it and frees it, and the compiler keeps it there.
pub(crate) struct LlamaCtx {
    ptr: NonNull<sys::llama_context>,
    mem: sys::llama_memory_t,
    pub n_ctx: u32,
    pub n_batch: u32,
    pub n_seq_max: u32,
    pub n_vocab: usize,
    /// Tokens a recurrent state can drop from its end after a decode (llama.cpp's
    /// `n_rs_seq`: 0 unless asked for and the architecture supports it).
    pub n_rs_seq: u32,
    /// Floats in one embedding row llama.cpp hands out: the model's output width, which a
    /// GGUF may set apart from its hidden size (`embedding_length_out`).
    n_embd_out: usize,
    /// Floats in one pooled sequence embedding: `n_embd_out`, or the `n_cls_out` scores of
    /// rank pooling (rerankers).
    n_seq_embd: usize,
    /// The most threads an adapting decode uses (resolved once, when created).
    pub max_threads: i32,
    /// Where a decode's output rows are padded to whole tiles of the CPU's output matmul:
    /// the padding sequence and the tile (None: no padding; see `Worker::pad_outputs`).
    pub output_padding: Option<(Seq, usize)>,
    /// Read by llama.cpp's abort callback; dropped after the context (field order).
    abort_signal: Option<Arc<AbortSignal>>,
    /// The chains of `device_sampling` (`sampling/device.rs`), which the context points to:
    /// dropped after it.
    device: Option<DeviceChains>,
    /// How many of the last decode's first batch entries were each an output (a commit's
    /// members): rows `0..leading_outputs` of its output buffer (`leading_outputs`).
    leading_outputs: usize,
    // Keeps the weights alive for as long as the context.
    _model: Arc<Model>,
}

impl Drop for LlamaCtx {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `llama_init_from_model` and is freed here only, once. The
        // model it reads and the abort signal its callback reads are fields, which drop after
        // this body.
        unsafe { sys::llama_free(self.ptr.as_ptr()) }
    }
}

impl LlamaCtx {
    /// A context of `model`; with `p.device_sampling`, its stages keep the candidates
    /// `KVFORK_DEVICE_CANDIDATES` says now.
    pub fn new(model: Arc<Model>, p: &ContextParams) -> Result<Self> {
        let kept = if p.device_sampling {
            candidates_from_env()?
        } else {
            CANDIDATES
        };
        Self::keeping(model, p, kept)
    }

    /// A context of `model` whose device stages (with `p.device_sampling`) keep `kept`
    /// candidates: a scratch context keeps what its main context keeps, whatever the
    /// environment says since.
    pub fn keeping(model: Arc<Model>, p: &ContextParams, kept: usize) -> Result<Self> {
        p.validate()?;
        // SAFETY: returns a struct by value; reads no state.
        let mut cp = unsafe { sys::llama_context_default_params() };
        cp.n_ctx = p.n_ctx;
        // With embeddings, llama.cpp reserves its pooling graph for n_ubatch tokens rounded up
        // to a multiple of n_seq_max, but for only n_ubatch outputs: unless n_ubatch is such a
        // multiple, the mean-pooling matmul's shapes disagree and GGML_ASSERT aborts the
        // process (n_seq_max = 3, 5, 6, ... with n_batch = 512). Round n_batch up instead.
        let n_batch = if p.embeddings {
            p.n_batch.div_ceil(p.n_seq_max) * p.n_seq_max
        } else {
            p.n_batch
        };
        if p.embeddings && p.n_ctx < n_batch && !p.n_ctx.is_multiple_of(p.n_seq_max) {
            return Err(Error::invalid(
                "n_ctx",
                format!(
                    "{} is below n_batch ({n_batch}): with embeddings it must then be a \
                     multiple of n_seq_max ({})",
                    p.n_ctx, p.n_seq_max
                ),
            ));
        }
        cp.n_batch = n_batch;
        // One physical batch per logical batch: one llama_decode == one graph run.
        cp.n_ubatch = n_batch;
        // llama.cpp reserves outputs for max(batch outputs, n_seq_max) rows and asserts that
        // this fits n_outputs_max (default n_batch): n_seq_max > n_batch would abort.
        cp.n_outputs_max = n_batch.max(p.llama_seqs());
        cp.n_seq_max = p.llama_seqs();
        let max_threads = ContextParams::max_threads();
        let (threads, threads_batch) = p.threads_with(max_threads);
        cp.n_threads = threads;
        cp.n_threads_batch = threads_batch;
        cp.type_k = p.type_k.ggml();
        cp.type_v = p.type_v.ggml();
        cp.embeddings = p.embeddings;
        if let Some(pool) = p.pooling {
            cp.pooling_type = pool;
        }
        // Forks share prefix cells only when the cache is unified (seq_cp just tags cells).
        cp.kv_unified = true;
        // Keep every position of sliding-window layers so partial seq_rm / forks stay exact.
        cp.swa_full = true;
        // Per-token recurrent snapshots, so a rejected guess is undone by `seq_rm`
        // (llama.cpp clamps it to 0 on architectures without them).
        cp.n_rs_seq = if model.is_recurrent() {
            p.recurrent_rollback
        } else {
            0
        };
        cp.no_perf = true;
        let mut device = p
            .device_sampling
            .then(|| DeviceChains::new(p.llama_seqs(), kept));
        if let Some(chains) = device.as_mut() {
            chains.attach(&mut cp);
            // A speculative verification draws at every position of its draft (llama.cpp's
            // default allows one output per sequence with backend samplers).
            cp.n_outputs_max_per_seq = cp.n_outputs_max;
        }
        // SAFETY: `model` is loaded and alive (the `Arc` held here, then `_model`, keeps it so
        // for the context's whole life). `cp` is llama.cpp's defaults with values `validate`
        // accepted and the adjustments above, which keep its asserts out of reach; any other
        // failure comes back as NULL (llama.cpp catches its exceptions here). The device
        // chains `cp` points to live in `device`, which the context owns from here on.
        let raw = unsafe { sys::llama_init_from_model(model.as_ptr(), cp) };
        let ptr = NonNull::new(raw).ok_or_else(|| {
            Error::Other(
                "llama.cpp could not create the context (out of memory? see the kvfork log)".into(),
            )
        })?;
        let ctx = ptr.as_ptr();
        // SAFETY: getters of the context just created (live, used by this thread only) and
        // of its loaded model. The memory handle is owned by the context and lives as long:
        // it is used only through `self`, which frees the context last.
        let (mem, n_ctx, n_batch, n_seq_max, n_rs_seq, pooling, n_embd_out, n_cls_out) = unsafe {
            (
                sys::llama_get_memory(ctx),
                sys::llama_n_ctx(ctx),
                sys::llama_n_batch(ctx),
                sys::llama_n_seq_max(ctx),
                sys::llama_n_rs_seq(ctx),
                sys::llama_pooling_type(ctx),
                sys::llama_model_n_embd_out(model.as_ptr()),
                sys::llama_model_n_cls_out(model.as_ptr()),
            )
        };
        let n_embd_out = n_embd_out.max(0) as usize;
        Ok(LlamaCtx {
            ptr,
            mem,
            n_ctx,
            n_batch,
            n_seq_max,
            n_rs_seq,
            n_vocab: model.vocab_size(),
            n_embd_out,
            n_seq_embd: if pooling == sys::LLAMA_POOLING_TYPE_RANK {
                n_cls_out as usize
            } else {
                n_embd_out
            },
            max_threads,
            output_padding: p
                .pad_seq()
                .map(|seq| (seq, model.output_tile()))
                .filter(|&(_, tile)| tile > 1)
                // Off for measuring its worth side by side (benchmarks/bench_store.py).
                .filter(|_| std::env::var_os("KVFORK_NO_OUTPUT_PADDING").is_none()),
            abort_signal: None,
            device,
            leading_outputs: 0,
            _model: model,
        })
    }

    /// Run one `llama_decode` and wait for its outputs. On failure llama.cpp restores the
    /// memory state (codes 1, -1).
    pub fn decode(&mut self, batch: &Batch) -> Result<()> {
        let r = self.decode_queued(batch);
        if r.is_ok() && batch.n_outputs() > 0 {
            // On a GPU `llama_decode` returns once the graph is queued, and the first read of
            // an output waits for it. Wait here instead, before the caller locks the branches
            // whose rows these are: reads of their other state must not wait for the device
            // (`test_row_loans`). On the CPU the decode is done already: nothing to wait for.
            self.wait_for_outputs();
        }
        r
    }

    /// Wait until the last decode's outputs are readable (on the CPU they are already).
    pub fn wait_for_outputs(&mut self) {
        // SAFETY: the context is live and used by this thread only.
        unsafe { sys::llama_synchronize(self.ptr.as_ptr()) };
    }

    /// `decode` without the wait: on a GPU the graph may still run when this returns, and
    /// the first read of an output (or `wait_for_outputs`) waits for it.
    pub fn decode_queued(&mut self, batch: &Batch) -> Result<()> {
        if batch.len() == 0 {
            return Ok(());
        }
        if let Some(device) = self.device.as_mut() {
            // SAFETY: the context is live, created with these chains, used by this thread,
            // and not decoding.
            unsafe { device.follow(self.ptr.as_ptr(), batch.outputs(), &batch.rows) };
        }
        self.leading_outputs = batch
            .outputs()
            .enumerate()
            .take_while(|&(k, (entry, _))| k == entry)
            .count();
        // SAFETY: the context is live and `&mut self` means no slice of the previous decode's
        // logits or embeddings is still borrowed; rows lent to snapshots as raw pointers are
        // given back or in flight (unread) first (`engine/loans.rs`). `batch.raw` holds `batch.len()` entries, all
        // written by `Batch::push` into buffers of its capacity; llama.cpp checks token ids,
        // positions and sequence ids itself and returns -1 instead of reading out of range.
        let code = unsafe { sys::llama_decode(self.ptr.as_ptr(), batch.raw) };
        match code {
            0 => Ok(()),
            1 => Err(Error::KvCacheFull(format!(
                "no KV slot for a batch of {} tokens (n_ctx = {})",
                batch.len(),
                self.n_ctx
            ))),
            2 => Err(Error::Cancelled("the decode was aborted".into())),
            -1 => Err(Error::Decode(
                "llama.cpp rejected the batch (inconsistent positions or sequence ids)".into(),
            )),
            c => Err(Error::Decode(format!("llama_decode returned {c}"))),
        }
    }

    /// Let `signal` abort a running `llama_decode` (between graph nodes; llama.cpp then
    /// removes the aborted batch's cells and returns 2). The signal outlives the context:
    /// the engine's `Shared` holds it for as long as the worker that owns this context.
    pub fn set_abort_signal(&mut self, signal: Arc<AbortSignal>) {
        /// # Safety
        /// `data` points to a live `AbortSignal` (llama.cpp passes back the pointer given to
        /// `llama_set_abort_callback` below).
        unsafe extern "C" fn should_abort(data: *mut std::ffi::c_void) -> bool {
            // SAFETY: `data` is the `Arc`'d signal that `self.abort_signal` keeps alive until
            // after `llama_free` (the `Drop` body runs before fields drop, and a later call
            // installs its new pointer before the old `Arc` goes). `AbortSignal` holds only
            // atomics, so a shared reference on whichever thread llama.cpp calls from is fine.
            let signal = unsafe { &*data.cast_const().cast::<AbortSignal>() };
            signal.should_abort()
        }
        let data = Arc::as_ptr(&signal).cast_mut().cast::<std::ffi::c_void>();
        // SAFETY: the context is live; `should_abort` has the `ggml_abort_callback` signature
        // and `data` stays valid for as long as llama.cpp may call it (see above).
        unsafe { sys::llama_set_abort_callback(self.ptr.as_ptr(), Some(should_abort), data) };
        self.abort_signal = Some(signal);
    }

    /// Logits row of batch entry `i` (which must have been marked for output, and give its
    /// row: see `output_ith`).
    fn logits_ith(&self, i: usize) -> Result<&[f32]> {
        // SAFETY: the context is live; llama.cpp checks any index against the last decode's
        // outputs and returns NULL for one that was not an output. (With device sampling it
        // returns the stage's short output for an entry that gave none: `output_ith` asks
        // only for entries that gave their row.)
        let p = unsafe { sys::llama_get_logits_ith(self.ptr.as_ptr(), i as i32) };
        if p.is_null() {
            return Err(Error::Decode(format!("no logits at batch index {i}")));
        }
        // SAFETY: a non-NULL row holds one float per vocabulary token (`n_vocab`, read from the
        // same vocabulary). It stays put and unchanged while `&self` is borrowed: only a
        // decode or a state load (`&mut self`) rewrites the outputs, and llama.cpp finishes
        // its lazy row reordering and pending copies inside the first getter after a decode,
        // before that returns, so no later getter moves a row already handed out.
        Ok(unsafe { std::slice::from_raw_parts(p, self.n_vocab) })
    }

    /// Output `i` of the last decode (batch entry `i`, marked for output): its row, or with
    /// device sampling what the device drew from it (unless its sequence gave the row:
    /// `Batch::want_row`).
    pub fn output_ith(&self, i: usize) -> Result<OutputRef<'_>> {
        if let Some(device) = self.device.as_ref().filter(|d| !d.gave_row(i)) {
            let kept = device.kept().min(self.n_vocab);
            // SAFETY: the context is live, created with the chains, and used by this thread.
            return Ok(OutputRef::Drawn(unsafe {
                Drawn::read(self.ptr.as_ptr(), i, self.n_vocab, kept)
            }?));
        }
        self.logits_ith(i).map(OutputRef::Row)
    }

    /// Outputs `0..n` of the last decode, whose first `n` batch entries were each an output
    /// (a commit's members), as `output_ith` gives them one by one, but read with two
    /// synchronizations with the device instead of one a row: each of llama.cpp's getters
    /// synchronizes (a stream sync on a GPU, paid per branch per step). llama.cpp keeps those
    /// rows contiguous, in the batch's order (`llama_get_logits`); the last row's own getter
    /// checks that, and any doubt (device sampling, an entry not an output) reads row by row.
    pub fn leading_outputs(&self, n: usize) -> Result<Vec<OutputRef<'_>>> {
        let one_by_one = || (0..n).map(|i| self.output_ith(i)).collect();
        if n < 3 || n > self.leading_outputs || self.device.is_some() {
            return one_by_one();
        }
        // SAFETY: the context is live; the call synchronizes and finishes any lazy row
        // reordering, after which no getter moves a row (see `logits_ith`).
        let base = unsafe { sys::llama_get_logits(self.ptr.as_ptr()) }.cast_const();
        let last = self.logits_ith(n - 1)?;
        // Only an address compared (`wrapping_add` reads nothing): is row `n - 1` where the
        // buffer's order puts it?
        if base.is_null() || !std::ptr::eq(last.as_ptr(), base.wrapping_add((n - 1) * self.n_vocab))
        {
            return one_by_one();
        }
        // SAFETY: rows `0..n` of the output buffer: `base` is row 0 and the last row's own
        // getter gave row `n - 1` exactly `n - 1` rows further, one contiguous allocation of
        // `n_vocab` floats a row; unchanged while `&self` is borrowed (see `logits_ith`).
        let rows = unsafe { std::slice::from_raw_parts(base, n * self.n_vocab) };
        Ok(rows
            .chunks_exact(self.n_vocab)
            .map(OutputRef::Row)
            .collect())
    }

    /// With device sampling, how many of each row's best logits the device keeps (a branch
    /// whose chain draws from more wants its row: `Batch::want_row`); None without.
    pub fn device_candidates(&self) -> Option<usize> {
        self.device.as_ref().map(|d| d.kept().min(self.n_vocab))
    }

    /// The candidates this context's device stages keep (before the vocabulary's size), or
    /// the default without device sampling: what a context made like it keeps.
    pub fn device_kept(&self) -> usize {
        self.device.as_ref().map_or(CANDIDATES, DeviceChains::kept)
    }

    /// Where llama.cpp's output buffer starts (it moves only when a decode needs more outputs
    /// than it holds).
    pub fn output_base(&self) -> *const f32 {
        // SAFETY: the context is live; the call reads its output buffer's address (after any
        // lazy row reordering, which stays within the buffer).
        unsafe { sys::llama_get_logits(self.ptr.as_ptr()) }.cast_const()
    }

    /// A `Seq` of this context is below its n_seq_max; checked again before llama.cpp sees
    /// it, since an id out of range aborts the process.
    fn check_seq(&self, seq: Seq) -> Result<i32> {
        Seq::checked(seq.id(), self.n_seq_max).map(Seq::id)
    }

    /// `seq` as llama.cpp's state calls take it: its id, or -1 for every sequence.
    fn check_seq_or_all(&self, seq: Option<Seq>) -> Result<i32> {
        seq.map_or(Ok(-1), |seq| self.check_seq(seq))
    }

    /// Threads of single-token and of multi-token decodes from now on.
    pub fn set_threads(&mut self, threads: i32, threads_batch: i32) {
        // SAFETY: the context is live; the counts are plain values read at the next decode.
        unsafe { sys::llama_set_n_threads(self.ptr.as_ptr(), threads, threads_batch) }
    }

    /// Replace the LoRA adapters applied to every decode from now on (none: `adapters` empty).
    pub fn set_loras(&mut self, adapters: &[(&LoraAdapter, f32)]) -> Result<()> {
        if adapters
            .iter()
            .any(|(a, _)| !Arc::ptr_eq(a.model(), &self._model))
        {
            return Err(Error::Internal("an adapter of another model".into()));
        }
        let mut ptrs: Vec<*mut sys::llama_adapter_lora> =
            adapters.iter().map(|(a, _)| a.as_ptr()).collect();
        let mut scales: Vec<f32> = adapters.iter().map(|(_, s)| *s).collect();
        // SAFETY: the context is live; every pointer is an adapter of this context's model
        // (checked), alive for as long as the model (see `adapter.rs`); both arrays hold
        // `len` elements and llama.cpp copies what it keeps.
        let code = unsafe {
            sys::llama_set_adapters_lora(
                self.ptr.as_ptr(),
                ptrs.as_mut_ptr(),
                ptrs.len(),
                scales.as_mut_ptr(),
            )
        };
        if code != 0 {
            return Err(Error::Decode(format!(
                "llama.cpp refused the adapters (code {code})"
            )));
        }
        Ok(())
    }

    /// Apply a control vector to every decode from now on: `rows` (layers 1.. of llama.cpp,
    /// `n_embd` values each) on llama.cpp's layers `il_start..=il_end`; `None` removes it.
    pub fn set_control_vector(&mut self, cvec: Option<(&[f32], i32, i32)>) -> Result<()> {
        let n_embd = self._model.n_embd();
        let (ptr, len, start, end) = match cvec {
            Some((rows, start, end)) => {
                if n_embd == 0 || rows.len() % n_embd != 0 {
                    return Err(Error::Internal("a control vector of another width".into()));
                }
                (rows.as_ptr(), rows.len(), start, end)
            }
            None => (std::ptr::null(), 0, -1, -1),
        };
        // SAFETY: the context is live; `ptr` is NULL (remove) or `len` floats alive for the
        // call, a whole number of rows of the model's width (checked: llama.cpp reads only
        // whole rows inside `len` and copies them into its own tensors).
        let code = unsafe {
            sys::llama_set_adapter_cvec(self.ptr.as_ptr(), ptr, len, n_embd as i32, start, end)
        };
        if code != 0 {
            return Err(Error::Decode(format!(
                "llama.cpp refused the control vector (code {code})"
            )));
        }
        Ok(())
    }

    /// The pooling llama.cpp applies to embeddings (`LLAMA_POOLING_TYPE_*`).
    pub fn pooling(&self) -> i32 {
        // SAFETY: a getter of the live context.
        unsafe { sys::llama_pooling_type(self.ptr.as_ptr()) }
    }

    /// The pooled embedding of `seq` after the last decode (pooled contexts only): the
    /// model's output width, or the scores of a reranker (rank pooling).
    pub fn embeddings_seq(&self, seq: Seq) -> Result<&[f32]> {
        let seq = self.check_seq(seq)?;
        // SAFETY: the context is live; llama.cpp looks `seq` up in its map of pooled results
        // and returns NULL when the last decode pooled none for it.
        let p = unsafe { sys::llama_get_embeddings_seq(self.ptr.as_ptr(), seq) };
        if p.is_null() {
            return Err(Error::Decode(format!(
                "no pooled embedding for sequence {seq}"
            )));
        }
        // SAFETY: a non-NULL result is the data of the vector llama.cpp sized for this
        // sequence: `n_seq_embd` floats (n_cls_out with rank pooling, else n_embd_out). Only a
        // decode (`&mut self`) replaces it.
        Ok(unsafe { std::slice::from_raw_parts(p, self.n_seq_embd) })
    }

    /// The embedding of batch entry `i` (contexts without pooling), `n_embd_out` wide.
    pub fn embeddings_ith(&self, i: usize) -> Result<&[f32]> {
        // SAFETY: the context is live; llama.cpp checks any index against the last decode's
        // outputs and returns NULL for one that was not an output.
        let p = unsafe { sys::llama_get_embeddings_ith(self.ptr.as_ptr(), i as i32) };
        if p.is_null() {
            return Err(Error::Decode(format!("no embedding at batch index {i}")));
        }
        // SAFETY: a non-NULL row holds `n_embd_out` floats (llama.cpp's row stride for
        // embeddings), stable while `&self` is borrowed, as in `logits_ith`.
        Ok(unsafe { std::slice::from_raw_parts(p, self.n_embd_out) })
    }

    pub fn seq_cp(&mut self, src: Seq, dst: Seq, p0: i32, p1: i32) -> Result<()> {
        let (src, dst) = (self.check_seq(src)?, self.check_seq(dst)?);
        check_range(p0, p1)?;
        if src != dst {
            // SAFETY: `mem` belongs to the live context; both ids are in [0, n_seq_max) and
            // the positions >= -1 (checked above: llama.cpp asserts on anything else).
            unsafe { sys::llama_memory_seq_cp(self.mem, src, dst, p0, p1) };
        }
        Ok(())
    }

    pub fn seq_rm(&mut self, seq: Seq, p0: i32, p1: i32) -> Result<bool> {
        let seq = self.check_seq(seq)?;
        check_range(p0, p1)?;
        // SAFETY: `mem` belongs to the live context; the id and positions are checked above.
        Ok(unsafe { sys::llama_memory_seq_rm(self.mem, seq, p0, p1) })
    }

    /// Empty a freshly leased sequence. A free lease holds no cells unless raw `kv_*` calls
    /// put some there, so the O(n_ctx) scan of `seq_rm` is skipped when it is already empty.
    pub fn clear_seq(&mut self, seq: Seq) -> Result<()> {
        if self.seq_pos_max(seq)? >= 0 {
            self.seq_rm(seq, 0, -1)?;
        }
        Ok(())
    }

    pub fn seq_keep(&mut self, seq: Seq) -> Result<()> {
        let seq = self.check_seq(seq)?;
        // SAFETY: `mem` belongs to the live context; the id is checked above.
        unsafe { sys::llama_memory_seq_keep(self.mem, seq) };
        Ok(())
    }

    pub fn seq_pos_max(&self, seq: Seq) -> Result<i32> {
        let seq = self.check_seq(seq)?;
        // SAFETY: `mem` belongs to the live context; the id is checked above.
        Ok(unsafe { sys::llama_memory_seq_pos_max(self.mem, seq) })
    }

    /// The smallest position `seq` holds (-1 when empty); on a model with sliding-window
    /// layers, the smallest those hold (they drop cells a window behind the sequence's end).
    pub fn seq_pos_min(&self, seq: Seq) -> Result<i32> {
        let seq = self.check_seq(seq)?;
        // SAFETY: `mem` belongs to the live context; the id is checked above.
        Ok(unsafe { sys::llama_memory_seq_pos_min(self.mem, seq) })
    }

    pub fn clear(&mut self) {
        // SAFETY: `mem` belongs to the live context.
        unsafe { sys::llama_memory_clear(self.mem, true) }
    }

    /// The KV cells of `seq`, or of every sequence with `None` (shared cells once, with all
    /// their sequence ids), in llama.cpp's own layout.
    pub fn kv_state(&self, seq: Option<Seq>) -> Result<Vec<u8>> {
        let seq = self.check_seq_or_all(seq)?;
        let ctx = self.ptr.as_ptr();
        // SAFETY: the context is live; `seq` is a checked id or -1 (every sequence).
        let size = unsafe { sys::llama_state_seq_get_size(ctx, seq) };
        let mut buf = vec![0u8; size];
        // SAFETY: `buf` has exactly `size` writable bytes, the length passed; llama.cpp writes
        // at most that many (it returns 0 rather than overrun should the cells have grown).
        let written = unsafe { sys::llama_state_seq_get_data(ctx, buf.as_mut_ptr(), size, seq) };
        if written == 0 && size != 0 {
            return Err(Error::Other(
                "llama.cpp could not copy the KV cells out".into(),
            ));
        }
        buf.truncate(written);
        Ok(buf)
    }

    /// Restore cells written by `kv_state` into `seq` (which must be empty), or replace every
    /// sequence with `None`. Bytes must be kvfork-verified first: llama.cpp trusts them.
    /// On failure the target is left empty.
    pub fn set_kv_state(&mut self, target: Option<Seq>, data: &[u8]) -> Result<()> {
        let seq = self.check_seq_or_all(target)?;
        let ctx = self.ptr.as_ptr();
        // SAFETY: the context is live and `seq` checked (or -1); `data` is readable for the
        // `data.len()` bytes passed, and llama.cpp bounds every read by that length (a short
        // buffer fails the restore). Its contents passed kvfork's framing checks first.
        let (read, logged) = crate::backend::logged_during(|| unsafe {
            sys::llama_state_seq_set_data(ctx, data.as_ptr(), data.len(), seq)
        });
        if read == data.len() {
            return Ok(());
        }
        // A failed restore can leave cells behind (iSWA models).
        match target {
            None => self.clear(),
            Some(seq) => {
                self.seq_rm(seq, -1, -1)?;
            }
        }
        // Cells taken by other sequences are not the bytes' fault: the same state restores
        // once some are free (a state larger than the whole cache is, below).
        if logged.contains("available cells in kv cache") {
            return Err(Error::KvCacheFull(format!(
                "no free KV cells for the saved state (n_ctx = {}): prune branches and retry",
                self.n_ctx
            )));
        }
        Err(Error::State(
            "llama.cpp refused the saved KV cells (saved from a context with other cache \
             types, or too large for this context's n_ctx; see the kvfork log)"
                .into(),
        ))
    }
}

/// `LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY` (llama.h; a `#define` the bindings do not carry):
/// only the recurrent or sliding-window part of a sequence's memory.
const PARTIAL_ONLY: sys::llama_state_seq_flags = 1;

impl LlamaCtx {
    /// The recurrent part of `seq`'s memory only (a recurrent model's whole state; a
    /// hybrid's recurrent layers, not its KV cells): a checkpoint of the state after the
    /// sequence's last token, in host memory.
    pub fn recurrent_state(&self, seq: Seq) -> Result<Vec<u8>> {
        let seq = self.check_seq(seq)?;
        let ctx = self.ptr.as_ptr();
        let flags = PARTIAL_ONLY;
        // SAFETY: the context is live and `seq` a checked id.
        let size = unsafe { sys::llama_state_seq_get_size_ext(ctx, seq, flags) };
        let mut buf = vec![0u8; size];
        // SAFETY: `buf` has exactly `size` writable bytes, the length passed.
        let written =
            unsafe { sys::llama_state_seq_get_data_ext(ctx, buf.as_mut_ptr(), size, seq, flags) };
        if written == 0 && size != 0 {
            return Err(Error::Other(
                "llama.cpp could not copy the recurrent state out".into(),
            ));
        }
        buf.truncate(written);
        Ok(buf)
    }

    /// Put back a state `recurrent_state` copied from a sequence of this context: `seq`'s
    /// recurrent part becomes it (its KV cells, on a hybrid, stay as they are).
    pub fn set_recurrent_state(&mut self, seq: Seq, data: &[u8]) -> Result<()> {
        let seq = self.check_seq(seq)?;
        let ctx = self.ptr.as_ptr();
        let flags = PARTIAL_ONLY;
        // SAFETY: the context is live and `seq` checked; `data` is readable for its length,
        // and came from `recurrent_state` of this same context (same layout and sizes).
        let read = unsafe {
            sys::llama_state_seq_set_data_ext(ctx, data.as_ptr(), data.len(), seq, flags)
        };
        if read == data.len() {
            return Ok(());
        }
        Err(Error::State(
            "llama.cpp refused a recurrent-state checkpoint".into(),
        ))
    }
}

/// KV positions are >= 0, or -1 for an open end.
pub(crate) fn check_range(p0: i32, p1: i32) -> Result<()> {
    if p0 < -1 || p1 < -1 {
        return Err(Error::invalid(
            "p0/p1",
            "positions must be >= 0 (or -1 for 'open')",
        ));
    }
    Ok(())
}

/// A reusable `llama_batch` holding up to `capacity` tokens, one sequence id each.
/// Invariant: `raw`'s token, pos, n_seq_id, seq_id and logits arrays have `capacity` entries,
/// each `seq_id[i]` room for one id, and the first `raw.n_tokens` entries are written.
pub(crate) struct Batch {
    raw: sys::llama_batch,
    capacity: usize,
    /// The sequence of the last entry pushed with `logits` (the decode's last output).
    last_output: Option<Seq>,
    /// Entries pushed with `logits`.
    n_outputs: usize,
    /// Entries at the end added by `pad` (output rows nobody reads), taken out by `unpad`.
    padding: usize,
    /// Sequences whose outputs must be whole rows in a device-sampling context (`want_row`).
    rows: Vec<Seq>,
}

impl Drop for Batch {
    fn drop(&mut self) {
        // SAFETY: `raw` came from `llama_batch_init` and is freed here only, once;
        // `llama_batch_free` frees what init allocated (`seq_id` up to its NULL terminator).
        unsafe { sys::llama_batch_free(self.raw) }
    }
}

impl Batch {
    pub fn new(capacity: usize) -> Self {
        let n = i32::try_from(capacity).expect("a batch capacity fits an i32");
        // SAFETY: allocates `n` entries per array (tokens, as `embd` is 0) and one sequence id
        // per `seq_id[i]`; reads nothing.
        let raw = unsafe { sys::llama_batch_init(n, 0, 1) };
        // llama.cpp does not check its mallocs; `push` relies on every array being there.
        let allocated = capacity == 0
            || (!raw.token.is_null()
                && !raw.pos.is_null()
                && !raw.n_seq_id.is_null()
                && !raw.seq_id.is_null()
                && !raw.logits.is_null()
                // SAFETY: `seq_id` (not NULL) has `capacity` + 1 entries.
                && (0..capacity).all(|i| !unsafe { *raw.seq_id.add(i) }.is_null()));
        assert!(allocated, "out of memory allocating a llama_batch");
        Batch {
            raw,
            capacity,
            last_output: None,
            n_outputs: 0,
            padding: 0,
            rows: Vec::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.raw.n_tokens as usize
    }

    pub fn clear(&mut self) {
        self.raw.n_tokens = 0;
        self.last_output = None;
        self.n_outputs = 0;
        self.padding = 0;
        self.rows.clear();
    }

    /// In a device-sampling context, `seq`'s outputs in this batch come back as whole rows
    /// (its branch's chain needs one: a grammar, a bias, a draw from the whole vocabulary),
    /// not as the device's candidates. Without device sampling every output is a row.
    pub fn want_row(&mut self, seq: Seq) {
        if !self.rows.contains(&seq) {
            self.rows.push(seq);
        }
    }

    /// Entries it can still take.
    pub fn room(&self) -> usize {
        self.capacity - self.len()
    }

    /// Entries marked for output.
    pub fn n_outputs(&self) -> usize {
        self.n_outputs
    }

    /// Append `n` output rows of `seq` (empty) at positions 0..n that only pad the decode
    /// (`Worker::pad_outputs`): not the batch's last output, taken out again by `unpad`.
    /// Callers keep `n <= room()`.
    pub fn pad(&mut self, seq: Seq, n: usize) {
        for i in 0..n {
            // Token 0 exists in every vocabulary.
            self.write(0, i as i32, seq, true);
        }
        self.padding += n;
    }

    /// Take out the rows `pad` added; how many there were.
    pub fn unpad(&mut self) -> usize {
        let n = std::mem::take(&mut self.padding);
        self.raw.n_tokens -= n as i32;
        n
    }

    /// The sequence of the last token marked for output, if any.
    pub fn last_output(&self) -> Option<Seq> {
        self.last_output
    }

    /// The sequences of the tokens marked for output (with repeats), in batch order.
    pub fn output_seqs(&self) -> impl Iterator<Item = Seq> + '_ {
        self.outputs().map(|(_, seq)| seq)
    }

    /// The entries marked for output and their sequences, in batch order.
    pub fn outputs(&self) -> impl Iterator<Item = (usize, Seq)> + '_ {
        (0..self.len()).filter_map(|i| {
            // SAFETY: `i < len() <= capacity` and, by the type's invariant, the first `len()`
            // entries of `logits` and `seq_id` (each with its one id) are written.
            let (wants, seq) = unsafe { (*self.raw.logits.add(i), **self.raw.seq_id.add(i)) };
            (wants != 0).then(|| (i, Seq::new(seq as u32)))
        })
    }

    /// Append one token. Callers keep `len() < capacity` (checked: a panic here is a bug).
    pub fn push(&mut self, token: Token, pos: i32, seq: Seq, logits: bool) {
        debug_assert_eq!(self.padding, 0, "no token after the padding");
        self.write(token, pos, seq, logits);
        if logits {
            self.last_output = Some(seq);
            self.n_outputs += 1;
        }
    }

    /// Write entry `len()`.
    fn write(&mut self, token: Token, pos: i32, seq: Seq, logits: bool) {
        let i = self.len();
        assert!(i < self.capacity, "batch overflow");
        // SAFETY: `i < capacity` (asserted above) and, by the type's invariant, every array has
        // `capacity` entries and `seq_id[i]` room for the one id written.
        unsafe {
            *self.raw.token.add(i) = token;
            *self.raw.pos.add(i) = pos;
            *self.raw.n_seq_id.add(i) = 1;
            *(*self.raw.seq_id.add(i)) = seq.id();
            *self.raw.logits.add(i) = logits as i8;
        }
        self.raw.n_tokens += 1;
    }
}
