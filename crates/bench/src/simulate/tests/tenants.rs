//! Tenants in virtual time: their figures add up, and VTC shields a light tenant from a flood.

use std::sync::Arc;
use std::time::Duration;

use kvroute_core::queue::QueueOrder;

use super::queue::{queued, request};
use super::*;

/// Tenant 0 floods two engines with 40 prompts of 2,048 tokens in the first 200 ms; tenant 1
/// sends a 512-token prompt every 100 ms.
fn flood() -> (Vec<TraceRequest>, Arc<[u32]>) {
    let mut tagged: Vec<(TraceRequest, u32)> = (0..40)
        .map(|i| (request(i * 5, 4, 1000 * i), 0))
        .chain((0..10).map(|i| (request(i * 100 + 3, 1, 100_000 + i), 1)))
        .collect();
    tagged.sort_by_key(|(r, _)| r.timestamp);
    let (trace, of): (Vec<_>, Vec<_>) = tagged.into_iter().unzip();
    (trace, of.into())
}

fn with_tenants(fairness: TenantFairness) -> (Vec<TraceRequest>, SimConfig) {
    let (trace, of) = flood();
    let queue = QueueConfig::new(1.0, QueueOrder::Fcfs, Duration::from_secs(600))
        .unwrap()
        .with_fairness(fairness);
    let cfg = SimConfig {
        tenants: Some(of),
        ..queued(2, Some(queue))
    };
    (trace, cfg)
}

#[test]
fn each_tenants_figures_add_up() {
    for fairness in [TenantFairness::Fcfs, TenantFairness::Vtc] {
        let (trace, cfg) = with_tenants(fairness);
        let r = simulate(&trace, &cfg);
        assert_eq!(r.tenants.len(), 2);
        let requests: usize = r.tenants.iter().map(|t| t.requests).sum();
        let answered: usize = r.tenants.iter().map(|t| t.answered).sum();
        assert_eq!(requests, trace.len());
        assert_eq!(answered, r.ttft_sorted_ms.len());
        assert_eq!((r.tenants[0].requests, r.tenants[1].requests), (40, 10));
        let share: f64 = r.tenants.iter().map(|t| t.token_share).sum();
        assert!((share - 1.0).abs() < 1e-9, "{share}");
        assert_eq!(r.queue.as_ref().unwrap().fairness, fairness);
    }
    let (trace, mut cfg) = with_tenants(TenantFairness::Fcfs);
    cfg.tenants = None;
    assert!(
        simulate(&trace, &cfg).tenants.is_empty(),
        "none without tenants"
    );
}

#[test]
fn under_a_flood_vtc_gives_the_light_tenant_a_lower_ttft_than_fcfs() {
    let light = |fairness| {
        let (trace, cfg) = with_tenants(fairness);
        let r = simulate(&trace, &cfg);
        let t = &r.tenants[1];
        assert!(t.router_wait_ms.p90 <= t.ttft_ms.p90, "{t:?}");
        (t.ttft_ms.p90, t.token_share)
    };
    let (fcfs, fcfs_share) = light(TenantFairness::Fcfs);
    let (vtc, vtc_share) = light(TenantFairness::Vtc);
    assert!(
        vtc < fcfs / 2.0,
        "light tenant TTFT p90: vtc {vtc} ms, fcfs {fcfs} ms"
    );
    assert!(vtc_share >= fcfs_share, "{vtc_share} < {fcfs_share}");
}

#[test]
fn one_tenant_under_vtc_is_the_fcfs_run() {
    let (trace, mut cfg) = with_tenants(TenantFairness::Vtc);
    cfg.tenants = Some(vec![0; trace.len()].into());
    let vtc = run(&trace, &cfg);
    let (_, mut cfg) = with_tenants(TenantFairness::Fcfs);
    cfg.tenants = Some(vec![0; trace.len()].into());
    let fcfs = run(&trace, &cfg);
    assert_eq!(vtc.routed, fcfs.routed);
    assert_eq!(vtc.result.ttft_ms, fcfs.result.ttft_ms);
}
