//! The gathering policy: which queued jobs share one `llama_decode`, and how long to wait for
//! them. While one request waits, the engine pulls the compatible requests queued behind it,
//! so independent callers (one asyncio task per request, say) share one decode. The engine's
//! worker (`kvfork::engine::gather`) pulls the jobs and executes what this module decides:
//! the decisions are pure functions of the group, the job (seen through [`JobView`]) and the
//! clock the caller passes in, so a simulated clock tests them without a model.
//!
//! **The window** adapts to the traffic. It stays open while the group is smaller than the
//! last one (commits) and requests keep arriving less than a gap apart, never longer than a
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
//! **The fate of a job** met while gathering ([`Gathering::fate`]): a job of the other kind
//! on other branches (a stream's step while prefills gather, a new request's prefill while
//! steps gather) waits behind the group instead of ending it, and a light KV operation (a
//! prefix cache's fork inside a branch) runs in passing: a server's requests that waited for
//! one shared preamble prefill their questions in ONE decode, and its streams keep stepping
//! together while new requests arrive. Jobs on a deferred job's branches never overtake it.
//!
//! **Between the decodes of a continuous prefill** ([`GatherPolicy::open_chunk`]; the engine's
//! `continuous.rs`): prompts are decoded chunk after chunk, and before each chunk a gathering
//! pulls the queue. A stream's step on another branch rides the chunk's decode (up to
//! [`max_riders`]), a new prompt joins the run's queue, a job that decodes nothing runs in
//! passing, and a step or prompt that may not (on a prompt still in flight, past the riders'
//! room) waits for the run to end, which then takes no new prompt, so that it ends. The
//! window waits for as many steps as rode the last chunk plus the prompts it finished (each
//! about to step), within the window after a prefill. What waits is carried from one
//! gathering to the next ([`Behind`]).
//!
//! Why here and not in the engine crate: the decision needs nothing of llama.cpp, and this
//! crate is where the other pure policies live (the batch packer, the thread tuner, the
//! speculation policy) with proptest at hand.

use std::collections::HashSet;
use std::time::{Duration, Instant};

/// The longest pause between two arrivals for which a gathering keeps waiting (at least).
pub const GAP: Duration = Duration::from_millis(1);
/// The longest a gathering waits in all, whatever the decode time.
pub const MAX_LINGER: Duration = Duration::from_millis(20);

/// A branch as the policy sees it: an identity (the engine uses its cell's address) and the
/// KV sequence it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Cell {
    /// Which branch (distinct for live branches).
    pub id: usize,
    /// Its KV sequence.
    pub seq: u32,
}

/// A queued job as the policy sees it: its kind and the branches it touches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobView {
    /// Any other work: it runs in queue order.
    Run,
    /// Emptying a fresh lease's sequence: touches that sequence only, decodes nothing.
    Clear {
        /// The sequence.
        seq: u32,
    },
    /// A KV operation that decodes nothing and touches only these branches (a prefix cache's
    /// `share_prefix`). One it only `reads` may be in the group: the group has not run yet,
    /// and its work leaves those cells in place.
    Light {
        /// Branches whose cells it reads.
        reads: Vec<Cell>,
        /// Branches whose cells it changes.
        writes: Vec<Cell>,
    },
    /// One token for each of its branches.
    Commit {
        /// The branches.
        cells: Vec<Cell>,
        /// A `produce`: samples, decodes nothing.
        sample_only: bool,
        /// A `BranchStore::step`: gathered by its caller already, it joins nothing.
        runs_alone: bool,
    },
    /// Tokens into its branches, packed.
    Prefill {
        /// The branches.
        cells: Vec<Cell>,
    },
}

impl JobView {
    /// The branches the job works on (none for a clear or other work).
    fn cells(&self) -> impl Iterator<Item = &Cell> {
        let (a, b): (&[Cell], &[Cell]) = match self {
            JobView::Commit { cells, .. } | JobView::Prefill { cells } => (cells, &[]),
            JobView::Light { reads, writes } => (reads, writes),
            JobView::Clear { .. } | JobView::Run => (&[], &[]),
        };
        a.iter().chain(b)
    }

    /// Whether it decodes nothing, so that a gathering may run it at once and go on (`parks`:
    /// on a `park` context a light job may need a lease, and making room could park a branch
    /// of the group).
    fn decodes_nothing(&self, parks: bool) -> bool {
        match self {
            JobView::Clear { .. } => true,
            JobView::Light { .. } => !parks,
            JobView::Commit { sample_only, .. } => *sample_only,
            _ => false,
        }
    }
}

