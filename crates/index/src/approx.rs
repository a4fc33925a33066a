//! [`ApproxIndex`]: the approximate index for replicas that publish no KV events.
//!
//! The router records the blocks of each request it sends to a replica; the replica is taken
//! to hold them (device tier) until `now + ttl`. Recording a held block again moves its
//! deadline to the new `now + ttl`. An entry is expired at `now >= deadline`: queries ignore
//! it from then on, and [`ApproxIndexer::expire`] frees it.
//!
//! Layout: as in [`KvIndex`](crate::KvIndex), a table keyed by the block hash with a mask of
//! the holding replicas per group of 64, plus each holder's deadline and the earliest
//! deadline of the entry, so a query checks deadlines only on entries where one has passed.
//! Deadlines go, in recording order, into a queue that `expire` pops from the front (time is
//! expected not to go backwards; if it does, freeing is late but queries stay exact).
//! [`ApproxIndex::with_max_entries`] bounds the (block, replica) entries: beyond it, the
//! entries recorded longest ago are dropped first. `clear_replica` scans the table (it is
//! rare: a worker removed).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::hasher::{map_bytes, IdentityMap};
use crate::slots::{bits, group_key, split, Slots};
use crate::{ApproxIndexer, BlockHash, OverlapScores, ReplicaId, TierCounts};

/// The approximate index; see the [module docs](self).
#[derive(Debug)]
pub struct ApproxIndex {
    ttl: Duration,
    max_entries: Option<usize>,
    slots: Slots,
    table: IdentityMap<u64, Entry>,
    /// (deadline, block, slot) in recording order; stale ones are skipped when popped.
    queue: VecDeque<(u64, BlockHash, u32)>,
    /// Deadlines are nanoseconds since the first `now` seen.
    origin: Option<Instant>,
    entries: usize,
    distinct: usize,
    /// Heap bytes of the entries' deadline lists.
    deadline_heap: usize,
}

#[derive(Debug, Default)]
struct Entry {
    /// The group of 64 slots `mask` is about.
    group: u32,
    mask: u64,
    earliest: u64,
    /// (bit, deadline) of each holder.
    deadlines: Vec<(u8, u64)>,
}

impl Entry {
    /// The holders whose deadline is after `now`.
    fn live(&self, now: u64) -> u64 {
        if self.earliest > now {
            return self.mask;
        }
        self.deadlines
            .iter()
            .filter(|(_, deadline)| *deadline > now)
            .fold(0, |mask, (bit, _)| mask | 1 << bit)
    }

    fn refresh_earliest(&mut self) {
        self.earliest = self
            .deadlines
            .iter()
            .map(|(_, d)| *d)
            .min()
            .unwrap_or(u64::MAX);
    }

    /// Drops holder `bit` if its deadline is `deadline` (any deadline for `None`).
    fn remove(&mut self, bit: u8, deadline: Option<u64>) -> bool {
        let Some(pos) = self
            .deadlines
            .iter()
            .position(|(b, d)| *b == bit && deadline.is_none_or(|want| *d == want))
        else {
            return false;
        };
        self.deadlines.swap_remove(pos);
        self.mask &= !(1 << bit);
        self.refresh_earliest();
        true
    }
}

