//! The buckets and the limiter on an injected clock: `t0 + secs`, never the wall clock.

use std::time::Duration;

use super::*;
use crate::config::{Limits, RateLimitPolicy};

fn limits(tpm: u32, rpm: u32) -> Limits {
    Limits {
        tokens_per_minute: tpm,
        requests_per_minute: rpm,
    }
}

fn at(t0: Instant, secs: f64) -> Instant {
    t0 + Duration::from_secs_f64(secs)
}

#[test]
fn a_bucket_refills_continuously_at_a_sixtieth_of_its_capacity_per_second() {
    let t0 = Instant::now();
    let mut b = Bucket::new(limits(600, 60), t0);
    b.take(600.0);
    assert_eq!(b.tokens(), 0.0);
    assert_eq!(b.requests(), 59.0);
    b.refill(at(t0, 1.5));
    assert!((b.tokens() - 15.0).abs() < 1e-9, "{}", b.tokens());
    assert!((b.requests() - 60.0).abs() < 1e-9, "capped at capacity");
    b.refill(at(t0, 1000.0));
    assert_eq!(b.tokens(), 600.0, "never past capacity");
    // A clock read out of order does not take anything back.
    b.refill(at(t0, 999.0));
    assert_eq!(b.tokens(), 600.0);
}

#[test]
fn a_refusal_says_how_long_until_enough_has_refilled_or_that_it_never_will() {
    let t0 = Instant::now();
    let mut b = Bucket::new(limits(60, 2), t0);
    assert_eq!(b.check(61.0), Err(Refused::OverCapacity));
    b.take(50.0);
    // 10 left, 30 asked: 20 tokens at 1 per second.
    assert_eq!(b.check(30.0), Err(Refused::Wait(20)));
    b.refill(at(t0, 19.5));
    assert_eq!(b.check(30.0), Err(Refused::Wait(1)), "rounded up");
    b.refill(at(t0, 20.0));
    assert_eq!(b.check(30.0), Ok(()));
    // Requests: 2 per minute, both taken: 30 s for the next.
    let mut b = Bucket::new(limits(60, 2), t0);
    b.take(0.0);
    b.take(0.0);
    assert_eq!(b.requests(), 0.0);
    assert_eq!(b.check(0.0), Err(Refused::Wait(30)));
}

#[test]
fn settling_gives_back_or_charges_more_but_never_past_capacity() {
    let t0 = Instant::now();
    let mut b = Bucket::new(limits(600, 10), t0);
    b.take(100.0);
    b.settle(-60.0, t0);
    assert_eq!(b.tokens(), 560.0);
    b.settle(1000.0, t0);
    assert_eq!(b.tokens(), -440.0, "a debt, refilled from below");
    b.settle(-10_000.0, t0);
    assert_eq!(b.tokens(), 600.0);
    // A charge counts from the refilled level: 10 s later the bucket was full again.
    b.take(600.0);
    b.settle(100.0, at(t0, 60.0));
    assert_eq!(b.tokens(), 500.0);
}

