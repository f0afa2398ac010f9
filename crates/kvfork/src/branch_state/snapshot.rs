//! A branch's logits snapshot: the row of its last decode with its log-partition, argmax and
//! (when the branch's sampler wants them) its best logits, computed in one pass.
//!
//! After a commit the row is *lent*: it stays in llama.cpp's output buffer, where the decode
//! wrote it, until the next decode (see `engine/loans.rs`); otherwise it is *owned*, a buffer
//! shared with forks until either side takes a new row (a fork copies no row). While a decode
//! of the branch runs, a lent row is *in flight*: not readable until the engine lands it.

use std::ptr::NonNull;
use std::sync::Arc;

use kvfork_core::metrics::{self, RowSummary};

use crate::error::{Error, Result};
use crate::llama_ctx::{Output, OutputRef};
use crate::model::Token;
use crate::sampling::device::Drawn;

#[derive(Clone)]
enum Row {
    Empty,
    Owned(Arc<[f32]>),
    Lent(LentRow),
    /// Device sampling: no row, only what the device drew from it (`sampling/device.rs`).
    Drawn(Drawn),
}

/// Why a device-sampled branch has no row to read.
const NO_ROW_ON_DEVICE: &str = "this output was drawn on the device \
    (create_context(device_sampling=True)): the logits row of this output stayed there, and \
    only its best logits (64, or KVFORK_DEVICE_CANDIDATES) and its log-partition came back. \
    A branch's row is decoded again \
    when it is read (and the branch gets rows from then on), except with n_seq_max 256 (no \
    spare sequence) and for a draw captured before the branch decoded anything (a \
    destroyed branch's); create the context with device_sampling=False to read rows there";

/// Why a branch whose chain came to need the row cannot draw from a device's output.
const DRAWN_BEFORE_NEEDED: &str = "this output was drawn on the device \
    (create_context(device_sampling=True)) before the branch's chain needed its whole row \
    (a grammar, logit bias, steer, or a sampler that draws from more than the device keeps). \
    sample(), produce(), step() and BranchStore.step decode the last token again for it, \
    except with n_seq_max 256 (no spare sequence to decode on): set those before the prefill \
    or step whose output the branch samples";

/// A row of llama.cpp's output buffer.
#[derive(Clone, Copy)]
struct LentRow {
    ptr: NonNull<f32>,
    len: usize,
}

// SAFETY: a `LentRow` is only read through `&LogitsSnapshot` while not in flight, and the
// engine's loan protocol (the `# Safety` of `LogitsSnapshot::lend`) keeps the memory valid, and
// unwritten while it is not in flight, whichever thread reads it.
unsafe impl Send for LentRow {}
// SAFETY: as for `Send`: shared reads of memory nobody writes during the loan.
unsafe impl Sync for LentRow {}

#[derive(Clone)]
pub(crate) struct LogitsSnapshot {
    row: Row,
    /// Bumped on every new row.
    version: u64,
    /// Log-partition and argmax of the row (valid while a row is present).
    summary: RowSummary,
    /// The row's best `top_k` finite logits, best first (see `metrics::top_k_sorted`).
    top: Vec<u32>,
    top_k: usize,
    /// A decode is rewriting llama.cpp's output buffer while this lent row waits for its
    /// successor: nobody reads it (`row` is `None`) until the engine lands the decode.
    in_flight: bool,
}

impl LogitsSnapshot {
    pub fn empty() -> Self {
        LogitsSnapshot {
            row: Row::Empty,
            version: 0,
            summary: RowSummary {
                log_sum_exp: f64::NEG_INFINITY,
                argmax: 0,
            },
            top: Vec::new(),
            top_k: 0,
            in_flight: false,
        }
    }

    pub fn row(&self) -> Option<&[f32]> {
        if self.in_flight {
            return None;
        }
        match &self.row {
            Row::Empty | Row::Drawn(_) => None,
            Row::Owned(row) => Some(row),
            // SAFETY: a lent row not in flight is valid and unwritten (the contract of `lend`),
            // and `&self` keeps the snapshot from changing meanwhile.
            Row::Lent(r) => Some(unsafe { std::slice::from_raw_parts(r.ptr.as_ptr(), r.len) }),
        }
    }

    /// The row as a buffer of its own (copied out of llama.cpp's output buffer if lent), for
    /// a caller that keeps it past the branch lock.
    pub fn shared(&mut self) -> Option<Arc<[f32]>> {
        self.give_back();
        match &self.row {
            Row::Owned(row) => Some(row.clone()),
            _ => None,
        }
    }

