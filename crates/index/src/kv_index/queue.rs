//! The bounded index's queue of stores: its engine blocks in the order they were last
//! stored, the least recently stored evicted first when the index goes over its bound.
//!
//! Every store of an engine block appends an entry (slot, engine hash, stamp), the stamp the
//! next of a store counter, which the block's record keeps (modulo 2^28, [`STAMP_BITS`]).
//! Storing the block again, or removing it, leaves its entry stale: an entry is live while its
//! stamp is its record's. The queue knows which without reading the records: a bit per stamp,
//! set when a store takes the stamp and cleared when its record takes another or goes (the
//! index tells it, [`Queue::retire`]). So dropping the stale entries reads the queue and the
//! bits in order, where a lookup of each entry's record, a cache miss apiece, made the bounded
//! index churn at 0.56x the unbounded one's rate.
//!
//! Stale entries are dropped by sweeps of a few entries a store, which begin when the queue
//! holds more than twice the blocks held. Every so many stores a sweep also gives the live
//! entries, and their records, new stamps in queue order (a renumbering), so that the stamps
//! in use stay within 2^27 of each other (see [`GRADUAL_RENUMBER_UP_TO`]) and the bits kept
//! cover only the stamps since the last renumbering began.

use std::collections::VecDeque;

use super::records::{Records, STAMP_BITS};
use crate::EngineHash;

/// See the [module docs](self).
#[derive(Debug, Default)]
pub(super) struct Queue {
    /// Engine blocks in store order.
    entries: VecDeque<Entry>,
    /// The stamps some record has now.
    live: Stamps,
    /// A pass over `entries` dropping the stale ones, a few a store, while one is under way.
    sweep: Option<Sweep>,
    /// The most engine blocks the index keeps.
    bound: usize,
    /// The stamp at which the live records are renumbered next.
    renumber_at: u64,
    renumber_every: u64,
}

impl Queue {
    /// The queue of an index bounded at `bound` engine blocks.
    pub(super) fn new(bound: usize) -> Self {
        let renumber_every = (16 * bound as u64).clamp(RENUMBER_MIN, RENUMBER_MAX);
        Self {
            bound,
            renumber_at: renumber_every,
            renumber_every,
            ..Self::default()
        }
    }

    /// The most engine blocks the index keeps.
    pub(super) fn bound(&self) -> usize {
        self.bound
    }

    /// Notes that `hash` of `slot` was stored with stamp `stamp`, which its record now has
    /// (its earlier stamp retired: [`Self::retire`]), then moves a sweep on, begins one when
    /// due, and gives the next stamps (`next_stamp`) to the live entries it renumbers.
    #[inline]
    pub(super) fn push(&mut self, slot: u32, hash: EngineHash, stamp: u64, index: Sweeping<'_>) {
        let entry = Entry {
            slot,
            stamp: stamp as u32,
            hash,
        };
        // The queue's next lines into cache ahead of their stores (a line holds 4 entries; the
        // address is past the buffer's end where the queue wraps there, once a lap).
        if let Some(last) = self.entries.back() {
            super::prefetch_at((last as *const Entry).wrapping_add(AHEAD));
        }
        self.entries.push_back(entry);
        self.live.set(stamp);
        let renumber = *index.next_stamp >= self.renumber_at;
        if renumber && self.bound > GRADUAL_RENUMBER_UP_TO {
            // At once (see `GRADUAL_RENUMBER_UP_TO`): the sweep under way, then a renumbering
            // one, each to the queue's end.
            self.sweep_on(usize::MAX, index.records, index.next_stamp);
            self.sweep = Some(Sweep::new(true));
            self.sweep_on(usize::MAX, index.records, index.next_stamp);
            self.renumber_at = *index.next_stamp + self.renumber_every;
        } else if self.sweep.is_some() {
            self.sweep_on(SWEEP_STEP, index.records, index.next_stamp);
        } else if renumber {
            // A renumbering sweep (see `GRADUAL_RENUMBER_UP_TO` for the window it keeps).
            self.sweep = Some(Sweep::new(true));
            self.renumber_at = *index.next_stamp + self.renumber_every;
        } else if self.entries.len() > 2 * index.engine_blocks + SWEEP_SLACK {
            self.sweep = Some(Sweep::new(false));
        }
    }

