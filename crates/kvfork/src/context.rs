//! `Context`: a llama context on its engine thread, plus the model's text helpers.

use std::sync::Arc;

use crate::context_params::ContextParams;
use crate::engine::{CancelPolicy, Engine, Pending, Shared, Worker};
use crate::error::{Error, Result};
use crate::llama_ctx::check_range;
use crate::model::{Model, Token};
use crate::seq::Seq;

/// Counters since the context was created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextStats {
    /// `llama_decode` invocations.
    pub decode_calls: u64,
    /// Tokens decoded successfully.
    pub decoded_tokens: u64,
    /// Time spent in `llama_decode` (on a GPU, until its outputs are ready), nanoseconds.
    pub decode_ns: u64,
    /// Rows of the padding sequence added to decodes so that their outputs fill whole tiles
    /// of the CPU's output matmul (see `kvfork_core::output_tile`); not in `decoded_tokens`.
    pub padded_rows: u64,
    /// Prompt tokens of new sequences prefilled in a scratch context whose attention sees
    /// only them, then moved to the cache (see `engine/scratch.rs`); in `decoded_tokens` too.
    pub scratch_tokens: u64,
    /// Decodes that held the next chunk of prompts being prefilled and one token of each of
    /// the streams stepping meanwhile (see `engine/continuous.rs`).
    pub mixed_decodes: u64,
    /// Commit requests served (several may share one decode).
    pub commit_requests: u64,
    /// Wall time of the engine's commit groups (steps and commits), from a group's start
    /// until its replies go out, their decodes included: with `decode_ns`, where a step's
    /// time goes.
    pub commit_ns: u64,
    /// Recurrent-state checkpoints taken (recurrent and hybrid models; see
    /// `engine/checkpoints.rs`).
    pub checkpoints_taken: u64,
    /// Bytes of the checkpoints taken.
    pub checkpoint_bytes_taken: u64,
    /// Time spent copying them out of llama.cpp's memory, in nanoseconds.
    pub checkpoint_ns: u64,
    /// Checkpoints put back: a fork inside a sequence, a rolled-back guess or decode.
    pub checkpoint_restores: u64,
    /// Tokens decoded again after a checkpoint was put back.
    pub replayed_tokens: u64,
    /// Checkpoints the live branches hold now (each once; forks share their parent's).
    pub checkpoints: u64,
    /// Bytes of those checkpoints, in host memory.
    pub checkpoint_bytes: u64,
    /// Branches parked in host memory now (`park` contexts).
    pub parked_branches: u64,
    /// Bytes of KV cells those branches hold in host memory now.
    pub parked_bytes: u64,
    /// Times a branch was parked (moved to host memory).
    pub parks: u64,
    /// Times a parked branch was brought back onto a lease.
    pub unparks: u64,
}

/// A llama context with a unified KV cache, owned by its engine thread. Cheap to clone.
#[derive(Clone)]
pub struct Context {
    engine: Arc<Engine>,
}

impl Context {
    /// Create a context on `model` (blocks while llama.cpp allocates it).
    pub fn new(model: Arc<Model>, params: ContextParams) -> Result<Context> {
        let engine = Arc::new(Engine::start(model, params)?);
        crate::engine::register(&engine);
        Ok(Context { engine })
    }

    pub(crate) fn engine(&self) -> &Engine {
        &self.engine
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.engine.shared
    }

