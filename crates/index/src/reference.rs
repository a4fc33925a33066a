//! Naive models of the indexes: the oracles of the differential tests and the baseline of the
//! benchmarks. They follow the same rules as [`KvIndex`](crate::KvIndex) and
//! [`ApproxIndex`](crate::ApproxIndex) (see [`kv_index`](crate::kv_index)) with the plainest
//! data structures: per replica, a map of block → holdings per tier, walked replica by
//! replica; each engine record keeps a copy of the partial router block after it instead of
//! walking back. They have no capacity bound. Not for production use.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::hash::block_hash;
use crate::hasher::map_bytes;
use crate::kv_index::tier_index;
use crate::{
    ApproxIndexer, BlockHash, EngineHash, IndexError, KvIndexer, OverlapScores, ReplicaId,
    StorageTier, StoredBlocks, TierCounts,
};

const TIERS: [StorageTier; 4] = [
    StorageTier::Device,
    StorageTier::Host,
    StorageTier::Disk,
    StorageTier::External,
];

/// The reference model of [`KvIndexer`].
#[derive(Debug)]
pub struct ReferenceIndex {
    block_size: usize,
    replicas: BTreeMap<ReplicaId, Replica>,
}

#[derive(Debug, Default)]
struct Replica {
    engine: HashMap<EngineHash, Record>,
    /// Holdings of each router block per tier.
    held: HashMap<BlockHash, [u32; 4]>,
}

#[derive(Debug, Clone)]
struct Record {
    tiers: [bool; 4],
    /// Router blocks this engine block stores.
    own: Vec<BlockHash>,
    /// Router blocks completed later through this piece.
    members_of: Vec<BlockHash>,
    /// The mapping's identity.
    piece: bool,
    parent: Option<EngineHash>,
    base: Option<BlockHash>,
    tokens: Vec<u32>,
    /// Where the chain stands after this block: the last complete router block, and the
    /// partial router block's tokens and pieces.
    next_base: Option<BlockHash>,
    tail: Vec<u32>,
    tail_members: Vec<EngineHash>,
}

impl Record {
    fn same_mapping(&self, other: &Record) -> bool {
        if self.piece != other.piece {
            return false;
        }
        if !self.piece {
            return self.own == other.own;
        }
        self.parent == other.parent
            && self.base == other.base
            && self.tail.len() == other.tail.len()
            && self.tokens == other.tokens
            && self.own == other.own
    }
}

impl ReferenceIndex {
    pub fn new(block_size: usize) -> Self {
        assert!(block_size > 0, "the router's block size must be positive");
        Self {
            block_size,
            replicas: BTreeMap::new(),
        }
    }

    fn upsert(&mut self, replica: ReplicaId, hash: EngineHash, mut new: Record, tier: usize) {
        let rep = self.replicas.entry(replica).or_default();
        if let Some(old) = rep.engine.get_mut(&hash) {
            if old.same_mapping(&new) {
                if !old.tiers[tier] {
                    old.tiers[tier] = true;
                    for block in &old.own {
                        rep.held.entry(*block).or_default()[tier] += 1;
                    }
                }
                return;
            }
            Self::remove_all(rep, hash);
        }
        new.tiers = [false; 4];
        new.tiers[tier] = true;
        for block in &new.own {
            rep.held.entry(*block).or_default()[tier] += 1;
        }
        rep.engine.insert(hash, new);
    }

    fn remove_all(rep: &mut Replica, hash: EngineHash) {
        for tier in 0..4 {
            Self::remove_tier(rep, hash, tier);
        }
    }

    fn remove_tier(rep: &mut Replica, hash: EngineHash, tier: usize) -> bool {
        let Some(record) = rep.engine.get_mut(&hash) else {
            return false;
        };
        if !record.tiers[tier] {
            return false;
        }
        record.tiers[tier] = false;
        for block in record.own.iter().chain(&record.members_of) {
            if let Some(counts) = rep.held.get_mut(block) {
                counts[tier] = counts[tier].saturating_sub(1);
                if counts.iter().all(|c| *c == 0) {
                    rep.held.remove(block);
                }
            }
        }
        if record.tiers.iter().all(|t| !t) {
            rep.engine.remove(&hash);
        }
        true
    }
}

impl KvIndexer for ReferenceIndex {
    fn block_size(&self) -> usize {
        self.block_size
    }