    pub fn require(&self) -> Result<&[f32]> {
        self.refuse_drawn()?;
        self.row().ok_or_else(Self::no_logits_yet)
    }

    /// Whether there is an output at all: a row, or what the device drew from one.
    pub fn has_output(&self) -> bool {
        !matches!(self.row, Row::Empty)
    }

    /// What a reader of a branch with no output yet gets.
    pub fn no_logits_yet() -> Error {
        Error::Other("the branch has no logits yet: prefill or commit a token first".into())
    }

    /// An error when the last output was drawn on the device: there is no row to read.
    pub fn refuse_drawn(&self) -> Result<()> {
        match self.row {
            Row::Drawn(_) => Err(Self::no_row_on_device()),
            _ => Ok(()),
        }
    }

    /// What a reader of a row that stayed on the device gets.
    pub fn no_row_on_device() -> Error {
        Error::Other(NO_ROW_ON_DEVICE.into())
    }

    /// What a branch whose chain needs the row gets from an output drawn on the device.
    pub fn drawn_before_needed() -> Error {
        Error::Other(DRAWN_BEFORE_NEEDED.into())
    }

    /// What the device kept, when the last output was sampled there (no row).
    pub fn drawn(&self) -> Option<&Drawn> {
        match &self.row {
            Row::Drawn(d) => Some(d),
            _ => None,
        }
    }

    /// Take a decode's output: a row (copied) or a device draw.
    pub fn set_output(&mut self, output: OutputRef<'_>) {
        match output {
            OutputRef::Row(row) => self.set(row),
            OutputRef::Drawn(d) => self.set_drawn(d),
        }
    }

    /// The last output as one of its own (a row copied), None before any.
    pub fn output(&self) -> Option<Output> {
        match &self.row {
            Row::Drawn(d) => Some(Output::Drawn(d.clone())),
            _ => self.row().map(|row| Output::Row(row.to_vec())),
        }
    }

    /// Take what the device kept of a new row (its candidates: no `top` list to keep).
    fn set_drawn(&mut self, d: Drawn) {
        self.summary = RowSummary {
            log_sum_exp: d.log_sum_exp,
            argmax: d.token() as usize,
        };
        self.top.clear();
        self.top_k = 0;
        self.row = Row::Drawn(d);
        self.in_flight = false;
        self.version += 1;
    }

    pub fn version(&self) -> u64 {
        self.version
    }

    /// The best raw token (valid once a row is present).
    pub fn argmax(&self) -> usize {
        self.summary.argmax
    }

    /// Whether the row lives in llama.cpp's output buffer.
    pub fn is_lent(&self) -> bool {
        matches!(self.row, Row::Lent(_))
    }

    /// Whether a decode is rewriting the buffer this row lives in (see `in_flight`).
    pub fn is_in_flight(&self) -> bool {
        self.in_flight
    }

    /// A decode of this branch is about to rewrite llama.cpp's output buffer: a lent row is
    /// not to be read until `land`.
    pub fn take_off(&mut self) {
        self.in_flight = self.is_lent();
    }

    /// A decode of this branch was queued and its caller answered before its outputs are
    /// read (`engine/landing.rs`): no row, lent or not, is to be read until `land` (the
    /// branch's new row is coming).
    pub fn hold(&mut self) {
        self.in_flight = true;
    }

    /// The decode is over: the row (a new one, or the old one of a failed decode, which
    /// llama.cpp leaves in place) may be read again.
    pub fn land(&mut self) {
        self.in_flight = false;
    }

    /// Take a new row, copying it.
    pub fn set(&mut self, row: &[f32]) {
        let own = match &mut self.row {
            Row::Owned(own) => Arc::get_mut(own).filter(|own| own.len() == row.len()),
            _ => None,
        };
        let own = match own {
            Some(own) => own,
            // Shared with a fork, lent or first use: start a buffer of our own.
            None => {
                self.row = Row::Owned(Arc::from(vec![0.0; row.len()]));
                match &mut self.row {
                    Row::Owned(own) => Arc::get_mut(own).expect("a fresh Arc is unique"),
                    _ => unreachable!("just set"),
                }
            }
        };
        self.summary = metrics::copy_and_summarize(row, own);
        self.top.clear();
        self.top_k = 0;
        self.in_flight = false;
        self.version += 1;
    }

