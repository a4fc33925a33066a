//! The open-addressing index both of the index's maps use ([`FlatMap`](super::flat::FlatMap),
//! and each slot of [`Records`](super::records::Records)): 8-byte entries, each a 32-bit tag
//! of its key (uniform; its low bits are the entry's home) and the position of the key's node
//! in its owner's arena. Linear probing, backward-shift deletion, no tombstones. The owner
//! reads a node only on a tag match, and growth and removal move entries without reading any.

/// `Entry::at` of an empty entry.
const NONE: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Entry {
    tag: u32,
    at: u32,
}

const EMPTY: Entry = Entry { tag: 0, at: NONE };

#[derive(Debug, Default)]
pub(crate) struct TagIndex {
    entries: Vec<Entry>,
    len: usize,
}

impl TagIndex {
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    #[inline]
    fn mask(&self) -> usize {
        self.entries.len() - 1
    }

    #[inline]
    fn home(&self, tag: u32) -> usize {
        tag as usize & self.mask()
    }

    /// The entry of the key with `tag` and its node's position, `is` telling whether the node
    /// at a position holds the key; else the empty entry where it would go. The index must
    /// have entries ([`Self::reserve`] first).
    #[inline]
    pub(crate) fn probe(&self, tag: u32, mut is: impl FnMut(u32) -> bool) -> (usize, Option<u32>) {
        let mask = self.mask();
        let mut i = self.home(tag);
        loop {
            let entry = self.entries[i];
            if entry.at == NONE {
                return (i, None);
            }
            if entry.tag == tag && is(entry.at) {
                return (i, Some(entry.at));
            }
            i = (i + 1) & mask;
        }
    }

    /// [`Self::probe`] for a key that may be absent, on an index that may be empty.
    #[inline]
    pub(crate) fn find(&self, tag: u32, is: impl FnMut(u32) -> bool) -> Option<(usize, u32)> {
        if self.len == 0 {
            return None;
        }
        match self.probe(tag, is) {
            (entry, Some(at)) => Some((entry, at)),
            (_, None) => None,
        }
    }

    /// Room for one more entry: doubles at three quarters full, to `min` entries at least.
    /// Returns the heap bytes that added (0 unless it grew).
    #[inline]
    pub(crate) fn reserve(&mut self, min: usize) -> usize {
        if (self.len + 1) * 4 > self.entries.len() * 3 {
            return self.grow(min);
        }
        0
    }

    /// Doubles the entries (to `min` at least), out of line: the callers' paths stay short.
    /// Returns the heap bytes that added.
    #[cold]
    #[inline(never)]
    fn grow(&mut self, min: usize) -> usize {
        let before = self.memory_bytes();
        let size = (self.entries.len() * 2).max(min);
        let old = std::mem::replace(&mut self.entries, vec![EMPTY; size]);
        let mask = size - 1;
        for entry in old.into_iter().filter(|e| e.at != NONE) {
            let mut i = self.home(entry.tag);
            while self.entries[i].at != NONE {
                i = (i + 1) & mask;
            }
            self.entries[i] = entry;
        }
        self.memory_bytes() - before
    }

    /// Fills the empty entry `entry` ([`Self::probe`]'s answer for `tag`) with node `at`.
    #[inline]
    pub(crate) fn set(&mut self, entry: usize, tag: u32, at: u32) {
        self.entries[entry] = Entry { tag, at };
        self.len += 1;
    }

    /// Whether entry `entry` still holds position `at` (as a probe found it, before later
    /// removals may have shifted it back).
    #[inline]
    pub(crate) fn holds(&self, entry: usize, at: u32) -> bool {
        self.entries.get(entry).is_some_and(|e| e.at == at)
    }

    /// Removes entry `entry`, shifting back the entries probing past it; returns its node's
    /// position.
    #[inline]
    pub(crate) fn remove(&mut self, entry: usize) -> u32 {
        let at = self.entries[entry].at;
        let mask = self.mask();
        let mut hole = entry;
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let entry = self.entries[j];
            if entry.at == NONE {
                break;
            }
            // The entry at `j` may fill the hole if the hole lies on its probe path.
            let home = self.home(entry.tag);
            if j.wrapping_sub(home) & mask >= j.wrapping_sub(hole) & mask {
                self.entries[hole] = entry;
                hole = j;
            }
        }
        self.entries[hole] = EMPTY;
        self.len -= 1;
        at
    }

    /// Loads the entry `tag` probes first, so that a later lookup finds it in cache: issued
    /// for a batch of keys at once, the cache misses overlap instead of coming one by one, and
    /// the work between goes on while they load.
    #[inline]
    pub(crate) fn touch(&self, tag: u32) {
        if !self.entries.is_empty() {
            prefetch(&self.entries[self.home(tag)]);
        }
    }

    /// The node positions of every entry.
    #[inline]
    pub(crate) fn positions(&self) -> impl Iterator<Item = u32> + '_ {
        self.entries.iter().filter(|e| e.at != NONE).map(|e| e.at)
    }

    #[inline]
    pub(crate) fn memory_bytes(&self) -> usize {
        self.entries.capacity() * std::mem::size_of::<Entry>()
    }
}

/// Asks for the cache line of `value` without waiting for it. A prefetch instruction, not a
/// load: a load that misses holds its instruction until the line arrives, and the index's
/// passes over a batch of keys stalled there (events applied 8-10% faster with it, build and
/// churn, `examples/query_latency`, 2026-12-04).
#[inline]
pub(crate) fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    // SAFETY: `_mm_prefetch` only hints the cache (it needs SSE, which every x86-64 has); it
    // reads nothing the program sees and cannot fault, whatever the address.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>((value as *const T).cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    std::hint::black_box(value);
}
