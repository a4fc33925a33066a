//! Every replica's engine blocks: the [`Record`]s of all slots in one arena of 1 MiB chunks,
//! in store order (a freed one reused last freed, first reused), and per slot a
//! [`TagIndex`] of the engine hashes (tagged by a mix of the hash) to the records' positions.
//! A record costs its 32 bytes in the arena and about 14 in its slot's index; a slot's index
//! is small enough to stay in cache while its events are applied, and records stored
//! together lie together.

use super::record::{Kind, Record};
use super::tags::TagIndex;
use crate::{BlockHash, EngineHash};

const MIN_ENTRIES: usize = 16;
/// Records per arena chunk (1 MiB).
const CHUNK_BITS: u32 = 15;
const CHUNK: usize = 1 << CHUNK_BITS;

#[derive(Debug)]
struct Held {
    engine: EngineHash,
    record: Record,
}

#[derive(Debug, Default)]
pub(crate) struct Records {
    /// Chunks of `CHUNK` records: growing never copies, the slack is one chunk at most, and
    /// no allocation is large enough to bypass the allocator's reuse of freed memory.
    arena: Vec<Vec<Held>>,
    /// Records in the arena, freed ones included.
    used: usize,
    /// Free arena positions, the last freed last.
    free: Vec<u32>,
    slots: Vec<TagIndex>,
    /// Heap bytes of the slots' indexes, kept as they grow and go (summing them over the slots
    /// took 0.2 µs at 1,024 replicas, and the router reads the size after every event).
    index_bytes: usize,
}

/// The index tag of an engine hash: engine hashes come from engines (any values), so one
/// folded multiply spreads them first. Its low bits are the entry's home, so growth and
/// removal move entries without reading their records.
fn tag(hash: EngineHash) -> u32 {
    let m = u128::from(hash.0 ^ 0x243F_6A88_85A3_08D3) * u128::from(0x9E37_79B9_7F4A_7C15u64);
    let mixed = (m as u64) ^ ((m >> 64) as u64);
    (mixed >> 32) as u32
}

fn placeholder() -> Record {
    Record::new(Kind::One(BlockHash(0), 0), 0, 0)
}

fn held_in(arena: &[Vec<Held>], at: u32) -> &Held {
    &arena[(at >> CHUNK_BITS) as usize][at as usize & (CHUNK - 1)]
}

impl Records {
    fn held(&self, at: u32) -> &Held {
        held_in(&self.arena, at)
    }

    fn held_mut(&mut self, at: u32) -> &mut Held {
        &mut self.arena[(at >> CHUNK_BITS) as usize][at as usize & (CHUNK - 1)]
    }

    /// Makes room for slots up to `slot`.
    pub(crate) fn ensure_slot(&mut self, slot: u32) {
        if self.slots.len() <= slot as usize {
            self.slots.resize_with(slot as usize + 1, TagIndex::default);
        }
    }

    /// Engine blocks of `slot`.
    #[cfg(test)]
    pub(crate) fn len(&self, slot: u32) -> usize {
        self.slots.get(slot as usize).map_or(0, TagIndex::len)
    }

    /// Slots holding at least one engine block.
    pub(crate) fn slots_in_use(&self) -> usize {
        self.slots.iter().filter(|index| index.len() > 0).count()
    }

    /// The arena position of `hash` of `slot`.
    pub(crate) fn find(&self, slot: u32, hash: EngineHash) -> Option<u32> {
        self.locate(slot, hash).map(|(_, at)| at)
    }

    /// Loads the index entry `hash` of `slot` probes first (see `FlatMap::touch`).
    pub(crate) fn touch(&self, slot: u32, hash: EngineHash) {
        self.slots[slot as usize].touch(tag(hash));
    }

    pub(crate) fn get(&self, slot: u32, hash: EngineHash) -> Option<&Record> {
        self.find(slot, hash).map(|at| self.at(at))
    }

    pub(crate) fn get_mut(&mut self, slot: u32, hash: EngineHash) -> Option<&mut Record> {
        self.find(slot, hash).map(|at| self.at_mut(at))
    }

    pub(crate) fn contains(&self, slot: u32, hash: EngineHash) -> bool {
        self.find(slot, hash).is_some()
    }

    pub(crate) fn at(&self, at: u32) -> &Record {
        &self.held(at).record
    }

    pub(crate) fn at_mut(&mut self, at: u32) -> &mut Record {
        &mut self.held_mut(at).record
    }

    /// Where `hash` of `slot` is: its arena position, or the empty index entry it would take
    /// ([`Self::insert_at`], the slot's index unchanged meanwhile). Makes room for one more
    /// record first, so that one probe serves the lookup and the insertion.
    pub(crate) fn find_or_vacant(&mut self, slot: u32, hash: EngineHash) -> Result<u32, usize> {
        self.index_bytes += self.slots[slot as usize].reserve(MIN_ENTRIES);
        let (arena, index) = (&self.arena, &self.slots[slot as usize]);
        match index.probe(tag(hash), |at| held_in(arena, at).engine == hash) {
            (_, Some(at)) => Ok(at),
            (entry, None) => Err(entry),
        }
    }

    /// Adds `hash` of `slot`, which must not be there yet.
    #[cfg(test)]
    pub(crate) fn insert(&mut self, slot: u32, hash: EngineHash, record: Record) {
        let entry = self
            .find_or_vacant(slot, hash)
            .expect_err("inserting a record already there");
        self.insert_at(slot, entry, hash, record);
    }

