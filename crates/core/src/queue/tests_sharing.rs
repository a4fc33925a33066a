//! One test per rule of tiers and tenants.

use std::collections::BTreeMap;
use std::time::Duration;

use super::*;

fn class(name: &str, weight: u64) -> PolicyClass {
    PolicyClass {
        name: name.to_owned(),
        weight,
        max_queued: None,
    }
}

fn vtc() -> Fairness {
    Fairness::Vtc(VtcConfig::default())
}

fn one_class(sharing: Sharing) -> DrrQueue<&'static str> {
    DrrQueue::with_sharing(vec![class("c", 1_000_000)], QueueOrder::Fcfs, sharing).unwrap()
}

fn fair() -> DrrQueue<&'static str> {
    one_class(Sharing {
        fairness: vtc(),
        ..Sharing::default()
    })
}

fn at(tenant: &str, cost: u64, secs: u64) -> Arrival<'_> {
    Arrival {
        class: 0,
        tier: 0,
        tenant,
        cost,
        now: Duration::from_secs(secs),
        head_start: Duration::ZERO,
    }
}

fn all<T>(_: usize, _: &T) -> bool {
    true
}

fn drain(q: &mut DrrQueue<&'static str>) -> Vec<&'static str> {
    std::iter::from_fn(|| q.pop(all)).map(|(_, i)| i).collect()
}

#[test]
fn a_light_tenants_request_cuts_ahead_of_a_heavy_backlog() {
    let mut q = fair();
    for item in ["h0", "h1", "h2", "h3"] {
        q.push_with(&at("heavy", 1000, 0), item).unwrap();
    }
    assert_eq!(q.pop(all), Some((0, "h0")));
    assert_eq!(q.counter(0, "heavy"), 1000.0);
    // The light tenant arrives last, at the minimum (heavy's 1000), and ties are broken by
    // arrival: heavy's h1 came first. After h1, heavy is at 2000 and light goes.
    q.push_with(&at("light", 100, 1), "l0").unwrap();
    assert_eq!(q.counter(0, "light"), 1000.0);
    assert_eq!(drain(&mut q), ["h1", "l0", "h2", "h3"]);
    // Under plain FCFS the light request waits behind the whole backlog.
    let mut q = one_class(Sharing::default());
    for item in ["h0", "h1", "h2", "h3"] {
        q.push_with(&at("heavy", 1000, 0), item).unwrap();
    }
    q.pop(all).unwrap();
    q.push_with(&at("light", 100, 1), "l0").unwrap();
    assert_eq!(drain(&mut q), ["h1", "h2", "h3", "l0"]);
}

#[test]
fn a_new_tenant_starts_at_the_minimum_not_zero() {
    let mut q = fair();
    for i in 0..3 {
        q.push_with(&at("a", 500, i), "a").unwrap();
        q.push_with(&at("b", 300, i), "b").unwrap();
    }
    q.pop(all).unwrap(); // a: 500
    q.pop(all).unwrap(); // b: 300
    q.pop(all).unwrap(); // b: 600
    assert_eq!((q.counter(0, "a"), q.counter(0, "b")), (500.0, 600.0));
    q.push_with(&at("new", 10, 5), "n").unwrap();
    assert_eq!(
        q.counter(0, "new"),
        500.0,
        "the smallest backlogged counter"
    );
    // A returning tenant keeps a larger counter of its own.
    q.charge(0, "old", 1_000);
    assert_eq!(
        q.counter(0, "old"),
        500.0 + 2.0 * 1_000.0,
        "lifted, then charged x2"
    );
    q.push_with(&at("old", 10, 5), "o").unwrap();
    assert_eq!(q.counter(0, "old"), 2_500.0);
}

#[test]
fn an_idle_tenant_does_not_bank_credit_when_the_queue_empties() {
    let mut q = fair();
    q.push_with(&at("light", 10, 0), "l").unwrap();
    q.pop(all).unwrap();
    for _ in 0..5 {
        q.push_with(&at("heavy", 1000, 1), "h").unwrap();
        q.pop(all).unwrap();
    }
    // Heavy started at light's 10 and the queue emptied with heavy last, at 5010: the light
    // tenant comes back there, not at the 10 it left with.
    q.push_with(&at("light", 10, 2), "l").unwrap();
    assert_eq!(q.counter(0, "light"), 5010.0);
    // Heavy, idle at the floor, is forgotten: it would be lifted there anyway.
    assert_eq!(q.known_tenants(0), 1);
    assert_eq!(q.counter(0, "heavy"), 5010.0);
}

#[test]
fn output_tokens_count_with_their_weight() {
    let mut q = fair();
    q.push_with(&at("a", 100, 0), "a0").unwrap();
    q.push_with(&at("b", 100, 0), "b0").unwrap();
    q.push_with(&at("a", 100, 0), "a1").unwrap();
    q.push_with(&at("b", 100, 0), "b1").unwrap();
    assert_eq!(q.pop(all), Some((0, "a0")));
    // a long answer to a0: a falls behind b for the next pops.
    q.charge(0, "a", 100);
    assert_eq!(q.counter(0, "a"), 300.0);
    assert_eq!(drain(&mut q), ["b0", "b1", "a1"]);
}

#[test]
fn weights_two_to_one_give_two_to_one_tokens_under_backlog() {
    let mut weights = BTreeMap::new();
    weights.insert("big".to_owned(), 2.0);
    let mut q = one_class(Sharing {
        fairness: Fairness::Vtc(VtcConfig {
            output_weight: 2.0,
            tenant_weights: weights,
        }),
        ..Sharing::default()
    });
    // Both always backlogged; big's requests cost 300, small's 200, each answered with 10
    // output tokens (20 weighted).
    let mut served = BTreeMap::<&str, u64>::new();
    let mut queued = BTreeMap::<&str, usize>::new();
    for _ in 0..6_000 {
        for (tenant, cost) in [("big", 300), ("small", 200)] {
            while queued.get(tenant).copied().unwrap_or(0) < 4 {
                q.push_with(&at(tenant, cost, 0), tenant).unwrap();
                *queued.entry(tenant).or_default() += 1;
            }
        }
        let (_, who) = q.pop(all).unwrap();
        *queued.get_mut(who).unwrap() -= 1;
        q.charge(0, who, 10);
        *served.entry(who).or_default() += if who == "big" { 300 } else { 200 } + 20;
    }
    let ratio = served["big"] as f64 / served["small"] as f64;
    assert!((ratio - 2.0).abs() < 0.05, "ratio {ratio}");
}

fn tiered(starvation: [Option<Duration>; 4]) -> DrrQueue<&'static str> {
    one_class(Sharing::smg(starvation, vtc()))
}

