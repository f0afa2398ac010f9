//! Continuous prefill: prompts decoded chunk after chunk, each answered as soon as its own
//! last token is in, with the running streams' steps riding the same decodes.
//!
//! A gathered group of prefills starts a run. Before each decode the run pulls the queue
//! (`kvfork_core::gather`, [`GatherPolicy::open_chunk`]): a stream's step rides the decode (its
//! token beside the prompts'), a new prompt joins the run's queue, a `produce` is answered in
//! passing (a prompt just finished samples its first token at once), anything else waits for
//! the run to end. The decode then holds the riders' tokens and as many prompt tokens as the
//! batch has room for (`kvfork_core::plan_chunk`: queue order; a prompt that ends in it gets
//! its logits row), so a running stream waits at most one `n_batch` decode for its next token,
//! as in llama.cpp's server. The riders go through the commit path (`commit.rs`), which puts the
//! chunk ([`Riding`]) into its one decode; without riders the chunk is decoded alone.
//!
//! Beside a busy cache, new prompts go to the scratch context instead (`scratch.rs`): there
//! a 512-token decode stays at the empty cache's speed, where in the main context it slowed
//! from ~0.7 s to 1.0–1.5 s with a server's cache full of finished requests (measured: the
//! steady workload of `bench_serve.py`), far more than a separate decode of the steps costs.
//! The steps that came meanwhile decode apart, now and then ([`StepsApart`]). Each
//! prompt is decoded wholly in one context, chosen at its first chunk; while one is cut
//! between two decodes, the next decode is its context's, except that short prompts
//! ([`SHORT_PROMPT`]) may go ahead of it: those for the main context (with the steps riding
//! their decode; new ones too while the prompt cut is in the main context), or new ones the
//! shared scratch takes while a long prompt is cut in the scratch it has alone; one decode of
//! them between two of the cut prompt's.
//!
//! A failed decode ends the run: the prompts not yet answered lose what they wrote and go
//! through the packed path (`prefill.rs`), which narrows the failure down to its request.
//! Contexts and prompts the run does not handle (`park`, embeddings, recurrent models,
//! adapters) take the packed path from the start. `KVFORK_NO_CONTINUOUS_PREFILL=1` turns it
//! off (to compare).

use std::collections::HashSet;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::Instant;

use kvfork_core::gather::{max_riders, Behind, Fate, NextChunk};
use kvfork_core::packer::{plan_chunk, plan_prefill, Chunk, ChunkRoom, Progress};
use kvfork_core::StepsApart;

use super::gather::{start_run, view};
use super::pending::Reply;
use super::scratch::{ScratchKind, ScratchSlots, LONG_SCRATCH_PROMPT, SCRATCH_SPANS};
use super::shared::{BranchCell, Stats};
use super::{CommitRequest, Job, PrefillItem, PrefillRequest, Ticket, Worker};
use crate::adapter::Adapters;
use crate::error::{Error, Result};
use crate::llama_ctx::{Batch, Output};
use crate::model::Token;
use crate::seq::Seq;

/// Prompts a run takes in all: then it drains and ends (its bookkeeping stays small).
const MOST_PROMPTS: usize = 256;

/// A prompt with at most this many tokens left goes before a prompt cut between two decodes
/// (one decode of them between two of the cut one's): a conversation's next turn
/// after its entry came back, a question on a fork, or a short new request would otherwise
/// wait for all of a prompt of up to [`LONG_SCRATCH_PROMPT`] tokens (~3 s on a CPU), a short
/// job behind a long one (a 46-token request waited 2.2 s in the steady workload of
/// `bench_serve.py`).
const SHORT_PROMPT: usize = 128;

/// A chunk of prompt tokens riding a commit's decode: its tokens go into the batch after the
/// steps', its logits rows are copied out once the decode lands.
pub(super) struct Riding {
    /// (token, position, sequence, wants logits), in batch order.
    tokens: Vec<(Token, i32, Seq, bool)>,
    /// The sequences whose outputs must be whole rows (`Batch::want_row`).
    whole_rows: Vec<Seq>,
    /// The rows of its outputs, in order.
    rows: Vec<Output>,
    /// None until it was decoded (or its decode failed).
    outcome: Option<Result<()>>,
}

