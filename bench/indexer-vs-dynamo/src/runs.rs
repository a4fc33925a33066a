//! A design probe, not an index kvroute ships: the KV index as runs of blocks (a compressed
//! radix tree over router block hashes), written to measure what that layout gives before
//! `KvIndex` was rebuilt on it (stop 52; issue 32's one-core goal). It stays as the lean
//! yardstick: the layout without the features below.
//!
//! A node is a run of up to 64 router hashes that one event stored; a later event continuing a
//! run at its end appends to it, one that leaves it mid-way hangs a branch at that offset, so
//! no run is ever split and a block's place (node, offset) never changes. Each node keeps, per
//! replica holding any of it, one bit per offset. Per replica, a map from engine hash to place,
//! an event's hashes looked up all at once before its blocks are applied.
//! A query walks the runs comparing hashes, one map lookup per branch taken, not per block;
//! a replica's match is its leading held bits along the way. A node nobody holds and with no
//! branch is freed, and its ancestors after it while the same holds.
//!
//! What it leaves out, that `KvIndex` has: storage tiers (one bit set per node and replica
//! here), engine blocks of another size than the router's, a count per held block (the same
//! router block stored twice under two engine hashes), errors for bad events (an unknown
//! parent panics), the capacity bound, memory reporting and the sharded mirror.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};

use kvroute_index::{block_hash, BlockHash, EngineHash};

/// Blocks a run holds at most (one bit each in a `u64`).
const RUN: usize = 64;
const NONE: u32 = u32::MAX;

/// Keys are engine or router hashes, uniform already: hashed as they are.
#[derive(Debug, Default, Clone, Copy)]
struct AsIs;

struct AsIsHasher(u64);

impl BuildHasher for AsIs {
    type Hasher = AsIsHasher;
    fn build_hasher(&self) -> AsIsHasher {
        AsIsHasher(0)
    }
}

impl Hasher for AsIsHasher {
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 << 8) | u64::from(*b);
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = x;
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

type Map<V> = HashMap<u64, V, AsIs>;

/// (replica, a bit per offset), sorted by replica; the first one inline, since most runs
/// (a conversation's) have one holder.
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
    fn get_mut(&mut self, replica: u32) -> Option<&mut u64> {
        if self.first.0 == replica {
            return Some(&mut self.first.1);
        }
        let i = (self.rest.binary_search_by_key(&replica, |h| h.0)).ok()?;
        Some(&mut self.rest[i].1)
    }

    fn insert(&mut self, replica: u32, bits: u64) {
        if self.first.0 == NONE {
            self.first = (replica, bits);
        } else if replica < self.first.0 {
            let first = std::mem::replace(&mut self.first, (replica, bits));
            self.rest.insert(0, first);
        } else {
            let i = (self.rest.binary_search_by_key(&replica, |h| h.0)).unwrap_or_else(|i| i);
            self.rest.insert(i, (replica, bits));
        }
    }

    fn remove(&mut self, replica: u32) {
        if self.first.0 == replica {
            self.first = match self.rest.is_empty() {
                true => (NONE, 0),
                false => self.rest.remove(0),
            };
        } else if let Ok(i) = self.rest.binary_search_by_key(&replica, |h| h.0) {
            self.rest.remove(i);
        }
    }

    fn iter(&self) -> impl Iterator<Item = &(u32, u64)> {
        let first = std::iter::once(&self.first).filter(|h| h.0 != NONE);
        first.chain(&self.rest)
    }
}

#[derive(Debug, Default)]
struct Node {
    hashes: Vec<u64>,
    /// Branches: (the offset they leave at, their first hash, their node).
    branches: Vec<(u32, u64, u32)>,
    holders: Holders,
    /// Bits set over every holder.
    held: u32,
    /// The node and offset it branches from (`NONE`: a root).
    parent: u32,
    at: u32,
}

/// See the module docs.
#[derive(Debug, Default)]
pub struct RunIndex {
    nodes: Vec<Node>,
    /// Freed nodes, their buffers kept.
    free: Vec<u32>,
    roots: Map<u32>,
    /// Per replica: engine hash → its place, `node << 8 | offset`.
    places: Vec<Map<u64>>,
}

fn place(node: u32, offset: u32) -> u64 {
    (u64::from(node) << 8) | u64::from(offset)
}

fn unplace(place: u64) -> (u32, u32) {
    ((place >> 8) as u32, (place & 0xff) as u32)
}