fn in_tier(tier: usize, secs: u64) -> Arrival<'static> {
    Arrival {
        tier,
        ..at("t", 10, secs)
    }
}

#[test]
fn a_higher_tier_goes_first_and_a_blocked_one_holds_nothing_back() {
    let mut q = tiered([None; 4]);
    assert_eq!(q.tier_index("bulk"), Some(3));
    assert_eq!(q.default_tier(), 2);
    q.push_with(&in_tier(3, 0), "bulk").unwrap();
    q.push_with(&in_tier(2, 1), "default").unwrap();
    q.push_with(&in_tier(1, 2), "interactive").unwrap();
    q.push_with(&in_tier(0, 3), "system").unwrap();
    // Work-conserving: with system's head blocked, interactive goes.
    assert_eq!(q.pop(|_, i| *i != "system"), Some((0, "interactive")));
    assert_eq!(drain(&mut q), ["system", "default", "bulk"]);
    assert_eq!(
        q.push_with(&in_tier(4, 0), "x"),
        Err(QueueError::UnknownTier { tier: 4 })
    );
}

#[test]
fn a_starved_item_is_promoted_once_past_its_threshold() {
    let limit = Some(Duration::from_secs(10));
    let mut q = tiered([None, None, None, limit]);
    let bulk = q.push_with(&in_tier(3, 0), "old bulk").unwrap();
    q.push_with(&in_tier(3, 0), "bulk2").unwrap();
    q.push_with(&in_tier(1, 5), "i1").unwrap();
    q.push_with(&in_tier(1, 5), "i2").unwrap();
    // Waited exactly the threshold: not yet.
    assert_eq!(q.pop_at(Duration::from_secs(10), all), Some((0, "i1")));
    assert_eq!(q.lane_len(3, 0), 2);
    // Past it: both bulk requests are served as tier 0, ahead of interactive.
    assert_eq!(
        q.pop_at(Duration::from_millis(10_001), all),
        Some((0, "old bulk"))
    );
    assert_eq!((q.lane_len(0, 0), q.lane_len(3, 0)), (1, 0));
    assert_eq!(q.remove(bulk), None, "already served");
    assert_eq!(drain(&mut q), ["bulk2", "i2"]);
}

