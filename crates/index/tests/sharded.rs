//! `ShardedKvIndex` under concurrent writers and readers: a stress test. Each writer thread
//! owns some replicas and applies their events in order (stores, removals, clears) while
//! reader threads query; at the end every answer must equal a `KvIndex` fed the same events
//! on one thread, and during the run a reader must never see a replica's match go backwards
//! while that replica only grows.

mod support;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Barrier;

use kvroute_index::sharded::{Op, Stored};
use kvroute_index::{BlockHash, KvIndex, KvIndexer, ReplicaId, ShardedKvIndex, StorageTier};
use support::{router_hashes, tokens, Event, BS};

/// Replica `r`'s events: conversations that grow turn by turn on a shared system prompt, some
/// removed again, one clear in the middle for odd replicas.
fn events(replica: u32) -> Vec<Op> {
    let id = ReplicaId(replica);
    let system = tokens(1_000_000, 8 * BS);
    let mut ops = Vec::new();
    for conversation in 0..12u32 {
        let mut prompt = system.clone();
        prompt.extend(tokens(replica * 100_000 + conversation * 1_000, 24 * BS));
        let blocks = prompt.len() / BS;
        for turn in 0..3 {
            let range = turn * blocks / 3..(turn + 1) * blocks / 3;
            let event = Event::new(&prompt, BS, range, StorageTier::Device, 0);
            ops.push(Op::Stored(Stored::new(id, &event.stored())));
        }
        if conversation % 3 == 2 {
            let all = support::engine_hashes(&prompt, BS, 0);
            ops.push(Op::Removed {
                replica: id,
                tier: StorageTier::Device,
                hashes: all[blocks - 4..].to_vec(),
            });
        }
        if conversation == 6 && replica % 2 == 1 {
            ops.push(Op::Cleared(id));
        }
    }
    ops
}

fn queries() -> Vec<Vec<BlockHash>> {
    let mut list = vec![router_hashes(&tokens(1_000_000, 8 * BS), 0)];
    for replica in 0..8u32 {
        for conversation in [0u32, 5, 11] {
            let mut prompt = tokens(1_000_000, 8 * BS);
            prompt.extend(tokens(replica * 100_000 + conversation * 1_000, 24 * BS));
            list.push(router_hashes(&prompt, 0));
        }
    }
    list
}

#[test]
fn concurrent_writers_and_readers_end_where_one_thread_ends() {
    const REPLICAS: u32 = 8;
    let index = ShardedKvIndex::new(BS, 3);
    let mut single = KvIndex::new(BS);
    for replica in 0..REPLICAS {
        for op in events(replica) {
            op.apply(&mut single).expect("valid");
        }
    }
    let queries = queries();
    let done = AtomicBool::new(false);
    let start = Barrier::new(4 + 2);
    std::thread::scope(|scope| {
        let writers: Vec<_> = (0..4u32)
            .map(|w| {
                let (index, start) = (&index, &start);
                scope.spawn(move || {
                    let mine: Vec<Vec<Op>> =
                        (0..REPLICAS).filter(|r| r % 4 == w).map(events).collect();
                    start.wait();
                    // Interleave the writer's replicas, keeping each one's order.
                    let longest = mine.iter().map(Vec::len).max().unwrap_or(0);
                    for i in 0..longest {
                        for ops in &mine {
                            if let Some(op) = ops.get(i) {
                                index.apply(op.clone()).expect("valid");
                            }
                        }
                    }
                })
            })
            .collect();
        for _ in 0..2 {
            let (index, queries, done, start) = (&index, &queries, &done, &start);
            scope.spawn(move || {
                start.wait();
                let mut answered = 0;
                while !done.load(Ordering::Acquire) || answered < 100 {
                    for q in queries {
                        let scores = index.matches(q).scores;
                        assert!(scores.windows(2).all(|w| w[0].0 < w[1].0), "{scores:?}");
                        answered += 1;
                    }
                }
            });
        }
        for w in writers {
            w.join().expect("writer");
        }
        done.store(true, Ordering::Release);
    });
    for q in &queries {
        assert_eq!(index.matches(q), single.find_matches(q));
    }
}

