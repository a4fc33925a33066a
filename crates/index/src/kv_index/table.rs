//! The block table as runs of blocks: a radix tree over router block hashes whose nodes are
//! runs of up to 64 blocks.
//!
//! A run holds the hashes of blocks stored one after another. A block stored after the last
//! block of a run (with room left) is appended to it; one stored after any other block, or
//! after a full run, starts a new run, a *branch* of that run; a block with no parent starts
//! a *root* run. No run is ever split or moved, so a block's *place* (its run and offset,
//! `run << 6 | offset`, under 2^31) stays the same while the run lives, and the replicas'
//! records keep it. Chained router hashes make a block's place unique (its hash names its
//! whole prefix), so every run is found by its first hash in one map (`heads`): the branch
//! holding a block after a given place is the run the block heads, and only a run with
//! branches needs that lookup when a store or a query leaves it.
//!
//! Per run, each (slot, tier) holding any of its blocks has one bit per offset (the first
//! such holder inline, most runs having one), and `any` has the bits some holder sets. A run
//! no one holds any block of and with no branch is freed, and its ancestors after it while
//! the same holds; a freed run keeps its buffers for the next. Counts above one (a router block
//! held through two engine blocks of one slot and tier) live in a side map, `extra`, empty in
//! the common case.
//!
//! Engine blocks of another size than the router's (re-blocking) are stored without their
//! parent's place. From the first such event on (`heads_only`), every block of a live run is
//! also found by hash (`keyed`), and so is the next block of a query that leaves a run.
//!
//! A query walks the runs comparing hashes, one lookup per run left, not one a block, with the
//! slots still matching; a slot's blocks in a run are its leading bits there.

use super::gradual::{ExtraHoldings, HashIndex};
use crate::slots::Slots;
use crate::{BlockHash, OverlapScores, TierCounts};

/// Blocks a run holds at most (one bit each in a `u64`).
const RUN: usize = 64;
const NONE: u32 = u32::MAX;
/// Places are `run << 6 | offset` under 2^31 (a record marks its other kind with the top
/// bit): at most 2^25 runs (of up to 64 blocks each).
const MAX_RUNS: usize = 1 << 25;
const HOLDER_BYTES: usize = std::mem::size_of::<(u32, u64)>();

fn place(run: u32, offset: u32) -> u32 {
    run << 6 | offset
}

fn unplace(place: u32) -> (usize, u32) {
    ((place >> 6) as usize, place & 63)
}

/// The bits of offsets `start..start + len`.
fn window(start: u32, len: usize) -> u64 {
    match len {
        64 => u64::MAX,
        len => ((1u64 << len) - 1) << start,
    }
}

/// A holder's key in a run: its slot and tier, sorted by slot.
fn holder(slot: u32, tier: usize) -> u32 {
    slot << 2 | tier as u32
}

/// Where [`BlockTable::inc`] finds or puts a block.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Place {
    /// After the place of the block's parent (`None`: a chain's first block, or a block whose
    /// parent's place its record does not keep: re-blocking).
    After(Option<u32>),
    /// At this place: the block's, which the slot already holds in another tier.
    At(u32),
}

/// One holding, as [`BlockTable::inc`] adds it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Holding {
    block: BlockHash,
    slot: u32,
    tier: u8,
}

/// A change to the table, as [`BlockTable::replay`] applies it again to a copy that has applied
/// the same changes up to it (a mirrored shard's other copy): the copy then assigns the same
/// places.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Change {
    Inc(Holding, Place),
    Dec(Held, u32, u8),
    HeadsOnly,
}

/// The block [`BlockTable::dec`] takes a holding of: at its place (as `inc` returned it), or
/// found by its hash.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Held {
    At(u32),
    Hash(BlockHash),
}

/// (holder key, a bit per offset), sorted by key; the first inline.
#[derive(Debug)]
struct Holders {
    first: (u32, u64),
    rest: Vec<(u32, u64)>,
}

impl Default for Holders {
    fn default() -> Self {
        Self {
            first: (NONE, 0),
            rest: Vec::new(),
        }
    }
}

impl Holders {
    #[inline]
    fn get_mut(&mut self, key: u32) -> Option<&mut u64> {
        if self.first.0 == key {
            return Some(&mut self.first.1);
        }
        if self.rest.is_empty() {
            return None;
        }
        let i = (self.rest.binary_search_by_key(&key, |h| h.0)).ok()?;
        Some(&mut self.rest[i].1)
    }

