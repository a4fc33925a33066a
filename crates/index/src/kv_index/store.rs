//! Applying `BlockStored`: resolving where the chain continues, then re-blocking.

use std::sync::Arc;

use super::record::{Basis, Kind, Part, Tail};
use super::records::Record;
use super::table::{BlockTable, Place};
use super::{tier_index, KvIndex};
use crate::hash::hash_into;
use crate::{BlockHash, EngineHash, IndexError, ReplicaId, StoredBlocks};

/// Lines of an event's tokens prefetched before its blocks are stored.
const TOKEN_LINES: usize = 16;
/// Tokens a 64-byte cache line holds.
const TOKENS_A_LINE: usize = 64 / std::mem::size_of::<u32>();

/// Buffers reused across events.
#[derive(Debug, Default)]
pub(super) struct Scratch {
    bytes: Vec<u8>,
    /// Router blocks of the event being stored (whole engine blocks).
    blocks: Vec<BlockHash>,
    /// The records' entries its engine blocks claimed.
    entries: Vec<usize>,
    /// Tokens of the partial router block being filled.
    tokens: Vec<u32>,
    /// Engine blocks of the partial router block being filled, in order.
    members: Vec<EngineHash>,
    /// The node of the partial router block the event continues (its parent's).
    before: Option<Arc<Tail>>,
}

impl Scratch {
    pub(super) fn memory_bytes(&self) -> usize {
        self.bytes.capacity()
            + 8 * self.blocks.capacity()
            + 8 * self.entries.capacity()
            + 4 * self.tokens.capacity()
            + 8 * self.members.capacity()
    }
}

impl KvIndex {
    pub(super) fn store(
        &mut self,
        replica: ReplicaId,
        event: &StoredBlocks<'_>,
    ) -> Result<(), IndexError> {
        let (router, engine) = (self.block_size, event.block_size);
        let mismatch = IndexError::BlockSizeMismatch { engine, router };
        if engine == 0 || (engine % router != 0 && router % engine != 0) {
            return Err(mismatch);
        }
        if event.token_ids.len() != event.engine_hashes.len() * engine {
            return Err(IndexError::TokenCount {
                tokens: event.token_ids.len(),
                blocks: event.engine_hashes.len(),
                block_size: engine,
            });
        }
        if event.engine_hashes.is_empty() {
            return Ok(());
        }
        if engine != router {
            // Re-blocking records do not keep their blocks' places: blocks found by hash.
            self.table.heads_only();
        }
        // The parent's record, the blocks' records and the tokens are asked for at once, so
        // that their cache misses overlap: the tokens are hashed once the others are found.
        let known = self.slots.get(replica);
        if let Some(slot) = known {
            let parent = event.parent.as_slice();
            (self.records).prefetch(slot, parent.iter().chain(event.engine_hashes));
        }
        for line in event.token_ids.chunks(TOKENS_A_LINE).take(TOKEN_LINES) {
            super::prefetch(&line[0]);
        }
        let mut scratch = std::mem::take(&mut self.scratch);
        let result = self.resolve_parent(known, event, &mut scratch);
        let result = result.map(|(base, base_at)| {
            let slot = known.unwrap_or_else(|| self.slots.get_or_insert(replica));
            self.records.ensure_slot(slot);
            if self.tier_counts.len() <= slot as usize {
                self.tier_counts.resize(slot as usize + 1, [0; 4]);
            }
            if engine >= router {
                self.store_whole(slot, event, base, base_at, &mut scratch);
            } else {
                self.store_pieces(slot, event, base, &mut scratch);
            }
        });
        self.scratch = scratch;
        result
    }

