//! Prefills of new prompts through a scratch context.
//!
//! In the unified KV cache, every decode's attention goes through the mask of all the cells
//! in use, those of other sequences included (llama.cpp's CPU flash attention checks each
//! entry): a burst of unrelated prompts prefills slower as the cache fills. 512-token
//! decodes took 687 ms with the cache empty and 838 ms with 3,584 cells in use (Gemma 3
//! 270M, 2 threads). A small second context of the same model holds only the prompts being
//! prefilled, so it decodes them at the empty cache's speed; each prompt's cells then move to
//! its own sequence of the main cache (`llama_state_seq_*`: ~8 ms for 265 tokens) and its
//! last logits to its branch. The KV is the same computation; only the order in which
//! attention adds up the cells may differ, as between two packings of one prefill.
//!
//! Taken only where it pays and nothing else changes: a model on the CPU (where the mask
//! scan was measured), not recurrent, prompts that start their sequence and fit one decode
//! (and the sliding window) each, no adapter, no `park`, a plan whose decodes hold at most
//! [`SCRATCH_SEQS`] prompts, a scratch of at most [`SCRATCH_MAX_CELLS`] cells (one decode and
//! one prompt), and a main cache holding two decodes' worth of cells on average over the
//! plan (what it held before, and half the plan's own tokens). A continuous prefill
//! (`continuous.rs`) also sends a longer prompt, of up to [`LONG_SCRATCH_PROMPT`] tokens, to
//! a second scratch it has alone, emptied first ([`ScratchKind::Alone`]): its cells then go
//! one after the other, so no sliding-window cell of it is handed to another token.
//! `KVFORK_NO_SCRATCH_PREFILL=1` turns it off (to compare).

use std::sync::Arc;

use kvfork_core::packer::{logits_index, Chunk as PrefillChunk};

use super::shared::Stats;
use super::{PrefillItem, Worker};
use crate::context_params::ContextParams;
use crate::error::{Error, Result};
use crate::llama_ctx::{LlamaCtx, Output};
use crate::seq::Seq;

/// Prompts the scratch context prefills at once (its sequences).
const SCRATCH_SEQS: u32 = 16;
/// The most cells a scratch context may have (beyond, its KV would cost more memory than a
/// prefill's speed is worth).
const SCRATCH_MAX_CELLS: u32 = 4096;
/// The longest prompt a continuous prefill decodes alone in a scratch (the cells of the one
/// it has alone). A server's prompts of up to ~1,000 tokens beside a full cache decoded at
/// 2.4 ms a token in it, 1.5 ms in the scratch (Gemma 3 270M, 2 threads).
pub(super) const LONG_SCRATCH_PROMPT: usize = 2048;

impl Worker {
    /// Whether `plan`, the prefill of `items` (all at position 0 of their sequences when
    /// `fresh`), goes through the scratch context.
    pub(super) fn scratch_pays(
        &self,
        items: &[&PrefillItem],
        fresh: bool,
        plan: &[PrefillChunk],
    ) -> bool {
        let longest = self.longest_scratch_prompt() as usize;
        self.scratch_pays_up_to(items, fresh, plan, longest)
    }

    /// [`Worker::scratch_pays`] for prompts of up to `longest` tokens.
    pub(super) fn scratch_pays_up_to(
        &self,
        items: &[&PrefillItem],
        fresh: bool,
        plan: &[PrefillChunk],
        longest: usize,
    ) -> bool {
        let model = &self.shared().model;
        fresh
            && self.scratch_allowed
            && model.on_cpu()
            && !model.is_recurrent()
            && !self.parks()
            && !self.shared().params.embeddings
            && self.scratch_cells() <= SCRATCH_MAX_CELLS
            && items.iter().all(|(_, tokens)| tokens.len() <= longest)
            && plan
                .iter()
                .all(|chunk| chunk.spans.len() <= SCRATCH_SEQS as usize)
            && self.cells_in_use() + plan_tokens(plan) / 2 >= 2 * self.ctx().n_batch as usize
    }

    /// The longest prompt the scratch takes: one decode, inside the sliding window
    /// (`find_slot` of an iSWA cache takes a cell whose position is a window behind its
    /// sequence's next one, and no cell of a prompt in flight may go to another's).
    fn longest_scratch_prompt(&self) -> u32 {
        match self.shared().model.n_swa() {
            0 => self.ctx().n_batch,
            n_swa => self.ctx().n_batch.min(n_swa - 1),
        }
    }

    /// Cells the scratch context needs: those of one decode, and the earlier part of the one
    /// prompt that may straddle it (shorter than the longest prompt).
    fn scratch_cells(&self) -> u32 {
        (self.ctx().n_batch + self.longest_scratch_prompt()).max(16)
    }