    /// Notes that the record whose stamp is `stamp` (modulo 2^28, as a record keeps it) took
    /// another or went: its entry is stale. `next_stamp` is the next stamp to be given.
    #[inline]
    pub(super) fn retire(&mut self, stamp: u64, next_stamp: u64) {
        if self.live.words.is_empty() {
            return;
        }
        // Every live stamp lies within 2^28 below the next (see `GRADUAL_RENUMBER_UP_TO`).
        let mask = (1u64 << STAMP_BITS) - 1;
        self.live.clear(before(next_stamp, stamp, mask));
    }

    /// Takes the least recently stored live entry off the queue, and the stale ones before
    /// it: its record is to be evicted.
    pub(super) fn pop_live(&mut self, next_stamp: u64) -> Option<(u32, EngineHash)> {
        loop {
            let entry = self.entries.pop_front()?;
            if let Some(sweep) = &mut self.sweep {
                // The queue's positions moved down by one (the front was kept, dropped or not
                // swept yet).
                sweep.read = sweep.read.saturating_sub(1);
                sweep.write = sweep.write.saturating_sub(1);
            }
            let stamp = entry.stamp(next_stamp);
            if self.live.test(stamp) {
                // Cleared here too, so that no bit outlives its entry even if the record were
                // missing (the index's removal then retires it again, a no-op).
                self.live.clear(stamp);
                return Some((entry.slot, entry.hash));
            }
        }
    }

    /// Moves the sweep of the queue on by `entries` entries: a live one is kept (moved down
    /// to the sweep's kept end; renumbering, with the next stamp, its record's too), a stale
    /// one dropped. At the queue's end (stores' entries included), the entries past the kept
    /// ones go, the stamps before the oldest kept are forgotten, and the sweep is over.
    fn sweep_on(&mut self, entries: usize, records: &mut Records, next_stamp: &mut u64) {
        let Some(at) = &mut self.sweep else {
            return;
        };
        for _ in 0..entries {
            // The entries it reads and the room it writes them to, ahead.
            if let Some(ahead) = self.entries.get(at.read + AHEAD) {
                super::prefetch(ahead);
            }
            if let Some(ahead) = self.entries.get(at.write + AHEAD) {
                super::prefetch(ahead);
            }
            if at.read == self.entries.len() {
                self.entries.truncate(at.write);
                self.live.forget_before(at.oldest);
                self.sweep = None;
                return;
            }
            let Entry { slot, hash, .. } = self.entries[at.read];
            let stamp = self.entries[at.read].stamp(*next_stamp);
            at.read += 1;
            let live = self.live.test(stamp);
            debug_assert_eq!(
                live,
                records
                    .get(slot, hash)
                    .is_some_and(|record| record.stamped(stamp)),
                "the stamps' bits agree with the records"
            );
            if !live {
                continue;
            }
            let stamp = match at.renumber {
                true => {
                    let Some(entry) = records.locate(slot, hash) else {
                        // Not while the bits agree with the records (checked above).
                        self.live.clear(stamp);
                        continue;
                    };
                    let renumbered = *next_stamp;
                    *next_stamp += 1;
                    records.at_mut(slot, entry).set_stamp(renumbered);
                    self.live.clear(stamp);
                    self.live.set(renumbered);
                    renumbered
                }
                false => stamp,
            };
            at.oldest = at.oldest.min(stamp);
            self.entries[at.write] = Entry {
                slot,
                stamp: stamp as u32,
                hash,
            };
            at.write += 1;
        }
    }

    pub(super) fn memory_bytes(&self) -> usize {
        self.entries.capacity() * std::mem::size_of::<Entry>()
            + self.live.words.capacity() * std::mem::size_of::<u64>()
    }

    /// Entries queued, stale ones included.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }

    /// While a sweep is under way, whether it renumbers.
    #[cfg(test)]
    pub(super) fn sweeping(&self) -> Option<bool> {
        self.sweep.map(|sweep| sweep.renumber)
    }

    /// Stamps the bits cover (a multiple of 64).
    #[cfg(test)]
    pub(super) fn stamps_covered(&self) -> usize {
        self.live.words.len() * 64
    }
}