/// What a gathering does with a job it pulled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// It joins the group: one decode for all.
    Join,
    /// Run it now and go on (it decodes nothing and touches nothing of the group).
    InPassing,
    /// Keep it until the group has run (queue order is kept among the kept ones).
    Defer,
    /// It runs after the group (and the deferred jobs); the gathering ends.
    Stop,
}

/// The branches (and sequences) a group, or the jobs deferred behind it, touch.
#[derive(Debug, Default, Clone)]
pub struct Members {
    cells: HashSet<usize>,
    seqs: HashSet<u32>,
}

impl Members {
    fn touches<'a>(&self, mut cells: impl Iterator<Item = &'a Cell>) -> bool {
        cells.any(|c| self.cells.contains(&c.id))
    }

    fn add<'a>(&mut self, cells: impl Iterator<Item = &'a Cell>) {
        for c in cells {
            self.cells.insert(c.id);
            self.seqs.insert(c.seq);
        }
    }

    /// The KV sequences, taken out.
    pub fn take_seqs(&mut self) -> HashSet<u32> {
        std::mem::take(&mut self.seqs)
    }
}

/// How long a gathering may still wait (times from the caller's clock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    opened: Instant,
    last_arrival: Instant,
    gap: Duration,
    cap: Duration,
}

impl Window {
    /// The window of a gathering opened at `now`, after a decode that took `last_decode`.
    pub fn new(last_decode: Duration, now: Instant) -> Self {
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
    pub fn after_prefill(last_decode: Duration, last_step: Duration, now: Instant) -> Self {
        let mut window = Window::new(last_decode, now);
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

    /// How long it may still wait at `now`.
    pub fn remaining(&self, now: Instant) -> Duration {
        let end = (self.opened + self.cap).min(self.last_arrival + self.gap);
        end.saturating_duration_since(now)
    }

    /// A job of the group arrived at `now` (or one was run in passing): the gap restarts.
    pub fn arrived(&mut self, now: Instant) {
        self.last_arrival = now;
    }
}

/// What is gathered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Commits and generation steps, for one decode: `n_items` tokens so far, `expected` as
    /// many as the last group decoded (worth waiting for), at most `n_batch`.
    Commits {
        /// Tokens joined so far.
        n_items: usize,
        /// Tokens the last group decoded.
        expected: usize,
        /// The batch's size.
        n_batch: usize,
    },
    /// Prefills packed into one plan (any number: the plan splits them into decodes).
    Prefills,
    /// The jobs met between two decodes of a continuous prefill ([`GatherPolicy::open_chunk`]):
    /// the running streams' steps ride its next decode, new prompts join its queue.
    Chunk(ChunkGathering),
}

/// What a gathering between two decodes of a continuous prefill counts and allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkGathering {
    /// Streams' tokens riding the next decode so far.
    pub riders: usize,
    /// At most this many may ride (the rest of the decode is the prompts').
    pub max_riders: usize,
    /// Streams' steps so far, riding or waiting behind the run: what the window waits for.
    pub arrivals: usize,
    /// As many as are worth waiting for: the last decode's riders and the prompts it finished
    /// (each about to step; a `produce` met first runs in passing and restarts the gap).
    pub expected: usize,
    /// New prompts may join the queue (not once a job waits behind the run: it must end).
    pub takes_prompts: bool,
}

/// A group being gathered: what it is, who is in it, who waits behind it, its window.
#[derive(Debug, Clone)]
pub struct Gathering {
    /// What is gathered (and, for commits, how many tokens so far).
    pub kind: Kind,
    members: Members,
    behind: Members,
    window: Window,
}

impl Gathering {
    /// How long to wait for the next job at `now` (zero: take only what is queued already).
    pub fn wait(&self, now: Instant) -> Duration {
        let wants_more = match self.kind {
            Kind::Commits {
                n_items, expected, ..
            } => n_items < expected,
            Kind::Prefills => true,
            Kind::Chunk(c) => c.arrivals < c.expected,
        };
        if wants_more {
            self.window.remaining(now)
        } else {
            Duration::ZERO
        }
    }

