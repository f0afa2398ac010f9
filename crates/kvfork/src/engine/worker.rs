//! The engine thread's side: owns the llama context and the batch, takes jobs in order.
//! Commits and prefills are gathered into groups (`gather.rs`) and run in `commit.rs` and
//! `prefill.rs`; every other operation has its file beside this one (see `mod.rs`). They
//! reach the context, the batch and the loans through the few methods below.

use std::collections::VecDeque;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfork_core::gather::GatherPolicy;
use kvfork_core::threads::{ceiling_for, ThreadTuner};

use super::load::LoadMeter;
use super::loans::RowLoans;
use super::shared::{Shared, Stats};
use super::{panic_message, BranchCell, Job, RunJob};
use crate::adapter::AdapterKey;
use crate::error::{Error, Result};
use crate::llama_ctx::{Batch, LlamaCtx};
use crate::seq::Seq;

/// Which decode `Worker::after_decode` accounts for.
#[derive(Clone, Copy)]
pub(super) enum Decoded {
    /// The main context's, whose output rows are branches' (or the raw layer's) new outputs:
    /// the outputs tracker follows them.
    Main,
    /// The main context's, returned once queued: its outputs are read at its landing
    /// (`landing.rs`).
    Queued,
    /// The main context's, aside: rows no branch takes as its new output (`decode_unpadded`).
    Aside,
    /// The scratch context's (`scratch.rs`).
    Scratch,
}

pub(crate) struct Worker {
    ctx: LlamaCtx,
    batch: Batch,
    shared: Arc<Shared>,
    /// Jobs pulled while gathering a group that could not join it, in their queue order:
    /// they run before anything still in the channel (see `gather.rs`).
    stash: VecDeque<Job>,
    /// Which queued jobs share a decode, and how long to wait for them (`kvfork_core::gather`;
    /// `gather.rs` executes its decisions). It hears of every decode's time.
    pub(super) policy: GatherPolicy,
    /// Adapts the thread counts to the machine's load (None when both are fixed), with the
    /// meter that tells it how many cores other processes leave free.
    tuner: Option<(ThreadTuner, LoadMeter)>,
    /// Threads of the last multi-token decode: the team that per-branch work after it uses.
    threads_batch: usize,
    /// Snapshots reading their rows in llama.cpp's output buffer.
    loans: RowLoans,
    /// The adapter set the context holds (see `adapters.rs`).
    adapters: AdapterKey,
    /// One line on stderr per decode (`KVFORK_TRACE_DECODES` set): when, how many tokens, how
    /// long, how many threads — to see how requests share decodes.
    trace: bool,
    /// The contexts new prompts are prefilled in, created on first use (see `scratch.rs`).
    pub(super) scratch: super::scratch::Scratches,
    /// `KVFORK_NO_SCRATCH_PREFILL` unset.
    pub(super) scratch_allowed: bool,
    /// A continuous prefill's chunk waiting to ride the next commit's decode
    /// (`continuous.rs`).
    pub(super) riding: Option<super::continuous::Riding>,
    /// A commit's decode whose outputs are read after its replies went (`landing.rs`).
    pub(super) landing: Option<super::landing::Landing>,
    /// Whether commits reply before their decode's outputs are read (`landing.rs`;
    /// `KVFORK_LAND_BEFORE_REPLY` set: never).
    pub(super) replies_early: bool,
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Before the context (a field) frees the output buffer the loans point into.
        self.loans.give_back_all();
    }
}