fn limiter(yaml: &str) -> Arc<RateLimiter> {
    let path = std::env::temp_dir().join(format!(
        "kvroute-rl-{}-{:?}.yaml",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::write(&path, yaml).unwrap();
    let policy: RateLimitPolicy = crate::config::load_rate_limits(&path, false).unwrap();
    std::fs::remove_file(&path).unwrap();
    Arc::new(RateLimiter::new(policy))
}

const FILE: &str = "default_policy: {tokens_per_minute: 100, requests_per_minute: 5}
tenants:
  - tenant_key: auth:a
    tokens_per_minute: 1000
    requests_per_minute: 100
    model_rules:
      - {rule_id: big, matcher: {type: prefix, value: big-}, tokens_per_minute: 300, requests_per_minute: 2}
";

#[test]
fn a_reservation_takes_from_the_tenant_and_its_rule_or_from_neither() {
    let l = limiter(FILE);
    let (a, t0) = (Tenant::authenticated("a"), Instant::now());
    let r1 = l.reserve(&a, Some("big-1"), 200, t0).unwrap();
    assert_eq!(l.bucket(&a, Some("big"), t0).unwrap().tokens(), 100.0);
    assert_eq!(l.bucket(&a, None, t0).unwrap().tokens(), 800.0);
    // The rule has 100 left: refused, and neither scope is touched.
    assert_eq!(
        l.reserve(&a, Some("big-2"), 200, t0).unwrap_err(),
        Refused::Wait(20)
    );
    assert_eq!(l.bucket(&a, None, t0).unwrap().tokens(), 800.0);
    // Another model of the same tenant only meets the tenant's limits.
    let r2 = l.reserve(&a, Some("small"), 500, t0).unwrap();
    assert_eq!(l.bucket(&a, None, t0).unwrap().tokens(), 300.0);
    // Settled from usage: 200 reserved, 50 used.
    r1.settle(50, t0);
    assert_eq!(l.bucket(&a, Some("big"), t0).unwrap().tokens(), 250.0);
    assert_eq!(l.bucket(&a, None, t0).unwrap().tokens(), 450.0);
    // Dropped unsettled: everything back, the request still counted.
    drop(r2);
    let own = l.bucket(&a, None, t0).unwrap();
    assert_eq!((own.tokens(), own.requests()), (950.0, 98.0));
    // Beyond the rule's whole capacity: never.
    assert_eq!(
        l.reserve(&a, Some("big-1"), 301, t0).unwrap_err(),
        Refused::OverCapacity
    );
}

#[test]
fn tenants_not_listed_have_the_default_each_on_their_own() {
    let l = limiter(FILE);
    let t0 = Instant::now();
    let (x, y) = (Tenant::header("x"), Tenant::anonymous());
    for _ in 0..5 {
        drop(l.reserve(&x, None, 1, t0).unwrap());
    }
    assert_eq!(l.reserve(&x, None, 1, t0).unwrap_err(), Refused::Wait(12));
    assert!(
        l.reserve(&y, None, 1, t0).is_ok(),
        "another tenant is untouched"
    );
    // A minute later, x has its five requests back.
    assert!(l.reserve(&x, None, 1, at(t0, 12.0)).is_ok());
}

#[test]
fn full_scopes_are_forgotten_every_so_many_new_ones() {
    let mut l = limiter(FILE);
    Arc::get_mut(&mut l).unwrap().sweep_every = 64;
    let t0 = Instant::now();
    let n = 64 * SHARDS * 4;
    for i in 0..n {
        drop(
            l.reserve(&Tenant::header(&i.to_string()), None, 0, t0)
                .unwrap(),
        );
    }
    let kept = |l: &RateLimiter| -> usize {
        l.shards
            .iter()
            .map(|s| s.lock().unwrap().scopes.len())
            .sum()
    };
    assert_eq!(kept(&l), n, "none full yet");
    // A minute later every one of them is full again: the next sweeps forget them.
    let later = at(t0, 60.0);
    for i in 0..n {
        let t = Tenant::header(&format!("later-{i}"));
        drop(l.reserve(&t, None, 0, later).unwrap());
    }
    assert!(kept(&l) <= n, "{}", kept(&l));
}

#[test]
fn charges_are_told_to_the_sink_and_a_peers_are_taken_without_a_check() {
    let (mine, peer) = (limiter(FILE), limiter(FILE));
    let told = Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = told.clone();
    mine.share(Box::new(move |c| sink.lock().unwrap().push(c)));
    let (a, t0) = (Tenant::authenticated("a"), Instant::now());
    let r = mine.reserve(&a, Some("big-1"), 200, t0).unwrap();
    r.settle(250, t0);
    let told = told.lock().unwrap().clone();
    let rules: Vec<_> = told
        .iter()
        .map(|c| (c.rule.clone(), c.tokens, c.requests))
        .collect();
    assert_eq!(
        rules,
        vec![
            (None, 200.0, 1.0),
            (Some("big".to_owned()), 200.0, 1.0),
            (None, 50.0, 0.0),
            (Some("big".to_owned()), 50.0, 0.0),
        ]
    );
    for c in &told {
        peer.charge(c, t0);
    }
    // The peer's copy is the same as the buckets that were charged.
    for rule in [None, Some("big")] {
        assert_eq!(peer.bucket(&a, rule, t0), mine.bucket(&a, rule, t0));
    }
    // Past the rule's room on the peer too.
    assert_eq!(
        peer.reserve(&a, Some("big-2"), 100, t0).unwrap_err(),
        Refused::Wait(10)
    );
    // A rule the peer does not know is ignored.
    let unknown = Charge {
        tenant: a.clone(),
        rule: Some("nope".into()),
        tokens: 1.0,
        requests: 1.0,
    };
    peer.charge(&unknown, t0);
    assert!(peer.bucket(&a, Some("nope"), t0).is_none());
}
