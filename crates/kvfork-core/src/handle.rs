//! Generational handles: an index plus a generation, so a handle to a freed
//! slot never aliases whatever later reuses that slot.

use std::fmt;

/// Opaque reference to an [`Arena`](crate::Arena) slot.
#[derive(Copy, Clone, PartialEq, Eq, Hash, Debug)]
pub struct Handle {
    index: u32,
    generation: u32,
}

impl Handle {
    /// Only the arena mints handles; outside code round-trips via `u64`.
    pub(crate) fn new(index: u32, generation: u32) -> Self {
        Handle { index, generation }
    }

    /// Slot index inside the arena.
    pub fn index(self) -> u32 {
        self.index
    }

    /// How many times the slot had been reused when this handle was made.
    pub fn generation(self) -> u32 {
        self.generation
    }

    /// Packs the handle into one integer, e.g. for passing through Python.
    pub fn to_u64(self) -> u64 {
        (u64::from(self.generation) << 32) | u64::from(self.index)
    }

    /// Inverse of [`Handle::to_u64`].
    pub fn from_u64(raw: u64) -> Handle {
        Handle {
            index: raw as u32,
            generation: (raw >> 32) as u32,
        }
    }
}

impl fmt::Display for Handle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}v{}", self.index, self.generation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn u64_round_trip() {
        let h = Handle::new(7, 0xdead_beef);
        assert_eq!(h.to_u64(), 0xdead_beef_0000_0007);
        assert_eq!(Handle::from_u64(h.to_u64()), h);
        let max = Handle::new(u32::MAX, u32::MAX);
        assert_eq!(Handle::from_u64(max.to_u64()), max);
    }

    #[test]
    fn display() {
        assert_eq!(Handle::new(3, 2).to_string(), "3v2");
    }
}
