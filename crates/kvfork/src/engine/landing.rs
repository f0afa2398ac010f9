//! A step's replies before its decode's outputs: where the rows a commit decodes are read
//! only after its callers have their answers.
//!
//! A commit's replies hold the tokens sampled *before* its decode (and errors found by the
//! time the decode was queued), never the decode's outputs. On a GPU `llama_decode` returns
//! once the graph is queued, so the commit replies then, and the engine waits for the
//! outputs, lends the rows and summarizes them (`summaries.rs`) while the caller takes its
//! answer and sends the next step: the hand-over, Python and the engine's bookkeeping run
//! beside the device instead of after it. On the CPU the decode is done when it returns, and
//! only the summaries move after the replies.
//!
//! Until the landing, each member's snapshot is in flight: a call that reads a row waits for
//! it (`Branch::with_row`); calls that read other state (the position, the history, the
//! perplexity, all up to date before the replies) do not. The engine lands before its next
//! job or decode (`Worker::run_commits`, `decode_items`), so no other job ever sees a
//! landing pending. `KVFORK_LAND_BEFORE_REPLY` set: commits land before they reply.

use std::sync::{Arc, MutexGuard};
use std::time::Instant;

use super::shared::{BranchCell, Stats};
use super::Worker;
use crate::branch_state::BranchState;

/// When a queued decode was queued, and the tokens it held (padding included).
pub(super) type Queued = (Instant, usize);

/// A commit decode, queued, whose members' rows are still to be read.
pub(crate) struct Landing {
    /// The members, in the order of their outputs.
    cells: Vec<Arc<BranchCell>>,
    /// When the decode was queued, and the tokens it held (padding included).
    queued: Queued,
}

impl Landing {
    pub(super) fn new(cells: Vec<Arc<BranchCell>>, queued: Queued) -> Self {
        Landing { cells, queued }
    }
}

impl Worker {
    /// Wait for the queued commit decode's outputs, if one is pending, and lend its members
    /// their rows (`commit.rs`'s `lend_rows`); readers waiting for a row go on.
    pub(super) fn land(&mut self) {
        let Some(landing) = self.landing.take() else {
            return;
        };
        let started = Instant::now();
        self.ctx_mut().wait_for_outputs();
        let waited = started.elapsed();
        let (queued_at, tokens) = landing.queued;
        self.queued_decode_took(queued_at.elapsed(), tokens);
        let mut states: Vec<MutexGuard<'_, BranchState>> =
            landing.cells.iter().map(|c| c.lock()).collect();
        if self.lend_rows(&mut states).is_err() {
            // Never expected after a decode that succeeded. The new rows cannot be read and
            // the old ones are stale (or gone): no row at all, so that the next sample of
            // these branches fails rather than draw from the row before this decode.
            for st in &mut states {
                st.forget_logits();
            }
        }
        // Counted before the rows are readable: a caller that read one sees it in the stats.
        // The wait is the decode's, as where a decode waits for its outputs itself.
        let stats = &self.shared().stats;
        Stats::add(&stats.decode_ns, waited.as_nanos() as u64);
        Stats::add(&stats.commit_ns, started.elapsed().as_nanos() as u64);
        for st in &mut states {
            st.land_row();
        }
        drop(states);
        let cells: Vec<&Arc<BranchCell>> = landing.cells.iter().collect();
        self.loans().held_by(&cells);
        self.shared().rows_landed.land();
    }
}
