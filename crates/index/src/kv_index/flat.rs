//! A map from block-table keys (router block hashes, already uniform) to a 64-bit value, in
//! two arrays:
//! - `nodes`, an arena of (key, value) pairs, 16 bytes each, allocated in insertion order (a
//!   freed node is reused last freed, first reused), so the blocks of one chain stored
//!   together lie side by side, and a query walking that chain reads consecutive memory: it
//!   checks the node after the last one matched ([`FlatMap::successor`]) before it looks the
//!   block up;
//! - `index`, a [`TagIndex`] whose tag is the key's upper half: only a tag match reads the
//!   node. It holds the *heads* only.
//!
//! # Heads and tails
//! A node inserted with the node of its key's parent block (the block before it in its chain)
//! as `after`, where the node right after that one is free or not yet allocated, takes that
//! place and is a *tail*: it is not in the index, and is found as the successor of its
//! parent's node, which is how a query steps and how a store continues a chain. Every other
//! node is a *head*, in the index. A block's parent being unique (its hash chains its parent's),
//! a block is in the map iff the index holds it or it is the successor of its parent's node;
//! [`FlatMap::insert`] therefore needs the parent's node to find a tail, and a key without a
//! parent (a chain's first block) is always a head. When a node is removed, a tail after it
//! becomes a head. Storing a run of blocks costs one index entry, not one a block, and the
//! index stays small enough for the cache. [`FlatMap::heads_only`] turns tails off for good
//! (every tail becomes a head), for callers that cannot name a block's parent node.
//!
//! # Stores that need no lookup
//! A head inserted with its parent's node (the node after that one being taken) is that
//! node's *head child*: the map remembers its parent and marks the parent *branched*. A node
//! removed while it has head children is not freed but kept as a *tombstone* (no key, never
//! found) until its last head child goes, and a tail orphaned by a removal becomes a head
//! child of the tombstone. So while there is no tombstone, every head stored after a parent
//! is a head child of that parent's live node, and a key inserted after a node that is not
//! branched is in the map only if it is that node's successor: [`FlatMap::insert`] then skips
//! the index lookup (a store extending a chain into new blocks, the common case, makes one
//! lookup an event, not one a block). Engines evicting a chain's newest blocks first leave no
//! tombstone.
//!
//! About 16 bytes an entry plus 8 a head (at 3/4 load: ~11), and for a head child its
//! parent and its parent's count (two small maps). Key 0 marks a free node and key 1 a
//! tombstone, so keys 0 and 1 are stored as [`ZERO_STANDIN`]: those keys then share an entry,
//! which is as likely as two blocks sharing a 64-bit hash.

use super::tags::TagIndex;
use crate::hasher::{map_bytes, MixMap};

const FREE: u64 = 0;
/// The key of a tombstone; stored keys equal to it share [`ZERO_STANDIN`] too.
const TOMB: u64 = 1;
const ZERO_STANDIN: u64 = 0x5BD1_E995_C6A4_A793;
const MIN_ENTRIES: usize = 64;

#[derive(Debug, Default, Clone, Copy)]
struct Node {
    key: u64,
    value: u64,
}

#[derive(Debug, Default)]
pub(crate) struct FlatMap {
    /// The heads.
    index: TagIndex,
    nodes: Vec<Node>,
    /// The last freed node: free nodes are a doubly linked list through their values
    /// ([`links`]), so that a free node taken as a tail leaves it at once.
    free: Option<u32>,
    /// Bit `at` set: node `at` is a tail.
    tails: Vec<u64>,
    /// Bit `at` set: node `at` has head children (counted in `children`).
    branched: Vec<u64>,
    /// Head child → its parent's node (a live node or a tombstone).
    parent_of: MixMap<u32, u32>,
    /// Node → its head children, where it has some.
    children: MixMap<u32, u32>,
    /// Tombstones: nodes removed while they had head children.
    tombstones: usize,
    live: usize,
    heads_only: bool,
}

/// `key` as the map stores it (0 and 1, which mark free nodes and tombstones, become
/// [`ZERO_STANDIN`]).
#[inline]
pub(crate) fn stored(key: u64) -> u64 {
    if key == FREE || key == TOMB {
        ZERO_STANDIN
    } else {
        key
    }
}

/// Whether a node with `key` holds a key (is neither free nor a tombstone).
#[inline]
fn live(key: u64) -> bool {
    key != FREE && key != TOMB
}

#[inline]
fn tag(key: u64) -> u32 {
    (key >> 32) as u32
}