    pub(crate) fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Worker) -> Result<T> + Send + 'static,
    ) -> Pending<T> {
        self.engine.run(f)
    }

    /// The model the context runs.
    pub fn model(&self) -> &Arc<Model> {
        &self.shared().model
    }

    /// KV cache size in tokens (shared by all sequences: the cache is unified).
    pub fn n_ctx(&self) -> u32 {
        self.shared().n_ctx
    }

    /// Most tokens one `llama_decode` takes.
    pub fn n_batch(&self) -> u32 {
        self.shared().n_batch
    }

    /// Number of KV sequences, so of live branches at once.
    pub fn n_seq_max(&self) -> u32 {
        self.shared().n_seq_max
    }

    /// Threads single-token decodes use now (they adapt to the machine's load unless the
    /// context was created with a fixed `n_threads`).
    pub fn n_threads(&self) -> i32 {
        self.shared().threads.get().0
    }

    /// Threads multi-token decodes (prefills, batched steps) use now.
    pub fn n_threads_batch(&self) -> i32 {
        self.shared().threads.get().1
    }

    /// Whether the context samples on the device (`ContextParams::device_sampling`).
    pub fn device_sampling(&self) -> bool {
        self.shared().params.device_sampling
    }

    /// Tokens in the model's vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.model().vocab_size()
    }

    /// Free the llama context after queued work finishes. Later use fails with `Error::Closed`.
    pub fn close(&self) {
        self.engine.close();
    }

    /// Whether the context was closed (or closed itself after an internal failure).
    pub fn is_closed(&self) -> bool {
        self.shared().check_open().is_err()
    }

    /// A sequence id argument (the raw layer's, `fork(seq_id=)`), checked against the
    /// context's sequences.
    pub(crate) fn seq_arg(&self, seq_id: i32) -> Result<Seq> {
        Seq::checked(seq_id, self.n_seq_max()).map_err(|_| {
            Error::invalid(
                "seq_id",
                format!(
                    "sequence id {seq_id} is not in [0, n_seq_max = {})",
                    self.n_seq_max()
                ),
            )
        })
    }

    /// Leases free now.
    pub fn available(&self) -> u32 {
        self.shared().available()
    }

    /// Whether branches without a free lease are parked in host memory (`park=True`).
    pub fn parks(&self) -> bool {
        self.shared().park.is_some()
    }

    /// Checkpoints the live branches hold and their bytes, each state once (forks share
    /// their parent's).
    fn checkpoints_held(&self) -> (u64, u64) {
        if !self.model().is_recurrent() {
            return (0, 0); // none kept: no branch to lock
        }
        let cells: Vec<_> = self
            .shared()
            .registry()
            .iter()
            .map(|(_, node)| node.data.clone())
            .collect();
        let mut seen = std::collections::HashSet::new();
        let mut bytes = 0u64;
        for cell in cells {
            for state in cell.lock().checkpoint_states() {
                if seen.insert(state.as_ptr()) {
                    bytes += state.len() as u64;
                }
            }
        }
        (seen.len() as u64, bytes)
    }

    /// Counters since the context was created.
    pub fn stats(&self) -> ContextStats {
        use crate::engine::shared::Stats;
        let s = &self.shared().stats;
        let (parked, bytes) = self.shared().ledger().map_or((0, 0), |l| l.parked_totals());
        let held = self.checkpoints_held();
        ContextStats {
            parked_branches: parked as u64,
            parked_bytes: bytes as u64,
            parks: Stats::get(&s.parks),
            unparks: Stats::get(&s.unparks),
            decode_calls: Stats::get(&s.decode_calls),
            decoded_tokens: Stats::get(&s.decoded_tokens),
            decode_ns: Stats::get(&s.decode_ns),
            padded_rows: Stats::get(&s.padded_rows),
            scratch_tokens: Stats::get(&s.scratch_tokens),
            mixed_decodes: Stats::get(&s.mixed_decodes),
            commit_requests: Stats::get(&s.commit_requests),
            commit_ns: Stats::get(&s.commit_ns),
            checkpoints_taken: Stats::get(&s.checkpoints_taken),
            checkpoint_bytes_taken: Stats::get(&s.checkpoint_bytes_taken),
            checkpoint_ns: Stats::get(&s.checkpoint_ns),
            checkpoint_restores: Stats::get(&s.checkpoint_restores),
            replayed_tokens: Stats::get(&s.replayed_tokens),
            checkpoints: held.0,
            checkpoint_bytes: held.1,
        }
    }

    /// Tokenize as llama.cpp does (`add_special`: BOS etc.; `parse_special`: control
    /// tokens written as text are recognised).
    pub fn tokenize(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<Token>> {
        self.shared().check_open()?;
        self.model().tokenize(text, add_special, parse_special)
    }

    /// Detokenize as llama.cpp does.
    pub fn detokenize(
        &self,
        tokens: &[Token],
        remove_special: bool,
        unparse_special: bool,
    ) -> Result<String> {
        self.shared().check_open()?;
        self.model()
            .detokenize(tokens, remove_special, unparse_special)
    }

    /// One token's piece as text (special tokens rendered, invalid UTF-8 replaced).
    pub fn token_to_text(&self, token: Token) -> Result<String> {
        self.shared().check_open()?;
        self.model().token_to_text(token)
    }

    /// Whether `token` ends generation (end-of-generation per the vocabulary).
    pub fn is_stop_token(&self, token: Token) -> Result<bool> {
        self.model().check_token(token)?;
        Ok(self.model().is_eog(token))
    }

    /// Make the engine thread panic inside a job (tests of the panic path only).
    #[doc(hidden)]
    pub fn debug_panic(&self) -> Pending<()> {
        self.run(|_| panic!("requested by debug_panic"))
    }

    // Low-level KV operations; they bypass branch tenancy. Arguments are checked here, so a
    // caller may queue them without waiting (they run in order with all other engine work).

    /// A caller's sequence id, checked (the public API takes integers).
    fn check_seq(&self, seq: i32) -> Result<Seq> {
        Seq::checked(seq, self.n_seq_max())
    }

    /// Queue `f` with the arguments `checked` gave, unless they or the context failed.
    fn queue_kv<A: Send + 'static, T: Send + 'static>(
        &self,
        checked: Result<A>,
        f: impl FnOnce(&mut Worker, A) -> Result<T> + Send + 'static,
    ) -> Pending<T> {
        match checked.and_then(|a| self.shared().check_open().map(|_| a)) {
            Ok(a) => self.engine.run_with(CancelPolicy::Never, move |w| f(w, a)),
            Err(e) => Pending::ready(Err(e)),
        }
    }

    /// Tag the cells of `src` in `[p0, p1)` as also belonging to `dst` (-1: open end). A
    /// recurrent or hybrid model's state is copied whole: a part of the sequence is refused
    /// (llama.cpp copied the state of all of `src` beside the part of its cells, a sequence
    /// whose state and cells disagree).
    pub fn kv_seq_copy(&self, src: i32, dst: i32, p0: i32, p1: i32) -> Pending<()> {
        let checked = self.check_seq(src).and_then(|src| {
            let dst = self.check_seq(dst)?;
            check_range(p0, p1)?;
            if !self.kv_can_remove(p0, p1) {
                return Err(Error::invalid(
                    "p0, p1",
                    format!(
                        "[{p0}, {p1}) is part of the sequence, and a recurrent model's state \
                         cannot be copied in part: copy it whole (p0=0, p1=-1)"
                    ),
                ));
            }
            Ok((src, dst))
        });
        self.queue_kv(checked, move |w, (src, dst)| {
            w.kv_seq_copy(src, dst, p0, p1)
        })
    }

    /// Remove every sequence but `seq` from the cache.
    pub fn kv_seq_keep(&self, seq: i32) -> Pending<()> {
        self.queue_kv(self.check_seq(seq), |w, seq| w.kv_seq_keep(seq))
    }

    /// Whether `kv_seq_remove(seq, p0, p1)` can succeed: always for a KV cache; a recurrent
    /// model's state cannot lose only part of a sequence.
    pub fn kv_can_remove(&self, p0: i32, p1: i32) -> bool {
        let whole = p0 <= 0 && p1 < 0;
        whole || !self.model().is_recurrent()
    }

    /// Remove `seq`'s cells in `[p0, p1)` (-1: open end); false when the model cannot.
    pub fn kv_seq_remove(&self, seq: i32, p0: i32, p1: i32) -> Pending<bool> {
        let checked = self
            .check_seq(seq)
            .and_then(|seq| check_range(p0, p1).map(|_| seq));
        self.queue_kv(checked, move |w, seq| w.kv_seq_remove(seq, p0, p1))
    }

    /// The largest position `seq` holds, -1 when it is empty.
    pub fn kv_seq_pos_max(&self, seq: i32) -> Pending<i32> {
        self.queue_kv(self.check_seq(seq), |w, seq| w.kv_seq_pos_max(seq))
    }

    /// Empty the whole KV cache.
    pub fn kv_clear(&self) -> Pending<()> {
        self.queue_kv(Ok(()), |w, ()| {
            w.kv_clear();
            Ok(())
        })
    }
}