impl ApproxIndex {
    /// An unbounded approximate index remembering blocks for `ttl`.
    pub fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            max_entries: None,
            slots: Slots::default(),
            table: IdentityMap::default(),
            queue: VecDeque::new(),
            origin: None,
            entries: 0,
            distinct: 0,
            deadline_heap: 0,
        }
    }

    /// An approximate index holding at most `max_entries` (block, replica) entries.
    pub fn with_max_entries(ttl: Duration, max_entries: usize) -> Self {
        Self {
            max_entries: Some(max_entries),
            ..Self::new(ttl)
        }
    }

    /// (block, replica) entries held, expired ones included until `expire`.
    pub fn num_entries(&self) -> usize {
        self.entries
    }

    /// Approximate heap bytes held.
    pub fn memory_bytes(&self) -> usize {
        map_bytes::<u64, Entry>(self.table.capacity())
            + self.deadline_heap
            + self.queue.capacity() * std::mem::size_of::<(u64, BlockHash, u32)>()
            + self.slots.memory_bytes()
    }

    /// The live entries as the records that rebuild them, oldest first: (replica, how long
    /// before `now` it was recorded, the blocks recorded then). At most the `max_blocks`
    /// most recently recorded blocks. Replaying them through
    /// [`record`](ApproxIndexer::record) at `now - age` gives every block its deadline.
    pub fn records(
        &self,
        now: Instant,
        max_blocks: usize,
    ) -> Vec<(ReplicaId, Duration, Vec<BlockHash>)> {
        let now = self.ticks(now);
        let ttl = u64::try_from(self.ttl.as_nanos()).unwrap_or(u64::MAX);
        let mut out: Vec<(ReplicaId, Duration, Vec<BlockHash>)> = Vec::new();
        let mut last = None;
        let mut taken = 0;
        for &(deadline, block, slot) in self.queue.iter().rev() {
            if taken >= max_blocks {
                break;
            }
            if deadline <= now || !is_current(&self.table, deadline, block, slot) {
                continue;
            }
            taken += 1;
            match out.last_mut() {
                Some(record) if last == Some((slot, deadline)) => record.2.push(block),
                _ => {
                    let age = now.saturating_add(ttl).saturating_sub(deadline);
                    out.push((self.slots.id(slot), Duration::from_nanos(age), vec![block]));
                    last = Some((slot, deadline));
                }
            }
        }
        for record in &mut out {
            record.2.reverse();
        }
        out.reverse();
        out
    }

    fn ticks(&self, now: Instant) -> u64 {
        self.origin.map_or(0, |origin| {
            now.saturating_duration_since(origin).as_nanos() as u64
        })
    }

    /// Removes holder `slot` of `block` if its deadline is `deadline` (any for `None`).
    fn remove(&mut self, block: BlockHash, slot: u32, deadline: Option<u64>) {
        let (group, bit) = split(slot);
        let key = group_key(block, group);
        let Some(entry) = self.table.get_mut(&key) else {
            return;
        };
        let before = entry.deadlines.capacity();
        if !entry.remove(bit.trailing_zeros() as u8, deadline) {
            return;
        }
        self.entries -= 1;
        if entry.mask == 0 {
            self.deadline_heap -= before * 16;
            self.table.remove(&key);
            if !self.in_other_group(block, group) {
                self.distinct -= 1;
            }
        }
    }

    fn in_other_group(&self, block: BlockHash, group: u32) -> bool {
        let groups = self.slots.groups();
        groups > 1
            && (0..groups).any(|g| g != group && self.table.contains_key(&group_key(block, g)))
    }

    fn pop_front(&mut self) {
        if let Some((deadline, block, slot)) = self.queue.pop_front() {
            self.remove(block, slot, Some(deadline));
        }
    }
}

/// Whether the queue entry (`deadline`, `block`, `slot`) is still that holder's deadline
/// (not refreshed or removed since).
fn is_current(table: &IdentityMap<u64, Entry>, deadline: u64, block: BlockHash, slot: u32) -> bool {
    let (group, _) = split(slot);
    let bit = (slot % 64) as u8;
    table
        .get(&group_key(block, group))
        .is_some_and(|e| e.deadlines.contains(&(bit, deadline)))
}

