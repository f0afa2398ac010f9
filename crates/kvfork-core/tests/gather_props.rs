//! The gathering policy without a model: random queues of jobs against random groups, and a
//! simulated clock for the windows and for streams that step together.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use kvfork_core::gather::{
    max_riders, Behind, Cell, Fate, GatherPolicy, JobView, NextChunk, Window, GAP, MAX_LINGER,
};
use proptest::prelude::*;

const MS: Duration = Duration::from_millis(1);

/// Branch `i` holds sequence `i`.
fn cell(i: usize) -> Cell {
    Cell {
        id: 1000 + i,
        seq: i as u32,
    }
}

fn commit(branches: &[usize]) -> JobView {
    JobView::Commit {
        cells: branches.iter().map(|&i| cell(i)).collect(),
        sample_only: false,
        runs_alone: false,
    }
}

fn prefill(branches: &[usize]) -> JobView {
    JobView::Prefill {
        cells: branches.iter().map(|&i| cell(i)).collect(),
    }
}

/// Any job on branches 0..8.
fn job() -> impl Strategy<Value = JobView> {
    let branches = || prop::collection::vec(0usize..8, 1..4);
    let cells = || branches().prop_map(|b| b.into_iter().map(cell).collect::<Vec<_>>());
    prop_oneof![
        Just(JobView::Run),
        (0u32..8).prop_map(|seq| JobView::Clear { seq }),
        (cells(), cells()).prop_map(|(reads, writes)| JobView::Light { reads, writes }),
        (cells(), any::<bool>(), any::<bool>()).prop_map(|(cells, sample_only, runs_alone)| {
            JobView::Commit {
                cells,
                sample_only,
                runs_alone,
            }
        }),
        cells().prop_map(|cells| JobView::Prefill { cells }),
    ]
}

fn cells_of(job: &JobView) -> HashSet<usize> {
    match job {
        JobView::Commit { cells, .. } | JobView::Prefill { cells } => {
            cells.iter().map(|c| c.id).collect()
        }
        JobView::Light { reads, writes } => reads.iter().chain(writes).map(|c| c.id).collect(),
        JobView::Clear { seq } => [1000 + *seq as usize].into(),
        JobView::Run => HashSet::new(),
    }
}

