//! Latency targets on a disaggregated route: the prefill half answers for the TTFT target,
//! the decode half for the TPOT target, and both are counted. Two kvroute-sim prefill
//! engines of two speeds (50x apart) and two decode engines; the prefill ranks' TTFT models
//! learn from the prefill halves' answers (pinned, `x-kvroute-prefill-worker`).

mod support;

use kvroute_core::PolicyKind;
use kvroute_gateway::Settings;
use serde_json::json;
use support::*;

const METRIC: &str = "kvroute_slo_requests_total";

/// A streamed prompt of ~2,000 tokens no other request shares.
fn body(i: u64) -> String {
    let prompt = format!("{i} {}", text(2000, 9000 + i));
    json!({"prompt": prompt, "max_tokens": 4, "stream": true}).to_string()
}

fn prefill_worker(reply: &Reply) -> String {
    reply.headers["x-kvroute-prefill-worker"]
        .to_str()
        .unwrap()
        .to_owned()
}

#[tokio::test]
async fn each_half_answers_for_its_target_and_the_outcomes_are_counted() {
    let mut sims = Vec::new();
    let mut specs = Vec::new();
    for (id, role, speedup) in [
        ("p0", "prefill", "10"),
        ("p1", "prefill", "0.2"),
        ("d0", "decode", "10"),
        ("d1", "decode", "10"),
    ] {
        let (sim, spec) = pd_engine(id, role, speedup, 0).await;
        sims.push(sim);
        specs.push(spec);
    }
    let mut settings = Settings::with_workers(specs).unwrap();
    settings.policy = PolicyKind::KvAware;
    let r = TestRouter::start(settings).await;
    // Each prefill engine computes 12 prompts: its rank's TTFT model learns its speed.
    for i in 0..12 {
        for p in ["p0", "p1"] {
            let reply = r
                .complete(&[("x-kvroute-prefill-worker", p)], &body(i))
                .await;
            assert_eq!(reply.status, 200, "{:?}", reply.body);
            assert_eq!(prefill_worker(&reply), p);
        }
    }
    // Met by neither prefill engine: routed to the lowest predicted TTFT, and counted so.
    for i in 100..105 {
        let reply = r
            .complete(&[("x-kvroute-slo-ttft-ms", "0.001")], &body(i))
            .await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        assert_eq!(prefill_worker(&reply), "p0");
    }
    // Met by both: the best fit, the slow engine, keeps the fast one free (without the
    // targets, idle engines without the prompt tie, and either takes it).
    for i in 200..205 {
        let headers = [
            ("x-kvroute-slo-ttft-ms", "1000000"),
            ("x-llm-d-slo-tpot-ms", "1000000"),
        ];
        let reply = r.complete(&headers, &body(i)).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        assert_eq!(prefill_worker(&reply), "p1");
        assert!(reply.worker().starts_with('d'));
    }
    // A stream's TPOT is counted when its guard drops, after its last byte.
    let tpot_met = "slo=\"tpot\",outcome=\"met\"";
    wait_until_async("the TPOT outcomes counted", || async {
        metric_value(&r.metrics().await, METRIC, tpot_met) == Some(5.0)
    })
    .await;
    let m = r.metrics().await;
    let count = |labels: &str| metric_value(&m, METRIC, labels).unwrap_or(0.0);
    assert_eq!(count("slo=\"ttft\",outcome=\"unattainable\""), 5.0, "{m}");
    assert_eq!(count("slo=\"ttft\",outcome=\"met\""), 5.0, "{m}");
    r.stop_idle().await;
}
