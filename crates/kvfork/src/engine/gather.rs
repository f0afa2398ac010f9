//! Gathering: while one request waits, the engine pulls the compatible requests queued behind
//! it, so independent callers (one asyncio task per request, say) share one `llama_decode`.
//!
//! The window adapts to the traffic. It stays open while the group is smaller than the last
//! one (commits) and requests keep arriving less than a gap apart, never longer than a
//! quarter of the last decode nor [`MAX_LINGER`] (one gap before the first decode); time
//! spent handling an arrival does not count against the gap. The gap is [`GAP`], or a
//! sixteenth of the last decode when that is longer: callers that are slow to come back (a
//! server streaming each token to its client) then still meet the others' next decode
//! instead of running one of their own, out of phase for good. A caller alone waits at most
//! one gap. Branches just prefilled together count as the last group (their tasks are about
//! to step together), and the first steps after a prefill wait for them up to one step's
//! time, however far apart they come back ([`Window::after_prefill`]). `produce` requests
//! met on the way are answered at once (they decode nothing), so their callers' commits can
//! still join.
//!
//! A job of the other kind on other branches (a stream's step while prefills gather, a new
//! request's prefill while steps gather) waits behind the group instead of ending it, and a
//! light KV operation (a prefix cache's fork inside a branch) runs in passing: a server's
//! requests that waited for one shared preamble prefill their questions in ONE decode, and
//! its streams keep stepping together while new requests arrive. Jobs on a deferred job's
//! branches never overtake it.

use std::collections::HashSet;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::shared::BranchCell;
use super::{next_run_id, CommitRequest, Job, PrefillRequest, Worker};
use crate::error::Error;
use crate::seq::Seq;

/// The longest pause between two arrivals for which a gathering keeps waiting (at least).
const GAP: Duration = Duration::from_millis(1);
/// The longest a gathering waits in all, whatever the decode time.
const MAX_LINGER: Duration = Duration::from_millis(20);

/// How long a gathering may still wait.
pub(super) struct Window {
    opened: Instant,
    last_arrival: Instant,
    gap: Duration,
    cap: Duration,
}

impl Window {
    pub fn new(last_decode: Duration) -> Self {
        let now = Instant::now();
        // Before the first decode there is no measure: one gap (the burst of a start-up).
        let cap = if last_decode.is_zero() {
            GAP
        } else {
            (last_decode / 4).min(MAX_LINGER)
        };
        Window {
            opened: now,
            last_arrival: now,
            gap: GAP.max(last_decode / 16).min(cap),
            cap,
        }
    }

    /// The window of the first steps after a prefill. The branches just prefilled come back
    /// one caller after another (a server's 14 requests: 30–60 ms on 2 cores, each setting
    /// up its stream), so there is no gap between arrivals, only the cap: a quarter of the
    /// prefill, at most one step's time (`last_step`; the prefill's when none was timed yet)
    /// but never less than [`MAX_LINGER`]. Waiting longer than the decode it saves would not
    /// pay.
    pub fn after_prefill(last_decode: Duration, last_step: Duration) -> Self {
        let mut window = Window::new(last_decode);
        if last_decode.is_zero() {
            return window;
        }
        let step = if last_step.is_zero() {
            last_decode
        } else {
            last_step
        };
        window.cap = (last_decode / 4).min(MAX_LINGER.max(step));
        window.gap = window.cap;
        window
    }

    fn remaining(&self) -> Duration {
        let end = (self.opened + self.cap).min(self.last_arrival + self.gap);
        end.saturating_duration_since(Instant::now())
    }

    fn arrived(&mut self) {
        self.last_arrival = Instant::now();
    }
}

/// A group being gathered.
pub(super) trait Gathering {
    /// Whether waiting for more requests is worth it.
    fn wants_more(&self) -> bool;
    /// Whether `job` may join (it must touch no branch of the group).
    fn accepts(&self, job: &Job) -> bool;
    /// Whether `job`, of the other kind (a prefill behind commits, a commit behind
    /// prefills), may wait until the group has run, the gathering going on past it.
    fn defers(&self, job: &Job) -> bool;
    /// Take an accepted job in (admitting it first: it may have been cancelled).
    fn add(&mut self, job: Job, w: &mut Worker);
    /// The branches (and sequences) of the group so far.
    fn members(&self) -> &Members;
}

/// The branches a job works on (none for a clear or any other work).
fn cells_of(job: &Job) -> Vec<&Arc<BranchCell>> {
    match job {
        Job::Commit(req) => req.items.iter().map(|(c, _)| c).collect(),
        Job::Prefill(req) => req.items.iter().map(|(c, _)| c).collect(),
        Job::Light { reads, writes, .. } => reads.iter().chain(writes).collect(),
        Job::Clear(_) | Job::Run(_) => Vec::new(),
    }
}