impl ApproxIndexer for ApproxIndex {
    fn record(&mut self, replica: ReplicaId, hashes: &[BlockHash], now: Instant) {
        let origin = *self.origin.get_or_insert(now);
        let deadline = now
            .saturating_duration_since(origin)
            .saturating_add(self.ttl);
        let deadline = deadline.as_nanos() as u64;
        let slot = self.slots.get_or_insert(replica);
        let (group, mask) = split(slot);
        let bit = slot as u8 % 64;
        for &block in hashes {
            let key = group_key(block, group);
            let created = !self.table.contains_key(&key);
            if created && !self.in_other_group(block, group) {
                self.distinct += 1;
            }
            let entry = self.table.entry(key).or_insert_with(|| Entry {
                group,
                ..Entry::default()
            });
            let before = entry.deadlines.capacity();
            if entry.mask & mask != 0 {
                let held = entry.deadlines.iter_mut().find(|(b, _)| *b == bit);
                let held = held.expect("a set bit has a deadline");
                if held.1 == deadline {
                    continue;
                }
                held.1 = deadline;
            } else {
                entry.mask |= mask;
                entry.deadlines.push((bit, deadline));
                self.entries += 1;
            }
            entry.refresh_earliest();
            self.deadline_heap += (entry.deadlines.capacity() - before) * 16;
            self.queue.push_back((deadline, block, slot));
        }
        if let Some(max) = self.max_entries {
            while self.entries > max && !self.queue.is_empty() {
                self.pop_front();
            }
        }
        if self.queue.len() > 2 * self.entries + 1024 {
            let table = &self.table;
            self.queue
                .retain(|&(deadline, block, slot)| is_current(table, deadline, block, slot));
        }
    }

    fn expire(&mut self, now: Instant) {
        let now = self.ticks(now);
        while self
            .queue
            .front()
            .is_some_and(|(deadline, _, _)| *deadline <= now)
        {
            self.pop_front();
        }
    }

    fn clear_replica(&mut self, replica: ReplicaId) {
        let Some(slot) = self.slots.get(replica) else {
            return;
        };
        let (group, mask) = split(slot);
        let bit = slot as u8 % 64;
        let offset = group_key(BlockHash(0), group);
        let mut emptied = Vec::new();
        let mut removed = 0;
        let mut freed = 0;
        self.table.retain(|key, entry| {
            if entry.group != group || entry.mask & mask == 0 {
                return true;
            }
            let before = entry.deadlines.capacity();
            entry.remove(bit, None);
            removed += 1;
            if entry.mask == 0 {
                freed += before * 16;
                emptied.push(BlockHash(*key ^ offset));
                return false;
            }
            true
        });
        self.entries -= removed;
        self.deadline_heap -= freed;
        for block in emptied {
            if !self.in_other_group(block, group) {
                self.distinct -= 1;
            }
        }
        self.slots.release(replica);
    }

    fn find_matches(&self, hashes: &[BlockHash], now: Instant) -> OverlapScores {
        let mut scores = Vec::new();
        let Some(&first) = hashes.first() else {
            return OverlapScores { scores };
        };
        let now = self.ticks(now);
        for group in 0..self.slots.groups() {
            let Some(entry) = self.table.get(&group_key(first, group)) else {
                continue;
            };
            let mut matched = [0u32; 64];
            let holders_of_first = entry.live(now);
            let mut active = holders_of_first;
            let mut i = 0;
            let mut live = holders_of_first;
            loop {
                for b in bits(active & !live, 0) {
                    matched[b as usize] = i as u32;
                }
                active &= live;
                if active == 0 {
                    break;
                }
                i += 1;
                live = hashes
                    .get(i)
                    .and_then(|h| self.table.get(&group_key(*h, group)))
                    .map_or(0, |entry| entry.live(now));
                if i == hashes.len() {
                    for b in bits(active, 0) {
                        matched[b as usize] = i as u32;
                    }
                    break;
                }
            }
            for b in bits(holders_of_first, 0) {
                let counts = TierCounts {
                    device: matched[b as usize],
                    ..TierCounts::default()
                };
                scores.push((self.slots.id(group * 64 + b), counts));
            }
        }
        scores.sort_unstable_by_key(|(id, _)| *id);
        OverlapScores { scores }
    }