    /// Adds `hash` of `slot` at the empty index entry `entry` ([`Self::find_or_vacant`]'s
    /// answer).
    pub(crate) fn insert_at(&mut self, slot: u32, entry: usize, hash: EngineHash, record: Record) {
        let held = Held {
            engine: hash,
            record,
        };
        let at = match self.free.pop() {
            Some(at) => {
                *self.held_mut(at) = held;
                at
            }
            None => {
                if self.used.is_multiple_of(CHUNK) {
                    // The first chunk grows by doubling (a small index stays small); later
                    // ones are allocated whole, never copied.
                    let capacity = if self.arena.is_empty() { 0 } else { CHUNK };
                    self.arena.push(Vec::with_capacity(capacity));
                }
                let chunk = self.arena.last_mut().expect("a chunk with room");
                if chunk.len() == chunk.capacity() {
                    chunk.reserve_exact(chunk.len().clamp(64, CHUNK - chunk.len()));
                }
                chunk.push(held);
                self.used += 1;
                (self.used - 1) as u32
            }
        };
        self.slots[slot as usize].set(entry, tag(hash), at);
    }

    /// The index entry and the arena position of `hash` of `slot`.
    #[inline]
    pub(crate) fn locate(&self, slot: u32, hash: EngineHash) -> Option<(usize, u32)> {
        self.slots
            .get(slot as usize)?
            .find(tag(hash), |at| self.held(at).engine == hash)
    }

    /// Removes `hash` of `slot`, returning its record.
    #[cfg(test)]
    pub(crate) fn remove(&mut self, slot: u32, hash: EngineHash) -> Option<Record> {
        let (entry, _) = self.locate(slot, hash)?;
        Some(self.remove_entry(slot, entry))
    }

    /// [`Self::locate`]'s answer `found` for `hash` of `slot`, checked: the same where its
    /// entry still holds the record, else looked up again (a removal since may have shifted
    /// the entry back, or removed the record).
    #[inline]
    pub(crate) fn relocate(
        &self,
        slot: u32,
        hash: EngineHash,
        found: (usize, u32),
    ) -> Option<(usize, u32)> {
        if self.slots[slot as usize].holds(found.0, found.1) {
            Some(found)
        } else {
            self.locate(slot, hash)
        }
    }

    /// Removes the record of index entry `entry` of `slot` (as [`locate`](Self::locate) found
    /// it, the slot's index unchanged since), returning it.
    #[inline]
    pub(crate) fn remove_entry(&mut self, slot: u32, entry: usize) -> Record {
        let at = self.slots[slot as usize].remove(entry);
        self.release(at)
    }

    fn release(&mut self, at: u32) -> Record {
        self.free.push(at);
        std::mem::replace(&mut self.held_mut(at).record, placeholder())
    }

    /// Removes every record of `slot`, returning them.
    pub(crate) fn take_slot(&mut self, slot: u32) -> Vec<Record> {
        let Some(index) = self.slots.get_mut(slot as usize) else {
            return Vec::new();
        };
        let index = std::mem::take(index);
        self.index_bytes -= index.memory_bytes();
        index.positions().map(|at| self.release(at)).collect()
    }

    /// The records of `slot` (for tests).
    #[cfg(test)]
    pub(crate) fn values(&self, slot: u32) -> impl Iterator<Item = &Record> + '_ {
        self.slots[slot as usize].positions().map(|at| self.at(at))
    }

    /// Heap bytes of the arena and the indexes (not what the records point to).
    pub(crate) fn memory_bytes(&self) -> usize {
        self.arena.iter().map(Vec::capacity).sum::<usize>() * std::mem::size_of::<Held>()
            + self.arena.capacity() * std::mem::size_of::<Vec<Held>>()
            + self.free.capacity() * std::mem::size_of::<u32>()
            + self.slots.capacity() * std::mem::size_of::<TagIndex>()
            + self.index_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn behaves_as_a_map_per_slot() {
        let mut records = Records::default();
        records.ensure_slot(2);
        let mut model: HashMap<(u32, u64), u64> = HashMap::new();
        let mut x = 0x1234_5678_9ABC_DEF1u64;
        for stamp in 0..20_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Small engine hashes, as some engines have, in three slots.
            let (slot, hash) = ((x % 3) as u32, EngineHash(x % 700));
            if x % 5 < 2 {
                let removed = records.remove(slot, hash).map(|r| r.stamp());
                assert_eq!(removed, model.remove(&(slot, hash.0)));
            } else if let Some(record) = records.get_mut(slot, hash) {
                record.set_stamp(stamp);
                model.insert((slot, hash.0), stamp);
            } else {
                records.insert(
                    slot,
                    hash,
                    Record::new(Kind::One(BlockHash(1), 0), stamp, 1),
                );
                model.insert((slot, hash.0), stamp);
            }
        }
        for slot in 0..3 {
            let mine = model.iter().filter(|((s, _), _)| *s == slot);
            assert_eq!(records.len(slot), mine.clone().count());
            for ((_, hash), stamp) in mine {
                assert_eq!(
                    records.get(slot, EngineHash(*hash)).unwrap().stamp(),
                    *stamp
                );
                assert!(records.contains(slot, EngineHash(*hash)));
            }
        }
        let index_bytes = |r: &Records| r.slots.iter().map(TagIndex::memory_bytes).sum::<usize>();
        assert!(records.index_bytes > 0);
        assert_eq!(records.index_bytes, index_bytes(&records));
        let taken = records.take_slot(1);
        assert_eq!(taken.len(), model.keys().filter(|(s, _)| *s == 1).count());
        assert_eq!(records.len(1), 0);
        assert!(records.get(1, EngineHash(3)).is_none());
        assert_eq!(records.slots_in_use(), 2);
        assert_eq!(records.index_bytes, index_bytes(&records));
    }
}