#[test]
fn a_promoted_items_ticket_still_removes_it() {
    let mut q = tiered([None, None, None, Some(Duration::from_secs(1))]);
    let t = q.push_with(&in_tier(3, 0), "bulk").unwrap();
    q.push_with(&in_tier(2, 0), "d").unwrap();
    // Promoted, but blocked in tier 0: the default tier's request goes.
    assert_eq!(
        q.pop_at(Duration::from_secs(2), |_, i| *i == "d"),
        Some((0, "d"))
    );
    assert_eq!(q.lane_len(0, 0), 1, "promoted");
    assert_eq!(t.tier(), 3);
    assert_eq!(q.remove(t), Some("bulk"));
    assert!(q.is_empty());
}

#[test]
fn one_tenant_one_tier_is_todays_order_exactly() {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    for seed in 0..8 {
        let mut rng = StdRng::seed_from_u64(seed);
        let order = [QueueOrder::Fcfs, QueueOrder::Wspt][seed as usize % 2];
        let classes = vec![class("a", 300), class("b", 700), class("c", 50)];
        let mut plain = DrrQueue::new(classes.clone(), order).unwrap();
        let sharing = Sharing {
            fairness: vtc(),
            ..Sharing::default()
        };
        let mut fair = DrrQueue::with_sharing(classes, order, sharing).unwrap();
        for i in 0..2_000u64 {
            if rng.random_bool(0.55) {
                let c = rng.random_range(0..3);
                let cost = rng.random_range(0..2_000);
                plain.push(c, i, cost).unwrap();
                let arrival = Arrival {
                    class: c,
                    tier: 0,
                    tenant: "only",
                    cost,
                    now: Duration::from_millis(i),
                    head_start: Duration::ZERO,
                };
                fair.push_with(&arrival, i).unwrap();
            } else {
                let blocked = rng.random_range(0..4);
                let now = Duration::from_millis(i);
                let a = plain.pop(|c, _| c != blocked);
                assert_eq!(a, fair.pop_at(now, |c, _| c != blocked), "seed {seed}");
                if rng.random_bool(0.3) {
                    fair.charge(0, "only", rng.random_range(0..500));
                }
            }
        }
    }
}

#[test]
fn sharing_is_validated() {
    let bad = |sharing: Sharing| {
        DrrQueue::<()>::with_sharing(vec![class("c", 1)], QueueOrder::Fcfs, sharing).unwrap_err()
    };
    let no_tiers = Sharing {
        tiers: vec![],
        fairness: Fairness::Off,
    };
    assert_eq!(bad(no_tiers), QueueConfigError::NoTiers);
    let mut twice = Sharing::smg([None; 4], Fairness::Off);
    twice.tiers[3].name = "system".into();
    assert_eq!(
        bad(twice),
        QueueConfigError::DuplicateTier {
            tier: "system".into()
        }
    );
    for w in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let mut cfg = VtcConfig::default();
        cfg.tenant_weights.insert("t".into(), w);
        let err = bad(Sharing::smg([None; 4], Fairness::Vtc(cfg)));
        assert!(matches!(err, QueueConfigError::BadWeight { .. }), "{w}");
        let cfg = VtcConfig {
            output_weight: w,
            ..VtcConfig::default()
        };
        let err = bad(Sharing::smg([None; 4], Fairness::Vtc(cfg)));
        assert!(matches!(err, QueueConfigError::BadWeight { .. }), "{w}");
    }
}

#[test]
fn a_head_start_counts_as_an_earlier_arrival_within_the_tenant() {
    let mut q = one_class(Sharing::default());
    q.push_with(&at("", 10, 10), "early").unwrap();
    q.push_with(&at("", 10, 12), "late").unwrap();
    // Arrived at 13 with 5 s of head start: as if at 8, before both.
    let ahead = Arrival {
        head_start: Duration::from_secs(5),
        ..at("", 10, 13)
    };
    q.push_with(&ahead, "jumped").unwrap();
    // Arrived at 14 with 3 s: as if at 11, between them.
    let between = Arrival {
        head_start: Duration::from_secs(3),
        ..at("", 10, 14)
    };
    q.push_with(&between, "between").unwrap();
    assert_eq!(drain(&mut q), ["jumped", "early", "between", "late"]);
}

#[test]
fn prompt_tokens_served_outside_the_queue_are_charged() {
    let mut q = fair();
    q.push_with(&at("heavy", 100, 0), "h").unwrap();
    q.push_with(&at("light", 100, 1), "l").unwrap();
    // While both wait, heavy is served 5,000 prompt tokens that never waited: light goes first.
    q.charge_prompt(0, "heavy", 5000);
    assert_eq!(drain(&mut q), ["l", "h"]);
}