    /// Where the event's chain starts: the router block before it and its place where the
    /// parent's record knows it, and (in `scratch.tokens`/`members`) the partial router block
    /// it continues, as the parent's record holds it. `slot` is the replica's, if it has one.
    fn resolve_parent(
        &self,
        slot: Option<u32>,
        event: &StoredBlocks<'_>,
        scratch: &mut Scratch,
    ) -> Result<(Option<BlockHash>, Option<u32>), IndexError> {
        scratch.tokens.clear();
        scratch.members.clear();
        scratch.before = None;
        let Some(parent) = event.parent else {
            return Ok((None, None));
        };
        let slot = slot.ok_or(IndexError::UnknownParent(parent))?;
        let record = self
            .records
            .get(slot, parent)
            .ok_or(IndexError::UnknownParent(parent))?;
        let kind = self.records.kind(&record);
        let Basis {
            base,
            base_at,
            filled,
        } = match (record.place(), kind) {
            (Some(at), _) => Basis {
                base: Some(self.table.block_at(at)),
                base_at: Some(at),
                filled: 0,
            },
            (None, Some(kind)) => kind.basis(),
            (None, None) => unreachable!("a boxed record has its kind"),
        };
        if filled == 0 {
            return Ok((base, base_at));
        }
        if event.block_size >= self.block_size
            || !(filled as usize).is_multiple_of(event.block_size)
        {
            return Err(IndexError::BlockSizeMismatch {
                engine: event.block_size,
                router: self.block_size,
            });
        }
        let Some(Kind::Part(part)) = kind else {
            unreachable!("only a piece leaves a router block partial");
        };
        // Continue the partial router block as the parent's record saw it; each of its pieces
        // must still be held (a removed piece breaks the prefix there).
        part.partial_into(&mut scratch.tokens, &mut scratch.members);
        if let Some(gone) = scratch
            .members
            .iter()
            .rev()
            .find(|m| !self.records.contains(slot, **m))
        {
            return Err(IndexError::UnknownParent(*gone));
        }
        scratch.before = part.tail.clone();
        Ok((base, None))
    }

    /// Engine block size a multiple of the router's. The records' entries are claimed, then
    /// the router hashes computed while those load, then the run the chain continues from is
    /// brought in (every block's entry, where blocks are found by hash), then the blocks are
    /// stored.
    fn store_whole(
        &mut self,
        slot: u32,
        event: &StoredBlocks<'_>,
        base: Option<BlockHash>,
        base_at: Option<u32>,
        scratch: &mut Scratch,
    ) {
        let per = event.block_size / self.block_size;
        self.records
            .claim(slot, event.engine_hashes, &mut scratch.entries);
        if per == 1 && !self.table.looks_up_tails() {
            return self.store_router_sized(slot, event, base, base_at, scratch);
        }
        let mut previous = base;
        scratch.blocks.clear();
        for tokens in event.token_ids.chunks_exact(self.block_size) {
            let block = hash_into(previous, event.salt, tokens, &mut scratch.bytes);
            scratch.blocks.push(block);
            previous = Some(block);
        }
        if self.table.looks_up_tails() {
            for &block in &scratch.blocks {
                self.table.touch(block, None);
            }
        } else if let Some(&first) = scratch.blocks.first() {
            self.table.touch(first, base_at);
        }
        self.table.expect(scratch.blocks.len());
        let tier = tier_index(event.tier);
        let mut after = base_at;
        let blocks = scratch.blocks.chunks_exact(per);
        for ((&hash, blocks), &entry) in
            event.engine_hashes.iter().zip(blocks).zip(&scratch.entries)
        {
            after = match blocks {
                [block] => self.upsert_claimed(slot, hash, (*block, after), tier, entry),
                _ => self.upsert(slot, hash, Kind::Many(Box::new(blocks.into())), tier),
            };
        }
    }

    /// [`Self::store_whole`] of engine blocks the router's size, found by place (the common
    /// case): each block hashed, then stored, in one loop, so that a block's store runs while
    /// the next block's hash, a chain of dependent steps, completes (a store is independent of
    /// the next hash).
    fn store_router_sized(
        &mut self,
        slot: u32,
        event: &StoredBlocks<'_>,
        base: Option<BlockHash>,
        base_at: Option<u32>,
        scratch: &mut Scratch,
    ) {
        let mut tokens = event.token_ids.chunks_exact(self.block_size);
        let Some(first) = tokens.next() else {
            return;
        };
        let mut block = hash_into(base, event.salt, first, &mut scratch.bytes);
        self.table.touch(block, base_at);
        self.table.expect(event.engine_hashes.len());
        let tier = tier_index(event.tier);
        let mut after = base_at;
        // Each engine hash with its claimed entry and the tokens of the block after it.
        let nexts = tokens.map(Some).chain(std::iter::once(None));
        let blocks = (event.engine_hashes.iter())
            .zip(&scratch.entries)
            .zip(nexts);
        for ((&hash, &entry), next) in blocks {
            after = self.upsert_claimed(slot, hash, (block, after), tier, entry);
            if let Some(next) = next {
                block = hash_into(Some(block), event.salt, next, &mut scratch.bytes);
            }
        }
    }

