//! The engine: one thread per context owns the `llama_context` and runs every decode and
//! KV operation in the order requested. Callers hold handles and get [`Pending`] replies.
//!
//! Requests of independent callers on different branches share decodes: while a commit (or
//! a prefill) waits, the thread gathers the compatible requests queued behind it into ONE
//! `llama_decode` (`gather.rs` executes the decisions of `kvfork_core::gather`, the policy);
//! a failure in a shared decode is narrowed down to the request that caused it, and the
//! others still succeed.
//!
//! Every job carries a [`Ticket`] (cancellation, see `pending.rs`). A panic inside a job is
//! caught: its caller gets `Error::Internal` and the context closes (its state may be torn).
//! After `close()` queued jobs fail with `Error::Closed` and a running decode is aborted.
//!
//! The operations have a file each (CONTRIBUTING.md maps the public calls onto them):
//! `commit.rs` (commits and generation steps; their rows read after the replies in
//! `landing.rs`), `continuous.rs` (prefills chunk by chunk, with
//! the streams' steps riding their decodes), `prefill.rs` (packed prefills), `tree.rs` (fork, prunes,
//! retain_only), `park.rs` (parked branches of a `park` context), `reseed.rs`,
//! `speculate.rs`, `score.rs`, `state_io.rs` (save, load, snapshots), `embed.rs`, `kv.rs` (raw KV),
//! `takeover.rs` (the raw layer: `Context::decode`, a branch taking a sequence's cells over).

mod adapters;
mod checkpoints;
mod commit;
mod continuous;
mod embed;
mod gather;
mod kv;
mod landing;
mod load;
mod loans;
mod outputs;
mod parallel;
mod park;
mod pending;
mod prefill;
mod refresh;
mod reseed;
mod score;
mod scratch;
mod share;
pub(crate) mod shared;
mod speculate;
mod state_io;
mod summaries;
mod takeover;
mod tree;
mod worker;

use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;

pub(crate) use outputs::LastOutput;
pub(crate) use pending::{next_run_id, CancelPolicy, Relay, Reply, Ticket};
pub use pending::{Cancel, Canceller, Pending};
pub(crate) use shared::{BranchCell, Shared};
pub(crate) use takeover::check_unleased;
pub(crate) use tree::Prune;
pub(crate) use worker::Worker;

use crate::context_params::ContextParams;
use crate::error::{Error, Result};
use crate::llama_ctx::LlamaCtx;
use crate::model::{Model, Token};
use crate::produced::Produced;
use crate::seq::Seq;

/// Stack of the engine thread (virtual memory; pages are only touched when used).
const ENGINE_STACK_BYTES: usize = 64 << 20;

/// One token for one branch, part of a commit.
pub(crate) type CommitItem = (Arc<BranchCell>, Token);

/// Accept + decode one token per branch; mergeable with neighbouring commits.
pub(crate) struct CommitRequest {
    pub items: Vec<CommitItem>,
    pub reply: CommitReply,
    pub ticket: Arc<Ticket>,
}

/// Who chose the tokens of a commit request.
pub(crate) enum CommitReply {
    /// The caller gave them.
    Given(Reply<()>),
    /// One branch; the engine samples its token first, then commits it (a generation step)
    /// unless `commit` is false (`produce`) or it is a stop token. Sample-only requests ride
    /// in the same groups as commits, so a `produce` never splits a gathering of commits.
    Sampled {
        reply: Reply<Produced>,
        commit: bool,
    },
    /// Every branch of a `BranchStore::step`: all sampled, then their tokens committed
    /// together except stop tokens; all or nothing.
    SampledAll(Reply<Vec<Produced>>),
}

impl CommitReply {
    /// Whether the engine samples the tokens (a step or a `produce`).
    fn is_sampled(&self) -> bool {
        !matches!(self, CommitReply::Given(_))
    }
}

impl CommitRequest {
    /// A `produce`: sample only, nothing to decode.
    fn is_sample_only(&self) -> bool {
        matches!(self.reply, CommitReply::Sampled { commit: false, .. })
    }

