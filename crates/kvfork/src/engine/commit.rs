//! Commits: accept first, then decode one token per branch; a failed decode is rolled back.
//! A gathered group shares its decode, and a failure is narrowed down to the request at
//! fault by halving the group, so one caller's bad branch never fails its neighbours.
//!
//! Generation steps (`Branch::step`, `BranchStore::step`) take the same path: their tokens
//! are sampled first (`sample_steps`), then committed with the rest of the group.

use std::borrow::Cow;
use std::sync::{Arc, MutexGuard};
use std::time::Instant;

use super::adapters::group_by_adapters;
use super::continuous::Riding;
use super::landing::{Landing, Queued};
use super::parallel;
use super::shared::{BranchCell, Stats};
use super::summaries;
use super::{CommitItem, CommitRequest, Worker};
use crate::adapter::Adapters;
use crate::branch_state::{BranchState, Snapshot};
use crate::error::{Error, Result};
use crate::llama_ctx::Output;
use crate::produced::Produced;
use crate::sampling::chain::Draws;
use crate::seq::Seq;

/// Whether a failure of a shared decode may be the fault of one request in it (then the
/// others are tried again without it). A closed context, an abort or a bug concern all.
pub(super) fn may_be_one_request(e: &Error) -> bool {
    !matches!(e, Error::Closed | Error::Cancelled(_) | Error::Internal(_))
}

/// A step's branches and their draws before it sampled them.
type StepDraws = Vec<(Arc<BranchCell>, Draws)>;

/// A cell sampled: its token, and its draws before (taken under the same lock; None when it
/// was not sampled), which a step that fails undoes.
struct Drawn {
    produced: Result<Produced>,
    before: Option<Draws>,
}

impl Drawn {
    fn refused(e: Error) -> Self {
        Drawn {
            produced: Err(e),
            before: None,
        }
    }
}

/// `e`, naming the branch it concerns when its request has several (a store's commit or
/// step): whose grammar, bias or chain refused.
fn naming_branch(e: Error, cell: &BranchCell, several: bool) -> Error {
    let Some(handle) = cell.handle().filter(|_| several) else {
        return e;
    };
    let named = |m: String| format!("branch handle={}: {m}", handle.to_u64());
    match e {
        Error::Grammar(m) => Error::Grammar(named(m)),
        Error::Other(m) => Error::Other(named(m)),
        e => e,
    }
}

/// Undo a failed step's draws.
fn rewind(draws: &StepDraws) {
    for (cell, before) in draws {
        cell.lock().rewind_draws(*before);
    }
}

impl Worker {
    /// A `produce`: sample now and reply (nothing to decode).
    pub(super) fn answer_sample(&mut self, req: CommitRequest) {
        let cell = req.items[0].0.clone();
        let mut result = self.guarded(1, |w| vec![w.sample_cells(&[cell]).remove(0).produced]);
        req.ticket.finish();
        req.reply.send(result.remove(0).map(|p| vec![p]));
    }

    /// One decode for every request of the group (more when a failure must be narrowed
    /// down); each request succeeds or fails as a whole.
    ///
    /// The replies may go before the decode's outputs are read (`landing.rs`): the group
    /// lands after them, before anything else.
    pub(super) fn run_commits(&mut self, mut group: Vec<CommitRequest>) {
        let started = Instant::now();
        let early = self.replies_early;
        let results = self.guarded(group.len(), |w| w.commit_group(&mut group, early));
        // Counted before the replies: a caller reading the stats after its step sees it.
        let elapsed = started.elapsed().as_nanos() as u64;
        Stats::add(&self.shared().stats.commit_ns, elapsed);
        for (req, result) in group.into_iter().zip(results) {
            req.ticket.finish();
            req.reply.send(result);
        }
        self.land();
    }

