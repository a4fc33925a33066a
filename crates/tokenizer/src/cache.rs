//! A bounded cache from a prompt's prefix to its token ids, so that a conversation that
//! grows by a turn tokenises only the new turn.
//!
//! A prompt is cut only at its tokenizer's safe cut points (see the `prefix` module); the
//! longest cut whose text was seen gives the ids up to it, and the rest is tokenised piece by
//! piece between cuts. The prompt's last cut is then cached for the next turn. Keys are the
//! 128-bit xxh3 of the prefix text (seeded by whether special tokens were added), values the
//! prefix's ids and, when the cache was given a block-hash chain, the hashes of its full
//! blocks, so that a hit recomputes neither.
//!
//! The bound counts each entry's ids, hashes and a fixed overhead; the least recently used
//! entries go first. The lock is held only to look up and insert, never while tokenising.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use xxhash_rust::xxh3::Xxh3;

/// Prompts shorter than this (bytes) are tokenised whole: the cache would save little.
pub const MIN_CACHED_BYTES: usize = 512;

/// What an entry costs beyond its ids and hashes: its key, map slot, order node, `Arc`.
const ENTRY_OVERHEAD: usize = 160;

/// How block hashes chain: each full block of `block_size` ids hashes with its parent's hash.
#[derive(Debug, Clone, Copy)]
pub struct BlockChain {
    pub block_size: usize,
    pub hash: fn(Option<u64>, &[u32]) -> u64,
}

impl BlockChain {
    /// Extends `hashes` (those of `ids`' first full blocks) to every full block of `ids`.
    pub fn extend(&self, hashes: &mut Vec<u64>, ids: &[u32]) {
        if self.block_size == 0 {
            return;
        }
        let done = hashes.len() * self.block_size;
        for block in ids[done.min(ids.len())..].chunks_exact(self.block_size) {
            let parent = hashes.last().copied();
            hashes.push((self.hash)(parent, block));
        }
    }
}

/// What a lookup found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// A cached prefix was reused.
    Hit,
    /// The prompt could be cut but no prefix of it was cached.
    Miss,
    /// Tokenised whole: too short, no cut point, or a tokenizer the cache cannot cut.
    Bypassed,
}

/// A prompt's ids, with the hashes of its full blocks when the cache has a chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    pub ids: Vec<u32>,
    pub hashes: Vec<u64>,
    pub lookup: Lookup,
    /// How many of `ids` came from the cache.
    pub reused: usize,
}

#[derive(Debug)]
struct Entry {
    ids: Vec<u32>,
    hashes: Vec<u64>,
}

impl Entry {
    fn bytes(&self) -> usize {
        self.ids.len() * 4 + self.hashes.len() * 8 + ENTRY_OVERHEAD
    }
}

#[derive(Debug, Default)]
struct Lru {
    entries: HashMap<u128, (Arc<Entry>, u64)>,
    order: BTreeMap<u64, u128>,
    bytes: usize,
    tick: u64,
}

impl Lru {
    fn touch(&mut self, key: u128) -> Option<Arc<Entry>> {
        self.tick += 1;
        let tick = self.tick;
        let (entry, used) = self.entries.get_mut(&key)?;
        self.order.remove(used);
        *used = tick;
        self.order.insert(tick, key);
        Some(entry.clone())
    }

    fn insert(&mut self, key: u128, entry: Entry, bound: usize) {
        let size = entry.bytes();
        if size > bound || self.touch(key).is_some() {
            return;
        }
        while self.bytes + size > bound {
            let Some((_, oldest)) = self.order.pop_first() else {
                break;
            };
            if let Some((gone, _)) = self.entries.remove(&oldest) {
                self.bytes -= gone.bytes();
            }
        }
        self.tick += 1;
        self.order.insert(self.tick, key);
        self.entries.insert(key, (Arc::new(entry), self.tick));
        self.bytes += size;
    }
}

/// The bounded prefix cache; share it behind an `Arc` with the tokenizer it was filled by.
pub struct PrefixCache {
    bound: usize,
    chain: Option<BlockChain>,
    lru: Mutex<Lru>,
}

impl fmt::Debug for PrefixCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PrefixCache")
            .field("bound", &self.bound)
            .field("bytes", &self.bytes())
            .field("entries", &self.len())
            .finish_non_exhaustive()
    }
}

