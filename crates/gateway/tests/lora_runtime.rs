//! LoRA adapters loaded and unloaded at run time: kvroute-sim engines take vLLM's
//! `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`, and the router, re-reading each
//! worker's `/v1/models` after its health checks, routes an adapter while an engine lists it
//! and stops when none does, without a restart. A re-read that fails or is malformed keeps
//! the worker's last good list. And the predicted cost model learns an engine's adapter load
//! time from the streams that loaded one (shown in `/debug/route` beside the fitted speeds).

mod support;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::routing::get;
use kvroute_gateway::{Settings, WorkerSpec};
use serde_json::{json, Value};
use support::*;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Health checks (and so the re-reads of `/v1/models`) every 100 ms.
fn quick_checks(specs: Vec<WorkerSpec>) -> Settings {
    let mut s = Settings::with_workers(specs).unwrap();
    s.health.interval = Duration::from_millis(100);
    s
}

fn completion(model: &str, seed: u64) -> String {
    json!({"model": model, "prompt": text(100, seed), "max_tokens": 2}).to_string()
}

#[tokio::test]
async fn an_adapter_loaded_at_run_time_is_routed_to_its_engine_and_dropped_once_unloaded() {
    let shutdown = CancellationToken::new();
    let mut specs = Vec::new();
    let mut urls = Vec::new();
    for i in 0..2 {
        let url = serve_sim(&["--enable-lora", "--max-loras", "2"], &shutdown).await;
        urls.push(url.clone());
        specs.push(WorkerSpec {
            id: Some(format!("sim{i}")),
            ..WorkerSpec::url(url)
        });
    }
    let r = TestRouter::start(quick_checks(specs)).await;
    assert_eq!(r.model_ids().await, ["kvroute-sim"]);
    assert_eq!(r.complete(&[], &completion("poetry", 0)).await.status, 404);
    // Loaded on sim1 at run time: the router sees it without a restart, and sends its
    // requests there (the only engine that serves it).
    let load = json!({"lora_name": "poetry", "lora_path": "/adapters/poetry"}).to_string();
    let loaded = post(&urls[1], "/v1/load_lora_adapter", &[], &load).await;
    assert_eq!(loaded.status, 200, "{:?}", loaded.body);
    wait_until_async("the router lists the loaded adapter", || async {
        r.model_ids().await == ["kvroute-sim", "poetry"]
    })
    .await;
    for i in 0..3 {
        let reply = r.complete(&[], &completion("poetry", i)).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        assert_eq!(reply.worker(), "sim1");
        assert_eq!(reply.json()["model"], "poetry");
    }
    let body = json!({"model": "poetry", "prompt": "which engine"}).to_string();
    let decision = post(&r.url, "/debug/route", &[], &body).await.json();
    let fits = adapter_fits(&decision);
    assert_eq!(fits.len(), 1, "{decision}");
    assert_eq!(fits[0].0, "sim1");
    assert_ne!(fits[0].1, "-", "{decision}");
    // Unloaded: the router stops listing and routing it.
    let unload = json!({"lora_name": "poetry"}).to_string();
    let unloaded = post(&urls[1], "/v1/unload_lora_adapter", &[], &unload).await;
    assert_eq!(unloaded.status, 200, "{:?}", unloaded.body);
    wait_until_async("the router drops the unloaded adapter", || async {
        r.model_ids().await == ["kvroute-sim"]
    })
    .await;
    assert_eq!(r.complete(&[], &completion("poetry", 9)).await.status, 404);
    // The base model was served throughout.
    let base = r.complete(&[], &completion("kvroute-sim", 10)).await;
    assert_eq!(base.status, 200, "{:?}", base.body);
    shutdown.cancel();
}

/// An engine whose `/v1/models` answers `models` (counting the reads) and whose health
/// check passes.
#[derive(Clone, Default)]
struct Listing {
    models: Arc<Mutex<String>>,
    reads: Arc<AtomicUsize>,
}