    fn insert(&mut self, key: u32, bits: u64) {
        if self.first.0 == NONE {
            self.first = (key, bits);
        } else if key < self.first.0 {
            let first = std::mem::replace(&mut self.first, (key, bits));
            self.rest.insert(0, first);
        } else {
            let i = (self.rest.binary_search_by_key(&key, |h| h.0)).unwrap_or_else(|i| i);
            self.rest.insert(i, (key, bits));
        }
    }

    fn remove(&mut self, key: u32) {
        if self.first.0 == key {
            self.first = match self.rest.is_empty() {
                true => (NONE, 0),
                false => self.rest.remove(0),
            };
        } else if let Ok(i) = self.rest.binary_search_by_key(&key, |h| h.0) {
            self.rest.remove(i);
        }
    }

    /// Whether some holder has a bit of `bits`.
    #[inline]
    fn any_holds(&self, bits: u64) -> bool {
        // (A free `first` has no bits.)
        self.first.1 & bits != 0 || self.rest.iter().any(|h| h.1 & bits != 0)
    }

    #[inline]
    fn iter(&self) -> impl Iterator<Item = &(u32, u64)> {
        let first = std::iter::once(&self.first).filter(|h| h.0 != NONE);
        first.chain(&self.rest)
    }
}

#[derive(Debug, Default)]
struct Run {
    hashes: Vec<u64>,
    /// Runs branching from this one.
    children: u32,
    /// Its one branch while it has one (`NONE` when unknown: its first was freed while it
    /// had two), so that a walk down a chain of runs skips the lookup in `heads`.
    child: u32,
    holders: Holders,
    /// Offsets some holder holds.
    any: u64,
    /// The run it branches from (`NONE`: a root).
    parent: u32,
}

impl Run {
    /// The run that `block` heads, where it is this run's only branch.
    #[inline]
    fn only_child(&self, runs: &[Run], block: u64) -> Option<u32> {
        let child = (self.children == 1 && self.child != NONE).then_some(self.child)?;
        (runs[child as usize].hashes.first() == Some(&block)).then_some(child)
    }

    #[cfg(test)]
    fn heap_bytes(&self) -> usize {
        self.hashes.capacity() * 8 + self.holders.rest.capacity() * HOLDER_BYTES
    }
}

#[derive(Debug, Default)]
pub(crate) struct BlockTable {
    runs: Vec<Run>,
    /// Freed runs, their buffers kept.
    free: Vec<u32>,
    /// Every run's first hash → the run (a block's hash names its parent block, so the run a
    /// block heads is the branch from its parent's place wherever that is).
    heads: HashIndex,
    /// Once re-blocking began: every block of a live run → its place.
    keyed: Option<HashIndex>,
    /// (place, slot, tier) → holdings beyond the first.
    extra: ExtraHoldings,
    /// Heap bytes behind the runs (their buffers), kept as they change.
    run_heap: usize,
    /// Blocks a store is about to add, to size a new run's buffer.
    room: usize,
    distinct: usize,
    /// While set, every change is also appended here ([`Self::log_into`]).
    log: Option<Vec<Change>>,
}

impl BlockTable {
    /// Distinct router blocks held by some slot.
    pub(crate) fn distinct(&self) -> usize {
        self.distinct
    }

    /// Runs in use.
    pub(crate) fn runs(&self) -> usize {
        self.runs.len() - self.free.len()
    }

    /// The next store adds up to `blocks` blocks in a row: a run started for them gets room
    /// for them (a hint; the table's contents do not depend on it).
    pub(crate) fn expect(&mut self, blocks: usize) {
        self.room = blocks;
    }

    /// One more holding of `block` by `slot` in `tier`. Returns `block`'s place, which stays
    /// the same while the block is held.
    #[inline(always)]
    pub(crate) fn inc(&mut self, block: BlockHash, place: Place, slot: u32, tier: usize) -> u32 {
        let holding = Holding {
            block,
            slot,
            tier: tier as u8,
        };
        self.logged(|| Change::Inc(holding, place));
        self.inc_now(holding, place)
    }

