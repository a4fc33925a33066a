//! Per-request latency targets (SLO headers) with kvroute-sim engines of two speeds: once the
//! ranks' latency models have learnt them, a tight TTFT target goes to the fast engine and a
//! loose one leaves it (best fit), an unattainable one is routed to the fastest and counted, or
//! refused with `--slo-shed`, and a malformed target is a 400. Targets are set from the
//! router's own predictions (`/debug/route`), never from wall-clock times, and every outcome
//! asserted is one the timings cannot change.

mod support;

use kvroute_core::PolicyKind;
use kvroute_gateway::Settings;
use serde_json::{json, Value};
use support::*;
use tokio_util::sync::CancellationToken;

const METRIC: &str = "kvroute_slo_requests_total";

/// The fast engine (`sim0`, 50 times the slow one's speed) and the slow one (`sim1`).
async fn engines(shutdown: &CancellationToken) -> Vec<String> {
    vec![
        serve_sim(&["--speedup", "10"], shutdown).await,
        serve_sim(&["--speedup", "0.2"], shutdown).await,
    ]
}

/// A streamed prompt of ~2,000 tokens no other request shares.
fn body(i: u64) -> String {
    let prompt = format!("{i} {}", text(2000, 7000 + i));
    json!({"prompt": prompt, "max_tokens": 4, "stream": true}).to_string()
}

/// Each engine answers `n` streams, pinned, so that its rank's latency models learn it.
async fn learn(r: &TestRouter, n: u64) {
    for i in 0..n {
        for id in ["sim0", "sim1"] {
            let reply = r.complete(&[("x-kvroute-worker", id)], &body(i)).await;
            assert_eq!(reply.status, 200, "{:?}", reply.body);
        }
    }
}

/// `/debug/route` for request `i` with `headers`.
async fn debug(r: &TestRouter, headers: &[(&str, &str)], i: u64) -> Value {
    let reply = post(&r.url, "/debug/route", headers, &body(i)).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    reply.json()
}

fn candidate<'a>(d: &'a Value, worker: &str) -> &'a Value {
    d["candidates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["worker"] == worker)
        .unwrap()
}

fn predicted_ttft(d: &Value, worker: &str) -> f64 {
    candidate(d, worker)["predicted"]["ttft_ms"]
        .as_f64()
        .unwrap()
}