    /// Engine block size a divisor of the router's: runs of pieces that leave a router block
    /// partial share one [`Tail`] node; the piece after a run completes the router block.
    fn store_pieces(
        &mut self,
        slot: u32,
        event: &StoredBlocks<'_>,
        mut base: Option<BlockHash>,
        scratch: &mut Scratch,
    ) {
        let (router, size) = (self.block_size, event.block_size);
        let tier = tier_index(event.tier);
        let hashes = event.engine_hashes;
        let mut parent = event.parent;
        let mut before = scratch.before.take();
        let mut start = 0;
        while start < hashes.len() {
            // Pieces `start..end` leave the router block partial; piece `end`, if any,
            // completes it (`resolve_parent` checked that the pieces fill it exactly).
            let room = (router - scratch.tokens.len()) / size;
            let end = (start + room - 1).min(hashes.len());
            if end > start {
                let (filled, members) = (scratch.tokens.len(), scratch.members.len());
                let tokens = &event.token_ids[start * size..end * size];
                let tail = Arc::new(Tail {
                    before: before.take(),
                    filled_before: filled as u32,
                    members_before: members as u32,
                    sharers: (end - start) as u32,
                    tokens: tokens.into(),
                    members: hashes[start..end].into(),
                });
                scratch.tokens.extend_from_slice(tokens);
                scratch.members.extend_from_slice(&hashes[start..end]);
                for (i, &hash) in hashes[start..end].iter().enumerate() {
                    let part = Part {
                        parent,
                        base,
                        filled: (filled + (i + 1) * size) as u32,
                        size: size as u32,
                        members: (members + i + 1) as u32,
                        tail: Some(Arc::clone(&tail)),
                        own: None,
                        members_of: Vec::new(),
                    };
                    self.upsert(slot, hash, Kind::Part(Box::new(part)), tier);
                    parent = Some(hash);
                }
            }
            let Some(&hash) = hashes.get(end) else {
                break;
            };
            scratch
                .tokens
                .extend_from_slice(&event.token_ids[end * size..(end + 1) * size]);
            let block = hash_into(base, event.salt, &scratch.tokens, &mut scratch.bytes);
            let part = Part {
                parent,
                base,
                filled: router as u32,
                size: size as u32,
                members: 0,
                tail: None,
                own: Some(block),
                members_of: Vec::new(),
            };
            self.upsert(slot, hash, Kind::Part(Box::new(part)), tier);
            for member in scratch.members.drain(..) {
                self.add_member_of(slot, member, block);
            }
            scratch.tokens.clear();
            before = None;
            base = Some(block);
            parent = Some(hash);
            start = end + 1;
        }
    }

    /// Records that `block` was completed through the piece `member`.
    fn add_member_of(&mut self, slot: u32, member: EngineHash, block: BlockHash) {
        let Some(record) = self.records.get(slot, member) else {
            return;
        };
        if let Some(Kind::Part(part)) = self.records.kind_mut(&record) {
            if !part.members_of.contains(&block) {
                let before = part.members_of.capacity();
                part.members_of.push(block);
                self.record_heap +=
                    (part.members_of.capacity() - before) * std::mem::size_of::<BlockHash>();
            }
        }
    }

    /// Stores engine block `hash` of `slot` in `tier` with mapping `kind`, one not of a single
    /// router block (those go through [`Self::upsert_claimed`]). Returns `None` (such records
    /// do not keep a place).
    fn upsert(&mut self, slot: u32, hash: EngineHash, kind: Kind, tier: usize) -> Option<u32> {
        debug_assert!(!matches!(kind, Kind::One(_)), "see upsert_claimed");
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        let at = self.upsert_boxed(slot, hash, kind, tier, stamp);
        self.enqueue(slot, hash, stamp);
        at
    }

    /// Stores router block `block` as engine block `hash` of `slot` in `tier`, whose records'
    /// entry the event claimed (`entry`); `after` is the place of the router block before it
    /// (see `BlockTable::inc`). Returns the block's place, which its record keeps. In the
    /// common case, a block new to the slot, one access to that entry and the table's change,
    /// inline in the event's loop (a call a block cost a quarter of a stored block's
    /// instructions).
    #[inline(always)]
    fn upsert_claimed(
        &mut self,
        slot: u32,
        hash: EngineHash,
        (block, after): (BlockHash, Option<u32>),
        tier: usize,
        entry: usize,
    ) -> Option<u32> {
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        let claimed = self.records.claimed_mut(slot, hash, entry);
        let at = match claimed.filter(|record| record.is_pending()) {
            Some(record) => {
                let at = self.table.inc(block, Place::After(after), slot, tier);
                *record = Record::one(at, stamp, 1 << tier);
                self.engine_blocks += 1;
                self.tier_counts[slot as usize][tier] += 1;
                Some(at)
            }
            None => self.upsert_one(slot, hash, (block, after), tier, stamp, entry),
        };
        self.enqueue(slot, hash, stamp);
        at
    }

