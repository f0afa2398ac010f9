//! The engine: one thread per context owns the `llama_context` and runs every decode and
//! KV operation in the order requested. Callers hold handles and get [`Pending`] replies.
//!
//! Concurrent single-token commits on different branches are coalesced: while a commit
//! request waits, the thread gathers the commits queued behind it (and, when the previous
//! step was a group, lingers briefly for its members) into ONE `llama_decode`.

mod parallel;
mod pending;
pub(crate) mod shared;
mod worker;

use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

pub(crate) use parallel::map_parallel;
pub use pending::Pending;
pub(crate) use pending::Reply;
pub(crate) use shared::{BranchCell, Shared};
pub(crate) use worker::Worker;

use crate::error::{Error, Result};
use crate::llama_ctx::{ContextParams, LlamaCtx};
use crate::model::{Model, Token};

/// One token for one branch, part of a commit.
pub(crate) type CommitItem = (Arc<BranchCell>, Token);

pub(crate) enum Job {
    /// Accept + decode one token per branch; mergeable with neighbouring commits.
    Commit {
        items: Vec<CommitItem>,
        reply: Reply<()>,
    },
    /// Any other work, run in order.
    Run(Box<dyn FnOnce(&mut Worker) + Send>),
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
            .spawn(move || {
                let ctx = match LlamaCtx::new(thread_model.clone(), &params) {
                    Ok(ctx) => ctx,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let shared = Arc::new(Shared {
                    model: thread_model,
                    registry: Mutex::new(kvfork_core::Registry::new(ctx.n_seq_max)),
                    stats: Default::default(),
                    closed: Default::default(),
                    n_ctx: ctx.n_ctx,
                    n_batch: ctx.n_batch,
                    n_seq_max: ctx.n_seq_max,
                    id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
                });
                let _ = ready_tx.send(Ok(shared.clone()));
                Worker::new(ctx, shared).run(rx);
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

    /// Queue `f` to run on the engine thread.
    pub fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Worker) -> Result<T> + Send + 'static,
    ) -> Pending<T> {
        let (reply, pending) = Pending::channel();
        let job = Job::Run(Box::new(move |w: &mut Worker| {
            let _ = reply.send(f(w));
        }));
        match self.send(job) {
            Ok(()) => pending,
            Err(e) => Pending::ready(Err(e)),
        }
    }

    /// Queue a coalescable commit.
    pub fn commit(&self, items: Vec<CommitItem>) -> Pending<()> {
        let (reply, pending) = Pending::channel();
        match self.send(Job::Commit { items, reply }) {
            Ok(()) => pending,
            Err(e) => Pending::ready(Err(e)),
        }
    }

    /// Finish queued work, free the llama context, join the thread. Idempotent.
    pub fn close(&self) {
        self.shared.closed.store(true, Ordering::Release);
        drop(self.tx.lock().unwrap_or_else(|e| e.into_inner()).take());
        let thread = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = thread {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
        for (_, node) in self.shared.registry().iter() {
            node.data.mark_disposed();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.close();
    }
}
