//! Tests of what only `KvIndex` has: the capacity bound, counters, slot bookkeeping.

use super::queue::{Queue, SWEEP_SLACK};
use super::*;
use crate::{below, block_hashes, ReplicaId};

const BS: usize = 16;

fn engine(tokens: &[u32], engine_bs: usize) -> Vec<EngineHash> {
    block_hashes(tokens, engine_bs, 0xE)
        .into_iter()
        .map(|h| EngineHash(h.0))
        .collect()
}

fn store(
    index: &mut impl KvIndexer,
    replica: u32,
    tokens: &[u32],
    engine_bs: usize,
    tier: StorageTier,
) {
    let hashes = engine(tokens, engine_bs);
    let event = StoredBlocks {
        parent: None,
        engine_hashes: &hashes,
        token_ids: &tokens[..hashes.len() * engine_bs],
        block_size: engine_bs,
        tier,
        salt: 0,
    };
    index.apply_stored(ReplicaId(replica), &event).unwrap();
}

fn prompt(start: u32, blocks: usize) -> Vec<u32> {
    (start..start + (blocks * BS) as u32).collect()
}

fn held(index: &KvIndex, replica: u32, tokens: &[u32]) -> u32 {
    index
        .find_matches(&block_hashes(tokens, BS, 0))
        .get(ReplicaId(replica))
        .total()
}

#[test]
fn the_bound_evicts_least_recently_stored_engine_blocks() {
    let mut index = KvIndex::with_max_blocks(BS, 10);
    let (a, b) = (prompt(0, 6), prompt(1000, 6));
    store(&mut index, 0, &a, BS, StorageTier::Device);
    store(&mut index, 1, &b[..4 * BS], BS, StorageTier::Device);
    assert_eq!((index.num_engine_blocks(), index.evicted_blocks()), (10, 0));
    // Storing a's first block again makes it the most recent; then two more of b evict a's
    // blocks 1 and 2 (the oldest), breaking a's prefix after block 0.
    store(&mut index, 0, &a[..BS], BS, StorageTier::Host);
    store(&mut index, 1, &b, BS, StorageTier::Device);
    assert_eq!((index.num_engine_blocks(), index.evicted_blocks()), (10, 2));
    assert_eq!(held(&index, 0, &a), 1);
    assert_eq!(held(&index, 1, &b), 6);
}

#[test]
fn the_bound_keeps_memory_flat_under_unbounded_traffic() {
    let mut index = KvIndex::with_max_blocks(BS, 2000);
    let mut peak = 0;
    for i in 0..400u32 {
        store(
            &mut index,
            i % 8,
            &prompt(i * 10_000, 20),
            BS,
            StorageTier::Device,
        );
        store(
            &mut index,
            i % 8,
            &prompt(i * 10_000 + 5000, 5),
            1,
            StorageTier::Device,
        );
        assert!(index.num_engine_blocks() <= 2000);
        if i == 200 {
            peak = index.memory_bytes();
        }
    }
    assert!(index.evicted_blocks() > 0);
    assert!(
        index.memory_bytes() <= peak * 5 / 4,
        "{} > {peak}",
        index.memory_bytes()
    );
    // At most a third past where a sweep begins (four entries swept a store), an event's
    // entries aside.
    assert!(queue(&index).len() <= (2 * 2000 + SWEEP_SLACK) * 4 / 3 + 25);
}

#[test]
fn cleared_slots_hold_no_bits_and_are_reused() {
    let mut index = KvIndex::new(BS);
    let shared = prompt(0, 8);
    for r in 0..3 {
        store(&mut index, r, &shared, BS, StorageTier::Device);
        store(&mut index, r, &shared, 64, StorageTier::Host);
        store(&mut index, r, &shared, 1, StorageTier::Disk);
        store(&mut index, r, &shared[..5 * BS], 32, StorageTier::Device);
    }
    index.apply_removed(ReplicaId(1), StorageTier::Disk, &engine(&shared, 1)[7..9]);
    let slot = index.slots.get(ReplicaId(1)).unwrap();
    index.clear_replica(ReplicaId(1));
    assert!(index.slot_is_clean(slot));
    assert_eq!(index.num_replicas(), 2);
    store(&mut index, 9, &shared[..BS], BS, StorageTier::Device);
    assert_eq!(index.slots.get(ReplicaId(9)), Some(slot));
    assert_eq!(held(&index, 9, &shared), 1);
    assert_eq!(held(&index, 0, &shared), 8);
    index.clear_replica(ReplicaId(0));
    index.clear_replica(ReplicaId(2));
    index.clear_replica(ReplicaId(9));
    assert_eq!(
        (index.num_blocks(), index.engine_blocks, index.record_heap),
        (0, 0, 0)
    );
    assert!(index.table.extra_is_empty(), "the extra counts are gone");
}