    /// A `BranchStore::step`: its caller gathered it already, so it runs as it comes and
    /// alone, never waiting for or joining other commits (as before it took this path).
    fn runs_alone(&self) -> bool {
        matches!(self.reply, CommitReply::SampledAll(_))
    }
}

/// Tokens to decode into one branch, part of a prefill.
pub(crate) type PrefillItem = (Arc<BranchCell>, Vec<Token>);

/// Decode external tokens into branches (packed); mergeable with neighbouring prefills.
pub(crate) struct PrefillRequest {
    pub items: Vec<PrefillItem>,
    pub reply: Reply<()>,
    pub ticket: Arc<Ticket>,
}

impl CommitReply {
    /// Reply with the request's result: the tokens it sampled, if any.
    fn send(self, result: Result<Vec<Produced>>) {
        match self {
            CommitReply::Given(r) => r.send(result.map(drop)),
            CommitReply::Sampled { reply, .. } => reply.send(result.and_then(|p| {
                p.into_iter()
                    .next()
                    .ok_or_else(|| Error::Internal("a sampled request produced no token".into()))
            })),
            CommitReply::SampledAll(reply) => reply.send(result),
        }
    }
}

pub(crate) enum Job {
    Commit(CommitRequest),
    Prefill(PrefillRequest),
    /// Empty the sequence of a fresh lease (`Branch::create`). It touches no other sequence,
    /// so a gathering runs it in passing instead of stopping at it. Nobody waits for it.
    Clear(Seq),
    /// A KV operation that decodes nothing and touches only these branches (a prefix
    /// cache's `share_prefix`): a gathering runs it in passing unless the group has a branch
    /// it `writes` (one it only `reads` may be in the group: the group has not run yet).
    Light {
        reads: Vec<Arc<BranchCell>>,
        writes: Vec<Arc<BranchCell>>,
        task: Box<dyn RunJob>,
    },
    /// Any other work, run in order.
    Run(Box<dyn RunJob>),
}

impl Job {
    fn ticket(&self) -> Option<&Ticket> {
        match self {
            Job::Commit(c) => Some(&c.ticket),
            Job::Prefill(p) => Some(&p.ticket),
            Job::Clear(_) => None,
            Job::Light { task, .. } => Some(task.ticket()),
            Job::Run(r) => Some(r.ticket()),
        }
    }

    /// Reply with an error without running.
    fn fail(self, err: Error) {
        match self {
            Job::Commit(c) => c.reply.send(Err(err)),
            Job::Prefill(p) => p.reply.send(Err(err)),
            Job::Clear(_) => {}
            Job::Light { task, .. } => task.fail(err),
            Job::Run(r) => r.fail(err),
        }
    }
}

/// A closure and its reply, type-erased so every job of the queue has one shape.
pub(crate) trait RunJob: Send {
    fn ticket(&self) -> &Arc<Ticket>;
    /// Run and reply. A panic is caught: the context closes and the caller gets `Internal`.
    fn run(self: Box<Self>, w: &mut Worker);
    fn fail(self: Box<Self>, err: Error);
}

struct Task<T, F> {
    f: F,
    reply: Reply<T>,
    ticket: Arc<Ticket>,
}

impl<T: Send, F: FnOnce(&mut Worker) -> Result<T> + Send> RunJob for Task<T, F> {
    fn ticket(&self) -> &Arc<Ticket> {
        &self.ticket
    }

    fn run(self: Box<Self>, w: &mut Worker) {
        let Task { f, reply, .. } = *self;
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(w))) {
            Ok(r) => reply.send(r),
            Err(payload) => {
                let msg = panic_message(payload.as_ref());
                // Closed before the caller hears of it, so it sees `closed` at once.
                w.shared()
                    .fail(format!("panic on the engine thread: {msg}"));
                reply.send(Err(Error::Internal(msg)));
            }
        }
    }

    fn fail(self: Box<Self>, err: Error) {
        self.reply.send(Err(err));
    }
}

