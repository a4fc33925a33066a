//! A policy's snapshot replayed into a fresh instance rebuilds it: the new instance's
//! snapshot is the same, and it makes the same choices.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvroute_protocol::WorkerId;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::policy::test_support::ids;
use crate::{EngineLoad, RouteRequest};

/// Builds a fresh policy.
type Make = fn() -> Box<dyn Policy>;

fn policies() -> Vec<(&'static str, Make)> {
    vec![
        ("cache_aware", || {
            Box::new(CacheAware::new(CacheAwareConfig::default()))
        }),
        ("llm_d", || Box::new(LlmD::new(LlmDConfig::default()))),
        ("manual", || {
            Box::new(Manual::new(
                Duration::from_secs(3600),
                1000,
                AssignmentMode::MinLoad,
            ))
        }),
    ]
}

/// Two ranks on each of four workers, every load known and small.
fn candidates<'a>(ids: &'a [WorkerId], rng: &mut SmallRng) -> Vec<Candidate<'a>> {
    ids.iter()
        .flat_map(|w| (0..2).map(move |r| (w, r)))
        .map(|(w, r)| Candidate {
            dp_rank: Some(r),
            engine: EngineLoad {
                waiting: Some(0.0),
                running: None,
                kv_usage: Some(0.0),
                num_gpu_blocks: None,
            },
            ..Candidate::new(w, 0)
        })
        .map(|mut c| {
            c.in_flight = rng.random_range(0..4);
            c
        })
        .collect()
}

/// A prompt on one of five shared prefixes, with a session key among twenty.
fn prompt(rng: &mut SmallRng) -> (String, Vec<u32>, String) {
    let base = rng.random_range(0..5u32);
    let tail = rng.random_range(0..1000u32);
    let text = format!("{}{}", format!("system prompt {base} ").repeat(40), tail);
    let mut tokens: Vec<u32> = (0..300).map(|i| base * 7919 + i).collect();
    tokens.extend((0..rng.random_range(0..200)).map(|i| tail * 31 + i));
    (text, tokens, format!("session-{}", rng.random_range(0..20)))
}

fn request<'a>(p: &'a (String, Vec<u32>, String), now: Instant, dry: bool) -> RouteRequest<'a> {
    RouteRequest {
        tokens: &p.1,
        prompt_tokens: p.1.len(),
        dry_run: dry,
        ..RouteRequest::simple(Some(&p.2), &p.0, now)
    }
}

/// A snapshot by (worker, rank), in order for LRUs, sorted otherwise (equal ages may come
/// in any order).
fn canonical(obs: &[Observation]) -> BTreeMap<(String, Option<u32>), Vec<String>> {
    let mut m: BTreeMap<_, Vec<String>> = BTreeMap::new();
    for o in obs {
        m.entry((o.worker.as_str().to_owned(), o.dp_rank))
            .or_default()
            .push(format!("{:?} {:?}", o.age, o.learnt));
    }
    let ordered = matches!(obs.first().map(|o| &o.learnt), Some(Observed::Blocks(_)));
    if !ordered {
        m.values_mut().for_each(|v| v.sort());
    }
    m
}

#[test]
fn a_restored_policy_has_the_same_snapshot_and_makes_the_same_choices() {
    let ids = ids(4);
    for (name, make) in policies() {
        let mut rng = SmallRng::seed_from_u64(7);
        let a = make();
        let t0 = Instant::now();
        for i in 0..300 {
            let p = prompt(&mut rng);
            let c = candidates(&ids, &mut rng);
            a.select(
                &c,
                &request(&p, t0 + Duration::from_millis(i), false),
                &mut rng,
            )
            .unwrap();
        }
        let now = t0 + Duration::from_secs(1);
        let snap = a.snapshot(now, usize::MAX);
        assert!(!snap.is_empty(), "{name}");
        let b = make();
        let later = now + Duration::from_secs(30);
        b.restore(&snap, later);
        assert_eq!(
            canonical(&b.snapshot(later, usize::MAX)),
            canonical(&snap),
            "{name}: the restored state is the state"
        );
        for k in 0..100 {
            let p = prompt(&mut rng);
            let c = candidates(&ids, &mut rng);
            let choice = |pol: &dyn Policy, at| {
                pol.select(&c, &request(&p, at, true), &mut SmallRng::seed_from_u64(k))
                    .unwrap()
                    .index
            };
            assert_eq!(choice(&*a, now), choice(&*b, later), "{name}, probe {k}");
        }
    }
}

#[test]
fn a_snapshot_keeps_the_most_recent_within_its_budget() {
    let ids = ids(4);
    let p = CacheAware::new(CacheAwareConfig::default());
    let t0 = Instant::now();
    for i in 0..50u64 {
        let text = format!("prompt {i} ").repeat(20);
        let w = &ids[i as usize % 4];
        p.insert(w, None, &text, t0 + Duration::from_secs(i));
    }
    let now = t0 + Duration::from_secs(60);
    let all = p.snapshot(now, usize::MAX);
    assert_eq!(all.len(), 50, "one text each");
    let budget = all.iter().map(|o| o.learnt.bytes()).sum::<usize>() / 2;
    let some = p.snapshot(now, budget);
    assert!(some.iter().map(|o| o.learnt.bytes()).sum::<usize>() <= budget);
    assert!(some.len() >= 20 && some.len() < 50, "{}", some.len());
    assert!(
        some.windows(2).all(|w| w[0].age >= w[1].age),
        "oldest first"
    );
    let kept_oldest = some[0].age;
    let dropped = all.len() - some.len();
    assert!(all[..dropped].iter().all(|o| o.age > kept_oldest));
    // A policy that learns nothing has nothing to send.
    assert!(RoundRobin::default().snapshot(now, usize::MAX).is_empty());
}

#[test]
fn a_text_that_ended_inside_a_longer_one_keeps_its_own_age() {
    let ids = ids(1);
    let p = CacheAware::new(CacheAwareConfig::default());
    let t0 = Instant::now();
    p.insert(&ids[0], None, "abcdef", t0);
    p.insert(&ids[0], None, "abc", t0 + Duration::from_secs(5));
    let now = t0 + Duration::from_secs(6);
    let snap = p.snapshot(now, usize::MAX);
    let texts: Vec<(Duration, &Observed)> = snap.iter().map(|o| (o.age, &o.learnt)).collect();
    assert_eq!(
        texts,
        [
            (Duration::from_secs(6), &Observed::Text("abcdef".into())),
            (Duration::from_secs(1), &Observed::Text("abc".into())),
        ]
    );
}