    #[inline(always)]
    fn inc_now(&mut self, holding: Holding, at: Place) -> u32 {
        let Holding { block, slot, tier } = holding;
        let p = match at {
            Place::At(p) => p,
            Place::After(after) => self.locate_or_add(block, after),
        };
        self.room = self.room.saturating_sub(1);
        let (r, offset) = unplace(p);
        let bit = 1u64 << offset;
        let run = &mut self.runs[r];
        debug_assert_eq!(run.hashes[offset as usize], block.0);
        let key = holder(slot, usize::from(tier));
        match run.holders.get_mut(key) {
            Some(bits) if *bits & bit != 0 => {
                self.extra.add(p, slot, tier);
            }
            Some(bits) => *bits |= bit,
            None => {
                let before = run.holders.rest.capacity();
                run.holders.insert(key, bit);
                self.run_heap += (run.holders.rest.capacity() - before) * HOLDER_BYTES;
            }
        }
        if run.any & bit == 0 {
            run.any |= bit;
            self.distinct += 1;
        }
        p
    }

    /// The place of `block` stored after place `after`: found along the run, as a run's head
    /// or (re-blocking) by hash, else added.
    #[inline]
    fn locate_or_add(&mut self, block: BlockHash, after: Option<u32>) -> u32 {
        if let Some(p) = self.keyed.as_ref().and_then(|keyed| keyed.get(block.0)) {
            return p;
        }
        let Some(after) = after else {
            if let Some(r) = self.heads.get(block.0) {
                return place(r, 0);
            }
            return place(self.alloc(NONE, block.0), 0);
        };
        let (r, offset) = unplace(after);
        let run = &self.runs[r];
        let next = offset as usize + 1;
        if run.hashes.get(next) == Some(&block.0) {
            return place(r as u32, next as u32);
        }
        // Only a run with branches may have this block as one (as may any, once keyed, which
        // the lookup above covered).
        if run.children > 0 {
            let found = run.only_child(&self.runs, block.0);
            if let Some(b) = found.or_else(|| self.heads.get(block.0)) {
                return place(b, 0);
            }
        }
        if next == run.hashes.len() && next < RUN {
            let hashes = &mut self.runs[r].hashes;
            let before = hashes.capacity();
            hashes.push(block.0);
            self.run_heap += (hashes.capacity() - before) * 8;
            let p = place(r as u32, next as u32);
            if let Some(keyed) = &mut self.keyed {
                keyed.insert(block.0, p);
            }
            return p;
        }
        let b = self.alloc(r as u32, block.0);
        let run = &mut self.runs[r];
        run.children += 1;
        run.child = if run.children == 1 { b } else { run.child };
        place(b, 0)
    }

    /// A run whose first block is `first`, branching from run `parent`.
    fn alloc(&mut self, parent: u32, first: u64) -> u32 {
        let room = self.room.clamp(1, RUN);
        let r = match self.free.pop() {
            Some(r) => r,
            None => {
                assert!(
                    self.runs.len() < MAX_RUNS,
                    "the block table is full (2^25 runs)"
                );
                self.runs.push(Run::default());
                (self.runs.len() - 1) as u32
            }
        };
        let run = &mut self.runs[r as usize];
        let before = run.hashes.capacity();
        run.hashes.reserve(room);
        run.hashes.push(first);
        run.parent = parent;
        self.run_heap += (run.hashes.capacity() - before) * 8;
        self.heads.insert(first, r);
        if let Some(keyed) = &mut self.keyed {
            keyed.insert(first, place(r, 0));
        }
        r
    }

    /// One holding fewer of block `held` by `slot` in `tier` (saturating: nothing happens when
    /// the slot does not hold it).
    #[inline]
    pub(crate) fn dec(&mut self, held: Held, slot: u32, tier: usize) {
        self.logged(|| Change::Dec(held, slot, tier as u8));
        self.dec_now(held, slot, tier as u8);
    }

    #[inline(always)]
    fn dec_now(&mut self, held: Held, slot: u32, tier: u8) {
        let p = match held {
            Held::At(p) => p,
            Held::Hash(block) => match self.find_place(block) {
                Some(p) => p,
                None => return,
            },
        };
        let (r, offset) = unplace(p);
        let bit = 1u64 << offset;
        let run = &mut self.runs[r];
        let key = holder(slot, usize::from(tier));
        let Some(bits) = run.holders.get_mut(key) else {
            return;
        };
        if *bits & bit == 0 {
            return;
        }
        if !self.extra.is_empty() && self.extra.take(p, slot, tier) {
            return;
        }
        *bits &= !bit;
        if *bits == 0 {
            run.holders.remove(key);
        }
        if !run.holders.any_holds(bit) {
            run.any &= !bit;
            self.distinct -= 1;
            if run.any == 0 && run.children == 0 {
                self.collect(r);
            }
        }
    }