    fn apply_stored(
        &mut self,
        replica: ReplicaId,
        event: &StoredBlocks<'_>,
    ) -> Result<(), IndexError> {
        let (bs, ebs) = (self.block_size, event.block_size);
        if ebs == 0 || (ebs % bs != 0 && bs % ebs != 0) {
            return Err(IndexError::BlockSizeMismatch {
                engine: ebs,
                router: bs,
            });
        }
        if event.token_ids.len() != event.engine_hashes.len() * ebs {
            return Err(IndexError::TokenCount {
                tokens: event.token_ids.len(),
                blocks: event.engine_hashes.len(),
                block_size: ebs,
            });
        }
        if event.engine_hashes.is_empty() {
            return Ok(());
        }
        let (mut base, mut tail, mut members) = (None, Vec::new(), Vec::new());
        if let Some(parent) = event.parent {
            let unknown = IndexError::UnknownParent(parent);
            let rep = self.replicas.get(&replica).ok_or(unknown.clone())?;
            let record = rep.engine.get(&parent).ok_or(unknown)?;
            base = record.next_base;
            if !record.tail.is_empty() {
                if ebs >= bs || record.tail.len() % ebs != 0 {
                    return Err(IndexError::BlockSizeMismatch {
                        engine: ebs,
                        router: bs,
                    });
                }
                if let Some(gone) = record
                    .tail_members
                    .iter()
                    .rev()
                    .find(|m| !rep.engine.contains_key(m))
                {
                    return Err(IndexError::UnknownParent(*gone));
                }
                tail = record.tail.clone();
                members = record.tail_members.clone();
            }
        }
        let tier = tier_index(event.tier);
        let mut parent = event.parent;
        for (i, &hash) in event.engine_hashes.iter().enumerate() {
            let tokens = &event.token_ids[i * ebs..(i + 1) * ebs];
            let mut record = Record {
                tiers: [false; 4],
                own: Vec::new(),
                members_of: Vec::new(),
                piece: ebs < bs,
                parent,
                base,
                tokens: Vec::new(),
                next_base: None,
                tail: Vec::new(),
                tail_members: Vec::new(),
            };
            if ebs >= bs {
                for piece in tokens.chunks(bs) {
                    base = Some(block_hash(base, event.salt, piece));
                    record.own.push(base.expect("just set"));
                }
                record.next_base = base;
                self.upsert(replica, hash, record, tier);
            } else {
                tail.extend_from_slice(tokens);
                if tail.len() == bs {
                    let block = block_hash(base, event.salt, &tail);
                    record.own.push(block);
                    record.next_base = Some(block);
                    self.upsert(replica, hash, record, tier);
                    let rep = self.replicas.get_mut(&replica).expect("just stored");
                    for member in members.drain(..) {
                        if let Some(m) = rep.engine.get_mut(&member) {
                            if !m.members_of.contains(&block) {
                                m.members_of.push(block);
                            }
                        }
                    }
                    tail.clear();
                    base = Some(block);
                } else {
                    members.push(hash);
                    record.tokens = tokens.to_vec();
                    record.next_base = base;
                    record.tail = tail.clone();
                    record.tail_members = members.clone();
                    self.upsert(replica, hash, record, tier);
                }
            }
            parent = Some(hash);
        }
        Ok(())
    }

    fn apply_removed(
        &mut self,
        replica: ReplicaId,
        tier: StorageTier,
        engine_hashes: &[EngineHash],
    ) {
        if let Some(rep) = self.replicas.get_mut(&replica) {
            for hash in engine_hashes {
                Self::remove_tier(rep, *hash, tier_index(tier));
            }
        }
    }

    fn clear_replica(&mut self, replica: ReplicaId) {
        self.replicas.remove(&replica);
    }

    fn find_matches(&self, hashes: &[BlockHash]) -> OverlapScores {
        let mut scores = Vec::new();
        for (id, rep) in &self.replicas {
            let mut counts = TierCounts::default();
            for hash in hashes {
                let best = rep
                    .held
                    .get(hash)
                    .and_then(|held| (0..4).find(|t| held[*t] > 0));
                match best {
                    Some(tier) => counts.add(TIERS[tier], 1),
                    None => break,
                }
            }
            if counts.total() > 0 {
                scores.push((*id, counts));
            }
        }
        OverlapScores { scores }
    }

    fn num_blocks(&self) -> usize {
        let blocks: HashSet<_> = self.replicas.values().flat_map(|r| r.held.keys()).collect();
        blocks.len()
    }

    fn memory_bytes(&self) -> usize {
        self.replicas
            .values()
            .map(|rep| {
                map_bytes::<BlockHash, [u32; 4]>(rep.held.capacity())
                    + map_bytes::<EngineHash, Record>(rep.engine.capacity())
                    + rep
                        .engine
                        .values()
                        .map(|r| {
                            8 * (r.own.capacity()
                                + r.members_of.capacity()
                                + r.tail_members.capacity())
                                + 4 * (r.tokens.capacity() + r.tail.capacity())
                        })
                        .sum::<usize>()
            })
            .sum::<usize>()
            + self.replicas.len() * (std::mem::size_of::<Replica>() + 32)
    }
}

/// The reference model of [`ApproxIndexer`] (no capacity bound).
#[derive(Debug)]
pub struct ReferenceApprox {
    ttl: Duration,
    held: BTreeMap<ReplicaId, HashMap<BlockHash, Instant>>,
}

impl ReferenceApprox {
    pub fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            held: BTreeMap::new(),
        }
    }
}

impl ApproxIndexer for ReferenceApprox {
    fn record(&mut self, replica: ReplicaId, hashes: &[BlockHash], now: Instant) {
        let rep = self.held.entry(replica).or_default();
        for hash in hashes {
            rep.insert(*hash, now + self.ttl);
        }
    }

    fn expire(&mut self, now: Instant) {
        for rep in self.held.values_mut() {
            rep.retain(|_, deadline| *deadline > now);
        }
    }

    fn clear_replica(&mut self, replica: ReplicaId) {
        self.held.remove(&replica);
    }

    fn find_matches(&self, hashes: &[BlockHash], now: Instant) -> OverlapScores {
        let mut scores = Vec::new();
        for (id, rep) in &self.held {
            let held = hashes
                .iter()
                .take_while(|h| rep.get(h).is_some_and(|deadline| *deadline > now))
                .count();
            if held > 0 {
                let counts = TierCounts {
                    device: held as u32,
                    ..TierCounts::default()
                };
                scores.push((*id, counts));
            }
        }
        OverlapScores { scores }
    }

    fn num_blocks(&self) -> usize {
        let blocks: HashSet<_> = self.held.values().flat_map(|r| r.keys()).collect();
        blocks.len()
    }
}
