//! The rules of `cache_aware`, one test each; every test fails if its rule changes.

use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::policy::test_support::{cands, ids, req};

fn policy(max_tree_size: usize) -> CacheAware {
    CacheAware::new(CacheAwareConfig {
        max_tree_size,
        ..CacheAwareConfig::default()
    })
}

fn choose(
    p: &CacheAware,
    c: &[Candidate<'_>],
    text: &str,
    now: Instant,
    rng: &mut SmallRng,
) -> usize {
    p.select(c, &req(None, text, now), rng)
        .expect("a candidate")
        .index
}

fn secs(t0: Instant, s: u64) -> Instant {
    t0 + Duration::from_secs(s)
}

#[test]
fn debug_names_every_parameter_for_the_startup_log() {
    assert_eq!(
        format!("{:?}", CacheAware::new(CacheAwareConfig::default())),
        "CacheAware { cache_threshold: 0.3, balance_abs_threshold: 64, \
         balance_rel_threshold: 1.5, eviction_interval_secs: 120, max_tree_size: 67108864 }"
    );
}

#[test]
fn imbalance_needs_both_the_absolute_and_the_relative_gap() {
    let ids = ids(2);
    let text = "x".repeat(100);
    let t0 = Instant::now();
    let mut rng = SmallRng::seed_from_u64(1);
    // Worker 0 holds the whole text: a balanced load sends the request there.
    for (loads, expected) in [
        ([65, 0], 1),    // 65 > 64 and 65 > 1.5 * 0: imbalanced
        ([64, 0], 0),    // 64 is not > 64
        ([202, 134], 1), // 68 > 64 and 202 > 201
        ([201, 134], 0), // 67 > 64 but 201 is not > 1.5 * 134
        ([300, 250], 0), // neither
    ] {
        let p = policy(1 << 20);
        p.insert(&ids[0], None, &text, t0);
        let got = choose(&p, &cands(&ids, &loads), &text, t0, &mut rng);
        assert_eq!(got, expected, "loads {loads:?}");
        // The text is inserted for the chosen worker either way.
        assert_eq!(p.tree_size(&ids[got], None), 100, "loads {loads:?}");
    }
}

#[test]
fn a_hit_needs_strictly_more_than_the_threshold() {
    let ids = ids(2);
    let t0 = Instant::now();
    let mut rng = SmallRng::seed_from_u64(2);
    // Worker 0 holds `k` characters of the 1000-character request; worker 1 holds nothing.
    for (k, expected) in [(299, 1), (300, 1), (301, 0), (700, 0)] {
        let p = policy(1 << 20);
        let held = format!("{}{}", "a".repeat(k), "b".repeat(1000 - k));
        let text = format!("{}{}", "a".repeat(k), "c".repeat(1000 - k));
        p.insert(&ids[0], None, &held, t0);
        assert_eq!(p.matched_chars(&cands(&ids, &[0, 0]), &text), k);
        let got = choose(&p, &cands(&ids, &[0, 0]), &text, t0, &mut rng);
        assert_eq!(got, expected, "{k} of 1000 matched");
    }
    // An empty text is a miss (0/0 is not above the threshold): the smallest tree.
    let p = policy(1 << 20);
    p.insert(&ids[0], None, "abc", t0);
    assert_eq!(choose(&p, &cands(&ids, &[0, 0]), "", t0, &mut rng), 1);
}

#[test]
fn a_miss_goes_to_the_smallest_tree_not_the_idlest_worker() {
    let ids = ids(3);
    let t0 = Instant::now();
    let mut rng = SmallRng::seed_from_u64(3);
    let p = policy(1 << 20);
    p.insert(&ids[0], None, &"a".repeat(300), t0);
    p.insert(&ids[1], None, &"b".repeat(100), t0);
    p.insert(&ids[2], None, &"c".repeat(200), t0);
    // Worker 1 is the busiest, yet has the smallest tree.
    assert_eq!(choose(&p, &cands(&ids, &[0, 5, 0]), "zzz", t0, &mut rng), 1);
    // Equal smallest trees: the less loaded of them, every time.
    for _ in 0..20 {
        let p = policy(1 << 20);
        p.insert(&ids[0], None, &"a".repeat(300), t0);
        p.insert(&ids[1], None, &"b".repeat(200), t0);
        p.insert(&ids[2], None, &"c".repeat(200), t0);
        assert_eq!(choose(&p, &cands(&ids, &[0, 3, 2]), "yyy", t0, &mut rng), 2);
    }
}

#[test]
fn equal_trees_and_loads_break_ties_at_random() {
    let ids = ids(3);
    let t0 = Instant::now();
    let mut rng = SmallRng::seed_from_u64(4);
    let mut seen = [0; 3];
    for _ in 0..90 {
        let p = policy(1 << 20);
        seen[choose(&p, &cands(&ids, &[0, 0, 0]), "hello", t0, &mut rng)] += 1;
    }
    assert!(seen.iter().all(|&n| n > 15), "{seen:?}");
}

#[test]
fn a_hit_held_by_several_goes_to_the_least_loaded_of_them() {
    let ids = ids(3);
    let t0 = Instant::now();
    let mut rng = SmallRng::seed_from_u64(5);
    let p = policy(1 << 20);
    let text = "the same long prompt";
    p.insert(&ids[0], None, text, t0);
    p.insert(&ids[1], None, text, t0);
    // Worker 2 is idle with an empty tree, but does not hold the prefix.
    for _ in 0..20 {
        assert_eq!(choose(&p, &cands(&ids, &[4, 3, 0]), text, t0, &mut rng), 1);
    }
    let mut seen = [0; 3];
    for _ in 0..60 {
        seen[choose(&p, &cands(&ids, &[1, 1, 0]), text, t0, &mut rng)] += 1;
    }
    assert_eq!(seen[2], 0);
    assert!(seen[0] > 10 && seen[1] > 10, "{seen:?}");
}

#[test]
fn only_candidates_count_as_matches() {
    let ids = ids(2);
    let t0 = Instant::now();
    let mut rng = SmallRng::seed_from_u64(6);
    let p = policy(1 << 20);
    p.insert(&ids[0], None, "prefix held by worker 0 only", t0);
    let only1 = cands(&ids[1..], &[0]);
    assert_eq!(p.matched_chars(&only1, "prefix held by worker 0 only"), 0);
    assert_eq!(
        choose(&p, &only1, "prefix held by worker 0 only", t0, &mut rng),
        0
    );
}

#[test]
fn a_shared_prefix_sticks_to_one_tenant_and_unrelated_prompts_spread() {
    let system = "You are a careful assistant. Answer briefly, cite sources, and say so \
                  when you do not know. "
        .repeat(6);
    assert!((480..=560).contains(&system.chars().count()));
    let t0 = Instant::now();
    let mut rng = SmallRng::seed_from_u64(7);
    for n in [2, 4] {
        let ids = ids(n);
        let p = policy(1 << 20);
        let mut seen = vec![0; n];
        for i in 0..120 {
            let text = format!("{system}Question {i}: what is {i} times {}?", i + 7);
            seen[choose(&p, &cands(&ids, &vec![0; n]), &text, secs(t0, i), &mut rng)] += 1;
        }
        assert_eq!(seen.iter().filter(|&&k| k > 0).count(), 1, "{seen:?}");
    }
    let ids = ids(4);
    let p = policy(1 << 20);
    let mut seen = [0; 4];
    for i in 0..40 {
        let text: String = (0..500).map(|_| rng.random_range('a'..='z')).collect();
        seen[choose(&p, &cands(&ids, &[0; 4]), &text, secs(t0, i), &mut rng)] += 1;
    }
    assert!(seen.iter().all(|&k| (9..=11).contains(&k)), "{seen:?}");
}

#[test]
fn interleaved_prefix_groups_each_stick_to_their_own_tenant() {
    let ids = ids(4);
    let t0 = Instant::now();
    let mut rng = SmallRng::seed_from_u64(8);
    let p = policy(1 << 20);
    let groups =
        ["Summarise the contract below. ", "Translate into French: "].map(|g| g.repeat(20));
    let mut chosen: [Vec<usize>; 2] = Default::default();
    for i in 0..60 {
        let g = i % 2;
        let text = format!("{}request {i}", groups[g]);
        chosen[g].push(choose(
            &p,
            &cands(&ids, &[0; 4]),
            &text,
            secs(t0, i as u64),
            &mut rng,
        ));
    }
    for c in &chosen {
        assert!(c.iter().all(|&w| w == c[0]), "{c:?}");
    }
    assert_ne!(chosen[0][0], chosen[1][0]);
}

#[test]
fn maintain_evicts_least_recently_used_leaves_once_per_interval() {
    let ids = ids(2);
    let t0 = Instant::now();
    let p = policy(20);
    let [a, b, c] = ["a", "b", "c"].map(|s| s.repeat(10));
    p.insert(&ids[0], None, &a, t0);
    p.insert(&ids[0], None, &b, secs(t0, 1));
    p.insert(&ids[0], None, &c, secs(t0, 2));
    p.insert(&ids[0], None, &a, secs(t0, 3)); // `a` is used again: `b` is now the oldest
    p.insert(&ids[1], None, &"e".repeat(20), t0);
    p.maintain(secs(t0, 119));
    assert_eq!(
        p.tree_size(&ids[0], None),
        30,
        "before the interval, nothing"
    );
    p.maintain(secs(t0, 120));
    assert_eq!(p.tree_size(&ids[0], None), 20);
    assert_eq!(
        p.tree_size(&ids[1], None),
        20,
        "a tree within the bound is kept"
    );
    let w0 = cands(&ids[..1], &[0]);
    assert_eq!(p.matched_chars(&w0, &a), 10);
    assert_eq!(
        p.matched_chars(&w0, &b),
        0,
        "the least recently used leaf went first"
    );
    assert_eq!(p.matched_chars(&w0, &c), 10);
    // The clock restarted at 120 s: the next eviction is due at 240 s.
    p.insert(&ids[0], None, &"d".repeat(10), secs(t0, 130));
    p.maintain(secs(t0, 200));
    assert_eq!(p.tree_size(&ids[0], None), 30);
    p.maintain(secs(t0, 240));
    assert_eq!(p.tree_size(&ids[0], None), 20);
    assert_eq!(
        p.matched_chars(&w0, &c),
        0,
        "`c` (2 s) was older than `a` (3 s)"
    );
    assert_eq!(p.total_chars(), 20 + 20);
}

#[test]
fn eviction_keeps_a_shared_prefix_while_a_newer_leaf_holds_it() {
    let ids = ids(1);
    let t0 = Instant::now();
    let p = policy(10);
    p.insert(&ids[0], None, "zzzzz-old", t0);
    p.insert(&ids[0], None, "zzzzz-new", secs(t0, 1));
    assert_eq!(p.tree_size(&ids[0], None), 12);
    p.maintain(t0);
    p.maintain(secs(t0, 120));
    assert_eq!(p.tree_size(&ids[0], None), 9);
    let w0 = cands(&ids, &[0]);
    assert_eq!(p.matched_chars(&w0, "zzzzz-new"), 9);
    assert_eq!(p.matched_chars(&w0, "zzzzz-old"), 6);
}

#[test]
fn without_maintain_inserts_keep_each_tree_within_twice_the_bound() {
    let ids = ids(2);
    let t0 = Instant::now();
    let mut rng = SmallRng::seed_from_u64(9);
    let p = policy(1000);
    let mut peak = 0;
    for i in 0..20_000u64 {
        let text: String = (0..40).map(|_| rng.random_range('a'..='z')).collect();
        let w = choose(
            &p,
            &cands(&ids, &[0, 0]),
            &text,
            t0 + Duration::from_millis(i),
            &mut rng,
        );
        assert!(p.tree_size(&ids[w], None) <= 2000);
        if i == 2000 {
            peak = p.memory_bytes();
        }
    }
    assert!(p.total_chars() <= 4000);
    assert!(
        p.memory_bytes() <= peak * 5 / 4,
        "{} > {peak}",
        p.memory_bytes()
    );
}

#[test]
fn forget_worker_drops_all_its_ranks() {
    let ids = ids(2);
    let t0 = Instant::now();
    let mut rng = SmallRng::seed_from_u64(10);
    let p = policy(1 << 20);
    let prompt = "a prompt served by both ranks of worker 0";
    p.insert(&ids[0], Some(0), prompt, t0);
    p.insert(&ids[0], Some(1), &format!("{prompt}, and more"), t0);
    p.insert(&ids[1], None, "something else", t0);
    assert_eq!(p.tree_size(&ids[0], Some(1)), prompt.len() + 10);
    p.forget_worker(&ids[0]);
    assert_eq!(p.tree_size(&ids[0], Some(0)), 0);
    assert_eq!(p.tree_size(&ids[0], Some(1)), 0);
    assert_eq!(p.tree_size(&ids[1], None), 14);
    assert_eq!(p.total_chars(), 14);
    let mut c = cands(&ids, &[0, 0]);
    c[0].dp_rank = Some(1);
    assert_eq!(p.matched_chars(&c, prompt), 0);
    // A miss again: the forgotten rank has the smallest tree; its index is reused cleanly.
    assert_eq!(choose(&p, &c, prompt, t0, &mut rng), 0);
    assert_eq!(p.tree_size(&ids[0], Some(1)), prompt.len());
    assert_eq!(p.tree_size(&ids[0], Some(0)), 0);
}

#[test]
fn ranks_of_one_worker_are_distinct_tenants() {
    let ids = ids(1);
    let t0 = Instant::now();
    let mut rng = SmallRng::seed_from_u64(11);
    let p = policy(1 << 20);
    let same = [ids[0].clone(), ids[0].clone()];
    let mut c = cands(&same, &[0, 0]);
    c[0].dp_rank = Some(0);
    c[1].dp_rank = Some(1);
    p.insert(&ids[0], Some(1), "rank one's prompt", t0);
    assert_eq!(choose(&p, &c, "rank one's prompt again", t0, &mut rng), 1);
    assert_eq!(choose(&p, &c, "an unrelated prompt", t0, &mut rng), 0);
}

#[test]
fn a_dry_run_inserts_nothing() {
    let ids = crate::policy::test_support::ids(2);
    let p = CacheAware::new(CacheAwareConfig::default());
    let c = crate::policy::test_support::cands(&ids, &[0, 0]);
    let mut rng = <rand::rngs::SmallRng as rand::SeedableRng>::seed_from_u64(3);
    let mut r =
        crate::policy::test_support::req(None, "a prompt to remember", std::time::Instant::now());
    r.dry_run = true;
    p.select(&c, &r, &mut rng).unwrap();
    assert_eq!(p.total_chars(), 0);
    r.dry_run = false;
    p.select(&c, &r, &mut rng).unwrap();
    assert_eq!(p.total_chars(), 20);
}
