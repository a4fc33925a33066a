//! The trait-level test suite, run against every `KvIndexer` backend (one generic function
//! per behaviour, instantiated for each backend by `kv_suite!`).

mod support;

use kvroute_index::reference::{ReferenceApprox, ReferenceIndex};
use kvroute_index::{
    block_hashes, ApproxIndex, EngineHash, IndexError, KvIndex, KvIndexer, ReplicaId, StorageTier,
    StoredBlocks, TierCounts,
};
use support::{engine_hashes, router_hashes, store_all, tokens, Event, BS};

const R0: ReplicaId = ReplicaId(0);
const R1: ReplicaId = ReplicaId(1);

fn device(n: u32) -> TierCounts {
    TierCounts {
        device: n,
        ..TierCounts::default()
    }
}

fn matched<I: KvIndexer>(index: &I, prompt: &[u32]) -> Vec<(ReplicaId, TierCounts)> {
    index.find_matches(&router_hashes(prompt, 0)).scores
}

macro_rules! kv_suite {
    ($($name:ident),* $(,)?) => {
        mod kv_index {
            $(#[test] fn $name() { super::$name(kvroute_index::KvIndex::new); })*
        }
        mod kv_index_bounded {
            $(#[test] fn $name() { super::$name(|bs| kvroute_index::KvIndex::with_max_blocks(bs, 1 << 20)); })*
        }
        mod sharded_mirrored {
            $(#[test] fn $name() { super::$name(|bs| kvroute_index::ShardedKvIndex::new(bs, 1)); })*
        }
        // Bounded, as the router builds it (the bound never reached here); one shard, since
        // the suite counts distinct blocks and shards count a shared block once each.
        mod sharded_bounded {
            $(#[test] fn $name() {
                super::$name(|bs| kvroute_index::ShardedKvIndex::with_max_blocks(bs, 1, 1 << 20));
            })*
        }
        mod reference {
            $(#[test] fn $name() { super::$name(kvroute_index::reference::ReferenceIndex::new); })*
        }
    };
}

kv_suite!(
    empty_index_matches_nothing,
    stored_chain_matches_its_leading_blocks,
    match_stops_at_first_block_not_held,
    only_replicas_holding_the_first_block_appear,
    each_block_counts_once_in_its_best_tier,
    removal_is_per_tier_and_ignores_unknown_hashes,
    clear_replica_forgets_only_that_replica,
    unknown_parent_is_an_error_and_changes_nothing,
    token_count_and_block_size_errors,
    events_split_anywhere_give_the_routers_hashes,
    engine_blocks_larger_than_router_blocks,
    shared_router_blocks_are_held_per_engine_block,
    pieces_continue_a_partial_router_block_across_events,
    a_branch_inside_a_router_block_completes_a_sibling,
    removing_a_piece_breaks_the_prefix_there,
    a_piece_stored_again_as_a_root_keeps_its_childrens_partial_block,
    a_piece_stored_again_under_another_parent_keeps_its_childrens_partial_block,
    storing_again_is_idempotent,
    salt_separates_chains,
    num_blocks_counts_distinct_blocks,
    memory_grows_with_blocks,
    many_replicas,
);

fn empty_index_matches_nothing<I: KvIndexer>(new: fn(usize) -> I) {
    let index = new(BS);
    assert_eq!(index.block_size(), BS);
    assert!(index.find_matches(&[]).scores.is_empty());
    assert!(matched(&index, &tokens(0, 64)).is_empty());
    assert_eq!(index.num_blocks(), 0);
}

fn stored_chain_matches_its_leading_blocks<I: KvIndexer>(new: fn(usize) -> I) {
    let mut index = new(BS);
    let prompt = tokens(0, 10 * BS + 5);
    store_all(&mut index, 0, &prompt, BS);
    assert_eq!(index.num_blocks(), 10);
    assert_eq!(matched(&index, &prompt), [(R0, device(10))]);
    assert_eq!(matched(&index, &prompt[..4 * BS + 3]), [(R0, device(4))]);
    let longer = [prompt.clone(), tokens(1000, 100)].concat();
    assert_eq!(matched(&index, &longer), [(R0, device(10))]);
    assert!(matched(&index, &tokens(1, 64)).is_empty());
    assert_eq!(
        index
            .find_matches(&router_hashes(&prompt, 0))
            .get(R0)
            .total(),
        10
    );
    assert_eq!(
        index
            .find_matches(&router_hashes(&prompt, 0))
            .get(R1)
            .total(),
        0
    );
}

fn match_stops_at_first_block_not_held<I: KvIndexer>(new: fn(usize) -> I) {
    let mut index = new(BS);
    let prompt = tokens(0, 10 * BS);
    store_all(&mut index, 0, &prompt, BS);
    let hashes = engine_hashes(&prompt, BS, 0);
    index.apply_removed(R0, StorageTier::Device, &hashes[3..4]);
    assert_eq!(matched(&index, &prompt), [(R0, device(3))]);
    assert_eq!(index.num_blocks(), 9);
}

fn only_replicas_holding_the_first_block_appear<I: KvIndexer>(new: fn(usize) -> I) {
    let mut index = new(BS);
    let prompt = tokens(0, 6 * BS);
    store_all(&mut index, 0, &prompt[..2 * BS], BS);
    store_all(&mut index, 1, &prompt, BS);
    store_all(&mut index, 2, &prompt, BS);
    store_all(&mut index, 3, &tokens(500, 3 * BS), BS);
    index.apply_removed(
        ReplicaId(2),
        StorageTier::Device,
        &engine_hashes(&prompt, BS, 0)[..1],
    );
    assert_eq!(matched(&index, &prompt), [(R0, device(2)), (R1, device(6))]);
}

fn each_block_counts_once_in_its_best_tier<I: KvIndexer>(new: fn(usize) -> I) {
    let mut index = new(BS);
    let prompt = tokens(0, 10 * BS);
    let store = |index: &mut I, blocks, tier| {
        Event::new(&prompt, BS, blocks, tier, 0)
            .apply(index, R0)
            .unwrap();
    };
    store(&mut index, 0..4, StorageTier::Device);
    store(&mut index, 0..8, StorageTier::Host);
    store(&mut index, 0..9, StorageTier::Disk);
    store(&mut index, 0..10, StorageTier::External);
    let counts = TierCounts {
        device: 4,
        host: 4,
        disk: 1,
        external: 1,
    };
    assert_eq!(matched(&index, &prompt), [(R0, counts)]);
    assert_eq!(counts.total(), 10);
    index.apply_removed(
        R0,
        StorageTier::Device,
        &engine_hashes(&prompt, BS, 0)[1..2],
    );
    let counts = TierCounts {
        device: 3,
        host: 5,
        disk: 1,
        external: 1,
    };
    assert_eq!(matched(&index, &prompt), [(R0, counts)]);
    assert_eq!(index.num_blocks(), 10);
}

fn removal_is_per_tier_and_ignores_unknown_hashes<I: KvIndexer>(new: fn(usize) -> I) {
    let mut index = new(BS);
    let prompt = tokens(0, 4 * BS);
    let hashes = engine_hashes(&prompt, BS, 0);
    store_all(&mut index, 0, &prompt, BS);
    Event::new(&prompt, BS, 0..4, StorageTier::Host, 0)
        .apply(&mut index, R0)
        .unwrap();
    index.apply_removed(R0, StorageTier::Disk, &hashes);
    index.apply_removed(R0, StorageTier::Device, &[EngineHash(12345)]);
    index.apply_removed(R1, StorageTier::Device, &hashes);
    assert_eq!(matched(&index, &prompt), [(R0, device(4))]);
    index.apply_removed(R0, StorageTier::Device, &hashes);
    let host = TierCounts {
        host: 4,
        ..TierCounts::default()
    };
    assert_eq!(matched(&index, &prompt), [(R0, host)]);
    index.apply_removed(R0, StorageTier::Host, &hashes);
    assert!(matched(&index, &prompt).is_empty());
    assert_eq!(index.num_blocks(), 0);
}

fn clear_replica_forgets_only_that_replica<I: KvIndexer>(new: fn(usize) -> I) {
    let mut index = new(BS);
    let prompt = tokens(0, 5 * BS);
    store_all(&mut index, 0, &prompt, BS);
    store_all(&mut index, 1, &prompt[..3 * BS], BS);
    store_all(&mut index, 0, &tokens(900, 4 * BS), 1);
    index.clear_replica(R0);
    index.clear_replica(ReplicaId(77));
    assert_eq!(matched(&index, &prompt), [(R1, device(3))]);
    assert_eq!(index.num_blocks(), 3);
    store_all(&mut index, 0, &prompt[..BS], BS);
    assert_eq!(matched(&index, &prompt), [(R0, device(1)), (R1, device(3))]);
}

fn unknown_parent_is_an_error_and_changes_nothing<I: KvIndexer>(new: fn(usize) -> I) {
    let mut index = new(BS);
    let prompt = tokens(0, 4 * BS);
    store_all(&mut index, 0, &prompt[..2 * BS], BS);
    let orphan = Event::new(&prompt, BS, 3..4, StorageTier::Device, 0);
    assert_eq!(
        orphan.apply(&mut index, R0),
        Err(IndexError::UnknownParent(orphan.parent.unwrap()))
    );
    let other_replica = Event::new(&prompt, BS, 2..4, StorageTier::Device, 0);
    assert!(matches!(
        other_replica.apply(&mut index, R1),
        Err(IndexError::UnknownParent(_))
    ));
    assert_eq!(index.num_blocks(), 2);
    assert_eq!(matched(&index, &prompt), [(R0, device(2))]);
    other_replica.apply(&mut index, R0).unwrap();
    assert_eq!(matched(&index, &prompt), [(R0, device(4))]);
}

fn token_count_and_block_size_errors<I: KvIndexer>(new: fn(usize) -> I) {
    let mut index = new(BS);
    let prompt = tokens(0, 4 * BS);
    let mut event = Event::new(&prompt, BS, 0..4, StorageTier::Device, 0);
    event.tokens.pop();
    assert_eq!(
        event.apply(&mut index, R0),
        Err(IndexError::TokenCount {
            tokens: 4 * BS - 1,
            blocks: 4,
            block_size: BS
        })
    );
    for bad in [0, 24, 3, 48 + 8] {
        let event = Event::new(&prompt, bad.max(1), 0..1, StorageTier::Device, 0);
        let stored = StoredBlocks {
            block_size: bad,
            token_ids: &prompt[..bad],
            ..event.stored()
        };
        assert_eq!(
            index.apply_stored(R0, &stored),
            Err(IndexError::BlockSizeMismatch {
                engine: bad,
                router: BS
            }),
            "engine block size {bad}"
        );
    }
    // A chain that switches to a larger block size inside a partial router block.
    Event::new(&prompt, 1, 0..5, StorageTier::Device, 0)
        .apply(&mut index, R0)
        .unwrap();
    let parent = engine_hashes(&prompt, 1, 0)[4];
    let switch = StoredBlocks {
        parent: Some(parent),
        engine_hashes: &[EngineHash(1)],
        token_ids: &prompt[5..5 + BS],
        block_size: BS,
        tier: StorageTier::Device,
        salt: 0,
    };
    assert_eq!(
        index.apply_stored(R0, &switch),
        Err(IndexError::BlockSizeMismatch {
            engine: BS,
            router: BS
        })
    );
    assert_eq!(index.num_blocks(), 0);
    let empty = StoredBlocks {
        engine_hashes: &[],
        token_ids: &[],
        ..switch
    };
    assert_eq!(index.apply_stored(R0, &empty), Ok(()));
}

/// Whatever the engine's block size and however its blocks are split into events, the
/// router blocks stored are those `block_hashes` gives for the same tokens.
fn events_split_anywhere_give_the_routers_hashes<I: KvIndexer>(new: fn(usize) -> I) {
    let prompt = tokens(7, 10 * BS + 9);
    for engine_bs in [1, 2, 4, 8, 16, 32, 64] {
        for split in [1, 3, 7, 100] {
            let mut index = new(BS);
            let blocks = prompt.len() / engine_bs;
            let mut start = 0;
            while start < blocks {
                let end = (start + split).min(blocks);
                Event::new(&prompt, engine_bs, start..end, StorageTier::Device, 0)
                    .apply(&mut index, R0)
                    .unwrap();
                start = end;
            }
            let full = (blocks * engine_bs / BS) as u32;
            assert_eq!(
                matched(&index, &prompt),
                [(R0, device(full))],
                "engine {engine_bs} split {split}"
            );
            assert_eq!(index.num_blocks(), full as usize);
        }
    }
}

fn engine_blocks_larger_than_router_blocks<I: KvIndexer>(new: fn(usize) -> I) {
    let mut index = new(BS);
    let prompt = tokens(0, 2 * 64 + 10);
    store_all(&mut index, 0, &prompt, 64);
    assert_eq!(matched(&index, &prompt), [(R0, device(8))]);
    let hashes = engine_hashes(&prompt, 64, 0);
    index.apply_removed(R0, StorageTier::Device, &hashes[1..]);
    assert_eq!(matched(&index, &prompt), [(R0, device(4))]);
    assert_eq!(index.num_blocks(), 4);
    index.apply_removed(R0, StorageTier::Device, &hashes[..1]);
    assert!(matched(&index, &prompt).is_empty());
    assert_eq!(index.num_blocks(), 0);
}

fn shared_router_blocks_are_held_per_engine_block<I: KvIndexer>(new: fn(usize) -> I) {
    let mut index = new(BS);
    let a = tokens(0, 64);
    let b = [&a[..BS], &tokens(500, 48)[..]].concat();
    store_all(&mut index, 0, &a, 64);
    store_all(&mut index, 0, &b, 64);
    assert_eq!(index.num_blocks(), 7);
    index.apply_removed(R0, StorageTier::Device, &engine_hashes(&a, 64, 0));
    assert_eq!(matched(&index, &b), [(R0, device(4))]);
    assert_eq!(matched(&index, &a), [(R0, device(1))]);
    assert_eq!(index.num_blocks(), 4);
}

fn pieces_continue_a_partial_router_block_across_events<I: KvIndexer>(new: fn(usize) -> I) {
    let mut index = new(BS);
    let prompt = tokens(0, 3 * BS);
    let store = |index: &mut I, blocks| {
        Event::new(&prompt, 1, blocks, StorageTier::Device, 0).apply(index, R0)
    };
    store(&mut index, 0..10).unwrap();
    assert!(matched(&index, &prompt).is_empty());
    assert_eq!(index.num_blocks(), 0);
    store(&mut index, 10..20).unwrap();
    assert_eq!(matched(&index, &prompt), [(R0, device(1))]);
    store(&mut index, 20..32).unwrap();
    store(&mut index, 32..47).unwrap();
    assert_eq!(matched(&index, &prompt), [(R0, device(2))]);
    store(&mut index, 47..48).unwrap();
    assert_eq!(matched(&index, &prompt), [(R0, device(3))]);
    // Pieces of 4 tokens behave the same.
    let mut index = new(BS);
    Event::new(&prompt, 4, 0..3, StorageTier::Device, 0)
        .apply(&mut index, R0)
        .unwrap();
    Event::new(&prompt, 4, 3..9, StorageTier::Device, 0)
        .apply(&mut index, R0)
        .unwrap();
    assert_eq!(matched(&index, &prompt), [(R0, device(2))]);
}

fn a_branch_inside_a_router_block_completes_a_sibling<I: KvIndexer>(new: fn(usize) -> I) {
    let mut index = new(BS);
    let a = tokens(0, 20);
    let b = [&a[..5], &tokens(700, 27)[..]].concat();
    Event::new(&a, 1, 0..20, StorageTier::Device, 0)
        .apply(&mut index, R0)
        .unwrap();
    Event::new(&b, 1, 5..32, StorageTier::Device, 0)
        .apply(&mut index, R0)
        .unwrap();
    assert_eq!(matched(&index, &a), [(R0, device(1))]);
    assert_eq!(matched(&index, &b), [(R0, device(2))]);
    assert_eq!(index.num_blocks(), 3);
    // The shared pieces belong to both first blocks.
    index.apply_removed(R0, StorageTier::Device, &engine_hashes(&a, 1, 0)[2..3]);
    assert!(matched(&index, &a).is_empty());
    assert!(matched(&index, &b).is_empty());
}

fn removing_a_piece_breaks_the_prefix_there<I: KvIndexer>(new: fn(usize) -> I) {
    let mut index = new(BS);
    let prompt = tokens(0, 3 * BS);
    let hashes = engine_hashes(&prompt, 1, 0);
    Event::new(&prompt, 1, 0..48, StorageTier::Device, 0)
        .apply(&mut index, R0)
        .unwrap();
    assert_eq!(matched(&index, &prompt), [(R0, device(3))]);
    index.apply_removed(R0, StorageTier::Device, &hashes[20..21]);
    assert_eq!(matched(&index, &prompt), [(R0, device(1))]);
    assert_eq!(index.num_blocks(), 2);
    index.apply_removed(R0, StorageTier::Device, &hashes[3..4]);
    assert!(matched(&index, &prompt).is_empty());
    // Extending the chain past a removed piece of a partial router block is an unknown parent.
    let short = tokens(0, 20);
    let mut index = new(BS);
    Event::new(&short, 1, 0..20, StorageTier::Device, 0)
        .apply(&mut index, R0)
        .unwrap();
    index.apply_removed(R0, StorageTier::Device, &hashes[17..18]);
    let next = Event::new(&prompt, 1, 20..21, StorageTier::Device, 0);
    assert_eq!(
        next.apply(&mut index, R0),
        Err(IndexError::UnknownParent(hashes[17]))
    );
}

/// Stores one engine block `hash` of one token (engine block size 1) under `parent`.
fn store_piece<I: KvIndexer>(
    index: &mut I,
    parent: Option<u64>,
    hash: u64,
    token: u32,
) -> Result<(), IndexError> {
    let event = StoredBlocks {
        parent: parent.map(EngineHash),
        engine_hashes: &[EngineHash(hash)],
        token_ids: &[token],
        block_size: 1,
        tier: StorageTier::Device,
        salt: 0,
    };
    index.apply_stored(R0, &event)
}

/// Router block 4, engine block 1: pieces 1, 2←1, 3←2; `restore` stores piece 2 again with
/// another mapping; then 4←3, which completes the router block the engine holds, [1, 2, 3, 4]
/// (3's record, unchanged, says so), whatever piece 2 has become since (fuzz finding K1).
fn complete_after_restoring_a_piece<I: KvIndexer>(
    new: fn(usize) -> I,
    restore: impl FnOnce(&mut I),
) -> I {
    let mut index = new(4);
    store_piece(&mut index, None, 1, 1).unwrap();
    store_piece(&mut index, Some(1), 2, 2).unwrap();
    store_piece(&mut index, Some(2), 3, 3).unwrap();
    restore(&mut index);
    assert_eq!(store_piece(&mut index, Some(3), 4, 4), Ok(()));
    index
}

fn a_piece_stored_again_as_a_root_keeps_its_childrens_partial_block<I: KvIndexer>(
    new: fn(usize) -> I,
) {
    let index = complete_after_restoring_a_piece(new, |index| {
        store_piece(index, None, 2, 2).unwrap();
    });
    let held = index
        .find_matches(&block_hashes(&[1, 2, 3, 4], 4, 0))
        .scores;
    assert_eq!(held, [(R0, device(1))]);
    assert_eq!(index.num_blocks(), 1);
}

fn a_piece_stored_again_under_another_parent_keeps_its_childrens_partial_block<I: KvIndexer>(
    new: fn(usize) -> I,
) {
    let mut index = complete_after_restoring_a_piece(new, |index| {
        store_piece(index, None, 9, 9).unwrap();
        store_piece(index, Some(9), 2, 7).unwrap();
    });
    let held = |index: &I, tokens: &[u32]| index.find_matches(&block_hashes(tokens, 4, 0)).scores;
    assert_eq!(held(&index, &[1, 2, 3, 4]), [(R0, device(1))]);
    assert!(held(&index, &[9, 7, 3, 4]).is_empty(), "a phantom prefix");
    assert_eq!(index.num_blocks(), 1);
    // The block was completed through piece 2's current record: removing it breaks it.
    index.apply_removed(R0, StorageTier::Device, &[EngineHash(2)]);
    assert!(held(&index, &[1, 2, 3, 4]).is_empty());
}

fn storing_again_is_idempotent<I: KvIndexer>(new: fn(usize) -> I) {
    for engine_bs in [1, 16, 32] {
        let mut index = new(BS);
        let prompt = tokens(0, 4 * BS);
        let hashes = engine_hashes(&prompt, engine_bs, 0);
        store_all(&mut index, 0, &prompt, engine_bs);
        store_all(&mut index, 0, &prompt, engine_bs);
        assert_eq!(matched(&index, &prompt), [(R0, device(4))]);
        let last = hashes.len() - 1;
        index.apply_removed(R0, StorageTier::Device, &hashes[last..]);
        let left = 4 - (engine_bs / BS).max(1) as u32;
        assert_eq!(
            matched(&index, &prompt),
            [(R0, device(left))],
            "engine {engine_bs}"
        );
    }
}

fn salt_separates_chains<I: KvIndexer>(new: fn(usize) -> I) {
    let mut index = new(BS);
    let prompt = tokens(0, 4 * BS);
    Event::new(&prompt, BS, 0..4, StorageTier::Device, 9)
        .apply(&mut index, R0)
        .unwrap();
    assert!(matched(&index, &prompt).is_empty());
    assert_eq!(
        index.find_matches(&router_hashes(&prompt, 9)).scores,
        [(R0, device(4))]
    );
}

fn num_blocks_counts_distinct_blocks<I: KvIndexer>(new: fn(usize) -> I) {
    let mut index = new(BS);
    let prompt = tokens(0, 6 * BS);
    store_all(&mut index, 0, &prompt, BS);
    store_all(&mut index, 1, &prompt[..4 * BS], BS);
    store_all(&mut index, 2, &prompt, 32);
    assert_eq!(index.num_blocks(), 6);
    index.clear_replica(R0);
    index.clear_replica(ReplicaId(2));
    assert_eq!(index.num_blocks(), 4);
}

fn memory_grows_with_blocks<I: KvIndexer>(new: fn(usize) -> I) {
    let mut index = new(BS);
    let empty = index.memory_bytes();
    store_all(&mut index, 0, &tokens(0, 1000 * BS), BS);
    let full = index.memory_bytes();
    assert!(full >= empty + 1000 * 24, "{empty} → {full}");
    assert!(full < 1000 * 1000, "{full}");
}

fn many_replicas<I: KvIndexer>(new: fn(usize) -> I) {
    let mut index = new(BS);
    let prompt = tokens(0, 12 * BS);
    for r in 0..150u32 {
        let blocks = (r % 11 + 1) as usize;
        store_all(&mut index, r * 3, &prompt[..blocks * BS], BS);
    }
    index.clear_replica(ReplicaId(3));
    store_all(&mut index, 1000, &prompt, BS);
    let scores = matched(&index, &prompt);
    let mut expected: Vec<_> = (0..150u32)
        .filter(|r| *r != 1)
        .map(|r| (ReplicaId(r * 3), device(r % 11 + 1)))
        .collect();
    expected.push((ReplicaId(1000), device(12)));
    assert_eq!(scores, expected);
    assert_eq!(index.num_blocks(), 12);
}

#[test]
fn backends_are_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<KvIndex>();
    assert_send_sync::<ReferenceIndex>();
    assert_send_sync::<ApproxIndex>();
    assert_send_sync::<ReferenceApprox>();
}