/// Give memory freed by a finished engine thread back to the OS. glibc keeps a malloc arena
/// per thread, and the megabytes a context frees stay in its arena: without this, opening and
/// closing contexts grows the process by ~20 KiB per context (measured over 1,000).
fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        extern "C" {
            fn malloc_trim(pad: usize) -> std::ffi::c_int;
        }
        // SAFETY: glibc's `malloc_trim` (this cfg), declared with its C signature; it takes a
        // plain size, returns only free pages to the OS and locks each arena it trims, so any
        // thread may call it at any time.
        unsafe { malloc_trim(0) };
    }
}

/// The text of a panic payload.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".into()
    }
}

/// How a thread that may hold a host runtime's lock (Python's GIL) waits for an engine thread
/// to end: the host lets the lock go meanwhile (the engine thread may need it to forward a log
/// line, the last ones of an aborted decode among them). Set once (`set_blocking_wrapper`).
static BLOCKING_WRAPPER: OnceLock<fn(&mut dyn FnMut())> = OnceLock::new();

/// Have `wrapper` run the waits for an engine thread to end (the join of a closed or dropped
/// context), so that a host can release a lock its callbacks take: `wrapper` must call the
/// function it is given, once. The first call sets it; later ones do nothing.
pub fn set_blocking_wrapper(wrapper: fn(&mut dyn FnMut())) {
    let _ = BLOCKING_WRAPPER.set(wrapper);
}

/// The engines of the contexts alive now (`close_all`).
static LIVE: Mutex<Vec<std::sync::Weak<Engine>>> = Mutex::new(Vec::new());

/// Count `engine` among the live ones.
pub(crate) fn register(engine: &Arc<Engine>) {
    let mut live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
    live.retain(|e| e.strong_count() > 0);
    live.push(Arc::downgrade(engine));
}

/// The engines still alive, taken off the list (the caller closes them).
fn take_live(live: &mut Vec<std::sync::Weak<Engine>>) -> Vec<Arc<Engine>> {
    std::mem::take(live)
        .iter()
        .filter_map(std::sync::Weak::upgrade)
        .collect()
}

/// Close every context still alive (its work aborted and failed, its thread ended): for a
/// host's exit, where a thread frozen holding a context would leave its engine decoding while
/// the process's static destructors run (a crash).
pub fn close_all() {
    let live = take_live(&mut LIVE.lock().unwrap_or_else(|e| e.into_inner()));
    for engine in live {
        engine.close();
    }
}

/// In the child of a `fork()`, which has none of the parent's other threads: every context the
/// parent had is closed without waiting for its engine thread, and any use of it says why.
/// A lock held by a thread the fork did not copy is passed over.
pub fn forsake_all_after_fork() {
    let Ok(mut live) = LIVE.try_lock() else {
        return;
    };
    for engine in take_live(&mut live) {
        engine.forsake();
    }
}

/// The caller's side of an engine thread.
pub(crate) struct Engine {
    tx: Mutex<Option<mpsc::Sender<Job>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    pub shared: Arc<Shared>,
}

