//! hashbrown tables that resize a step at a time, for the index's maps that grow with what it
//! holds (a replica's records, the runs by first hash, the extra holdings), so that no write
//! holds the index for long.
//!
//! hashbrown alone resizes a full table inside one insertion: it doubles it, or rehashes it in
//! place where removals left it full of tombstones, moving every entry. Under the index's
//! write that is the single index's lock, which every routing decision takes: about 20 ms for
//! a replica's million records. Here a full table of [`GRADUAL_FROM`] buckets or more is
//! replaced by a new one (twice the buckets, or as many where at most half of it is held), and
//! each later insertion first copies the entries of the next [`STEP`] buckets of the old one.
//! Until the last is copied, a key missing from the new table is looked up in the old one too,
//! where a bucket already copied is dead (copies are not removed, which would cost a control
//! byte's write each). The new table is sized so that it never fills before the old one is
//! copied: it takes at most the old one's entries and an insertion a step.
//!
//! Entries are addressed by *position*: the bucket, with [`OLD`] set for the old table's. A
//! position stays valid until the next insertion, which may copy its entry away.

use hashbrown::hash_table::OccupiedEntry;
use hashbrown::HashTable;

use crate::hasher::mix;

/// Marks a position in the old table (while resizing).
const OLD: usize = 1 << 62;

/// Tables of fewer buckets resize at once (hashbrown's own resize, under 100 µs: at most
/// 3,584 entries of 16 bytes moved).
#[cfg(not(test))]
const GRADUAL_FROM: usize = 1 << 13;
#[cfg(test)]
const GRADUAL_FROM: usize = 1 << 4;
/// Old buckets an insertion copies while resizing (at most 7/8 of them hold an entry): about
/// 20 µs for an event of 16 blocks.
#[cfg(not(test))]
const STEP: usize = 64;
#[cfg(test)]
const STEP: usize = 3;

/// An entry that knows its hash.
pub(crate) trait Hashed: Copy {
    fn hash(&self) -> u64;
}

#[derive(Debug)]
pub(crate) struct Gradual<T> {
    table: HashTable<T>,
    /// While resizing, the table whose entries are copied to `table` (empty otherwise): its
    /// buckets from `cursor` on are live, `copied` of its entries are dead copies.
    old: HashTable<T>,
    cursor: usize,
    copied: usize,
    resizing: bool,
    /// Where `table`'s entries lie, once an insertion showed it; `None` again when a resize
    /// may move them ([`Self::lines`]).
    lines: Option<Lines<T>>,
}

impl<T> Default for Gradual<T> {
    fn default() -> Self {
        Self {
            table: HashTable::new(),
            old: HashTable::new(),
            cursor: 0,
            copied: 0,
            resizing: false,
            lines: None,
        }
    }
}

impl<T: Hashed> Gradual<T> {
    pub(crate) fn len(&self) -> usize {
        self.table.len() + self.old.len() - self.copied
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    #[cfg(test)]
    pub(crate) fn resizing(&self) -> bool {
        self.resizing
    }

    #[cfg(test)]
    pub(crate) fn buckets(&self) -> usize {
        self.table.num_buckets()
    }

    /// The position of the entry `eq` picks among those hashed to `hash`.
    #[inline]
    pub(crate) fn find(&self, hash: u64, mut eq: impl FnMut(&T) -> bool) -> Option<usize> {
        if let Some(i) = self.table.find_bucket_index(hash, &mut eq) {
            return Some(i);
        }
        self.find_old(hash, eq).map(|i| i | OLD)
    }

    /// The old table's live bucket of the entry `eq` picks (while resizing).
    #[inline]
    fn find_old(&self, hash: u64, eq: impl FnMut(&T) -> bool) -> Option<usize> {
        match self.resizing {
            true => self.find_old_resizing(hash, eq),
            false => None,
        }
    }

    #[cold]
    #[inline(never)]
    fn find_old_resizing(&self, hash: u64, eq: impl FnMut(&T) -> bool) -> Option<usize> {
        let i = self.old.find_bucket_index(hash, eq)?;
        (i >= self.cursor).then_some(i)
    }

    /// The old table's bucket of an old position, where it is not copied yet.
    #[inline]
    fn old_bucket(&self, position: usize) -> Option<usize> {
        let bucket = position & !OLD;
        (self.resizing && bucket >= self.cursor).then_some(bucket)
    }

    #[inline]
    pub(crate) fn get(&self, position: usize) -> Option<&T> {
        match position & OLD {
            0 => self.table.get_bucket(position),
            _ => self.get_old(position),
        }
    }

    #[cold]
    #[inline(never)]
    fn get_old(&self, position: usize) -> Option<&T> {
        self.old.get_bucket(self.old_bucket(position)?)
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, position: usize) -> Option<&mut T> {
        match position & OLD {
            0 => self.table.get_bucket_mut(position),
            _ => self.get_old_mut(position),
        }
    }

    #[cold]
    #[inline(never)]
    fn get_old_mut(&mut self, position: usize) -> Option<&mut T> {
        let bucket = self.old_bucket(position)?;
        self.old.get_bucket_mut(bucket)
    }

    /// The entry at `position`, to change or remove in one access.
    #[inline]
    pub(crate) fn occupied(&mut self, position: usize) -> Option<OccupiedEntry<'_, T>> {
        match position & OLD {
            0 => self.table.get_bucket_entry(position).ok(),
            _ => self.occupied_old(position),
        }
    }

