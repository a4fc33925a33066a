//! Every replica's engine blocks: per slot, a hash map from engine hash to an 8-byte
//! [`Record`] held in the map's own entry (16 bytes with the key), so that finding a record
//! is one probe of the map (its control bytes, then the entry) and nothing after it. A record
//! of an engine block the router's size (the common case) is whole in its entry: its router
//! block's place in the block table (the block's hash is there), its tiers and its stamp. The
//! rare mappings (an engine block of several router blocks, or a piece of one) keep their
//! [`Kind`] in a side arena the entry points to.
//!
//! Before this layout a record lived in an arena of 32-byte records in store order, found
//! through a per-slot open-addressing index of 8-byte tags: two dependent cache misses a
//! lookup (the tag entry, then the record) where there is now one. With 24-byte entries (a
//! 64-bit stamp) events applied 7-10% slower than with these.

use super::record::Kind;
use super::record_map::RecordMap;
use crate::EngineHash;

/// `Record::at`'s bit set when the record's kind is in the side arena (places are under
/// 2^31: see the block table).
const BOXED: u32 = 1 << 31;

/// Bits of a record's stamp: the global store counter modulo 2^28. The bounded index's queue
/// of stores keeps the stamps of live records within 2^27 of each other and of the next (it
/// renumbers them every 16 times the bound stores, at most 2^26, and bounds at most 2^27
/// engine blocks; see `queue.rs`), so a stamp modulo 2^28 is a whole one.
pub(crate) const STAMP_BITS: u32 = 28;

/// One engine block of one replica (8 bytes): where its router blocks are, the tiers holding
/// it, and when it was last stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Record {
    /// Not boxed: the place of its one router block in the block table (which stays where it
    /// is while held). Boxed ([`BOXED`] set): its kind's position in the side arena.
    at: u32,
    /// `stamp << 4 | tiers`: when it was last stored (modulo 2^28, see [`STAMP_BITS`]), and
    /// bit `t` set when held in tier `t`. Tiers 0 only in an entry claimed and not yet
    /// stored ([`RecordMap::claim`]).
    meta: u32,
}

impl Record {
    /// An entry claimed for a record not stored yet (no tier).
    pub(super) const PENDING: Self = Self { at: 0, meta: 0 };

    pub(super) fn is_pending(&self) -> bool {
        self.meta & 0xF == 0
    }

    /// The record of an engine block the router's size, whose router block is at place `at`.
    pub(crate) fn one(at: u32, stamp: u64, tiers: u8) -> Self {
        debug_assert!(at & BOXED == 0);
        Self::new(at, stamp, tiers)
    }

    /// A record whose `at` is a place or a boxed position.
    fn new(at: u32, stamp: u64, tiers: u8) -> Self {
        debug_assert!(tiers != 0);
        let mut record = Self { at, meta: 0 };
        record.set_stamp(stamp);
        record.set_tiers(tiers);
        record
    }

    pub(crate) fn tiers(&self) -> u8 {
        (self.meta & 0xF) as u8
    }

    pub(crate) fn set_tiers(&mut self, tiers: u8) {
        self.meta = self.meta & !0xF | u32::from(tiers);
    }

    /// The stamp modulo 2^28.
    pub(crate) fn stamp(&self) -> u64 {
        u64::from(self.meta >> 4)
    }

    /// Whether the record was last stored at `stamp` (a full one).
    pub(crate) fn stamped(&self, stamp: u64) -> bool {
        self.stamp() == stamp & ((1 << STAMP_BITS) - 1)
    }

    pub(crate) fn set_stamp(&mut self, stamp: u64) {
        self.meta = (stamp as u32) << 4 | self.meta & 0xF;
    }

    /// The place of its one router block, when it maps to one block the router's size.
    pub(crate) fn place(&self) -> Option<u32> {
        (self.at & BOXED == 0).then_some(self.at)
    }

    /// Its kind's position in the side arena, when it is not one block the router's size.
    pub(crate) fn boxed(&self) -> Option<u32> {
        (self.at & BOXED != 0).then_some(self.at & !BOXED)
    }
}

type SlotMap = RecordMap;