/// What a gathering does with a job it pulled.
enum Fate {
    Join,
    /// Run it now and go on (it decodes nothing and touches nothing of the group).
    InPassing,
    /// Keep it until the group has run (queue order is kept among the kept ones).
    Defer,
    /// It runs after the group (and the deferred jobs); the gathering ends.
    Stop,
}

impl Worker {
    /// Pull jobs into `group` until the window closes or a job cannot join nor wait behind
    /// the group (it runs next). A job of the other kind on other branches waits behind the
    /// group instead of ending it (a stream's step arriving while prefills gather, a new
    /// request's prefill while steps gather), so the group still meets everyone it expects;
    /// a light KV operation on other branches (a prefix cache's `share_prefix`) runs in
    /// passing. Jobs on a deferred job's branches never overtake it.
    pub(super) fn gather(
        &mut self,
        rx: &Receiver<Job>,
        group: &mut impl Gathering,
        mut window: Window,
    ) {
        let mut deferred = Vec::new();
        let mut behind = Members::default();
        let mut stopper = None;
        loop {
            let remaining = window.remaining();
            let wait = if group.wants_more() {
                remaining
            } else {
                Duration::ZERO
            };
            let Some(job) = self.next_queued(rx, wait) else {
                break;
            };
            match fate(group, &behind, &job, self.parks()) {
                // The group's arrivals keep its window open (so does time spent on one run in
                // passing); a deferred job's do not.
                Fate::Join => {
                    group.add(job, self);
                    window.arrived();
                }
                Fate::InPassing => {
                    self.run_in_passing(job);
                    window.arrived();
                }
                Fate::Defer => {
                    behind.add(cells_of(&job).into_iter());
                    deferred.push(job);
                }
                Fate::Stop => {
                    stopper = Some(job);
                    break;
                }
            }
        }
        self.run_next(deferred.into_iter().chain(stopper));
    }

    /// A job that decodes nothing and touches no branch of the group being gathered.
    fn run_in_passing(&mut self, job: Job) {
        let Some(job) = self.admit(job) else { return };
        match job {
            Job::Clear(seq) => self.clear_seq(seq),
            Job::Light { task, .. } => self.run_task(task),
            Job::Commit(req) if req.is_sample_only() => self.answer_sample(req),
            job => job.fail(Error::Internal("not a job to run in passing".into())),
        }
    }
}

/// Where `job` goes while `group` gathers, with `behind` the branches of the jobs deferred
/// (`parks`: the context is a `park` one).
fn fate(group: &impl Gathering, behind: &Members, job: &Job, parks: bool) -> Fate {
    let members = group.members();
    let (in_group, after_deferred) = match job {
        Job::Run(_) => return Fate::Stop, // any other work runs in queue order
        Job::Clear(seq) => (members.seqs.contains(seq), behind.seqs.contains(seq)),
        // A light job may read a branch of the group: it reads only cells the group's work
        // leaves in place (`share_prefix` copies a prefix; commits and prefills extend).
        Job::Light { reads, writes, .. } => (
            members.touches(writes.iter()),
            behind.touches(reads.iter().chain(writes)),
        ),
        Job::Commit(_) | Job::Prefill(_) => {
            let cells = cells_of(job);
            (
                members.touches(cells.iter().copied()),
                behind.touches(cells.into_iter()),
            )
        }
    };
    if after_deferred {
        // Never ahead of a job queued before it on the same branch.
        let kept = !in_group && (matches!(job, Job::Light { .. }) || group.defers(job));
        return if kept { Fate::Defer } else { Fate::Stop };
    }
    let decodes_nothing = match job {
        Job::Clear(_) => true,
        // With `park` it may need a lease, and making room could park a branch of the group.
        Job::Light { .. } => !parks,
        Job::Commit(req) => req.is_sample_only(),
        _ => false,
    };
    if in_group {
        Fate::Stop
    } else if decodes_nothing {
        Fate::InPassing
    } else if group.accepts(job) {
        Fate::Join
    } else if group.defers(job) {
        Fate::Defer
    } else {
        Fate::Stop
    }
}

/// The branches a group touches (by cell identity) and their KV sequences.
#[derive(Default)]
pub(super) struct Members {
    cells: HashSet<*const BranchCell>,
    seqs: HashSet<Seq>,
}

impl Members {
    fn touches<'a>(&self, mut cells: impl Iterator<Item = &'a Arc<BranchCell>>) -> bool {
        cells.any(|c| self.cells.contains(&Arc::as_ptr(c)))
    }

    fn add<'a>(&mut self, cells: impl Iterator<Item = &'a Arc<BranchCell>>) {
        for c in cells {
            self.cells.insert(Arc::as_ptr(c));
            self.seqs.insert(c.seq());
        }
    }
}

/// Commits and generation steps for one decode.
pub(super) struct CommitGathering {
    pub requests: Vec<CommitRequest>,
    members: Members,
    /// Tokens to decode so far.
    pub n_items: usize,
    /// How many the last group decoded: worth waiting for.
    expected: usize,
    n_batch: usize,
}

