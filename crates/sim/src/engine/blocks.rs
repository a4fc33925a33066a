//! The paged KV cache: a fixed number of blocks, a prefix cache over full blocks, and LRU
//! eviction, as vLLM's block pool keeps them.
//!
//! Every block is either in use (reference count > 0, held by running sequences) or free.
//! Free blocks wait in an LRU queue; a free block that still holds a cached full block (its
//! hash registered) can be reused by a prefix-cache hit, which takes it out of the queue, or
//! evicted when the queue's head is allocated, which unregisters its hash and records a
//! `Removed` event. Blocks freed together are queued tail-first (a finished sequence's last
//! block is evicted before its first), as vLLM does.

use std::collections::HashMap;

use super::CacheEvent;

pub type BlockId = u32;

const NIL: u32 = u32::MAX;

/// An intrusive doubly-linked LRU queue over block ids: O(1) push, pop and remove.
#[derive(Debug, Clone)]
struct FreeQueue {
    prev: Vec<u32>,
    next: Vec<u32>,
    queued: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl FreeQueue {
    fn with_all(n: usize) -> Self {
        let mut q = Self {
            prev: vec![NIL; n],
            next: vec![NIL; n],
            queued: vec![false; n],
            head: NIL,
            tail: NIL,
            len: 0,
        };
        for b in 0..n as u32 {
            q.push_back(b);
        }
        q
    }

    fn push_back(&mut self, b: u32) {
        debug_assert!(!self.queued[b as usize]);
        self.prev[b as usize] = self.tail;
        self.next[b as usize] = NIL;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.next[self.tail as usize] = b;
        }
        self.tail = b;
        self.queued[b as usize] = true;
        self.len += 1;
    }

    fn remove(&mut self, b: u32) {
        debug_assert!(self.queued[b as usize]);
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.queued[b as usize] = false;
        self.len -= 1;
    }

    fn pop_front(&mut self) -> Option<u32> {
        let b = self.head;
        if b == NIL {
            return None;
        }
        self.remove(b);
        Some(b)
    }
}

/// The KV blocks of one engine.
#[derive(Debug, Clone)]
pub struct BlockPool {
    ref_count: Vec<u32>,
    /// The cached full block a block holds, if any.
    hash_of: Vec<Option<u64>>,
    cached: HashMap<u64, BlockId>,
    free: FreeQueue,
    events: Vec<CacheEvent>,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        Self {
            ref_count: vec![0; num_blocks],
            hash_of: vec![None; num_blocks],
            cached: HashMap::new(),
            free: FreeQueue::with_all(num_blocks),
            events: Vec::new(),
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_count.len()
    }

    /// Free blocks, cached or not.
    pub fn num_free(&self) -> usize {
        self.free.len
    }

    /// Blocks held by sequences.
    pub fn num_used(&self) -> usize {
        self.num_blocks() - self.free.len
    }

    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    /// The cached block holding `hash`, if any.
    pub fn lookup(&self, hash: u64) -> Option<BlockId> {
        self.cached.get(&hash).copied()
    }

    /// Whether `b` is free (so taking it reduces the free count).
    pub fn is_free(&self, b: BlockId) -> bool {
        self.ref_count[b as usize] == 0
    }

    /// Takes a reference on a cached block (a prefix-cache hit).
    pub fn touch(&mut self, b: BlockId) {
        if self.ref_count[b as usize] == 0 {
            self.free.remove(b);
        }
        self.ref_count[b as usize] += 1;
    }

    /// Allocates a fresh block, evicting the least recently used free one.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let b = self.free.pop_front()?;
        if let Some(hash) = self.hash_of[b as usize].take() {
            self.cached.remove(&hash);
            self.events.push(CacheEvent::Removed { hash });
        }
        self.ref_count[b as usize] = 1;
        Some(b)
    }

    /// Drops one reference on each of `blocks`; those no longer used join the free queue,
    /// last block first.
    pub fn release(&mut self, blocks: &[BlockId]) {
        for &b in blocks.iter().rev() {
            let rc = &mut self.ref_count[b as usize];
            debug_assert!(*rc > 0);
            *rc -= 1;
            if *rc == 0 {
                self.free.push_back(b);
            }
        }
    }

    /// Registers `b` as holding the full block `hash`. Returns false (and registers
    /// nothing) when another block already holds it.
    pub fn register(&mut self, b: BlockId, hash: u64) -> bool {
        if self.cached.contains_key(&hash) || self.hash_of[b as usize].is_some() {
            return false;
        }
        self.cached.insert(hash, b);
        self.hash_of[b as usize] = Some(hash);
        true
    }

    pub fn push_event(&mut self, event: CacheEvent) {
        self.events.push(event);
    }

    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        std::mem::take(&mut self.events)
    }

    /// Forgets every cached block. Only possible when no block is in use (as vLLM's
    /// `reset_prefix_cache`); returns whether it happened.
    pub fn clear_cache(&mut self) -> bool {
        if self.num_used() > 0 {
            return false;
        }
        self.cached.clear();
        self.hash_of.iter_mut().for_each(|h| *h = None);
        self.events.push(CacheEvent::Cleared);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_evicts_the_oldest_free_block_and_reports_it() {
        let mut p = BlockPool::new(3);
        let a = p.allocate().unwrap();
        let b = p.allocate().unwrap();
        assert!(p.register(a, 10));
        assert!(p.register(b, 20));
        assert!(!p.register(b, 30), "a block holds one hash");
        p.release(&[a, b]); // queued b then a: b is evicted before a
        let c = p.allocate().unwrap(); // the never-used third block first
        assert_ne!(c, a);
        assert_ne!(c, b);
        assert!(p.take_events().is_empty());
        let d = p.allocate().unwrap();
        assert_eq!(d, b);
        assert_eq!(p.take_events(), vec![CacheEvent::Removed { hash: 20 }]);
        assert_eq!(p.lookup(10), Some(a));
        assert_eq!(p.lookup(20), None);
        // A hit takes the cached block out of the free queue.
        p.touch(a);
        assert_eq!(p.num_free(), 0);
        assert!(p.allocate().is_none());
        assert!(!p.clear_cache(), "blocks in use");
        p.release(&[a, c, d]);
        assert!(p.clear_cache());
        assert_eq!(p.take_events(), vec![CacheEvent::Cleared]);
        assert_eq!(p.num_cached(), 0);
    }
}