#[test]
fn storing_and_removing_in_rounds_reuses_nodes_and_records() {
    // Conversations on a shared prefix, stored then removed newest block first, round after
    // round, by changing replicas: the answers stay right and the memory stays flat (freed
    // nodes and records are reused).
    let mut index = KvIndex::new(BS);
    let shared = prompt(0, 4);
    store(&mut index, 0, &shared, BS, StorageTier::Device);
    let mut settled = 0;
    for round in 0..200u32 {
        let replica = 1 + round % 5;
        let tokens = [shared.clone(), prompt(10_000 + round * 1000, 20)].concat();
        let hashes = engine(&tokens, BS);
        let event = StoredBlocks {
            parent: None,
            engine_hashes: &hashes,
            token_ids: &tokens,
            block_size: BS,
            tier: StorageTier::Device,
            salt: 0,
        };
        index.apply_stored(ReplicaId(replica), &event).unwrap();
        assert_eq!(held(&index, replica, &tokens), 24);
        assert_eq!(held(&index, 0, &tokens), 4);
        assert_eq!(index.num_blocks(), 24);
        let newest_first: Vec<EngineHash> = hashes[4..].iter().rev().copied().collect();
        index.apply_removed(ReplicaId(replica), StorageTier::Device, &newest_first);
        assert_eq!(held(&index, replica, &tokens), 4);
        index.apply_removed(ReplicaId(replica), StorageTier::Device, &hashes[..4]);
        assert_eq!(held(&index, replica, &tokens), 0);
        assert_eq!(held(&index, 0, &tokens), 4);
        assert_eq!((index.num_blocks(), index.num_engine_blocks()), (4, 4));
        // (Once every replica's record map has settled: emptied and filled again, a map may
        // double once or twice before its removed entries stop counting against its room,
        // depending on when a claim finds it full; at this size by round 80.)
        if round == 100 {
            settled = index.memory_bytes();
        }
        if round > 100 {
            assert!(index.memory_bytes() <= settled, "round {round}");
        }
    }
    assert_eq!(index.unknown_removals(), 0);
}

#[test]
fn storing_with_another_mapping_replaces_the_old_one() {
    let mut index = KvIndex::new(BS);
    let a = prompt(0, 2);
    let hashes = engine(&a, BS);
    fn stored<'a>(hashes: &'a [EngineHash], tokens: &'a [u32]) -> StoredBlocks<'a> {
        StoredBlocks {
            parent: None,
            engine_hashes: &hashes[..1],
            token_ids: &tokens[..BS],
            block_size: BS,
            tier: StorageTier::Device,
            salt: 0,
        }
    }
    index
        .apply_stored(ReplicaId(0), &stored(&hashes, &a))
        .unwrap();
    let other = prompt(500, 1);
    index
        .apply_stored(ReplicaId(0), &stored(&hashes, &other))
        .unwrap();
    assert_eq!(held(&index, 0, &a), 0);
    assert_eq!(held(&index, 0, &other), 1);
    assert_eq!((index.num_blocks(), index.num_engine_blocks()), (1, 1));
}

#[test]
fn unknown_removals_are_counted() {
    let mut index = KvIndex::new(BS);
    let a = prompt(0, 2);
    store(&mut index, 0, &a, BS, StorageTier::Device);
    let hashes = engine(&a, BS);
    index.apply_removed(ReplicaId(0), StorageTier::Host, &hashes);
    index.apply_removed(ReplicaId(5), StorageTier::Device, &hashes);
    index.apply_removed(
        ReplicaId(0),
        StorageTier::Device,
        &[hashes[0], EngineHash(3)],
    );
    assert_eq!(index.unknown_removals(), 5);
    assert_eq!(
        format!("{index:?}"),
        "KvIndex { block_size: 16, blocks: 1, engine_blocks: 1, max_blocks: None, .. }"
    );
    // Named twice in one batch: removed once, the second unknown.
    index.apply_removed(ReplicaId(0), StorageTier::Device, &[hashes[1], hashes[1]]);
    assert_eq!(index.unknown_removals(), 6);
    assert_eq!(
        format!("{index:?}"),
        "KvIndex { block_size: 16, blocks: 0, engine_blocks: 0, max_blocks: None, .. }"
    );
}