impl CommitGathering {
    pub fn new(first: CommitRequest, expected: usize, n_batch: usize) -> Self {
        let mut members = Members::default();
        members.add(first.items.iter().map(|(c, _)| c));
        CommitGathering {
            n_items: first.items.len(),
            requests: vec![first],
            members,
            expected,
            n_batch,
        }
    }

    /// The KV sequences of the group's branches, taken out (the gathering is over).
    pub fn take_seqs(&mut self) -> HashSet<Seq> {
        std::mem::take(&mut self.members.seqs)
    }
}

impl Gathering for CommitGathering {
    fn wants_more(&self) -> bool {
        self.n_items < self.expected
    }

    fn accepts(&self, job: &Job) -> bool {
        let Job::Commit(req) = job else { return false };
        if req.runs_alone() {
            return false;
        }
        self.n_items + req.items.len() <= self.n_batch
            && !self.members.touches(req.items.iter().map(|(c, _)| c))
    }

    fn defers(&self, job: &Job) -> bool {
        matches!(job, Job::Prefill(_))
    }

    fn add(&mut self, job: Job, w: &mut Worker) {
        // (A `produce` never joins: it decodes nothing and is answered in passing.)
        let Some(Job::Commit(req)) = w.admit(job) else {
            return;
        };
        self.n_items += req.items.len();
        self.members.add(req.items.iter().map(|(c, _)| c));
        self.requests.push(req);
    }

    fn members(&self) -> &Members {
        &self.members
    }
}

/// Prefills packed into one plan. Members run as one abortable run: cancelling any of them
/// aborts the decode, and the others run again.
pub(super) struct PrefillGathering {
    pub requests: Vec<PrefillRequest>,
    members: Members,
}

impl PrefillGathering {
    pub fn new(first: PrefillRequest) -> Self {
        let mut members = Members::default();
        members.add(first.items.iter().map(|(c, _)| c));
        PrefillGathering {
            requests: vec![first],
            members,
        }
    }
}

impl Gathering for PrefillGathering {
    fn wants_more(&self) -> bool {
        true
    }

    fn accepts(&self, job: &Job) -> bool {
        let Job::Prefill(req) = job else { return false };
        !self.members.touches(req.items.iter().map(|(c, _)| c))
    }

    fn defers(&self, job: &Job) -> bool {
        matches!(job, Job::Commit(req) if !req.runs_alone())
    }

    fn add(&mut self, job: Job, w: &mut Worker) {
        if let Some(Job::Prefill(req)) = w.admit(job) {
            self.members.add(req.items.iter().map(|(c, _)| c));
            self.requests.push(req);
        }
    }

    fn members(&self) -> &Members {
        &self.members
    }
}

/// A fresh id for one run of a group; each member's abort targets it from now on.
pub(super) fn start_run<'a>(tickets: impl Iterator<Item = &'a super::Ticket>) -> u64 {
    let run = next_run_id();
    for t in tickets {
        t.join_run(run);
    }
    run
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gap_grows_with_the_decode_and_stays_inside_the_cap() {
        let ms = Duration::from_millis;
        // Before any decode: one minimal gap, which is also the cap.
        let w = Window::new(Duration::ZERO);
        assert_eq!((w.gap, w.cap), (GAP, GAP));
        // Short decodes keep the minimal gap.
        assert_eq!(Window::new(ms(8)).gap, GAP);
        // A 16-branch step of ~80 ms: callers get 5 ms to come back.
        let w = Window::new(ms(80));
        assert_eq!((w.gap, w.cap), (ms(5), ms(20)));
        // Long decodes: the gap grows, never past the linger cap.
        let w = Window::new(ms(1000));
        assert!(w.gap <= w.cap && w.cap == MAX_LINGER);
    }

    #[test]
    fn the_first_steps_after_a_prefill_wait_up_to_the_decode_they_save() {
        let ms = Duration::from_millis;
        // A 640 ms prefill, steps of 80 ms: the stragglers get 80 ms, however far apart.
        let w = Window::after_prefill(ms(640), ms(80));
        assert_eq!((w.gap, w.cap), (ms(80), ms(80)));
        // No step timed yet: a quarter of the prefill.
        assert_eq!(Window::after_prefill(ms(640), Duration::ZERO).cap, ms(160));
        // Cheap steps still get the usual linger; a short prefill, a quarter of it.
        assert_eq!(Window::after_prefill(ms(640), ms(5)).cap, MAX_LINGER);
        assert_eq!(Window::after_prefill(ms(40), ms(80)).cap, ms(10));
        // A prefill that decoded nothing: the usual start-up window.
        let w = Window::after_prefill(Duration::ZERO, ms(80));
        assert_eq!((w.gap, w.cap), (GAP, GAP));
    }
}
