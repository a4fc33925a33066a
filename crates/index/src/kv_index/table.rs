//! The block table: for each (router block, group of 64 slots), one holder mask per tier.
//!
//! A bit set in `tiers[t]` means the slot holds the block in tier `t` at least once. The
//! device masks live in a [`FlatMap`] (an arena of 16-byte nodes in insertion order, the first
//! node of each run stored together found by an open-addressing index of 8-byte entries, the
//! others after their parent's node); the masks of the other
//! tiers, rarer, in a side map, `lower`, consulted only when it is not empty. Counts above one
//! (several engine blocks covering one router block) live in another side map, `extra`, which
//! stays empty in the common one-to-one case.
//!
//! The query walks the request's blocks in order with a mask of the replicas still matching:
//! one step per block per group (the node after the last one matched, which is where a chain
//! stored together lies, else a lookup), and the per-replica work happens only when a replica
//! drops out or holds a block outside the device tier. Counts per tier follow from
//! `device = matched - host - disk - external`.

use super::flat::{self, FlatMap};
use crate::hasher::{map_bytes, IdentityMap, MixMap};
use crate::slots::{bits, group_key, split, Slots};
use crate::{BlockHash, OverlapScores, TierCounts};

/// Tier indices: device, host, disk, external.
pub(crate) const TIERS: usize = 4;

/// Where [`BlockTable::inc`] finds or puts a block's node.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Place {
    /// After the node of the block's parent for the slot's group (see [`FlatMap`]'s heads and
    /// tails); `None` for a chain's first block, or once [`BlockTable::heads_only`] was called.
    After(Option<u32>),
    /// At this node: the block's, which the slot already holds in another tier.
    At(u32),
}

/// One holding, as [`BlockTable::inc`] adds it and [`BlockTable::dec`] takes it: `block` by
/// `slot` in `tier`, with `groups` slot groups at the time.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Holding {
    block: BlockHash,
    slot: u32,
    tier: u8,
    groups: u32,
}

impl Holding {
    fn new(block: BlockHash, slot: u32, tier: usize, groups: u32) -> Self {
        let tier = tier as u8;
        Self {
            block,
            slot,
            tier,
            groups,
        }
    }

    /// (block, slot, tier, groups), as `inc` and `dec` take them.
    fn parts(self) -> (BlockHash, u32, usize, u32) {
        (self.block, self.slot, usize::from(self.tier), self.groups)
    }
}

/// A change to the table, as [`BlockTable::replay`] applies it again to a copy that has applied
/// the same changes up to it (a mirrored shard's other copy): the copy then assigns the same
/// nodes.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Change {
    Inc(Holding, Place),
    Dec(Holding, Option<u32>),
    HeadsOnly,
}

#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Holders {
    tiers: [u64; TIERS],
}

impl Holders {
    fn any(&self) -> u64 {
        self.tiers[0] | self.tiers[1] | self.tiers[2] | self.tiers[3]
    }
}

#[derive(Debug, Default)]
pub(crate) struct BlockTable {
    /// Table key → device mask; an entry exists while some slot holds the key in some tier.
    map: FlatMap,
    /// Table key → host, disk and external masks, while one is not zero.
    lower: IdentityMap<u64, [u64; 3]>,
    /// (table key, slot, tier) → holdings beyond the first.
    extra: MixMap<(u64, u32, u8), u32>,
    /// With more than one group of slots: router block → the groups holding it, so that
    /// `distinct` follows in one lookup (not one per group). Built when a second group appears
    /// (every key then is group 0's, which is the block itself).
    groups_of: Option<IdentityMap<u64, u32>>,
    distinct: usize,
    /// Count (block, group) entries instead of distinct blocks past one group (see
    /// [`KvIndex::counting_entries`](super::KvIndex::counting_entries)).
    entries_only: bool,
    /// While set, every change is also appended here ([`Self::log_into`]).
    log: Option<Vec<Change>>,
}

impl BlockTable {
    /// Distinct router blocks held by some slot (with `entries_only`, the entries).
    pub(crate) fn distinct(&self) -> usize {
        self.distinct
    }

    /// From now on, counts (block, group) entries (see the field).
    pub(crate) fn count_entries_only(&mut self) {
        self.entries_only = true;
        self.groups_of = None;
    }

    /// One more holding of `block` by `slot` in `tier`; `groups` is the number of slot groups.
    /// Returns `block`'s node for `slot`'s group, which stays where it is while held.
    #[inline]
    pub(crate) fn inc(
        &mut self,
        block: BlockHash,
        place: Place,
        slot: u32,
        tier: usize,
        groups: u32,
    ) -> u32 {
        let holding = Holding::new(block, slot, tier, groups);
        self.logged(|| Change::Inc(holding, place));
        self.inc_now(holding, place)
    }