#[test]
fn a_reader_never_sees_a_growing_replica_go_backwards() {
    // Replicas only store here, so what a reader sees of one can only grow.
    let index = ShardedKvIndex::new(BS, 2);
    let prompt = tokens(7, 64 * BS);
    let query = router_hashes(&prompt, 0);
    let done = AtomicBool::new(false);
    std::thread::scope(|scope| {
        for replica in 0..4u32 {
            let (index, prompt) = (&index, &prompt);
            scope.spawn(move || {
                for block in 0..64 {
                    let event = Event::new(prompt, BS, block..block + 1, StorageTier::Device, 0);
                    index
                        .stored(ReplicaId(replica), &event.stored())
                        .expect("valid");
                }
            });
        }
        let (index, query, done) = (&index, &query, &done);
        let reader = scope.spawn(move || {
            let mut seen = [0u32; 4];
            while !done.load(Ordering::Acquire) {
                for (replica, counts) in index.matches(query).scores {
                    let last = &mut seen[replica.0 as usize];
                    assert!(counts.device >= *last, "{replica:?} went back");
                    *last = counts.device;
                }
            }
            seen
        });
        while index
            .matches(query)
            .scores
            .iter()
            .map(|s| s.1.device)
            .sum::<u32>()
            < 4 * 64
        {
            std::thread::yield_now();
        }
        done.store(true, Ordering::Release);
        let seen = reader.join().expect("reader");
        assert!(seen.iter().all(|&n| n <= 64), "{seen:?}");
    });
    assert_eq!(index.matches(&query).scores.len(), 4);
    assert_eq!(
        index.blocks(),
        2 * 64,
        "each of the 2 shards holds the chain once"
    );
}

#[test]
fn a_refused_event_changes_neither_copy() {
    let index = ShardedKvIndex::new(BS, 1);
    let prompt = tokens(3, 4 * BS);
    let orphan = Event::new(&prompt, BS, 2..4, StorageTier::Device, 0);
    assert!(index.stored(ReplicaId(0), &orphan.stored()).is_err());
    // The next writes replay the refused event on the other copy and flip twice: still empty.
    let other = tokens(900, 2 * BS);
    let first = Event::new(&other, BS, 0..2, StorageTier::Device, 0);
    index.stored(ReplicaId(1), &first.stored()).expect("valid");
    index.cleared(ReplicaId(1));
    assert!(index.matches(&router_hashes(&prompt, 0)).scores.is_empty());
    assert_eq!(index.blocks(), 0);
}

#[test]
fn a_shard_keeps_its_records_once_and_its_table_twice() {
    // The records (most of an index's bytes) live on the writer's side only; the two copies
    // are of the block table. Two whole copies of a `KvIndex` would be twice its bytes.
    let (sharded, mut single) = (ShardedKvIndex::new(BS, 1), KvIndex::new(BS));
    for replica in 0..8 {
        for op in events(replica) {
            sharded.apply(op.clone()).expect("valid");
            op.apply(&mut single).expect("valid");
        }
    }
    for q in &queries() {
        assert_eq!(sharded.matches(q), single.find_matches(q));
    }
    for replica in 0..8 {
        let id = ReplicaId(replica);
        assert_eq!(sharded.replica_blocks(id), single.replica_blocks(id));
    }
    let (two, one) = (sharded.heap_bytes(), single.memory_bytes());
    assert!(
        one < two && two < one * 8 / 5,
        "sharded {two} bytes against one index's {one}"
    );
}