    /// The place of `block` by its hash alone (re-blocking; else a root's first block).
    fn find_place(&self, block: BlockHash) -> Option<u32> {
        match &self.keyed {
            Some(keyed) => keyed.get(block.0),
            None => self.heads.get(block.0).map(|r| place(r, 0)),
        }
    }

    /// Frees run `r`, then its ancestors, while no one holds them and no branch leaves them.
    fn collect(&mut self, mut r: usize) {
        loop {
            let run = &mut self.runs[r];
            if run.any != 0 || run.children > 0 {
                return;
            }
            let parent = run.parent;
            if let Some(keyed) = &mut self.keyed {
                for hash in &run.hashes {
                    keyed.remove(*hash);
                }
            }
            self.heads.remove(run.hashes[0]);
            run.hashes.clear();
            run.holders.first = (NONE, 0);
            run.holders.rest.clear();
            self.free.push(r as u32);
            if parent == NONE {
                return;
            }
            let freed = r as u32;
            r = parent as usize;
            let parent = &mut self.runs[r];
            parent.children -= 1;
            if parent.child == freed {
                parent.child = NONE;
            }
        }
    }

    /// From now on every block is also found by hash (see the module docs): for engines
    /// whose block size differs from the router's, whose records do not keep places.
    pub(crate) fn heads_only(&mut self) {
        if self.keyed.is_none() {
            self.logged(|| Change::HeadsOnly);
            self.key_every_block();
        }
    }

    fn key_every_block(&mut self) {
        if self.keyed.is_some() {
            return;
        }
        let mut keyed = HashIndex::default();
        for (r, run) in self.runs.iter().enumerate() {
            for (offset, &hash) in run.hashes.iter().enumerate() {
                keyed.insert(hash, place(r as u32, offset as u32));
            }
        }
        self.keyed = Some(keyed);
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
                Change::Dec(held, slot, tier) => self.dec_now(held, slot, tier),
                Change::HeadsOnly => self.key_every_block(),
            }
        }
    }

    /// Whether blocks are also found by hash (re-blocking began).
    pub(crate) fn looks_up_tails(&self) -> bool {
        self.keyed.is_some()
    }

    /// The router block at place `at` (a held block's).
    #[inline]
    pub(crate) fn block_at(&self, at: u32) -> BlockHash {
        let (r, offset) = unplace(at);
        BlockHash(self.runs[r].hashes[offset as usize])
    }

    /// Brings the run of place `at` into cache, or, with no place, what finding `block` by
    /// hash reads.
    pub(crate) fn touch(&self, block: BlockHash, at: Option<u32>) {
        match at {
            Some(at) => super::prefetch(&self.runs[unplace(at).0]),
            None => {
                std::hint::black_box(self.find_place(block));
            }
        }
    }

    /// Whether no block is held more than once by a slot in a tier (for tests).
    #[cfg(test)]
    pub(crate) fn extra_is_empty(&self) -> bool {
        self.extra.is_empty()
    }

    /// Whether any holding of `slot` is left (for tests).
    #[cfg(test)]
    pub(crate) fn any_bit_of(&self, slot: u32) -> bool {
        let mut holders = self.runs.iter().flat_map(|run| run.holders.iter());
        holders.any(|h| h.0 >> 2 == slot) || self.extra.holds_slot(slot)
    }

    pub(crate) fn find(&self, hashes: &[BlockHash], slots: &Slots) -> OverlapScores {
        let mut scores = Vec::new();
        let Some(p) = hashes.first().and_then(|first| self.find_place(*first)) else {
            return OverlapScores { scores };
        };
        let matched = self.walk(hashes, p);
        scores.extend(matched.iter().map(|m| {
            let [host, disk, external] = m.lower;
            let counts = TierCounts {
                device: m.count - host - disk - external,
                host,
                disk,
                external,
            };
            (slots.id(m.slot), counts)
        }));
        if scores.len() > 1 {
            scores.sort_unstable_by_key(|(id, _)| *id);
        }
        OverlapScores { scores }
    }

    /// Per slot holding the first of `hashes` (whose place is `p`), how many leading blocks of
    /// them it holds, and how many of those it holds in a lower tier only.
    fn walk(&self, hashes: &[BlockHash], p: u32) -> Vec<Match> {
        let mut matched: Vec<Match> = Vec::new();
        let (mut r, mut start) = unplace(p);
        let mut pos = 0;
        loop {
            let run = &self.runs[r];
            let along = (run.hashes[start as usize..].iter()).zip(&hashes[pos..]);
            let len = along.take_while(|(a, b)| **a == b.0).count();
            let window = window(start, len);
            if pos == 0 {
                let first = (run.holders.iter()).filter(|h| h.1 & 1 << start != 0);
                for &(key, _) in first {
                    if matched.last().is_none_or(|m| m.slot != key >> 2) {
                        matched.push(Match::new(key >> 2));
                    }
                }
            }
            let mut holders = run.holders.iter().peekable();
            for m in matched.iter_mut().filter(|m| m.count as usize == pos) {
                let mut tiers = [0u64; 4];
                while let Some(&&(key, bits)) = holders.peek() {
                    if key >> 2 > m.slot {
                        break;
                    }
                    if key >> 2 == m.slot {
                        tiers[(key & 3) as usize] = bits;
                    }
                    holders.next();
                }
                m.add(tiers, window, start, len);
            }
            pos += len;
            if pos == hashes.len() || !matched.iter().any(|m| m.count as usize == pos) {
                return matched;
            }
            let next = match &self.keyed {
                Some(keyed) => keyed.get(hashes[pos].0),
                None if run.children > 0 => (run.only_child(&self.runs, hashes[pos].0))
                    .or_else(|| self.heads.get(hashes[pos].0))
                    .map(|b| place(b, 0)),
                None => None,
            };
            match next {
                Some(p) => (r, start) = unplace(p),
                None => return matched,
            }
        }
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        self.runs.capacity() * std::mem::size_of::<Run>()
            + self.run_heap
            + self.free.capacity() * 4
            + self.heads.memory_bytes()
            + (self.keyed.as_ref()).map_or(0, HashIndex::memory_bytes)
            + self.extra.memory_bytes()
    }
}