    /// Take a new row without copying it: read it where llama.cpp wrote it, with its summary
    /// and its best `top_k` logits for the sampler (`top`, best first), found by the engine
    /// (`engine/summaries.rs`).
    ///
    /// # Safety
    /// `row` must stay valid, and unwritten while this snapshot is not in flight, until this
    /// snapshot (or a clone of it) gives it back (`give_back`), takes another row, or is
    /// dropped. The engine keeps this by giving back every loan before a decode, except those
    /// of the decode's own members, which are in flight until it lands (`engine/loans.rs`).
    pub unsafe fn lend(&mut self, row: &[f32], top_k: usize, summary: RowSummary, top: Vec<u32>) {
        self.summary = summary;
        self.top = top;
        self.top_k = top_k;
        self.row = Row::Lent(LentRow {
            ptr: NonNull::from(row).cast(),
            len: row.len(),
        });
        self.in_flight = false;
        self.version += 1;
    }

    /// A lent row becomes a buffer of its own (a copy); nothing else changes.
    pub fn give_back(&mut self) {
        // In flight only when a panic left a decode unlanded; no decode runs now.
        self.in_flight = false;
        if let Row::Lent(r) = self.row {
            // SAFETY: the loan is still valid (the contract of `lend`): it is being given back.
            let row = unsafe { std::slice::from_raw_parts(r.ptr.as_ptr(), r.len) };
            self.row = Row::Owned(Arc::from(row));
        }
    }

    /// Forget the row, whatever it is (the sequence it was read from is gone): no logits
    /// until the next decode.
    pub fn forget(&mut self) {
        let version = self.version + 1;
        *self = LogitsSnapshot::empty();
        self.version = version;
    }

    /// Forget a lent row that is no longer valid (llama.cpp moved its output buffer): the
    /// branch has no logits until its next decode.
    pub fn forget_loan(&mut self) {
        self.in_flight = false;
        if self.is_lent() {
            self.row = Row::Empty;
            self.version += 1;
        }
    }

    /// The indices of the `k` best finite logits, best first, in `out` (from the summary pass
    /// when it kept enough of them; none without a row).
    pub fn best(&self, k: usize, out: &mut Vec<u32>) {
        out.clear();
        let Some(row) = self.row() else { return };
        if k <= self.top_k {
            out.extend_from_slice(&self.top[..k.min(self.top.len())]);
        } else {
            metrics::top_k_sorted(row, k.min(row.len()), out);
        }
    }

    /// Model-level surprisal of `token` in nats (after a device draw: of its candidates only).
    pub fn surprisal(&self, token: Token) -> Result<f64> {
        if let Row::Drawn(d) = &self.row {
            let logit = d.logit_of(token).ok_or_else(|| {
                Error::Other(format!(
                    "token {token} is not among the {} best of the row, and its probability \
                     is unknown: {NO_ROW_ON_DEVICE}",
                    d.best.len()
                ))
            })?;
            return Ok(d.log_sum_exp - f64::from(logit));
        }
        let logit = f64::from(self.require()?[token as usize]);
        Ok(if logit == f64::NEG_INFINITY {
            f64::INFINITY
        } else {
            self.summary.log_sum_exp - logit
        })
    }

    /// The `k` most likely tokens with their natural-log probabilities, best first (ties:
    /// lower token id first). Fewer when fewer logits are finite.
    pub fn top_logprobs(&self, k: usize) -> Result<Vec<(Token, f64)>> {
        if let Row::Drawn(d) = &self.row {
            if k > d.best.len() {
                return Err(Error::Other(format!(
                    "top_logprobs({k}): the device keeps the {} best of each row: \
                     {NO_ROW_ON_DEVICE}",
                    d.best.len()
                )));
            }
            return Ok(d.best[..k]
                .iter()
                .map(|&(t, l)| (t, f64::from(l) - d.log_sum_exp))
                .collect());
        }
        let logits = self.require()?;
        let mut idx = Vec::new();
        self.best(k, &mut idx);
        let lse = self.summary.log_sum_exp;
        Ok(idx
            .into_iter()
            .map(|i| (i as Token, f64::from(logits[i as usize]) - lse))
            .collect())
    }

    /// Entropy in nats.
    pub fn entropy(&self) -> Result<f64> {
        Ok(metrics::entropy(self.require()?))
    }
}
