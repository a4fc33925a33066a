use std::time::Instant;

use kvroute_protocol::WorkerId;
use rand::rngs::SmallRng;
use rand::SeedableRng;

use super::*;
use crate::policy::test_support::ids;

fn engine(waiting: Option<f64>, kv_usage: Option<f64>) -> EngineLoad {
    EngineLoad {
        waiting,
        running: None,
        kv_usage,
        num_gpu_blocks: None,
    }
}

fn cand(worker: &WorkerId, engine: EngineLoad) -> Candidate<'_> {
    Candidate {
        engine,
        ..Candidate::new(worker, 0)
    }
}

/// Candidates with the same (known, equal) load, so only the prefix scorer tells them apart.
fn idle(ids: &[WorkerId]) -> Vec<Candidate<'_>> {
    ids.iter()
        .map(|w| cand(w, engine(Some(0.0), Some(0.0))))
        .collect()
}

fn req(tokens: &[u32]) -> RouteRequest<'_> {
    RouteRequest {
        tokens,
        prompt_tokens: tokens.len(),
        ..RouteRequest::simple(None, "", Instant::now())
    }
}

fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32).map(|i| i.wrapping_mul(31) ^ seed).collect()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-12
}

#[test]
fn debug_names_the_weights_and_the_effective_block_size() {
    let p = LlmD::new(LlmDConfig::default());
    assert_eq!(
        format!("{p:?}"),
        "LlmD { prefix_weight: 3.0, queue_weight: 2.0, kv_weight: 2.0, lora_weight: 0.0, block_size: 64, prefix: Approximate }"
    );
    let small = LlmD::new(LlmDConfig {
        block_size: 16,
        ..LlmDConfig::default()
    });
    assert!(format!("{small:?}").ends_with("block_size: 64, prefix: Approximate }"));
}

#[test]
fn queue_scorer_is_min_max_normalised() {
    let ids = ids(4);
    let c: Vec<_> = [Some(2.0), Some(10.0), Some(6.0), None]
        .into_iter()
        .zip(&ids)
        .map(|(q, w)| cand(w, engine(q, None)))
        .collect();
    let s = queue_scores(&c);
    assert!(
        close(s[0], 1.0) && close(s[1], 0.0) && close(s[2], 0.5),
        "{s:?}"
    );
    assert!(close(s[3], 0.5), "unknown is neutral: {s:?}");
    // All known values equal: 1 for each, whatever the value; unknown stays 0.5.
    let c: Vec<_> = [Some(7.0), Some(7.0), None]
        .into_iter()
        .zip(&ids)
        .map(|(q, w)| cand(w, engine(q, None)))
        .collect();
    assert_eq!(queue_scores(&c), [1.0, 1.0, 0.5]);
    // Unknown candidates are left out of min/max: one known value scores 1.
    let c = vec![
        cand(&ids[0], engine(None, None)),
        cand(&ids[1], engine(Some(40.0), None)),
    ];
    assert_eq!(queue_scores(&c), [0.5, 1.0]);
    let c = vec![cand(&ids[0], engine(Some(f64::NAN), None))];
    assert_eq!(queue_scores(&c), [0.5]);
    assert!(queue_scores(&[]).is_empty());
}

#[test]
fn kv_scorer_is_one_minus_usage() {
    assert!(close(kv_score(&engine(None, Some(0.25))), 0.75));
    assert_eq!(kv_score(&engine(None, Some(0.0))), 1.0);
    assert_eq!(kv_score(&engine(None, Some(1.0))), 0.0);
    assert_eq!(kv_score(&engine(None, None)), 0.5);
    assert_eq!(kv_score(&engine(None, Some(f64::NAN))), 0.5);
    assert_eq!(kv_score(&engine(None, Some(1.5))), 0.0, "clamped to [0, 1]");
}

