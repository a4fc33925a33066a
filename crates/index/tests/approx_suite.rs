//! The trait-level test suite of approximate mode, run against every `ApproxIndexer` backend
//! (one generic function per behaviour, instantiated for each backend by `approx_suite!`).

mod support;

use std::time::{Duration, Instant};

use kvroute_index::{ApproxIndexer, ReplicaId, TierCounts};
use support::{router_hashes, tokens, BS};

const R0: ReplicaId = ReplicaId(0);
const R1: ReplicaId = ReplicaId(1);

fn device(n: u32) -> TierCounts {
    TierCounts {
        device: n,
        ..TierCounts::default()
    }
}

macro_rules! approx_suite {
    ($($name:ident),* $(,)?) => {
        mod approx_index {
            $(#[test] fn $name() { super::$name(kvroute_index::ApproxIndex::new); })*
        }
        mod approx_bounded {
            $(#[test] fn $name() { super::$name(|ttl| kvroute_index::ApproxIndex::with_max_entries(ttl, 1 << 20)); })*
        }
        mod approx_reference {
            $(#[test] fn $name() { super::$name(kvroute_index::reference::ReferenceApprox::new); })*
        }
    };
}

approx_suite!(
    approx_records_then_matches,
    approx_entries_expire_at_their_deadline,
    approx_recording_again_extends,
    approx_clear_replica,
    approx_many_replicas,
);

const TTL: Duration = Duration::from_secs(120);

fn approx_records_then_matches<A: ApproxIndexer>(new: fn(Duration) -> A) {
    let mut index = new(TTL);
    let t0 = Instant::now();
    let prompt = router_hashes(&tokens(0, 10 * BS), 0);
    assert!(index.find_matches(&prompt, t0).scores.is_empty());
    index.record(R0, &prompt[..6], t0);
    index.record(R1, &prompt[..2], t0);
    index.record(ReplicaId(2), &prompt[1..], t0);
    assert_eq!(
        index.find_matches(&prompt, t0).scores,
        [(R0, device(6)), (R1, device(2))]
    );
    assert!(index.find_matches(&[], t0).scores.is_empty());
    assert_eq!(index.num_blocks(), 10);
}

fn approx_entries_expire_at_their_deadline<A: ApproxIndexer>(new: fn(Duration) -> A) {
    let mut index = new(TTL);
    let t0 = Instant::now();
    let prompt = router_hashes(&tokens(0, 4 * BS), 0);
    index.record(R0, &prompt, t0);
    index.record(R1, &prompt[..2], t0 + Duration::from_secs(10));
    let just_before = t0 + TTL - Duration::from_nanos(1);
    assert_eq!(
        index.find_matches(&prompt, just_before).scores,
        [(R0, device(4)), (R1, device(2))]
    );
    assert_eq!(
        index.find_matches(&prompt, t0 + TTL).scores,
        [(R1, device(2))]
    );
    index.expire(t0 + TTL);
    assert_eq!(index.num_blocks(), 2);
    assert_eq!(
        index.find_matches(&prompt, t0 + TTL).scores,
        [(R1, device(2))]
    );
    index.expire(t0 + TTL + Duration::from_secs(10));
    assert_eq!(index.num_blocks(), 0);
}

fn approx_recording_again_extends<A: ApproxIndexer>(new: fn(Duration) -> A) {
    let mut index = new(TTL);
    let t0 = Instant::now();
    let prompt = router_hashes(&tokens(0, 4 * BS), 0);
    index.record(R0, &prompt, t0);
    let t1 = t0 + Duration::from_secs(60);
    index.record(R0, &prompt[..3], t1);
    index.expire(t0 + TTL);
    assert_eq!(
        index.find_matches(&prompt, t0 + TTL).scores,
        [(R0, device(3))]
    );
    assert_eq!(index.num_blocks(), 3);
    index.expire(t1 + TTL);
    assert!(index.find_matches(&prompt, t1 + TTL).scores.is_empty());
    assert_eq!(index.num_blocks(), 0);
}

fn approx_clear_replica<A: ApproxIndexer>(new: fn(Duration) -> A) {
    let mut index = new(TTL);
    let t0 = Instant::now();
    let prompt = router_hashes(&tokens(0, 4 * BS), 0);
    index.record(R0, &prompt, t0);
    index.record(R1, &prompt[..2], t0);
    index.clear_replica(R0);
    index.clear_replica(ReplicaId(9));
    assert_eq!(index.find_matches(&prompt, t0).scores, [(R1, device(2))]);
    assert_eq!(index.num_blocks(), 2);
    index.record(ReplicaId(5), &prompt, t0);
    assert_eq!(
        index.find_matches(&prompt, t0).scores,
        [(R1, device(2)), (ReplicaId(5), device(4))]
    );
}

fn approx_many_replicas<A: ApproxIndexer>(new: fn(Duration) -> A) {
    let mut index = new(TTL);
    let t0 = Instant::now();
    let prompt = router_hashes(&tokens(0, 12 * BS), 0);
    for r in 0..150u32 {
        index.record(
            ReplicaId(r),
            &prompt[..(r % 12 + 1) as usize],
            t0 + Duration::from_secs(r.into()),
        );
    }
    index.clear_replica(ReplicaId(70));
    let now = t0 + TTL + Duration::from_secs(20);
    let expected: Vec<_> = (21..150u32)
        .filter(|r| *r != 70)
        .map(|r| (ReplicaId(r), device(r % 12 + 1)))
        .collect();
    assert_eq!(index.find_matches(&prompt, now).scores, expected);
    index.expire(now);
    assert_eq!(index.num_blocks(), 12);
}