#[test]
fn a_batch_is_seen_whole_or_not_at_all() {
    // Each batch stores a chain and removes it again: a reader must never see the chain. Were
    // the events written one by one, it would see it between the two writes.
    let index = ShardedKvIndex::new(BS, 2);
    let prompt = tokens(5, 8 * BS);
    let query = router_hashes(&prompt, 0);
    let hashes = support::engine_hashes(&prompt, BS, 0);
    let whole = Event::new(&prompt, BS, 0..8, StorageTier::Device, 0);
    let (done, half, reads) = (
        AtomicBool::new(false),
        AtomicBool::new(false),
        AtomicU64::new(0),
    );
    std::thread::scope(|scope| {
        let (index, query) = (&index, &query);
        let (done, half, reads) = (&done, &half, &reads);
        scope.spawn(move || {
            while !done.load(Ordering::Acquire) {
                if !index.matches(query).scores.is_empty() {
                    half.store(true, Ordering::Release);
                    break;
                }
                reads.fetch_add(1, Ordering::Relaxed);
            }
        });
        // Writes until the reader has read a while alongside (however the threads run).
        let mut batches = 0;
        while (batches < 2_000 || reads.load(Ordering::Relaxed) < 1_000)
            && !half.load(Ordering::Acquire)
        {
            index.batch(ReplicaId(1), |events| {
                events.stored(&whole.stored()).expect("valid");
                events.removed(StorageTier::Device, &hashes);
            });
            batches += 1;
        }
        done.store(true, Ordering::Release);
    });
    assert!(!half.load(Ordering::Acquire), "a half batch seen");
    // A refused event in a batch changes nothing; the events after it still apply.
    let orphan = Event::new(&prompt, BS, 2..4, StorageTier::Device, 0);
    let refused = index.batch(ReplicaId(1), |events| {
        let refused = events.stored(&orphan.stored()).is_err();
        events.stored(&whole.stored()).expect("valid");
        refused
    });
    assert!(refused);
    assert_eq!(index.matches(&query).scores.len(), 1);
    index.batch(ReplicaId(1), |events| events.cleared());
    assert!(index.matches(&query).scores.is_empty());
}

/// Removals a block an event, as vLLM sends them, gathered within a batch: a block removed
/// then stored again (so the removal must be applied before the store) and a tier changed
/// midway end where the same events applied one by one end, through a shard's batch and
/// through a batch of one locked `KvIndex`.
#[test]
fn removals_gathered_in_a_batch_end_where_single_events_end() {
    let prompt = tokens(9, 6 * BS);
    let hashes = support::engine_hashes(&prompt, BS, 0);
    let whole = Event::new(&prompt, BS, 0..6, StorageTier::Device, 0);
    let last = Event::new(&prompt, BS, 5..6, StorageTier::Device, 0);
    let on_host = Event::new(&prompt, BS, 0..6, StorageTier::Host, 0);
    let (me, other) = (ReplicaId(0), ReplicaId(1));
    let one = |h: usize| std::slice::from_ref(&hashes[h]);
    let batch = |events: &mut kvroute_index::ReplicaEvents<'_>| {
        events.stored(&whole.stored()).unwrap();
        events.stored(&on_host.stored()).unwrap();
        events.removed(StorageTier::Device, one(5));
        events.stored(&last.stored()).unwrap();
        events.removed(StorageTier::Device, one(4));
        events.removed(StorageTier::Host, one(5));
        events.removed(StorageTier::Device, one(3));
    };
    // The same events, each alone.
    let mut expected = KvIndex::new(BS);
    let index = &mut expected;
    whole.apply(index, me).unwrap();
    on_host.apply(index, me).unwrap();
    index.apply_removed(me, StorageTier::Device, one(5));
    last.apply(index, me).unwrap();
    index.apply_removed(me, StorageTier::Device, one(4));
    index.apply_removed(me, StorageTier::Host, one(5));
    index.apply_removed(me, StorageTier::Device, one(3));
    whole.apply(index, other).unwrap();
    let sharded = ShardedKvIndex::new(BS, 2);
    sharded.batch(me, batch);
    sharded.stored(other, &whole.stored()).unwrap();
    let mut single = KvIndex::new(BS);
    batch(&mut kvroute_index::ReplicaEvents::new(&mut single, me));
    whole.apply(&mut single, other).unwrap();
    let query = router_hashes(&prompt, 0);
    let want = expected.find_matches(&query);
    // The device holds blocks 0-2 and 5 again, the host blocks 0-4.
    let held = expected.replica_blocks(me);
    assert_eq!((held.device, held.host), (4, 5), "{want:?}");
    assert_eq!(sharded.matches(&query), want);
    assert_eq!(single.find_matches(&query), want);
    for id in [me, other] {
        assert_eq!(sharded.replica_blocks(id), expected.replica_blocks(id));
        assert_eq!(single.replica_blocks(id), expected.replica_blocks(id));
    }
}