/// A store of an engine block (16 bytes).
#[derive(Debug, Clone, Copy)]
struct Entry {
    slot: u32,
    /// The store's stamp modulo 2^32: every stamp queued lies within 2^28 below the next
    /// (see `GRADUAL_RENUMBER_UP_TO`).
    stamp: u32,
    hash: EngineHash,
}

impl Entry {
    /// The stamp, whole, where `next_stamp` is the next to be given.
    #[inline]
    fn stamp(&self, next_stamp: u64) -> u64 {
        before(next_stamp, u64::from(self.stamp), u64::from(u32::MAX))
    }
}

/// The stamp before `next_stamp` that is `stamp` modulo `mask + 1` (a power of two), where
/// the stamp lies within that many below.
#[inline]
fn before(next_stamp: u64, stamp: u64, mask: u64) -> u64 {
    let newest = next_stamp.wrapping_sub(1);
    newest.wrapping_sub(newest.wrapping_sub(stamp) & mask)
}

/// What a store's sweep step needs of the index.
pub(super) struct Sweeping<'a> {
    pub(super) records: &'a mut Records,
    pub(super) next_stamp: &'a mut u64,
    pub(super) engine_blocks: usize,
}

/// A bit per stamp from `base` (a multiple of 64) on.
#[derive(Debug, Default)]
struct Stamps {
    base: u64,
    words: VecDeque<u64>,
}

impl Stamps {
    /// Sets `stamp`'s bit; `stamp` is at or after every stamp set before.
    #[inline]
    fn set(&mut self, stamp: u64) {
        if self.words.is_empty() {
            self.base = stamp & !63;
        }
        debug_assert!(stamp >= self.base, "stamps are given in order");
        let word = ((stamp - self.base) / 64) as usize;
        if word >= self.words.len() {
            self.words.resize(word + 1, 0);
        }
        self.words[word] |= 1 << (stamp % 64);
    }

    #[inline]
    fn clear(&mut self, stamp: u64) {
        let word = (stamp.wrapping_sub(self.base) / 64) as usize;
        if let Some(bits) = self.words.get_mut(word).filter(|_| stamp >= self.base) {
            *bits &= !(1 << (stamp % 64));
        }
    }

    #[inline]
    fn test(&self, stamp: u64) -> bool {
        let word = (stamp.wrapping_sub(self.base) / 64) as usize;
        stamp >= self.base
            && self
                .words
                .get(word)
                .is_some_and(|bits| bits >> (stamp % 64) & 1 != 0)
    }

    /// Drops the bits of the words wholly before `stamp` (none of them set).
    fn forget_before(&mut self, stamp: u64) {
        while self.base + 64 <= stamp && self.words.front().is_some_and(|&bits| bits == 0) {
            self.words.pop_front();
            self.base += 64;
        }
    }
}

impl Sweep {
    fn new(renumber: bool) -> Self {
        Self {
            read: 0,
            write: 0,
            renumber,
            oldest: u64::MAX,
        }
    }
}

/// A sweep of the queue in store order (see [`Queue::sweep_on`]): entries before `write` are
/// kept, those from `write` to `read` dropped, those from `read` on not seen yet.
#[derive(Debug, Clone, Copy)]
struct Sweep {
    read: usize,
    write: usize,
    /// Whether the entries kept get new stamps.
    renumber: bool,
    /// The oldest stamp kept so far.
    oldest: u64,
}

/// Queue entries a store checks while a sweep is under way, so that the queue is swept before
/// it grows by a third. Sweeping it at once, as it passed twice the blocks held, took 51-65 ms
/// at a million blocks with a lookup of each entry's record.
const SWEEP_STEP: usize = 4;

/// Entries ahead (four lines) that a store or a sweep brings into cache.
const AHEAD: usize = 16;

/// A sweep begins when the queue holds more than twice the blocks held, and this many more.
#[cfg(not(test))]
pub(super) const SWEEP_SLACK: usize = 1024;
#[cfg(test)]
pub(super) const SWEEP_SLACK: usize = 8;

