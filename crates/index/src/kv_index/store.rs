//! Applying `BlockStored`: resolving where the chain continues, then re-blocking.

use super::record::{Basis, Kind, Part, Record};
use super::{tier_index, KvIndex};
use crate::hash::hash_into;
use crate::hasher::MixMap;
use crate::{BlockHash, EngineHash, IndexError, ReplicaId, StoredBlocks};

/// Buffers reused across events.
#[derive(Debug, Default)]
pub(super) struct Scratch {
    bytes: Vec<u8>,
    /// Tokens of the partial router block being filled.
    tokens: Vec<u32>,
    /// Engine blocks of the partial router block being filled, in order.
    members: Vec<EngineHash>,
}

impl Scratch {
    pub(super) fn memory_bytes(&self) -> usize {
        self.bytes.capacity() + 4 * self.tokens.capacity() + 8 * self.members.capacity()
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
        let mut scratch = std::mem::take(&mut self.scratch);
        let result = self.resolve_parent(replica, event, &mut scratch);
        let result = result.map(|base| {
            let slot = self.slots.get_or_insert(replica);
            if self.replicas.len() <= slot as usize {
                self.replicas
                    .resize_with(slot as usize + 1, MixMap::default);
            }
            if engine >= router {
                self.store_whole(slot, event, base, &mut scratch.bytes);
            } else {
                self.store_pieces(slot, event, base, &mut scratch);
            }
        });
        self.scratch = scratch;
        result
    }

    /// Where the event's chain starts: the router block before it, and (in
    /// `scratch.tokens`/`members`) the pieces of a partial router block it continues.
    fn resolve_parent(
        &self,
        replica: ReplicaId,
        event: &StoredBlocks<'_>,
        scratch: &mut Scratch,
    ) -> Result<Option<BlockHash>, IndexError> {
        scratch.tokens.clear();
        scratch.members.clear();
        let Some(parent) = event.parent else {
            return Ok(None);
        };
        let engine = self
            .slots
            .get(replica)
            .map(|slot| &self.replicas[slot as usize])
            .ok_or(IndexError::UnknownParent(parent))?;
        let record = engine
            .get(&parent)
            .ok_or(IndexError::UnknownParent(parent))?;
        let Basis { base, filled } = record.kind.basis();
        if filled == 0 {
            return Ok(base);
        }
        if event.block_size >= self.block_size || filled as usize % event.block_size != 0 {
            return Err(IndexError::BlockSizeMismatch {
                engine: event.block_size,
                router: self.block_size,
            });
        }
        // Walk back through the pieces of the partial router block.
        let mut need = filled as usize;
        let mut current = parent;
        loop {
            let part = match engine.get(&current).map(|r| &r.kind) {
                Some(Kind::Part(part)) if part.own.is_none() && part.base == base => part,
                _ => return Err(IndexError::UnknownParent(current)),
            };
            scratch.members.push(current);
            need = need
                .checked_sub(part.tokens.len())
                .ok_or(IndexError::UnknownParent(current))?;
            if need == 0 {
                break;
            }
            current = part.parent.ok_or(IndexError::UnknownParent(current))?;
        }
        scratch.members.reverse();
        for member in &scratch.members {
            if let Some(Kind::Part(part)) = engine.get(member).map(|r| &r.kind) {
                scratch.tokens.extend_from_slice(&part.tokens);
            }
        }
        Ok(base)
    }

    /// Engine block size a multiple of the router's.
    fn store_whole(
        &mut self,
        slot: u32,
        event: &StoredBlocks<'_>,
        base: Option<BlockHash>,
        bytes: &mut Vec<u8>,
    ) {
        let router = self.block_size;
        let mut previous = base;
        for (&hash, tokens) in event
            .engine_hashes
            .iter()
            .zip(event.token_ids.chunks_exact(event.block_size))
        {
            let kind = if tokens.len() == router {
                let block = hash_into(previous, event.salt, tokens, bytes);
                previous = Some(block);
                Kind::One(block)
            } else {
                let blocks = tokens
                    .chunks_exact(router)
                    .map(|piece| {
                        let block = hash_into(previous, event.salt, piece, bytes);
                        previous = Some(block);
                        block
                    })
                    .collect();
                Kind::Many(Box::new(blocks))
            };
            self.upsert(slot, hash, kind, tier_index(event.tier));
        }
    }

    /// Engine block size a divisor of the router's.
    fn store_pieces(
        &mut self,
        slot: u32,
        event: &StoredBlocks<'_>,
        mut base: Option<BlockHash>,
        scratch: &mut Scratch,
    ) {
        let router = self.block_size;
        let mut parent = event.parent;
        for (&hash, tokens) in event
            .engine_hashes
            .iter()
            .zip(event.token_ids.chunks_exact(event.block_size))
        {
            scratch.tokens.extend_from_slice(tokens);
            let filled = scratch.tokens.len();
            let own = (filled == router)
                .then(|| hash_into(base, event.salt, &scratch.tokens, &mut scratch.bytes));
            let part = Part {
                parent,
                base,
                filled: filled as u32,
                tokens: if own.is_some() {
                    Box::default()
                } else {
                    tokens.into()
                },
                own,
                members_of: Vec::new(),
            };
            self.upsert(
                slot,
                hash,
                Kind::Part(Box::new(part)),
                tier_index(event.tier),
            );
            match own {
                Some(block) => {
                    for member in scratch.members.drain(..) {
                        self.add_member_of(slot, member, block);
                    }
                    scratch.tokens.clear();
                    base = Some(block);
                }
                None => scratch.members.push(hash),
            }
            parent = Some(hash);
        }
    }

    /// Records that `block` was completed through the piece `member`.
    fn add_member_of(&mut self, slot: u32, member: EngineHash, block: BlockHash) {
        let Some(record) = self.replicas[slot as usize].get_mut(&member) else {
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

    /// Stores engine block `hash` of `slot` in `tier` with mapping `kind`.
    fn upsert(&mut self, slot: u32, hash: EngineHash, kind: Kind, tier: usize) {
        use std::collections::hash_map::Entry;
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        let groups = self.slots.groups();
        match self.replicas[slot as usize].entry(hash) {
            Entry::Occupied(mut held) if held.get().kind.same_mapping(&kind) => {
                let record = held.get_mut();
                record.set_stamp(stamp);
                if record.tiers() & (1 << tier) == 0 {
                    record.set_tiers(record.tiers() | 1 << tier);
                    for &block in record.kind.own() {
                        self.table.inc(block, slot, tier, groups);
                    }
                }
            }
            Entry::Occupied(_) => {
                self.remove_record(slot, hash);
                self.insert(slot, hash, kind, tier, stamp);
            }
            Entry::Vacant(vacant) => {
                for &block in kind.own() {
                    self.table.inc(block, slot, tier, groups);
                }
                self.records += 1;
                self.record_heap += kind.heap_bytes();
                vacant.insert(Record::new(kind, stamp, 1 << tier));
            }
        }
        self.push_fifo(slot, hash, stamp);
    }

    fn insert(&mut self, slot: u32, hash: EngineHash, kind: Kind, tier: usize, stamp: u64) {
        let groups = self.slots.groups();
        for &block in kind.own() {
            self.table.inc(block, slot, tier, groups);
        }
        self.records += 1;
        self.record_heap += kind.heap_bytes();
        self.replicas[slot as usize].insert(hash, Record::new(kind, stamp, 1 << tier));
    }
}
