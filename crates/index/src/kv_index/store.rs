//! Applying `BlockStored`: resolving where the chain continues, then re-blocking.

use std::sync::Arc;

use super::record::{Basis, Kind, Part, Record, Tail};
use super::table::{BlockTable, Place};
use super::{tier_index, KvIndex};
use crate::hash::hash_into;
use crate::{BlockHash, EngineHash, IndexError, ReplicaId, StoredBlocks};

/// Buffers reused across events.
#[derive(Debug, Default)]
pub(super) struct Scratch {
    bytes: Vec<u8>,
    /// Router blocks of the event being stored (whole engine blocks).
    blocks: Vec<BlockHash>,
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
            // Re-blocking records do not keep their blocks' nodes: look blocks up by key.
            self.table.heads_only();
        }
        let mut scratch = std::mem::take(&mut self.scratch);
        let result = self.resolve_parent(replica, event, &mut scratch);
        let result = result.map(|(base, base_at)| {
            let slot = self.slots.get_or_insert(replica);
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

    /// Where the event's chain starts: the router block before it and its node where the
    /// parent's record knows it, and (in `scratch.tokens`/`members`) the partial router block
    /// it continues, as the parent's record holds it.
    fn resolve_parent(
        &self,
        replica: ReplicaId,
        event: &StoredBlocks<'_>,
        scratch: &mut Scratch,
    ) -> Result<(Option<BlockHash>, Option<u32>), IndexError> {
        scratch.tokens.clear();
        scratch.members.clear();
        scratch.before = None;
        let Some(parent) = event.parent else {
            return Ok((None, None));
        };
        let slot = self
            .slots
            .get(replica)
            .ok_or(IndexError::UnknownParent(parent))?;
        let record = self
            .records
            .get(slot, parent)
            .ok_or(IndexError::UnknownParent(parent))?;
        let Basis {
            base,
            base_at,
            filled,
        } = record.kind.basis();
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
        let Kind::Part(part) = &record.kind else {
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

    /// Engine block size a multiple of the router's. The records' index entries are brought
    /// into cache while the router hashes are computed, then the table's entries, all
    /// together (their cache misses overlap), then the blocks are stored.
    fn store_whole(
        &mut self,
        slot: u32,
        event: &StoredBlocks<'_>,
        base: Option<BlockHash>,
        base_at: Option<u32>,
        scratch: &mut Scratch,
    ) {
        let per = event.block_size / self.block_size;
        for &hash in event.engine_hashes {
            self.records.touch(slot, hash);
        }
        let mut previous = base;
        scratch.blocks.clear();
        for tokens in event.token_ids.chunks_exact(self.block_size) {
            let block = hash_into(previous, event.salt, tokens, &mut scratch.bytes);
            scratch.blocks.push(block);
            previous = Some(block);
        }
        // The blocks after the first are looked up only where the table cannot tell them new.
        let looked_up = if self.table.looks_up_tails() {
            usize::MAX
        } else {
            1
        };
        for &block in scratch.blocks.iter().take(looked_up) {
            self.table.touch(block, None, slot);
        }
        let tier = tier_index(event.tier);
        let mut after = base_at;
        for (&hash, blocks) in event
            .engine_hashes
            .iter()
            .zip(scratch.blocks.chunks_exact(per))
        {
            let kind = match blocks {
                [block] => Kind::One(*block, u32::MAX),
                _ => Kind::Many(Box::new(blocks.into())),
            };
            after = self.upsert(slot, hash, kind, tier, after);
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
                    self.upsert(slot, hash, Kind::Part(Box::new(part)), tier, None);
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
            self.upsert(slot, hash, Kind::Part(Box::new(part)), tier, None);
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
        let Some(record) = self.records.get_mut(slot, member) else {
            return;
        };
        if let Kind::Part(part) = &mut record.kind {
            if !part.members_of.contains(&block) {
                let before = part.members_of.capacity();
                part.members_of.push(block);
                self.record_heap +=
                    (part.members_of.capacity() - before) * std::mem::size_of::<BlockHash>();
            }
        }
    }

    /// Stores engine block `hash` of `slot` in `tier` with mapping `kind`; `after` is the node
    /// of the router block before it (see `BlockTable::inc`). Returns the node of its router
    /// block where its record keeps it ([`Kind::One`]).
    fn upsert(
        &mut self,
        slot: u32,
        hash: EngineHash,
        kind: Kind,
        tier: usize,
        after: Option<u32>,
    ) -> Option<u32> {
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        let groups = self.slots.groups();
        let at = match self.records.find_or_vacant(slot, hash) {
            Ok(at) if self.records.at(at).kind.same_mapping(&kind) => {
                let record = self.records.at_mut(at);
                record.set_stamp(stamp);
                if record.tiers() & (1 << tier) == 0 {
                    record.set_tiers(record.tiers() | 1 << tier);
                    self.tier_counts[slot as usize][tier] += 1;
                    let place = match record.kind {
                        Kind::One(_, at) => Place::At(at),
                        _ => Place::After(None),
                    };
                    hold(&mut self.table, &record.kind, place, slot, tier, groups);
                }
                match record.kind {
                    Kind::One(_, at) => Some(at),
                    _ => None,
                }
            }
            Ok(_) => {
                self.remove_record(slot, hash);
                let entry = self
                    .records
                    .find_or_vacant(slot, hash)
                    .expect_err("just removed");
                self.insert(slot, entry, hash, kind, tier, stamp, after)
            }
            Err(entry) => self.insert(slot, entry, hash, kind, tier, stamp, after),
        };
        self.push_fifo(slot, hash, stamp);
        at
    }

    /// Adds engine block `hash` of `slot` at the records' empty index entry `entry`.
    #[allow(clippy::too_many_arguments)]
    fn insert(
        &mut self,
        slot: u32,
        entry: usize,
        hash: EngineHash,
        mut kind: Kind,
        tier: usize,
        stamp: u64,
        after: Option<u32>,
    ) -> Option<u32> {
        let groups = self.slots.groups();
        let at = hold(
            &mut self.table,
            &kind,
            Place::After(after),
            slot,
            tier,
            groups,
        );
        if let (Kind::One(_, node), Some(at)) = (&mut kind, at) {
            *node = at;
        }
        self.engine_blocks += 1;
        self.record_heap += kind.heap_bytes();
        self.tier_counts[slot as usize][tier] += 1;
        self.records
            .insert_at(slot, entry, hash, Record::new(kind, stamp, 1 << tier));
        at
    }
}

/// One more holding by `slot` in `tier` of the router blocks `kind` stores; a [`Kind::One`]
/// block at `one`, whose node it returns (the others are looked up by key: heads only).
fn hold(
    table: &mut BlockTable,
    kind: &Kind,
    one: Place,
    slot: u32,
    tier: usize,
    groups: u32,
) -> Option<u32> {
    match kind {
        Kind::One(block, _) => Some(table.inc(*block, one, slot, tier, groups)),
        _ => {
            for &block in kind.own() {
                table.inc(block, Place::After(None), slot, tier, groups);
            }
            None
        }
    }
}
