//! cache_aware and llm_d end to end, on kvroute-sim replicas.

mod support;

use std::collections::HashMap;

use kvroute_core::PolicyKind;
use kvroute_gateway::{Settings, WorkerSpec};
use serde_json::json;
use support::*;
use tokio_util::sync::CancellationToken;

/// kvroute-sim replicas on loopback (stopped when dropped).
struct Engines {
    urls: Vec<String>,
    shutdown: CancellationToken,
}

impl Engines {
    async fn start(n: usize) -> Engines {
        let shutdown = CancellationToken::new();
        let mut urls = Vec::new();
        for i in 0..n {
            let id = format!("sim{i}");
            let argv = ["--speedup", "100", "--instance-id", &id];
            urls.push(serve_sim(&argv, &shutdown).await);
        }
        Engines { urls, shutdown }
    }

    async fn router(&self, policy: PolicyKind) -> TestRouter {
        let mut s =
            Settings::with_workers(self.urls.iter().map(WorkerSpec::url).collect()).unwrap();
        s.policy = policy;
        TestRouter::start(s).await
    }
}

impl Drop for Engines {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// 120 serial chats opening with the same ~500 characters, each ending in its own question.
async fn shared_prefix_run(r: &TestRouter) -> HashMap<String, usize> {
    let system = format!("You are a helpful assistant. {}", text(470, 42));
    let chats = (0..120).map(|i| {
        json!({"model": "kvroute-sim", "max_tokens": 2, "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": format!("question {i}: {}", text(40, i))},
        ]})
        .to_string()
    });
    r.tally_routes("/v1/chat/completions", chats).await
}

/// A completion of `prompt` for the replicas.
fn completion(prompt: &str) -> String {
    json!({"model": "kvroute-sim", "max_tokens": 2, "prompt": prompt}).to_string()
}

/// `POST /debug/route` for `prompt`: the router's decision.
async fn dry_run(r: &TestRouter, prompt: &str) -> serde_json::Value {
    let body = json!({"model": "kvroute-sim", "prompt": prompt}).to_string();
    r.post("/debug/route", &[], &body).await.json()
}

#[tokio::test]
async fn a_shared_prefix_sticks_under_cache_aware_and_splits_under_round_robin() {
    let e = Engines::start(2).await;
    let r = e.router(PolicyKind::CacheAware).await;
    let counts = shared_prefix_run(&r).await;
    assert_eq!(
        counts.len(),
        1,
        "cache_aware sent a shared prefix to one replica: {counts:?}"
    );
    assert_eq!(counts.values().sum::<usize>(), 120);
    r.stop().await;
    let r = e.router(PolicyKind::RoundRobin).await;
    assert_spread(&shared_prefix_run(&r).await, &[60, 60]);
    r.stop().await;
}

#[tokio::test]
async fn unrelated_prefixes_spread_under_cache_aware() {
    let e = Engines::start(2).await;
    let r = e.router(PolicyKind::CacheAware).await;
    let prompts = (0..20).map(|i| completion(&text(500, 1000 + i)));
    let counts = r.tally_routes("/v1/completions", prompts).await;
    // A miss goes to the smallest tree: unrelated prompts alternate between the replicas.
    assert_spread(&counts, &[10, 10]);
    r.stop().await;
}

#[tokio::test]
async fn llm_d_learns_its_prefixes_and_reads_engine_metrics() {
    let e = Engines::start(2).await;
    let r = e.router(PolicyKind::LlmD).await;
    let prompt = text(2000, 7);
    let prompts = (0..10).map(|i| completion(&format!("{prompt} {i}")));
    let homes = r.tally_routes("/v1/completions", prompts).await;
    assert_eq!(
        homes.len(),
        1,
        "the prefix scorer keeps a shared prompt on one replica: {homes:?}"
    );
    let d = dry_run(&r, &format!("{prompt} x")).await;
    assert_eq!(d["policy"], "llm_d");
    assert_eq!(&d["worker"], homes.keys().next().unwrap().as_str());
    // The engines' /metrics are scraped: every candidate carries their readings.
    wait_until_async("engine metrics on every candidate", || async {
        let d = dry_run(&r, "x").await;
        d["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .all(|c| c["engine"]["kv_usage"].is_number() && c["engine"]["num_gpu_blocks"] == 16384)
    })
    .await;
    r.stop().await;
}