/// The largest bound whose renumberings sweep the queue a few entries a store, like its
/// compactions; a larger bound renumbers at once (70 ms at a million blocks): then every live
/// stamp lies within the bound (at most 2^27) of the next, and within 2^27 + 2^26 until the
/// next renumbering.
///
/// A record keeps its stamp modulo 2^28, so every stamp in the queue and in the records must
/// lie within 2^28 of each other and of the next. Once a renumbering sweep is over, they all
/// lie at or after the stamp it began at, S. The next begins `E` stamps after S (`E`, 16
/// times the bound B within 2^16..2^26), or once a compaction under way is over (at most its
/// queue of 2.7B, a third of it in stores), and lasts its queue in stores (a third of it) and
/// the bound in new stamps. The stamps then span at most E + 0.9B + 0.9B + B, under 2^27 for
/// B = 2^24, and each sweep is over before the next is due (2.8B < E).
#[cfg(not(test))]
const GRADUAL_RENUMBER_UP_TO: usize = 1 << 24;
#[cfg(test)]
const GRADUAL_RENUMBER_UP_TO: usize = 100;

/// Stores between two renumberings: 16 times the bound, within these (in tests, often, to
/// exercise them). A renumbering looks up every live record (a cache miss each), so at a full
/// index it costs a lookup every 16 stores; the bits cover up to `E` + 2.8B stamps (9.4 MiB at
/// the router's default bound of 2^22, 2.4 bytes a block of it).
#[cfg(not(test))]
const RENUMBER_MIN: u64 = 1 << 16;
#[cfg(not(test))]
const RENUMBER_MAX: u64 = 1 << 26;
#[cfg(test)]
const RENUMBER_MIN: u64 = 1000;
#[cfg(test)]
const RENUMBER_MAX: u64 = 1000;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stamp_is_found_whole_from_its_low_bits() {
        let mask32 = u64::from(u32::MAX);
        let mask28 = (1 << STAMP_BITS) - 1;
        for next in [
            1u64,
            2,
            1 << 28,
            (1 << 28) + 5,
            (1 << 32) + 5,
            (7 << 32) + 123,
        ] {
            // Every stamp up to 2^28 below the next (the window the queue keeps).
            for back in [1u64, 2, 1000, (1 << 27) + 3, 1 << 28] {
                let Some(stamp) = next.checked_sub(back) else {
                    continue;
                };
                let entry = Entry {
                    slot: 0,
                    stamp: stamp as u32,
                    hash: EngineHash(0),
                };
                assert_eq!(entry.stamp(next), stamp, "{stamp} before {next}");
                assert_eq!(
                    before(next, stamp & mask28, mask28),
                    stamp,
                    "{stamp}, 28 bits"
                );
                assert_eq!(
                    before(next, stamp & mask32, mask32),
                    stamp,
                    "{stamp}, 32 bits"
                );
            }
        }
    }

    #[test]
    fn the_bits_behave_as_a_set_of_stamps() {
        // Stamps set in order, some cleared, the oldest words forgotten once clear: a model
        // set answers the same.
        let mut stamps = Stamps::default();
        let mut model = std::collections::BTreeSet::new();
        let mut next = crate::below(0x2545_F491_4F6C_DD1D);
        let mut stamp = 1_000u64;
        for step in 0..20_000 {
            match next(10) {
                0..=5 => {
                    stamp += 1 + next(3);
                    stamps.set(stamp);
                    model.insert(stamp);
                }
                6..=8 => {
                    let old = stamp.saturating_sub(next(3_000));
                    stamps.clear(old);
                    model.remove(&old);
                }
                _ => {
                    let oldest = model.first().copied().unwrap_or(u64::MAX);
                    stamps.forget_before(oldest);
                    assert!(stamps.base <= oldest, "step {step}");
                }
            }
            for probe in [stamp, stamp.saturating_sub(next(5_000)), stamp + 1] {
                assert_eq!(stamps.test(probe), model.contains(&probe), "step {step}");
            }
        }
        // Forgetting keeps the bits to the live stamps' span, a word aside.
        let oldest = *model.first().expect("live stamps");
        stamps.forget_before(oldest);
        assert!(stamps.base + 64 > oldest);
        assert!((stamps.words.len() as u64) * 64 <= stamp - stamps.base + 64);
    }
}