impl Riding {
    /// Not decoded yet.
    pub(super) fn waits(&self) -> bool {
        self.outcome.is_none()
    }

    pub(super) fn push_into(&self, batch: &mut Batch) {
        for &(token, pos, seq, logits) in &self.tokens {
            batch.push(token, pos, seq, logits);
        }
        self.whole_rows.iter().for_each(|&seq| batch.want_row(seq));
    }

    /// The decode that held it (after `n_steps` step rows) ended with `decoded`.
    pub(super) fn landed(&mut self, w: &Worker, decoded: &Result<()>, n_steps: usize) {
        let outcome = decoded.clone().and_then(|()| {
            if n_steps > 0 {
                Stats::add(&w.shared().stats.mixed_decodes, 1);
            }
            // (`logits_ith` takes the token's index in the batch.)
            for (j, _) in self.tokens.iter().enumerate().filter(|(_, t)| t.3) {
                self.rows
                    .push(w.ctx().output_ith(n_steps + j)?.into_owned());
            }
            Ok(())
        });
        self.outcome = Some(outcome);
    }
}

/// A prompt request of a run: its items, where each starts and how far it is, and its
/// reply (None once answered).
struct Prompt {
    items: Vec<PrefillItem>,
    reply: Option<Reply<()>>,
    ticket: Arc<Ticket>,
    starts: Vec<i32>,
    /// The index of its first item among the run's items.
    first: usize,
}

/// Which prompts the next decode takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Take {
    /// From those before this item (exclusive), in queue order.
    UpTo(usize),
    /// Only the short prompts going ahead of a prompt cut between two decodes
    /// ([`short_prompts`]) to the decode's context.
    Ahead,
}

/// Where an item of a run is decoded, chosen at its first chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Unplaced,
    Main,
    Scratch,
}

/// A run: its prompts in queue order, their items (flat), and what waits behind it.
struct Run {
    prompts: Vec<Prompt>,
    /// (prompt, item) of each item, and its progress.
    items: Vec<(usize, usize)>,
    progress: Vec<Progress>,
    rows: Vec<Option<Output>>,
    place: Vec<Place>,
    /// Scratch sequences of items in flight there.
    slots: ScratchSlots,
    behind: Behind,
    /// Jobs that wait for the run to end, in queue order.
    waiting: Vec<Job>,
    /// A job that may not be overtaken at all came: nothing more is pulled.
    stopped: bool,
    /// Its decodes' abort target.
    run_id: u64,
    /// Sequences of the prompts answered and the streams that rode: they step next.
    stepping: HashSet<u32>,
    /// Streams' steps worth waiting for before the next decode.
    expected: usize,
    /// Streams' steps held while prompts decode in a scratch (see [`StepsApart`]).
    held: Vec<CommitRequest>,
    /// When the held steps decode apart.
    steps_apart: StepsApart,
    /// The last decode took short prompts ahead of a prompt cut between two decodes
    /// ([`SHORT_PROMPT`]): the cut prompt's turn now.
    went_ahead: bool,
}

impl Run {
    fn in_flight(&self) -> impl Iterator<Item = &Prompt> {
        self.prompts.iter().filter(|p| p.reply.is_some())
    }
}

impl Worker {
    /// Whether a gathered group of prefills runs continuously: the context and every prompt
    /// allow it (else it is packed, `prefill.rs`).
    pub(super) fn runs_continuously(&self, group: &[PrefillRequest]) -> bool {
        self.continuous_allowed() && group.iter().all(|r| self.continuous_takes(r))
    }

    fn continuous_allowed(&self) -> bool {
        std::env::var_os("KVFORK_NO_CONTINUOUS_PREFILL").is_none()
            && !self.parks()
            && !self.shared().params.embeddings
            && !self.shared().model.is_recurrent()
    }

    /// Whether a run may take `req`: no adapter on its branches.
    fn continuous_takes(&self, req: &PrefillRequest) -> bool {
        req.items
            .iter()
            .all(|(cell, _)| cell.lock().adapters().key().is_empty())
    }

