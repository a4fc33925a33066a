//! A replica's records: hashbrown's `HashTable` of 16-byte (engine hash, [`Record`]) entries,
//! addressed by bucket position between a lookup and the change after it.
//!
//! A store first *claims* the entries of all of an event's engine hashes (an absent one is
//! inserted as a pending record, which lookups treat as absent), so that the insertions'
//! cache misses overlap; each block's store then fills its claimed entry in place. A
//! position stays valid until the table grows, which a store checks (the key at the position).

use super::records::Record;

#[derive(Debug, Clone, Copy)]
#[repr(C)]
struct Entry {
    key: u64,
    record: Record,
}

/// [`RecordMap::probe`]'s answer for a key with no entry at all.
const ABSENT: usize = usize::MAX;

#[derive(Debug, Default)]
pub(crate) struct RecordMap {
    table: hashbrown::HashTable<Entry>,
}

/// Engine hashes come from engines (any values, small ones too): one folded multiply
/// spreads them.
#[inline]
fn mix(key: u64) -> u64 {
    let m = u128::from(key ^ 0x243F_6A88_85A3_08D3) * u128::from(0x9E37_79B9_7F4A_7C15u64);
    (m as u64) ^ ((m >> 64) as u64)
}

impl RecordMap {
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    /// The entry holding `key`'s record; else its claimed entry, or [`ABSENT`].
    #[inline]
    pub(crate) fn probe(&self, key: u64) -> Result<usize, usize> {
        match self.table.find_bucket_index(mix(key), |e| e.key == key) {
            Some(i) if self.record(i).is_pending() => Err(i),
            Some(i) => Ok(i),
            None => Err(ABSENT),
        }
    }

    #[inline]
    pub(crate) fn find(&self, key: u64) -> Option<usize> {
        self.probe(key).ok()
    }

    /// Makes room for `n` more entries; the heap bytes that added.
    pub(crate) fn reserve(&mut self, n: usize) -> usize {
        let before = self.table.allocation_size();
        self.table.reserve(n, |e| mix(e.key));
        self.table.allocation_size() - before
    }

    /// Claims an entry for `key` if it has none, for a record stored next (the entry written
    /// now, with the misses of an event's other claims, not later one by one). Every claimed
    /// entry must be filled ([`Self::insert_at`]) before any other use of the map.
    /// Returns the entry, which stays `key`'s until the map grows (see [`Self::probe_at`]).
    #[inline]
    pub(crate) fn claim(&mut self, key: u64) -> usize {
        match self.table.entry(mix(key), |e| e.key == key, |e| mix(e.key)) {
            hashbrown::hash_table::Entry::Occupied(occupied) => occupied.bucket_index(),
            hashbrown::hash_table::Entry::Vacant(vacant) => {
                let record = Record::PENDING;
                vacant.insert(Entry { key, record }).bucket_index()
            }
        }
    }

    /// [`Self::probe`]'s answer for `key` from `entry`, where `key` claimed it ([`Self::claim`])
    /// and it still holds `key` (no growth moved it since); else `None`.
    #[inline]
    pub(crate) fn probe_at(&self, entry: usize, key: u64) -> Option<Result<usize, usize>> {
        let found = self.table.get_bucket(entry).filter(|e| e.key == key)?;
        Some(match found.record.is_pending() {
            true => Err(entry),
            false => Ok(entry),
        })
    }

    /// The record at `entry` where it holds `key` (claimed there: [`Self::claim`], no growth
    /// since), pending or not.
    #[inline]
    pub(crate) fn claimed_mut(&mut self, entry: usize, key: u64) -> Option<&mut Record> {
        let found = self.table.get_bucket_mut(entry).filter(|e| e.key == key)?;
        Some(&mut found.record)
    }

    #[cfg(test)]
    pub(crate) fn holds(&self, entry: usize, key: u64) -> bool {
        self.table.get_bucket(entry).is_some_and(|e| e.key == key)
    }

    #[inline]
    pub(crate) fn record(&self, entry: usize) -> &Record {
        &self.table.get_bucket(entry).expect("a live entry").record
    }

    #[inline]
    pub(crate) fn record_mut(&mut self, entry: usize) -> &mut Record {
        &mut self
            .table
            .get_bucket_mut(entry)
            .expect("a live entry")
            .record
    }

