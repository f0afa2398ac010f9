//! `Seq`: a KV sequence id, the tag of one branch's cells (llama.cpp's `llama_seq_id`).
//!
//! To llama.cpp token ids, positions and sequence ids are all `i32`; inside kvfork a sequence
//! is a `Seq`, which cannot stand in for the other two. One comes from a lease of the
//! registry, or is checked from a caller's integer (`Context::kv_*`); it becomes an integer
//! again only at the FFI edge (`llama_ctx.rs`) and in the public API (`Branch::seq_id`).

use crate::error::{Error, Result};

/// A sequence id in [0, n_seq_max) of the context it belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Seq(u32);

impl Seq {
    /// The sequence of a registry lease, or the `i`-th of a context's sequences (below
    /// n_seq_max either way).
    pub fn new(i: u32) -> Seq {
        Seq(i)
    }

    /// A caller's id, if it lies in [0, n_seq_max): llama.cpp aborts on ids outside
    /// [0, 256).
    pub fn checked(id: i32, n_seq_max: u32) -> Result<Seq> {
        match u32::try_from(id) {
            Ok(i) if i < n_seq_max => Ok(Seq(i)),
            _ => Err(Error::invalid(
                "seq",
                format!("sequence id {id} is not in [0, n_seq_max = {n_seq_max})"),
            )),
        }
    }

    /// The id as llama.cpp and the public API take it.
    pub fn id(self) -> i32 {
        // At most 256 (`MAX_SEQUENCES`): always fits.
        self.0 as i32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checked_takes_ids_below_n_seq_max_only() {
        assert_eq!(Seq::checked(0, 4).unwrap(), Seq::new(0));
        assert_eq!(Seq::checked(3, 4).unwrap().id(), 3);
        for bad in [-1, 4, i32::MAX, i32::MIN] {
            let err = Seq::checked(bad, 4).unwrap_err().to_string();
            assert!(err.contains(&format!("sequence id {bad} is not in [0, n_seq_max = 4)")));
        }
    }
}