impl Engine {
    /// Start the thread; it creates the llama context itself and reports success or failure.
    pub fn start(model: Arc<Model>, params: ContextParams) -> Result<Engine> {
        params.validate()?;
        crate::backend::ensure_backend()?;
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let (tx, rx) = mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<Arc<Shared>>>();
        let thread_model = model.clone();
        let thread = std::thread::Builder::new()
            .name("kvfork-engine".into())
            // llama.cpp recurses (grammars, libstdc++ regex for lazy triggers): room to spare.
            .stack_size(ENGINE_STACK_BYTES)
            .spawn(move || {
                // The load meter's first window spans the context's creation, so that the
                // first prefill already knows how busy the machine is.
                let meter = params.adapts_threads().then(load::LoadMeter::new);
                let mut ctx = match LlamaCtx::new(thread_model.clone(), &params) {
                    Ok(ctx) => ctx,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let shared = Arc::new(Shared {
                    model: thread_model,
                    // With `park`, branches outnumber leases: the registry's ids are slots.
                    registry: Mutex::new(kvfork_core::Registry::new(if params.park {
                        park::SLOTS
                    } else {
                        params.n_seq_max
                    })),
                    park: params
                        .park
                        .then(|| Mutex::new(kvfork_core::ParkLedger::new(params.n_seq_max))),
                    stats: Default::default(),
                    closed: Default::default(),
                    failure: Default::default(),
                    forked: Default::default(),
                    abort: Default::default(),
                    n_ctx: ctx.n_ctx,
                    n_batch: ctx.n_batch,
                    n_seq_max: params.n_seq_max,
                    pooling: ctx.pooling(),
                    threads: Default::default(),
                    rows_landed: Default::default(),
                    outputs: Default::default(),
                    params: params.clone(),
                    id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
                });
                let (single, batch) = params.threads_with(ctx.max_threads);
                shared.threads.set(single, batch);
                ctx.set_abort_signal(shared.abort.clone());
                // Before the context is handed out: the thread counts it reports are set.
                let worker = Worker::new(ctx, shared.clone(), meter);
                let _ = ready_tx.send(Ok(shared));
                worker.run(rx);
            })
            .map_err(|e| Error::Other(format!("could not start the engine thread: {e}")))?;
        let shared = ready_rx
            .recv()
            .map_err(|_| Error::Other("the engine thread died while starting".into()))??;
        Ok(Engine {
            tx: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            shared,
        })
    }

    fn send(&self, job: Job) -> Result<()> {
        self.shared.check_open()?;
        let tx = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        tx.as_ref()
            .ok_or(Error::Closed)?
            .send(job)
            .map_err(|_| Error::Closed)
    }

    /// Queue `f` to run on the engine thread; a cancel drops it while it is queued.
    pub fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Worker) -> Result<T> + Send + 'static,
    ) -> Pending<T> {
        self.run_with(CancelPolicy::Drop, f)
    }

    /// Queue `f` with an explicit cancel policy.
    pub fn run_with<T: Send + 'static>(
        &self,
        policy: CancelPolicy,
        f: impl FnOnce(&mut Worker) -> Result<T> + Send + 'static,
    ) -> Pending<T> {
        self.queue_task(policy, f, Job::Run)
    }

    /// Queue `f`, a KV operation that decodes nothing, reads only `reads` and changes only
    /// `writes`: a gathering of other branches' commits or prefills runs it in passing
    /// instead of stopping at it.
    pub fn run_light<T: Send + 'static>(
        &self,
        policy: CancelPolicy,
        reads: Vec<Arc<BranchCell>>,
        writes: Vec<Arc<BranchCell>>,
        f: impl FnOnce(&mut Worker) -> Result<T> + Send + 'static,
    ) -> Pending<T> {
        self.queue_task(policy, f, |task| Job::Light {
            reads,
            writes,
            task,
        })
    }

    /// Queue `f` as the job `as_job` makes of it, with a ticket of `policy`.
    fn queue_task<T: Send + 'static>(
        &self,
        policy: CancelPolicy,
        f: impl FnOnce(&mut Worker) -> Result<T> + Send + 'static,
        as_job: impl FnOnce(Box<dyn RunJob>) -> Job,
    ) -> Pending<T> {
        let ticket = Ticket::new(policy, self.shared.abort.clone());
        let (reply, pending) = Pending::channel(Some(ticket.clone()));
        match self.send(as_job(Box::new(Task { f, reply, ticket }))) {
            Ok(()) => pending,
            Err(e) => Pending::ready(Err(e)),
        }
    }

    /// Queue a prefill that may be packed with the prefills queued behind it. Cancelled while
    /// it runs, it is aborted and rolled back.
    pub fn prefill(&self, items: Vec<PrefillItem>) -> Pending<()> {
        let ticket = Ticket::new(CancelPolicy::DropOrAbort, self.shared.abort.clone());
        let (reply, pending) = Pending::channel(Some(ticket.clone()));
        match self.send(Job::Prefill(PrefillRequest {
            items,
            reply,
            ticket,
        })) {
            Ok(()) => pending,
            Err(e) => Pending::ready(Err(e)),
        }
    }

    /// Queue the emptying of a fresh lease's sequence (a failure can only be a closed
    /// context, which the next call reports).
    pub fn clear_seq(&self, seq: Seq) {
        let _ = self.send(Job::Clear(seq));
    }

    /// Queue a coalescable commit.
    pub fn commit(&self, items: Vec<CommitItem>) -> Pending<()> {
        self.queue_commit(items, CommitReply::Given)
    }

    /// Queue a coalescable sample of one branch, then (with `commit`) its commit unless it is
    /// a stop token.
    pub fn sample(&self, cell: Arc<BranchCell>, commit: bool) -> Pending<Produced> {
        self.queue_commit(vec![(cell, -1)], |reply| CommitReply::Sampled {
            reply,
            commit,
        })
    }

    /// Queue a sample of every branch, then one commit of their tokens but stop tokens
    /// (`BranchStore::step`: all or nothing).
    pub fn step(&self, cells: Vec<Arc<BranchCell>>) -> Pending<Vec<Produced>> {
        let items = cells.into_iter().map(|cell| (cell, -1)).collect();
        self.queue_commit(items, CommitReply::SampledAll)
    }

    fn queue_commit<T>(
        &self,
        items: Vec<CommitItem>,
        reply: impl FnOnce(Reply<T>) -> CommitReply,
    ) -> Pending<T> {
        let ticket = Ticket::new(CancelPolicy::Drop, self.shared.abort.clone());
        let (tx, pending) = Pending::channel(Some(ticket.clone()));
        let request = CommitRequest {
            items,
            reply: reply(tx),
            ticket,
        };
        match self.send(Job::Commit(request)) {
            Ok(()) => pending,
            Err(e) => Pending::ready(Err(e)),
        }
    }

    /// Abort the running decode, fail queued work, free the llama context, join the thread.
    /// Idempotent.
    pub fn close(&self) {
        if self.shared.forked.load(Ordering::Acquire) {
            return; // left behind by a fork (`forsake`): nothing here to close
        }
        self.shared.closed.store(true, Ordering::Release);
        self.shared.abort.close();
        drop(self.tx.lock().unwrap_or_else(|e| e.into_inner()).take());
        let thread = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = thread {
            if t.thread().id() != std::thread::current().id() {
                let mut t = Some(t);
                let mut join = || {
                    if let Some(t) = t.take() {
                        let _ = t.join();
                    }
                };
                match BLOCKING_WRAPPER.get() {
                    Some(wrapper) => wrapper(&mut join),
                    None => join(),
                }
                release_freed_memory();
            }
        }
        for (_, node) in self.shared.registry().iter() {
            node.data.mark_disposed();
        }
    }

    /// `close` in a forked child: the engine thread is not in this process, so it is not
    /// waited for (nor are its jobs: nobody here waits for them).
    #[allow(clippy::mem_forget)]
    fn forsake(&self) {
        self.shared.forked.store(true, Ordering::Release);
        self.shared.closed.store(true, Ordering::Release);
        // Neither the channel's receiver nor the thread is in this process: nothing of theirs
        // is dropped (a detach of a thread id that is not here, a channel another thread may
        // have held mid-send at the fork), only leaked.
        if let Ok(mut tx) = self.tx.try_lock() {
            std::mem::forget(tx.take());
        }
        if let Ok(mut thread) = self.thread.try_lock() {
            std::mem::forget(thread.take());
        }
        if let Ok(registry) = self.shared.registry.try_lock() {
            for (_, node) in registry.iter() {
                node.data.mark_disposed();
            }
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.close();
    }
}