impl PrefixCache {
    /// A cache of at most `bound` bytes, keeping block hashes along `chain` if given.
    pub fn new(bound: usize, chain: Option<BlockChain>) -> Self {
        Self {
            bound,
            chain,
            lru: Mutex::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Lru> {
        // A panic elsewhere cannot leave the map half-updated in a way that matters here.
        self.lru.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The bytes the entries are counted as (never above the bound).
    pub fn bytes(&self) -> usize {
        self.lock().bytes
    }

    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn chain(&self) -> Option<&BlockChain> {
        self.chain.as_ref()
    }

    /// Tokenises `text` through the cache: `cuts` are its safe cut points (ascending), `start`
    /// the ids before any text (the special prefix), `encode` tokenises a piece alone.
    pub(crate) fn encode<E>(
        &self,
        text: &str,
        seed: u64,
        cuts: &[usize],
        start: &[u32],
        encode: impl Fn(&str) -> Result<Vec<u32>, E>,
    ) -> Result<Encoded, E> {
        let Some(&last) = cuts.last() else {
            let mut ids = start.to_vec();
            ids.extend(encode(text)?);
            return Ok(self.finish(ids, Vec::new(), Lookup::Bypassed, 0));
        };
        let mut hasher = Xxh3::with_seed(seed);
        let mut at = 0;
        let keys: Vec<u128> = cuts
            .iter()
            .map(|&c| {
                hasher.update(&text.as_bytes()[at..c]);
                at = c;
                hasher.digest128()
            })
            .collect();
        let found = {
            let mut lru = self.lock();
            keys.iter()
                .enumerate()
                .rev()
                .find_map(|(i, k)| lru.touch(*k).map(|e| (i, e)))
        };
        let (mut ids, mut hashes, from, lookup) = match &found {
            Some((i, e)) => (e.ids.clone(), e.hashes.clone(), cuts[*i], Lookup::Hit),
            None => (start.to_vec(), Vec::new(), 0, Lookup::Miss),
        };
        let reused = if found.is_some() { ids.len() } else { 0 };
        if from < last {
            ids.extend(encode(&text[from..last])?);
            if let Some(chain) = &self.chain {
                chain.extend(&mut hashes, &ids);
            }
            let entry = Entry {
                ids: ids.clone(),
                hashes: hashes.clone(),
            };
            self.lock().insert(keys[keys.len() - 1], entry, self.bound);
        }
        ids.extend(encode(&text[last..])?);
        Ok(self.finish(ids, hashes, lookup, reused))
    }

    /// A prompt tokenised whole, outside the cache.
    pub(crate) fn bypass(&self, ids: Vec<u32>) -> Encoded {
        self.finish(ids, Vec::new(), Lookup::Bypassed, 0)
    }

    fn finish(
        &self,
        ids: Vec<u32>,
        mut hashes: Vec<u64>,
        lookup: Lookup,
        reused: usize,
    ) -> Encoded {
        if let Some(chain) = &self.chain {
            chain.extend(&mut hashes, &ids);
        }
        Encoded {
            ids,
            hashes,
            lookup,
            reused,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes_as_ids(s: &str) -> Result<Vec<u32>, ()> {
        Ok(s.bytes().map(u32::from).collect())
    }

    #[test]
    fn a_longer_prompt_reuses_the_longest_cached_cut() {
        let cache = PrefixCache::new(1 << 20, None);
        let first = cache
            .encode("ab\ncd\nef", 0, &[3, 6], &[], bytes_as_ids)
            .unwrap();
        assert_eq!(first.lookup, Lookup::Miss);
        assert_eq!(first.ids, bytes_as_ids("ab\ncd\nef").unwrap());
        // "ab\ncd\n" is cached; a prompt going on from it reuses it.
        let second = cache
            .encode("ab\ncd\nxy\nz", 0, &[3, 6, 9], &[], bytes_as_ids)
            .unwrap();
        assert_eq!((second.lookup, second.reused), (Lookup::Hit, 6));
        assert_eq!(second.ids, bytes_as_ids("ab\ncd\nxy\nz").unwrap());
        // Another seed is another namespace.
        let other = cache
            .encode("ab\ncd\nef", 1, &[3, 6], &[7], bytes_as_ids)
            .unwrap();
        assert_eq!(other.lookup, Lookup::Miss);
        assert_eq!(other.ids[0], 7);
    }

    #[test]
    fn hashes_chain_over_the_whole_prompt_hit_or_miss() {
        let chain = BlockChain {
            block_size: 2,
            hash: |parent, block| parent.unwrap_or(1) * 31 + u64::from(block[0] + block[1]),
        };
        let cache = PrefixCache::new(1 << 20, Some(chain));
        let text = "abc\ndef\nghij";
        let fresh = {
            let mut h = Vec::new();
            chain.extend(&mut h, &bytes_as_ids(text).unwrap());
            h
        };
        for _ in 0..2 {
            let got = cache.encode(text, 0, &[4, 8], &[], bytes_as_ids).unwrap();
            assert_eq!(got.hashes, fresh);
        }
    }

    #[test]
    fn the_bound_holds_and_the_least_recently_used_go_first() {
        let entry = |n| Entry {
            ids: vec![0; n],
            hashes: Vec::new(),
        };
        let bound = 3 * (400 + ENTRY_OVERHEAD);
        let mut lru = Lru::default();
        for key in 0..3 {
            lru.insert(key, entry(100), bound);
        }
        lru.touch(0);
        lru.insert(3, entry(100), bound);
        assert!(lru.bytes <= bound);
        assert!(lru.entries.contains_key(&0) && !lru.entries.contains_key(&1));
        // An entry larger than the bound is not kept, and evicts nothing.
        lru.insert(9, entry(10_000), bound);
        assert!(!lru.entries.contains_key(&9) && lru.entries.len() == 3);
    }
}