    /// Run `group` (gathered) continuously; the jobs that waited for it run next.
    pub(super) fn run_continuous(&mut self, rx: &Receiver<Job>, group: Vec<PrefillRequest>) {
        let run_id = start_run(group.iter().map(|r| &*r.ticket));
        let mut run = Run {
            prompts: Vec::new(),
            items: Vec::new(),
            progress: Vec::new(),
            rows: Vec::new(),
            place: Vec::new(),
            slots: ScratchSlots::new(0),
            behind: Behind::new(true),
            waiting: Vec::new(),
            stopped: false,
            run_id,
            stepping: HashSet::new(),
            expected: 0,
            held: Vec::new(),
            steps_apart: StepsApart::new(Instant::now()),
            went_ahead: false,
        };
        for req in group {
            self.take_prompt(&mut run, req);
        }
        let outcome = self.guarded(1, |w| vec![w.run_chunks(rx, &mut run)]);
        let held = std::mem::take(&mut run.held);
        if !held.is_empty() {
            self.run_commits(held);
        }
        if let Some(Err(e)) = outcome.into_iter().next() {
            self.fall_back(&mut run, e);
        }
        self.policy
            .prefills_gathered(std::mem::take(&mut run.stepping));
        self.run_next(run.waiting.into_iter());
    }

    /// Where the next decode goes, and which prompts it takes. A prompt cut between two
    /// decodes finishes where it started (short prompts may go ahead of it in between, every
    /// other decode at most: [`Worker::short_prompts`]). A new prompt goes to
    /// the scratch when it fits there (`scratch.rs`: it starts its sequence, within one
    /// decode and the sliding window, or up to `LONG_SCRATCH_PROMPT` tokens alone) and the
    /// scratch pays for it and the new prompts after it; a decode in the main context then
    /// ends before it (so that it starts a decode).
    fn next_place(&self, run: &Run) -> (Place, Take) {
        let n = run.items.len();
        let unfinished = |k: &usize| run.progress[*k].done < run.progress[*k].len;
        let Some(first) = (0..n).find(unfinished) else {
            return (Place::Main, Take::UpTo(n));
        };
        let new = |k: usize| {
            let (p, i) = run.items[k];
            run.place[k] == Place::Unplaced && run.prompts[p].starts[i] == 0
        };
        let prompt_of = |k: usize| &run.prompts[run.items[k].0];
        // Alone: a request of one prompt only.
        let alone = |k: usize| {
            prompt_of(k).items.len() == 1 && self.fits_scratch_alone(run.progress[k].len)
        };
        // A request's prompts go to one context (a `BranchStore::prefill` of several keeps
        // its packing into ceil(total / n_batch) decodes): beside others in the scratch
        // when every one of them fits there.
        let fits_beside = |k: usize| {
            let prompt = prompt_of(k);
            let own = prompt.first..prompt.first + prompt.items.len();
            new(k)
                && own.into_iter().all(|j| {
                    let i = run.items[j].1;
                    prompt.starts[i] == 0 && self.fits_scratch(run.progress[j].len)
                })
        };
        let fits = |k: usize| fits_beside(k) || (new(k) && alone(k));
        // The end of the scratch's prompts from `k`: a prompt that goes alone is alone.
        let scratch_end = |k: usize| {
            if alone(k) {
                return k + 1;
            }
            (k + 1..n)
                .filter(unfinished)
                .find(|&j| !fits_beside(j))
                .unwrap_or(n)
        };
        let scratch_pays_from = |k: usize| {
            let ks: Vec<usize> = (k..scratch_end(k)).filter(unfinished).collect();
            let items: Vec<&PrefillItem> = ks
                .iter()
                .map(|&j| &run.prompts[run.items[j].0].items[run.items[j].1])
                .collect();
            let lens: Vec<usize> = ks.iter().map(|&j| run.progress[j].len).collect();
            let plan = plan_prefill(&lens, self.n_batch());
            self.scratch_pays_up_to(&items, true, &plan, LONG_SCRATCH_PROMPT)
        };
        // A decode in the main context ends before the next new prompt the scratch takes.
        let main_end = || {
            (first + 1..n)
                .filter(unfinished)
                .find(|&k| run.place[k] == Place::Unplaced)
                .filter(|&k| run.items[k].1 == 0 && fits(k) && scratch_pays_from(k))
                .unwrap_or(n)
        };
        let short_goes_ahead = |place: Place| {
            // New prompts go ahead into the shared scratch only while the one cut is in the
            // scratch it has alone (in the shared one they join its next decode anyway).
            (place == Place::Main || alone(first))
                && self.short_prompts(run, place).next().is_some()
        };
        match run.place[first] {
            Place::Scratch if !run.went_ahead && short_goes_ahead(Place::Main) => {
                (Place::Main, Take::Ahead)
            }
            Place::Scratch if !run.went_ahead && short_goes_ahead(Place::Scratch) => {
                (Place::Scratch, Take::Ahead)
            }
            Place::Scratch => (Place::Scratch, Take::UpTo(scratch_end(first))),
            // Cut in the main context, as in the scratch: a short request waits one decode,
            // not all of a long prompt's (26 s behind a 3,000-token prompt on this CPU).
            Place::Main if !run.went_ahead && short_goes_ahead(Place::Main) => {
                (Place::Main, Take::Ahead)
            }
            Place::Unplaced if fits(first) && scratch_pays_from(first) => {
                (Place::Scratch, Take::UpTo(scratch_end(first)))
            }
            _ => (Place::Main, Take::UpTo(main_end())),
        }
    }

