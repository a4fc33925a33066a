//! Heterogeneous clusters: engines of different speeds and KV capacities, and the predicted
//! cost model learning the speeds from the timings it observes.

use kvroute_core::CostModel;

use super::*;

/// Four engines, the last one four times slower; busy enough that where requests go matters.
pub(super) fn slow_last(cost_model: CostModel) -> SimConfig {
    let mut policy_config = PolicyConfig::default();
    policy_config.kv_aware.cost_model = cost_model;
    SimConfig {
        cluster: Cluster::Aggregated {
            workers: 4,
            policy: PolicyKind::KvAware,
            policy_config,
        },
        rate_scale: 2.0,
        shapes: EngineShapes {
            speed: vec![1.0, 1.0, 1.0, 0.25],
            num_gpu_blocks: vec![2048, 2048, 1024, 1024],
        },
        ..cfg(PolicyKind::KvAware)
    }
}

#[test]
fn each_engine_gets_its_own_speed_and_capacity() {
    let run = run(&small_trace(), &slow_last(CostModel::Weighted));
    let blocks: Vec<usize> = run
        .engines
        .iter()
        .map(|e| e.config().num_gpu_blocks)
        .collect();
    assert_eq!(blocks, vec![2048, 2048, 1024, 1024]);
    let speeds: Vec<f64> = run
        .engines
        .iter()
        .map(|e| e.config().timing.speedup)
        .collect();
    assert_eq!(speeds, vec![1.0, 1.0, 1.0, 0.25]);
    assert_eq!(run.result.requests, 120);
}

#[test]
fn the_fitted_models_find_the_slow_engine_and_predicted_routes_around_it() {
    let run = super::run(&small_trace(), &slow_last(CostModel::Predicted));
    assert_eq!(run.result.requests, 120);
    // The router was never told the speeds: its TTFT fits found them.
    let slope = |e: usize| run.speeds[e].prefill[1];
    let fast = (slope(0) + slope(1) + slope(2)) / 3.0;
    assert!(slope(3) > 2.0 * fast, "{:?}", run.speeds);
    assert!(run.speeds.iter().all(|s| s.prefill_observations > 0));
    let per = &run.result.requests_per_worker;
    let fast_mean = (per[0] + per[1] + per[2]) as f64 / 3.0;
    assert!((per[3] as f64) < 0.5 * fast_mean, "{per:?}");
    // The weighted model does not know speeds: it sends the slow engine its share.
    let weighted = super::run(&small_trace(), &slow_last(CostModel::Weighted));
    let w = &weighted.result.requests_per_worker;
    assert!(w[3] > per[3], "weighted {w:?}, predicted {per:?}");
}
