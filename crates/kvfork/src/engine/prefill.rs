//! Prefills: external tokens decoded into branches, packed into ceil(total / n_batch)
//! decodes. A gathered group of prefill requests is packed as one plan; a failure is
//! narrowed down (a cancelled member leaves, the rest run again; otherwise halves are tried)
//! so that only the request at fault fails.

use std::sync::Arc;

use kvfork_core::packer::{logits_index, plan_prefill};

use super::adapters::group_by_adapters;
use super::commit::may_be_one_request;
use super::gather::start_run;
use super::{BranchCell, PrefillItem, PrefillRequest, Worker};
use crate::error::{Error, Result};
use crate::llama_ctx::Output;
use crate::seq::Seq;

impl Worker {
    /// Run a gathered group and reply to each member.
    pub(super) fn run_prefills(&mut self, group: Vec<PrefillRequest>) {
        let results = self.guarded(group.len(), |w| {
            let mut results = vec![None; group.len()];
            // A request that cannot fit fails alone, before anything is decoded.
            let mut members = Vec::with_capacity(group.len());
            for (i, req) in group.iter().enumerate() {
                match req
                    .items
                    .iter()
                    .try_for_each(|it| w.prefill_place(it).map(drop))
                {
                    Ok(()) => members.push(i),
                    Err(e) => results[i] = Some(Err(e)),
                }
            }
            w.prefill_requests(&group, &members, &mut results);
            results
                .into_iter()
                .map(|r| {
                    r.unwrap_or_else(|| Err(Error::Internal("a prefill got no result".into())))
                })
                .collect()
        });
        for (req, result) in group.into_iter().zip(results) {
            req.ticket.finish();
            req.reply.send(result);
        }
    }

    /// Prefill `members` (indices into `group`) as one packed run; narrow a failure down.
    fn prefill_requests(
        &mut self,
        group: &[PrefillRequest],
        members: &[usize],
        results: &mut [Option<Result<()>>],
    ) {
        // Members whose caller asked for an abort before this run leave at once.
        let (gone, members): (Vec<usize>, Vec<usize>) = members
            .iter()
            .partition(|&&i| group[i].ticket.abort_requested());
        for i in gone {
            results[i] = Some(Err(Error::Cancelled("aborted and rolled back".into())));
        }
        if members.is_empty() {
            return;
        }
        let run = start_run(members.iter().map(|&i| &*group[i].ticket));
        self.shared().abort.set_running(run);
        let items: Vec<&PrefillItem> = members.iter().flat_map(|&i| &group[i].items).collect();
        let outcome = self.prefill(&items);
        self.shared().abort.set_running(0);
        match outcome {
            Ok(()) => members.iter().for_each(|&i| results[i] = Some(Ok(()))),
            Err(e) if members.len() == 1 => results[members[0]] = Some(Err(e)),
            Err(Error::Cancelled(_))
                if members.iter().any(|&i| group[i].ticket.abort_requested()) =>
            {
                // An abort asked for by some members: they leave, the others run again.
                self.prefill_requests(group, &members, results)
            }
            Err(e) if may_be_one_request(&e) => {
                let (a, b) = members.split_at(members.len() / 2);
                self.prefill_requests(group, a, results);
                self.prefill_requests(group, b, results);
            }
            Err(e) => members
                .iter()
                .for_each(|&i| results[i] = Some(Err(e.clone()))),
        }
    }

    /// The first position of an item's tokens, or why they cannot go there.
    pub(super) fn prefill_place(&self, (cell, tokens): &PrefillItem) -> Result<i32> {
        self.place(cell, tokens.len())
    }

    /// The first position of `n` tokens decoded into `cell`, or why they cannot go there.
    pub(super) fn place(&self, cell: &Arc<BranchCell>, n: usize) -> Result<i32> {
        if self.is_gone(cell) {
            return Err(Error::BranchDisposed("in prefill".into()));
        }
        let st = cell.lock();
        if st.position() as u64 + n as u64 > self.shared().n_ctx as u64 {
            return Err(Error::KvCacheFull(format!(
                "prefill of {n} tokens at position {} exceeds n_ctx = {}",
                st.position(),
                self.shared().n_ctx
            )));
        }
        Ok(st.position())
    }