    /// [`Self::upsert_claimed`] of a block held before (or whose claimed entry a change in the
    /// event moved): one probe of the slot's records finds the record or the room for it.
    fn upsert_one(
        &mut self,
        slot: u32,
        hash: EngineHash,
        (block, after): (BlockHash, Option<u32>),
        tier: usize,
        stamp: u64,
        entry: usize,
    ) -> Option<u32> {
        let (table, counts) = (&mut self.table, &mut self.tier_counts[slot as usize]);
        match self.records.find_or_vacant_at(slot, hash, entry) {
            Err(vacant) => {
                let at = table.inc(block, Place::After(after), slot, tier);
                (self.records).insert_at(slot, vacant, hash, Record::one(at, stamp, 1 << tier));
                self.engine_blocks += 1;
                counts[tier] += 1;
                return Some(at);
            }
            Ok(entry) => {
                let record = self.records.at_mut(slot, entry);
                let at = record.place().filter(|&at| table.block_at(at) == block);
                if let Some(at) = at {
                    super::retire(&mut self.queue, record.stamp(), stamp);
                    record.set_stamp(stamp);
                    if record.tiers() & (1 << tier) == 0 {
                        record.set_tiers(record.tiers() | 1 << tier);
                        counts[tier] += 1;
                        table.inc(block, Place::At(at), slot, tier);
                    }
                    return Some(at);
                }
            }
        }
        // Stored before with another mapping: replaced.
        self.remove_record(slot, hash);
        self.insert(slot, hash, Kind::One(block), tier, stamp, after)
    }

    /// [`Self::upsert`] of a block mapped to several router blocks, or to a piece of one.
    fn upsert_boxed(
        &mut self,
        slot: u32,
        hash: EngineHash,
        kind: Kind,
        tier: usize,
        stamp: u64,
    ) -> Option<u32> {
        let Some(mut record) = self.records.get(slot, hash) else {
            return self.insert(slot, hash, kind, tier, stamp, None);
        };
        let same = (self.records.kind(&record)).is_some_and(|old| old.same_mapping(&kind));
        if !same {
            self.remove_record(slot, hash);
            return self.insert(slot, hash, kind, tier, stamp, None);
        }
        super::retire(&mut self.queue, record.stamp(), stamp);
        record.set_stamp(stamp);
        if record.tiers() & (1 << tier) == 0 {
            record.set_tiers(record.tiers() | 1 << tier);
            self.tier_counts[slot as usize][tier] += 1;
            hold(&mut self.table, &kind, Place::After(None), slot, tier);
        }
        self.records.set(slot, hash, record);
        None
    }

    /// Adds engine block `hash` of `slot`, which it does not hold.
    fn insert(
        &mut self,
        slot: u32,
        hash: EngineHash,
        kind: Kind,
        tier: usize,
        stamp: u64,
        after: Option<u32>,
    ) -> Option<u32> {
        let at = hold(&mut self.table, &kind, Place::After(after), slot, tier);
        self.engine_blocks += 1;
        self.record_heap += kind.heap_bytes();
        self.tier_counts[slot as usize][tier] += 1;
        let record = self
            .records
            .new_record(kind, at.unwrap_or(0), stamp, 1 << tier);
        self.records.insert(slot, hash, record);
        at
    }
}

/// One more holding by `slot` in `tier` of the router blocks `kind` stores; a [`Kind::One`]
/// block at `one`, whose place it returns (the others are found by hash: see `heads_only`).
fn hold(table: &mut BlockTable, kind: &Kind, one: Place, slot: u32, tier: usize) -> Option<u32> {
    match kind {
        Kind::One(block) => Some(table.inc(*block, one, slot, tier)),
        _ => {
            for &block in kind.own() {
                table.inc(block, Place::After(None), slot, tier);
            }
            None
        }
    }
}