    #[cold]
    #[inline(never)]
    fn occupied_old(&mut self, position: usize) -> Option<OccupiedEntry<'_, T>> {
        let bucket = self.old_bucket(position)?;
        self.old.get_bucket_entry(bucket).ok()
    }

    /// The position of the entry `eq` picks among those hashed to `hash`, inserting `make()`
    /// there first where there is none.
    #[inline]
    pub(crate) fn find_or_insert(
        &mut self,
        hash: u64,
        mut eq: impl FnMut(&T) -> bool,
        make: impl FnOnce() -> T,
    ) -> usize {
        if self.resizing || self.table.len() == self.table.capacity() {
            self.make_room();
            if let Some(i) = self.find_old(hash, &mut eq) {
                return i | OLD;
            }
        }
        let buckets = self.table.num_buckets();
        let occupied = match self.table.entry(hash, eq, T::hash) {
            hashbrown::hash_table::Entry::Occupied(occupied) => occupied,
            hashbrown::hash_table::Entry::Vacant(vacant) => vacant.insert(make()),
        };
        let bucket = occupied.bucket_index();
        if self.lines.is_none() {
            self.lines = Some(Lines::new(occupied.get(), bucket, buckets));
        }
        bucket
    }

    /// Inserts `value`, whose key must not be there yet.
    #[inline]
    pub(crate) fn insert_unique(&mut self, value: T) {
        self.room();
        self.table.insert_unique(value.hash(), value, T::hash);
    }

    /// Removes the entry `eq` picks among those hashed to `hash`.
    pub(crate) fn remove(&mut self, hash: u64, eq: impl FnMut(&T) -> bool) -> Option<T> {
        let position = self.find(hash, eq)?;
        Some(self.occupied(position)?.remove().0)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> + '_ {
        let old = match self.resizing {
            true => self.cursor..self.old.num_buckets(),
            false => 0..0,
        };
        (self.table.iter()).chain(old.filter_map(|i| self.old.get_bucket(i)))
    }

    /// Where the current table's entries lie, to prefetch the buckets of hashes before they
    /// are probed: known once an insertion into the current table showed it.
    #[inline]
    pub(crate) fn lines(&self) -> Option<Lines<T>> {
        self.lines
    }

    /// Heap bytes (both tables while resizing).
    #[inline]
    pub(crate) fn memory_bytes(&self) -> usize {
        self.table.allocation_size() + self.old.allocation_size()
    }

    /// Room in `table` for one more entry: a step of a resize under way, or a resize begun
    /// where `table` is full.
    #[inline]
    fn room(&mut self) {
        if self.resizing || self.table.len() == self.table.capacity() {
            self.make_room();
        }
    }

    #[cold]
    #[inline(never)]
    fn make_room(&mut self) {
        // Whatever moves `table` happens here.
        self.lines = None;
        self.step(STEP);
        if self.table.len() < self.table.capacity() {
            return;
        }
        // Full while resizing (not with the sizes chosen below): the old table first.
        self.step(usize::MAX);
        let buckets = self.table.num_buckets();
        if buckets < GRADUAL_FROM {
            self.table.reserve(1, T::hash);
            return;
        }
        // hashbrown's choice: as many buckets again where at most half are held (tombstones
        // fill the rest), else twice as many.
        let full = buckets / 8 * 7;
        let capacity = match self.table.len() < full / 2 {
            true => full,
            false => full * 2,
        };
        self.old = std::mem::replace(&mut self.table, HashTable::with_capacity(capacity));
        (self.cursor, self.copied, self.resizing) = (0, 0, true);
        self.step(STEP);
    }

    /// Copies the entries of the old table's next `buckets` buckets to `table`.
    fn step(&mut self, buckets: usize) {
        if !self.resizing {
            return;
        }
        let end = self
            .cursor
            .saturating_add(buckets)
            .min(self.old.num_buckets());
        for i in self.cursor..end {
            if let Some(&entry) = self.old.get_bucket(i) {
                debug_assert!(
                    self.table.len() < self.table.capacity(),
                    "room while resizing"
                );
                self.table.insert_unique(entry.hash(), entry, T::hash);
                self.copied += 1;
            }
        }
        self.cursor = end;
        if end == self.old.num_buckets() {
            self.old = HashTable::new();
            (self.cursor, self.copied, self.resizing) = (0, 0, false);
        }
    }
}