    /// `job` joins the group at `now` (after [`Gathering::fate`] said [`Fate::Join`] and the
    /// engine admitted it): its branches are members, and the window restarts its gap.
    pub fn join(&mut self, job: &JobView, now: Instant) {
        match (&mut self.kind, job) {
            (Kind::Commits { n_items, .. }, JobView::Commit { cells, .. }) => {
                *n_items += cells.len();
            }
            (Kind::Chunk(c), JobView::Commit { cells, .. }) => {
                c.riders += cells.len();
                c.arrivals += cells.len();
            }
            _ => {}
        }
        self.members.add(job.cells());
        self.window.arrived(now);
    }

    /// A job of the group's turned up at `now` but will not run (cancelled before it
    /// started), or one ran in passing: the window restarts its gap all the same (time spent
    /// on an arrival does not count against it).
    pub fn arrived(&mut self, now: Instant) {
        self.window.arrived(now);
    }

    /// `job` waits behind the group ([`Fate::Defer`]): later jobs on its branches must not
    /// overtake it.
    pub fn defer(&mut self, job: &JobView) {
        self.behind.add(job.cells());
        if let Kind::Chunk(c) = &mut self.kind {
            // A job waits for the continuous prefill to end: it takes no new prompt, so it
            // ends. (A stream's step that may not ride counts among the arrivals it expected.)
            c.takes_prompts = false;
            if let JobView::Commit { cells, .. } = job {
                c.arrivals += cells.len();
            }
        }
    }

    /// Where `job` goes (see the module doc); pure.
    pub fn fate(&self, job: &JobView, parks: bool) -> Fate {
        let (in_group, after_deferred) = match job {
            JobView::Run => return Fate::Stop, // any other work runs in queue order
            JobView::Clear { seq } => (
                self.members.seqs.contains(seq),
                self.behind.seqs.contains(seq),
            ),
            // A light job may read a branch of the group: it reads only cells the group's
            // work leaves in place (`share_prefix` copies a prefix; commits and prefills
            // extend).
            JobView::Light { writes, .. } => (
                self.members.touches(writes.iter()),
                self.behind.touches(job.cells()),
            ),
            JobView::Commit { .. } | JobView::Prefill { .. } => (
                self.members.touches(job.cells()),
                self.behind.touches(job.cells()),
            ),
        };
        if after_deferred {
            // Never ahead of a job queued before it on the same branch.
            // (A continuous prefill keeps a job on its prompts' branches too: it waits anyway.)
            let chunk = matches!(self.kind, Kind::Chunk(_));
            let kept = (!in_group && matches!(job, JobView::Light { .. }))
                || ((!in_group || chunk) && self.defers(job));
            return if kept { Fate::Defer } else { Fate::Stop };
        }
        if in_group {
            // A job on a prompt being prefilled (or a stream riding already) waits for the
            // continuous prefill; in a plain group it ends the gathering.
            let waits = matches!(self.kind, Kind::Chunk(_))
                && matches!(job, JobView::Commit { .. } | JobView::Prefill { .. });
            if waits {
                Fate::Defer
            } else {
                Fate::Stop
            }
        } else if job.decodes_nothing(parks) {
            Fate::InPassing
        } else if self.accepts(job) {
            Fate::Join
        } else if self.defers(job) {
            Fate::Defer
        } else {
            Fate::Stop
        }
    }

    /// Whether `job` may join (it touches no branch of the group: checked by `fate`).
    fn accepts(&self, job: &JobView) -> bool {
        match (self.kind, job) {
            (
                Kind::Commits {
                    n_items, n_batch, ..
                },
                JobView::Commit {
                    cells, runs_alone, ..
                },
            ) => !runs_alone && n_items + cells.len() <= n_batch,
            (Kind::Prefills, JobView::Prefill { .. }) => true,
            (
                Kind::Chunk(c),
                JobView::Commit {
                    cells, runs_alone, ..
                },
            ) => !runs_alone && c.riders + cells.len() <= c.max_riders,
            (Kind::Chunk(c), JobView::Prefill { .. }) => c.takes_prompts,
            _ => false,
        }
    }

    /// Whether `job`, of the other kind (a prefill behind commits, a commit behind
    /// prefills), may wait until the group has run, the gathering going on past it.
    fn defers(&self, job: &JobView) -> bool {
        match self.kind {
            // A step that may not ride, a prompt that may not join: after the run.
            Kind::Chunk(_) => matches!(job, JobView::Commit { .. } | JobView::Prefill { .. }),
            Kind::Commits { .. } => matches!(job, JobView::Prefill { .. }),
            Kind::Prefills => matches!(
                job,
                JobView::Commit {
                    runs_alone: false,
                    ..
                }
            ),
        }
    }