    fn inc_now(&mut self, holding: Holding, place: Place) -> u32 {
        let (block, slot, tier, groups) = holding.parts();
        let (group, bit) = split(slot);
        let key = group_key(block, group);
        self.count_groups(groups);
        let (at, created) = match place {
            Place::After(after) => self.map.insert(key, after.map(|a| a as usize)),
            Place::At(at) => {
                debug_assert_eq!(self.map.key(at as usize), flat::stored(key));
                (at as usize, false)
            }
        };
        let mask = if tier == 0 {
            self.map.value_mut(at)
        } else {
            &mut self.lower.entry(key).or_default()[tier - 1]
        };
        if *mask & bit == 0 {
            *mask |= bit;
        } else {
            *self.extra.entry((key, slot, tier as u8)).or_insert(0) += 1;
        }
        if created {
            self.group_gained(block);
        }
        at as u32
    }

    /// One holding fewer (saturating: nothing happens when the slot does not hold it). `at`
    /// is `block`'s node for `slot`'s group as [`Self::inc`] returned it, else (after
    /// [`Self::heads_only`]) it is looked up.
    #[inline]
    pub(crate) fn dec(
        &mut self,
        block: BlockHash,
        at: Option<u32>,
        slot: u32,
        tier: usize,
        groups: u32,
    ) {
        let holding = Holding::new(block, slot, tier, groups);
        self.logged(|| Change::Dec(holding, at));
        self.dec_now(holding, at);
    }

    #[inline]
    fn dec_now(&mut self, holding: Holding, at: Option<u32>) {
        let (block, slot, tier, groups) = holding.parts();
        let (group, bit) = split(slot);
        let key = group_key(block, group);
        let at = match at {
            Some(at) => at as usize,
            None => {
                debug_assert!(self.map.is_heads_only(), "a tail is found by its parent");
                match self.map.find(key) {
                    Some(at) => at,
                    None => return,
                }
            }
        };
        debug_assert_eq!(self.map.key(at), flat::stored(key), "a held node stays");
        self.count_groups(groups);
        let held = if tier == 0 {
            self.map.value(at)
        } else {
            self.lower.get(&key).map_or(0, |lower| lower[tier - 1])
        };
        if held & bit == 0 {
            return;
        }
        if !self.extra.is_empty() {
            if let Some(more) = self.extra.get_mut(&(key, slot, tier as u8)) {
                *more -= 1;
                if *more == 0 {
                    self.extra.remove(&(key, slot, tier as u8));
                }
                return;
            }
        }
        let mut lower_left = false;
        if tier == 0 {
            *self.map.value_mut(at) &= !bit;
        } else if let Some(lower) = self.lower.get_mut(&key) {
            lower[tier - 1] &= !bit;
            lower_left = *lower != [0; 3];
            if !lower_left {
                self.lower.remove(&key);
            }
        }
        if !lower_left && !self.lower.contains_key(&key) && self.map.value(at) == 0 {
            self.map.remove(at);
            self.group_lost(block);
        }
    }

    /// From now on blocks are looked up by key alone (see [`FlatMap::heads_only`]): for
    /// engines whose block size differs from the router's, whose records do not keep nodes.
    pub(crate) fn heads_only(&mut self) {
        self.logged(|| Change::HeadsOnly);
        self.map.heads_only();
    }

    /// Appends `change` to the log while one is kept.
    #[inline]
    fn logged(&mut self, change: impl FnOnce() -> Change) {
        if let Some(log) = &mut self.log {
            log.push(change());
        }
    }

    /// From now on, appends every change to `log` (cleared first), until
    /// [`Self::take_log`].
    pub(crate) fn log_into(&mut self, mut log: Vec<Change>) {
        log.clear();
        self.log = Some(log);
    }

    /// Stops logging changes and returns those logged.
    pub(crate) fn take_log(&mut self) -> Vec<Change> {
        self.log.take().unwrap_or_default()
    }

    /// Applies `changes`, logged by a table in the state this one is in (not logged again).
    pub(crate) fn replay(&mut self, changes: &[Change]) {
        for change in changes {
            match *change {
                Change::Inc(holding, place) => {
                    self.inc_now(holding, place);
                }
                Change::Dec(holding, at) => self.dec_now(holding, at),
                Change::HeadsOnly => self.map.heads_only(),
            }
        }
    }

    /// Whether a store must look up a block stored after its parent (see
    /// [`FlatMap::looks_up_tails`]).
    pub(crate) fn looks_up_tails(&self) -> bool {
        self.map.looks_up_tails()
    }

    /// The holders of table key `key`, at node `at`.
    fn holders(&self, at: usize, key: u64) -> Holders {
        let mut holders = Holders {
            tiers: [self.map.value(at), 0, 0, 0],
        };
        if !self.lower.is_empty() {
            if let Some(lower) = self.lower.get(&key) {
                holders.tiers[1..].copy_from_slice(lower);
            }
        }
        holders
    }

