//! Replay through a real kvroute in front of real kvroute-sim replicas; with tenants, each
//! request's tenant header reaches the router, which counts it under that tenant.

use std::sync::Arc;
use std::time::Duration;

use kvroute_bench::replay::{replay, ReplayConfig};
use kvroute_bench::tenants::{split, TenantSplit};
use kvroute_bench::trace::TraceRequest;
use kvroute_gateway::{Gateway, Settings, WorkerSpec};
use kvroute_sim::{SimArgs, SimInstance};
use kvroute_tokenizer::Tokenizer;
use tokio_util::sync::CancellationToken;

/// POSTs `body` as JSON; the answer's JSON (null when it is none).
async fn post(base: &str, path: &str, body: &serde_json::Value) -> serde_json::Value {
    use http_body_util::BodyExt;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build(hyper_util::client::legacy::connect::HttpConnector::new());
    let req = http::Request::post(format!("{base}{path}"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes())
        .unwrap_or_default()
}

/// A kvroute-sim replica 50x faster than real time, publishing KV events, and their endpoint.
/// It binds its KV-event port itself, so another test may take it first: then another is
/// tried.
async fn sim() -> (SimInstance, String) {
    let mut error = None;
    for _ in 0..20 {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let events = format!("tcp://127.0.0.1:{port}");
        let args = <SimArgs as clap::Parser>::parse_from([
            "kvroute-sim",
            "--speedup",
            "50",
            "--kv-events-endpoint",
            &events,
        ]);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        match SimInstance::start(args, Arc::new(Tokenizer::fallback()), listener).await {
            Ok(sim) => return (sim, events),
            Err(e) => error = Some(e),
        }
    }
    panic!("no sim could bind a KV-event port: {error:?}");
}

/// GETs `path`; the body as text.
async fn get(base: &str, path: &str) -> String {
    use http_body_util::BodyExt;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build(hyper_util::client::legacy::connect::HttpConnector::new());
    let req = http::Request::get(format!("{base}{path}"))
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    let resp = client.request(req).await.unwrap();
    String::from_utf8_lossy(&resp.into_body().collect().await.unwrap().to_bytes()).into_owned()
}

/// Whether the router at `router` credits worker `id` with some device blocks of `prompt`.
async fn credited(router: &str, prompt: &str, id: &str) -> bool {
    let d = post(
        router,
        "/debug/route",
        &serde_json::json!({"prompt": prompt}),
    )
    .await;
    d["candidates"].as_array().is_some_and(|c| {
        c.iter()
            .any(|c| c["worker"] == id && c["overlap_blocks"]["device"].as_u64().unwrap_or(0) > 0)
    })
}

/// Waits until the router at `router` receives the KV events of worker `id`, the engine at
/// `engine` (ZMQ subscribers join asynchronously, and what was published before is lost):
/// probes go straight to the engine until the router's index credits one.
async fn joined(router: &str, engine: &str, id: &str) {
    for k in 0..400 {
        let probe = format!("probe {id} {k} ").repeat(8);
        let body = serde_json::json!({"prompt": probe, "max_tokens": 1});
        post(engine, "/v1/completions", &body).await;
        // The probe's events reach the index a moment later, or never (published before the
        // subscriber joined): then the next probe tries again.
        let deadline = tokio::time::Instant::now() + Duration::from_millis(100);
        loop {
            if credited(router, &probe, id).await {
                return;
            }
            if tokio::time::Instant::now() >= deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    panic!("the router never received {id}'s events");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_trace_replays_through_kvroute_with_cache_hits() {
    let mut sims = Vec::new();
    let mut workers = Vec::new();
    for i in 0..2 {
        let (sim, events) = sim().await;
        workers.push(WorkerSpec {
            id: Some(format!("w{i}")),
            kv_events: Some(events),
            ..WorkerSpec::url(sim.url())
        });
        sims.push(sim);
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metrics = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics_url = format!("http://{}", metrics.local_addr().unwrap());
    let mut settings = Settings::with_workers(workers).unwrap();
    // `--trust-tenant-header`, smg's header.
    settings.tenancy.tenant_header = Some(http::HeaderName::from_static("x-smg-tenant-id"));
    let gw = Gateway::new(settings, &mut registry);
    let shutdown = CancellationToken::new();
    tokio::spawn(
        gw.clone()
            .serve(listener, metrics, Arc::new(registry), shutdown.clone()),
    );
    tokio::time::timeout(Duration::from_secs(30), gw.wait_ready())
        .await
        .unwrap();
    // Probe each replica until the router's index credits it, so no event of the trace is
    // lost.
    for (i, sim) in sims.iter().enumerate() {
        joined(&url, &sim.url(), &format!("w{i}")).await;
    }

    // 30 requests in 3 conversations that grow turn by turn (shared leading hash ids), far
    // enough apart that each is served before the next arrives.
    let trace: Vec<TraceRequest> = (0..30u64)
        .map(|i| TraceRequest {
            timestamp: i * 150,
            input_length: 512 * (2 + i as usize / 3) - 100,
            output_length: 4,
            hash_ids: (0..(2 + i / 3)).map(|k| (i % 3) * 1000 + k).collect(),
        })
        .collect();
    // Two tenants by conversation; scale 1 leaves the trace as it is.
    let (same, of) = split(
        &trace,
        TenantSplit {
            tenants: 2,
            heavy_scale: 1,
        },
    );
    assert_eq!(same, trace);
    let r = replay(
        &trace,
        &ReplayConfig {
            urls: vec![url],
            model: None,
            extra_body: Default::default(),
            hash_block: 512,
            rate_scale: 1.0,
            max_concurrency: 16,
            duration: None,
            progress: false,
            tenants: Some(of.clone().into()),
            tenant_header: ReplayConfig::DEFAULT_TENANT_HEADER.into(),
        },
    )
    .await;
    assert_eq!((r.requests, r.errors), (30, 0), "{r:?}");
    assert_eq!(r.requests_per_worker.values().sum::<usize>(), 30);
    assert!(r.ttft_ms.p50 > 0.0 && r.e2e_ms.p99 >= r.ttft_ms.p99);
    assert!(
        r.hit_share > 0.2,
        "conversations reuse their prefixes: {r:?}"
    );
    assert!(r.output_tokens_per_s > 0.0);
    assert_eq!(r.short_streams, 0, "kvroute-sim streams a chunk per token");

    // Each tenant's figures, and the router saw each request's tenant in its header.
    let sent = |t: u32| of.iter().filter(|&&x| x == t).count();
    assert!(
        sent(0) > 0 && sent(1) > 0,
        "both tenants have requests: {of:?}"
    );
    let names: Vec<&str> = r.tenants.iter().map(|t| t.tenant.as_str()).collect();
    assert_eq!(names, ["tenant-0", "tenant-1"]);
    let counted = get(&metrics_url, "/metrics").await;
    for (t, figures) in r.tenants.iter().enumerate() {
        assert_eq!(
            (figures.requests, figures.answered),
            (sent(t as u32), sent(t as u32))
        );
        assert!(figures.ttft_ms.p50 > 0.0 && figures.ttft_ms.p99 >= figures.ttft_ms.p50);
        let line = format!(
            "kvroute_tenant_requests_total{{tenant=\"header:tenant-{t}\",status=\"200\"}} {}",
            sent(t as u32)
        );
        assert!(counted.contains(&line), "{line} not in\n{counted}");
    }

    // The virtual-time path agrees: the same trace and engines (the replicas run 50x fast,
    // so in engine time the requests arrive 50x further apart).
    let sim = kvroute_bench::simulate::simulate(
        &trace,
        &kvroute_bench::simulate::SimConfig {
            cluster: kvroute_bench::simulate::Cluster::Aggregated {
                workers: 2,
                policy: kvroute_core::PolicyKind::KvAware,
                policy_config: kvroute_core::PolicyConfig::default(),
            },
            engine: kvroute_sim::engine::EngineConfig::default(),
            hash_block: 512,
            vocab: 26,
            rate_scale: 1.0 / 50.0,
            seed: 0,
            queue: None,
            tenants: None,
            shapes: Default::default(),
            loras: 0,
            slo: None,
            output_blocks: None,
            sample_ranks: None,
            ttft_oracle: false,
            metrics_refresh: None,
        },
    );
    assert!(
        (sim.hit_share - r.hit_share).abs() < 0.05,
        "virtual {:.3} vs real {:.3}",
        sim.hit_share,
        r.hit_share
    );
    shutdown.cancel();
}
