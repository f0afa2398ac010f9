//! The engine thread's side: owns the llama context and the batch, runs jobs.

use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfork_core::packer::{logits_index, plan_prefill};
use kvfork_core::threads::ThreadTuner;

use super::shared::{BranchCell, Shared, Stats};
use super::{panic_message, CommitItem, CommitReply, CommitRequest, Job};
use crate::branch::Produced;
use crate::branch_state::Snapshot;
use crate::error::{Error, Result};
use crate::llama_ctx::{Batch, LlamaCtx};
use crate::model::Token;

/// Upper bound of the wait for the rest of a coalescing group.
const MAX_LINGER: Duration = Duration::from_millis(2);

pub(crate) struct Worker {
    pub ctx: LlamaCtx,
    pub(crate) batch: Batch,
    pub shared: Arc<Shared>,
    /// A job pulled while gathering a commit group that could not join it.
    stash: Option<Job>,
    /// Branches in the last commit group (how many to wait for next time).
    last_group: usize,
    last_decode: Duration,
    /// Adapts the thread counts to the machine's load (None when both are fixed).
    tuner: Option<ThreadTuner>,
}

impl Worker {
    pub fn new(ctx: LlamaCtx, shared: Arc<Shared>) -> Self {
        let batch = Batch::new(ctx.n_batch as usize);
        let max = ctx.max_threads;
        let tuner = shared
            .params
            .adapts_threads()
            .then(|| ThreadTuner::new(max as u32));
        Worker {
            tuner,
            ctx,
            batch,
            shared,
            stash: None,
            last_group: 0,
            last_decode: Duration::ZERO,
        }
    }

    pub fn run(mut self, rx: Receiver<Job>) {
        loop {
            let job = match self.stash.take() {
                Some(job) => job,
                None => match rx.recv() {
                    Ok(job) => job,
                    Err(_) => return,
                },
            };
            let Some(job) = self.admit(job) else { continue };
            match job {
                Job::Run(task) => {
                    let ticket = task.ticket().clone();
                    self.shared
                        .abort
                        .current
                        .store(ticket.id(), Ordering::Relaxed);
                    task.run(&mut self);
                    self.shared.abort.current.store(0, Ordering::Relaxed);
                    ticket.finish();
                }
                Job::Commit(first) => {
                    let group = self.gather(&rx, first);
                    self.run_group(group);
                }
            }
        }
    }

    /// Start `job` unless the context is closed or the job was cancelled (then fail it).
    fn admit(&self, job: Job) -> Option<Job> {
        if let Err(e) = self.shared.check_open() {
            job.fail(e);
            return None;
        }
        if !job.ticket().start() {
            job.fail(Error::Cancelled("cancelled before it started".into()));
            return None;
        }
        Some(job)
    }

    /// Collect the commit requests queued behind `first` (disjoint branches, within n_batch).
    fn gather(&mut self, rx: &Receiver<Job>, first: CommitRequest) -> Vec<CommitRequest> {
        let mut n_items = first.items.len();
        let mut group = vec![first];
        let linger = (self.last_decode / 10).min(MAX_LINGER);
        let deadline = Instant::now() + linger;
        loop {
            let next = if n_items < self.last_group {
                rx.recv_timeout(deadline.saturating_duration_since(Instant::now()))
                    .ok()
            } else {
                rx.try_recv().ok()
            };
            let Some(job) = next else { break };
            match job {
                Job::Commit(req)
                    if n_items + req.items.len() <= self.ctx.n_batch as usize
                        && req.items.iter().all(|(c, _)| {
                            !group
                                .iter()
                                .any(|r| r.items.iter().any(|(g, _)| Arc::ptr_eq(c, g)))
                        }) =>
                {
                    if let Some(Job::Commit(req)) = self.admit(Job::Commit(req)) {
                        n_items += req.items.len();
                        group.push(req);
                    }
                }
                other => {
                    self.stash = Some(other);
                    break;
                }
            }
        }
        self.last_group = n_items;
        group
    }

