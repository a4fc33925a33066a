//! kvroute as the endpoint picker behind a real Envoy (ext_proc v3, GIE's processing mode):
//! requests land where kvroute picked, bodies and streams pass whole and as streams, errors
//! are the proxy's, in-flight counts are released, gRPC health answers, and the default TLS
//! serving works behind Envoy's TLS upstream.

mod support;

use std::time::Duration;

use http::{Method, StatusCode};
use http_body_util::{BodyExt, Full};
use kvroute_core::PolicyKind;
use kvroute_gateway::config::{EppEndpoints, EppServing, EppSettings};
use kvroute_gateway::epp::serve::EppListeners;
use kvroute_gateway::Settings;
use serde_json::{json, Value};
use tokio::net::TcpListener;

use support::*;

/// A router serving as the picker (`serving`), and its ext_proc and health ports.
async fn picker(mut settings: Settings, serving: EppServing) -> (TestRouter, u16, u16) {
    settings.epp = Some(EppSettings {
        grpc_port: 0,
        grpc_health_port: 0,
        serving,
        endpoints: EppEndpoints::Static,
        kv_events_port: None,
    });
    let router = TestRouter::start(settings).await;
    let grpc = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let health = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let ports = (
        grpc.local_addr().unwrap().port(),
        health.local_addr().unwrap().port(),
    );
    router
        .gateway
        .serve_epp(EppListeners { grpc, health })
        .expect("the picker serves");
    (router, ports.0, ports.1)
}

/// Two simulated engines behind Envoy and kvroute (kv_aware, KV events from the engines).
async fn sims_behind_envoy() -> (Vec<kvroute_sim::SimInstance>, TestRouter, Envoy) {
    sims_behind_envoy_with(|s| s.policy = PolicyKind::KvAware).await
}

/// [`sims_behind_envoy`] with the settings as `set` makes them.
async fn sims_behind_envoy_with(
    set: impl FnOnce(&mut Settings),
) -> (Vec<kvroute_sim::SimInstance>, TestRouter, Envoy) {
    let mut sims = Vec::new();
    let mut specs = Vec::new();
    for i in 0..2 {
        let (sim, events) = sim_with_events(|events| {
            <kvroute_sim::SimArgs as clap::Parser>::parse_from([
                "kvroute-sim",
                "--kv-events-endpoint",
                events,
            ])
        })
        .await;
        let mut spec = named_spec(&format!("sim{i}"), "kvroute-sim", sim.url());
        spec.kv_events = Some(events);
        specs.push(spec);
        sims.push(sim);
    }
    let mut settings = Settings::with_workers(specs).unwrap();
    set(&mut settings);
    let (router, grpc, _) = picker(settings, EppServing::H2c).await;
    for (i, sim) in sims.iter().enumerate() {
        joined(&router, &sim.url(), &format!("sim{i}")).await;
    }
    let envoy = Envoy::start("envoy.yaml", &[grpc]).await;
    (sims, router, envoy)
}

fn completion(prompt: &str) -> String {
    json!({"model": "kvroute-sim", "prompt": prompt, "max_tokens": 2}).to_string()
}