    /// `req` joins the run (its ticket started): refused at once if it cannot fit, answered at
    /// once if it has nothing to decode.
    fn take_prompt(&mut self, run: &mut Run, req: PrefillRequest) {
        let PrefillRequest {
            items,
            reply,
            ticket,
        } = req;
        let starts: Result<Vec<i32>> = items.iter().map(|it| self.prefill_place(it)).collect();
        let starts = match starts {
            Ok(starts) => starts,
            Err(e) => {
                ticket.finish();
                reply.send(Err(e));
                return;
            }
        };
        ticket.join_run(run.run_id);
        let p = run.prompts.len();
        let first = run.items.len();
        for (i, (_, tokens)) in items.iter().enumerate() {
            run.items.push((p, i));
            run.progress.push(Progress {
                done: 0,
                len: tokens.len(),
            });
            run.rows.push(None);
            run.place.push(Place::Unplaced);
        }
        run.slots.grow(run.items.len());
        run.prompts.push(Prompt {
            items,
            reply: Some(reply),
            ticket,
            starts,
            first,
        });
        self.answer_finished(run);
    }

    /// Decode the run's prompts chunk after chunk until every one is answered.
    fn run_chunks(&mut self, rx: &Receiver<Job>, run: &mut Run) -> Result<()> {
        loop {
            self.drop_aborted(run);
            if run.in_flight().next().is_none() {
                return Ok(());
            }
            let mut riders = std::mem::take(&mut run.held);
            if !run.stopped {
                self.gather_chunk(rx, run, &mut riders);
            }
            let rider_tokens: usize = riders.iter().map(|r| r.items.len()).sum();
            let n_seq_max = self.shared().n_seq_max as usize;
            let (place, take) = self.next_place(run);
            let room = if place == Place::Scratch {
                ChunkRoom {
                    tokens: self.n_batch(),
                    outputs: SCRATCH_SPANS,
                    spans: SCRATCH_SPANS,
                }
            } else {
                ChunkRoom {
                    tokens: self.n_batch() - rider_tokens,
                    outputs: n_seq_max.saturating_sub(rider_tokens),
                    spans: usize::MAX,
                }
            };
            let chunk = match take {
                Take::UpTo(limit) => plan_chunk(&run.progress[..limit], room),
                Take::Ahead => self.plan_ahead(run, room, place),
            };
            run.went_ahead = take == Take::Ahead;
            for span in &chunk.spans {
                run.place[span.item] = place;
            }
            run.stepping.extend(
                riders
                    .iter()
                    .flat_map(|r| r.items.iter().map(|(c, _)| seq_id(c))),
            );
            run.expected = rider_tokens;
            let rows = if place == Place::Scratch {
                // The streams cannot share the scratch's decode: they step apart, now and
                // then (`StepsApart`).
                if run.steps_apart.due(Instant::now()) && !riders.is_empty() {
                    self.run_commits(riders);
                    run.steps_apart.stepped(Instant::now());
                } else {
                    run.held = riders;
                    run.expected = 0;
                }
                run.steps_apart.decoded(chunk.n_tokens());
                self.scratch_decode(run, &chunk)?
            } else {
                run.steps_apart.rode(Instant::now());
                self.main_decode(run, &chunk, riders)?
            };
            let mut rows = rows.into_iter();
            for span in &chunk.spans {
                run.progress[span.item].done += span.len;
                if span.is_last {
                    run.rows[span.item] = rows.next();
                }
            }
            run.expected += self.answer_finished(run);
        }
    }