#[test]
fn memory_estimate_is_close_to_the_tables() {
    let mut index = KvIndex::new(BS);
    for r in 0..4 {
        store(
            &mut index,
            r,
            &prompt(r * 100_000, 5000),
            BS,
            StorageTier::Device,
        );
    }
    let per_block = index.memory_bytes() / index.num_blocks();
    // A block's hash in its run (8 bytes, the run's own fields shared by up to 64 blocks) and
    // its record (16 bytes and a control byte, at hashbrown's load of 7/16 to 7/8): 26 to 47
    // bytes; the bound is 100.
    assert!((26..=50).contains(&per_block), "{per_block}");
}

#[test]
fn replica_blocks_counts_each_replicas_engine_blocks_per_tier() {
    let mut index = KvIndex::new(BS);
    let a = prompt(0, 5);
    store(&mut index, 0, &a, BS, StorageTier::Device);
    store(&mut index, 0, &a[..2 * BS], BS, StorageTier::Host);
    store(&mut index, 1, &prompt(500, 3), BS, StorageTier::Disk);
    let zero = index.replica_blocks(ReplicaId(0));
    assert_eq!((zero.device, zero.host, zero.disk), (5, 2, 0));
    assert_eq!(index.replica_blocks(ReplicaId(1)).disk, 3);
    assert_eq!(index.replica_blocks(ReplicaId(7)).total(), 0);
    index.clear_replica(ReplicaId(0));
    assert_eq!(index.replica_blocks(ReplicaId(0)).device, 0);
}

/// The per-tier counts by walking the replica's records, to check the kept ones against.
fn walked(index: &KvIndex, replica: u32) -> [u32; 4] {
    let mut counts = [0; 4];
    if let Some(slot) = index.slots.get(ReplicaId(replica)) {
        for record in index.records.values(slot) {
            for tier in tier_bits(record.tiers()) {
                counts[tier] += 1;
            }
        }
    }
    counts
}

#[test]
fn kept_tier_counts_match_the_records_through_stores_removals_and_evictions() {
    let mut index = KvIndex::with_max_blocks(BS, 40);
    for i in 0..60u32 {
        let tier = [StorageTier::Device, StorageTier::Host, StorageTier::Disk][i as usize % 3];
        store(
            &mut index,
            i % 3,
            &prompt(i * 37 % 500, 1 + i as usize % 6),
            BS,
            tier,
        );
        if i % 7 == 0 {
            let gone = engine(&prompt(i * 37 % 500, 2), BS);
            index.apply_removed(ReplicaId(i % 3), StorageTier::Device, &gone);
        }
        if i == 45 {
            index.clear_replica(ReplicaId(1));
        }
        for r in 0..3 {
            let b = index.replica_blocks(ReplicaId(r));
            assert_eq!(
                [b.device, b.host, b.disk, b.external],
                walked(&index, r),
                "step {i}, replica {r}"
            );
        }
    }
    assert!(index.evicted_blocks() > 0);
}

#[test]
fn distinct_blocks_are_counted_across_many_replicas() {
    // 200 replicas, each holding a prefix of one of 5 prompts; some are cleared, some stored
    // again, and the count of distinct router blocks must equal the reference model's at
    // every step.
    let mut index = KvIndex::new(BS);
    let mut reference = crate::reference::ReferenceIndex::new(BS);
    let prompts: Vec<Vec<u32>> = (0..5).map(|p| prompt(p * 10_000, 12)).collect();
    let mut steps = 0;
    for round in 0..3u32 {
        for replica in 0..200u32 {
            let tokens = &prompts[((replica + round) % 5) as usize];
            let blocks = ((replica * 7 + round) % 12 + 1) as usize;
            store(
                &mut index,
                replica,
                &tokens[..blocks * BS],
                BS,
                StorageTier::Device,
            );
            store(
                &mut reference,
                replica,
                &tokens[..blocks * BS],
                BS,
                StorageTier::Device,
            );
            if (replica + round) % 3 == 0 {
                index.clear_replica(ReplicaId(replica / 2));
                reference.clear_replica(ReplicaId(replica / 2));
            }
            assert_eq!(
                index.num_blocks(),
                reference.num_blocks(),
                "round {round} replica {replica}"
            );
            steps += 1;
        }
    }
    assert_eq!(steps, 600);
    for p in &prompts {
        let hashes = crate::block_hashes(p, BS, 0);
        assert_eq!(reference.find_matches(&hashes), index.find_matches(&hashes));
    }
    // 60 distinct blocks, each held by many replicas: counted once.
    assert_eq!(index.num_blocks(), 60);
    for replica in 0..200 {
        index.clear_replica(ReplicaId(replica));
    }
    assert_eq!(index.num_blocks(), 0);
}