fn long_prompt(seed: &str) -> String {
    format!(
        "{seed} {}",
        "the quick brown fox jumps over the lazy dog. ".repeat(40)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_land_where_kvroute_picked_and_a_shared_prefix_stays_on_its_engine() {
    let (sims, router, envoy) = sims_behind_envoy().await;
    let urls: Vec<String> = sims.iter().map(|s| s.url()).collect();
    let probes: Vec<u64> =
        futures_util::future::join_all(urls.iter().map(|u| engine_requests(u))).await;
    // Requests land on the endpoint kvroute named, and its counters agree with the engines.
    for i in 0..6 {
        let reply = post(
            &envoy.url,
            "/v1/chat/completions",
            &[],
            &chat(
                "kvroute-sim",
                &format!("question {i}: {}", long_prompt(&i.to_string())),
            ),
        )
        .await;
        assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
        assert!(reply.worker().starts_with("sim"), "named by the picker");
    }
    let metrics = router.metrics().await;
    for (i, url) in urls.iter().enumerate() {
        let picked = metric(
            &metrics,
            "kvroute_processed_requests_total",
            &format!("sim{i}"),
        );
        let served = engine_requests(url).await - probes[i];
        assert_eq!(
            picked, served,
            "sim{i}: picks {picked}, engine served {served}"
        );
    }

    // kv_aware keeps a shared prefix on the engine that cached it: the engine's own cached
    // tokens are the proof.
    let shared = long_prompt("a shared system prompt");
    let first = post(
        &envoy.url,
        "/v1/completions",
        &[],
        &completion(&format!("{shared} first question")),
    )
    .await;
    assert_eq!(first.status, StatusCode::OK);
    let home = first.worker().to_owned();
    wait_overlap(&router, &format!("{shared} again"), &home, |n| {
        n.is_some_and(|n| n > 0)
    })
    .await;
    for i in 0..3 {
        let reply = post(
            &envoy.url,
            "/v1/completions",
            &[],
            &completion(&format!("{shared} question {i}")),
        )
        .await;
        assert_eq!(reply.status, StatusCode::OK);
        assert_eq!(reply.worker(), home, "the prefix's engine");
        let cached = reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        assert!(
            cached >= 256,
            "the engine served the prefix from its cache: {cached}"
        );
    }
    drop(envoy);
    router.stop().await;
}

/// The requests an engine counts as served (its TTFT histogram's count, summed).
async fn engine_requests(url: &str) -> u64 {
    let text = scrape(url).await;
    text.lines()
        .filter(|l| l.starts_with("vllm:time_to_first_token_seconds_count"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

fn metric(text: &str, name: &str, worker: &str) -> u64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(&format!("worker=\"{worker}\"")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Settings for `workers`, each known by its name.
fn named(workers: &[MockWorker]) -> Settings {
    let specs = workers
        .iter()
        .map(|w| named_spec(&w.name, "m", w.url.clone()))
        .collect();
    Settings::with_workers(specs).unwrap()
}

/// A picker over mock engines behind Envoy.
async fn mocks_behind_envoy(names: &[&str]) -> (Vec<MockWorker>, TestRouter, Envoy) {
    let mut workers = Vec::new();
    for name in names {
        workers.push(MockWorker::start(name, &["m"]).await);
    }
    let (router, grpc, _) = picker(named(&workers), EppServing::H2c).await;
    let envoy = Envoy::start("envoy.yaml", &[grpc]).await;
    (workers, router, envoy)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_body_arrives_whole_and_gie_headers_do_not_go_on() {
    let (_workers, router, envoy) = mocks_behind_envoy(&["a", "b"]).await;
    let prompt = "x".repeat(160_000);
    let body = json!({"model": "m", "prompt": prompt}).to_string();
    assert!(body.len() > 150_000);
    let reply = post(
        &envoy.url,
        "/v1/completions",
        &[
            ("x-gateway-inference-fairness-id", "team-a"),
            ("x-gateway-destination-endpoint", "10.9.9.9:1"),
        ],
        &body,
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    let echoed = reply.json();
    let received: Value = serde_json::from_str(echoed["body"].as_str().unwrap()).unwrap();
    assert_eq!(received["prompt"].as_str().unwrap().len(), 160_000, "whole");
    assert_eq!(echoed["worker"].as_str().unwrap(), reply.worker());
    let headers = &echoed["headers"];
    assert!(
        headers.get("x-gateway-inference-fairness-id").is_none(),
        "GIE's headers are stripped: {headers}"
    );
    drop(envoy);
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_streams_and_a_client_gone_mid_stream_releases_it() {
    let (workers, router, envoy) = mocks_behind_envoy(&["a"]).await;
    let body = json!({"model": "m", "prompt": "hi", "stream": true, "max_tokens": 2});
    let request = http::Request::builder()
        .method(Method::POST)
        .uri(format!("{}/v1/completions", envoy.url))
        .header("content-type", "application/json")
        .body(Full::new(bytes::Bytes::from(body.to_string())))
        .unwrap();
    let response = client().request(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(response.headers()["x-kvroute-worker"], "a");
    let mut body = response.into_body();
    // The mock sends one chunk, then waits for a permit: the first chunk comes through while
    // the answer is not over.
    let first = tokio::time::timeout(Duration::from_secs(20), body.frame())
        .await
        .expect("the first chunk before the end")
        .unwrap()
        .unwrap();
    assert!(!first.data_ref().unwrap().is_empty());
    router.wait_in_flight("a", |n| n == 1).await;
    router
        .wait_metric("kvroute_worker_requests_active", "worker=\"a\"", Some(1.0))
        .await;
    // The client goes away: the picker's count is released.
    drop(body);
    router.wait_none_in_flight().await;
    router
        .wait_metric("kvroute_worker_requests_active", "worker=\"a\"", Some(0.0))
        .await;
    workers[0].release.add_permits(10);

    // A whole stream, to its end.
    workers[0].release.add_permits(10);
    let reply = post(&envoy.url, "/v1/completions", &[], &body_stream()).await;
    assert_eq!(reply.status, StatusCode::OK);
    let text = String::from_utf8_lossy(&reply.body);
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    router.wait_none_in_flight().await;
    drop(envoy);
    router.stop().await;
}

/// A completion for the mock engines through `envoy`, which must answer 200.
async fn complete_ok(envoy: &Envoy) -> Reply {
    let body = json!({"model": "m", "prompt": "hi"}).to_string();
    let reply = post(&envoy.url, "/v1/completions", &[], &body).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    reply
}

fn body_stream() -> String {
    json!({"model": "m", "prompt": "hello", "stream": true, "max_tokens": 3}).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_the_proxys_and_health_answers() {
    let (_workers, router, envoy) = mocks_behind_envoy(&["a"]).await;
    let reply = post(&envoy.url, "/v1/completions", &[], &chat("nosuch", "hi")).await;
    assert_eq!(reply.status, StatusCode::NOT_FOUND, "{:?}", reply.body);
    assert_eq!(reply.error_code(), "model_not_found");
    let reply = post(
        &envoy.url,
        "/v1/completions",
        &[("x-kvroute-required-taints", "gpu-none")],
        &json!({"model": "m", "prompt": "hi"}).to_string(),
    )
    .await;
    assert_eq!(
        reply.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{:?}",
        reply.body
    );
    assert_eq!(reply.error_code(), "no_endpoint");
    let reply = post(&envoy.url, "/v1/completions", &[], "{not json").await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    assert_eq!(reply.error_code(), "invalid_json");
    router.wait_none_in_flight().await;
    drop(envoy);
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_health_is_serving_for_every_name_llm_d_probes() {
    let worker = MockWorker::start("a", &["m"]).await;
    let (router, _, health) = picker(settings(&[&worker]), EppServing::H2c).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{health}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = tonic_health::pb::health_client::HealthClient::new(channel);
    for service in kvroute_gateway::epp::serve::HEALTH_SERVICES
        .iter()
        .chain(&["anything"])
    {
        let answer = client
            .check(tonic_health::pb::HealthCheckRequest {
                service: (*service).to_owned(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            answer.status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32,
            "{service}"
        );
    }
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_tls_serving_works_behind_envoys_tls_upstream() {
    let workers = [
        MockWorker::start("a", &["m"]).await,
        MockWorker::start("b", &["m"]).await,
    ];
    let (router, grpc, _) = picker(named(&workers), EppServing::SelfSigned).await;
    let envoy = Envoy::start("envoy-tls.yaml", &[grpc]).await;
    for _ in 0..4 {
        let reply = complete_ok(&envoy).await;
        assert_eq!(reply.json()["worker"].as_str().unwrap(), reply.worker());
    }
    drop(envoy);
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffered_bodies_work_too_and_the_model_name_is_rewritten() {
    let workers = [MockWorker::start("a", &["m"]).await];
    let (router, grpc, _) = picker(named(&workers), EppServing::H2c).await;
    let envoy = Envoy::start_edited("envoy.yaml", &[grpc], |text| {
        text.replace("body_mode: FULL_DUPLEX_STREAMED", "body_mode: BUFFERED")
    })
    .await;
    let prompt = "y".repeat(100_000);
    let reply = post(
        &envoy.url,
        "/v1/completions",
        &[("x-gateway-model-name-rewrite", "m")],
        &json!({"model": "an-alias", "prompt": prompt}).to_string(),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    assert_eq!(reply.worker(), "a");
    let echoed = reply.json();
    let received: Value = serde_json::from_str(echoed["body"].as_str().unwrap()).unwrap();
    assert_eq!(received["model"], "m", "the engine gets the rewritten name");
    assert_eq!(received["prompt"].as_str().unwrap().len(), 100_000, "whole");
    assert!(echoed["headers"]
        .get("x-gateway-model-name-rewrite")
        .is_none());
    // Without the rewrite, the alias is no model kvroute knows.
    let reply = post(
        &envoy.url,
        "/v1/completions",
        &[],
        &json!({"model": "an-alias", "prompt": "hi"}).to_string(),
    )
    .await;
    assert_eq!(reply.status, StatusCode::NOT_FOUND);
    assert_eq!(reply.error_code(), "model_not_found");
    drop(envoy);
    router.stop().await;
}

/// The gateway's subset hint (`envoy.lb.subset_hint` in the metadata), through a real gRPC
/// client: the pick stays inside it, and a subset of unknown endpoints is 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subset_hint_narrows_the_pick() {
    use kvroute_gateway::epp::pb::core::{HeaderMap, HeaderValue, Metadata};
    use kvroute_gateway::epp::pb::ext_proc::external_processor_client::ExternalProcessorClient;
    use kvroute_gateway::epp::pb::ext_proc::{
        processing_request, processing_response, HttpBody, HttpHeaders, ProcessingRequest,
    };
    use prost_types::value::Kind;

    let workers = [
        MockWorker::start("a", &["m"]).await,
        MockWorker::start("b", &["m"]).await,
    ];
    let (router, grpc, _) = picker(named(&workers), EppServing::H2c).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{grpc}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = ExternalProcessorClient::new(channel);
    let exchange = |subset: Vec<String>| {
        let hint = prost_types::Struct {
            fields: [(
                "x-gateway-destination-endpoint-subset".to_owned(),
                prost_types::Value {
                    kind: Some(Kind::ListValue(prost_types::ListValue {
                        values: subset
                            .into_iter()
                            .map(|e| prost_types::Value {
                                kind: Some(Kind::StringValue(e)),
                            })
                            .collect(),
                    })),
                },
            )]
            .into(),
        };
        let header = |k: &str, v: &str| HeaderValue {
            key: k.to_owned(),
            raw_value: v.as_bytes().to_vec(),
            ..Default::default()
        };
        vec![
            ProcessingRequest {
                request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
                    headers: Some(HeaderMap {
                        headers: vec![
                            header(":method", "POST"),
                            header(":path", "/v1/completions"),
                        ],
                    }),
                    end_of_stream: false,
                    ..Default::default()
                })),
                metadata_context: Some(Metadata {
                    filter_metadata: [("envoy.lb.subset_hint".to_owned(), hint)].into(),
                    ..Default::default()
                }),
                ..Default::default()
            },
            ProcessingRequest {
                request: Some(processing_request::Request::RequestBody(HttpBody {
                    body: br#"{"model":"m","prompt":"hello"}"#.to_vec(),
                    end_of_stream: true,
                    ..Default::default()
                })),
                ..Default::default()
            },
        ]
    };
    let endpoint = |w: &MockWorker| w.url.trim_start_matches("http://").to_owned();
    for _ in 0..4 {
        let answers = client
            .process(futures_util::stream::iter(exchange(vec![endpoint(
                &workers[1],
            )])))
            .await
            .unwrap()
            .into_inner();
        let first = answers_of(answers).await.remove(0);
        let Some(processing_response::Response::RequestHeaders(h)) = first.response else {
            panic!("a headers answer first: {first:?}");
        };
        let set = h.response.unwrap().header_mutation.unwrap().set_headers;
        let destination = set
            .iter()
            .map(|o| o.header.as_ref().unwrap())
            .find(|h| h.key == "x-gateway-destination-endpoint")
            .expect("the destination header");
        assert_eq!(destination.raw_value, endpoint(&workers[1]).into_bytes());
        router.wait_none_in_flight().await;
    }
    let answers = client
        .process(futures_util::stream::iter(exchange(vec![
            "10.1.1.1:80".into()
        ])))
        .await
        .unwrap()
        .into_inner();
    let first = answers_of(answers).await.remove(0);
    let Some(processing_response::Response::ImmediateResponse(immediate)) = first.response else {
        panic!("an immediate answer: {first:?}");
    };
    assert_eq!(immediate.status.unwrap().code, 503);
    assert_eq!(immediate.details, "no_endpoint");
    router.stop().await;
}

/// Every answer of a stream, until it ends.
async fn answers_of(
    mut answers: tonic::Streaming<kvroute_gateway::epp::pb::ext_proc::ProcessingResponse>,
) -> Vec<kvroute_gateway::epp::pb::ext_proc::ProcessingResponse> {
    let mut out = Vec::new();
    while let Some(a) = answers.message().await.unwrap() {
        out.push(a);
    }
    out
}

/// The requests in flight `r` counts on all its workers' ranks (its own and its peers').
fn in_flight(r: &TestRouter) -> u64 {
    r.gateway
        .workers()
        .statuses()
        .iter()
        .flat_map(|w| w.ranks.iter().map(|rank| rank.in_flight))
        .sum()
}

/// Opens a stream through `envoy` and returns its body once the first chunk arrived (the
/// mock holds the rest until released).
async fn held_stream(envoy: &Envoy) -> hyper::body::Incoming {
    let request = http::Request::builder()
        .method(Method::POST)
        .uri(format!("{}/v1/completions", envoy.url))
        .header("content-type", "application/json")
        .body(Full::new(bytes::Bytes::from(body_stream())))
        .unwrap();
    let response = client().request(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let mut body = response.into_body();
    body.frame().await.unwrap().unwrap();
    body
}

/// Active-active pickers: two behind one Envoy (its `epp` cluster with two endpoints), in
/// sync over a real nats-server, route on one view of the load; when one goes, Envoy's
/// ext_proc streams open on the other and nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_pickers_behind_one_envoy_share_one_view_and_survive_one_going() {
    let nats = nats().await;
    let workers = [
        MockWorker::start("a", &["m"]).await,
        MockWorker::start("b", &["m"]).await,
    ];
    let synced = || {
        let mut s = named(&workers);
        s.replica_sync = Some(kvroute_gateway::config::SyncConfig {
            url: nats.1.clone(),
            prefix: "epp".into(),
            timeout: Duration::from_secs(2),
        });
        s
    };
    let (one, grpc_one, _) = picker(synced(), EppServing::H2c).await;
    let (two, grpc_two, _) = picker(synced(), EppServing::H2c).await;
    for r in [&one, &two] {
        r.wait_metric("kvroute_replica_peers", "", Some(1.0)).await;
    }
    let envoy = Envoy::start("envoy.yaml", &[grpc_one, grpc_two]).await;
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(held_stream(&envoy).await);
    }
    // Each picker chose some of them, and each counts all four.
    for r in [&one, &two] {
        let text = r.metrics().await;
        let picks: u64 = ["a", "b"]
            .iter()
            .map(|w| metric(&text, "kvroute_processed_requests_total", w))
            .sum();
        assert!(picks >= 1, "Envoy spreads its streams over both pickers");
    }
    wait_until("both pickers count the four streams", || {
        in_flight(&one) == 4 && in_flight(&two) == 4
    })
    .await;
    for w in &workers {
        w.release.add_permits(100);
    }
    for body in held {
        body.collect().await.unwrap();
    }
    wait_until("both pickers count none", || {
        in_flight(&one) == 0 && in_flight(&two) == 0
    })
    .await;

    // One picker goes: every request still gets through, on the other.
    two.stop().await;
    for _ in 0..6 {
        complete_ok(&envoy).await;
    }
    drop(envoy);
    one.stop().await;
}

/// llm-d's precise prefix producer: `llm_d` scores the prefix from the engines' KV events, so
/// a prefix an engine cached on its own (not routed by kvroute) draws the request there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llm_ds_precise_prefix_follows_what_the_engines_cache() {
    let (sims, router, envoy) = sims_behind_envoy_with(|s| {
        s.policy = PolicyKind::LlmD;
        s.policy_config.llm_d.prefix = kvroute_core::policy::PrefixSource::Exact {
            block_size: s.block_size,
        };
    })
    .await;
    for (home, id) in [(1, "sim1"), (0, "sim0")] {
        let shared = long_prompt(&format!("cached by {id} alone"));
        // Straight to the engine: kvroute routed none of it.
        let warm = post(
            &sims[home].url(),
            "/v1/completions",
            &[],
            &completion(&shared),
        )
        .await;
        assert_eq!(warm.status, StatusCode::OK);
        wait_overlap(&router, &shared, id, |n| n.is_some_and(|n| n > 0)).await;
        let reply = post(
            &envoy.url,
            "/v1/completions",
            &[],
            &completion(&format!("{shared} and a question")),
        )
        .await;
        assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
        assert_eq!(reply.worker(), id, "the engine holding the prefix");
    }
    drop(envoy);
    router.stop().await;
}

/// The `kvroute` binary with llm-d's chart arguments (its no-ops included) serves ext_proc
/// and gRPC health, and Envoy routes through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_with_llm_ds_arguments_picks_behind_envoy() {
    let worker = MockWorker::start("a", &["m"]).await;
    let (grpc, health) = (free_port(), free_port());
    let (grpc_s, health_s) = (grpc.to_string(), health.to_string());
    let (_child, _url, _log) = kvroute_process(&[
        "--epp",
        "--secure-serving=false",
        "--grpc-port",
        &grpc_s,
        "--grpc-health-port",
        &health_s,
        "--host",
        "127.0.0.1",
        "--zap-encoder",
        "json",
        "--v=4",
        "--tracing=false",
        "--ha-enable-leader-election=false",
        "--worker-urls",
        &worker.url,
    ])
    .await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{health}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let answer = tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: "inference-extension".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        answer.status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    let envoy = Envoy::start("envoy.yaml", &[grpc]).await;
    let reply = complete_ok(&envoy).await;
    assert_eq!(reply.worker(), worker.url);
    assert_eq!(worker.requests(), 1, "the engine answered");
}

/// GIE's inference objective names a policy class when one of that name is configured (here
/// one with its own busy threshold): that class's requests are shed while the others pass,
/// and an objective no class is named after changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inference_objective_names_a_policy_class() {
    let worker = MockWorker::start("w", &["m"]).await;
    let file = "router_queue_threshold: 100\npolicy_classes:\n  - {name: default, weight: 1}\n  - {name: strict, weight: 1, active_prefill_tokens_threshold: 100}\n";
    let parsed = kvroute_gateway::Args::from_text(file).unwrap();
    let mut s = kvroute_gateway::Args {
        workers: vec![named_spec("w", "m", worker.url.clone())],
        ..parsed
    }
    .into_settings()
    .unwrap();
    s.request_timeout = Duration::from_secs(60);
    let (router, grpc, _) = picker(s, EppServing::H2c).await;
    let envoy = Envoy::start("envoy.yaml", &[grpc]).await;
    // A request that never answers holds 500 prompt tokens in prefill on the only worker.
    let url = envoy.url.clone();
    let held = tokio::spawn(async move {
        post(&url, "/v1/completions", &[], &hanging(&"x".repeat(500))).await
    });
    router.wait_in_flight("w", |n| n == 1).await;
    let body = json!({"model": "m", "prompt": "a"}).to_string();
    for header in [
        "x-gateway-inference-objective",
        "x-llm-d-inference-objective",
    ] {
        let strict = post(&envoy.url, "/v1/completions", &[(header, "strict")], &body).await;
        strict.assert_error(503, "all_workers_overloaded");
    }
    let other = post(
        &envoy.url,
        "/v1/completions",
        &[("x-gateway-inference-objective", "no-such-class")],
        &body,
    )
    .await;
    assert_eq!(other.status, StatusCode::OK, "{:?}", other.body);
    assert!(
        other.json()["headers"]
            .get("x-gateway-inference-objective")
            .is_none(),
        "stripped before the engine"
    );
    held.abort();
    drop(envoy);
    router.stop().await;
}