/// The cache lines a hash's first probe reads in one hashbrown table: its bucket's entry and
/// the group of control bytes from it. hashbrown keeps bucket `i`'s entry at `end - (i + 1) *
/// size_of::<T>()` and its control byte at `end + i`, and starts a probe at bucket `hash &
/// (buckets - 1)`; `end` is worked out from an entry whose bucket is known. Only addresses,
/// for prefetch instructions: were that layout to change, a hint would go to the wrong line
/// and cost no more than a wasted hint (a test checks the layout).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Lines<T> {
    end: usize,
    mask: usize,
    entries: std::marker::PhantomData<T>,
}

impl<T> Lines<T> {
    fn new(entry: &T, bucket: usize, buckets: usize) -> Self {
        let size = std::mem::size_of::<T>();
        let end = (entry as *const T as usize).wrapping_add((bucket + 1) * size);
        Self {
            end,
            mask: buckets.wrapping_sub(1),
            entries: std::marker::PhantomData,
        }
    }

    /// Where the entry of bucket `bucket` would lie.
    #[inline]
    fn entry_at(&self, bucket: usize) -> usize {
        let size = std::mem::size_of::<T>();
        self.end.wrapping_sub((bucket + 1) * size)
    }

    /// Prefetches the first bucket `hash` probes: its entry and its control bytes.
    #[inline]
    pub(crate) fn prefetch(&self, hash: u64) {
        let bucket = hash as usize & self.mask;
        super::prefetch_at(self.entry_at(bucket) as *const u8);
        super::prefetch_at(self.end.wrapping_add(bucket) as *const u8);
    }
}

/// Router block hash → a `u32` (a run, or a place), in a [`Gradual`] table.
#[derive(Debug, Default)]
pub(crate) struct HashIndex(Gradual<ByHash>);

#[derive(Debug, Clone, Copy)]
struct ByHash {
    hash: u64,
    value: u32,
}

impl Hashed for ByHash {
    /// Router block hashes are uniform already.
    #[inline]
    fn hash(&self) -> u64 {
        self.hash
    }
}

impl HashIndex {
    #[inline]
    pub(crate) fn get(&self, hash: u64) -> Option<u32> {
        let at = self.0.find(hash, |e| e.hash == hash)?;
        self.0.get(at).map(|e| e.value)
    }

    /// Sets `hash`'s value.
    pub(crate) fn insert(&mut self, hash: u64, value: u32) {
        let at = (self.0).find_or_insert(hash, |e| e.hash == hash, || ByHash { hash, value });
        self.0.get_mut(at).expect("just found").value = value;
    }

    pub(crate) fn remove(&mut self, hash: u64) -> Option<u32> {
        self.0.remove(hash, |e| e.hash == hash).map(|e| e.value)
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        self.0.memory_bytes()
    }
}

/// Holdings beyond the first of a router block by one (slot, tier), by (place, slot, tier), in
/// a [`Gradual`] table.
#[derive(Debug, Default)]
pub(crate) struct ExtraHoldings(Gradual<Extra>);

#[derive(Debug, Clone, Copy)]
struct Extra {
    place: u32,
    slot: u32,
    tier: u8,
    count: u32,
}

impl Hashed for Extra {
    #[inline]
    fn hash(&self) -> u64 {
        mix(u64::from(self.place) << 32 | u64::from(self.slot)) ^ u64::from(self.tier)
    }
}

impl Extra {
    /// The entry of (place, slot, tier) with no count, and a test for it.
    fn key(place: u32, slot: u32, tier: u8) -> (Self, impl Fn(&Self) -> bool) {
        let key = Self {
            place,
            slot,
            tier,
            count: 0,
        };
        (key, move |e: &Self| {
            (e.place, e.slot, e.tier) == (place, slot, tier)
        })
    }
}