    /// Decode external tokens into each branch, packed into ceil(total / n_batch) decodes
    /// (with `park`, for at most as many branches at a time as there are leases). All or
    /// nothing: on failure the KV written so far is removed and no state changes.
    pub(super) fn prefill(&mut self, items: &[&PrefillItem]) -> Result<()> {
        let mut starts = Vec::with_capacity(items.len());
        for &item in items {
            starts.push(self.prefill_place(item)?);
        }
        if self.keeps_checkpoints() && !self.parks() {
            // A recurrent state rolls back to a checkpoint: one where each prefill starts.
            for (&(cell, _), &start) in items.iter().zip(&starts) {
                self.take_checkpoint(cell, start)?;
            }
        }
        let room = if self.parks() {
            self.shared().n_seq_max as usize
        } else {
            items.len().max(1)
        };
        let mut rows: Vec<Option<Output>> = vec![None; items.len()];
        for first in (0..items.len()).step_by(room) {
            let end = (first + room).min(items.len());
            if let Err(e) = self.prefill_group(
                &items[first..end],
                &starts[first..end],
                &mut rows[first..end],
            ) {
                for (&(cell, _), &start) in items[..end].iter().zip(&starts) {
                    self.truncate(cell, start);
                }
                return Err(e);
            }
        }
        for (i, (cell, tokens)) in items.iter().copied().enumerate() {
            cell.lock().prefilled(tokens, rows[i].as_ref());
        }
        Ok(())
    }

    /// The decodes of `prefill` for branches that all hold a lease at once; each item's last
    /// logits row goes to `rows`. On failure the caller removes what was written.
    fn prefill_group(
        &mut self,
        items: &[&PrefillItem],
        starts: &[i32],
        rows: &mut [Option<Output>],
    ) -> Result<()> {
        let cells: Vec<&Arc<BranchCell>> = items.iter().map(|(cell, _)| cell).collect();
        self.give_leases(&cells)?;
        for ((cell, tokens), &start) in items.iter().copied().zip(starts) {
            self.guard_window(cell, start + tokens.len() as i32 - 1)?;
        }
        let seqs: Vec<Seq> = cells.iter().map(|cell| cell.seq()).collect();
        // Branches under different adapters are packed apart, one plan per set.
        for (set, members) in group_by_adapters(&cells) {
            let lens: Vec<usize> = members.iter().map(|&i| items[i].1.len()).collect();
            let plan = plan_prefill(&lens, self.ctx().n_batch as usize);
            // New prompts, no adapter: maybe through the scratch context (`scratch.rs`).
            let fresh = set.key().is_empty() && members.iter().all(|&i| starts[i] == 0);
            let own: Vec<&PrefillItem> = members.iter().map(|&i| items[i]).collect();
            if self.scratch_pays(&own, fresh, &plan) {
                let own_seqs: Vec<Seq> = members.iter().map(|&i| seqs[i]).collect();
                let mut own_rows = vec![None; members.len()];
                self.prefill_in_scratch(&own, &own_seqs, &plan, &mut own_rows)?;
                for (&i, row) in members.iter().zip(own_rows) {
                    rows[i] = row;
                }
                continue;
            }
            let whole_rows = self.row_seqs(members.iter().map(|&i| &items[i].0));
            for chunk in plan {
                self.use_adapters(&set)?;
                let batch = self.start_batch();
                whole_rows.iter().for_each(|&seq| batch.want_row(seq));
                for span in &chunk.spans {
                    let item = members[span.item];
                    let tokens = &items[item].1[span.start..span.start + span.len];
                    for (j, &t) in tokens.iter().enumerate() {
                        let wants_logits = span.is_last && j + 1 == span.len;
                        let pos = starts[item] + (span.start + j) as i32;
                        batch.push(t, pos, seqs[item], wants_logits);
                    }
                }
                self.decode()?;
                for (k, span) in chunk.spans.iter().enumerate() {
                    if span.is_last {
                        rows[members[span.item]] =
                            Some(self.ctx().output_ith(logits_index(&chunk, k))?.into_owned());
                    }
                }
                // Recurrent models: a checkpoint where each prompt's chunk ends, for forks
                // inside it later (`checkpoints.rs`).
                for span in &chunk.spans {
                    let item = members[span.item];
                    let end = starts[item] + (span.start + span.len) as i32;
                    self.take_checkpoint(&items[item].0, end)?;
                }
            }
        }
        Ok(())
    }
}