#[test]
fn a_prefix_removed_before_its_continuations_is_stored_again_without_doubling_them() {
    // Four replicas hold one prefix and a continuation each; the prefix goes first (its run,
    // with the continuations branching from it, stays, held by no one), then another replica
    // stores a chain again: the prefix's blocks and the continuation's are found where they
    // were, not made twice. Once every block goes, nothing is left.
    let mut index = KvIndex::new(BS);
    let shared = prompt(0, 8);
    let chains: Vec<Vec<u32>> = (1..=4)
        .map(|r| [shared.clone(), prompt(1000 * r, 6)].concat())
        .collect();
    for (r, tokens) in chains.iter().enumerate() {
        store(&mut index, r as u32, tokens, BS, StorageTier::Device);
    }
    assert_eq!(index.num_blocks(), 8 + 4 * 6);
    let hashes: Vec<Vec<EngineHash>> = chains.iter().map(|t| engine(t, BS)).collect();
    for (r, h) in hashes.iter().enumerate() {
        index.apply_removed(ReplicaId(r as u32), StorageTier::Device, &h[..8]);
    }
    assert_eq!(index.num_blocks(), 4 * 6);
    // A fifth replica stores the first chain: the prefix anew, the continuation found.
    store(&mut index, 4, &chains[0], BS, StorageTier::Device);
    assert_eq!(index.num_blocks(), 8 + 4 * 6);
    assert_eq!(held(&index, 4, &chains[0]), 14);
    for (r, h) in hashes.iter().enumerate() {
        index.apply_removed(ReplicaId(r as u32), StorageTier::Device, &h[8..]);
    }
    assert_eq!(held(&index, 4, &chains[0]), 14);
    index.apply_removed(ReplicaId(4), StorageTier::Device, &hashes[0]);
    assert_eq!((index.num_blocks(), index.num_engine_blocks()), (0, 0));
    assert_eq!(index.unknown_removals(), 0);
    store(&mut index, 1, &chains[1], BS, StorageTier::Device);
    assert_eq!(held(&index, 1, &chains[1]), 14);
}

#[test]
fn the_bound_evicts_in_store_order_across_renumberings() {
    // Single-block chains stored, stored again (becoming the most recent), removed, by 6
    // replicas, under a bound of 50, over 20,000 steps (16,000 stores): a renumbering of the
    // stamps every 1,000 stores (in tests), a sweep of the queue a few entries a store (a bound
    // of 100 at most, in tests). A model keeps each held block's last store time and evicts
    // the oldest beyond the bound; the index holds exactly the model's blocks after every step.
    use std::collections::HashMap;
    let mut index = KvIndex::with_max_blocks(BS, 50);
    let mut model: HashMap<(u32, u64), u64> = HashMap::new();
    let mut next = below(0x0123_4567_89AB_CDEF);
    let (mut evicted, mut stores, mut renumbering, mut covered) = (0, 0, 0, 0);
    for t in 0..20_000u64 {
        renumbering += usize::from(queue(&index).sweeping() == Some(true));
        covered = covered.max(queue(&index).stamps_covered());
        let (replica, block) = (next(6) as u32, next(120) as u32);
        let tokens = prompt(block * 1000, 1);
        let hash = engine(&tokens, BS)[0];
        if next(5) == 0 {
            index.apply_removed(ReplicaId(replica), StorageTier::Device, &[hash]);
            model.remove(&(replica, hash.0));
        } else {
            store(&mut index, replica, &tokens, BS, StorageTier::Device);
            stores += 1;
            model.insert((replica, hash.0), t);
            while model.len() > 50 {
                let oldest = *model.iter().min_by_key(|(_, t)| **t).unwrap().0;
                model.remove(&oldest);
                evicted += 1;
            }
        }
        assert_eq!(index.num_engine_blocks(), model.len(), "step {t}");
        for &(replica, hash) in model.keys() {
            let slot = index.slots.get(ReplicaId(replica)).expect("a slot");
            assert!(index.records.contains(slot, EngineHash(hash)), "step {t}");
        }
    }
    assert_eq!(index.evicted_blocks(), evicted);
    assert!(renumbering > 100, "renumbering in {renumbering} steps");
    // The queue's bits cover the stamps since the last renumbering began, not every stamp
    // ever given (17,152 without forgetting): at most its interval (1,000 in tests), the
    // stamps its sweep gives and the stores meanwhile (under three times the bound), and a
    // word at each end.
    assert!(covered <= 1_000 + 3 * 50 + 128, "{covered} stamps covered");
    // Each renumbering gave the live records stamps after the stores': more than 15 of them.
    assert!(
        index.next_stamp > stores + 15 * 40,
        "{} after {stores}",
        index.next_stamp
    );
}

