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
            ..Default::default()
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

#[test]
fn the_own_decode_term_sends_the_slow_engine_less_than_the_calibrated_model_without_it() {
    // Chats: each turn's prefix is cached where the chat began, which keeps a chat on the
    // slow engine unless its own decode is priced.
    let chats = crate::synthetic::Synthetic::MultiTurn(crate::synthetic::MultiTurn {
        conversations: 60,
        request_rate: 20.0,
        ..Default::default()
    })
    .generate(512, 1);
    let with = run(&chats, &slow_last(CostModel::Calibrated));
    let mut off = slow_last(CostModel::Calibrated);
    if let Cluster::Aggregated { policy_config, .. } = &mut off.cluster {
        policy_config.kv_aware.own_decode_weight = 0.0;
    }
    let without = run(&chats, &off);
    assert_eq!(with.result.requests, without.result.requests);
    // The router learned the slow engine's speeds from its timings: slower at both.
    let f = with.speeds[3].factors();
    assert!(f.prefill_factor > 1.5 && f.decode_factor > 1.5, "{f:?}");
    let (a, b) = (
        &with.result.requests_per_worker,
        &without.result.requests_per_worker,
    );
    assert!(a[3] < b[3], "with {a:?}, without {b:?}");
}

#[test]
fn an_idle_cluster_tries_its_unseen_engines_and_finds_the_fast_ones() {
    // Agent sessions at a fiftieth of their rate: engines are idle between steps. Without
    // exploration the first engines to serve keep every agent type's prompt and the unseen
    // ones, priced at the mean, are never tried: here the two fast engines served nothing.
    let sessions = crate::synthetic::Synthetic::Agentic(crate::synthetic::Agentic {
        sessions: 40,
        ..Default::default()
    })
    .generate(512, 0);
    let config = SimConfig {
        rate_scale: 0.02,
        seed: 0,
        shapes: EngineShapes {
            speed: vec![2.0, 2.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5],
            num_gpu_blocks: vec![16384, 8192, 16384, 16384, 8192, 16384, 8192, 8192],
            ..Default::default()
        },
        cluster: Cluster::Aggregated {
            workers: 8,
            policy: PolicyKind::KvAware,
            policy_config: PolicyConfig::default(),
        },
        ..cfg(PolicyKind::KvAware)
    };
    let run = run(&sessions, &config);
    assert_eq!(run.result.requests, sessions.len());
    let per = &run.result.requests_per_worker;
    let busiest = (0..per.len()).max_by_key(|&i| per[i]).unwrap();
    assert!(busiest < 2, "a fast engine serves the most: {per:?}");
}

#[test]
fn every_policy_sends_a_prompt_where_its_context_fits() {
    // 64 blocks of 16 (1,024 tokens) on engines 0 and 2: no prompt of 1,500-2,100 fits.
    let small_two = |policy| SimConfig {
        shapes: EngineShapes {
            speed: vec![1.0; 4],
            num_gpu_blocks: vec![64, 2048, 64, 2048],
            ..Default::default()
        },
        ..cfg(policy)
    };
    let policies = [
        PolicyKind::KvAware,
        PolicyKind::LlmD,
        PolicyKind::RoundRobin,
        PolicyKind::CacheAware,
    ];
    for policy in policies {
        let r = run(&small_trace(), &small_two(policy)).result;
        assert_eq!((r.requests, r.rejected), (120, 0), "{policy:?}");
        let per = &r.requests_per_worker;
        assert_eq!((per[0], per[2], per[1] + per[3]), (0, 0, 120), "{policy:?}");
    }
}

#[test]
fn a_router_told_the_speeds_sends_the_slow_engine_less_than_one_learning_them() {
    // `--router-told-speeds`: the calibrated model knows that engine 3 is four times slower
    // before it has timed anything there; learning it, the router first prices it at the mean.
    let trace = small_trace();
    let learned = run(&trace, &slow_last(CostModel::Calibrated));
    let mut config = slow_last(CostModel::Calibrated);
    config.shapes.told = true;
    let told = run(&trace, &config);
    assert_eq!(told.result.requests, learned.result.requests);
    let (t, l) = (
        &told.result.requests_per_worker,
        &learned.result.requests_per_worker,
    );
    assert!(t[3] < l[3], "told {t:?}, learned {l:?}");
}

/// `slow_last` at `rate_scale` with the TTFT oracle choosing, over the weighted model's
/// accounting (which knows no speeds).
fn oracle(rate_scale: f64) -> SimConfig {
    SimConfig {
        rate_scale,
        ttft_oracle: true,
        metrics_refresh: None,
        ..slow_last(CostModel::Weighted)
    }
}

#[test]
fn the_ttft_oracle_leaves_the_slow_engine_idle_on_an_idle_cluster() {
    // A request every 4 s: each finds every engine idle, where the slow one's first token
    // comes four times later. kv_aware alone spreads the prompts over the engines.
    let run = run(&small_trace(), &oracle(0.01));
    assert_eq!(run.result.policy, "ttft_oracle");
    assert_eq!(run.result.requests, 120);
    assert_eq!(run.result.requests_per_worker[3], 0, "{:?}", run.result);
    let alone = super::run(
        &small_trace(),
        &SimConfig {
            rate_scale: 0.01,
            ..slow_last(CostModel::Weighted)
        },
    );
    assert!(
        alone.result.requests_per_worker[3] > 0,
        "{:?}",
        alone.result
    );
}

#[test]
fn the_ttft_oracle_sends_the_slow_engine_what_would_wait_longer_elsewhere() {
    // Twenty times the trace's rate: the fast engines' queues make the slow one worth a request
    // now and then, never its share.
    let run = run(&small_trace(), &oracle(20.0));
    assert_eq!(run.result.requests, 120);
    let per = &run.result.requests_per_worker;
    let fast_mean = (per[0] + per[1] + per[2]) as f64 / 3.0;
    assert!(per[3] > 0 && (per[3] as f64) < 0.5 * fast_mean, "{per:?}");
}