#[test]
fn blocks_are_full_chained_and_capped() {
    assert!(block_hashes(&prompt(63, 0), 64).is_empty());
    let a = block_hashes(&prompt(64 * 3 + 10, 0), 64);
    assert_eq!(a.len(), 3, "the partial block is ignored");
    // Chained: the same block content after a different prefix hashes differently.
    let mut other = prompt(64 * 3, 0);
    other[0] ^= 1;
    let b = block_hashes(&other, 64);
    assert_ne!(a[0], b[0]);
    assert_ne!(a[2], b[2]);
    // A prompt sharing the first two blocks shares their hashes only.
    let mut tail = prompt(64 * 3, 0);
    tail[64 * 2] ^= 1;
    let c = block_hashes(&tail, 64);
    assert_eq!(a[..2], c[..2]);
    assert_ne!(a[2], c[2]);
    // Pinned: h_0 = stable_hash(0u64 LE ++ tokens LE).
    let tokens: Vec<u32> = (0..64).collect();
    let mut bytes = 0u64.to_le_bytes().to_vec();
    tokens.iter().for_each(|t| bytes.extend(t.to_le_bytes()));
    assert_eq!(block_hashes(&tokens, 64), [stable_hash(&bytes)]);
    assert_eq!(
        block_hashes(&prompt(64 * 300, 0), 64).len(),
        MAX_PREFIX_BLOCKS
    );
}

#[test]
fn prefix_scorer_learns_from_its_own_decisions() {
    let ids = ids(3);
    let c = idle(&ids);
    let p = LlmD::new(LlmDConfig::default());
    let mut rng = SmallRng::seed_from_u64(1);
    let tokens = prompt(64 * 4 + 5, 9);
    let r = req(&tokens);
    assert!(p.scores(&c, &r).iter().all(|s| s.0 == 0.0));
    let first = p.select(&c, &r, &mut rng).unwrap().index;
    assert_eq!(p.cached_blocks(&ids[first], None), 4);
    let scores = p.scores(&c, &r);
    for (i, s) in scores.iter().enumerate() {
        assert_eq!(s.0, if i == first { 1.0 } else { 0.0 }, "{scores:?}");
    }
    for _ in 0..20 {
        assert_eq!(p.select(&c, &r, &mut rng).unwrap().index, first);
    }
    // Half the prompt shared, then a different half: half the blocks found.
    let mut half = tokens.clone();
    half[64 * 2 + 3] ^= 7;
    assert!(close(p.scores(&c, &req(&half))[first].0, 0.5));
    // A miss in the first block means nothing counts, even if later blocks are held.
    let mut head = tokens.clone();
    head[0] ^= 7;
    assert_eq!(p.scores(&c, &req(&head))[first].0, 0.0);
    // Prompts with no full block score 0 everywhere and record nothing.
    let short = prompt(40, 9);
    assert!(p.scores(&c, &req(&short)).iter().all(|s| s.0 == 0.0));
}

#[test]
fn leading_blocks_count_until_the_first_miss() {
    let ids = ids(1);
    let c = idle(&ids);
    let p = LlmD::new(LlmDConfig::default());
    let mut rng = SmallRng::seed_from_u64(1);
    let short = prompt(64, 3);
    p.select(&c, &req(&short), &mut rng);
    let long = [short.clone(), prompt(64 * 3, 4)].concat();
    assert!(close(p.scores(&c, &req(&long))[0].0, 0.25));
}

#[test]
fn ranks_of_a_worker_have_their_own_caches_and_forget_drops_them() {
    let ids = ids(1);
    let mut r0 = cand(&ids[0], engine(Some(0.0), Some(0.0)));
    r0.dp_rank = Some(0);
    let r1 = Candidate {
        dp_rank: Some(1),
        ..r0
    };
    let p = LlmD::new(LlmDConfig::default());
    let mut rng = SmallRng::seed_from_u64(2);
    let tokens = prompt(128, 1);
    let chosen = p.select(&[r0, r1], &req(&tokens), &mut rng).unwrap().index;
    let s = p.scores(&[r0, r1], &req(&tokens));
    assert_eq!(s[chosen].0, 1.0);
    assert_eq!(s[1 - chosen].0, 0.0);
    p.forget_worker(&ids[0]);
    assert_eq!(p.cached_blocks(&ids[0], Some(chosen as u32)), 0);
    assert!(p
        .scores(&[r0, r1], &req(&tokens))
        .iter()
        .all(|s| s.0 == 0.0));
}

