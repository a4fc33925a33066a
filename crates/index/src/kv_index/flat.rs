//! An open-addressing map from block-table keys (router block hashes, already uniform) to a
//! 64-bit value: one 16-byte slot per entry holding key and value side by side, linear
//! probing, no tombstones (backward-shift deletion). A lookup touches one cache line in the
//! common case, where a general map touches two (its control bytes, then its entries), and
//! an entry costs 16 bytes at a load of 3/8 to 3/4.
//!
//! Key 0 marks an empty slot, so a key of 0 is stored as [`ZERO_STANDIN`]: the two keys then
//! share an entry, which is as likely as two blocks sharing a 64-bit hash.

const EMPTY: u64 = 0;
const ZERO_STANDIN: u64 = 0x5BD1_E995_C6A4_A793;
const MIN_SLOTS: usize = 64;

#[derive(Debug, Default, Clone, Copy)]
struct Slot {
    key: u64,
    value: u64,
}

#[derive(Debug, Default)]
pub(crate) struct FlatMap {
    slots: Vec<Slot>,
    len: usize,
}

fn stored(key: u64) -> u64 {
    if key == EMPTY {
        ZERO_STANDIN
    } else {
        key
    }
}

impl FlatMap {
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    fn home(&self, key: u64) -> usize {
        // The keys are uniform: their high bits index the table directly.
        (key.rotate_left(32) as usize) & self.mask()
    }

    /// The position of `key`, if present.
    pub(crate) fn find(&self, key: u64) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let key = stored(key);
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            let slot = self.slots[i];
            if slot.key == key {
                return Some(i);
            }
            if slot.key == EMPTY {
                return None;
            }
            i = (i + 1) & mask;
        }
    }

    /// Loads the first slot `key` probes, so that a later lookup finds it in cache: issued
    /// for a batch of keys at once, the cache misses overlap instead of coming one by one.
    pub(crate) fn touch(&self, key: u64) {
        if !self.slots.is_empty() {
            std::hint::black_box(self.slots[self.home(stored(key))].key);
        }
    }

    /// The value of `key`, if present.
    pub(crate) fn get(&self, key: u64) -> Option<u64> {
        self.find(key).map(|i| self.slots[i].value)
    }

    pub(crate) fn contains(&self, key: u64) -> bool {
        self.find(key).is_some()
    }

    /// The value at a position [`find`](Self::find) or [`insert`](Self::insert) returned
    /// (valid until the next insertion or removal).
    pub(crate) fn value_mut(&mut self, at: usize) -> &mut u64 {
        &mut self.slots[at].value
    }

    /// The position of `key`, inserted with value 0 if absent, and whether it was inserted.
    pub(crate) fn insert(&mut self, key: u64) -> (usize, bool) {
        if (self.len + 1) * 4 > self.slots.len() * 3 {
            self.grow();
        }
        let key = stored(key);
        let mask = self.mask();
        let mut i = self.home(key);
        loop {
            let slot = self.slots[i];
            if slot.key == key {
                return (i, false);
            }
            if slot.key == EMPTY {
                self.slots[i] = Slot { key, value: 0 };
                self.len += 1;
                return (i, true);
            }
            i = (i + 1) & mask;
        }
    }

    /// Removes the entry at `at`, shifting back the entries probing past it.
    pub(crate) fn remove_at(&mut self, at: usize) {
        let mask = self.mask();
        let mut hole = at;
        let mut j = at;
        loop {
            j = (j + 1) & mask;
            let key = self.slots[j].key;
            if key == EMPTY {
                break;
            }
            // The entry at `j` may fill the hole if the hole lies on its probe path.
            let home = self.home(key);
            if j.wrapping_sub(home) & mask >= j.wrapping_sub(hole) & mask {
                self.slots[hole] = self.slots[j];
                hole = j;
            }
        }
        self.slots[hole] = Slot::default();
        self.len -= 1;
    }

    fn grow(&mut self) {
        let size = (self.slots.len() * 2).max(MIN_SLOTS);
        let old = std::mem::replace(&mut self.slots, vec![Slot::default(); size]);
        let mask = size - 1;
        for slot in old.into_iter().filter(|s| s.key != EMPTY) {
            let mut i = self.home(slot.key);
            while self.slots[i].key != EMPTY {
                i = (i + 1) & mask;
            }
            self.slots[i] = slot;
        }
    }

    /// Every value (for tests).
    #[cfg(test)]
    pub(crate) fn values(&self) -> impl Iterator<Item = u64> + '_ {
        self.slots
            .iter()
            .filter(|s| s.key != EMPTY)
            .map(|s| s.value)
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Slot>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn behaves_as_a_map_under_inserts_and_removals() {
        let mut flat = FlatMap::default();
        let mut model: HashMap<u64, u64> = HashMap::new();
        let mut x = 0x1234_5678_9ABC_DEF1u64;
        for step in 0..20_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Few distinct keys, many colliding homes: keys differ in their low bits only
            // (and key 0 is among them).
            let key = (x % 1500) << 40 | (x % 3);
            if x % 3 == 0 {
                if let Some(at) = flat.find(key) {
                    flat.remove_at(at);
                }
                model.remove(&key);
            } else {
                let (at, inserted) = flat.insert(key);
                assert_eq!(inserted, !model.contains_key(&key));
                *flat.value_mut(at) += step;
                *model.entry(key).or_insert(0) += step;
            }
            assert_eq!(flat.len(), model.len());
        }
        for (key, value) in &model {
            assert_eq!(flat.get(*key), Some(*value));
        }
        assert_eq!(flat.values().count(), model.len());
        assert!(flat.get(0xFFFF_FFFF).is_none());
        assert!(flat.contains(*model.keys().next().unwrap()));
    }
}
