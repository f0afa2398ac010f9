//! Rows of llama.cpp's output buffer lent to branch snapshots.
//!
//! A commit's decode leaves each branch's logits in llama.cpp's output buffer. Copying them
//! out costs a 1 MiB write per branch and step on Gemma's 262,144-token vocabulary, so the
//! branch's snapshot reads its row where it is instead, until the next decode overwrites the
//! buffer. The protocol that keeps every read valid:
//!
//! - before any decode, every loan is given back (the row copied into the branch's own
//!   buffer, under its lock) except those of a commit's own members, whose snapshots are *in
//!   flight* from before the decode until each has its new row: row reads of those branches
//!   wait for the landing (`Branch::with_row`), so nobody reads a row llama.cpp is writing;
//! - a member's old row survives a failed decode: llama.cpp writes outputs only after the
//!   whole batch has computed, and moves the buffer only for more outputs than it reserved at
//!   creation (`n_seq_max` rows), which a commit (one token per branch) never asks for;
//! - forks share their parent's loan and are recorded like it;
//! - the worker gives every loan back before it frees the context.

use std::collections::HashSet;
use std::sync::Arc;

use super::shared::BranchCell;

#[derive(Default)]
pub(crate) struct RowLoans {
    /// Cells whose snapshot may hold a row of the current output buffer.
    holders: Vec<Arc<BranchCell>>,
}

impl RowLoans {
    /// `cell`'s snapshot now holds a row of the output buffer.
    pub fn record(&mut self, cell: &Arc<BranchCell>) {
        if !self.holders.iter().any(|h| Arc::ptr_eq(h, cell)) {
            self.holders.push(cell.clone());
        }
    }

    /// After a commit: its members are the only holders (every other loan was given back
    /// before its decode).
    pub fn held_by(&mut self, members: &[&Arc<BranchCell>]) {
        self.holders = members.iter().map(|&cell| cell.clone()).collect();
    }

    /// Give back every loan except those of `members` (their loans stay recorded).
    pub fn give_back_except(&mut self, members: &[&Arc<BranchCell>]) {
        let keep: HashSet<*const BranchCell> = members.iter().map(|c| Arc::as_ptr(c)).collect();
        self.holders.retain(|cell| {
            if keep.contains(&Arc::as_ptr(cell)) {
                return true;
            }
            cell.lock().give_back_row();
            false
        });
    }

    /// Give back every loan.
    pub fn give_back_all(&mut self) {
        self.give_back_except(&[]);
    }
}
