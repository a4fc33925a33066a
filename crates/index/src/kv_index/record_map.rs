//! A replica's records: 16-byte (engine hash, [`Record`]) entries in a [`Gradual`] table
//! (hashbrown's, resized a step at a time), addressed by position between a lookup and the
//! change after it.
//!
//! A store first *claims* the entries of all of an event's engine hashes (an absent one is
//! inserted as a pending record, which lookups treat as absent), so that the insertions'
//! cache misses overlap; each block's store then fills its claimed entry in place. A
//! position stays valid until the next insertion, which may move entries; a store checks it
//! (the key at the position).

use super::gradual::{Gradual, Hashed};
use super::records::Record;
use crate::hasher::mix;
use crate::EngineHash;

#[derive(Debug, Clone, Copy)]
#[repr(C)]
struct Entry {
    key: u64,
    record: Record,
}

impl Hashed for Entry {
    /// Engine hashes come from engines (any values, small ones too): mixed.
    #[inline]
    fn hash(&self) -> u64 {
        mix(self.key)
    }
}

/// [`RecordMap::probe`]'s answer for a key with no entry at all.
const ABSENT: usize = usize::MAX;

#[derive(Debug, Default)]
pub(crate) struct RecordMap {
    table: Gradual<Entry>,
}

impl RecordMap {
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// The entry holding `key`'s record; else its claimed entry, or [`ABSENT`].
    #[inline]
    pub(crate) fn probe(&self, key: u64) -> Result<usize, usize> {
        let Some(entry) = self.table.find(mix(key), |e| e.key == key) else {
            return Err(ABSENT);
        };
        match self.record(entry).is_pending() {
            true => Err(entry),
            false => Ok(entry),
        }
    }

    #[inline]
    pub(crate) fn find(&self, key: u64) -> Option<usize> {
        self.probe(key).ok()
    }

    /// Claims an entry for `key` if it has none, for a record stored next (the entry written
    /// now, with the misses of an event's other claims, not later one by one). Every claimed
    /// entry must be filled ([`Self::insert_at`]) before any other use of the map.
    /// Returns the entry, which stays `key`'s until the next insertion (see
    /// [`Self::probe_at`]).
    #[inline]
    pub(crate) fn claim(&mut self, key: u64) -> usize {
        let record = Record::PENDING;
        (self.table).find_or_insert(mix(key), |e| e.key == key, || Entry { key, record })
    }

    /// [`Self::probe`]'s answer for `key` from `entry`, where `key` claimed it ([`Self::claim`])
    /// and it still holds `key` (no insertion moved it since); else `None`.
    #[inline]
    pub(crate) fn probe_at(&self, entry: usize, key: u64) -> Option<Result<usize, usize>> {
        let found = self.table.get(entry).filter(|e| e.key == key)?;
        Some(match found.record.is_pending() {
            true => Err(entry),
            false => Ok(entry),
        })
    }

    /// The record at `entry` where it holds `key` (claimed there: [`Self::claim`], no
    /// insertion since), pending or not.
    #[inline]
    pub(crate) fn claimed_mut(&mut self, entry: usize, key: u64) -> Option<&mut Record> {
        let found = self.table.get_mut(entry).filter(|e| e.key == key)?;
        Some(&mut found.record)
    }

    #[cfg(test)]
    pub(crate) fn holds(&self, entry: usize, key: u64) -> bool {
        self.table.get(entry).is_some_and(|e| e.key == key)
    }

    #[inline]
    pub(crate) fn record(&self, entry: usize) -> &Record {
        &self.table.get(entry).expect("a live entry").record
    }

    #[inline]
    pub(crate) fn record_mut(&mut self, entry: usize) -> &mut Record {
        &mut self.table.get_mut(entry).expect("a live entry").record
    }

    /// Stores `record` for `key` where [`Self::probe`] found no record (`entry` its answer).
    #[inline]
    pub(crate) fn insert_at(&mut self, entry: usize, key: u64, record: Record) {
        match entry {
            ABSENT => self.table.insert_unique(Entry { key, record }),
            entry => *self.record_mut(entry) = record,
        }
    }

