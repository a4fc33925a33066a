//! A bounded set of block hashes with least-recently-used eviction: `llm_d`'s approximation
//! of what one engine holds in its prefix cache.
//!
//! The entries form a doubly linked list threaded through a `Vec` (indices, not pointers),
//! most recent at the head, with a map from hash to slot: lookup, insert and refresh are
//! O(1), and a full set reuses its least recent slot for the new hash, so a set never holds
//! more than its capacity and never allocates past it.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher, RandomState};

use kvroute_protocol::mix64;

const NIL: u32 = u32::MAX;

/// The most entries one set may hold (a bound on a capacity derived from an engine's
/// reported `num_gpu_blocks`, which the router does not control).
pub(super) const MAX_CAPACITY: usize = 1 << 24;

#[derive(Debug, Clone, Copy)]
struct Node {
    hash: u64,
    prev: u32,
    next: u32,
}

/// A bounded LRU set of block hashes.
#[derive(Debug)]
pub(super) struct BlockLru {
    map: HashMap<u64, u32, BlockHashState>,
    nodes: Vec<Node>,
    /// Most recently used.
    head: u32,
    /// Least recently used: the next to go.
    tail: u32,
    capacity: usize,
}

impl BlockLru {
    /// An empty set holding at most `capacity` hashes (clamped to `1..=MAX_CAPACITY`).
    pub(super) fn new(capacity: usize, hasher: BlockHashState) -> Self {
        Self {
            map: HashMap::with_hasher(hasher),
            nodes: Vec::new(),
            head: NIL,
            tail: NIL,
            capacity: capacity.clamp(1, MAX_CAPACITY),
        }
    }

    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    pub(super) fn capacity(&self) -> usize {
        self.capacity
    }

    /// Whether `hash` is held. Does not refresh it (llm-d's lookups do not either).
    pub(super) fn contains(&self, hash: u64) -> bool {
        self.map.contains_key(&hash)
    }

    /// Makes `hash` the most recent entry, evicting the least recent one when full.
    pub(super) fn insert(&mut self, hash: u64) {
        if let Some(&slot) = self.map.get(&hash) {
            self.unlink(slot);
            self.push_front(slot);
            return;
        }
        let slot = if self.map.len() < self.capacity {
            let slot = self.nodes.len() as u32;
            self.nodes.push(Node {
                hash,
                prev: NIL,
                next: NIL,
            });
            slot
        } else {
            let slot = self.tail;
            self.unlink(slot);
            let old = std::mem::replace(&mut self.nodes[slot as usize].hash, hash);
            self.map.remove(&old);
            slot
        };
        self.map.insert(hash, slot);
        self.push_front(slot);
    }

    /// Changes the capacity (clamped to `1..=MAX_CAPACITY`); shrinking keeps the most
    /// recent entries.
    pub(super) fn set_capacity(&mut self, capacity: usize) {
        let capacity = capacity.clamp(1, MAX_CAPACITY);
        if capacity >= self.map.len() {
            self.capacity = capacity;
            return;
        }
        let keep: Vec<u64> = self.iter_recent().take(capacity).collect();
        let mut fresh = BlockLru::new(capacity, *self.map.hasher());
        for &hash in keep.iter().rev() {
            fresh.insert(hash);
        }
        *self = fresh;
    }

    /// The hashes, most recent first.
    pub(super) fn iter_recent(&self) -> impl Iterator<Item = u64> + '_ {
        let mut at = self.head;
        std::iter::from_fn(move || {
            let node = self.nodes.get(at as usize)?;
            at = node.next;
            Some(node.hash)
        })
    }

    fn unlink(&mut self, slot: u32) {
        let Node { prev, next, .. } = self.nodes[slot as usize];
        match prev {
            NIL => self.head = next,
            p => self.nodes[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.nodes[n as usize].prev = prev,
        }
    }

    fn push_front(&mut self, slot: u32) {
        let old_head = self.head;
        let node = &mut self.nodes[slot as usize];
        node.prev = NIL;
        node.next = old_head;
        match old_head {
            NIL => self.tail = slot,
            h => self.nodes[h as usize].prev = slot,
        }
        self.head = slot;
    }
}

