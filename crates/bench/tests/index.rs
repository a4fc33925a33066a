//! `kvroute-bench index`: a replay file is read through the router's KV-event decoder and
//! applied to the index, and the queries drawn from it match what the file says.

use kvroute_bench::index::{events, new_index, queries, replay_into, write_synthetic};
use kvroute_index::reference::ReferenceIndex;
use kvroute_index::{block_hashes, KvIndex, KvIndexer, ReplicaId, TierCounts};

fn device(blocks: u32) -> TierCounts {
    TierCounts {
        device: blocks,
        ..TierCounts::default()
    }
}

/// Worker 7 stores blocks A, B, C; worker 9 (rank 1) stores A and B, in the map form, then
/// removes B in the positional form.
const FILE: &str = r#"
{"worker": 7, "dp_rank": 0, "events": [["BlockStored", [101, 102], null, [0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31], 16, null, null]]}
{"worker": 9, "dp_rank": 1, "events": [{"type": "BlockStored", "block_hashes": [201, 202], "parent_block_hash": null, "token_ids": [0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31], "block_size": 16}]}
{"worker": 7, "dp_rank": 0, "events": [["BlockStored", [103], 102, [32,33,34,35,36,37,38,39,40,41,42,43,44,45,46,47], 16, null, null]]}
{"worker": 9, "dp_rank": 1, "events": [["BlockRemoved", [202], null]]}
"#;

#[test]
fn a_small_file_gives_the_matches_it_describes() {
    let replay = events::read(FILE.as_bytes()).unwrap();
    assert_eq!(replay.replicas, vec![(7, 0), (9, 1)]);
    assert_eq!(replay.ops.len(), 4);
    assert_eq!(replay.lines, vec![0..1, 1..2, 2..3, 3..4]);
    assert_eq!(replay.block_events, 2 + 2 + 1 + 1);
    let mut index = KvIndex::new(16);
    assert_eq!(replay_into(&mut index, &replay), 0);
    let tokens: Vec<u32> = (0..48).collect();
    let scores = index.find_matches(&block_hashes(&tokens, 16, 0));
    assert_eq!(
        scores.scores,
        vec![(ReplicaId(0), device(3)), (ReplicaId(1), device(1))]
    );
    // The queries drawn from it: each stored event's whole prefix, padded with new tokens.
    let drawn = queries::derive(&replay, 16, 8, 1);
    assert_eq!(
        drawn.hit_source,
        vec![(ReplicaId(0), 32), (ReplicaId(1), 32), (ReplicaId(0), 48)]
    );
    assert_eq!(drawn.hit_tokens[2][..48], tokens[..]);
    assert_eq!(drawn.hit[2].len(), queries::QUERY_BLOCKS);
    assert_eq!(
        index.find_matches(&drawn.hit[2]).get(ReplicaId(0)),
        device(3)
    );
    assert_eq!(
        index.find_matches(&drawn.hit[1]).get(ReplicaId(1)),
        device(1)
    );
    assert_eq!(drawn.miss.len(), 8);
    assert!(drawn
        .miss
        .iter()
        .all(|q| index.find_matches(q).scores.is_empty()));
}

#[test]
fn a_bound_evicts_the_least_recently_stored_as_the_router_does() {
    // Bounded at 2 engine blocks: worker 9's store evicts worker 7's two blocks, so worker 7's
    // third block, whose parent went, is refused; worker 9 then removes B and keeps A.
    let replay = events::read(FILE.as_bytes()).unwrap();
    let mut index = new_index(16, Some(2));
    assert_eq!(replay_into(&mut index, &replay), 1);
    assert_eq!(index.evicted_blocks(), 2);
    assert_eq!(index.num_engine_blocks(), 1);
    let tokens: Vec<u32> = (0..48).collect();
    let scores = index.find_matches(&block_hashes(&tokens, 16, 0));
    assert_eq!(scores.scores, vec![(ReplicaId(1), device(1))]);
    // Unbounded, nothing goes.
    let mut index = new_index(16, None);
    assert_eq!(replay_into(&mut index, &replay), 0);
    assert_eq!(index.evicted_blocks(), 0);
}