impl RunIndex {
    /// Nodes in use.
    pub fn nodes(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    /// A `BlockStored` event of `replica` whose blocks are the router's size: `parent` is the
    /// engine hash of the block before the first (`None`: a sequence's first block).
    pub fn stored(
        &mut self,
        replica: u32,
        parent: Option<EngineHash>,
        engine_hashes: &[EngineHash],
        tokens: &[u32],
        block_size: usize,
    ) {
        let r = replica as usize;
        if self.places.len() <= r {
            self.places.resize_with(r + 1, Map::default);
        }
        let mut at = parent.map(|p| unplace(*self.places[r].get(&p.0).expect("a known parent")));
        let mut previous = at.map(|(n, o)| BlockHash(self.nodes[n as usize].hashes[o as usize]));
        self.places[r].reserve(engine_hashes.len());
        self.touch(r, engine_hashes);
        let blocks = engine_hashes.iter().zip(tokens.chunks_exact(block_size));
        for (i, (engine, block)) in blocks.enumerate() {
            let hash = block_hash(previous, 0, block).0;
            previous = Some(BlockHash(hash));
            let next = self.step(at, hash, engine_hashes.len() - i);
            self.hold(replica, next);
            self.places[r].insert(engine.0, place(next.0, next.1));
            at = Some(next);
        }
    }

    /// Where block `hash` goes after place `at` (`None`: a sequence's first): on along the run,
    /// into a branch, appended to the run, or a new branch (or root) with room for `left`.
    fn step(&mut self, at: Option<(u32, u32)>, hash: u64, left: usize) -> (u32, u32) {
        let Some((n, offset)) = at else {
            if let Some(&root) = self.roots.get(&hash) {
                return (root, 0);
            }
            let root = self.alloc(NONE, 0, hash, left);
            self.roots.insert(hash, root);
            return (root, 0);
        };
        let node = &self.nodes[n as usize];
        let o = offset as usize + 1;
        if node.hashes.get(o) == Some(&hash) {
            return (n, offset + 1);
        }
        let branch = (node.branches.iter()).find(|&&(a, first, _)| a == offset && first == hash);
        if let Some(&(_, _, b)) = branch {
            return (b, 0);
        }
        if o == node.hashes.len() && o < RUN {
            self.nodes[n as usize].hashes.push(hash);
            return (n, offset + 1);
        }
        let b = self.alloc(n, offset, hash, left);
        self.nodes[n as usize].branches.push((offset, hash, b));
        (b, 0)
    }

    fn alloc(&mut self, parent: u32, at: u32, first: u64, room: usize) -> u32 {
        if let Some(i) = self.free.pop() {
            let node = &mut self.nodes[i as usize];
            node.hashes.push(first);
            (node.parent, node.at) = (parent, at);
            return i;
        }
        let mut hashes = Vec::with_capacity(room.clamp(1, RUN));
        hashes.push(first);
        self.nodes.push(Node {
            hashes,
            parent,
            at,
            ..Node::default()
        });
        (self.nodes.len() - 1) as u32
    }

    fn hold(&mut self, replica: u32, (n, offset): (u32, u32)) {
        let node = &mut self.nodes[n as usize];
        let bit = 1u64 << offset;
        match node.holders.get_mut(replica) {
            Some(bits) if *bits & bit != 0 => return,
            Some(bits) => *bits |= bit,
            None => node.holders.insert(replica, bit),
        }
        node.held += 1;
    }

    /// Looks up every engine hash of an event before its blocks are applied one by one: the
    /// lookups do not depend on each other, so their cache misses overlap, and the inserts or
    /// removals after them find their slots in cache (churn 22.6-24.7 → 28.0-28.1 M block
    /// events/s in a scratch loop, three runs each).
    fn touch(&self, replica: usize, engine_hashes: &[EngineHash]) {
        let places = &self.places[replica];
        let seen = (engine_hashes.iter()).fold(0, |x, e| x ^ places.get(&e.0).map_or(0, |p| *p));
        std::hint::black_box(seen);
    }

    /// A `BlockRemoved` event of `replica`.
    pub fn removed(&mut self, replica: u32, engine_hashes: &[EngineHash]) {
        let r = replica as usize;
        if r >= self.places.len() {
            return;
        }
        self.touch(r, engine_hashes);
        for e in engine_hashes {
            let Some(p) = self.places[r].remove(&e.0) else {
                continue;
            };
            let (n, offset) = unplace(p);
            let node = &mut self.nodes[n as usize];
            let bit = 1u64 << offset;
            let Some(bits) = node.holders.get_mut(replica) else {
                continue;
            };
            if *bits & bit == 0 {
                continue;
            }
            *bits &= !bit;
            if *bits == 0 {
                node.holders.remove(replica);
            }
            node.held -= 1;
            self.collect(n);
        }
    }

    /// Frees `n`, then its ancestors, while nobody holds them and no branch leaves them.
    fn collect(&mut self, mut n: u32) {
        loop {
            let node = &mut self.nodes[n as usize];
            if node.held > 0 || !node.branches.is_empty() {
                return;
            }
            let (parent, at, first) = (node.parent, node.at, node.hashes[0]);
            node.hashes.clear();
            node.holders = Holders {
                first: (NONE, 0),
                rest: std::mem::take(&mut node.holders.rest),
            };
            self.free.push(n);
            if parent == NONE {
                self.roots.remove(&first);
                return;
            }
            let branches = &mut self.nodes[parent as usize].branches;
            let i = (branches.iter())
                .position(|&(a, f, b)| (a, f, b) == (at, first, n))
                .expect("a branch of its parent");
            branches.swap_remove(i);
            n = parent;
        }
    }

    /// Per replica holding the first block of `query`, sorted by replica, how many leading
    /// blocks of it the replica holds.
    pub fn find_matches(&self, query: &[BlockHash]) -> Vec<(u32, u32)> {
        let mut matched: Vec<(u32, u32)> = Vec::new();
        let Some(&root) = query.first().and_then(|h| self.roots.get(&h.0)) else {
            return matched;
        };
        let (mut n, mut start, mut pos) = (root, 0usize, 0usize);
        loop {
            let node = &self.nodes[n as usize];
            // How far the query follows this run from `start`.
            let len = (node.hashes[start..].iter())
                .zip(&query[pos..])
                .take_while(|(a, b)| **a == b.0)
                .count();
            let mask = match len {
                64 => u64::MAX,
                len => ((1u64 << len) - 1) << start,
            };
            let run = |bits: u64| ((bits & mask) >> start).trailing_ones().min(len as u32);
            if pos == 0 {
                let holding = node.holders.iter().filter(|h| h.1 & 1 << start != 0);
                matched.extend(holding.map(|&(r, bits)| (r, run(bits))));
            } else {
                // Those that held every block so far go on by their leading bits here.
                let mut holders = node.holders.iter().peekable();
                for m in matched.iter_mut().filter(|m| m.1 as usize == pos) {
                    while holders.peek().is_some_and(|h| h.0 < m.0) {
                        holders.next();
                    }
                    if let Some(&&(r, bits)) = holders.peek() {
                        if r == m.0 {
                            m.1 += run(bits);
                        }
                    }
                }
            }
            pos += len;
            if pos == query.len() || !matched.iter().any(|m| m.1 as usize == pos) {
                return matched;
            }
            let end = (start + len - 1) as u32;
            let branch = (node.branches.iter()).find(|&&(a, f, _)| a == end && f == query[pos].0);
            match branch {
                Some(&(_, _, b)) => (n, start) = (b, 0),
                None => return matched,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use kvroute_index::{EngineHash, KvIndex, KvIndexer, ReplicaId, StorageTier, StoredBlocks};

    use super::*;

    /// Random chains over shared prefixes, stored in pieces by several replicas and removed
    /// newest first or at random: the probe answers as `KvIndex` does after every event.
    #[test]
    fn answers_as_kv_index_does() {
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        };
        let bs = 4;
        let prefixes: Vec<Vec<u32>> = (0..4)
            .map(|_| (0..bs * 40).map(|_| next(50) as u32).collect())
            .collect();
        let (mut kv, mut runs) = (KvIndex::new(bs), RunIndex::default());
        let mut stored: Vec<(u32, Vec<EngineHash>)> = Vec::new();
        for round in 0..300u64 {
            let replica = next(6) as u32;
            let mut tokens = prefixes[next(4) as usize][..bs * (1 + next(40) as usize)].to_vec();
            tokens.extend((0..bs * next(90) as usize).map(|_| next(50) as u32));
            let engine: Vec<EngineHash> = (kvroute_index::block_hashes(&tokens, bs, 7).iter())
                .map(|h| EngineHash(h.0 ^ u64::from(replica)))
                .collect();
            let mut start = 0;
            while start < engine.len() {
                let end = (start + 1 + next(20) as usize).min(engine.len());
                let parent = start.checked_sub(1).map(|i| engine[i]);
                let event = StoredBlocks {
                    parent,
                    engine_hashes: &engine[start..end],
                    token_ids: &tokens[start * bs..end * bs],
                    block_size: bs,
                    tier: StorageTier::Device,
                    salt: 0,
                };
                kv.apply_stored(ReplicaId(replica), &event).expect("valid");
                runs.stored(replica, parent, event.engine_hashes, event.token_ids, bs);
                start = end;
            }
            stored.push((replica, engine));
            if round % 3 == 0 && !stored.is_empty() {
                let (replica, mut engine) = stored.swap_remove(next(stored.len() as u64) as usize);
                engine.reverse();
                if next(2) == 0 {
                    engine.truncate(1 + next(engine.len() as u64) as usize);
                }
                kv.apply_removed(ReplicaId(replica), StorageTier::Device, &engine);
                runs.removed(replica, &engine);
            }
            for p in &prefixes {
                let mut query = p.clone();
                query.extend((0..bs * 8).map(|_| next(50) as u32));
                let hashes = kvroute_index::block_hashes(&query, bs, 0);
                let want: Vec<(u32, u32)> = (kv.find_matches(&hashes).scores.iter())
                    .map(|(r, c)| (r.0, c.total()))
                    .collect();
                assert_eq!(runs.find_matches(&hashes), want, "round {round}");
            }
        }
        assert!(runs.nodes() > 0);
    }
}
