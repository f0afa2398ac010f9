//! The reply to a request sent to the engine thread: wait for it (with a timeout, so a caller
//! can watch for signals), `.await` it, or cancel it.
//!
//! Cancellation is all-or-nothing: a job that has not started is dropped (nothing happened);
//! a running prefill is aborted inside `llama_decode` and rolled back (nothing happened); any
//! other running job completes (everything happened). The caller learns which from
//! [`Pending::cancel`] and, when it must, waits for the job before handing control back.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use crate::abort::AbortSignal;
use crate::error::{Error, Result};

// ---- the reply slot ----

struct SlotState<T> {
    result: Option<Result<T>>,
    /// The sender went away without replying (the engine stopped).
    dropped: bool,
    waker: Option<Waker>,
}

struct Slot<T> {
    state: Mutex<SlotState<T>>,
    ready: Condvar,
}

impl<T> Slot<T> {
    fn lock(&self) -> MutexGuard<'_, SlotState<T>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn fill(&self, result: Option<Result<T>>) {
        let waker = {
            let mut st = self.lock();
            match result {
                Some(r) => st.result = Some(r),
                None => st.dropped = true,
            }
            st.waker.take()
        };
        self.ready.notify_all();
        if let Some(w) = waker {
            w.wake();
        }
    }
}

/// The engine's side: send exactly once (dropping it unsent reports `Error::Closed`).
pub(crate) struct Reply<T>(Option<Arc<Slot<T>>>);

impl<T> Reply<T> {
    pub fn send(mut self, result: Result<T>) {
        if let Some(slot) = self.0.take() {
            slot.fill(Some(result));
        }
    }
}

impl<T> Drop for Reply<T> {
    fn drop(&mut self) {
        if let Some(slot) = self.0.take() {
            slot.fill(None);
        }
    }
}

// ---- cancellation ----

const QUEUED: u8 = 0;
const RUNNING: u8 = 1;
const CANCELLED: u8 = 2;
const DONE: u8 = 3;

/// What a cancel may do to a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CancelPolicy {
    /// Dropped while queued; completes once running.
    Drop,
    /// Dropped while queued; aborted (and rolled back) while running.
    DropOrAbort,
    /// Always completes (its effect is already visible to the caller, e.g. `prune`).
    Never,
}

/// One job's life: queued → running → done, or queued → cancelled.
pub(crate) struct Ticket {
    id: u64,
    state: AtomicU8,
    policy: CancelPolicy,
    signal: Arc<AbortSignal>,
    /// The run this job takes part in (its own id, or that of a gathered group it joined):
    /// the id an abort must name.
    run: AtomicU64,
    /// A cancel asked for this job to be aborted while it ran.
    abort_requested: AtomicBool,
}

