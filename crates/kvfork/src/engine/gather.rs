//! Gathering, the worker's half: pull the jobs queued behind the one that opened a group and
//! do what the policy decides with each — join the group, run in passing, wait behind it, or
//! end the gathering. The decisions and the windows are `kvfork_core::gather` (pure, tested
//! with a simulated clock); here jobs become `JobView`s and the decisions become work.

use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::Instant;

use kvfork_core::gather::{Cell, Fate, Gathering, JobView};

use super::shared::{BranchCell, Stats};
use super::{next_run_id, CommitRequest, Job, PrefillRequest, Worker};
use crate::error::Error;

/// A branch as the policy sees it: its cell's address, and its sequence.
pub(super) fn cell(c: &Arc<BranchCell>) -> Cell {
    Cell {
        id: Arc::as_ptr(c) as usize,
        seq: c.seq().id() as u32,
    }
}

fn cells<'a>(items: impl Iterator<Item = &'a Arc<BranchCell>>) -> Vec<Cell> {
    items.map(cell).collect()
}

fn commit_view(req: &CommitRequest) -> JobView {
    JobView::Commit {
        cells: cells(req.items.iter().map(|(c, _)| c)),
        sample_only: req.is_sample_only(),
        runs_alone: req.runs_alone(),
    }
}

fn prefill_view(req: &PrefillRequest) -> JobView {
    JobView::Prefill {
        cells: cells(req.items.iter().map(|(c, _)| c)),
    }
}

/// `job` as the policy sees it.
pub(super) fn view(job: &Job) -> JobView {
    match job {
        Job::Run(_) => JobView::Run,
        Job::Clear(seq) => JobView::Clear {
            seq: seq.id() as u32,
        },
        Job::Light { reads, writes, .. } => JobView::Light {
            reads: cells(reads.iter()),
            writes: cells(writes.iter()),
        },
        Job::Commit(req) => commit_view(req),
        Job::Prefill(req) => prefill_view(req),
    }
}

impl Worker {
    /// Gather the commits that share a decode with `first`, then run them.
    pub(super) fn gather_commits(&mut self, rx: &Receiver<Job>, first: CommitRequest) {
        let n_batch = self.n_batch();
        let mut gathering = self
            .policy
            .open_commits(&commit_view(&first), n_batch, Instant::now());
        let mut group = vec![first];
        self.gather(rx, &mut gathering, &mut group, |job| match job {
            Job::Commit(req) => Ok(req),
            other => Err(other),
        });
        self.policy.commits_gathered(&mut gathering);
        let decodes = Stats::get(&self.shared().stats.decode_calls);
        self.run_commits(group);
        let decoded = Stats::get(&self.shared().stats.decode_calls) != decodes;
        self.policy.commits_ran(decoded);
    }

    /// Gather the prefills that start with `first`, then run them: continuously
    /// (`continuous.rs`), or packed into one plan.
    pub(super) fn gather_prefills(&mut self, rx: &Receiver<Job>, first: PrefillRequest) {
        let mut gathering = self
            .policy
            .open_prefills(&prefill_view(&first), Instant::now());
        let mut group = vec![first];
        self.gather(rx, &mut gathering, &mut group, |job| match job {
            Job::Prefill(req) => Ok(req),
            other => Err(other),
        });
        if self.runs_continuously(&group) {
            return self.run_continuous(rx, group);
        }
        let prefilled = group
            .iter()
            .flat_map(|r| r.items.iter().map(|(c, _)| c.seq().id() as u32))
            .collect();
        self.policy.prefills_gathered(prefilled);
        self.run_prefills(group);
    }

    /// Pull jobs into `group` (the requests joined so far; `gathering`, the policy's view of
    /// them) until the window closes or a job cannot join nor wait behind the group (it runs
    /// next, after the deferred ones). `request` takes a joined job's request out of it.
    fn gather<R>(
        &mut self,
        rx: &Receiver<Job>,
        gathering: &mut Gathering,
        group: &mut Vec<R>,
        request: impl Fn(Job) -> std::result::Result<R, Job>,
    ) {
        let mut deferred = Vec::new();
        let mut stopper = None;
        while let Some(job) = self.next_queued(rx, gathering.wait(Instant::now())) {
            let seen = view(&job);
            match gathering.fate(&seen, self.parks()) {
                // The group's arrivals keep its window open (so does time spent on one run in
                // passing); a deferred job's do not.
                Fate::Join => {
                    // A job cancelled before it started is answered by `admit`.
                    if let Some(job) = self.admit(job) {
                        match request(job) {
                            Ok(req) => {
                                gathering.join(&seen, Instant::now());
                                group.push(req);
                            }
                            Err(job) => {
                                job.fail(Error::Internal("joined a group not its kind".into()))
                            }
                        }
                    } else {
                        gathering.arrived(Instant::now());
                    }
                }
                Fate::InPassing => {
                    self.run_in_passing(job);
                    gathering.arrived(Instant::now());
                }
                Fate::Defer => {
                    gathering.defer(&seen);
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
    pub(super) fn run_in_passing(&mut self, job: Job) {
        let Some(job) = self.admit(job) else { return };
        match job {
            Job::Clear(seq) => self.clear_seq(seq),
            Job::Light { task, .. } => self.run_task(task),
            Job::Commit(req) if req.is_sample_only() => self.answer_sample(req),
            job => job.fail(Error::Internal("not a job to run in passing".into())),
        }
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