    /// Pull the queue before the next decode: riders, new prompts, jobs in passing, jobs
    /// that wait for the run (see the module doc).
    /// `riders`: the steps held so far (members of the gathering too).
    fn gather_chunk(&mut self, rx: &Receiver<Job>, run: &mut Run, riders: &mut Vec<CommitRequest>) {
        let held = riders.iter().flat_map(|r| r.items.iter().map(|(c, _)| c));
        let prompts: Vec<_> = run
            .in_flight()
            .flat_map(|p| p.items.iter().map(|(c, _)| c))
            .chain(held)
            .map(super::gather::cell)
            .collect();
        let held_tokens: usize = riders.iter().map(|r| r.items.len()).sum();
        let most = max_riders(self.n_batch(), self.shared().n_seq_max as usize);
        let next = NextChunk {
            expected: run.expected,
            max_riders: most.saturating_sub(held_tokens),
        };
        let behind = std::mem::replace(&mut run.behind, Behind::new(false));
        let mut g = self
            .policy
            .open_chunk(&prompts, behind, next, Instant::now());
        while let Some(job) = self.next_queued(rx, g.wait(Instant::now())) {
            let seen = view(&job);
            let fate = match (g.fate(&seen, false), &job) {
                // A prompt this run cannot take (adapters, or the run is full) waits.
                (Fate::Join, Job::Prefill(req)) if !self.run_takes(run, req) => Fate::Defer,
                (fate, _) => fate,
            };
            match fate {
                Fate::Join => match self.admit(job) {
                    Some(Job::Commit(req)) => {
                        g.join(&seen, Instant::now());
                        riders.push(req);
                    }
                    Some(Job::Prefill(req)) => {
                        g.join(&seen, Instant::now());
                        self.take_prompt(run, req);
                    }
                    Some(other) => other.fail(Error::Internal("joined a run not its kind".into())),
                    None => g.arrived(Instant::now()),
                },
                Fate::InPassing => {
                    self.run_in_passing(job);
                    g.arrived(Instant::now());
                }
                Fate::Defer => {
                    g.defer(&seen);
                    run.waiting.push(job);
                }
                Fate::Stop => {
                    run.waiting.push(job);
                    run.stopped = true;
                    break;
                }
            }
        }
        run.behind = g.into_behind();
    }

    fn run_takes(&self, run: &Run, req: &PrefillRequest) -> bool {
        run.prompts.len() < MOST_PROMPTS && self.continuous_takes(req)
    }