#[test]
fn a_bound_outside_the_index_s_range_is_refused_by_name() {
    for bound in ["0", "134217729", "lots"] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute-bench"))
            .args(["index", "no-such-file.jsonl", "--max-indexed-blocks", bound])
            .output()
            .expect("the binary runs");
        assert!(!out.status.success(), "{bound} accepted");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("--max-indexed-blocks") && stderr.contains("from 1 to 134217728"),
            "{bound}: {stderr}"
        );
    }
}

#[test]
fn the_synthetic_file_replays_as_the_reference_model_says() {
    let path = std::env::temp_dir().join(format!("kvroute-index-{}.jsonl", std::process::id()));
    let lines = write_synthetic(&path, 1, 3, false).unwrap();
    let replay = events::read(std::io::BufReader::new(std::fs::File::open(&path).unwrap()));
    std::fs::remove_file(&path).unwrap();
    let replay = replay.unwrap();
    assert_eq!(replay.ops.len(), lines);
    assert_eq!(replay.replicas.len(), 64);
    let (mut index, mut reference) = (KvIndex::new(16), ReferenceIndex::new(16));
    assert_eq!(replay_into(&mut index, &replay), 0);
    assert_eq!(replay_into(&mut reference, &replay), 0);
    assert_eq!(index.num_blocks(), reference.num_blocks());
    let drawn = queries::derive(&replay, 16, 64, 5);
    assert_eq!(drawn.hit.len(), 64);
    let mut whole = 0;
    for (query, (replica, tokens)) in drawn.hit.iter().zip(&drawn.hit_source) {
        let scores = index.find_matches(query);
        assert_eq!(scores, reference.find_matches(query));
        // Churn removes the conversations it stores, down to their system prompt.
        let held = scores.get(*replica).total() as usize;
        assert!(held > 0 && held * 16 <= *tokens);
        whole += usize::from(held * 16 == *tokens);
    }
    assert!(whole > 0, "some queries match their whole prefix");
    assert!(drawn
        .miss
        .iter()
        .all(|q| index.find_matches(q).scores.is_empty()));
}

/// The synthetic file written at `seed`, as vLLM publishes its events or one event a line.
fn synthetic(vllm_batches: bool) -> (usize, events::Replay) {
    let path = std::env::temp_dir().join(format!(
        "kvroute-index-{}-{vllm_batches}.jsonl",
        std::process::id()
    ));
    let lines = write_synthetic(&path, 1, 3, vllm_batches).unwrap();
    let replay = events::read(std::io::BufReader::new(std::fs::File::open(&path).unwrap()));
    std::fs::remove_file(&path).unwrap();
    (lines, replay.unwrap())
}

#[test]
fn a_vllm_shaped_file_batches_a_chain_and_removes_a_block_an_event() {
    let (plain_lines, plain) = synthetic(false);
    let (lines, vllm) = synthetic(true);
    assert_eq!(vllm.lines.len(), lines);
    assert!(
        lines < plain_lines,
        "{lines} lines, {plain_lines} one event each"
    );
    assert_eq!(vllm.block_events, plain.block_events);
    // Each line is one replica's; the removals name one block each.
    for line in &vllm.lines {
        let ops = &vllm.ops[line.clone()];
        assert!(ops.iter().all(|op| op.replica() == ops[0].replica()));
    }
    let removals = vllm.ops.iter().filter_map(|op| match op {
        events::Op::Removed { hashes, .. } => Some(hashes.len()),
        _ => None,
    });
    assert!(removals.clone().count() > 0 && removals.into_iter().all(|n| n == 1));
    assert!(vllm.lines.iter().any(|l| l.len() > 1));
    // The same index either way.
    let (mut a, mut b) = (KvIndex::new(16), KvIndex::new(16));
    assert_eq!(replay_into(&mut a, &plain), 0);
    assert_eq!(replay_into(&mut b, &vllm), 0);
    assert_eq!(a.num_blocks(), b.num_blocks());
    let drawn = queries::derive(&plain, 16, 64, 5);
    for query in drawn.hit.iter().chain(&drawn.miss) {
        assert_eq!(a.find_matches(query), b.find_matches(query));
    }
}