async fn serve_listing(listing: Listing) -> String {
    async fn models(State(l): State<Listing>) -> ([(&'static str, &'static str); 1], String) {
        l.reads.fetch_add(1, Ordering::SeqCst);
        let body = l.models.lock().unwrap().clone();
        ([("content-type", "application/json")], body)
    }
    let app = axum::Router::new()
        .route("/v1/models", get(models))
        .route("/health", get(|| async { "ok" }))
        .with_state(listing);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

#[tokio::test]
async fn a_malformed_models_answer_at_a_re_read_keeps_the_last_good_list() {
    let listing = Listing::default();
    let with_sql = r#"{"object":"list","data":[{"id":"base"},{"id":"sql","parent":"base"}]}"#;
    *listing.models.lock().unwrap() = with_sql.to_owned();
    let url = serve_listing(listing.clone()).await;
    let spec = WorkerSpec {
        id: Some("engine".to_owned()),
        ..WorkerSpec::url(url)
    };
    let r = TestRouter::start(quick_checks(vec![spec])).await;
    assert_eq!(r.model_ids().await, ["base", "sql"]);
    let failures = |text: &str| {
        metric_value(
            text,
            "kvroute_worker_model_list_failures_total",
            r#"worker="engine""#,
        )
        .unwrap_or(0.0)
    };
    assert_eq!(failures(&r.metrics().await), 0.0);
    // Garbage, then a list with no model, then a 200 that is not JSON at all: each re-read
    // fails, is counted, and the models stay.
    for (i, bad) in [
        r#"{"data": "nope"}"#,
        r#"{"data": []}"#,
        "<html>oops</html>",
    ]
    .iter()
    .enumerate()
    {
        *listing.models.lock().unwrap() = (*bad).to_owned();
        let reads = listing.reads.load(Ordering::SeqCst);
        wait_until_async("a re-read of the malformed list", || async {
            listing.reads.load(Ordering::SeqCst) >= reads + 2
                && failures(&r.metrics().await) >= (i + 1) as f64
        })
        .await;
        assert_eq!(r.model_ids().await, ["base", "sql"], "after {bad}");
        let body = json!({"model": "sql", "prompt": "still here"}).to_string();
        let decision = post(&r.url, "/debug/route", &[], &body).await;
        assert_eq!(decision.status, 200, "after {bad}: {:?}", decision.body);
    }
    let status = r.gateway.workers().statuses();
    assert!(status[0].healthy, "a bad list is not a failed health check");
    // A good list again is taken: the adapter unloaded meanwhile goes.
    *listing.models.lock().unwrap() = r#"{"data":[{"id":"base"}]}"#.to_owned();
    wait_until_async("the router takes the good list", || async {
        r.model_ids().await == ["base"]
    })
    .await;
}

#[tokio::test]
async fn the_router_learns_an_engines_adapter_load_time_from_its_streams() {
    let shutdown = CancellationToken::new();
    let argv = ["--lora-modules", "a", "b", "--max-loras", "1"];
    let url = serve_sim(&[&argv[..], &["--lora-load-ms", "300"]].concat(), &shutdown).await;
    let spec = WorkerSpec {
        id: Some("sim0".to_owned()),
        ..WorkerSpec::url(url)
    };
    let mut s = quick_checks(vec![spec]);
    s.policy_config.kv_aware.cost_model = kvroute_core::CostModel::Predicted;
    let r = TestRouter::start(s).await;
    let decide = |model: &'static str| {
        let body = json!({"model": model, "prompt": "which engine"}).to_string();
        let url = r.url.clone();
        async move { post(&url, "/debug/route", &[], &body).await.json() }
    };
    wait_until_async("the router reads the engine's adapters", || async {
        adapter_fits(&decide("a").await)[0].1 == "free_slot"
    })
    .await;
    let predicted = |d: &Value| d["candidates"][0]["predicted"].clone();
    let prior = predicted(&decide("a").await);
    assert_eq!(prior["fitted"]["adapter_load_ms"], 50.0, "{prior}");
    assert_eq!(prior["adapter_ms"], 50.0, "{prior}");
    // One slot, two adapters taking turns: each of their requests loads its adapter
    // (300 ms); the base model's between them load nothing, which tells the loads apart from
    // the TTFT's intercept.
    for i in 0..32u64 {
        let model = ["a", "kvroute-sim", "b", "kvroute-sim"][i as usize % 4];
        let body = json!({
            "model": model, "prompt": text(200, 100 + i), "max_tokens": 2, "stream": true,
        });
        let reply = r.complete(&[], &body.to_string()).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
    }
    let learned = predicted(&decide("a").await);
    let fitted = &learned["fitted"];
    assert!(
        fitted["adapter_load_observations"].as_u64().unwrap() >= 12,
        "{learned}"
    );
    let load_ms = fitted["adapter_load_ms"].as_f64().unwrap();
    // From the prior (50) towards the engine's 300 (223 ms measured after 16 loads).
    assert!((150.0..600.0).contains(&load_ms), "{learned}");
    shutdown.cancel();
}