#[test]
fn the_bound_keeps_the_table_s_runs_under_its_limit() {
    // Forks: every chain shares a 2-block prefix and branches after it, so each costs a run
    // of its own (64 at most in tests), while the block bound (10,000) is never reached. The
    // least recently stored chains go, as for the block bound, and the newest stay whole.
    let mut index = KvIndex::with_max_blocks(BS, 10_000);
    let shared = prompt(0, 2);
    for i in 0..300u32 {
        let tokens = [shared.clone(), prompt(100_000 + i * 1000, 3)].concat();
        store(&mut index, i % 4, &tokens, BS, StorageTier::Device);
        assert!(
            index.table.runs() <= 64,
            "chain {i}: {} runs",
            index.table.runs()
        );
        assert_eq!(held(&index, i % 4, &tokens), 5, "chain {i}");
    }
    assert!(index.evicted_blocks() > 0);
    assert!(index.num_engine_blocks() < 10_000);
}

#[test]
fn the_queue_of_stores_is_swept_a_few_entries_a_store() {
    // 60 chains of 8 blocks (6 replicas, a run each: under the 64 runs tests allow) stored
    // again and again (each store leaving the last one's queue entries stale), their ends
    // removed now and then, under a bound of 450 of their 480 blocks: the queue is swept while
    // stores go on, stays within a third of where a sweep begins, and the blocks evicted are
    // still the least recently stored (a model's), across renumberings at once.
    use std::collections::HashMap;
    let mut index = KvIndex::with_max_blocks(BS, 450);
    let mut model: HashMap<(u32, u64), u64> = HashMap::new();
    let mut next = below(0x0F1E_2D3C_4B5A_6978);
    let mut sweeping = 0;
    for t in 0..6_000u64 {
        let (replica, chain) = (next(6) as u32, next(10) as u32);
        let tokens = prompt(chain * 100_000, 8);
        let hashes = engine(&tokens, BS);
        if next(20) == 0 {
            let from = next(8) as usize;
            index.apply_removed(ReplicaId(replica), StorageTier::Device, &hashes[from..]);
            for hash in &hashes[from..] {
                model.remove(&(replica, hash.0));
            }
        } else {
            store(&mut index, replica, &tokens, BS, StorageTier::Device);
            for (i, hash) in hashes.iter().enumerate() {
                model.insert((replica, hash.0), t * 8 + i as u64);
            }
            while model.len() > 450 {
                let oldest = *model.iter().min_by_key(|(_, t)| **t).unwrap().0;
                model.remove(&oldest);
            }
        }
        sweeping += usize::from(queue(&index).sweeping().is_some());
        // Over the bound renumberings sweep at (100, in tests): they renumber at once.
        assert_ne!(queue(&index).sweeping(), Some(true), "step {t}");
        // A sweep begins past twice the blocks held (at most 450) and 8 more, and ends
        // before the queue grows by a third (an event's 8 entries aside).
        let most = (2 * 450 + SWEEP_SLACK) * 4 / 3 + 8;
        assert!(
            queue(&index).len() <= most,
            "step {t}: {} queued",
            queue(&index).len()
        );
        assert_eq!(index.num_engine_blocks(), model.len(), "step {t}");
        for &(replica, hash) in model.keys() {
            let slot = index.slots.get(ReplicaId(replica)).expect("a slot");
            assert!(index.records.contains(slot, EngineHash(hash)), "step {t}");
        }
    }
    assert!(index.evicted_blocks() > 0);
    assert!(sweeping > 1_000, "sweeping in {sweeping} steps");
}

/// A bounded index's queue of stores.
fn queue(index: &KvIndex) -> &Queue {
    index.queue.as_deref().expect("a bounded index")
}
