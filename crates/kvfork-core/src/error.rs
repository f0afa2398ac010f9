//! Errors for lease and branch-tree bookkeeping.

use crate::Handle;

/// Why a lease or tree operation was refused. Every refusal leaves state unchanged.
#[derive(thiserror::Error, Debug, Clone, PartialEq, Eq)]
pub enum TenancyError {
    /// Every KV sequence id is held by a live branch.
    #[error("no free KV sequence: all {n_seq_max} leases are in use; prune a branch first")]
    LeaseExhausted {
        /// The number of sequences of the context.
        n_seq_max: u32,
    },

    /// A specific sequence id was asked for (restoring state) but is taken or out of range.
    #[error("KV sequence {seq} is not available (leased, or not below n_seq_max = {n_seq_max})")]
    SeqUnavailable {
        /// The sequence id asked for.
        seq: u32,
        /// The number of sequences of the context.
        n_seq_max: u32,
    },

    /// Releasing a sequence id that nobody holds (a double free).
    #[error("KV sequence {0} is not leased")]
    NotLeased(u32),

    /// The handle's branch was pruned (or never existed in this registry).
    #[error("branch {0} no longer exists (stale handle)")]
    StaleHandle(Handle),

    /// Restrict-style prune of a branch that still has forks hanging off it.
    #[error("branch {handle} has {children} live child branch(es); prune them first or prune the subtree")]
    HasChildren {
        /// The branch asked to be pruned.
        handle: Handle,
        /// How many live children it has.
        children: usize,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages() {
        let e = TenancyError::LeaseExhausted { n_seq_max: 8 };
        assert_eq!(
            e.to_string(),
            "no free KV sequence: all 8 leases are in use; prune a branch first"
        );
        assert_eq!(
            TenancyError::NotLeased(3).to_string(),
            "KV sequence 3 is not leased"
        );
        let h = Handle::from_u64(2 | (1 << 32));
        assert!(TenancyError::StaleHandle(h).to_string().contains("2v1"));
        let e = TenancyError::HasChildren {
            handle: h,
            children: 2,
        };
        assert!(e.to_string().contains("2 live child"));
    }
}