#[tokio::test]
async fn tight_targets_take_the_fast_engine_loose_ones_leave_it_and_misses_are_counted() {
    let shutdown = CancellationToken::new();
    let r = TestRouter::start(sim_settings(&engines(&shutdown).await, PolicyKind::KvAware)).await;
    learn(&r, 12).await;
    let d = debug(&r, &[], 100).await;
    let (fast, slow) = (predicted_ttft(&d, "sim0"), predicted_ttft(&d, "sim1"));
    assert!(fast * 4.0 < slow, "the models did not learn: {fast} {slow}");
    // Between the two: only the fast engine meets it.
    let tight = format!("{:.3}", (fast * slow).sqrt());
    for (i, h) in (200..).zip(["x-llm-d-slo-ttft-ms", "x-sgl-ttft-slo-ms"]) {
        let reply = r.complete(&[(h, &tight)], &body(i)).await;
        assert_eq!(
            (reply.status.as_u16(), reply.worker()),
            (200, "sim0"),
            "{h}"
        );
    }
    // Met by both: the slow one fits best, and the fast one is left free.
    for i in 300..303 {
        let headers = [
            ("x-kvroute-slo-ttft-ms", "1000000"),
            ("x-llm-d-slo-tpot-ms", "1000000"),
        ];
        let reply = r.complete(&headers, &body(i)).await;
        assert_eq!((reply.status.as_u16(), reply.worker()), (200, "sim1"));
    }
    // Met by neither: routed anyway, to the lowest predicted TTFT, and counted.
    let reply = r
        .complete(&[("x-kvroute-slo-ttft-ms", "0.001")], &body(400))
        .await;
    assert_eq!((reply.status.as_u16(), reply.worker()), (200, "sim0"));
    // /debug/route shows the targets and each candidate's headroom.
    let headers = [
        ("x-kvroute-slo-ttft-ms", tight.as_str()),
        ("x-llm-d-slo-tpot-ms", "1000000"),
    ];
    let d = debug(&r, &headers, 500).await;
    assert_eq!(d["worker"], "sim0", "{d}");
    assert_eq!(d["slo"]["ttft_ms"].as_f64(), tight.parse().ok(), "{d}");
    assert_eq!(
        (&d["slo"]["ttft"], &d["slo"]["attainable"]),
        (&json!("meets"), &json!(true))
    );
    for (w, meets) in [("sim0", true), ("sim1", false)] {
        let c = candidate(&d, w);
        let h = c["headroom"]["ttft_ms"].as_f64().unwrap();
        let want =
            d["slo"]["ttft_ms"].as_f64().unwrap() - c["predicted"]["ttft_ms"].as_f64().unwrap();
        assert!((h - want).abs() < 1e-6, "{c}");
        assert_eq!(c["headroom"]["meets"], meets, "{c}");
        assert!(c["headroom"]["tpot_ms"].as_f64().unwrap() > 0.0, "{c}");
    }
    // A malformed target is a 400 naming its header.
    for bad in ["0", "-3", "soon"] {
        let reply = r.complete(&[("x-sgl-ttft-slo-ms", bad)], &body(600)).await;
        reply.assert_error(400, "invalid_hint");
        let message = reply.json()["error"]["message"].to_string();
        assert!(message.contains("x-sgl-ttft-slo-ms"), "{message}");
    }
    // Each request counted once per target: the tight ones met or missed, the loose ones met.
    let m = r.metrics().await;
    let ttft = |outcome: &str| {
        metric_value(&m, METRIC, &format!("slo=\"ttft\",outcome=\"{outcome}\"")).unwrap_or(-1.0)
    };
    assert_eq!(ttft("met") + ttft("missed"), 2.0 + 3.0, "{m}");
    assert!(ttft("met") >= 3.0, "{m}");
    assert_eq!((ttft("unattainable"), ttft("shed")), (1.0, 0.0), "{m}");
    assert_metric(&m, METRIC, "slo=\"tpot\",outcome=\"met\"", Some(3.0));
    r.stop().await;
    shutdown.cancel();
}

#[tokio::test]
async fn with_slo_shed_an_unattainable_request_is_refused_and_counted() {
    let shutdown = CancellationToken::new();
    let mut s: Settings = sim_settings(&engines(&shutdown).await, PolicyKind::KvAware);
    s.slo_shed = true;
    let r = TestRouter::start(s).await;
    // Faster than any prediction (the prior's TTFT is 25 ms and more, a step 1 ms and more).
    for headers in [
        &[("x-llm-d-slo-ttft-ms", "0.001")][..],
        &[
            ("x-kvroute-slo-ttft-ms", "0.001"),
            ("x-llm-d-slo-tpot-ms", "0.001"),
        ],
    ] {
        let reply = r.complete(headers, &body(1)).await;
        reply.assert_error(503, "slo_unattainable");
        assert_eq!(reply.headers["retry-after"], "1");
        let message = reply.json()["error"]["message"].to_string();
        assert!(message.contains("predicted TTFT"), "{message}");
    }
    // An attainable one is served.
    let reply = r
        .complete(&[("x-llm-d-slo-ttft-ms", "1000000")], &body(2))
        .await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    // /debug/route shows the verdict instead of refusing.
    let d = debug(&r, &[("x-llm-d-slo-ttft-ms", "0.001")], 3).await;
    assert_eq!(
        (&d["slo"]["ttft"], &d["slo"]["attainable"]),
        (&json!("unattainable"), &json!(false))
    );
    let m = r.metrics().await;
    assert_metric(&m, METRIC, "slo=\"ttft\",outcome=\"shed\"", Some(2.0));
    assert_metric(&m, METRIC, "slo=\"tpot\",outcome=\"shed\"", Some(1.0));
    assert_metric(&m, METRIC, "slo=\"ttft\",outcome=\"met\"", Some(1.0));
    r.stop().await;
    shutdown.cancel();
}
