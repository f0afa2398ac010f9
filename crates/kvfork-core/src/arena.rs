//! Generational slot arena: stable small handles for branches, with stale
//! handles detected instead of silently pointing at a reused slot.

use crate::Handle;

struct Slot<T> {
    /// Bumped every time the slot is emptied, so old handles stop matching.
    generation: u32,
    value: Option<T>,
}

/// A `Vec` of slots plus a free list; insert, get and remove are O(1).
pub struct Arena<T> {
    slots: Vec<Slot<T>>,
    free: Vec<u32>,
    len: usize,
}

impl<T> Default for Arena<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> Arena<T> {
    /// An empty arena.
    pub fn new() -> Self {
        Arena {
            slots: Vec::new(),
            free: Vec::new(),
            len: 0,
        }
    }

    /// Stores `value`, reusing a freed slot when one exists.
    pub fn insert(&mut self, value: T) -> Handle {
        self.len += 1;
        if let Some(index) = self.free.pop() {
            let slot = &mut self.slots[index as usize];
            debug_assert!(slot.value.is_none());
            slot.value = Some(value);
            return Handle::new(index, slot.generation);
        }
        let index = u32::try_from(self.slots.len()).expect("arena exceeds u32::MAX slots");
        self.slots.push(Slot {
            generation: 0,
            value: Some(value),
        });
        Handle::new(index, 0)
    }

    fn slot(&self, h: Handle) -> Option<&Slot<T>> {
        self.slots
            .get(h.index() as usize)
            .filter(|s| s.generation == h.generation())
    }

    /// The value behind `h`, if `h` is still live.
    pub fn get(&self, h: Handle) -> Option<&T> {
        self.slot(h)?.value.as_ref()
    }

    /// The value behind `h` for change, if `h` is still live.
    pub fn get_mut(&mut self, h: Handle) -> Option<&mut T> {
        self.slots
            .get_mut(h.index() as usize)
            .filter(|s| s.generation == h.generation())?
            .value
            .as_mut()
    }

    /// Whether `h` still names a live value.
    pub fn contains(&self, h: Handle) -> bool {
        self.get(h).is_some()
    }

    /// Takes the value out; `h` (and every copy of it) is stale afterwards.
    pub fn remove(&mut self, h: Handle) -> Option<T> {
        let slot = self
            .slots
            .get_mut(h.index() as usize)
            .filter(|s| s.generation == h.generation())?;
        let value = slot.value.take()?;
        self.len -= 1;
        // A slot whose generation would wrap is retired rather than risk a
        // 2^32-old handle matching again.
        if let Some(next) = slot.generation.checked_add(1) {
            slot.generation = next;
            self.free.push(h.index());
        }
        Some(value)
    }

    /// Number of live values.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no value is live.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Live values in slot order.
    pub fn iter(&self) -> impl Iterator<Item = (Handle, &T)> {
        self.slots.iter().enumerate().filter_map(|(i, s)| {
            let value = s.value.as_ref()?;
            Some((Handle::new(i as u32, s.generation), value))
        })
    }

    /// Snapshot of live handles, handy when the arena is mutated while walking.
    pub fn handles(&self) -> Vec<Handle> {
        self.iter().map(|(h, _)| h).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_get_remove() {
        let mut a = Arena::new();
        assert!(a.is_empty());
        let x = a.insert("x");
        let y = a.insert("y");
        assert_eq!(a.len(), 2);
        assert_eq!(a.get(x), Some(&"x"));
        *a.get_mut(y).unwrap() = "why";
        assert_eq!(a.get(y), Some(&"why"));
        assert_eq!(a.remove(x), Some("x"));
        assert_eq!(a.remove(x), None);
        assert!(!a.contains(x));
        assert_eq!(a.len(), 1);
        assert_eq!(a.handles(), vec![y]);
    }

    #[test]
    fn stale_handles_never_match_reused_slots() {
        let mut a = Arena::new();
        let old = a.insert(1);
        a.remove(old);
        let new = a.insert(2);
        assert_eq!(new.index(), old.index());
        assert_ne!(new.generation(), old.generation());
        assert_eq!(a.get(old), None);
        assert_eq!(a.get_mut(old), None);
        assert_eq!(a.remove(old), None);
        assert_eq!(a.get(new), Some(&2));
    }

    #[test]
    fn foreign_handles_are_rejected() {
        let a: Arena<u8> = Arena::new();
        assert!(!a.contains(Handle::new(5, 0)));
    }

    #[test]
    fn iter_is_in_slot_order() {
        let mut a = Arena::new();
        let hs: Vec<_> = (0..5).map(|i| a.insert(i)).collect();
        a.remove(hs[1]);
        a.remove(hs[3]);
        let seen: Vec<_> = a.iter().map(|(h, v)| (h, *v)).collect();
        assert_eq!(seen, vec![(hs[0], 0), (hs[2], 2), (hs[4], 4)]);
    }

    #[test]
    fn exhausted_generation_retires_slot() {
        let mut a = Arena::new();
        let h = a.insert(0);
        a.slots[0].generation = u32::MAX;
        let h = Handle::new(h.index(), u32::MAX);
        assert_eq!(a.remove(h), Some(0));
        let fresh = a.insert(1);
        assert_ne!(fresh.index(), h.index());
    }
}