    /// The run's items (`items`, as the chunks' spans index them, of `prompts`), with their
    /// first positions.
    fn chunk_items<'r>(
        items: &[(usize, usize)],
        prompts: &'r [Prompt],
    ) -> Vec<(&'r PrefillItem, i32)> {
        items
            .iter()
            .map(|&(p, i)| (&prompts[p].items[i], prompts[p].starts[i]))
            .collect()
    }

    /// One decode of the chunk in the main context, with the riders when there are any.
    /// The rows of the prompts it finishes, in order.
    fn main_decode(
        &mut self,
        run: &Run,
        chunk: &Chunk,
        riders: Vec<CommitRequest>,
    ) -> Result<Vec<Output>> {
        let items = Self::chunk_items(&run.items, &run.prompts);
        let mut tokens = Vec::with_capacity(chunk.n_tokens());
        let whole_rows = self.row_seqs(
            chunk
                .spans
                .iter()
                .filter(|span| span.is_last)
                .map(|span| &items[span.item].0 .0),
        );
        for span in &chunk.spans {
            let ((cell, all), start) = items[span.item];
            let seq = cell.seq();
            for j in 0..span.len {
                let wants_logits = span.is_last && j + 1 == span.len;
                let at = span.start + j;
                tokens.push((all[at], start + at as i32, seq, wants_logits));
            }
        }
        let mut riding = Riding {
            tokens,
            whole_rows,
            rows: Vec::new(),
            outcome: None,
        };
        if !riders.is_empty() && !chunk.spans.is_empty() {
            self.riding = Some(riding);
            self.run_commits(riders);
            riding = self.riding.take().ok_or_else(|| {
                Error::Internal("a prompt chunk riding a commit was not given back".into())
            })?;
        } else if !riders.is_empty() {
            self.run_commits(riders);
        }
        if riding.waits() && !chunk.spans.is_empty() {
            // Alone (no rider, or the riders' decode was not one the chunk could ride).
            self.use_adapters(&Adapters::default())?;
            let batch = self.start_batch();
            riding.push_into(batch);
            self.shared().abort.set_running(run.run_id);
            let decoded = self.decode();
            self.shared().abort.set_running(0);
            riding.landed(self, &decoded, 0);
        }
        match riding.outcome {
            Some(outcome) => outcome.map(|()| riding.rows),
            None => Ok(Vec::new()), // an empty chunk: the riders ran alone
        }
    }

    /// One decode of the chunk in the scratch context; the prompts it finishes move to their
    /// sequences. Their rows, in order.
    fn scratch_decode(&mut self, run: &mut Run, chunk: &Chunk) -> Result<Vec<Output>> {
        let items: Vec<&PrefillItem> = Self::chunk_items(&run.items, &run.prompts)
            .into_iter()
            .map(|(it, _)| it)
            .collect();
        let seqs: Vec<Seq> = items.iter().map(|(cell, _)| cell.seq()).collect();
        let mut rows = vec![None; items.len()];
        let kind = scratch_kind(self, run, chunk);
        let starts_alone = chunk.spans.first().is_some_and(|span| span.start == 0);
        if kind == ScratchKind::Alone && starts_alone {
            // Its cells go one after the other from the first (see `scratch.rs`).
            self.empty_scratch(kind);
        }
        self.shared().abort.set_running(run.run_id);
        let decoded = self.scratch_chunk(kind, &items, &seqs, chunk, &mut run.slots, &mut rows);
        self.shared().abort.set_running(0);
        decoded?;
        Ok(chunk
            .spans
            .iter()
            .filter(|s| s.is_last)
            .filter_map(|s| rows[s.item].take())
            .collect())
    }

    /// Answer every prompt whose items are all in: its branches take their tokens and last
    /// rows. How many were answered.
    fn answer_finished(&mut self, run: &mut Run) -> usize {
        let mut answered = 0;
        for prompt in run.prompts.iter_mut().filter(|p| p.reply.is_some()) {
            let n = prompt.items.len();
            let range = prompt.first..prompt.first + n;
            if !run.progress[range.clone()].iter().all(|p| p.done == p.len) {
                continue;
            }
            for ((cell, tokens), row) in prompt.items.iter().zip(&mut run.rows[range]) {
                cell.lock().prefilled(tokens, row.take().as_ref());
                run.stepping.insert(seq_id(cell));
            }
            prompt.ticket.finish();
            if let Some(reply) = prompt.reply.take() {
                reply.send(Ok(()));
            }
            answered += n;
        }
        answered
    }

    /// Prompts whose caller asked for an abort leave: what they wrote is removed.
    fn drop_aborted(&mut self, run: &mut Run) {
        for p in 0..run.prompts.len() {
            let prompt = &run.prompts[p];
            if prompt.reply.is_none() || !prompt.ticket.abort_requested() {
                continue;
            }
            self.undo(run, p);
            let prompt = &mut run.prompts[p];
            prompt.ticket.finish();
            if let Some(reply) = prompt.reply.take() {
                reply.send(Err(Error::Cancelled("aborted and rolled back".into())));
            }
        }
    }

    /// Remove what prompt `p` wrote (and take its items out of the run's queue).
    fn undo(&mut self, run: &mut Run, p: usize) {
        let prompt = &run.prompts[p];
        for (i, (cell, _)) in prompt.items.iter().enumerate() {
            let k = prompt.first + i;
            // (A failed decode, or one whose rows could not be read, may have written
            // cells that `done` does not count yet.)
            self.truncate(cell, prompt.starts[i]);
            if let Some(seq) = run.slots.forget(k) {
                let kind = self.scratch_kind_of(run.progress[k].len);
                self.empty_scratch_seq(kind, seq);
            }
            run.progress[k].done = run.progress[k].len;
            run.rows[k] = None;
        }
    }

    /// A decode failed: the prompts not yet answered lose what they wrote and go through
    /// the packed path, which narrows the failure down to its request.
    fn fall_back(&mut self, run: &mut Run, e: Error) {
        if run.place.contains(&Place::Scratch) {
            self.empty_scratch(ScratchKind::Shared);
            self.empty_scratch(ScratchKind::Alone);
        }
        let mut again = Vec::new();
        for p in 0..run.prompts.len() {
            if run.prompts[p].reply.is_none() {
                continue;
            }
            self.undo(run, p);
            let prompt = &mut run.prompts[p];
            if let Some(reply) = prompt.reply.take() {
                again.push(PrefillRequest {
                    items: std::mem::take(&mut prompt.items),
                    reply,
                    ticket: prompt.ticket.clone(),
                });
            }
        }
        if matches!(e, Error::Closed) {
            for req in again {
                req.ticket.finish();
                req.reply.send(Err(Error::Closed));
            }
            return;
        }
        self.run_prefills(again);
    }
}

