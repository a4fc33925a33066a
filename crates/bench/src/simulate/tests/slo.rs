//! Per-request TTFT targets in virtual time: on a cluster with a slow engine, the router that
//! sees the requests' targets meets more of the tight ones, and the same requests have the
//! same targets whether the router sees them or not.

use super::hetero::slow_last;
use super::*;
use crate::simulate::{SloConfig, SloResult, SloRouting};

/// Half the requests must see their first token within 100 ms, half within 100 s.
fn with_slo(routing: SloRouting) -> SimConfig {
    SimConfig {
        slo: Some(SloConfig {
            mix: "0.5:100,0.5:100000".parse().unwrap(),
            routing,
        }),
        rate_scale: 1.0,
        ..slow_last(kvroute_core::CostModel::Weighted)
    }
}

#[test]
fn targets_sent_to_the_router_meet_more_tight_ones_on_a_slow_engine() {
    let blind = simulate(&small_trace(), &with_slo(SloRouting::Blind));
    let sent = simulate(&small_trace(), &with_slo(SloRouting::Headers));
    let (b, s) = (blind.slo.unwrap(), sent.slo.unwrap());
    assert!(!b.routed_on_targets && s.routed_on_targets);
    // The same requests in the same classes.
    let requests = |r: &SloResult| -> Vec<usize> { r.classes.iter().map(|c| c.requests).collect() };
    assert_eq!(requests(&b), requests(&s));
    assert_eq!(requests(&b).iter().sum::<usize>(), 120);
    // Measured (deterministic): 50 of the tight class met blind, 56 routed on targets; every
    // loose one met either way.
    let met = |r: &SloResult, c: usize| r.classes[c].met;
    assert!(met(&s, 0) >= met(&b, 0) + 4, "blind {b:?}\nsent {s:?}");
    assert_eq!(
        (met(&b, 1), met(&s, 1)),
        (b.classes[1].requests, s.classes[1].requests)
    );
    assert!(s.attainment > b.attainment && s.goodput_rps > b.goodput_rps);
}