#[derive(Debug, Default)]
pub(crate) struct Records {
    slots: Vec<SlotMap>,
    /// The kinds of boxed records; `None` where freed.
    kinds: Vec<Option<Kind>>,
    /// Freed positions of `kinds`, the last freed reused first.
    free: Vec<u32>,
    /// Heap bytes of the slots' maps, kept as they grow and go (summing them over the slots
    /// took 0.2 µs at 1,024 replicas, and the router reads the size after every event).
    map_bytes: usize,
}

impl Records {
    /// Makes room for slots up to `slot`.
    pub(crate) fn ensure_slot(&mut self, slot: u32) {
        if self.slots.len() <= slot as usize {
            self.slots.resize_with(slot as usize + 1, SlotMap::default);
        }
    }

    /// Engine blocks of `slot`.
    #[cfg(test)]
    pub(crate) fn len(&self, slot: u32) -> usize {
        self.slots.get(slot as usize).map_or(0, SlotMap::len)
    }

    /// Slots holding at least one engine block.
    pub(crate) fn slots_in_use(&self) -> usize {
        self.slots.iter().filter(|map| !map.is_empty()).count()
    }

    /// Claims the entries of an event's engine hashes of `slot` that have none (see
    /// [`RecordMap::claim`]): each must be stored next. Writes each hash's entry to `entries`,
    /// for [`Self::find_or_vacant_at`].
    pub(crate) fn claim(&mut self, slot: u32, hashes: &[EngineHash], entries: &mut Vec<usize>) {
        let map = &mut self.slots[slot as usize];
        let before = map.memory_bytes();
        entries.clear();
        entries.extend(hashes.iter().map(|hash| map.claim(hash.0)));
        self.map_bytes = self.map_bytes + map.memory_bytes() - before;
    }

    /// [`Self::find_or_vacant`] where [`Self::claim`] gave `hash` entry `entry` (checked: a
    /// later insertion may move entries).
    #[inline]
    pub(crate) fn find_or_vacant_at(
        &mut self,
        slot: u32,
        hash: EngineHash,
        entry: usize,
    ) -> Result<usize, usize> {
        match self.slots[slot as usize].probe_at(entry, hash.0) {
            Some(found) => found,
            None => self.find_or_vacant(slot, hash),
        }
    }

    /// The record of `hash` of `slot` in entry `entry`, where [`Self::claim`] gave it that
    /// entry and no insertion moved it since (pending until stored).
    #[inline]
    pub(crate) fn claimed_mut(
        &mut self,
        slot: u32,
        hash: EngineHash,
        entry: usize,
    ) -> Option<&mut Record> {
        self.slots[slot as usize].claimed_mut(entry, hash.0)
    }

    /// The entry of `hash` of `slot`.
    #[inline]
    pub(crate) fn locate(&self, slot: u32, hash: EngineHash) -> Option<usize> {
        self.slots.get(slot as usize)?.find(hash.0)
    }