impl Worker {
    /// The next decode of the short prompts going ahead of a prompt cut into `place`
    /// ([`Worker::short_prompts`]): the other items count as done for this plan.
    fn plan_ahead(&self, run: &Run, room: ChunkRoom, place: Place) -> Chunk {
        let mut progress: Vec<Progress> = run
            .progress
            .iter()
            .map(|p| Progress {
                done: p.len,
                len: p.len,
            })
            .collect();
        for k in self.short_prompts(run, place) {
            progress[k] = run.progress[k];
        }
        plan_chunk(&progress, room)
    }

    /// The items that may go ahead of a prompt cut between two decodes, into `place`: prompts
    /// of one item (a request of several keeps its packing) with at most [`SHORT_PROMPT`]
    /// tokens left. For the main context, those placed there or continuing a sequence (which
    /// the scratch never takes), and new ones too when the prompt cut is in the main context
    /// (then it is the main context's turn); for the scratch, new prompts that start their
    /// sequence and fit the shared scratch.
    fn short_prompts<'r>(&'r self, run: &'r Run, place: Place) -> impl Iterator<Item = usize> + 'r {
        let cut_in_main = (0..run.items.len())
            .find(|&k| run.progress[k].done < run.progress[k].len)
            .is_some_and(|k| run.place[k] == Place::Main);
        (0..run.items.len()).filter(move |&k| {
            let (p, i) = run.items[k];
            let Progress { done, len } = run.progress[k];
            let continues = run.prompts[p].starts[i] > 0;
            let goes = match (place, run.place[k]) {
                (Place::Main, Place::Main) => true,
                (Place::Main, Place::Unplaced) => continues || cut_in_main,
                (Place::Scratch, Place::Unplaced) => !continues && self.fits_scratch(len),
                _ => false,
            };
            goes && done < len && len - done <= SHORT_PROMPT && run.prompts[p].items.len() == 1
        })
    }
}

/// The scratch a chunk decodes in: the one a long prompt has alone (a chunk of the scratch's
/// holds one such prompt only), else the shared one.
fn scratch_kind(w: &Worker, run: &Run, chunk: &Chunk) -> ScratchKind {
    match chunk.spans.first() {
        Some(span) => w.scratch_kind_of(run.progress[span.item].len),
        None => ScratchKind::Shared,
    }
}

fn seq_id(cell: &Arc<BranchCell>) -> u32 {
    cell.seq().id() as u32
}