    /// Sample the tokens of generation steps, accept every request (a failing one alone is
    /// refused), then decode all that remain. Each request's result holds the tokens its
    /// steps sampled (none for a plain commit). (A `produce` never gets here: it is answered
    /// on arrival.) `early`: its decode may be queued, its rows read after the replies.
    fn commit_group(
        &mut self,
        group: &mut [CommitRequest],
        early: bool,
    ) -> Vec<Result<Vec<Produced>>> {
        let mut results: Vec<Result<Vec<Produced>>> = vec![Ok(Vec::new()); group.len()];
        let draws = self.sample_steps(group, &mut results);
        let mut accepted: Vec<(usize, Vec<Snapshot>)> = Vec::with_capacity(group.len());
        for (i, req) in group.iter().enumerate() {
            if req.items.is_empty() {
                continue;
            }
            Stats::add(&self.shared().stats.commit_requests, 1);
            match self.accept_all(&req.items) {
                Ok(snaps) => accepted.push((i, snaps)),
                Err(e) => results[i] = Err(e),
            }
        }
        let members: Vec<usize> = accepted.iter().map(|(i, _)| *i).collect();
        let mut failed = Vec::new();
        self.decode_requests(group, &members, &mut failed, early);
        for (i, snaps) in accepted {
            if let Some((_, e)) = failed.iter().find(|(f, _)| *f == i) {
                restore(&group[i].items, snaps);
                if let Some(draws) = &draws[i] {
                    rewind(draws);
                }
                results[i] = Err(e.clone());
            }
        }
        results
    }

    /// Sample the branches of every step in the group at once (across the cores when it pays).
    /// A step's tokens become its items, except stop tokens: reported, not committed. A step
    /// with a branch that cannot be sampled fails whole (its first error) and commits nothing,
    /// its branches' draws undone. Returns each step's draws before sampling (by index into
    /// `group`), to undo should its decode fail.
    fn sample_steps(
        &mut self,
        group: &mut [CommitRequest],
        results: &mut [Result<Vec<Produced>>],
    ) -> Vec<Option<StepDraws>> {
        let mut draws: Vec<Option<StepDraws>> = vec![None; group.len()];
        let steps: Vec<usize> = (0..group.len())
            .filter(|&i| group[i].reply.is_sampled())
            .collect();
        if steps.is_empty() {
            return draws;
        }
        let cells: Vec<Arc<BranchCell>> = steps
            .iter()
            .flat_map(|&i| group[i].items.iter().map(|(cell, _)| cell.clone()))
            .collect();
        let mut sampled = self.sample_cells(&cells).into_iter();
        for i in steps {
            let items = &mut group[i].items;
            let mut step_draws = StepDraws::with_capacity(items.len());
            let mut produced = Vec::with_capacity(items.len());
            let mut failed = None;
            let several = items.len() > 1;
            for ((cell, _), drawn) in items.iter().zip(sampled.by_ref()) {
                if let Some(before) = drawn.before {
                    step_draws.push((cell.clone(), before));
                }
                match drawn.produced {
                    Ok(p) => produced.push(p),
                    Err(e) => {
                        failed.get_or_insert_with(|| naming_branch(e, cell, several));
                    }
                }
            }
            if let Some(e) = failed {
                // Its seeded branches draw next what they would have drawn without it.
                rewind(&step_draws);
                items.clear();
                results[i] = Err(e);
                continue;
            }
            let mut drawn = produced.iter();
            items.retain_mut(|(_, token)| {
                let p = drawn.next().expect("one token per item");
                *token = p.token;
                !p.is_stop
            });
            results[i] = Ok(produced);
            draws[i] = Some(step_draws);
        }
        draws
    }

    /// Decode the items of `members` (indices into `group`) together; when that fails and
    /// the failure may be one request's, each half again. Records `(index, error)` of those
    /// that still fail. `early`: the decode may be queued (`decode_items`); the halves'
    /// are not.
    fn decode_requests(
        &mut self,
        group: &[CommitRequest],
        members: &[usize],
        failed: &mut Vec<(usize, Error)>,
        early: bool,
    ) {
        let items: Vec<&CommitItem> = members.iter().flat_map(|&i| &group[i].items).collect();
        match self.decode_items(&items, early) {
            Ok(()) => {}
            Err(e) if members.len() > 1 && may_be_one_request(&e) => {
                let (a, b) = members.split_at(members.len() / 2);
                self.decode_requests(group, a, failed, false);
                self.decode_requests(group, b, failed, false);
            }
            Err(e) => failed.extend(members.iter().map(|&i| (i, e.clone()))),
        }
    }