    /// Cells of the main cache in use before the plan, counted per sequence (shared cells
    /// more than once: an upper bound, which is all `scratch_pays` needs).
    pub(super) fn cells_in_use(&self) -> usize {
        (0..self.shared().n_seq_max)
            .filter_map(|s| self.ctx().seq_pos_max(Seq::new(s)).ok())
            .map(|max| (max + 1).max(0) as usize)
            .sum()
    }

    /// Decode `plan` (over `items`, into `seqs` of the main cache, from position 0) in the
    /// scratch context; each item's last logits row goes to `rows`, its cells to its
    /// sequence as soon as its last span is decoded (the scratch is then empty again). On
    /// failure the caller removes what reached the main cache; the scratch is emptied here.
    pub(super) fn prefill_in_scratch(
        &mut self,
        items: &[&PrefillItem],
        seqs: &[Seq],
        plan: &[PrefillChunk],
        rows: &mut [Option<Output>],
    ) -> Result<()> {
        let mut slots = ScratchSlots::new(items.len());
        let result = plan.iter().try_for_each(|chunk| {
            self.scratch_chunk(ScratchKind::Shared, items, seqs, chunk, &mut slots, rows)
        });
        if result.is_err() {
            self.empty_scratch(ScratchKind::Shared);
        }
        result
    }

    /// One decode of a prefill through the scratch context (opened first): `chunk`'s spans
    /// of `items` (at position 0 of `seqs` in the main cache); each prompt it finishes moves
    /// to its sequence, its last row to `rows`. On failure the caller empties the scratch
    /// ([`Worker::empty_scratch`]) and removes what reached the main cache.
    pub(super) fn scratch_chunk(
        &mut self,
        kind: ScratchKind,
        items: &[&PrefillItem],
        seqs: &[Seq],
        chunk: &PrefillChunk,
        slots: &mut ScratchSlots,
        rows: &mut [Option<Output>],
    ) -> Result<()> {
        self.open_scratch(kind)?;
        // The prompts this chunk finishes whose outputs must be rows (none, and no
        // allocation, without device sampling).
        let mut whole_rows = Vec::new();
        for span in chunk.spans.iter().filter(|s| s.is_last) {
            if self.wants_row(&items[span.item].0) {
                whole_rows.push(slots.seq_of(span.item)?);
            }
        }
        let batch = self.start_batch();
        whole_rows.into_iter().for_each(|seq| batch.want_row(seq));
        for span in &chunk.spans {
            let seq = slots.seq_of(span.item)?;
            let tokens = &items[span.item].1[span.start..span.start + span.len];
            for (j, &t) in tokens.iter().enumerate() {
                let wants_logits = span.is_last && j + 1 == span.len;
                batch.push(t, (span.start + j) as i32, seq, wants_logits);
            }
        }
        self.decode_in_scratch(kind)?;
        Stats::add(&self.shared().stats.scratch_tokens, chunk.n_tokens() as u64);
        for (k, span) in chunk.spans.iter().enumerate().filter(|(_, s)| s.is_last) {
            let seq = slots.give_back(span.item)?;
            let scratch = self.scratch.get(kind).expect("opened above");
            rows[span.item] = Some(scratch.output_ith(logits_index(chunk, k))?.into_owned());
            let cells = scratch.kv_state(Some(seq))?;
            scratch.clear_seq(seq)?;
            // Fails only without enough free cells, where a decode would fail alike.
            let n = span.start + span.len;
            self.ctx_mut()
                .set_kv_state(Some(seqs[span.item]), &cells)
                .map_err(|_| {
                    Error::KvCacheFull(format!(
                        "no room for the {n} cells of a prompt prefilled apart"
                    ))
                })?;
        }
        Ok(())
    }

    /// Empty one scratch sequence (a prompt in flight left).
    pub(super) fn empty_scratch_seq(&mut self, kind: ScratchKind, seq: Seq) {
        if let Some(scratch) = self.scratch.get(kind) {
            // Fails only on a closed context, which the next decode reports.
            let _ = scratch.clear_seq(seq);
        }
    }

    /// Empty the scratch context (after a failure: prompts in flight are dropped).
    pub(super) fn empty_scratch(&mut self, kind: ScratchKind) {
        if let Some(scratch) = self.scratch.get(kind) {
            scratch.clear();
        }
    }

    /// Whether a prompt of `len` tokens may go through the scratch context: one decode
    /// inside the sliding window (see [`Worker::scratch_pays`]).
    pub(super) fn fits_scratch(&self, len: usize) -> bool {
        len <= self.longest_scratch_prompt() as usize
    }

    /// The scratch a prompt of `len` tokens decodes in.
    pub(super) fn scratch_kind_of(&self, len: usize) -> ScratchKind {
        if self.fits_scratch_alone(len) {
            ScratchKind::Alone
        } else {
            ScratchKind::Shared
        }
    }