/// A free node's value: the previous and next free nodes (`u32::MAX`: none).
fn links(value: u64) -> (Option<u32>, Option<u32>) {
    let some = |v: u32| (v != u32::MAX).then_some(v);
    (some((value >> 32) as u32), some(value as u32))
}

fn bit(bits: &[u64], at: usize) -> bool {
    bits.get(at / 64).is_some_and(|w| w >> (at % 64) & 1 == 1)
}

fn set_bit(bits: &mut Vec<u64>, at: usize, on: bool) {
    if bits.len() <= at / 64 {
        if !on {
            return;
        }
        bits.resize(at / 64 + 1, 0);
    }
    if on {
        bits[at / 64] |= 1 << (at % 64);
    } else {
        bits[at / 64] &= !(1 << (at % 64));
    }
}

fn link_value(prev: Option<u32>, next: Option<u32>) -> u64 {
    u64::from(prev.unwrap_or(u32::MAX)) << 32 | u64::from(next.unwrap_or(u32::MAX))
}

impl FlatMap {
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.live
    }

    #[inline]
    fn is_tail(&self, at: usize) -> bool {
        bit(&self.tails, at)
    }

    fn set_tail(&mut self, at: usize, tail: bool) {
        set_bit(&mut self.tails, at, tail);
    }

    /// Whether a key inserted after node `parent` may be a head: the index must be searched
    /// (see the module docs).
    #[inline]
    fn may_have_head_child(&self, parent: usize) -> bool {
        self.heads_only || self.tombstones > 0 || bit(&self.branched, parent)
    }

    /// Whether a store must look its blocks up in the index even after a parent's node: the
    /// map cannot tell a new block from a head stored before (tails off, or a tombstone).
    #[inline]
    pub(crate) fn looks_up_tails(&self) -> bool {
        self.heads_only || self.tombstones > 0
    }

    /// Head `child` was inserted (or promoted) with `parent` the node of its parent.
    fn adopt(&mut self, parent: u32, child: u32) {
        self.parent_of.insert(child, parent);
        *self.children.entry(parent).or_insert(0) += 1;
        set_bit(&mut self.branched, parent as usize, true);
    }

    /// Head `child` is gone: one head child fewer for its parent, freed if a tombstone.
    fn child_gone(&mut self, child: u32) {
        let Some(parent) = self.parent_of.remove(&child) else {
            return;
        };
        let count = self
            .children
            .get_mut(&parent)
            .expect("a parent counts its head children");
        *count -= 1;
        if *count == 0 {
            self.children.remove(&parent);
            set_bit(&mut self.branched, parent as usize, false);
            if self.nodes[parent as usize].key == TOMB {
                self.tombstones -= 1;
                self.push_free(parent);
            }
        }
    }

    /// From now on every node is a head, the tails becoming heads now: for callers that look
    /// blocks up by key alone.
    pub(crate) fn heads_only(&mut self) {
        if self.heads_only {
            return;
        }
        self.heads_only = true;
        for at in 0..self.nodes.len() {
            if self.is_tail(at) {
                self.promote(at);
            }
            if self.nodes[at].key == TOMB {
                self.push_free(at as u32);
            }
        }
        self.tails = Vec::new();
        self.branched = Vec::new();
        self.parent_of = MixMap::default();
        self.children = MixMap::default();
        self.tombstones = 0;
    }

    /// Whether [`Self::heads_only`] was called.
    pub(crate) fn is_heads_only(&self) -> bool {
        self.heads_only
    }

    /// Makes tail `at` a head.
    fn promote(&mut self, at: usize) {
        self.set_tail(at, false);
        self.index.reserve(MIN_ENTRIES);
        let key = self.nodes[at].key;
        // Not in the index (a tail): the probe ends at the empty entry it takes.
        let (entry, _) = self.index.probe(tag(key), |_| false);
        self.index.set(entry, tag(key), at as u32);
    }

    /// The node of `key` if it is a head (every node is, after [`Self::heads_only`]).
    #[inline]
    pub(crate) fn find(&self, key: u64) -> Option<usize> {
        let key = stored(key);
        let nodes = &self.nodes;
        let (_, at) = self
            .index
            .find(tag(key), |at| nodes[at as usize].key == key)?;
        Some(at as usize)
    }

    /// The node after `at`, if it holds `key`.
    #[inline]
    pub(crate) fn successor(&self, at: usize, key: u64) -> Option<usize> {
        let next = self.nodes.get(at + 1)?;
        (next.key == stored(key)).then_some(at + 1)
    }

    /// The node of `key`, looked for after `at` first (see [`successor`](Self::successor)).
    #[inline]
    pub(crate) fn find_after(&self, at: usize, key: u64) -> Option<usize> {
        self.successor(at, key).or_else(|| self.find(key))
    }

    /// Loads the index entry `key` probes first (see [`TagIndex::touch`]).
    #[inline]
    pub(crate) fn touch(&self, key: u64) {
        self.index.touch(tag(stored(key)));
    }

    /// Loads node `at`.
    #[inline]
    pub(crate) fn touch_node(&self, at: usize) {
        if let Some(node) = self.nodes.get(at) {
            super::tags::prefetch(node);
        }
    }

    /// The key of node `at`, as stored.
    #[inline]
    pub(crate) fn key(&self, at: usize) -> u64 {
        self.nodes[at].key
    }

    /// The value of `key`, if present.
    #[cfg(test)]
    pub(crate) fn get(&self, key: u64) -> Option<u64> {
        self.find(key).map(|at| self.nodes[at].value)
    }

    #[cfg(test)]
    pub(crate) fn contains(&self, key: u64) -> bool {
        self.find(key).is_some()
    }

    /// The value of node `at` (a node stays where it is until removed).
    #[inline]
    pub(crate) fn value(&self, at: usize) -> u64 {
        self.nodes[at].value
    }

    #[inline]
    pub(crate) fn value_mut(&mut self, at: usize) -> &mut u64 {
        &mut self.nodes[at].value
    }

    /// The node of `key`, inserted with value 0 if absent, and whether it was inserted.
    /// `after` is the node of `key`'s parent block (`None`: `key` has no parent, or the
    /// caller looks blocks up by key alone and called [`Self::heads_only`]).
    pub(crate) fn insert(&mut self, key: u64, after: Option<usize>) -> (usize, bool) {
        let key = stored(key);
        if let Some(next) = after.map(|p| p + 1) {
            if self.nodes.get(next).is_some_and(|n| n.key == key) {
                return (next, false);
            }
        }
        // The empty index entry a new head takes: found by the lookup, where there is one.
        let entry = if after.is_some_and(|p| !self.may_have_head_child(p)) {
            None
        } else {
            self.index.reserve(MIN_ENTRIES);
            let nodes = &self.nodes;
            match self
                .index
                .probe(tag(key), |at| nodes[at as usize].key == key)
            {
                (_, Some(at)) => return (at as usize, false),
                (entry, None) => Some(entry),
            }
        };
        let node = Node { key, value: 0 };
        self.live += 1;
        if let Some(next) = after.map(|p| p + 1).filter(|_| !self.heads_only) {
            if next == self.nodes.len() {
                self.nodes.push(node);
                self.set_tail(next, true);
                return (next, true);
            }
            if self.nodes[next].key == FREE {
                self.unlink(next as u32);
                self.nodes[next] = node;
                self.set_tail(next, true);
                return (next, true);
            }
        }
        let at = match self.pop_free() {
            Some(at) => {
                self.nodes[at as usize] = node;
                at
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        let entry = entry.unwrap_or_else(|| {
            // Known absent: the probe ends at the empty entry it takes.
            self.index.reserve(MIN_ENTRIES);
            self.index.probe(tag(key), |_| false).0
        });
        self.index.set(entry, tag(key), at);
        if let (Some(parent), false) = (after, self.heads_only) {
            self.adopt(parent as u32, at);
        }
        (at as usize, true)
    }

    /// A free node, the last freed first.
    fn pop_free(&mut self) -> Option<u32> {
        let at = self.free?;
        self.unlink(at);
        Some(at)
    }

    /// Takes free node `at` off the free list.
    fn unlink(&mut self, at: u32) {
        let (prev, next) = links(self.nodes[at as usize].value);
        match prev {
            Some(prev) => {
                let (before, _) = links(self.nodes[prev as usize].value);
                self.nodes[prev as usize].value = link_value(before, next);
            }
            None => self.free = next,
        }
        if let Some(next) = next {
            let (_, after) = links(self.nodes[next as usize].value);
            self.nodes[next as usize].value = link_value(prev, after);
        }
    }

    /// Frees node `at`, first on the free list.
    fn push_free(&mut self, at: u32) {
        if let Some(head) = self.free {
            let (_, after) = links(self.nodes[head as usize].value);
            self.nodes[head as usize].value = link_value(Some(at), after);
        }
        self.nodes[at as usize] = Node {
            key: FREE,
            value: link_value(None, self.free),
        };
        self.free = Some(at);
    }

    /// Removes node `at` (a live one): its index entry if a head; a tail after it becomes a
    /// head (a head child of `at`). A node with head children stays as a tombstone until
    /// they are gone.
    #[inline]
    pub(crate) fn remove(&mut self, at: usize) {
        let key = self.nodes[at].key;
        debug_assert!(key != FREE && key != TOMB, "removing a node not live");
        if self.is_tail(at) {
            self.set_tail(at, false);
        } else {
            let (entry, found) = self.index.probe(tag(key), |a| a as usize == at);
            debug_assert!(found.is_some(), "a head is in the index");
            if found.is_some() {
                self.index.remove(entry);
            }
            if !self.heads_only {
                self.child_gone(at as u32);
            }
        }
        self.live -= 1;
        if self.is_tail(at + 1) {
            self.promote(at + 1);
            if !self.heads_only {
                self.adopt(at as u32, at as u32 + 1);
            }
        }
        if bit(&self.branched, at) {
            self.nodes[at] = Node {
                key: TOMB,
                value: 0,
            };
            self.tombstones += 1;
        } else {
            self.push_free(at as u32);
        }
    }

    /// Every key, as stored (a key of 0 as [`ZERO_STANDIN`]).
    pub(crate) fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.nodes.iter().filter(|n| live(n.key)).map(|n| n.key)
    }

    /// Every value (for tests).
    #[cfg(test)]
    pub(crate) fn values(&self) -> impl Iterator<Item = u64> + '_ {
        self.nodes.iter().filter(|n| live(n.key)).map(|n| n.value)
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        self.index.memory_bytes()
            + self.nodes.capacity() * std::mem::size_of::<Node>()
            + (self.tails.capacity() + self.branched.capacity()) * std::mem::size_of::<u64>()
            + map_bytes::<u32, u32>(self.parent_of.capacity())
            + map_bytes::<u32, u32>(self.children.capacity())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn behaves_as_a_map_under_inserts_and_removals() {
        let mut flat = FlatMap::default();
        flat.heads_only();
        let mut model: HashMap<u64, u64> = HashMap::new();
        let mut x = 0x1234_5678_9ABC_DEF1u64;
        for step in 0..20_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Few distinct keys, many colliding homes and tags (and key 0 among them).
            let key = (x % 3) << 32 | (x % 1500) << 20;
            if x.is_multiple_of(3) {
                if let Some(at) = flat.find(key) {
                    flat.remove(at);
                }
                model.remove(&key);
            } else {
                let (at, inserted) = flat.insert(key, None);
                assert_eq!(inserted, !model.contains_key(&key));
                *flat.value_mut(at) += step;
                *model.entry(key).or_insert(0) += step;
            }
            assert_eq!(flat.len(), model.len());
        }
        for (key, value) in &model {
            assert_eq!(flat.get(*key), Some(*value));
            let at = flat.find(*key).unwrap();
            assert_eq!(flat.value(at), *value);
        }
        assert_eq!(flat.values().count(), model.len());
        assert!(flat.get(0xFFFF_FFFF).is_none());
        assert!(flat.contains(*model.keys().next().unwrap()));
    }

    /// Keys in a forest (key `k`'s parent is `parent[k]`), inserted with their parent's node,
    /// removed in any order: every key present is found where a query or a store looks for
    /// it (the successor of its parent's node, else the index), and no key is ever in two
    /// nodes; the index holds the heads only.
    #[test]
    fn tails_are_found_after_their_parents_and_become_heads_when_orphaned() {
        const KEYS: usize = 400;
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        // Chains of 1-12 keys hanging from earlier keys or from nothing.
        let mut parent: Vec<Option<usize>> = Vec::with_capacity(KEYS);
        while parent.len() < KEYS {
            let len = (next() % 12 + 1) as usize;
            let from = match next() % 3 {
                0 => None,
                _ if parent.is_empty() => None,
                _ => Some((next() % parent.len() as u64) as usize),
            };
            for i in 0..len.min(KEYS - parent.len()) {
                parent.push(if i == 0 { from } else { Some(parent.len() - 1) });
            }
        }
        let key = |k: usize| 0x9E37_79B9_7F4A_7C15u64.wrapping_mul(k as u64 + 1);
        let mut flat = FlatMap::default();
        let mut node: Vec<Option<usize>> = vec![None; KEYS];
        let lookup = |flat: &FlatMap, node: &[Option<usize>], k: usize| match parent[k]
            .and_then(|p| node[p])
        {
            Some(p) => flat.find_after(p, key(k)),
            None => flat.find(key(k)),
        };
        for step in 0..30_000 {
            let k = (next() % KEYS as u64) as usize;
            if next() % 5 < 2 {
                if let Some(at) = node[k].take() {
                    flat.remove(at);
                }
            } else if parent[k].is_none_or(|p| node[p].is_some()) {
                let after = parent[k].and_then(|p| node[p]);
                let (at, created) = flat.insert(key(k), after);
                assert_eq!(created, node[k].is_none(), "step {step}, key {k}");
                if let Some(was) = node[k] {
                    assert_eq!(at, was, "step {step}: key {k} found in another node");
                }
                node[k] = Some(at);
            }
            if step % 97 == 0 {
                for k in 0..KEYS {
                    assert_eq!(lookup(&flat, &node, k), node[k], "step {step}, key {k}");
                }
                assert_eq!(flat.len(), node.iter().flatten().count());
                assert!(flat.index.len() <= flat.len());
            }
        }
        // The chains stored in order from their roots are mostly tails.
        assert!(
            flat.index.len() < flat.len(),
            "{} heads of {}",
            flat.index.len(),
            flat.len()
        );
        flat.heads_only();
        assert_eq!(flat.index.len(), flat.len());
        for (k, at) in node.iter().enumerate() {
            assert_eq!(flat.find(key(k)), *at);
        }
    }

    #[test]
    fn a_parent_removed_before_its_head_children_stays_a_tombstone_until_they_go() {
        let key = |k: u64| 0x9E37_79B9_7F4A_7C15u64.wrapping_mul(k);
        let (a, b, c, x) = (key(1), key(2), key(3), key(4));
        let mut flat = FlatMap::default();
        let at_a = flat.insert(a, None).0;
        assert_eq!(flat.insert(b, Some(at_a)), (at_a + 1, true));
        flat.insert(c, None);
        // x after a, whose successor is taken: a head child of a.
        let (at_x, _) = flat.insert(x, Some(at_a));
        assert_eq!(flat.index.len(), 3);
        assert!(flat.may_have_head_child(at_a));
        assert!(!flat.may_have_head_child(at_x));
        // a goes first: b becomes a head, and a a tombstone (its head children live on).
        flat.remove(at_a);
        assert_eq!((flat.tombstones, flat.len()), (1, 3));
        assert!(flat.looks_up_tails());
        assert_eq!(flat.find(a), None);
        // a stored again: x, stored after its new node, is found, not made twice.
        let again = flat.insert(a, None).0;
        assert_ne!(again, at_a);
        assert_eq!(flat.insert(x, Some(again)), (at_x, false));
        assert_eq!(flat.insert(b, Some(again)), (at_a + 1, false));
        // Its head children gone, the tombstone is freed and reused.
        flat.remove(at_x);
        assert_eq!(flat.tombstones, 1);
        flat.remove(at_a + 1);
        assert_eq!(flat.tombstones, 0);
        assert!(!flat.looks_up_tails());
        let mut reused: Vec<usize> = (5..8).map(|k| flat.insert(key(k), None).0).collect();
        reused.sort_unstable();
        assert_eq!(reused, vec![at_a, at_a + 1, at_x]);
        assert_eq!(flat.len(), 5);
    }

    #[test]
    fn a_chain_inserted_together_lies_side_by_side() {
        let mut flat = FlatMap::default();
        let keys: Vec<u64> = (1..=10)
            .map(|k| 0x9E37_79B9_7F4A_7C15u64.wrapping_mul(k))
            .collect();
        let first = flat.insert(keys[0], None).0;
        let mut at = first;
        for &key in &keys[1..] {
            assert_eq!(flat.insert(key, Some(at)).0, at + 1);
            assert_eq!(flat.successor(at, key), Some(at + 1));
            at = flat.find_after(at, key).unwrap();
        }
        // One index entry for the chain: the rest are tails.
        assert_eq!(flat.index.len(), 1);
        assert_eq!(flat.successor(first, keys[5]), None);
        assert_eq!(flat.find(keys[5]), None);
        // Freed nodes are reused: a chain removed from its end and stored again from the
        // same parent lies side by side again, as tails.
        for (i, &key) in keys.iter().enumerate().skip(4).rev() {
            let at = first + i;
            assert_eq!(flat.successor(at - 1, key), Some(at));
            flat.remove(at);
            assert_eq!(flat.successor(at - 1, key), None);
        }
        let at = flat.insert(keys[4] ^ 1, Some(first + 3)).0;
        assert_eq!(at, first + 4);
        assert_eq!(flat.insert(keys[5] ^ 1, Some(at)).0, at + 1);
        assert_eq!(flat.index.len(), 1);
        // Removing a node in the middle makes the tail after it a head.
        flat.remove(first + 2);
        assert_eq!(flat.find(keys[3]), Some(first + 3));
        assert_eq!(flat.index.len(), 2);
    }
}
