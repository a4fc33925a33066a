//! LoRA adapters in the simulated cluster: the predicted cost model learns each engine's
//! adapter load time from the TTFTs of the requests it expected to load.

use std::time::Duration;

use kvroute_core::CostModel;
use kvroute_sim::engine::LoraConfig;

use super::*;

/// 600 requests of 12 prefix groups (so 12 adapters with `loras` 12) every 60 ms.
fn adapter_trace() -> Vec<TraceRequest> {
    (0..600u64)
        .map(|i| TraceRequest {
            timestamp: i * 60,
            input_length: 800 + (i as usize % 5) * 200,
            output_length: 16,
            hash_ids: vec![i % 12, 1000 + i],
        })
        .collect()
}

#[test]
fn the_router_learns_each_engines_adapter_load_time() {
    let mut policy_config = PolicyConfig::default();
    policy_config.kv_aware.cost_model = CostModel::Predicted;
    let cfg = SimConfig {
        cluster: Cluster::Aggregated {
            workers: 4,
            policy: PolicyKind::KvAware,
            policy_config,
        },
        engine: EngineConfig {
            num_gpu_blocks: 2048,
            lora: LoraConfig {
                max_loras: 2,
                load_time: Duration::from_millis(200),
            },
            ..EngineConfig::default()
        },
        loras: 12,
        ..cfg(PolicyKind::KvAware)
    };
    let run = run(&adapter_trace(), &cfg);
    assert_eq!(run.result.requests, 600);
    assert!(run.result.lora_loads > 50, "{}", run.result.lora_loads);
    // Every engine loaded adapters; the router was never told how long a load takes.
    for (e, s) in run.speeds.iter().enumerate() {
        assert!(s.adapter_load_observations >= 20, "{e}: {s:?}");
        assert!(
            (150.0..250.0).contains(&s.adapter_load_ms),
            "{e}: {} ms",
            s.adapter_load_ms
        );
    }
    assert_eq!(run.result.fitted_lora_load_ms.len(), 4);
}