    /// Sample each cell (across the cores when a grammar or a full-vocabulary chain makes it
    /// pay); nothing is accepted. A cell whose chain needs the row the device kept gets it
    /// first (`refresh.rs`).
    fn sample_cells(&mut self, cells: &[Arc<BranchCell>]) -> Vec<Drawn> {
        let refused = self.refresh_rows(cells);
        let model = self.shared().model.clone();
        // Empty (no allocation) unless a cell is disposed, as `refused`.
        let gone: Vec<bool> = if cells.iter().any(|cell| cell.is_disposed()) {
            cells.iter().map(|cell| self.is_gone(cell)).collect()
        } else {
            Vec::new()
        };
        let sample = |i: usize| -> Drawn {
            if gone.get(i) == Some(&true) {
                return Drawn::refused(Error::BranchDisposed("in step".into()));
            }
            if let Some(Some(e)) = refused.get(i) {
                return Drawn::refused(e.clone());
            }
            let mut st = cells[i].lock();
            let before = st.draws();
            Drawn {
                produced: st.produce(&model),
                before: Some(before),
            }
        };
        let heavy = cells.len() > 1 && cells.iter().any(|c| c.lock().sampling_is_heavy());
        if heavy {
            let indices: Vec<usize> = (0..cells.len()).collect();
            parallel::map_parallel(&indices, |&i| sample(i))
        } else {
            (0..cells.len()).map(sample).collect()
        }
    }