    /// One decode for every request of the group; each request succeeds or fails as a whole.
    /// A panic fails every request of the group and closes the context.
    fn run_group(&mut self, mut group: Vec<CommitRequest>) {
        let results = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.commit_group(&mut group)
        }));
        let results = match results {
            Ok(results) => results,
            Err(payload) => {
                let msg = panic_message(payload.as_ref());
                self.shared
                    .fail(format!("panic on the engine thread: {msg}"));
                vec![Err(Error::Internal(msg)); group.len()]
            }
        };
        for (req, result) in group.into_iter().zip(results) {
            req.ticket.finish();
            req.reply.send(result);
        }
    }

    /// Sample the tokens of generation steps, accept every request (a failing one alone is
    /// refused), then one decode for all that remain.
    fn commit_group(&mut self, group: &mut [CommitRequest]) -> Vec<Result<Option<Produced>>> {
        let mut results: Vec<Result<Option<Produced>>> = vec![Ok(None); group.len()];
        let steps: Vec<usize> = (0..group.len())
            .filter(|&i| matches!(group[i].reply, CommitReply::Sampled { .. }))
            .collect();
        if !steps.is_empty() {
            let cells: Vec<Arc<BranchCell>> =
                steps.iter().map(|&i| group[i].items[0].0.clone()).collect();
            for (&i, produced) in steps.iter().zip(self.sample_cells(&cells)) {
                match produced {
                    Ok(p) => {
                        let commit =
                            matches!(group[i].reply, CommitReply::Sampled { commit: true, .. });
                        if p.is_stop || !commit {
                            group[i].items.clear(); // reported, not committed
                        } else {
                            group[i].items[0].1 = p.token;
                        }
                        results[i] = Ok(Some(p));
                    }
                    Err(e) => {
                        group[i].items.clear();
                        results[i] = Err(e);
                    }
                }
            }
        }
        let mut accepted: Vec<(usize, Vec<Snapshot>)> = Vec::with_capacity(group.len());
        for (i, req) in group.iter().enumerate() {
            if req.items.is_empty() {
                continue;
            }
            Stats::add(&self.shared.stats.commit_requests, 1);
            match self.accept_all(&req.items) {
                Ok(snaps) => accepted.push((i, snaps)),
                Err(e) => results[i] = Err(e),
            }
        }
        let items: Vec<&CommitItem> = accepted
            .iter()
            .flat_map(|(i, _)| group[*i].items.iter())
            .collect();
        let result = self.decode_items(&items);
        drop(items);
        for (i, snaps) in accepted {
            match &result {
                Ok(()) => {}
                Err(e) => {
                    restore(&group[i].items, snaps);
                    results[i] = Err(e.clone());
                }
            }
        }
        results
    }

    /// Sample each cell (across the cores when a grammar or a full-vocabulary chain makes it
    /// pay); nothing is accepted.
    pub(crate) fn sample_cells(&self, cells: &[Arc<BranchCell>]) -> Vec<Result<Produced>> {
        let model = self.shared.model.clone();
        let sample = |cell: &Arc<BranchCell>| -> Result<Produced> {
            if cell.is_disposed() {
                return Err(Error::BranchDisposed("in step".into()));
            }
            crate::branch::produce(&mut cell.lock(), &model)
        };
        let heavy = cells.iter().any(|c| c.lock().sampling_is_heavy());
        if heavy {
            super::map_parallel(cells, sample)
        } else {
            cells.iter().map(sample).collect()
        }
    }

    /// Commit one group synchronously (BranchStore::commit, step).
    pub fn commit_now(&mut self, items: &[CommitItem]) -> Result<()> {
        if !items.is_empty() {
            Stats::add(&self.shared.stats.commit_requests, 1);
        }
        let snaps = self.accept_all(items)?;
        let refs: Vec<&CommitItem> = items.iter().collect();
        let result = self.decode_items(&refs);
        if result.is_err() {
            restore(items, snaps);
        }
        result
    }

    /// Accept every token (snapshotting first); on any failure undo this request's accepts.
    fn accept_all(&mut self, items: &[CommitItem]) -> Result<Vec<Snapshot>> {
        let mut snaps = Vec::with_capacity(items.len());
        let model = self.shared.model.clone();
        for (i, (cell, token)) in items.iter().enumerate() {
            let outcome = (|| {
                if cell.is_disposed() {
                    return Err(Error::BranchDisposed("in commit".into()));
                }
                let mut st = cell.lock();
                if st.position as u32 >= self.shared.n_ctx {
                    return Err(Error::KvCacheFull(format!(
                        "position {} reached n_ctx = {}",
                        st.position, self.shared.n_ctx
                    )));
                }
                let snap = st.snapshot();
                if let Err(e) = st.accept_for_commit(&model, *token) {
                    st.restore(snap);
                    return Err(e);
                }
                Ok(snap)
            })();
            match outcome {
                Ok(s) => snaps.push(s),
                Err(e) => {
                    restore(&items[..i], snaps);
                    return Err(e);
                }
            }
        }
        Ok(snaps)
    }

    /// Decode one token per item, in ceil(N / n_batch) decodes that form one rollback unit;
    /// on success store logits and advance positions.
    fn decode_items(&mut self, items: &[&CommitItem]) -> Result<()> {
        if items.is_empty() {
            return Ok(());
        }
        let places: Vec<(i32, i32)> = items
            .iter()
            .map(|(cell, _)| {
                let st = cell.lock();
                (st.seq, st.position)
            })
            .collect();
        let n_batch = self.ctx.n_batch as usize;
        // Rows of earlier decodes are kept aside: the next decode overwrites the output buffer.
        let mut kept: Vec<Vec<f32>> = Vec::new();
        for start in (0..items.len()).step_by(n_batch) {
            let end = (start + n_batch).min(items.len());
            self.batch.clear();
            for (&(seq, pos), (_, token)) in places[start..end].iter().zip(&items[start..end]) {
                self.batch.push(*token, pos, seq, true);
            }
            if let Err(e) = self.decode() {
                // llama.cpp removed this decode's cells; remove those of the earlier ones.
                for &(seq, pos) in &places[..start] {
                    let _ = self.ctx.seq_rm(seq, pos, -1);
                }
                return Err(e);
            }
            if end < items.len() || start > 0 {
                for k in 0..end - start {
                    kept.push(self.ctx.logits_ith(k)?.to_vec());
                }
            }
        }
        for (i, (cell, _)) in items.iter().enumerate() {
            let mut st = cell.lock();
            if kept.is_empty() {
                st.set_logits(self.ctx.logits_ith(i)?);
            } else {
                st.set_logits(&kept[i]);
            }
            st.position += 1;
        }
        Ok(())
    }

    /// `llama_decode` of the current batch, counted.
    pub(crate) fn decode(&mut self) -> Result<()> {
        let t0 = Instant::now();
        let mut r = self.ctx.decode(&self.batch);
        self.last_decode = t0.elapsed();
        if matches!(r, Err(Error::Cancelled(_)))
            && self.shared.abort.closing.load(Ordering::Relaxed)
        {
            r = Err(Error::Closed);
        }
        self.tune_threads();
        let stats = &self.shared.stats;
        Stats::add(&stats.decode_calls, 1);
        Stats::add(&stats.decode_ns, self.last_decode.as_nanos() as u64);
        if r.is_ok() {
            Stats::add(&stats.decoded_tokens, self.batch.len() as u64);
        }
        r
    }

    /// Feed the decode just timed to the tuner; apply the count it wants next.
    fn tune_threads(&mut self) {
        let Some(tuner) = self.tuner.as_mut() else {
            return;
        };
        let before = tuner.threads();
        tuner.observe(self.batch.len(), self.last_decode.as_nanos() as f64);
        let next = tuner.threads();
        if next != before {
            let (single, batch) = self.shared.params.threads_with(next as i32);
            self.ctx.set_threads(single, batch);
            // Readers see the settled choice, not a probe's.
            let (single, batch) = self.shared.params.threads_with(tuner.current() as i32);
            self.shared.threads.set(single, batch);
        }
    }

    /// Decode external tokens into each branch, packed into ceil(total / n_batch) decodes.
    /// All or nothing: on failure the KV written so far is removed and no state changes.
    pub fn prefill(&mut self, items: &[(Arc<BranchCell>, Vec<Token>)]) -> Result<()> {
        let mut starts = Vec::with_capacity(items.len());
        let mut seqs = Vec::with_capacity(items.len());
        for (cell, tokens) in items {
            if cell.is_disposed() {
                return Err(Error::BranchDisposed("in prefill".into()));
            }
            let st = cell.lock();
            if st.position as u64 + tokens.len() as u64 > self.shared.n_ctx as u64 {
                return Err(Error::KvCacheFull(format!(
                    "prefill of {} tokens at position {} exceeds n_ctx = {}",
                    tokens.len(),
                    st.position,
                    self.shared.n_ctx
                )));
            }
            starts.push(st.position);
            seqs.push(st.seq);
        }
        let lens: Vec<usize> = items.iter().map(|(_, t)| t.len()).collect();
        let mut rows: Vec<Option<Vec<f32>>> = vec![None; items.len()];
        for chunk in plan_prefill(&lens, self.ctx.n_batch as usize) {
            self.batch.clear();
            for span in &chunk.spans {
                let tokens = &items[span.item].1[span.start..span.start + span.len];
                for (j, &t) in tokens.iter().enumerate() {
                    let wants_logits = span.is_last && j + 1 == span.len;
                    let pos = starts[span.item] + (span.start + j) as i32;
                    self.batch.push(t, pos, seqs[span.item], wants_logits);
                }
            }
            if let Err(e) = self.decode() {
                for (i, &seq) in seqs.iter().enumerate() {
                    let _ = self.ctx.seq_rm(seq, starts[i], -1);
                }
                return Err(e);
            }
            for (k, span) in chunk.spans.iter().enumerate() {
                if span.is_last {
                    rows[span.item] = Some(self.ctx.logits_ith(logits_index(&chunk, k))?.to_vec());
                }
            }
        }
        for (i, (cell, tokens)) in items.iter().enumerate() {
            cell.lock().prefilled(tokens.len(), rows[i].as_deref());
        }
        Ok(())
    }
}

fn restore(items: &[CommitItem], snaps: Vec<Snapshot>) {
    for ((cell, _), snap) in items.iter().zip(snaps) {
        cell.lock().restore(snap);
    }
}