    /// Takes tier bit `bit` from `key`'s record at `entry`, removing the entry when no tier is
    /// left, in one access: the record as it was, and whether it went. `None` where `entry`
    /// no longer holds `key` (removed since: entries never move while nothing is inserted) or
    /// its record lacks the tier.
    #[inline]
    pub(crate) fn take_tier(&mut self, entry: usize, key: u64, bit: u8) -> Option<(Record, bool)> {
        let mut occupied = self.table.occupied(entry)?;
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
        let occupied = self.table.occupied(entry).expect("a live entry");
        occupied.remove().0.record
    }

    pub(crate) fn records(&self) -> impl Iterator<Item = &Record> + '_ {
        self.table.iter().map(|e| &e.record)
    }

    /// Prefetches the lines of the first probe of each of `keys`, where an insertion showed
    /// where the table lies: their cache misses then overlap, where probing one key after
    /// another waits on each in turn.
    #[inline]
    pub(crate) fn prefetch<'k>(&self, keys: impl Iterator<Item = &'k EngineHash>) {
        if let Some(lines) = self.table.lines() {
            for key in keys {
                lines.prefetch(mix(key.0));
            }
        }
    }

    /// Heap bytes (both tables while resizing).
    #[inline]
    pub(crate) fn memory_bytes(&self) -> usize {
        self.table.memory_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Random claims, stores, changes, removals and tiers taken of small keys (0 among them)
    /// against a map: a claimed entry reads as absent until stored, and the map answers as the
    /// model. Tables here resize a step at a time from 16 buckets, three buckets a step: the
    /// checks run while a resize is under way too.
    #[test]
    fn behaves_as_a_map_with_claims() {
        for keys in [150, 2_000] {
            let (map, resizing) = claims_against_a_model(keys);
            assert!(
                resizing >= 10,
                "{keys} keys: checked while resizing {resizing} times"
            );
            assert!(map.table.buckets() > 16, "{keys} keys");
        }
    }

    /// The map after the run, and how many times it was checked while resizing.
    fn claims_against_a_model(range: u64) -> (RecordMap, usize) {
        let mut resizing = 0;
        let mut map = RecordMap::default();
        let mut model: HashMap<u64, u32> = HashMap::new();
        let mut next = crate::xorshift(0x9E37_79B9_7F4A_7C15);
        for _ in 0..5_000 {
            let keys: Vec<u64> = (0..1 + next() % 8).map(|_| next() % range).collect();
            let claimed: Vec<usize> = keys.iter().map(|&key| map.claim(key)).collect();
            for (&key, &entry) in keys.iter().zip(&claimed) {
                assert_eq!(map.find(key).is_some(), model.contains_key(&key));
                let at = (next() % 1000) as u32;
                // As a store: the claimed entry where a later claim moved nothing, else a lookup.
                let found = map.probe_at(entry, key).unwrap_or_else(|| map.probe(key));
                assert_eq!(found, map.probe(key), "claimed entry of {key}");
                match found {
                    Ok(entry) => *map.record_mut(entry) = Record::one(at, 0, 1),
                    Err(entry) => {
                        map.insert_at(entry, key, Record::one(at, 0, 1));
                    }
                }
                model.insert(key, at);
            }
            for _ in 0..next() % 6 {
                let key = next() % range;
                let removed = map.find(key).map(|entry| map.remove_at(entry).place());
                assert_eq!(removed, model.remove(&key).map(Some));
            }
            // Tiers taken one at a time: the entry goes with its last tier.
            for _ in 0..next() % 4 {
                let key = next() % range;
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
            resizing += usize::from(map.table.resizing());
        }
        for (key, at) in &model {
            let entry = map.find(*key).expect("every key found");
            assert!(map.holds(entry, *key));
            assert_eq!(map.record(entry).place(), Some(*at));
        }
        assert_eq!(map.records().count(), model.len());
        assert_eq!(std::mem::size_of::<Entry>(), 16);
        (map, resizing)
    }
}
