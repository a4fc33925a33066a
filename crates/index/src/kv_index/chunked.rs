//! A vector in fixed chunks, for the block table's runs: it grows by a chunk, never by moving
//! what it holds. A `Vec` of runs doubled by copying all of them inside one store, under the
//! index's write: 3.4 ms at 65,536 runs, 6.7 ms at 131,072, and on for a large cluster's
//! millions. Here a chunk grows as a `Vec` up to [`CHUNK`] items (moving 88 KiB at most), and
//! the next starts a new one. An access reads one more pointer (the chunk's), from a small
//! directory.

use std::ops::{Index, IndexMut};

/// Items a chunk holds (the block table's runs: 88 KiB a chunk).
const CHUNK_BITS: u32 = 10;
const CHUNK: usize = 1 << CHUNK_BITS;

#[derive(Debug)]
pub(crate) struct Chunked<T> {
    /// Full chunks of [`CHUNK`] items, then the last one.
    chunks: Vec<Vec<T>>,
    len: usize,
}

impl<T> Default for Chunked<T> {
    fn default() -> Self {
        Self {
            chunks: Vec::new(),
            len: 0,
        }
    }
}

impl<T> Chunked<T> {
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn push(&mut self, item: T) {
        if self.len == self.chunks.len() * CHUNK {
            self.chunks.push(Vec::new());
        }
        self.chunks
            .last_mut()
            .expect("a chunk with room")
            .push(item);
        self.len += 1;
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> + '_ {
        self.chunks.iter().flatten()
    }

    /// Heap bytes: the chunks' buffers and the directory.
    pub(crate) fn memory_bytes(&self) -> usize {
        let items: usize = self.chunks.iter().map(Vec::capacity).sum();
        items * std::mem::size_of::<T>() + self.chunks.capacity() * std::mem::size_of::<Vec<T>>()
    }
}

impl<T> Index<usize> for Chunked<T> {
    type Output = T;

    #[inline]
    fn index(&self, i: usize) -> &T {
        &self.chunks[i >> CHUNK_BITS][i & (CHUNK - 1)]
    }
}

impl<T> IndexMut<usize> for Chunked<T> {
    #[inline]
    fn index_mut(&mut self, i: usize) -> &mut T {
        &mut self.chunks[i >> CHUNK_BITS][i & (CHUNK - 1)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indexes_as_a_vec_across_chunks() {
        let mut chunked = Chunked::default();
        let mut vec = Vec::new();
        for i in 0..3 * CHUNK + 5 {
            chunked.push(i * 3);
            vec.push(i * 3);
            assert_eq!(chunked.len(), vec.len());
        }
        chunked[CHUNK] += 1;
        vec[CHUNK] += 1;
        assert!((0..vec.len()).all(|i| chunked[i] == vec[i]));
        assert!(chunked.iter().eq(vec.iter()));
        let buffers = (3 * CHUNK + 5) * std::mem::size_of::<usize>();
        assert!(chunked.memory_bytes() >= buffers);
        assert!(chunked.chunks[..3].iter().all(|c| c.capacity() == CHUNK));
    }

    #[test]
    #[should_panic]
    fn past_the_end_panics() {
        let mut chunked = Chunked::default();
        chunked.push(1u8);
        let _ = chunked[1];
    }
}
