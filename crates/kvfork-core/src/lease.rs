//! Allocation of llama.cpp sequence ids (`0..n_seq_max`) to live branches.

use std::collections::BTreeSet;

use crate::TenancyError;

/// Hands out sequence ids, always the lowest free one, so allocation is
/// deterministic and low ids (cheapest for llama.cpp's unified cache) are reused first.
#[derive(Clone, Debug)]
pub struct LeaseAllocator {
    n_seq_max: u32,
    /// Free ids; ordered so the lowest is an O(log n) pop.
    free: BTreeSet<u32>,
}

impl LeaseAllocator {
    /// All of `0..n_seq_max` start free.
    pub fn new(n_seq_max: u32) -> Self {
        LeaseAllocator {
            n_seq_max,
            free: (0..n_seq_max).collect(),
        }
    }

    /// Leases the lowest free id.
    pub fn acquire(&mut self) -> Result<u32, TenancyError> {
        self.free.pop_first().ok_or(TenancyError::LeaseExhausted {
            n_seq_max: self.n_seq_max,
        })
    }

    /// Leases `seq` itself (restoring saved state); refuses an id that is taken or out of range.
    pub fn acquire_exact(&mut self, seq: u32) -> Result<(), TenancyError> {
        if self.free.remove(&seq) {
            Ok(())
        } else {
            Err(TenancyError::SeqUnavailable {
                seq,
                n_seq_max: self.n_seq_max,
            })
        }
    }

    /// Returns `seq` to the pool; refuses double frees and out-of-range ids.
    pub fn release(&mut self, seq: u32) -> Result<(), TenancyError> {
        if !self.is_leased(seq) {
            return Err(TenancyError::NotLeased(seq));
        }
        self.free.insert(seq);
        Ok(())
    }

    /// Frees every id except `seq`, which ends up leased whatever it was before.
    ///
    /// # Panics
    /// If `seq >= n_seq_max`.
    pub fn retain_only(&mut self, seq: u32) {
        assert!(
            seq < self.n_seq_max,
            "sequence {seq} out of range 0..{}",
            self.n_seq_max
        );
        self.free = (0..self.n_seq_max).filter(|&s| s != seq).collect();
    }

    /// Number of ids that can still be acquired.
    pub fn available(&self) -> u32 {
        self.free.len() as u32
    }

    /// The number of sequence ids (`0..n_seq_max`) this allocator hands out.
    pub fn n_seq_max(&self) -> u32 {
        self.n_seq_max
    }

    /// Whether `seq` is in range and held by someone.
    pub fn is_leased(&self, seq: u32) -> bool {
        seq < self.n_seq_max && !self.free.contains(&seq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lowest_free_first() {
        let mut l = LeaseAllocator::new(4);
        assert_eq!(l.acquire(), Ok(0));
        assert_eq!(l.acquire(), Ok(1));
        assert_eq!(l.acquire(), Ok(2));
        l.release(1).unwrap();
        l.release(0).unwrap();
        assert_eq!(l.acquire(), Ok(0));
        assert_eq!(l.acquire(), Ok(1));
        assert_eq!(l.acquire(), Ok(3));
        assert_eq!(l.available(), 0);
        assert_eq!(
            l.acquire(),
            Err(TenancyError::LeaseExhausted { n_seq_max: 4 })
        );
    }

    #[test]
    fn release_rejects_unleased() {
        let mut l = LeaseAllocator::new(2);
        assert_eq!(l.release(0), Err(TenancyError::NotLeased(0)));
        assert_eq!(l.release(9), Err(TenancyError::NotLeased(9)));
        let s = l.acquire().unwrap();
        l.release(s).unwrap();
        assert_eq!(l.release(s), Err(TenancyError::NotLeased(s)));
        assert_eq!(l.available(), 2);
    }

    #[test]
    fn retain_only_keeps_one() {
        let mut l = LeaseAllocator::new(5);
        for _ in 0..3 {
            l.acquire().unwrap();
        }
        l.retain_only(4);
        assert_eq!(l.available(), 4);
        assert!(l.is_leased(4));
        assert!((0..4).all(|s| !l.is_leased(s)));
        assert_eq!(l.acquire(), Ok(0));
    }

    #[test]
    fn acquire_exact_takes_that_id_only_when_free() {
        let mut l = LeaseAllocator::new(3);
        l.acquire_exact(2).unwrap();
        assert!(l.acquire_exact(2).is_err());
        assert!(l.acquire_exact(3).is_err());
        assert_eq!(l.acquire(), Ok(0));
        assert_eq!(l.acquire(), Ok(1));
        assert_eq!(l.available(), 0);
    }

    #[test]
    fn zero_capacity() {
        let mut l = LeaseAllocator::new(0);
        assert_eq!(l.n_seq_max(), 0);
        assert_eq!(
            l.acquire(),
            Err(TenancyError::LeaseExhausted { n_seq_max: 0 })
        );
    }
}