impl Worker {
    /// `meter`: started before the context was created (None when both counts are fixed).
    pub(super) fn new(ctx: LlamaCtx, shared: Arc<Shared>, meter: Option<LoadMeter>) -> Self {
        let batch = Batch::new(ctx.n_batch as usize);
        let max = ctx.max_threads;
        let tuner = meter.map(|mut meter| {
            let mut tuner = ThreadTuner::new(max as u32);
            // Busy already? The first prefill must not spin on cores others hold. The window
            // since the meter started (the context's creation) tells, or failing that an
            // instant count of runnable tasks.
            if let Some(others) = meter.others_busy().or_else(|| meter.others_now()) {
                tuner.set_ceiling(ceiling_for(meter.cpus(), others));
            }
            (tuner, meter)
        });
        let (_, threads_batch) = shared.params.threads_with(max);
        let n_seq_max = shared.n_seq_max as usize;
        let mut worker = Worker {
            tuner,
            threads_batch: threads_batch as usize,
            loans: RowLoans::default(),
            ctx,
            batch,
            shared,
            stash: VecDeque::new(),
            policy: GatherPolicy::new(n_seq_max),
            trace: std::env::var_os("KVFORK_TRACE_DECODES").is_some(),
            scratch: Default::default(),
            scratch_allowed: std::env::var_os("KVFORK_NO_SCRATCH_PREFILL").is_none(),
            riding: None,
            landing: None,
            replies_early: std::env::var_os("KVFORK_LAND_BEFORE_REPLY").is_none(),
            adapters: AdapterKey::default(),
        };
        worker.apply_threads(max as u32);
        worker
    }

    pub fn run(mut self, rx: Receiver<Job>) {
        loop {
            let job = match self.stash.pop_front() {
                Some(job) => job,
                None => match rx.recv() {
                    Ok(job) => job,
                    Err(_) => return,
                },
            };
            let Some(job) = self.admit(job) else { continue };
            match job {
                Job::Run(task) | Job::Light { task, .. } => self.run_task(task),
                Job::Clear(seq) => self.clear_seq(seq),
                Job::Commit(first) if first.is_sample_only() => self.answer_sample(first),
                Job::Commit(first) if first.runs_alone() => self.run_commits(vec![first]),
                Job::Commit(first) => self.gather_commits(&rx, first),
                Job::Prefill(first) => self.gather_prefills(&rx, first),
            }
        }
    }

    /// Run a queued closure (its ticket marks it running, so a cancel can abort it).
    pub(super) fn run_task(&mut self, task: Box<dyn RunJob>) {
        let ticket = task.ticket().clone();
        self.shared.abort.set_running(ticket.id());
        task.run(self);
        self.shared.abort.set_running(0);
        ticket.finish();
    }

    // ---- what the operations (this module's other files) use ----

    /// Whether `cell`'s branch is gone: disposed, and its prune (or `retain_only`, or a
    /// restore over it) has run here. A branch disposed by a call made after the work now
    /// running is still registered, its lease and cells intact: that work was requested first
    /// and goes on, as jobs run in the order they were requested (`prune` marks a branch
    /// disposed at once, for the calls made after it).
    pub(super) fn is_gone(&self, cell: &Arc<BranchCell>) -> bool {
        cell.is_disposed()
            && !cell.handle().is_some_and(|h| {
                self.shared()
                    .registry()
                    .get(h)
                    .is_some_and(|node| Arc::ptr_eq(&node.data, cell))
            })
    }

    /// The llama context: KV operations and the outputs of the last decode.
    pub(super) fn ctx(&self) -> &LlamaCtx {
        &self.ctx
    }

    /// The llama context, to change its KV cells.
    pub(super) fn ctx_mut(&mut self) -> &mut LlamaCtx {
        &mut self.ctx
    }

    /// What the engine shares with callers: the model, the branch registry, counters.
    pub(super) fn shared(&self) -> &Shared {
        &self.shared
    }

    /// [`Self::shared`] as an owned handle, to hold one of its locks across `&mut self` calls.
    pub(super) fn shared_handle(&self) -> Arc<Shared> {
        Arc::clone(&self.shared)
    }

    /// The batch, emptied, to fill for the next `decode`.
    pub(super) fn start_batch(&mut self) -> &mut Batch {
        self.batch.clear();
        &mut self.batch
    }

    /// The rows of the output buffer lent to snapshots (see `loans.rs`).
    pub(super) fn loans(&mut self) -> &mut RowLoans {
        &mut self.loans
    }

