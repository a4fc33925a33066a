//! A burst through router replicas: after one request has cached a long prefix on one
//! engine, 64 concurrent streaming requests sharing it, alternating over the given routers; meanwhile each engine's requests (running + waiting,
//! from its vLLM metrics) are sampled, and the most each engine held at once is printed. Run
//! by `bench/replica_burst.sh`.
//!
//!     cargo run --release -p kvroute-gateway --example replica_burst -- \
//!         ROUTER_URL[,ROUTER_URL...] ENGINE_URL[,ENGINE_URL...] [REQUESTS [PREFIX_CHARS]]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

type Http = Client<HttpConnector, Full<Bytes>>;

async fn get(client: &Http, url: &str) -> String {
    let req = http::Request::get(url)
        .body(Full::new(Bytes::new()))
        .unwrap();
    match client.request(req).await {
        Ok(r) => {
            String::from_utf8_lossy(&r.into_body().collect().await.unwrap().to_bytes()).into_owned()
        }
        Err(_) => String::new(),
    }
}

/// Waits (10 s at most) until `router` credits an engine with the prompt of `body`: the warm
/// request's KV events have reached it. Policies that do not score overlap return at once.
async fn wait_credited(client: &Http, router: &str, body: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::time::Instant::now() < deadline {
        let req = http::Request::post(format!("{router}/debug/route"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_owned())))
            .unwrap();
        let text = match client.request(req).await {
            Ok(r) => r
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default(),
            Err(_) => Bytes::new(),
        };
        let v: serde_json::Value = serde_json::from_slice(&text).unwrap_or_default();
        let candidates = v["candidates"].as_array().cloned().unwrap_or_default();
        let scored = candidates.iter().any(|c| c.get("overlap_blocks").is_some());
        let credited = candidates
            .iter()
            .any(|c| c["overlap_blocks"]["device"].as_u64().unwrap_or(0) > 0);
        if credited || (!candidates.is_empty() && !scored) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("warning: {router} never credited the warm prefix");
}

/// Requests on the engine now: running plus waiting, over its ranks.
fn held(metrics: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| {
            l.starts_with("vllm:num_requests_running") || l.starts_with("vllm:num_requests_waiting")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let routers: Vec<String> = args[0].split(',').map(str::to_owned).collect();
    let engines: Vec<String> = args[1].split(',').map(str::to_owned).collect();
    let requests: usize = args.get(2).map_or(64, |s| s.parse().unwrap());
    let prefix_len: usize = args.get(3).map_or(8000, |s| s.parse().unwrap());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let client: Http = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
        let prefix = kvroute_sim::text(prefix_len, 7);
        // One engine caches the prefix first (its KV events reach every router), as in a
        // cluster already serving the prompt: the burst then tempts every router to it.
        let warm = serde_json::json!({"model": "kvroute-sim", "prompt": format!("{prefix} warm"), "max_tokens": 1})
            .to_string();
        let req = http::Request::post(format!("{}/v1/completions", routers[0]))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(warm.clone())))
            .unwrap();
        if let Ok(r) = client.request(req).await {
            let _ = r.into_body().collect().await;
        }
        for router in &routers {
            wait_credited(&client, router, &warm).await;
        }
        let done = Arc::new(AtomicBool::new(false));
        let sampler = {
            let (client, engines, done) = (client.clone(), engines.clone(), done.clone());
            tokio::spawn(async move {
                let mut max = vec![0f64; engines.len()];
                while !done.load(Ordering::Relaxed) {
                    for (i, e) in engines.iter().enumerate() {
                        let h = held(&get(&client, &format!("{e}/metrics")).await);
                        max[i] = max[i].max(h);
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                max
            })
        };
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..requests {
            let url = format!("{}/v1/completions", routers[i % routers.len()]);
            let body = serde_json::json!({
                "model": "kvroute-sim",
                "prompt": format!("{prefix} question {i}: {}", kvroute_sim::text(200, 1000 + i as u64)),
                "max_tokens": 32,
                "stream": true,
            })
            .to_string();
            let client = client.clone();
            tasks.spawn(async move {
                let req = http::Request::post(url)
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from(body)))
                    .unwrap();
                match client.request(req).await {
                    Ok(r) if r.status() == 200 => r.into_body().collect().await.is_ok(),
                    _ => false,
                }
            });
        }
        let mut ok = 0;
        while let Some(r) = tasks.join_next().await {
            ok += usize::from(r.unwrap_or(false));
        }
        done.store(true, Ordering::Relaxed);
        let max = sampler.await.unwrap();
        let top = max.iter().cloned().fold(0.0, f64::max);
        println!(
            "{} routers, {requests} requests ({ok} ok): most held at once per engine {:?}, max {top}",
            routers.len(),
            max
        );
    });
}
