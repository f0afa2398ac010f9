//! The context's outputs outside any branch (the raw layer, `raw_layer.rs`): the logits row each
//! `Context::decode` left for its sequence, and which sequence the last decode of all was for.
//!
//! A raw row lives until something else happens to its sequence's cells: a branch decodes
//! into the sequence (its snapshot is then the sequence's last output), a lease empties it
//! (`Branch::create`, `fork`), a prune removes its cells, or a restore or `kv_clear`
//! replaces the cache. `Branch::capture_logits` reads it; `Context::model_entropy` reads the
//! last output, raw or a branch's.

use std::collections::HashMap;

use crate::branch_state::LogitsSnapshot;
use crate::llama_ctx::OutputRef;
use crate::seq::Seq;

/// What the context's last decode output.
#[derive(Clone, Default)]
pub(crate) enum LastOutput {
    /// Nothing yet, or it is gone (its sequence was emptied).
    #[default]
    None,
    /// A `Context::decode`: its last token's logits.
    Raw(LogitsSnapshot),
    /// A branch's decode: the branch holding this sequence has the row as its snapshot.
    Branch(Seq),
}

/// Raw rows by sequence, and the last output.
#[derive(Default)]
pub(crate) struct Outputs {
    rows: HashMap<Seq, LogitsSnapshot>,
    last: LastOutput,
}

impl Outputs {
    /// A `Context::decode` into `seq` ended with `output`.
    pub fn raw(&mut self, seq: Seq, output: OutputRef<'_>) {
        let mut snapshot = LogitsSnapshot::empty();
        snapshot.set_output(output);
        self.rows.insert(seq, snapshot.clone());
        self.last = LastOutput::Raw(snapshot);
    }

    /// A decode wrote outputs for `seqs` (its last output `last`): their raw rows are stale.
    pub fn decoded(&mut self, seqs: impl Iterator<Item = Seq>, last: Seq) {
        if !self.rows.is_empty() {
            for seq in seqs {
                self.rows.remove(&seq);
            }
        }
        self.last = LastOutput::Branch(last);
    }

    /// `seq` lost its cells: its output (raw row, or last output) goes with them.
    pub fn emptied(&mut self, seq: Seq) {
        self.rows.remove(&seq);
        if matches!(self.last, LastOutput::Branch(s) if s == seq) {
            self.last = LastOutput::None;
        }
    }

    /// Every sequence but `seq` lost its cells.
    pub fn keep_only(&mut self, seq: Seq) {
        self.rows.retain(|&s, _| s == seq);
        if matches!(self.last, LastOutput::Branch(s) if s != seq) {
            self.last = LastOutput::None;
        }
    }

    /// The whole cache was replaced or cleared.
    pub fn clear(&mut self) {
        self.rows.clear();
        self.last = LastOutput::None;
    }

    /// `seq`'s raw row (a `destroy`ed branch's snapshot counts as one).
    pub fn row(&self, seq: Seq) -> Option<&LogitsSnapshot> {
        self.rows.get(&seq)
    }

    /// Keep `snapshot` as `seq`'s row: a branch released its handle but not its cells. When
    /// that branch made the last output, the row stays the last output.
    pub fn keep(&mut self, seq: Seq, snapshot: LogitsSnapshot) {
        if matches!(self.last, LastOutput::Branch(s) if s == seq) {
            self.last = LastOutput::Raw(snapshot.clone());
        }
        self.rows.insert(seq, snapshot);
    }

    /// The last decode's output.
    pub fn last(&self) -> LastOutput {
        self.last.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row_of(o: &Outputs, seq: u32) -> Option<Vec<f32>> {
        o.row(Seq::new(seq))
            .and_then(|s| s.row())
            .map(<[f32]>::to_vec)
    }

    #[test]
    fn a_raw_row_lives_until_its_sequence_is_decoded_into_or_emptied() {
        let mut o = Outputs::default();
        o.raw(Seq::new(1), OutputRef::Row(&[1.0, 2.0]));
        o.raw(Seq::new(2), OutputRef::Row(&[3.0, 4.0]));
        assert!(matches!(o.last(), LastOutput::Raw(_)));
        // A branch decode into sequence 1 (its last output) supersedes 1's row only.
        o.decoded([Seq::new(1)].into_iter(), Seq::new(1));
        assert_eq!(row_of(&o, 1), None);
        assert_eq!(row_of(&o, 2), Some(vec![3.0, 4.0]));
        assert!(matches!(o.last(), LastOutput::Branch(s) if s == Seq::new(1)));
        o.emptied(Seq::new(1));
        assert!(matches!(o.last(), LastOutput::None));
        o.keep(Seq::new(3), o.row(Seq::new(2)).cloned().expect("row 2"));
        assert!(matches!(o.last(), LastOutput::None)); // sequence 3 did not make it
        o.decoded([Seq::new(3)].into_iter(), Seq::new(3));
        o.keep(Seq::new(3), o.row(Seq::new(2)).cloned().expect("row 2"));
        // The branch that made the last output released its handle: its row stays last.
        assert!(matches!(o.last(), LastOutput::Raw(_)));
        o.keep_only(Seq::new(3));
        assert_eq!((row_of(&o, 2), row_of(&o, 3)), (None, Some(vec![3.0, 4.0])));
        o.clear();
        assert_eq!(row_of(&o, 3), None);
    }
}