    fn num_blocks(&self) -> usize {
        self.distinct
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block_hashes;

    #[test]
    fn its_records_replayed_rebuild_the_index_with_the_same_deadlines() {
        let ttl = Duration::from_secs(60);
        let mut index = ApproxIndex::new(ttl);
        let t0 = Instant::now();
        let a = block_hashes(&(0..128).collect::<Vec<_>>(), 16, 0);
        let b = block_hashes(&(500..628).collect::<Vec<_>>(), 16, 0);
        index.record(ReplicaId(0), &a[..6], t0); // a[2..6] expired at `now`
        index.record(ReplicaId(2), &a[..3], t0 + Duration::from_secs(2));
        index.record(ReplicaId(1), &b, t0 + Duration::from_secs(10));
        // A refresh: a[..2] on replica 0 now expires later than a[2..6].
        index.record(ReplicaId(0), &a[..2], t0 + Duration::from_secs(30));
        let now = t0 + Duration::from_secs(61);
        let records = index.records(now, usize::MAX);
        let shape: Vec<(u32, u64, usize)> = records
            .iter()
            .map(|(r, age, blocks)| (r.0, age.as_secs(), blocks.len()))
            .collect();
        assert_eq!(shape, [(2, 59, 3), (1, 51, 8), (0, 31, 2)]);
        let mut copy = ApproxIndex::new(ttl);
        let later = now + Duration::from_secs(1000);
        for (replica, age, blocks) in &records {
            copy.record(*replica, blocks, later - *age);
        }
        assert_eq!(copy.records(later, usize::MAX), records);
        for dt in [0, 1, 20, 30] {
            let d = Duration::from_secs(dt);
            for q in [&a, &b] {
                assert_eq!(
                    copy.find_matches(q, later + d),
                    index.find_matches(q, now + d),
                    "{dt} s on"
                );
            }
        }
        // The budget keeps the most recent blocks.
        let recent = index.records(now, 3);
        let shape: Vec<(u32, usize)> = recent.iter().map(|(r, _, b)| (r.0, b.len())).collect();
        assert_eq!(shape, [(1, 1), (0, 2)]);
    }

    #[test]
    fn the_bound_drops_the_entries_recorded_longest_ago() {
        let mut index = ApproxIndex::with_max_entries(Duration::from_secs(60), 10);
        let t0 = Instant::now();
        let a = block_hashes(&(0..128).collect::<Vec<_>>(), 16, 0);
        index.record(ReplicaId(0), &a[..6], t0);
        index.record(ReplicaId(1), &a[..4], t0);
        index.record(ReplicaId(0), &a[..2], t0 + Duration::from_secs(1));
        index.record(ReplicaId(2), &a[..3], t0 + Duration::from_secs(2));
        assert_eq!(index.num_entries(), 10);
        let scores = index.find_matches(&a, t0 + Duration::from_secs(2));
        // Replica 0's blocks 2, 3 and 4 went first: 0 and 1 were recorded again.
        assert_eq!(scores.get(ReplicaId(0)).device, 2);
        assert_eq!(scores.get(ReplicaId(1)).device, 4);
        assert_eq!(scores.get(ReplicaId(2)).device, 3);
    }

    #[test]
    fn memory_stays_flat_under_unbounded_traffic() {
        let mut index = ApproxIndex::with_max_entries(Duration::from_secs(60), 5000);
        let t0 = Instant::now();
        let mut peak = 0;
        for i in 0..2000u32 {
            let tokens: Vec<u32> = (i * 1000..i * 1000 + 320).collect();
            let now = t0 + Duration::from_millis(u64::from(i));
            index.record(ReplicaId(i % 16), &block_hashes(&tokens, 16, 0), now);
            assert!(index.num_entries() <= 5000);
            if i == 1000 {
                peak = index.memory_bytes();
            }
        }
        assert!(index.memory_bytes() <= peak * 5 / 4);
        index.expire(t0 + Duration::from_secs(100));
        assert_eq!((index.num_entries(), index.num_blocks()), (0, 0));
        assert!(index.queue.is_empty());
    }
}
