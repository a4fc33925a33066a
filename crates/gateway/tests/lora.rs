//! LoRA adapters end to end: kvroute-sim engines serving adapters (`--lora-modules`), read
//! by the router from their `/v1/models` and their `vllm:lora_requests_info`, under
//! `kv_aware`: an adapter's requests go where it is loaded.

mod support;

use kvroute_gateway::{Settings, WorkerSpec};
use serde_json::{json, Value};
use support::*;
use tokio_util::sync::CancellationToken;

/// The router's decision for a completion of `prompt` with `model`.
async fn route(r: &TestRouter, model: &str, prompt: &str) -> Value {
    let body = json!({"model": model, "prompt": prompt}).to_string();
    let reply = post(&r.url, "/debug/route", &[], &body).await;
    assert_eq!(reply.status, http::StatusCode::OK, "{:?}", reply.body);
    reply.json()
}

#[tokio::test]
async fn an_adapters_requests_go_to_the_engine_that_has_it_loaded() {
    let shutdown = CancellationToken::new();
    let argv = ["--lora-modules", "sql", "chat", "--max-loras", "2"];
    let mut specs = Vec::new();
    for i in 0..3 {
        let url = serve_sim(&argv, &shutdown).await;
        specs.push(WorkerSpec {
            id: Some(format!("sim{i}")),
            ..WorkerSpec::url(url)
        });
    }
    let r = TestRouter::start(Settings::with_workers(specs).unwrap()).await;
    // The router has probed the engines' models (sql is an adapter: it has a parent) and
    // read their adapters (none running, two slots each).
    wait_until_async("the router reads every engine's adapters", || async {
        let d = route(&r, "sql", "probe").await;
        adapter_fits(&d)
            .iter()
            .filter(|(_, f)| f == "free_slot")
            .count()
            == 3
    })
    .await;
    let ask = |i: usize| {
        json!({"model": "sql", "prompt": text(200, i as u64), "max_tokens": 2}).to_string()
    };
    let first = r.complete(&[], &ask(0)).await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    let home = first.worker().to_owned();
    assert_eq!(first.json()["model"], "sql");
    // Unrelated prompts (no shared prefix), same adapter: where it was loaded, every time
    // (without the adapter term equal loads would tie and spread them).
    for i in 1..8 {
        let reply = r.complete(&[], &ask(i)).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        assert_eq!(reply.worker(), home, "request {i}");
    }
    let d = route(&r, "sql", "another").await;
    for (worker, fit) in adapter_fits(&d) {
        let loaded = ["running", "resident", "queued"].contains(&fit.as_str());
        assert_eq!(loaded, worker == home, "{worker}: {fit}");
    }
    // The base model's requests name no adapter.
    let d = route(&r, "kvroute-sim", "plain").await;
    assert!(adapter_fits(&d).iter().all(|(_, f)| f == "-"), "{d}");
    // An adapter no engine serves: no worker serves that model.
    let body = json!({"model": "poetry", "prompt": "x", "max_tokens": 1}).to_string();
    assert_eq!(r.complete(&[], &body).await.status, 404);
    shutdown.cancel();
}