impl ExtraHoldings {
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// One more holding beyond the first.
    pub(crate) fn add(&mut self, place: u32, slot: u32, tier: u8) {
        let (new, same) = Extra::key(place, slot, tier);
        let at = self.0.find_or_insert(new.hash(), same, || new);
        self.0.get_mut(at).expect("just found").count += 1;
    }

    /// One holding beyond the first fewer, where there is one.
    pub(crate) fn take(&mut self, place: u32, slot: u32, tier: u8) -> bool {
        let (key, same) = Extra::key(place, slot, tier);
        let Some(at) = self.0.find(key.hash(), same) else {
            return false;
        };
        let mut occupied = self.0.occupied(at).expect("just found");
        occupied.get_mut().count -= 1;
        if occupied.get().count == 0 {
            occupied.remove();
        }
        true
    }

    #[cfg(test)]
    pub(crate) fn holds_slot(&self, slot: u32) -> bool {
        self.0.iter().any(|e| e.slot == slot)
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        self.0.memory_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Random inserts, changes and removals of small and colliding keys against a map, with
    /// tables resizing a step at a time from 16 buckets here, three buckets a step: checked
    /// while resizing too, growing, and at a steady size (tombstones filling the table).
    #[test]
    fn behaves_as_a_map_while_resizing() {
        for range in [300u64, 3_000] {
            let mut map = HashIndex::default();
            let mut model: HashMap<u64, u32> = HashMap::new();
            let mut next = crate::xorshift(0x9E37_79B9_7F4A_7C15);
            let mut resizing = 0;
            for round in 0..20_000u32 {
                let x = next();
                // Keys spread over the hash's top bits and low bits both.
                let key = (x % range).rotate_right(7) | (x % range);
                if x.is_multiple_of(3) {
                    assert_eq!(map.remove(key), model.remove(&key), "round {round}");
                } else {
                    map.insert(key, round);
                    model.insert(key, round);
                }
                assert_eq!(map.get(key), model.get(&key).copied(), "round {round}");
                assert_eq!(map.len(), model.len(), "round {round}");
                resizing += usize::from(map.0.resizing());
            }
            for (key, value) in &model {
                assert_eq!(map.get(*key), Some(*value));
            }
            let mut seen: Vec<(u64, u32)> = map.0.iter().map(|e| (e.hash, e.value)).collect();
            let mut expected: Vec<(u64, u32)> = model.into_iter().collect();
            seen.sort_unstable();
            expected.sort_unstable();
            assert_eq!(seen, expected);
            assert!(resizing > 100, "{range} keys: resizing {resizing} times");
            assert!(map.0.buckets() > GRADUAL_FROM, "{range} keys");
        }
    }

    /// The prefetched lines are where hashbrown keeps the entries, through resizes: each
    /// entry of the current table lies where [`Lines`] says its bucket's entry does (the
    /// control bytes cannot be seen from outside; a wrong guess there costs a wasted hint).
    #[test]
    fn the_lines_are_where_the_entries_are() {
        let mut map = HashIndex::default();
        let mut keys = Vec::new();
        let (mut checked, mut next) = (0, crate::xorshift(0x2545_F491_4F6C_DD1D));
        for round in 0..3_000u32 {
            let key = next();
            map.insert(key, round);
            keys.push(key);
            let lines = map.0.lines().expect("known after an insertion");
            for &key in keys.iter().rev().take(8) {
                let at = map.0.find(key, |e| e.hash == key).expect("inserted");
                if at & OLD == 0 {
                    let entry = map.0.get(at).expect("live");
                    assert_eq!(lines.entry_at(at), entry as *const ByHash as usize);
                    checked += 1;
                }
            }
        }
        assert!(
            map.0.buckets() > GRADUAL_FROM && checked > 10_000,
            "{checked}"
        );
    }

    /// A full table resizes to as many buckets where removals left it at most half held, so
    /// that a steady size does not grow the table.
    #[test]
    fn a_steady_size_keeps_its_buckets() {
        let mut map = HashIndex::default();
        let mut buckets = 0;
        for key in 0..20_000u64 {
            if key >= 40 {
                map.remove((key - 40) << 32 | (key - 40));
            }
            map.insert(key << 32 | key, 0);
            assert_eq!(map.len(), (key + 1).min(40) as usize);
            if key == 1_000 {
                buckets = map.0.buckets();
            }
        }
        assert_eq!(map.0.buckets(), buckets);
    }
}
