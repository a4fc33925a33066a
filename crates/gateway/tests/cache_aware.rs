//! cache_aware and llm_d end to end, on kvroute-sim replicas.

mod support;

use std::collections::HashMap;
use std::sync::Arc;

use kvroute_core::PolicyKind;
use kvroute_gateway::{Settings, WorkerSpec};
use kvroute_tokenizer::Tokenizer;
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
            let args = <kvroute_sim::SimArgs as clap::Parser>::parse_from([
                "kvroute-sim",
                "--speedup",
                "100",
                "--instance-id",
                &id,
            ]);
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            urls.push(format!("http://{}", listener.local_addr().unwrap()));
            let server = kvroute_sim::SimServer::new(args, Arc::new(Tokenizer::fallback()));
            tokio::spawn(server.serve(listener, shutdown.clone()));
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
    let mut counts = HashMap::new();
    for i in 0..120 {
        let body = json!({"model": "kvroute-sim", "max_tokens": 2, "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": format!("question {i}: {}", text(40, i))},
        ]});
        let reply = post(&r.url, "/v1/chat/completions", &[], &body.to_string()).await;
        assert_eq!(reply.status, 200);
        *counts.entry(reply.worker().to_owned()).or_insert(0) += 1;
    }
    counts
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
    let counts = shared_prefix_run(&r).await;
    let mut v: Vec<usize> = counts.values().copied().collect();
    v.sort();
    assert_eq!(v, [60, 60], "{counts:?}");
    r.stop().await;
}

#[tokio::test]
async fn unrelated_prefixes_spread_under_cache_aware() {
    let e = Engines::start(2).await;
    let r = e.router(PolicyKind::CacheAware).await;
    let mut counts = HashMap::<String, usize>::new();
    for i in 0..20 {
        let body = json!({"model": "kvroute-sim", "max_tokens": 2, "prompt": text(500, 1000 + i)});
        let reply = post(&r.url, "/v1/completions", &[], &body.to_string()).await;
        *counts.entry(reply.worker().to_owned()).or_insert(0) += 1;
    }
    // A miss goes to the smallest tree: unrelated prompts alternate between the replicas.
    let mut v: Vec<usize> = counts.values().copied().collect();
    v.sort();
    assert_eq!(v, [10, 10], "{counts:?}");
    r.stop().await;
}

#[tokio::test]
async fn llm_d_learns_its_prefixes_and_reads_engine_metrics() {
    let e = Engines::start(2).await;
    let r = e.router(PolicyKind::LlmD).await;
    let prompt = text(2000, 7);
    let mut homes = HashMap::<String, usize>::new();
    for i in 0..10 {
        let body =
            json!({"model": "kvroute-sim", "max_tokens": 2, "prompt": format!("{prompt} {i}")});
        let reply = post(&r.url, "/v1/completions", &[], &body.to_string()).await;
        *homes.entry(reply.worker().to_owned()).or_insert(0) += 1;
    }
    assert_eq!(
        homes.len(),
        1,
        "the prefix scorer keeps a shared prompt on one replica: {homes:?}"
    );
    let d = post(
        &r.url,
        "/debug/route",
        &[],
        &json!({"model": "kvroute-sim", "prompt": format!("{prompt} x")}).to_string(),
    )
    .await
    .json();
    assert_eq!(d["policy"], "llm_d");
    assert_eq!(&d["worker"], homes.keys().next().unwrap().as_str());
    // The engines' /metrics are scraped: every candidate carries their readings.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let d = post(
            &r.url,
            "/debug/route",
            &[],
            &json!({"model": "kvroute-sim", "prompt": "x"}).to_string(),
        )
        .await
        .json();
        let read =
            d["candidates"].as_array().unwrap().iter().all(|c| {
                c["engine"]["kv_usage"].is_number() && c["engine"]["num_gpu_blocks"] == 16384
            });
        if read {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "engine metrics never read: {d}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    r.stop().await;
}