    /// Stores `record` for `key` where [`Self::probe`] found no record (`entry` its answer);
    /// the heap bytes that added.
    #[inline]
    pub(crate) fn insert_at(&mut self, entry: usize, key: u64, record: Record) -> usize {
        if entry != ABSENT {
            *self.record_mut(entry) = record;
            return 0;
        }
        let before = self.table.allocation_size();
        self.table
            .insert_unique(mix(key), Entry { key, record }, |e| mix(e.key));
        self.table.allocation_size() - before
    }

    /// Takes tier bit `bit` from `key`'s record at `entry`, removing the entry when no tier is
    /// left, in one access: the record as it was, and whether it went. `None` where `entry`
    /// no longer holds `key` (removed since: entries never move while nothing is inserted) or
    /// its record lacks the tier.
    #[inline]
    pub(crate) fn take_tier(&mut self, entry: usize, key: u64, bit: u8) -> Option<(Record, bool)> {
        let mut occupied = self.table.get_bucket_entry(entry).ok()?;
        let found = occupied.get_mut();
        let record = found.record;
        if found.key != key || record.tiers() & bit == 0 {
            return None;
        }
        if record.tiers() == bit {
            occupied.remove();
            return Some((record, true));
        }
        found.record.set_tiers(record.tiers() & !bit);
        Some((record, false))
    }

    #[cfg(test)]
    pub(crate) fn remove_at(&mut self, entry: usize) -> Record {
        let occupied = self.table.get_bucket_entry(entry).expect("a live entry");
        occupied.remove().0.record
    }

    pub(crate) fn records(&self) -> impl Iterator<Item = &Record> + '_ {
        self.table.iter().map(|e| &e.record)
    }

    #[inline]
    pub(crate) fn memory_bytes(&self) -> usize {
        self.table.allocation_size()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Random claims, stores, changes, removals and tiers taken of small keys (0 among them)
    /// against a map: a claimed entry reads as absent until stored, and the map answers as the
    /// model.
    #[test]
    fn behaves_as_a_map_with_claims() {
        let mut map = RecordMap::default();
        let mut model: HashMap<u64, u32> = HashMap::new();
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..5_000 {
            let keys: Vec<u64> = (0..1 + next() % 8).map(|_| next() % 500).collect();
            map.reserve(keys.len());
            for &key in &keys {
                map.claim(key);
            }
            for &key in &keys {
                assert_eq!(map.find(key).is_some(), model.contains_key(&key));
                let at = (next() % 1000) as u32;
                match map.probe(key) {
                    Ok(entry) => *map.record_mut(entry) = Record::one(at, 0, 1),
                    Err(entry) => {
                        map.insert_at(entry, key, Record::one(at, 0, 1));
                    }
                }
                model.insert(key, at);
            }
            for _ in 0..next() % 6 {
                let key = next() % 500;
                let removed = map.find(key).map(|entry| map.remove_at(entry).place());
                assert_eq!(removed, model.remove(&key).map(Some));
            }
            // Tiers taken one at a time: the entry goes with its last tier.
            for _ in 0..next() % 4 {
                let key = next() % 500;
                let Some(entry) = map.find(key) else {
                    assert!(!model.contains_key(&key));
                    continue;
                };
                *map.record_mut(entry) = Record::one(model[&key], 0, 0b101);
                assert_eq!(map.take_tier(entry, key, 0b010), None);
                assert_eq!(map.take_tier(entry, key ^ 1 << 40, 0b001), None);
                let (before, gone) = map.take_tier(entry, key, 0b001).expect("held in tier 0");
                assert_eq!((before.tiers(), gone), (0b101, false));
                assert_eq!(map.record(entry).tiers(), 0b100);
                let (_, gone) = map.take_tier(entry, key, 0b100).expect("held in tier 2");
                assert!(gone);
                assert_eq!(map.find(key), None);
                assert_eq!(map.take_tier(entry, key, 0b100), None);
                model.remove(&key);
            }
            assert_eq!(map.len(), model.len());
        }
        for (key, at) in &model {
            let entry = map.find(*key).expect("every key found");
            assert!(map.holds(entry, *key));
            assert_eq!(map.record(entry).place(), Some(*at));
        }
        assert_eq!(map.records().count(), model.len());
        assert_eq!(std::mem::size_of::<Entry>(), 16);
    }
}
