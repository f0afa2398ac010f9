//! The engine thread's side: owns the llama context and the batch, runs jobs.

use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvfork_core::packer::{logits_index, plan_prefill};

use super::shared::{BranchCell, Shared, Stats};
use super::{CommitItem, Job, Reply};
use crate::branch_state::Snapshot;
use crate::error::{Error, Result};
use crate::llama_ctx::{Batch, LlamaCtx};
use crate::model::Token;

/// Upper bound of the wait for the rest of a coalescing group.
const MAX_LINGER: Duration = Duration::from_millis(2);

pub(crate) struct Worker {
    pub ctx: LlamaCtx,
    batch: Batch,
    pub shared: Arc<Shared>,
    /// A job pulled while gathering a commit group that could not join it.
    stash: Option<Job>,
    /// Branches in the last commit group (how many to wait for next time).
    last_group: usize,
    last_decode: Duration,
}

/// One commit request inside a coalesced group.
struct Request {
    items: Vec<CommitItem>,
    reply: Reply<()>,
}

impl Worker {
    pub fn new(ctx: LlamaCtx, shared: Arc<Shared>) -> Self {
        let batch = Batch::new(ctx.n_batch as usize);
        Worker {
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
            match job {
                Job::Run(f) => f(&mut self),
                Job::Commit { items, reply } => {
                    let group = self.gather(&rx, Request { items, reply });
                    self.run_group(group);
                }
            }
        }
    }

    /// Collect the commit requests queued behind `first` (disjoint branches, within n_batch).
    fn gather(&mut self, rx: &Receiver<Job>, first: Request) -> Vec<Request> {
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
                Job::Commit { items, reply }
                    if n_items + items.len() <= self.ctx.n_batch as usize
                        && items.iter().all(|(c, _)| {
                            !group
                                .iter()
                                .any(|r| r.items.iter().any(|(g, _)| Arc::ptr_eq(c, g)))
                        }) =>
                {
                    n_items += items.len();
                    group.push(Request { items, reply });
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
    fn run_group(&mut self, group: Vec<Request>) {
        Stats::add(&self.shared.stats.commit_requests, group.len() as u64);
        let mut accepted: Vec<(Request, Vec<Snapshot>)> = Vec::with_capacity(group.len());
        for req in group {
            match self.accept_all(&req.items) {
                Ok(snaps) => accepted.push((req, snaps)),
                Err(e) => {
                    let _ = req.reply.send(Err(e));
                }
            }
        }
        let items: Vec<&CommitItem> = accepted.iter().flat_map(|(r, _)| r.items.iter()).collect();
        let result = self.decode_items(&items);
        drop(items);
        for (req, snaps) in accepted {
            if result.is_err() {
                restore(&req.items, snaps);
            }
            let _ = req.reply.send(result.clone());
        }
    }

    /// Commit one group synchronously (BranchStore::commit, step).
    pub fn commit_now(&mut self, items: &[CommitItem]) -> Result<()> {
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
                if let Err(e) = st.accept(&model, *token) {
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

    /// Decode one token per item in one batch; on success store logits and advance positions.
    fn decode_items(&mut self, items: &[&CommitItem]) -> Result<()> {
        if items.is_empty() {
            return Ok(());
        }
        self.batch.clear();
        for (cell, token) in items {
            let st = cell.lock();
            self.batch.push(*token, st.position, st.seq, true);
        }
        self.decode()?;
        for (i, (cell, _)) in items.iter().enumerate() {
            let row = self.ctx.logits_ith(i)?;
            let mut st = cell.lock();
            st.set_logits(row);
            st.position += 1;
        }
        Ok(())
    }

    /// `llama_decode` of the current batch, counted.
    fn decode(&mut self) -> Result<()> {
        let t0 = Instant::now();
        let r = self.ctx.decode(&self.batch);
        self.last_decode = t0.elapsed();
        let stats = &self.shared.stats;
        Stats::add(&stats.decode_calls, 1);
        Stats::add(&stats.decode_ns, self.last_decode.as_nanos() as u64);
        if r.is_ok() {
            Stats::add(&stats.decoded_tokens, self.batch.len() as u64);
        }
        r
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
            let mut st = cell.lock();
            if let Some(row) = &rows[i] {
                st.set_logits(row);
            }
            st.position += tokens.len() as i32;
        }
        Ok(())
    }
}

fn restore(items: &[CommitItem], snaps: Vec<Snapshot>) {
    for ((cell, _), snap) in items.iter().zip(snaps) {
        cell.lock().restore(snap);
    }
}