/// A fresh id for a job or for one run of a gathered group.
pub(crate) fn next_run_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl Ticket {
    pub fn new(policy: CancelPolicy, signal: Arc<AbortSignal>) -> Arc<Ticket> {
        let id = next_run_id();
        Arc::new(Ticket {
            id,
            state: AtomicU8::new(QUEUED),
            policy,
            signal,
            run: AtomicU64::new(id),
            abort_requested: AtomicBool::new(false),
        })
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    /// From now on this job runs as part of `run` (a group): an abort targets that run.
    pub fn join_run(&self, run: u64) {
        self.run.store(run, Ordering::Release);
    }

    /// Whether a cancel asked for this running job to be aborted.
    pub fn abort_requested(&self) -> bool {
        self.abort_requested.load(Ordering::Acquire)
    }

    /// The engine takes the job; false when it was cancelled first (then it must not run).
    pub fn start(&self) -> bool {
        self.state
            .compare_exchange(QUEUED, RUNNING, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    pub fn finish(&self) {
        self.state.store(DONE, Ordering::Release);
    }

    fn cancel(&self) -> Cancel {
        if self.policy != CancelPolicy::Never
            && self
                .state
                .compare_exchange(QUEUED, CANCELLED, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            return Cancel::Prevented;
        }
        match self.state.load(Ordering::Acquire) {
            CANCELLED => Cancel::Prevented,
            RUNNING if self.policy == CancelPolicy::DropOrAbort => {
                self.abort_requested.store(true, Ordering::Release);
                self.signal.abort(self.run.load(Ordering::Acquire));
                Cancel::Aborting
            }
            _ => Cancel::Completing,
        }
    }
}

/// The cancelling of work that runs on a thread of its own and waits for engine jobs one
/// after another (the prefix cache's `branch`: evictions, a prefill): a cancel marks it
/// abandoned and cancels the job it waits for now (a prefill is aborted and rolled back);
/// the work checks [`Relay::check`] between its jobs and fails with `Error::Cancelled`.
#[derive(Default)]
pub struct Relay {
    state: Mutex<RelayState>,
}

#[derive(Default)]
struct RelayState {
    /// Cancelled: the work stops at its next check.
    abandoned: bool,
    /// The engine job the work waits for now.
    waiting_for: Option<Canceller>,
}

impl Relay {
    fn lock(&self) -> MutexGuard<'_, RelayState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `Err(Cancelled)` once the work was cancelled: it stops here.
    pub fn check(&self) -> Result<()> {
        if self.lock().abandoned {
            return Err(Error::Cancelled("cancelled by its caller".into()));
        }
        Ok(())
    }

    /// Wait for `pending`, cancelling it if the work is (or gets) cancelled meanwhile.
    pub fn wait<T>(&self, pending: Pending<T>) -> Result<T> {
        {
            let mut st = self.lock();
            if st.abandoned {
                let _ = pending.cancel();
            }
            st.waiting_for = Some(pending.canceller());
        }
        let result = pending.wait();
        self.lock().waiting_for = None;
        result
    }

    fn cancel(&self) -> Cancel {
        let mut st = self.lock();
        st.abandoned = true;
        if let Some(job) = &st.waiting_for {
            let _ = job.cancel();
        }
        Cancel::Aborting
    }
}

/// What [`Pending::cancel`] achieved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cancel {
    /// The job never started and never will: nothing happened.
    Prevented,
    /// The job was running and is being aborted: it rolls back (nothing happened), unless it
    /// finished first (everything happened). Wait for the reply to know.
    Aborting,
    /// The job is running or done and completes: everything happens. Wait for the reply.
    Completing,
}

// ---- the caller's side ----

/// A result the engine thread will deliver. `wait()` blocks (never call it inside an async
/// runtime); awaiting it does not block.
#[must_use = "a Pending does nothing unless waited for or awaited"]
pub struct Pending<T> {
    slot: Arc<Slot<T>>,
    cancels: Cancels,
}

/// What a Pending's cancel reaches.
#[derive(Clone)]
enum Cancels {
    /// Nothing: the work cannot be cancelled.
    Nothing,
    /// An engine job.
    Job(Arc<Ticket>),
    /// Work on a thread of its own (see [`Relay`]).
    Relay(Arc<Relay>),
}

impl<T> Pending<T> {
    pub(crate) fn channel(ticket: Option<Arc<Ticket>>) -> (Reply<T>, Pending<T>) {
        let slot = Arc::new(Slot {
            state: Mutex::new(SlotState {
                result: None,
                dropped: false,
                waker: None,
            }),
            ready: Condvar::new(),
        });
        let cancels = ticket.map_or(Cancels::Nothing, Cancels::Job);
        (Reply(Some(slot.clone())), Pending { slot, cancels })
    }

    /// A Pending that is already resolved (errors found before any work was queued).
    pub fn ready(result: Result<T>) -> Self {
        let (tx, p) = Self::channel(None);
        tx.send(result);
        p
    }

    /// [`Pending::spawn`] for work that waits for engine jobs through `relay`: cancelling the
    /// Pending cancels the job it waits for and fails the work at its next check.
    pub fn spawn_relayed(name: &str, f: impl FnOnce(&Relay) -> Result<T> + Send + 'static) -> Self
    where
        T: Send + 'static,
    {
        let relay = Arc::new(Relay::default());
        let theirs = relay.clone();
        let mut pending = Self::spawn(name, move || f(&theirs));
        pending.cancels = Cancels::Relay(relay);
        pending
    }

    /// A Pending resolved by a thread of the caller's choosing (work that is not engine work,
    /// such as loading a model). It cannot be cancelled.
    pub fn spawn(name: &str, f: impl FnOnce() -> Result<T> + Send + 'static) -> Self
    where
        T: Send + 'static,
    {
        let (tx, p) = Self::channel(None);
        let started = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || tx.send(f()));
        match started {
            Ok(_) => p,
            Err(e) => Pending::ready(Err(Error::Other(format!("could not start a thread: {e}")))),
        }
    }

    fn take(st: &mut SlotState<T>) -> Option<Result<T>> {
        match st.result.take() {
            Some(r) => Some(r),
            None if st.dropped => Some(Err(Error::Closed)),
            None => None,
        }
    }

    /// Block the calling thread until the engine replies.
    pub fn wait(self) -> Result<T> {
        let mut st = self.slot.lock();
        loop {
            if let Some(r) = Self::take(&mut st) {
                return r;
            }
            st = self.slot.ready.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Block for at most `timeout`; `Err(self)` when the reply has not come yet.
    pub fn wait_timeout(self, timeout: Duration) -> std::result::Result<Result<T>, Self> {
        let got = {
            let st = self.slot.lock();
            let (mut st, _) = self
                .slot
                .ready
                .wait_timeout_while(st, timeout, |s| s.result.is_none() && !s.dropped)
                .unwrap_or_else(|e| e.into_inner());
            Self::take(&mut st)
        };
        got.ok_or(self)
    }

    /// Whether the reply is there (a wait would not block).
    pub fn is_ready(&self) -> bool {
        let st = self.slot.lock();
        st.result.is_some() || st.dropped
    }

    /// Ask for the job not to happen; see [`Cancel`] for what it achieved.
    pub fn cancel(&self) -> Cancel {
        self.canceller().cancel()
    }

    /// A handle that cancels this job from elsewhere (e.g. while the Pending is awaited).
    pub fn canceller(&self) -> Canceller {
        Canceller(self.cancels.clone())
    }
}

/// Cancels one job; see [`Pending::cancel`].
#[derive(Clone)]
pub struct Canceller(Cancels);

impl Canceller {
    /// Cancel the job: it never starts if still queued, and a running decode is aborted
    /// and rolled back where its policy allows (see [`Cancel`]).
    pub fn cancel(&self) -> Cancel {
        match &self.0 {
            Cancels::Job(t) => t.cancel(),
            Cancels::Relay(r) => r.cancel(),
            Cancels::Nothing => Cancel::Completing,
        }
    }
}

impl<T> Future for Pending<T> {
    type Output = Result<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut st = self.slot.lock();
        match Self::take(&mut st) {
            Some(r) => Poll::Ready(r),
            None => {
                st.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ticket(policy: CancelPolicy) -> Arc<Ticket> {
        Ticket::new(policy, Arc::new(AbortSignal::default()))
    }

    #[test]
    fn reply_then_wait() {
        let (tx, p) = Pending::<u32>::channel(None);
        tx.send(Ok(7));
        assert_eq!(p.wait().unwrap(), 7);
    }

    #[test]
    fn dropped_reply_is_closed() {
        let (tx, p) = Pending::<u32>::channel(None);
        drop(tx);
        assert!(matches!(p.wait(), Err(Error::Closed)));
    }

    #[test]
    fn wait_timeout_returns_the_pending() {
        let (tx, p) = Pending::<u32>::channel(None);
        let p = p.wait_timeout(Duration::from_millis(1)).unwrap_err();
        std::thread::spawn(move || tx.send(Ok(3)));
        assert_eq!(
            p.wait_timeout(Duration::from_secs(10))
                .ok()
                .unwrap()
                .unwrap(),
            3
        );
    }

    #[test]
    fn cancel_before_start_prevents() {
        let t = ticket(CancelPolicy::Drop);
        let (_tx, p) = Pending::<()>::channel(Some(t.clone()));
        assert_eq!(p.cancel(), Cancel::Prevented);
        assert!(!t.start());
    }

    #[test]
    fn cancel_after_start_completes_or_aborts() {
        for (policy, want) in [
            (CancelPolicy::Drop, Cancel::Completing),
            (CancelPolicy::DropOrAbort, Cancel::Aborting),
            (CancelPolicy::Never, Cancel::Completing),
        ] {
            let t = ticket(policy);
            let (_tx, p) = Pending::<()>::channel(Some(t.clone()));
            assert!(t.start());
            t.signal.set_running(t.id());
            assert_eq!(p.cancel(), want);
            assert_eq!(t.signal.should_abort(), want == Cancel::Aborting);
        }
    }

    #[test]
    fn never_policy_is_not_prevented() {
        let t = ticket(CancelPolicy::Never);
        let (_tx, p) = Pending::<()>::channel(Some(t.clone()));
        assert_eq!(p.cancel(), Cancel::Completing);
        assert!(t.start());
    }

    #[test]
    fn a_relayed_cancel_aborts_the_job_waited_for_and_stops_the_work() {
        let t = ticket(CancelPolicy::DropOrAbort);
        let job = t.clone();
        let (tx, inner) = Pending::<()>::channel(Some(t.clone()));
        let (started_tx, started) = std::sync::mpsc::channel();
        let work = Pending::spawn_relayed("test", move |relay| {
            started_tx.send(()).unwrap();
            let waited = relay.wait(inner); // the engine answers once it saw the abort
            relay.check()?;
            waited
        });
        started.recv().unwrap();
        assert!(t.start());
        t.signal.set_running(t.id());
        // Until the relay has the job, a cancel marks the work; once it has, it reaches it.
        while !job.abort_requested() {
            assert_eq!(work.cancel(), Cancel::Aborting);
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(t.signal.should_abort());
        tx.send(Err(Error::Cancelled("aborted".into())));
        assert!(matches!(work.wait(), Err(Error::Cancelled(_))));
    }

    #[test]
    fn a_relay_cancelled_first_cancels_what_it_then_waits_for() {
        let relay = Relay::default();
        assert!(relay.check().is_ok());
        assert_eq!(relay.cancel(), Cancel::Aborting);
        assert!(matches!(relay.check(), Err(Error::Cancelled(_))));
        let t = ticket(CancelPolicy::Drop);
        let (tx, p) = Pending::<u32>::channel(Some(t.clone()));
        let waiting = std::thread::spawn(move || relay.wait(p));
        while t.state.load(Ordering::Acquire) != CANCELLED {
            std::thread::sleep(Duration::from_millis(1)); // the wait cancels it
        }
        assert!(!t.start()); // cancelled while queued: never runs
        drop(tx); // the engine drops a cancelled job's reply
        assert!(waiting.join().unwrap().is_err());
    }
}