    /// The adapter set the context holds.
    pub(super) fn applied_adapters(&self) -> &AdapterKey {
        &self.adapters
    }

    pub(super) fn set_applied_adapters(&mut self, key: AdapterKey) {
        self.adapters = key;
    }

    /// Jobs pulled while gathering that did not join the group, in queue order: they run
    /// next, before the rest of the stash and the channel.
    pub(super) fn run_next(&mut self, jobs: impl DoubleEndedIterator<Item = Job>) {
        for job in jobs.rev() {
            self.stash.push_front(job);
        }
    }

    /// The stash's next job, else the channel's (waiting up to `wait` when it is not zero).
    /// None when nothing came (or the channel is closed).
    pub(super) fn next_queued(&mut self, rx: &Receiver<Job>, wait: Duration) -> Option<Job> {
        if let Some(job) = self.stash.pop_front() {
            return Some(job);
        }
        if wait.is_zero() {
            rx.try_recv().ok()
        } else {
            rx.recv_timeout(wait).ok()
        }
    }

    /// Threads for per-branch work right after a decode: the decode's own team.
    pub(super) fn team_threads(&self) -> usize {
        self.threads_batch
    }

    pub(super) fn n_batch(&self) -> usize {
        self.ctx.n_batch as usize
    }

    /// Start `job` unless the context is closed or the job was cancelled (then fail it).
    pub(super) fn admit(&self, job: Job) -> Option<Job> {
        if let Err(e) = self.shared.check_open() {
            job.fail(e);
            return None;
        }
        if job.ticket().is_some_and(|t| !t.start()) {
            job.fail(Error::Cancelled("cancelled before it started".into()));
            return None;
        }
        Some(job)
    }

    /// Empty a fresh lease's sequence. Nobody waits: a failure can only be a closed context.
    pub(super) fn clear_seq(&mut self, seq: Seq) {
        let _ = self.empty_seq(seq);
    }

    /// Empty `seq`, forgetting the last output it held (a raw row, or a branch of it).
    pub(super) fn empty_seq(&mut self, seq: Seq) -> Result<()> {
        self.shared.outputs().emptied(seq);
        self.ctx.clear_seq(seq)
    }