    /// Prefetches the lines of the first probes of `hashes` in `slot`'s map (see
    /// [`RecordMap::prefetch`]).
    #[inline]
    pub(crate) fn prefetch<'h>(&self, slot: u32, hashes: impl Iterator<Item = &'h EngineHash>) {
        if let Some(map) = self.slots.get(slot as usize) {
            map.prefetch(hashes);
        }
    }

    /// [`Self::locate`] of each of `hashes` into `found` (as long), their probes' lines
    /// prefetched first.
    #[inline]
    pub(crate) fn locate_all(&self, slot: u32, hashes: &[EngineHash], found: &mut [Option<usize>]) {
        let Some(map) = self.slots.get(slot as usize) else {
            return found.fill(None);
        };
        map.prefetch(hashes.iter());
        for (hash, found) in hashes.iter().zip(found) {
            *found = map.find(hash.0);
        }
    }

    /// Takes tier `tier` from the record of `hash` of `slot`, which [`Self::locate`] found at
    /// `entry` with no insertion since, removing the record when no tier is left: the record
    /// as it was, and whether it went (its kind, if boxed, still in the arena until
    /// [`Self::release`]). `None` where `slot` no longer holds it in `tier` (the same hash
    /// removed twice in a batch).
    #[inline]
    pub(crate) fn take_tier(
        &mut self,
        slot: u32,
        hash: EngineHash,
        entry: usize,
        tier: usize,
    ) -> Option<(Record, bool)> {
        self.slots[slot as usize].take_tier(entry, hash.0, 1 << tier)
    }

    #[inline]
    pub(crate) fn get(&self, slot: u32, hash: EngineHash) -> Option<Record> {
        let map = self.slots.get(slot as usize)?;
        map.find(hash.0).map(|entry| *map.record(entry))
    }

    pub(crate) fn contains(&self, slot: u32, hash: EngineHash) -> bool {
        self.get(slot, hash).is_some()
    }

    /// Replaces the record of `hash` of `slot`, which must be there.
    #[inline]
    pub(crate) fn set(&mut self, slot: u32, hash: EngineHash, record: Record) {
        let map = &mut self.slots[slot as usize];
        let entry = map.find(hash.0).expect("a record to replace");
        *map.record_mut(entry) = record;
    }

    /// The kind of a boxed record.
    pub(crate) fn kind(&self, record: &Record) -> Option<&Kind> {
        let at = record.boxed()?;
        self.kinds[at as usize].as_ref()
    }

    /// The kind of a boxed record, to change what is not part of its mapping.
    pub(crate) fn kind_mut(&mut self, record: &Record) -> Option<&mut Kind> {
        let at = record.boxed()?;
        self.kinds[at as usize].as_mut()
    }

    /// The entry of `hash` of `slot`; else its claimed entry, or `ABSENT` (see
    /// [`RecordMap::probe`]), for [`Self::insert_at`].
    #[inline]
    pub(crate) fn find_or_vacant(&mut self, slot: u32, hash: EngineHash) -> Result<usize, usize> {
        self.slots[slot as usize].probe(hash.0)
    }

    /// The record in entry `entry` of `slot` ([`Self::find_or_vacant`]'s answer).
    #[inline]
    pub(crate) fn at_mut(&mut self, slot: u32, entry: usize) -> &mut Record {
        self.slots[slot as usize].record_mut(entry)
    }

    /// Stores `record` for `hash` of `slot` where [`Self::find_or_vacant`] found none (`entry`
    /// its answer, the slot unchanged since).
    #[inline]
    pub(crate) fn insert_at(&mut self, slot: u32, entry: usize, hash: EngineHash, record: Record) {
        let map = &mut self.slots[slot as usize];
        let before = map.memory_bytes();
        map.insert_at(entry, hash.0, record);
        self.map_bytes = self.map_bytes + map.memory_bytes() - before;
    }

    /// A new record for `kind` (its place, for [`Kind::One`], is `place`), to insert.
    pub(crate) fn new_record(&mut self, kind: Kind, place: u32, stamp: u64, tiers: u8) -> Record {
        let at = match kind {
            Kind::One(..) => place,
            kind => {
                let at = match self.free.pop() {
                    Some(at) => {
                        self.kinds[at as usize] = Some(kind);
                        at
                    }
                    None => {
                        self.kinds.push(Some(kind));
                        (self.kinds.len() - 1) as u32
                    }
                };
                assert!(at < BOXED, "2^31 boxed records");
                at | BOXED
            }
        };
        Record::new(at, stamp, tiers)
    }

    /// Adds `hash` of `slot`, which must not be there yet.
    pub(crate) fn insert(&mut self, slot: u32, hash: EngineHash, record: Record) {
        let entry =
            (self.find_or_vacant(slot, hash)).expect_err("inserting a record already there");
        self.insert_at(slot, entry, hash, record);
    }

    /// Removes `hash` of `slot`, returning its record and, if boxed, its kind.
    #[inline]
    #[cfg(test)]
    pub(crate) fn remove(&mut self, slot: u32, hash: EngineHash) -> Option<(Record, Option<Kind>)> {
        let map = self.slots.get_mut(slot as usize)?;
        let record = map.remove_at(map.find(hash.0)?);
        Some((record, self.release(&record)))
    }

    pub(crate) fn release(&mut self, record: &Record) -> Option<Kind> {
        let at = record.boxed()?;
        self.free.push(at);
        self.kinds[at as usize].take()
    }

    /// Removes every record of `slot`, returning them (with the kinds of the boxed ones).
    pub(crate) fn take_slot(&mut self, slot: u32) -> Vec<(Record, Option<Kind>)> {
        let Some(map) = self.slots.get_mut(slot as usize) else {
            return Vec::new();
        };
        let map = std::mem::take(map);
        self.map_bytes -= map.memory_bytes();
        (map.records())
            .map(|record| (*record, self.release(record)))
            .collect()
    }

    /// The records of `slot` (for tests).
    #[cfg(test)]
    pub(crate) fn values(&self, slot: u32) -> impl Iterator<Item = &Record> + '_ {
        self.slots[slot as usize].records()
    }

    /// Heap bytes of the maps and the side arena (not what the boxed kinds point to).
    pub(crate) fn memory_bytes(&self) -> usize {
        self.map_bytes
            + self.slots.capacity() * std::mem::size_of::<SlotMap>()
            + self.kinds.capacity() * std::mem::size_of::<Option<Kind>>()
            + self.free.capacity() * std::mem::size_of::<u32>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BlockHash;
    use std::collections::HashMap;

    #[test]
    fn behaves_as_a_map_per_slot() {
        let mut records = Records::default();
        records.ensure_slot(2);
        let mut model: HashMap<(u32, u64), u64> = HashMap::new();
        let mut next = crate::xorshift(0x1234_5678_9ABC_DEF1);
        for stamp in 0..20_000u64 {
            let x = next();
            // Small engine hashes, as some engines have, in three slots; every fourth record
            // boxed.
            let (slot, hash) = ((x % 3) as u32, EngineHash(x % 700));
            if x % 5 < 2 {
                let removed = records.remove(slot, hash);
                if let Some((record, kind)) = &removed {
                    assert_eq!(kind.is_some(), record.boxed().is_some());
                }
                let removed = removed.map(|(r, _)| r.stamp());
                assert_eq!(removed, model.remove(&(slot, hash.0)));
            } else if let Some(mut record) = records.get(slot, hash) {
                record.set_stamp(stamp);
                records.set(slot, hash, record);
                model.insert((slot, hash.0), stamp);
            } else {
                let kind = match x % 4 {
                    0 => Kind::Many(Box::new(vec![BlockHash(1), BlockHash(2)].into())),
                    _ => Kind::One(BlockHash(1)),
                };
                let record = records.new_record(kind, 7, stamp, 1);
                records.insert(slot, hash, record);
                model.insert((slot, hash.0), stamp);
            }
        }
        for slot in 0..3 {
            let mine = model.iter().filter(|((s, _), _)| *s == slot);
            assert_eq!(records.len(slot), mine.clone().count());
            for ((_, hash), stamp) in mine {
                let record = records.get(slot, EngineHash(*hash)).unwrap();
                assert_eq!(record.stamp(), *stamp);
                match records.kind(&record) {
                    Some(kind) => assert_eq!(kind.own().len(), 2),
                    None => assert_eq!(record.place(), Some(7)),
                }
            }
        }
        let boxed = |r: &Records| r.kinds.iter().filter(|k| k.is_some()).count();
        let live = (0..3)
            .flat_map(|s| records.values(s))
            .filter(|r| r.boxed().is_some());
        assert_eq!(boxed(&records), live.count());
        let sizes = |r: &Records| r.slots.iter().map(SlotMap::memory_bytes).sum::<usize>();
        assert!(records.map_bytes > 0);
        assert_eq!(records.map_bytes, sizes(&records));
        let taken = records.take_slot(1);
        assert_eq!(taken.len(), model.keys().filter(|(s, _)| *s == 1).count());
        assert_eq!(records.len(1), 0);
        assert!(records.get(1, EngineHash(3)).is_none());
        assert_eq!(records.slots_in_use(), 2);
        assert_eq!(records.map_bytes, sizes(&records));
        let live = (0..3)
            .flat_map(|s| records.values(s))
            .filter(|r| r.boxed().is_some());
        assert_eq!(boxed(&records), live.count());
    }
}
