//! Dense internal slots for replicas. `KvIndex`'s table keys its holders by slot; the
//! approximate index takes slot `s` as bit `s % 64` of group `s / 64`, so that the holders
//! of a block are one 64-bit mask per group (one group up to 64 replicas). Freed slots are
//! reused lowest first, which keeps slots (and groups) few.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::hasher::{map_bytes, MixMap};
use crate::{BlockHash, ReplicaId};

#[derive(Debug, Default, Clone)]
pub(crate) struct Slots {
    by_id: MixMap<ReplicaId, u32>,
    ids: Vec<Option<ReplicaId>>,
    free: BinaryHeap<Reverse<u32>>,
    /// Changes so far (a slot taken or freed), so that a copy can tell it is behind.
    version: u64,
}

impl Slots {
    pub(crate) fn get(&self, id: ReplicaId) -> Option<u32> {
        self.by_id.get(&id).copied()
    }

    pub(crate) fn get_or_insert(&mut self, id: ReplicaId) -> u32 {
        if let Some(&slot) = self.by_id.get(&id) {
            return slot;
        }
        let slot = match self.free.pop() {
            Some(Reverse(slot)) => slot,
            None => {
                self.ids.push(None);
                (self.ids.len() - 1) as u32
            }
        };
        self.ids[slot as usize] = Some(id);
        self.by_id.insert(id, slot);
        self.version += 1;
        slot
    }

    /// Frees `id`'s slot for reuse; the caller has already cleared its bits.
    pub(crate) fn release(&mut self, id: ReplicaId) -> Option<u32> {
        let slot = self.by_id.remove(&id)?;
        self.ids[slot as usize] = None;
        self.free.push(Reverse(slot));
        self.version += 1;
        Some(slot)
    }

    /// Changes so far: equal versions of one `Slots` and its clone mean equal contents.
    pub(crate) fn version(&self) -> u64 {
        self.version
    }

    /// The replica in `slot`. Panics on a free slot (a bit left set for it is a bug).
    pub(crate) fn id(&self, slot: u32) -> ReplicaId {
        self.ids[slot as usize].expect("a set bit belongs to a live slot")
    }

    /// Groups of 64 slots in use.
    pub(crate) fn groups(&self) -> u32 {
        self.ids.len().div_ceil(64) as u32
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        map_bytes::<ReplicaId, u32>(self.by_id.capacity())
            + self.ids.capacity() * std::mem::size_of::<Option<ReplicaId>>()
            + self.free.capacity() * 4
    }
}

/// The table key of `block` in `group`: the block hash itself in group 0, and a fixed
/// per-group offset of it otherwise (a collision is as likely as a 64-bit hash collision).
pub(crate) fn group_key(block: BlockHash, group: u32) -> u64 {
    block.0 ^ u64::from(group).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// The group and bit of `slot`.
pub(crate) fn split(slot: u32) -> (u32, u64) {
    (slot / 64, 1u64 << (slot % 64))
}

/// Iterates the set bits of `mask` as slot numbers of `group`.
pub(crate) fn bits(mask: u64, group: u32) -> impl Iterator<Item = u32> {
    let mut rest = mask;
    std::iter::from_fn(move || {
        if rest == 0 {
            return None;
        }
        let bit = rest.trailing_zeros();
        rest &= rest - 1;
        Some(group * 64 + bit)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_reused_lowest_first() {
        let mut slots = Slots::default();
        for i in 0..70 {
            assert_eq!(slots.get_or_insert(ReplicaId(100 + i)), i);
        }
        assert_eq!(slots.groups(), 2);
        assert_eq!(slots.get_or_insert(ReplicaId(100)), 0);
        slots.release(ReplicaId(105));
        slots.release(ReplicaId(103));
        assert_eq!(slots.get_or_insert(ReplicaId(7)), 3);
        assert_eq!(slots.get_or_insert(ReplicaId(8)), 5);
        assert_eq!(slots.id(5), ReplicaId(8));
        assert_eq!(slots.get(ReplicaId(105)), None);
    }

    #[test]
    fn bits_iterates_set_bits_in_order() {
        let v: Vec<u32> = bits(0b1010_0001, 1).collect();
        assert_eq!(v, [64, 69, 71]);
        assert_eq!(split(70), (1, 1 << 6));
        assert_eq!(group_key(BlockHash(5), 0), 5);
    }
}