    /// Run `f` for a group of `n` requests; a panic closes the context and fails them all.
    pub(super) fn guarded<R>(
        &mut self,
        n: usize,
        f: impl FnOnce(&mut Self) -> Vec<Result<R>>,
    ) -> Vec<Result<R>> {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(self))) {
            Ok(results) => results,
            Err(payload) => {
                let msg = panic_message(payload.as_ref());
                self.shared
                    .fail(format!("panic on the engine thread: {msg}"));
                (0..n).map(|_| Err(Error::Internal(msg.clone()))).collect()
            }
        }
    }

    /// Whether `cell`'s next output must be a whole row: in a device-sampling context, when
    /// its chain draws from more than the device's candidates (for `Batch::want_row`); never
    /// otherwise (every output is a row).
    pub(super) fn wants_row(&self, cell: &BranchCell) -> bool {
        self.ctx
            .device_candidates()
            .is_some_and(|kept| cell.lock().needs_row(kept))
    }

    /// The sequences of `cells` whose next outputs must be whole rows (`wants_row`).
    pub(super) fn row_seqs<'a>(
        &self,
        cells: impl IntoIterator<Item = &'a Arc<BranchCell>>,
    ) -> Vec<Seq> {
        cells
            .into_iter()
            .filter(|cell| self.wants_row(cell))
            .map(|cell| cell.seq())
            .collect()
    }

    /// `llama_decode` of the current batch, counted. Every row lent to a snapshot is given
    /// back first (the decode overwrites them).
    pub(super) fn decode(&mut self) -> Result<()> {
        self.loans.give_back_all();
        self.decode_batch()
    }

    /// `llama_decode` of the current batch, counted, with no loan given back: the caller has
    /// given back all but those of branches it holds locked (see `loans.rs`).
    pub(super) fn decode_batch(&mut self) -> Result<()> {
        self.decode_main(true).map(|_| ())
    }

    /// `decode_batch` that returns once the graph is queued: on a GPU it may still run. The
    /// landing (`landing.rs`) waits for its outputs and reports its time; this returns when
    /// the decode was queued and the tokens it held, padding included.
    pub(super) fn decode_batch_queued(&mut self) -> Result<(Instant, usize)> {
        self.decode_main(false)
    }

    fn decode_main(&mut self, wait: bool) -> Result<(Instant, usize)> {
        self.read_load();
        let pad = self.pad_outputs();
        let t0 = Instant::now();
        let decode = |ctx: &mut LlamaCtx, batch: &Batch| {
            if wait {
                ctx.decode(batch)
            } else {
                ctx.decode_queued(batch)
            }
        };
        let mut r = decode(&mut self.ctx, &self.batch);
        if pad > 0 {
            self.unpad();
            if matches!(r, Err(Error::KvCacheFull(_))) {
                r = decode(&mut self.ctx, &self.batch); // the padding's cells were the ones missing
            }
        }
        let kind = if wait { Decoded::Main } else { Decoded::Queued };
        self.after_decode(t0.elapsed(), r, pad, kind)
            .map(|()| (t0, self.batch.len() + pad))
    }

    /// `decode` with no output padding, for a batch on the padding sequence itself
    /// (`refresh.rs`) or one with no outputs (`checkpoints.rs`): its rows are no branch's
    /// new output, so the outputs tracker does not follow them.
    pub(super) fn decode_unpadded(&mut self) -> Result<()> {
        self.loans.give_back_all();
        self.read_load();
        let t0 = Instant::now();
        let r = self.ctx.decode(&self.batch);
        self.after_decode(t0.elapsed(), r, 0, Decoded::Aside)
    }

    /// `llama_decode` of the current batch in the scratch context, timed and counted like
    /// the main context's (no output padding; its rows are read at once).
    pub(super) fn decode_in_scratch(&mut self, kind: super::scratch::ScratchKind) -> Result<()> {
        self.read_load();
        let scratch = self.scratch.get(kind).expect("opened before its decodes");
        let t0 = Instant::now();
        let r = scratch.decode(&self.batch);
        self.after_decode(t0.elapsed(), r, 0, Decoded::Scratch)
    }

    /// Account for the decode of the current batch that took `elapsed` (`pad` rows padded;
    /// `kind`: which decode, and whether the outputs tracker follows its rows). A queued
    /// decode's time is the policy's and the tuner's at its landing (`queued_decode_took`).
    pub(super) fn after_decode(
        &mut self,
        elapsed: Duration,
        mut r: Result<()>,
        pad: usize,
        kind: Decoded,
    ) -> Result<()> {
        let finished = !matches!(kind, Decoded::Queued);
        if finished {
            self.policy.decoded(elapsed);
        }
        if matches!(r, Err(Error::Cancelled(_))) && self.shared.abort.is_closing() {
            r = Err(Error::Closed);
        }
        if self.trace {
            self.trace_decode(r.is_ok(), pad, kind);
        }
        if finished {
            self.tune_threads(self.batch.len() + pad);
        }
        let stats = &self.shared.stats;
        Stats::add(&stats.decode_calls, 1);
        Stats::add(&stats.decode_ns, elapsed.as_nanos() as u64);
        Stats::add(&stats.padded_rows, pad as u64);
        if r.is_ok() {
            Stats::add(&stats.decoded_tokens, self.batch.len() as u64);
            let tracked = matches!(kind, Decoded::Main | Decoded::Queued);
            if let Some(last) = self.batch.last_output().filter(|_| tracked) {
                self.shared
                    .outputs()
                    .decoded(self.batch.output_seqs(), last);
            }
        }
        r
    }

    /// Pad the batch's output rows to whole tiles of the CPU's output matmul with rows of the
    /// padding sequence (their logits unread), where that is cheaper than the remainder's
    /// extra pass (`kvfork_core::output_tile`). Only while the outputs stay within the
    /// `n_seq_max` rows llama.cpp reserved, so its output buffer never moves under a row
    /// lent to a snapshot. The rows padded.
    fn pad_outputs(&mut self) -> usize {
        let Some((seq, tile)) = self.ctx.output_padding else {
            return 0;
        };
        let outputs = self.batch.n_outputs();
        let room = self
            .batch
            .room()
            .min((self.ctx.n_seq_max as usize).saturating_sub(outputs));
        let pad = kvfork_core::output_tile::padding(outputs, tile, room);
        self.batch.pad(seq, pad);
        pad
    }

    /// Take the padding rows out of the batch again and empty the padding sequence's cells.
    fn unpad(&mut self) {
        self.batch.unpad();
        if let Some((seq, _)) = self.ctx.output_padding {
            // Fails only on a closed context, which the decode's own result reports.
            let _ = self.ctx.clear_seq(seq);
        }
    }

    fn trace_decode(&self, ok: bool, pad: usize, kind: Decoded) {
        use std::io::Write;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        // Asked for by the user (`KVFORK_TRACE_DECODES`); a failed write is not worth a panic.
        let _ = writeln!(
            std::io::stderr(),
            "kvfork decode: t={:.3} tokens={} pad={pad} ms={:.1} threads={} ok={ok}{}",
            now.as_secs_f64(),
            self.batch.len(),
            self.policy.last_decode().as_secs_f64() * 1e3,
            self.threads_batch,
            match kind {
                Decoded::Main => "",
                Decoded::Queued => " queued",
                Decoded::Aside => " aside",
                Decoded::Scratch => " scratch",
            },
        );
    }

    /// A queued decode of `tokens` tokens (padding included) landed `elapsed` after it was
    /// queued: the gathering policy and the thread tuner hear of it as of any decode.
    pub(super) fn queued_decode_took(&mut self, elapsed: Duration, tokens: usize) {
        self.policy.decoded(elapsed);
        self.tune_threads(tokens);
    }

    /// Feed the decode just timed to the tuner; apply the count it wants next.
    /// `tokens`: how many the decode just timed held.
    fn tune_threads(&mut self, tokens: usize) {
        let Some((tuner, _)) = self.tuner.as_mut() else {
            return;
        };
        let before = tuner.threads();
        tuner.observe(tokens, self.policy.last_decode().as_nanos() as f64);
        self.apply_threads(before);
    }

    /// Lower or raise the tuner's ceiling to the cores other processes left free since the
    /// last reading (at most every few decodes; see `load.rs`), before the next decode.
    fn read_load(&mut self) {
        let Some((tuner, meter)) = self.tuner.as_mut() else {
            return;
        };
        let Some(others) = meter.others_busy() else {
            return;
        };
        let before = tuner.threads();
        tuner.set_ceiling(ceiling_for(meter.cpus(), others));
        self.apply_threads(before);
    }

    /// The (single-token, batch) thread counts in use now.
    pub(super) fn threads(&self) -> (i32, i32) {
        let adaptive = match &self.tuner {
            Some((tuner, _)) => tuner.threads() as i32,
            None => self.ctx.max_threads,
        };
        self.shared.params.threads_with(adaptive)
    }

    /// Hand llama.cpp the tuner's count when it differs from `before` (the count in use).
    fn apply_threads(&mut self, before: u32) {
        let Some((tuner, _)) = self.tuner.as_ref() else {
            return;
        };
        let next = tuner.threads();
        if next == before {
            return;
        }
        let (single, batch) = self.shared.params.threads_with(next as i32);
        self.ctx.set_threads(single, batch);
        for scratch in self.scratch.opened() {
            scratch.set_threads(single, batch);
        }
        self.threads_batch = batch as usize;
        // Readers see the settled choice, not a probe's.
        let (single, batch) = self.shared.params.threads_with(tuner.current() as i32);
        self.shared.threads.set(single, batch);
    }
}