#[test]
fn the_weighted_sum_picks_the_best_candidate() {
    let ids = ids(3);
    let p = LlmD::new(LlmDConfig::default());
    let mut rng = SmallRng::seed_from_u64(3);
    let tokens = prompt(64 * 2, 5);
    // Seed the prefix cache of candidate 0 (the only candidate then).
    p.select(&idle(&ids[..1]), &req(&tokens), &mut rng);
    // 0 holds the prefix (3 * 1) but is the most loaded (queue 0, kv 1 - 0.9): 3.2.
    // 1: empty queue, kv 0.5 used: 0 + 2 + 1 = 3.0. 2: mid queue, idle kv: 0 + 1 + 2 = 3.0.
    let c = vec![
        cand(&ids[0], engine(Some(8.0), Some(0.9))),
        cand(&ids[1], engine(Some(0.0), Some(0.5))),
        cand(&ids[2], engine(Some(4.0), Some(0.0))),
    ];
    let costs = p.costs(&c, &req(&tokens)).unwrap();
    assert!(close(costs[0], -3.2) && close(costs[1], -3.0) && close(costs[2], -3.0));
    for _ in 0..20 {
        assert_eq!(p.select(&c, &req(&tokens), &mut rng).unwrap().index, 0);
    }
    // A heavier queue weight flips the choice to the emptiest queue.
    let q = LlmD::new(LlmDConfig {
        queue_weight: 5.0,
        ..LlmDConfig::default()
    });
    q.select(&idle(&ids[..1]), &req(&tokens), &mut rng);
    assert_eq!(q.select(&c, &req(&tokens), &mut rng).unwrap().index, 1);
    // Without the prefix, unknown metrics are neutral: known-idle beats unknown.
    let c = vec![
        cand(&ids[0], engine(None, None)),
        cand(&ids[1], engine(Some(0.0), Some(0.0))),
    ];
    let other = prompt(64, 77);
    let s = p.scores(&c, &req(&other));
    assert_eq!(s, [(0.0, 0.5, 0.5), (0.0, 1.0, 1.0)]);
    assert_eq!(p.select(&c, &req(&other), &mut rng).unwrap().index, 1);
}

#[test]
fn ties_are_broken_at_random() {
    let ids = ids(3);
    let p = LlmD::new(LlmDConfig::default());
    let mut rng = SmallRng::seed_from_u64(4);
    let c: Vec<_> = ids
        .iter()
        .map(|w| cand(w, engine(Some(1.0), Some(0.3))))
        .collect();
    let mut seen = [0; 3];
    for i in 0..300 {
        // Untokenised and distinct prompts: nothing but the (equal) load terms.
        let tokens = prompt(if i % 2 == 0 { 0 } else { 64 }, 1000 + i);
        seen[p.select(&c, &req(&tokens), &mut rng).unwrap().index] += 1;
    }
    assert!(seen.iter().all(|&n| n > 60), "{seen:?}");
    assert!(p.select(&[], &req(&[]), &mut rng).is_none());
}

#[test]
fn nan_totals_never_win() {
    let mut rng = SmallRng::seed_from_u64(5);
    assert_eq!(
        best([f64::NAN, 1.0, f64::NAN].into_iter(), &mut rng),
        Some(1)
    );
    assert_eq!(best([f64::NAN].into_iter(), &mut rng), Some(0));
    assert_eq!(best(std::iter::empty(), &mut rng), None);
}