    /// Accept every token (snapshotting first); on any failure undo this request's accepts.
    fn accept_all(&mut self, items: &[CommitItem]) -> Result<Vec<Snapshot>> {
        let mut snaps = Vec::with_capacity(items.len());
        let model = self.shared().model.clone();
        for (i, (cell, token)) in items.iter().enumerate() {
            if let Err(e) = self.refresh_for_commit(cell, *token) {
                restore(&items[..i], snaps);
                return Err(e);
            }
            let outcome = (|| {
                if self.is_gone(cell) {
                    return Err(Error::BranchDisposed("in commit".into()));
                }
                let mut st = cell.lock();
                if st.position() as u32 >= self.shared().n_ctx {
                    return Err(Error::KvCacheFull(format!(
                        "position {} reached n_ctx = {}",
                        st.position(),
                        self.shared().n_ctx
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
                    return Err(naming_branch(e, cell, items.len() > 1));
                }
            }
        }
        Ok(snaps)
    }

    /// Decode one token per item, in ceil(N / n_batch) decodes that form one rollback unit;
    /// on success store logits and advance positions.
    ///
    /// The members' snapshots keep the rows they borrowed from llama.cpp's output buffer
    /// through the decode (in flight: row reads wait for the landing, other calls do not), and
    /// their new rows are lent too instead of copied (see `loans.rs`).
    ///
    /// `early`: when the items go in one decode and no prefill's chunk rides it (the chunk's
    /// row is read at once), the decode is queued and its rows land after the replies
    /// (`landing.rs`).
    fn decode_items(&mut self, items: &[&CommitItem], early: bool) -> Result<()> {
        self.land();
        if items.is_empty() {
            return Ok(());
        }
        let cells: Vec<&Arc<BranchCell>> = items.iter().map(|(cell, _)| cell).collect();
        if (1..cells.len()).any(|i| cells[..i].iter().any(|c| Arc::ptr_eq(c, cells[i]))) {
            // Gathering and the store refuse this; one row cannot take two.
            return Err(Error::Internal(
                "a branch appears twice in one decode".into(),
            ));
        }
        // Branches under different adapters decode apart: the items in one run per set.
        let groups = group_by_adapters(&cells);
        let (items, sets): (Cow<'_, [&CommitItem]>, Vec<(Adapters, usize)>) = if groups.len() == 1 {
            let (set, _) = groups.into_iter().next().expect("one group");
            (Cow::Borrowed(items), vec![(set, items.len())])
        } else {
            let mut ordered = Vec::with_capacity(items.len());
            let mut sets = Vec::with_capacity(groups.len());
            for (set, members) in groups {
                sets.push((set, members.len()));
                ordered.extend(members.iter().map(|&i| items[i]));
            }
            (Cow::Owned(ordered), sets)
        };
        let items = &items[..];
        let cells: Vec<&Arc<BranchCell>> = items.iter().map(|(cell, _)| cell).collect();
        self.loans().give_back_except(&cells);
        // One decode of at most n_seq_max outputs: llama.cpp neither moves its output buffer
        // nor writes it unless the decode succeeds, so the members' loans survive a failure.
        // (With `park`, a decode holds at most as many branches as there are leases.)
        let one_decode = sets.len() == 1
            && items.len() <= self.decode_room()
            && items.len() <= self.ctx().n_seq_max as usize;
        let queue = early && one_decode && !self.riding.as_ref().is_some_and(Riding::waits);
        let places: Vec<i32> = cells
            .iter()
            .map(|cell| {
                let mut st = cell.lock();
                if !one_decode {
                    st.give_back_row();
                }
                st.take_off_row();
                st.position()
            })
            .collect();
        let decoded = self.decode_places(items, &places, &sets, !one_decode, queue);
        if let Ok((_, Some(queued))) = decoded {
            self.await_landing(items, &cells, queued);
            return Ok(());
        }
        let decoded = decoded.map(|(kept, _)| kept);
        let mut states: Vec<MutexGuard<'_, BranchState>> = cells.iter().map(|c| c.lock()).collect();
        let landed = match decoded {
            Ok(kept) if kept.is_empty() => self.lend_rows(&mut states),
            Ok(kept) => {
                // Each row copied and summarized (1 MiB and ~0.2 ms for Gemma 3's): across
                // the team, as `lend_rows` does with rows it lends.
                let mut work: Vec<(&mut BranchState, &Output)> =
                    states.iter_mut().map(|st| &mut **st).zip(&kept).collect();
                parallel::for_each_mut(&mut work, self.team_threads(), |(st, output)| {
                    st.set_output(output.as_ref());
                });
                Ok(())
            }
            Err(e) => Err(e),
        };
        for st in &mut states {
            st.land_row();
        }
        if landed.is_ok() {
            for (st, (_, token)) in states.iter_mut().zip(items) {
                st.decoded(&[*token]);
            }
        }
        drop(states);
        self.loans().held_by(&cells);
        self.shared().rows_landed.land();
        landed
    }

    /// After `decode_items`'s one decode, queued (`queued`): positions and histories advance
    /// now, the rows land after the replies (`landing.rs`).
    fn await_landing(&mut self, items: &[&CommitItem], cells: &[&Arc<BranchCell>], queued: Queued) {
        for (cell, (_, token)) in cells.iter().zip(items) {
            let mut st = cell.lock();
            st.hold_row();
            st.decoded(&[*token]);
        }
        let members = cells.iter().map(|&c| Arc::clone(c)).collect();
        self.landing = Some(Landing::new(members, queued));
    }

    /// The decodes of `decode_items`: one run per adapter set (`sets`: each set and how many
    /// items in a row use it), at most `decode_room` items a decode (admitted first: with
    /// `park` a later decode may park an earlier one's branches), one rollback unit. With
    /// `copy_rows` every row is copied aside (more than one decode); otherwise the rows stay
    /// in the output buffer. With `queue` (one decode, no rows copied), the decode returns
    /// once queued: when it was queued and the tokens it held come back beside the rows.
    fn decode_places(
        &mut self,
        items: &[&CommitItem],
        places: &[i32],
        sets: &[(Adapters, usize)],
        copy_rows: bool,
        queue: bool,
    ) -> Result<(Vec<Output>, Option<Queued>)> {
        let mut queued = None;
        let room = self.decode_room();
        let base = self.ctx().output_base();
        let mut kept: Vec<Output> = Vec::new();
        let mut chunks = Vec::new();
        let mut first = 0;
        for (set, n) in sets {
            for start in (first..first + n).step_by(room) {
                chunks.push((set, start, (start + room).min(first + n)));
            }
            first += n;
        }
        // A continuous prefill's next chunk rides a commit that is one decode (`continuous.rs`).
        // Taken only while it waits: once landed (a failed decode that the commit path then
        // narrows down decodes its halves here again), it stays for `main_decode` to read.
        let rides = chunks.len() == 1 && !copy_rows && sets[0].0.key().is_empty();
        let mut riding = if rides && self.riding.as_ref().is_some_and(Riding::waits) {
            self.riding.take()
        } else {
            None
        };
        for (set, start, end) in chunks {
            let group: Vec<&Arc<BranchCell>> =
                items[start..end].iter().map(|(cell, _)| cell).collect();
            let admitted = self.give_leases(&group).and_then(|_| {
                group
                    .iter()
                    .zip(&places[start..end])
                    .try_for_each(|(cell, &pos)| self.guard_window(cell, pos))
            });
            let decoded = admitted
                .and_then(|()| self.use_adapters(set))
                .and_then(|()| {
                    let seqs: Vec<Seq> = group.iter().map(|cell| cell.seq()).collect();
                    let rows = self.row_seqs(group.iter().copied());
                    let batch = self.start_batch();
                    for ((seq, &pos), (_, token)) in
                        seqs.iter().zip(&places[start..end]).zip(&items[start..end])
                    {
                        batch.push(*token, pos, *seq, true);
                    }
                    rows.into_iter().for_each(|seq| batch.want_row(seq));
                    if let Some(riding) = &riding {
                        riding.push_into(batch);
                    }
                    if queue {
                        queued = Some(self.decode_batch_queued()?);
                        Ok(())
                    } else {
                        self.decode_batch()
                    }
                });
            if let Some(mut riding) = riding.take() {
                riding.landed(self, &decoded, end - start);
                self.riding = Some(riding);
            }
            if let Err(e) = decoded {
                // llama.cpp removed this decode's cells; remove those of the earlier ones.
                for ((cell, _), &pos) in items[..start].iter().zip(places) {
                    self.truncate(cell, pos);
                }
                if self.ctx().output_base() != base {
                    // Never expected (see `loans.rs`); the old rows are gone, never read them.
                    for (cell, _) in items {
                        cell.lock().forget_row_loan();
                    }
                }
                return Err(e);
            }
            if copy_rows {
                for k in 0..end - start {
                    kept.push(self.ctx().output_ith(k)?.into_owned());
                }
            }
        }
        Ok((kept, queued))
    }

    /// Lend each member its row of the decode just run (`states[i]` made output `i`), summaries
    /// computed on the decode's own thread team.
    pub(super) fn lend_rows(&self, states: &mut [MutexGuard<'_, BranchState>]) -> Result<()> {
        let outputs = self.ctx().leading_outputs(states.len())?;
        let mut states: Vec<&mut BranchState> = states.iter_mut().map(|st| &mut **st).collect();
        // SAFETY: each row is in llama.cpp's output buffer, which only a decode rewrites or
        // moves. Before every decode the worker gives back each loan except those of a
        // commit's members, which are in flight (never read) until the decode lands
        // (`loans.rs`); `decode_items` records these cells as the holders right after.
        unsafe { summaries::lend(&mut states, outputs, self.team_threads()) };
        Ok(())
    }
}

fn restore(items: &[CommitItem], snaps: Vec<Snapshot>) {
    for ((cell, _), snap) in items.iter().zip(snaps) {
        cell.lock().restore(snap);
    }
}