fn writes_of(job: &JobView) -> HashSet<usize> {
    match job {
        JobView::Light { writes, .. } => writes.iter().map(|c| c.id).collect(),
        other => cells_of(other),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Through a whole gathering: a job never joins or runs in passing when it changes a
    /// branch of the group or touches one that a deferred job waits on (queue order on a
    /// branch is kept); other work always ends the gathering; a commit group never passes
    /// its batch; only commits join commits and prefills join prefills.
    #[test]
    fn no_job_overtakes_another_on_the_same_branch(
        first_is_commit in any::<bool>(),
        first in prop::collection::vec(0usize..8, 1..3),
        queue in prop::collection::vec(job(), 0..24),
        n_batch in 1usize..8,
        parks in any::<bool>(),
    ) {
        let t0 = Instant::now();
        let mut policy = GatherPolicy::new(8);
        let opener = if first_is_commit { commit(&first) } else { prefill(&first) };
        let mut g = if first_is_commit {
            policy.open_commits(&opener, n_batch, t0)
        } else {
            policy.open_prefills(&opener, t0)
        };
        let mut members: HashSet<usize> = cells_of(&opener);
        let mut behind: HashSet<usize> = HashSet::new();
        let mut items = first.len();
        for (k, job) in queue.iter().enumerate() {
            let fate = g.fate(job, parks);
            let touches_group = !writes_of(job).is_disjoint(&members);
            let touches_behind = !cells_of(job).is_disjoint(&behind);
            if matches!(job, JobView::Run) || touches_group {
                prop_assert_eq!(fate, Fate::Stop, "job {} {:?}", k, job);
            }
            if touches_behind {
                prop_assert!(matches!(fate, Fate::Defer | Fate::Stop), "job {} {:?}", k, job);
            }
            match fate {
                Fate::Join => {
                    let same_kind = matches!(
                        (first_is_commit, job),
                        (true, JobView::Commit { .. }) | (false, JobView::Prefill { .. })
                    );
                    prop_assert!(same_kind, "{:?} joined", job);
                    if let JobView::Commit { cells, runs_alone, .. } = job {
                        prop_assert!(!runs_alone);
                        items += cells.len();
                        prop_assert!(items <= n_batch);
                    }
                    g.join(job, t0 + MS * k as u32);
                    members.extend(cells_of(job));
                }
                Fate::InPassing => {
                    let nothing = matches!(
                        job,
                        JobView::Clear { .. } | JobView::Commit { sample_only: true, .. }
                    ) || (matches!(job, JobView::Light { .. }) && !parks);
                    prop_assert!(nothing, "{:?} ran in passing", job);
                    g.arrived(t0 + MS * k as u32);
                }
                Fate::Defer => {
                    g.defer(job);
                    behind.extend(cells_of(job));
                }
                Fate::Stop => break,
            }
        }
        prop_assert_eq!(g.n_items(), if first_is_commit { items } else { 0 });
    }

    /// Between two decodes of a continuous prefill: a stream's step rides only when it
    /// touches no prompt in flight, no rider and nothing waiting behind the run, within the
    /// riders' room (none when it is 0); a new prompt joins only while nothing waits
    /// behind the run; any other work ends the gathering; nothing waiting behind the run is
    /// overtaken on its branches, and what waits stays waiting in the next gathering.
    #[test]
    fn a_continuous_prefill_takes_riders_and_prompts_in_order(
        prompts in prop::collection::vec(0usize..8, 1..3),
        queue in prop::collection::vec(job(), 0..24),
        max in 0usize..6,
        split in 0usize..24,
    ) {
        let t0 = Instant::now();
        let policy = GatherPolicy::new(8);
        let prompt_cells: Vec<Cell> = prompts.iter().map(|&i| cell(i)).collect();
        let next = NextChunk { expected: 3, max_riders: max };
        let mut g = policy.open_chunk(&prompt_cells, Behind::new(true), next, t0);
        let mut members: HashSet<usize> = prompts.iter().map(|&i| cell(i).id).collect();
        let mut behind: HashSet<usize> = HashSet::new();
        let mut riders = 0;
        let mut waited = false;
        for (k, job) in queue.iter().enumerate() {
            if k == split {
                // The next decode's gathering: riders leave, the prompts and what waits stay.
                let carried = g.into_behind();
                prop_assert_eq!(carried.takes_prompts(), !waited);
                g = policy.open_chunk(&prompt_cells, carried, next, t0);
                members = prompts.iter().map(|&i| cell(i).id).collect();
                riders = 0;
            }
            let fate = g.fate(job, false);
            let touches = !writes_of(job).is_disjoint(&members);
            let touches_behind = !cells_of(job).is_disjoint(&behind);
            if matches!(job, JobView::Run) {
                prop_assert_eq!(fate, Fate::Stop);
            }
            if touches || touches_behind {
                prop_assert!(!matches!(fate, Fate::Join | Fate::InPassing), "job {} {:?}", k, job);
            }
            match fate {
                Fate::Join => {
                    match job {
                        JobView::Commit { cells, runs_alone, sample_only } => {
                            prop_assert!(max > 0 && !runs_alone && !sample_only);
                            riders += cells.len();
                            prop_assert!(riders <= max);
                        }
                        JobView::Prefill { .. } => prop_assert!(!waited, "a prompt joined late"),
                        other => prop_assert!(false, "{:?} joined", other),
                    }
                    g.join(job, t0);
                    members.extend(cells_of(job));
                }
                Fate::InPassing => g.arrived(t0),
                Fate::Defer => {
                    g.defer(job);
                    behind.extend(cells_of(job));
                    waited = true;
                }
                Fate::Stop => break,
            }
        }
    }

    /// However jobs arrive, a window is never open past its cap, nor a gap past the last
    /// arrival; both grow with the last decode, up to `MAX_LINGER`.
    #[test]
    fn a_window_closes_by_its_cap_and_its_gap(
        last_decode_ms in 0u64..2000,
        arrivals in prop::collection::vec(0u64..30, 0..12),
        probe in 0u64..40,
    ) {
        let t0 = Instant::now();
        let last_decode = MS * last_decode_ms as u32;
        let mut w = Window::new(last_decode, t0);
        let cap = if last_decode.is_zero() { GAP } else { (last_decode / 4).min(MAX_LINGER) };
        let gap = GAP.max(last_decode / 16).min(cap);
        let mut last = t0;
        for a in arrivals.iter().scan(0u64, |t, d| { *t += d; Some(*t) }) {
            let now = t0 + MS * a as u32;
            w.arrived(now);
            last = now;
        }
        let now = last + MS * probe as u32;
        let left = w.remaining(now);
        prop_assert!(now + left <= (t0 + cap).max(now));
        prop_assert!(now + left <= (last + gap).max(now));
        prop_assert!(cap <= MAX_LINGER.max(GAP));
    }
}

/// A simulated server: `n` streams step together, their callers coming back `jitter` apart
/// after each decode of `step` (a clock that only moves when told). The policy keeps them in
/// one decode per step once it has seen them together, and a burst prefilled in two groups
/// steps as one from its first token.
#[test]
fn streams_that_come_back_within_the_gap_share_every_step() {
    let n = 16;
    let step = MS * 80; // a 16-branch step on 2 cores
    let jitter = MS; // callers streaming their token to a client first
    let mut policy = GatherPolicy::new(32);
    let mut now = Instant::now();
    // Two prefill groups of 8 (a burst that arrived in two waves).
    for wave in [0..8, 8..16] {
        let branches: Vec<usize> = wave.collect();
        let mut g = policy.open_prefills(&prefill(&branches), now);
        policy.prefills_gathered(g.take_seqs());
        policy.decoded(MS * 600);
        now += MS * 600;
    }
    assert_eq!(policy.expected(), n);
    let mut groups = Vec::new();
    for _ in 0..5 {
        // The first caller opens the gathering; the others arrive one by one.
        let mut g = policy.open_commits(&commit(&[0]), 512, now);
        let mut arrived = 1;
        for i in 1..n {
            let at = now + jitter * i as u32;
            if g.wait(now + jitter * (i as u32 - 1)) < jitter {
                break; // the window closed before this caller came back
            }
            assert_eq!(g.fate(&commit(&[i]), false), Fate::Join);
            g.join(&commit(&[i]), at);
            arrived += 1;
        }
        assert_eq!(
            g.wait(now + jitter * n as u32),
            Duration::ZERO,
            "all in: no more waiting"
        );
        policy.commits_gathered(&mut g);
        policy.decoded(step);
        policy.commits_ran(true);
        groups.push(arrived);
        now += jitter * n as u32 + step;
    }
    assert_eq!(groups, vec![n; 5], "one decode of all {n} streams per step");
}

/// A caller alone waits one gap at most: nobody else is expected.
#[test]
fn a_caller_alone_waits_at_most_one_gap() {
    let mut policy = GatherPolicy::new(8);
    let now = Instant::now();
    let mut g = policy.open_commits(&commit(&[0]), 512, now);
    assert_eq!(
        g.wait(now),
        Duration::ZERO,
        "expects no one yet: no wait at all"
    );
    policy.commits_gathered(&mut g);
    policy.decoded(MS * 10);
    policy.commits_ran(true);
    let g = policy.open_commits(&commit(&[0]), 512, now);
    assert_eq!(
        g.wait(now),
        Duration::ZERO,
        "the last group was one: no wait"
    );
    // Two streams: the second is waited for one gap (10 ms decode: the minimal gap).
    let mut policy = GatherPolicy::new(8);
    let mut g = policy.open_commits(&commit(&[0, 1]), 512, now);
    policy.commits_gathered(&mut g);
    policy.decoded(MS * 10);
    let g = policy.open_commits(&commit(&[0]), 512, now);
    assert_eq!(g.wait(now), GAP);
}

/// Prefills and steps mix without splitting either: a new request's prefill waits behind the
/// streams' step, a stream's step behind a prefill group, and a prefix cache's fork runs in
/// passing unless it writes a branch of the group.
#[test]
fn jobs_of_the_other_kind_wait_behind_the_group() {
    let now = Instant::now();
    let mut policy = GatherPolicy::new(8);
    let g = policy.open_commits(&commit(&[0, 1]), 512, now);
    assert_eq!(g.fate(&prefill(&[2]), false), Fate::Defer);
    assert_eq!(
        g.fate(&prefill(&[1]), false),
        Fate::Stop,
        "its own branch: queue order"
    );
    let fork = JobView::Light {
        reads: vec![cell(0)],
        writes: vec![cell(3)],
    };
    assert_eq!(
        g.fate(&fork, false),
        Fate::InPassing,
        "reads a member: allowed"
    );
    assert_eq!(
        g.fate(&fork, true),
        Fate::Stop,
        "on a park context it may need a lease"
    );
    let into_member = JobView::Light {
        reads: vec![cell(3)],
        writes: vec![cell(0)],
    };
    assert_eq!(g.fate(&into_member, false), Fate::Stop);
    let step = JobView::Commit {
        cells: vec![cell(4)],
        sample_only: false,
        runs_alone: true,
    };
    assert_eq!(g.fate(&step, false), Fate::Stop, "a store step runs alone");
    let produce = JobView::Commit {
        cells: vec![cell(5)],
        sample_only: true,
        runs_alone: false,
    };
    assert_eq!(g.fate(&produce, false), Fate::InPassing);
    let p = policy.open_prefills(&prefill(&[0]), now);
    assert_eq!(p.fate(&commit(&[1]), false), Fate::Defer);
    assert_eq!(p.fate(&step, false), Fate::Stop);
    assert_eq!(p.fate(&prefill(&[2]), false), Fate::Join);
    assert_eq!(p.fate(&JobView::Clear { seq: 6 }, false), Fate::InPassing);
    assert_eq!(p.fate(&JobView::Clear { seq: 0 }, false), Fate::Stop);
}

/// A continuous prefill waits for the streams it feeds: the riders of its last decode and the
/// first samples of the prompts that decode finished, then no longer; riders stay within
/// half a batch and the outputs.
#[test]
fn a_continuous_prefill_waits_for_the_streams_it_expects() {
    let mut policy = GatherPolicy::new(16);
    policy.decoded(MS * 700); // a 512-token chunk
    let t0 = Instant::now();
    let next = NextChunk {
        expected: 2,
        max_riders: max_riders(512, 16),
    };
    let mut g = policy.open_chunk(&[cell(0)], Behind::new(true), next, t0);
    assert!(g.wait(t0) > Duration::ZERO);
    // A finished prompt's first sample runs in passing (the gap restarts); steps ride.
    let produce = JobView::Commit {
        cells: vec![cell(1)],
        sample_only: true,
        runs_alone: false,
    };
    assert_eq!(g.fate(&produce, false), Fate::InPassing);
    g.arrived(t0 + MS);
    assert!(g.wait(t0 + MS) > Duration::ZERO);
    assert_eq!(g.fate(&commit(&[2]), false), Fate::Join);
    g.join(&commit(&[2]), t0 + MS * 2);
    assert!(g.wait(t0 + MS * 2) > Duration::ZERO, "one of two has come");
    assert_eq!(g.fate(&commit(&[1]), false), Fate::Join);
    g.join(&commit(&[1]), t0 + MS * 3);
    assert_eq!(
        g.wait(t0 + MS * 3),
        Duration::ZERO,
        "all expected have come"
    );
    assert_eq!(g.n_items(), 2);
    // A step on the prompt's own branch waits for the run; so does one the run cannot take.
    assert_eq!(g.fate(&commit(&[0]), false), Fate::Defer);
    assert_eq!(max_riders(512, 64), 64);
    assert_eq!(max_riders(64, 64), 32);
    // A decode no step may ride: steps wait behind the run, which takes no more prompts.
    let scratch = NextChunk {
        max_riders: 0,
        ..next
    };
    let mut g = policy.open_chunk(&[cell(0)], Behind::new(true), scratch, t0);
    assert_eq!(g.fate(&prefill(&[3]), false), Fate::Join);
    assert_eq!(g.fate(&commit(&[2]), false), Fate::Defer);
    g.defer(&commit(&[2]));
    assert_eq!(g.fate(&prefill(&[4]), false), Fate::Defer);
    assert!(!g.into_behind().takes_prompts());
}