/// Hashes block hashes for the sets' maps. Block hashes are already XXH3 outputs, so one
/// mixing round suffices; it is keyed with a per-process random seed (taken from std's
/// `RandomState`) so that crafted prompts cannot aim many hashes at one bucket.
#[derive(Debug, Clone, Copy)]
pub(super) struct BlockHashState {
    seed: u64,
}

impl BlockHashState {
    pub(super) fn new() -> Self {
        Self {
            seed: RandomState::new().hash_one(0x006c_6c6d_5f64_u64),
        }
    }
}

impl BuildHasher for BlockHashState {
    type Hasher = BlockHasher;

    fn build_hasher(&self) -> BlockHasher {
        BlockHasher {
            seed: self.seed,
            state: 0,
        }
    }
}

#[derive(Debug)]
pub(super) struct BlockHasher {
    seed: u64,
    state: u64,
}

impl Hasher for BlockHasher {
    fn finish(&self) -> u64 {
        self.state
    }

    fn write_u64(&mut self, value: u64) {
        self.state = mix64(self.state ^ value, self.seed);
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(word));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recent(lru: &BlockLru) -> Vec<u64> {
        lru.iter_recent().collect()
    }

    #[test]
    fn evicts_the_least_recently_used_and_never_exceeds_capacity() {
        let mut lru = BlockLru::new(3, BlockHashState::new());
        for h in [1, 2, 3] {
            lru.insert(h);
        }
        assert_eq!(recent(&lru), [3, 2, 1]);
        lru.insert(1); // refresh: 2 is now the least recent
        lru.insert(4);
        assert_eq!(recent(&lru), [4, 1, 3]);
        assert!(!lru.contains(2));
        assert!(lru.contains(1) && lru.contains(3) && lru.contains(4));
        for h in 10..1000 {
            lru.insert(h);
            assert!(lru.len() <= 3);
        }
        assert_eq!(recent(&lru), [999, 998, 997]);
        assert_eq!(lru.nodes.len(), 3, "slots are reused, not grown");
    }

    #[test]
    fn lookups_do_not_refresh() {
        let mut lru = BlockLru::new(2, BlockHashState::new());
        lru.insert(1);
        lru.insert(2);
        assert!(lru.contains(1));
        lru.insert(3);
        assert!(!lru.contains(1));
    }

    #[test]
    fn shrinking_keeps_the_most_recent_and_growing_keeps_all() {
        let mut lru = BlockLru::new(10, BlockHashState::new());
        for h in 1..=6 {
            lru.insert(h);
        }
        lru.set_capacity(20);
        assert_eq!(lru.len(), 6);
        lru.set_capacity(4);
        assert_eq!(recent(&lru), [6, 5, 4, 3]);
        assert_eq!(lru.capacity(), 4);
        lru.insert(7);
        assert_eq!(recent(&lru), [7, 6, 5, 4]);
        lru.set_capacity(0);
        assert_eq!(recent(&lru), [7]);
    }

    #[test]
    fn matches_a_simple_model_on_a_random_sequence() {
        use rand::rngs::SmallRng;
        use rand::{Rng, SeedableRng};
        let mut rng = SmallRng::seed_from_u64(5);
        let mut lru = BlockLru::new(16, BlockHashState::new());
        let mut model: Vec<u64> = Vec::new(); // most recent first
        for _ in 0..5000 {
            let h = rng.random_range(0..40u64);
            model.retain(|&x| x != h);
            model.insert(0, h);
            model.truncate(16);
            lru.insert(h);
            assert_eq!(recent(&lru), model);
        }
    }
}