    /// The KV sequences of the group's branches, taken out (the gathering is over).
    pub fn take_seqs(&mut self) -> HashSet<u32> {
        self.members.take_seqs()
    }

    /// Tokens the group's commits decode (0 for prefills).
    pub fn n_items(&self) -> usize {
        match self.kind {
            Kind::Commits { n_items, .. } => n_items,
            Kind::Chunk(c) => c.riders,
            Kind::Prefills => 0,
        }
    }

    /// A continuous prefill's gathering is over: what the next one inherits (the jobs
    /// waiting behind the run, and whether it still takes new prompts).
    pub fn into_behind(self) -> Behind {
        Behind {
            members: self.behind,
            takes_prompts: matches!(self.kind, Kind::Chunk(c) if c.takes_prompts),
        }
    }
}

/// What a continuous prefill carries from one gathering to the next: the branches of the
/// jobs waiting for it to end, and whether it still takes new prompts.
#[derive(Debug, Clone)]
pub struct Behind {
    members: Members,
    takes_prompts: bool,
}

impl Behind {
    /// A run that just started: nothing waits behind it; it takes new prompts if `open`.
    pub fn new(open: bool) -> Self {
        Behind {
            members: Members::default(),
            takes_prompts: open,
        }
    }

    /// Whether new prompts may still join.
    pub fn takes_prompts(&self) -> bool {
        self.takes_prompts
    }
}

/// The shape of the next decode of a continuous prefill, for its gathering.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NextChunk {
    /// Arrivals worth waiting for (the last decode's riders and the prompts it finished).
    pub expected: usize,
    /// Most tokens of steps riding it (0: none may).
    pub max_riders: usize,
}

/// Steps riding one decode of a continuous prefill, at most: the decode's outputs, and half
/// its tokens (the prompts keep the other half, so a prefill always moves on).
pub fn max_riders(n_batch: usize, n_seq_max: usize) -> usize {
    n_seq_max.min(n_batch / 2)
}

/// What the gatherings remember from one to the next: the last commit group (how many to wait
/// for next time, and the sequences it stepped), the last decode's time and the last step's,
/// and whether a prefill group ran since the last commit group.
#[derive(Debug, Clone)]
pub struct GatherPolicy {
    last_group: usize,
    last_seqs: HashSet<u32>,
    last_decode: Duration,
    /// The decode of the last commit group that decoded: what splitting a step costs.
    last_step: Duration,
    /// A prefill group ran since the last commit group: the next one expects its branches.
    after_prefill: bool,
    n_seq_max: usize,
}

impl GatherPolicy {
    /// The policy of a context with `n_seq_max` sequences (no group is expected larger).
    pub fn new(n_seq_max: usize) -> Self {
        GatherPolicy {
            last_group: 0,
            last_seqs: HashSet::new(),
            last_decode: Duration::ZERO,
            last_step: Duration::ZERO,
            after_prefill: false,
            n_seq_max,
        }
    }

    /// A decode (any) took `elapsed`.
    pub fn decoded(&mut self, elapsed: Duration) {
        self.last_decode = elapsed;
    }

    /// The time of the last decode.
    pub fn last_decode(&self) -> Duration {
        self.last_decode
    }

    /// A gathering of commits opened at `now` by `first` (a commit that may join others),
    /// under a batch of `n_batch` tokens.
    pub fn open_commits(&mut self, first: &JobView, n_batch: usize, now: Instant) -> Gathering {
        let window = if std::mem::take(&mut self.after_prefill) {
            Window::after_prefill(self.last_decode, self.last_step, now)
        } else {
            Window::new(self.last_decode, now)
        };
        let n_items = match first {
            JobView::Commit { cells, .. } => cells.len(),
            _ => 0,
        };
        let mut members = Members::default();
        members.add(first.cells());
        Gathering {
            kind: Kind::Commits {
                n_items,
                expected: self.last_group,
                n_batch,
            },
            members,
            behind: Members::default(),
            window,
        }
    }

    /// The gathering before the next decode of a continuous prefill, opened at `now`: the
    /// branches of its prompts still in flight (`prompts`) are its members, `behind` what it
    /// carries from the last one. It waits for the arrivals `next` expects, within the
    /// window after a prefill (the streams it feeds come back one caller after another).
    pub fn open_chunk(
        &self,
        prompts: &[Cell],
        behind: Behind,
        next: NextChunk,
        now: Instant,
    ) -> Gathering {
        let mut members = Members::default();
        members.add(prompts.iter());
        Gathering {
            kind: Kind::Chunk(ChunkGathering {
                riders: 0,
                max_riders: next.max_riders,
                arrivals: 0,
                expected: next.expected,
                takes_prompts: behind.takes_prompts,
            }),
            members,
            behind: behind.members,
            window: Window::after_prefill(self.last_decode, self.last_step, now),
        }
    }

