//! A burst that oversubscribes 4 simulated replicas, with and without the router's queue.
//!
//!     cargo run --release -p kvroute-gateway --example queue_burst [-- REQUESTS]
//!
//! 4 in-process kvroute-sim replicas (`--max-num-batched-tokens 2048`, `--speedup 10`), then
//! REQUESTS (default 160) streaming completions of 2,000 unique tokens and 16 output tokens,
//! all sent at once through kvroute (kv_aware): once without a queue, once with
//! `--router-queue-threshold 1.0`; TTFT p50/p90/p99 as the clients see it. Then the same burst
//! with two policy classes, weights 3 and 1, half the requests in each: the share of each
//! class among the first half of the requests to be let through.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvroute_core::queue::{PolicyClass, QueueOrder};
use kvroute_core::PolicyKind;
use kvroute_gateway::config::QueueSettings;
use kvroute_gateway::{Gateway, Settings, WorkerSpec};
use kvroute_tokenizer::Tokenizer;
use tokio_util::sync::CancellationToken;

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 * p) as usize).min(v.len() - 1)]
}

async fn router(
    workers: &[WorkerSpec],
    queue: Option<QueueSettings>,
) -> (String, CancellationToken) {
    let mut s = Settings::with_workers(workers.to_vec()).unwrap();
    s.policy = PolicyKind::KvAware;
    s.queue = queue;
    s.request_timeout = Duration::from_secs(600);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metrics = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let mut registry = prometheus_client::registry::Registry::default();
    let gw = Gateway::new(s, &mut registry);
    let shutdown = CancellationToken::new();
    tokio::spawn(
        gw.clone()
            .serve(listener, metrics, Arc::new(registry), shutdown.clone()),
    );
    gw.wait_ready().await;
    (url, shutdown)
}

/// Sends the burst; returns (TTFT seconds, class, time the first token arrived) per request.
async fn burst(
    url: &str,
    n: usize,
    seed: u64,
    classes: Option<(&'static str, &'static str)>,
) -> Vec<(f64, usize, Instant)> {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..n {
        let (client, url) = (client.clone(), url.to_owned());
        let class = i % 2;
        let header = classes.map(|(a, b)| if class == 0 { a } else { b });
        tasks.push(tokio::spawn(async move {
            let body = serde_json::json!({"model": "kvroute-sim", "prompt": kvroute_sim::text(2000, seed * 100_000 + i as u64), "max_tokens": 16, "stream": true});
            let mut req = http::Request::post(format!("{url}/v1/completions")).header("content-type", "application/json");
            if let Some(h) = header {
                req = req.header("x-kvroute-class", h);
            }
            let resp = client.request(req.body(Full::new(Bytes::from(body.to_string()))).unwrap()).await.unwrap();
            assert_eq!(resp.status(), 200);
            let mut body = resp.into_body();
            let _ = body.frame().await;
            let first = Instant::now();
            while body.frame().await.is_some() {}
            (first.duration_since(start).as_secs_f64(), class, first)
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

#[tokio::main]
async fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(160);
    let shutdown = CancellationToken::new();
    let mut workers = Vec::new();
    for i in 0..4 {
        let args = <kvroute_sim::SimArgs as clap::Parser>::parse_from([
            "kvroute-sim",
            "--speedup",
            "10",
            "--max-num-batched-tokens",
            "2048",
            "--seed",
            &i.to_string(),
        ]);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        workers.push(WorkerSpec {
            max_num_batched_tokens: Some(2048),
            ..WorkerSpec::url(format!("http://{}", listener.local_addr().unwrap()))
        });
        let server = kvroute_sim::SimServer::new(args, Arc::new(Tokenizer::fallback()));
        tokio::spawn(server.serve(listener, shutdown.clone()));
    }
    let default_class = vec![PolicyClass {
        name: "default".into(),
        weight: 1,
        max_queued: None,
    }];
    for (label, queue) in [
        ("no queue", None),
        (
            "queue 1.0",
            Some(QueueSettings {
                threshold: 1.0,
                order: QueueOrder::Fcfs,
                timeout: Duration::from_secs(600),
                class_thresholds: vec![Default::default()],
                sharing: Default::default(),
                classes: default_class.clone(),
            }),
        ),
        (
            "queue 1.0 wspt",
            Some(QueueSettings {
                threshold: 1.0,
                order: QueueOrder::Wspt,
                timeout: Duration::from_secs(600),
                class_thresholds: vec![Default::default()],
                sharing: Default::default(),
                classes: default_class.clone(),
            }),
        ),
    ] {
        let (url, stop) = router(&workers, queue).await;
        let mut ttft: Vec<f64> = burst(&url, n, 1 + label.len() as u64, None)
            .await
            .into_iter()
            .map(|x| x.0)
            .collect();
        println!(
            "{label:<15} requests={n} TTFT p50={:.3}s p90={:.3}s p99={:.3}s",
            pct(&mut ttft, 0.5),
            pct(&mut ttft, 0.9),
            pct(&mut ttft, 0.99)
        );
        stop.cancel();
    }
    let classes = vec![
        PolicyClass {
            name: "interactive".into(),
            weight: 3 * 2000,
            max_queued: None,
        },
        PolicyClass {
            name: "batch".into(),
            weight: 2000,
            max_queued: None,
        },
    ];
    let (url, stop) = router(
        &workers,
        Some(QueueSettings {
            threshold: 1.0,
            order: QueueOrder::Fcfs,
            timeout: Duration::from_secs(600),
            class_thresholds: vec![Default::default(); 2],
            sharing: Default::default(),
            classes,
        }),
    )
    .await;
    let mut results = burst(&url, n, 99, Some(("interactive", "batch"))).await;
    results.sort_by_key(|r| r.2);
    let half = &results[..n / 2];
    let interactive = half.iter().filter(|r| r.1 == 0).count();
    println!(
        "classes weights 3:1, {n} requests half in each: the first {} let through were {} interactive, {} batch ({:.0}% / {:.0}%)",
        n / 2,
        interactive,
        n / 2 - interactive,
        100.0 * interactive as f64 / (n / 2) as f64,
        100.0 * (n / 2 - interactive) as f64 / (n / 2) as f64
    );
    stop.cancel();
    shutdown.cancel();
}