/// A slot's match so far.
#[derive(Debug)]
struct Match {
    slot: u32,
    count: u32,
    /// Blocks held in host, disk, external, and not in a tier above.
    lower: [u32; 3],
}

impl Match {
    fn new(slot: u32) -> Self {
        Self {
            slot,
            count: 0,
            lower: [0; 3],
        }
    }

    /// Adds the slot's leading blocks of the run's `window` (`len` blocks from `start`), its
    /// bits per tier there being `tiers`.
    #[inline]
    fn add(&mut self, tiers: [u64; 4], window: u64, start: u32, len: usize) {
        let [device, host, disk, external] = tiers;
        let any = (device | host | disk | external) & window;
        let held = (any >> start).trailing_ones().min(len as u32);
        if held == 0 {
            return;
        }
        let mine = self::window(start, held as usize);
        self.lower[0] += (host & !device & mine).count_ones();
        self.lower[1] += (disk & !device & !host & mine).count_ones();
        self.lower[2] += (external & !device & !host & !disk & mine).count_ones();
        self.count += held;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ReplicaId;

    /// A chain of `len` blocks from `start`, each after the one before (block `i`'s hash is
    /// `i + 1`, so no hash is 0).
    fn chain(table: &mut BlockTable, after: Option<u32>, blocks: &[u64], slot: u32) -> Vec<u32> {
        let mut at = after;
        (blocks.iter())
            .map(|&b| {
                let p = table.inc(BlockHash(b), Place::After(at), slot, 0);
                at = Some(p);
                p
            })
            .collect()
    }

    fn slots(n: u32) -> Slots {
        let mut slots = Slots::default();
        for r in 0..n {
            slots.get_or_insert(ReplicaId(r));
        }
        slots
    }

    fn matched(table: &BlockTable, query: &[u64], slots: &Slots) -> Vec<(u32, u32)> {
        let hashes: Vec<BlockHash> = query.iter().map(|&h| BlockHash(h)).collect();
        let scores = table.find(&hashes, slots).scores;
        scores.iter().map(|(r, c)| (r.0, c.total())).collect()
    }

    #[test]
    fn a_chain_is_one_run_a_continuation_appends_and_a_fork_branches() {
        let mut table = BlockTable::default();
        let slots = slots(2);
        let first = chain(&mut table, None, &[1, 2, 3, 4, 5], 0);
        assert_eq!(first, (0..5).map(|o| place(0, o)).collect::<Vec<_>>());
        // Continued from its last block: appended to the run.
        let more = chain(&mut table, Some(first[4]), &[6, 7], 0);
        assert_eq!(more, vec![place(0, 5), place(0, 6)]);
        // Slot 1 forks after block 3: a branch, a second run.
        let fork = chain(&mut table, Some(first[2]), &[30, 31], 1);
        assert_eq!(fork, vec![place(1, 0), place(1, 1)]);
        // Slot 1 also holds blocks 1-3, found where they are.
        assert_eq!(chain(&mut table, None, &[1, 2, 3], 1), first[..3]);
        assert_eq!(table.distinct(), 9);
        let slots = &slots;
        assert_eq!(
            matched(&table, &[1, 2, 3, 4, 5, 6, 7], slots),
            [(0, 7), (1, 3)]
        );
        assert_eq!(
            matched(&table, &[1, 2, 3, 30, 31, 32], slots),
            [(0, 3), (1, 5)]
        );
        assert_eq!(matched(&table, &[2, 3], slots), []);
        // Slot 0 lets go of its blocks 1-2: its match ends before it starts; slot 1's holds.
        for &p in &first[..2] {
            table.dec(Held::At(p), 0, 0);
        }
        assert_eq!(matched(&table, &[1, 2, 3, 30], slots), [(1, 4)]);
        assert_eq!(table.distinct(), 9);
    }

    #[test]
    fn runs_no_one_holds_are_freed_and_reused() {
        let mut table = BlockTable::default();
        let slots = slots(1);
        for round in 0..20u64 {
            let blocks: Vec<u64> = (0..100).map(|i| 1 + round * 1000 + i).collect();
            let places = chain(&mut table, None, &blocks, 0);
            let fork = chain(&mut table, Some(places[10]), &[999_999 + round], 0);
            assert_eq!(matched(&table, &blocks, &slots), [(0, 100)]);
            assert_eq!(table.distinct(), 101);
            // Newest first, as engines evict.
            for &p in fork.iter().chain(places.iter().rev()) {
                table.dec(Held::At(p), 0, 0);
            }
            assert_eq!((table.distinct(), table.heads.len()), (0, 0));
            assert_eq!(table.free.len(), table.runs.len());
        }
        // 100 blocks in runs of 64, and one branch: three runs, reused every round.
        assert_eq!(table.runs.len(), 3);
        let heap: usize = table.runs.iter().map(Run::heap_bytes).sum();
        assert_eq!(table.run_heap, heap);
    }

    #[test]
    fn a_chain_of_runs_is_walked_through_each_run_s_only_branch() {
        let mut table = BlockTable::default();
        let slots = slots(1);
        // 200 blocks: four runs, each the only branch of the one before.
        let blocks: Vec<u64> = (1..=200).collect();
        let places = chain(&mut table, None, &blocks, 0);
        assert_eq!(table.runs[0].child, unplace(places[64]).0 as u32);
        assert_eq!(matched(&table, &blocks, &slots), [(0, 200)]);
        // A second branch of the first run, then the first branch freed: the run forgets it,
        // and the chain stored again is found through `heads`.
        let fork = chain(&mut table, Some(places[9]), &[1000], 0)[0];
        for &p in places[64..].iter().rev() {
            table.dec(Held::At(p), 0, 0);
        }
        assert_eq!((table.runs[0].children, table.runs[0].child), (1, NONE));
        assert_eq!(matched(&table, &blocks, &slots), [(0, 64)]);
        assert_eq!(
            chain(&mut table, Some(places[63]), &blocks[64..], 0).len(),
            136
        );
        assert_eq!(matched(&table, &blocks, &slots), [(0, 200)]);
        assert_eq!(
            matched(&table, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1000], &slots),
            [(0, 11)]
        );
        assert_eq!(table.block_at(fork), BlockHash(1000));
    }

    #[test]
    fn a_block_held_twice_by_one_slot_and_tier_is_held_until_both_go() {
        let mut table = BlockTable::default();
        let slots = slots(1);
        let p = chain(&mut table, None, &[7], 0)[0];
        assert_eq!(table.inc(BlockHash(7), Place::At(p), 0, 0), p);
        assert_eq!(table.inc(BlockHash(7), Place::At(p), 0, 1), p);
        table.dec(Held::At(p), 0, 0);
        assert_eq!(matched(&table, &[7], &slots), [(0, 1)]);
        table.dec(Held::Hash(BlockHash(7)), 0, 0);
        let scores = table.find(&[BlockHash(7)], &slots).scores;
        assert_eq!((scores[0].1.device, scores[0].1.host), (0, 1));
        table.dec(Held::At(p), 0, 1);
        assert_eq!((table.distinct(), table.free.len()), (0, 1));
        assert!(table.extra.is_empty());
    }
}