    /// A gathering of prefills opened at `now` by `first`.
    pub fn open_prefills(&self, first: &JobView, now: Instant) -> Gathering {
        let mut members = Members::default();
        members.add(first.cells());
        Gathering {
            kind: Kind::Prefills,
            members,
            behind: Members::default(),
            window: Window::new(self.last_decode, now),
        }
    }

    /// A commit gathering is over, about to run: the next expects as many.
    pub fn commits_gathered(&mut self, group: &mut Gathering) {
        self.last_group = group.n_items();
        self.last_seqs = group.take_seqs();
    }

    /// The commit group ran; `decoded`: it ran a decode (it was not all `produce`s or
    /// failures), whose time is what splitting a step costs.
    pub fn commits_ran(&mut self, decoded: bool) {
        if decoded {
            self.last_step = self.last_decode;
        }
    }

    /// A prefill gathering is over, about to run, with the branches of `prefilled` (their
    /// sequences): they are about to step, with those stepping already (a burst's earlier
    /// prefill groups), so the next commit group expects them all together. An overestimate
    /// (streams that ended meanwhile) costs one window, once.
    pub fn prefills_gathered(&mut self, prefilled: HashSet<u32>) {
        let new = prefilled.difference(&self.last_seqs).count();
        self.last_group = (self.last_group + new).min(self.n_seq_max);
        self.last_seqs.extend(prefilled);
        self.after_prefill = true;
    }

    /// How many tokens the next commit group waits for.
    pub fn expected(&self) -> usize {
        self.last_group
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gap_grows_with_the_decode_and_stays_inside_the_cap() {
        let ms = Duration::from_millis;
        let now = Instant::now();
        // Before any decode: one minimal gap, which is also the cap.
        let w = Window::new(Duration::ZERO, now);
        assert_eq!((w.gap, w.cap), (GAP, GAP));
        // Short decodes keep the minimal gap.
        assert_eq!(Window::new(ms(8), now).gap, GAP);
        // A 16-branch step of ~80 ms: callers get 5 ms to come back.
        let w = Window::new(ms(80), now);
        assert_eq!((w.gap, w.cap), (ms(5), ms(20)));
        // Long decodes: the gap grows, never past the linger cap.
        let w = Window::new(ms(1000), now);
        assert!(w.gap <= w.cap && w.cap == MAX_LINGER);
    }

    #[test]
    fn the_first_steps_after_a_prefill_wait_up_to_the_decode_they_save() {
        let ms = Duration::from_millis;
        let now = Instant::now();
        // A 640 ms prefill, steps of 80 ms: the stragglers get 80 ms, however far apart.
        let w = Window::after_prefill(ms(640), ms(80), now);
        assert_eq!((w.gap, w.cap), (ms(80), ms(80)));
        // No step timed yet: a quarter of the prefill.
        assert_eq!(
            Window::after_prefill(ms(640), Duration::ZERO, now).cap,
            ms(160)
        );
        // Cheap steps still get the usual linger; a short prefill, a quarter of it.
        assert_eq!(Window::after_prefill(ms(640), ms(5), now).cap, MAX_LINGER);
        assert_eq!(Window::after_prefill(ms(40), ms(80), now).cap, ms(10));
        // A prefill that decoded nothing: the usual start-up window.
        let w = Window::after_prefill(Duration::ZERO, ms(80), now);
        assert_eq!((w.gap, w.cap), (GAP, GAP));
    }

    #[test]
    fn arrivals_keep_the_window_open_until_the_cap() {
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        let mut w = Window::new(ms(80), t0); // gap 5 ms, cap 20 ms
        assert_eq!(w.remaining(t0), ms(5));
        w.arrived(t0 + ms(4));
        assert_eq!(w.remaining(t0 + ms(4)), ms(5));
        w.arrived(t0 + ms(18));
        assert_eq!(w.remaining(t0 + ms(18)), ms(2)); // the cap, not the gap
        assert_eq!(w.remaining(t0 + ms(25)), Duration::ZERO);
    }
}
