//! A map from block-table keys (router block hashes, already uniform) to a 64-bit value, in
//! two arrays:
//! - `nodes`, an arena of (key, value) pairs, 16 bytes each, allocated in insertion order (a
//!   freed node is reused last freed, first reused), so the blocks of one chain stored
//!   together lie side by side, and a query walking that chain reads consecutive memory: it
//!   checks the node after the last one matched ([`FlatMap::successor`]) before it looks the
//!   block up;
//! - `index`, a [`TagIndex`] whose tag is the key's upper half: only a tag match reads the
//!   node.
//!
//! About 32 bytes an entry all in all. Key 0 marks a free node, so a key of 0 is stored as
//! [`ZERO_STANDIN`]: the two keys then share an entry, which is as likely as two blocks
//! sharing a 64-bit hash.

use super::tags::TagIndex;

const FREE: u64 = 0;
const ZERO_STANDIN: u64 = 0x5BD1_E995_C6A4_A793;
const MIN_ENTRIES: usize = 64;

#[derive(Debug, Default, Clone, Copy)]
struct Node {
    key: u64,
    value: u64,
}

#[derive(Debug, Default)]
pub(crate) struct FlatMap {
    index: TagIndex,
    nodes: Vec<Node>,
    /// Free nodes, the last freed last.
    free: Vec<u32>,
}

/// `key` as the map stores it (0 becomes [`ZERO_STANDIN`]).
pub(crate) fn stored(key: u64) -> u64 {
    if key == FREE {
        ZERO_STANDIN
    } else {
        key
    }
}

fn tag(key: u64) -> u32 {
    (key >> 32) as u32
}

impl FlatMap {
    pub(crate) fn len(&self) -> usize {
        self.index.len()
    }

    /// The node of `key`, if present.
    pub(crate) fn find(&self, key: u64) -> Option<usize> {
        self.locate(key).map(|(_, at)| at)
    }

    /// The index entry and the node of `key`, if present.
    pub(crate) fn locate(&self, key: u64) -> Option<(usize, usize)> {
        let key = stored(key);
        let nodes = &self.nodes;
        let (entry, at) = self
            .index
            .find(tag(key), |at| nodes[at as usize].key == key)?;
        Some((entry, at as usize))
    }

    /// The node after `at`, if it holds `key`.
    pub(crate) fn successor(&self, at: usize, key: u64) -> Option<usize> {
        let next = self.nodes.get(at + 1)?;
        (next.key == stored(key)).then_some(at + 1)
    }

    /// The node of `key`, looked for after `at` first (see [`successor`](Self::successor)).
    pub(crate) fn find_after(&self, at: usize, key: u64) -> Option<usize> {
        self.successor(at, key).or_else(|| self.find(key))
    }

    /// Loads the index entry `key` probes first (see [`TagIndex::touch`]).
    pub(crate) fn touch(&self, key: u64) {
        self.index.touch(tag(stored(key)));
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
    pub(crate) fn value(&self, at: usize) -> u64 {
        self.nodes[at].value
    }

    pub(crate) fn value_mut(&mut self, at: usize) -> &mut u64 {
        &mut self.nodes[at].value
    }

    /// The node of `key`, inserted with value 0 if absent, and whether it was inserted.
    pub(crate) fn insert(&mut self, key: u64) -> (usize, bool) {
        self.index.reserve(MIN_ENTRIES);
        let (key, nodes) = (stored(key), &self.nodes);
        let (entry, found) = self
            .index
            .probe(tag(key), |at| nodes[at as usize].key == key);
        if let Some(at) = found {
            return (at as usize, false);
        }
        let node = Node { key, value: 0 };
        let at = match self.free.pop() {
            Some(at) => {
                self.nodes[at as usize] = node;
                at
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.index.set(entry, tag(key), at);
        (at as usize, true)
    }

    /// Removes node `at` and its index entry.
    #[cfg(test)]
    pub(crate) fn remove_at(&mut self, at: usize) {
        let key = self.nodes[at].key;
        let (entry, _) = self.index.probe(tag(key), |a| a as usize == at);
        self.remove_entry(entry);
    }

    /// Removes the node of index entry `entry` (as [`locate`](Self::locate) found it, the
    /// map unchanged since) and the entry.
    pub(crate) fn remove_entry(&mut self, entry: usize) {
        let at = self.index.remove(entry);
        self.nodes[at as usize] = Node::default();
        self.free.push(at);
    }

    /// Every key, as stored (a key of 0 as [`ZERO_STANDIN`]).
    pub(crate) fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.nodes.iter().filter(|n| n.key != FREE).map(|n| n.key)
    }

    /// Every value (for tests).
    #[cfg(test)]
    pub(crate) fn values(&self) -> impl Iterator<Item = u64> + '_ {
        self.nodes.iter().filter(|n| n.key != FREE).map(|n| n.value)
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        self.index.memory_bytes()
            + self.nodes.capacity() * std::mem::size_of::<Node>()
            + self.free.capacity() * std::mem::size_of::<u32>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn behaves_as_a_map_under_inserts_and_removals() {
        let mut flat = FlatMap::default();
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
                    flat.remove_at(at);
                }
                model.remove(&key);
            } else {
                let (at, inserted) = flat.insert(key);
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

    #[test]
    fn a_chain_inserted_together_lies_side_by_side() {
        let mut flat = FlatMap::default();
        let keys: Vec<u64> = (1..=10)
            .map(|k| 0x9E37_79B9_7F4A_7C15u64.wrapping_mul(k))
            .collect();
        let first = flat.insert(keys[0]).0;
        let mut at = first;
        for &key in &keys[1..] {
            assert_eq!(flat.insert(key).0, at + 1);
            assert_eq!(flat.successor(at, key), Some(at + 1));
            at = flat.find_after(at, key).unwrap();
        }
        assert_eq!(flat.successor(first, keys[5]), None);
        assert_eq!(flat.find_after(first, keys[5]), flat.find(keys[5]));
        // Freed nodes are reused last freed first: a chain removed from its end and stored
        // again lies side by side again.
        for &key in keys[4..].iter().rev() {
            let at = flat.find(key).unwrap();
            flat.remove_at(at);
            assert_eq!(flat.successor(at - 1, key), None);
        }
        let at = flat.insert(keys[4] ^ 1).0;
        assert_eq!(flat.insert(keys[5] ^ 1).0, at + 1);
    }
}