    /// Brings the table entry of `block` for `slot` into cache (see [`FlatMap::touch`]): its
    /// node `at` where known, else its index entry.
    pub(crate) fn touch(&self, block: BlockHash, at: Option<u32>, slot: u32) {
        match at {
            Some(at) => self.map.touch_node(at as usize),
            None => self.map.touch(group_key(block, split(slot).0)),
        }
    }

    /// Starts counting the groups holding each block once there are several (groups only grow).
    fn count_groups(&mut self, groups: u32) {
        if groups > 1 && self.groups_of.is_none() && !self.entries_only {
            let mut of = IdentityMap::default();
            of.reserve(self.map.len());
            of.extend(self.map.keys().map(|key| (key, 1)));
            self.groups_of = Some(of);
        }
    }

    /// A group's entry for `block` was created.
    fn group_gained(&mut self, block: BlockHash) {
        let first = match &mut self.groups_of {
            None => true,
            Some(of) => {
                let held = of.entry(flat::stored(block.0)).or_insert(0);
                *held += 1;
                *held == 1
            }
        };
        if first {
            self.distinct += 1;
        }
    }

    /// A group's entry for `block` was removed.
    fn group_lost(&mut self, block: BlockHash) {
        let last = match &mut self.groups_of {
            None => true,
            Some(of) => {
                let key = flat::stored(block.0);
                match of.get_mut(&key) {
                    Some(held) if *held > 1 => {
                        *held -= 1;
                        false
                    }
                    _ => of.remove(&key).is_some(),
                }
            }
        };
        if last {
            self.distinct -= 1;
        }
    }

    /// Whether any bit of `slot` is set anywhere (for tests).
    #[cfg(test)]
    pub(crate) fn any_bit_of(&self, slot: u32) -> bool {
        let (_, bit) = split(slot);
        self.map.values().any(|device| device & bit != 0)
            || self
                .lower
                .values()
                .any(|lower| (lower[0] | lower[1] | lower[2]) & bit != 0)
            || self.extra.keys().any(|(_, s, _)| *s == slot)
    }

    pub(crate) fn find(&self, hashes: &[BlockHash], slots: &Slots) -> OverlapScores {
        let mut scores = Vec::new();
        let Some(&first) = hashes.first() else {
            return OverlapScores { scores };
        };
        for group in 0..slots.groups() {
            let key = group_key(first, group);
            if let Some(at) = self.map.find(key) {
                self.walk_group(hashes, group, at, slots, &mut scores);
            }
        }
        if slots.groups() > 1 || scores.len() > 1 {
            scores.sort_unstable_by_key(|(id, _)| *id);
        }
        OverlapScores { scores }
    }

    fn walk_group(
        &self,
        hashes: &[BlockHash],
        group: u32,
        mut at: usize,
        slots: &Slots,
        scores: &mut Vec<(crate::ReplicaId, TierCounts)>,
    ) {
        // matched[b]: leading blocks of bit b; lower[b]: blocks counted host, disk, external.
        // (Issuing the lookups of a window of blocks ahead of the walk was measured: no gain,
        // the processor already overlaps the misses of consecutive iterations.)
        let mut matched = [0u32; 64];
        let mut lower = [[0u32; 3]; 64];
        let mut current = self.holders(at, group_key(hashes[0], group));
        let holders_of_first = current.any();
        let mut active = holders_of_first;
        let mut i = 0;
        loop {
            let any = current.any();
            for b in bits(active & !any, 0) {
                matched[b as usize] = i as u32;
            }
            active &= any;
            if active == 0 {
                break;
            }
            let below_device = active & !current.tiers[0];
            for b in bits(below_device, 0) {
                let mask = 1u64 << b;
                let tier = if current.tiers[1] & mask != 0 {
                    0
                } else if current.tiers[2] & mask != 0 {
                    1
                } else {
                    2
                };
                lower[b as usize][tier] += 1;
            }
            i += 1;
            let next = hashes.get(i).and_then(|h| {
                let key = group_key(*h, group);
                self.map.find_after(at, key).map(|next| (next, key))
            });
            match next {
                Some((next, key)) => {
                    at = next;
                    current = self.holders(at, key);
                }
                None => {
                    for b in bits(active, 0) {
                        matched[b as usize] = i as u32;
                    }
                    break;
                }
            }
        }
        for b in bits(holders_of_first, 0) {
            let [host, disk, external] = lower[b as usize];
            let counts = TierCounts {
                device: matched[b as usize] - host - disk - external,
                host,
                disk,
                external,
            };
            scores.push((slots.id(group * 64 + b), counts));
        }
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        self.map.memory_bytes()
            + map_bytes::<u64, [u64; 3]>(self.lower.capacity())
            + map_bytes::<(u64, u32, u8), u32>(self.extra.capacity())
            + self
                .groups_of
                .as_ref()
                .map_or(0, |of| map_bytes::<u64, u32>(of.capacity()))
    }
}