    /// Whether a prompt of `len` tokens goes through the scratch only alone (longer than
    /// [`Worker::fits_scratch`] allows beside others, at most [`LONG_SCRATCH_PROMPT`]).
    pub(super) fn fits_scratch_alone(&self, len: usize) -> bool {
        !self.fits_scratch(len) && len <= LONG_SCRATCH_PROMPT
    }

    /// A scratch context, created on first use: the main one's model, threads and cache
    /// types, [`SCRATCH_SEQS`] sequences and the cells they may hold at once (a long prompt's
    /// for the one it has alone).
    fn open_scratch(&mut self, kind: ScratchKind) -> Result<()> {
        if self.scratch.get(kind).is_some() {
            return Ok(());
        }
        let main = &self.shared().params;
        let n_ctx = match kind {
            ScratchKind::Shared => self.scratch_cells(),
            ScratchKind::Alone => LONG_SCRATCH_PROMPT as u32,
        };
        let params = ContextParams {
            n_ctx,
            n_seq_max: SCRATCH_SEQS,
            embeddings: false,
            pooling: None,
            park: false,
            ..main.clone()
        };
        let kept = self.ctx().device_kept();
        let mut scratch = LlamaCtx::keeping(Arc::clone(&self.shared().model), &params, kept)?;
        scratch.set_abort_signal(self.shared().abort.clone());
        let (single, batch) = self.threads();
        scratch.set_threads(single, batch);
        self.scratch.set(kind, scratch);
        Ok(())
    }
}

/// Which scratch context: the one prompts share (each within one decode and the window), or
/// the one a long prompt has alone (emptied first: its cells then go one after the other).
/// Two, so that the shared one keeps its few cells: its attention pays for the cells its
/// sequences have moved through (llama.cpp's slot search goes on from the last one), and
/// 2,048 cells slowed its 512-token decodes from ~650 to ~950 ms in a burst.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ScratchKind {
    Shared,
    Alone,
}

/// The scratch contexts, each created on first use.
#[derive(Default)]
pub(crate) struct Scratches {
    shared: Option<LlamaCtx>,
    alone: Option<LlamaCtx>,
}

impl Scratches {
    pub(super) fn get(&mut self, kind: ScratchKind) -> Option<&mut LlamaCtx> {
        match kind {
            ScratchKind::Shared => self.shared.as_mut(),
            ScratchKind::Alone => self.alone.as_mut(),
        }
    }

    fn set(&mut self, kind: ScratchKind, ctx: LlamaCtx) {
        match kind {
            ScratchKind::Shared => self.shared = Some(ctx),
            ScratchKind::Alone => self.alone = Some(ctx),
        }
    }

    /// Those created so far.
    pub(super) fn opened(&mut self) -> impl Iterator<Item = &mut LlamaCtx> {
        self.shared.iter_mut().chain(self.alone.iter_mut())
    }
}

/// The scratch sequence of each prompt while its tokens are in flight (`item`: the prompt's
/// index, as in the chunks' spans).
pub(super) struct ScratchSlots {
    lent: Vec<Option<Seq>>,
    free: Vec<Seq>,
}

impl ScratchSlots {
    /// Slots for `n` prompts (more may be added: [`ScratchSlots::grow`]).
    pub(super) fn new(n: usize) -> Self {
        ScratchSlots {
            lent: vec![None; n],
            free: (0..SCRATCH_SEQS).rev().map(Seq::new).collect(),
        }
    }

    /// Room for prompts up to index `n - 1`.
    pub(super) fn grow(&mut self, n: usize) {
        if self.lent.len() < n {
            self.lent.resize(n, None);
        }
    }

    /// The sequence `item` decodes into (lent on its first span).
    fn seq_of(&mut self, item: usize) -> Result<Seq> {
        if let Some(seq) = self.lent[item] {
            return Ok(seq);
        }
        let seq = self
            .free
            .pop()
            .ok_or_else(|| Error::Internal("no free scratch sequence".into()))?;
        self.lent[item] = Some(seq);
        Ok(seq)
    }

    /// `item` left before its last span (aborted): its sequence, if it had one, free again
    /// (its cells are the caller's to empty).
    pub(super) fn forget(&mut self, item: usize) -> Option<Seq> {
        let seq = self.lent.get_mut(item)?.take()?;
        self.free.push(seq);
        Some(seq)
    }

    /// `item`'s last span is decoded: its sequence, free again.
    fn give_back(&mut self, item: usize) -> Result<Seq> {
        let seq = self.lent[item]
            .take()
            .ok_or_else(|| Error::Internal("a scratch prompt without a sequence".into()))?;
        self.free.push(seq);
        Ok(seq)
    }
}

/// Prompts a scratch decode may hold at once.
pub(super) const SCRATCH_SPANS: usize = SCRATCH_SEQS as usize;

fn plan_tokens(plan: &[PrefillChunk]) -> usize {
    plan.iter().map(PrefillChunk::n_tokens).sum()
}