#[test]
fn lru_capacity_follows_the_engine_and_evicts_the_least_recent() {
    assert_eq!(lru_capacity(None, 64), DEFAULT_LRU_CAPACITY);
    assert_eq!(lru_capacity(Some(0), 64), DEFAULT_LRU_CAPACITY);
    assert_eq!(lru_capacity(Some(16_384), 64), 4096);
    assert_eq!(lru_capacity(Some(16_384), 128), 2048);
    assert_eq!(lru_capacity(Some(1), 64), 1);
    assert_eq!(lru_capacity(Some(u64::MAX), 64), 1 << 24);

    // An engine with 16 blocks of 16 tokens holds 4 policy blocks of 64.
    let ids = ids(1);
    let mut c = cand(&ids[0], engine(Some(0.0), Some(0.0)));
    c.engine.num_gpu_blocks = Some(16);
    let p = LlmD::new(LlmDConfig::default());
    let mut rng = SmallRng::seed_from_u64(6);
    let a = prompt(64 * 2, 1);
    let b = prompt(64 * 2, 2);
    let d = prompt(64 * 2, 3);
    p.select(&[c], &req(&a), &mut rng);
    p.select(&[c], &req(&b), &mut rng);
    assert_eq!(p.cached_blocks(&ids[0], None), 4);
    // `a` is used again (refreshed), so `b` is the least recent and goes when `d` comes.
    p.select(&[c], &req(&a), &mut rng);
    p.select(&[c], &req(&d), &mut rng);
    assert_eq!(p.cached_blocks(&ids[0], None), 4);
    assert_eq!(p.scores(&[c], &req(&a))[0].0, 1.0);
    assert_eq!(p.scores(&[c], &req(&b))[0].0, 0.0);
    assert_eq!(p.scores(&[c], &req(&d))[0].0, 1.0);
    // A long prompt overflowing the cache keeps its leading blocks (the tail goes first).
    let long = prompt(64 * 6, 4);
    p.select(&[c], &req(&long), &mut rng);
    assert!(close(p.scores(&[c], &req(&long))[0].0, 4.0 / 6.0));
    // The engine shrinks: the LRU follows at the next record.
    c.engine.num_gpu_blocks = Some(8);
    p.select(&[c], &req(&a), &mut rng);
    assert_eq!(p.cached_blocks(&ids[0], None), 2);
}

#[test]
fn the_exact_prefix_reads_the_kv_index_and_records_nothing() {
    let ws = ids(3);
    let p = LlmD::new(LlmDConfig {
        prefix: PrefixSource::Exact { block_size: 16 },
        ..LlmDConfig::default()
    });
    assert!(p.reads_kv_index());
    assert!(!LlmD::new(LlmDConfig::default()).reads_kv_index());
    let tokens = prompt(160, 7); // 10 blocks of 16
    let mut cands = idle(&ws);
    cands[1].kv.overlap.device = 4;
    cands[2].kv.overlap.device = 25; // more than the prompt: capped at 1
    let scores: Vec<f64> = p
        .scores(&cands, &req(&tokens))
        .iter()
        .map(|s| s.0)
        .collect();
    assert!(
        close(scores[0], 0.0) && close(scores[1], 0.4) && close(scores[2], 1.0),
        "{scores:?}"
    );
    let mut rng = SmallRng::seed_from_u64(1);
    let d = p.select(&cands, &req(&tokens), &mut rng).unwrap();
    assert_eq!(d.index, 2);
    // Nothing recorded: a second look without the index's credit sees no prefix.
    assert_eq!(p.cached_blocks(&ws[2], None), 0);
    let short = prompt(10, 7);
    let scores = p.scores(&cands, &req(&short));
    assert!(
        scores.iter().all(|s| close(s.0, 0.0)),
        "no full block: no prefix"
    );
}

#[test]
fn the_lora_affinity_scorer_is_optional_and_weighted() {
    use crate::AdapterFit;
    let ids: Vec<WorkerId> = (0..3).map(|i| WorkerId::new(format!("w{i}"))).collect();
    let fits = [AdapterFit::Full, AdapterFit::Waiting, AdapterFit::Running];
    let c: Vec<Candidate<'_>> = idle(&ids)
        .into_iter()
        .zip(fits)
        .map(|(c, adapter)| Candidate { adapter, ..c })
        .collect();
    let tokens = prompt(8, 1);
    // Off by default: the three tie.
    let off = LlmD::new(LlmDConfig::default());
    let costs = off.costs(&c, &req(&tokens)).unwrap();
    assert!(
        close(costs[0], costs[1]) && close(costs[1], costs[2]),
        "{costs:?}"
    );
    let on = LlmD::new(LlmDConfig {
        lora_weight: 2.0,
        ..LlmDConfig::default()
    });
    let costs = on.costs(&c, &req(&tokens)).unwrap();
    assert!(
        close(costs[0] - costs[1], 1.2) && close(costs[1] - costs[2], 0.8),
        "{costs:?}"
    );
    let mut rng = SmallRng::seed_from_u64(0);
    assert_eq!(on.select(&c, &req(&tokens), &mut rng).unwrap().index, 2);
}
