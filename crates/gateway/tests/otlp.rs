//! OpenTelemetry traces, received by a real OTLP receiver: `support/otlp_receiver.py`, which
//! decodes with the official `opentelemetry-proto` (PyPI; grpcio for gRPC). It runs with
//! `$KVROUTE_PYTHON`, else `target/ci-tools/bin/python` (where `.ci/run` installs both),
//! else `python3`.

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};

use clap::Parser;
use serde_json::Value;
use support::*;

/// The receiver process and the spans it printed.
struct Receiver {
    _child: ChildGuard,
    port: u16,
    spans: Arc<Mutex<Vec<Value>>>,
}

impl Receiver {
    fn start(mode: &str) -> Receiver {
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/support/otlp_receiver.py"
        );
        let mut child = ChildGuard(
            Command::new(test_python())
                .args([script, mode])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("python for the OTLP receiver"),
        );
        let mut lines = BufReader::new(child.0.stdout.take().unwrap()).lines();
        let first = lines.next().and_then(Result::ok).unwrap_or_else(|| {
            panic!("the receiver did not start: pip install opentelemetry-proto grpcio")
        });
        let port = first
            .strip_prefix("PORT ")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("the receiver said {first:?}"));
        let spans = Arc::new(Mutex::new(Vec::new()));
        let sink = spans.clone();
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                let span = serde_json::from_str(&line)
                    .unwrap_or_else(|e| panic!("the receiver printed {line:?}: {e}"));
                sink.lock().unwrap().push(span);
            }
        });
        Receiver {
            _child: child,
            port,
            spans,
        }
    }

    fn spans(&self) -> Vec<Value> {
        self.spans.lock().unwrap().clone()
    }

    /// Waits until `n` spans of `trace` arrived; returns them, the server span first.
    async fn trace(&self, trace: &str, n: usize) -> Vec<Value> {
        let of_trace = || -> Vec<Value> {
            self.spans()
                .into_iter()
                .filter(|s| s["trace_id"] == trace)
                .collect()
        };
        wait_until(&format!("{n} spans of trace {trace}"), || {
            of_trace().len() >= n
        })
        .await;
        let mut spans = of_trace();
        assert_eq!(spans.len(), n, "{spans:#?}");
        spans.sort_by_key(|s| s["kind"].as_i64() != Some(SERVER));
        spans
    }
}

const SERVER: i64 = 2;
const CLIENT: i64 = 3;

fn settings(args: &[&str]) -> kvroute_gateway::Settings {
    let argv = std::iter::once("kvroute").chain(args.iter().copied());
    kvroute_gateway::Args::try_parse_from(argv)
        .unwrap()
        .load()
        .unwrap()
}

/// The trace id and parent span id of a `traceparent`.
fn ids(traceparent: &str) -> (String, String) {
    let parts: Vec<&str> = traceparent.split('-').collect();
    assert_eq!(parts.len(), 4, "{traceparent}");
    assert_eq!(parts[3], "01", "sampled: {traceparent}");
    (parts[1].to_owned(), parts[2].to_owned())
}

const TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
const PARENT: &str = "b7ad6b7169203331";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_export_continues_the_clients_trace_with_a_span_per_attempt() {
    let receiver = Receiver::start("http");
    let live = MockWorker::start("live", &["m"]).await;
    live.release.add_permits(100);
    let endpoint = format!("http://127.0.0.1:{}", receiver.port);
    let router = TestRouter::start(settings(&[
        "--worker-urls",
        &live.url,
        "--otlp-traces-endpoint",
        &endpoint,
        "--no-router-kv-events",
    ]))
    .await;
    let prompt = "the same long prompt, long enough for a few blocks of sixteen tokens ".repeat(4);

    // A: the client's sampled trace, continued; the worker gets our attempt as its parent.
    let traceparent = format!("00-{TRACE}-{PARENT}-01");
    let a = post(
        &router.url,
        "/v1/completions",
        &[("traceparent", &traceparent), ("tracestate", "vendor=x")],
        &serde_json::json!({"model": "m", "prompt": prompt}).to_string(),
    )
    .await;
    assert_eq!(a.status, 200);
    let sent = a.json()["headers"]["traceparent"]
        .as_str()
        .expect("a traceparent forwarded")
        .to_owned();
    let (trace, attempt_id) = ids(&sent);
    assert_eq!(trace, TRACE);
    assert_ne!(attempt_id, PARENT);

    let spans = receiver.trace(TRACE, 2).await;
    let (server, client) = (&spans[0], &spans[1]);
    assert_eq!(server["kind"], SERVER);
    assert_eq!(server["name"], "POST /v1/completions");
    assert_eq!(server["parent_span_id"], PARENT);
    assert_eq!(server["trace_state"], "vendor=x");
    // Sampled, with a remote parent.
    assert_eq!(server["flags"].as_i64().unwrap() & 0x301, 0x301);
    let attrs = &server["attributes"];
    assert_eq!(attrs["kvroute.route"], "/v1/completions");
    assert_eq!(attrs["kvroute.model"], "m");
    assert_eq!(attrs["kvroute.policy"], "kv_aware");
    assert_eq!(attrs["kvroute.worker"], a.worker());
    assert_eq!(attrs["http.response.status_code"], 200);
    assert_eq!(attrs["kvroute.overlap_blocks.device"], 0);
    assert!(attrs["kvroute.cost"].is_number(), "{attrs}");
    assert!(attrs["kvroute.ttft_ms"].as_f64().unwrap() >= 0.0);
    assert!(attrs.get("kvroute.retries").is_none(), "{attrs}");
    assert_eq!(server["resource"]["service.name"], "kvroute");
    assert_eq!(server["scope"], "kvroute");
    assert_eq!(server["status"]["code"], 0);
    assert!(server["end"].as_u64() >= server["start"].as_u64());

    assert_eq!(client["kind"], CLIENT);
    assert_eq!(client["span_id"], attempt_id);
    assert_eq!(client["parent_span_id"], server["span_id"]);
    assert_eq!(client["attributes"]["kvroute.worker"], a.worker());
    assert_eq!(client["attributes"]["kvroute.attempt"], 1);
    assert_eq!(client["attributes"]["http.response.status_code"], 200);

    // B: no traceparent, a stream: a new trace (ratio 1.0), which finds A's prefix.
    let b = post(
        &router.url,
        "/v1/completions",
        &[],
        &serde_json::json!({"model": "m", "prompt": prompt, "stream": true, "max_tokens": 2})
            .to_string(),
    )
    .await;
    assert_eq!(b.status, 200);
    assert!(String::from_utf8_lossy(&b.body).contains("[DONE]"));
    wait_until("B's spans", || {
        receiver
            .spans()
            .iter()
            .filter(|s| s["trace_id"] != TRACE)
            .count()
            >= 2
    })
    .await;
    let spans = receiver.spans();
    let server_b = spans
        .iter()
        .find(|s| s["trace_id"] != TRACE && s["kind"] == SERVER)
        .expect("B's server span");
    assert_eq!(server_b["parent_span_id"], "");
    assert_eq!(server_b["flags"].as_i64().unwrap() & 0x301, 0x101);
    let attrs = &server_b["attributes"];
    assert!(
        attrs["kvroute.overlap_blocks.device"].as_i64().unwrap() > 0,
        "{attrs}"
    );
    let ttft = attrs["kvroute.ttft_ms"].as_f64().unwrap();
    let total = (server_b["end"].as_u64().unwrap() - server_b["start"].as_u64().unwrap()) as f64;
    assert!(ttft * 1e6 <= total, "ttft {ttft} ms, span {total} ns");

    // C, then shutdown at once: the exporter sends what is queued before it stops.
    let c_trace = "1af7651916cd43dd8448eb211c80319c";
    let c = post(
        &router.url,
        "/v1/completions",
        &[("traceparent", &format!("00-{c_trace}-{PARENT}-01"))],
        r#"{"model":"m","prompt":"c"}"#,
    )
    .await;
    assert_eq!(c.status, 200);
    router.stop().await;
    receiver.trace(c_trace, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_export_is_parent_based_and_shows_retries() {
    let receiver = Receiver::start("grpc");
    let live = MockWorker::start("live", &["m"]).await;
    let broken = broken_worker("m").await;
    let endpoint = format!("127.0.0.1:{}", receiver.port);
    let router = TestRouter::start(settings(&[
        "--worker-urls",
        &broken,
        &live.url,
        "--policy",
        "round_robin",
        "--otlp-traces-endpoint",
        &endpoint,
        "--otlp-sampling-ratio",
        "0",
    ]))
    .await;
    let body = r#"{"model":"m","prompt":"hi"}"#;

    // Ratio 0: a root is not traced, and the worker gets no traceparent.
    let r = post(&router.url, "/v1/completions", &[], body).await;
    assert_eq!(r.status, 200);
    assert!(r.json()["headers"].get("traceparent").is_none());
    // A parent that was not sampled: not traced, its traceparent forwarded as it came.
    let unsampled = format!("00-2af7651916cd43dd8448eb211c80319c-{PARENT}-00");
    let r = post(
        &router.url,
        "/v1/completions",
        &[("traceparent", &unsampled)],
        body,
    )
    .await;
    assert_eq!(r.json()["headers"]["traceparent"], unsampled.as_str());

    // Sampled parents are traced whatever the ratio. Round robin: at least one of the two
    // tries the broken worker first.
    let traces = [
        "3af7651916cd43dd8448eb211c80319c",
        "4af7651916cd43dd8448eb211c80319c",
    ];
    for trace in traces {
        let tp = format!("00-{trace}-{PARENT}-01");
        let r = post(
            &router.url,
            "/v1/completions",
            &[("traceparent", &tp)],
            body,
        )
        .await;
        assert_eq!(r.status, 200, "{:?}", r.body);
    }
    wait_until("the sampled requests' spans", || {
        traces.iter().all(|t| {
            let spans = receiver.spans();
            let server = spans
                .iter()
                .find(|s| s["trace_id"] == *t && s["kind"] == SERVER);
            let attempts = server.and_then(|s| s["attributes"]["kvroute.retries"].as_i64());
            let clients = spans
                .iter()
                .filter(|s| s["trace_id"] == *t && s["kind"] == CLIENT)
                .count() as i64;
            server.is_some() && clients == 1 + attempts.unwrap_or(0)
        })
    })
    .await;
    let spans = receiver.spans();
    assert!(
        spans
            .iter()
            .all(|s| traces.contains(&s["trace_id"].as_str().unwrap())),
        "only the sampled traces: {spans:#?}"
    );
    let retried: Vec<&Value> = spans
        .iter()
        .filter(|s| s["kind"] == SERVER && s["attributes"]["kvroute.retries"] == 1)
        .collect();
    assert!(!retried.is_empty(), "{spans:#?}");
    for retried in retried {
        let mut attempts: Vec<&Value> = spans
            .iter()
            .filter(|s| s["parent_span_id"] == retried["span_id"])
            .collect();
        attempts.sort_by_key(|s| s["attributes"]["kvroute.attempt"].as_i64());
        assert_eq!(attempts.len(), 2);
        assert_eq!(attempts[0]["attributes"]["kvroute.worker"], broken.as_str());
        assert_eq!(
            attempts[0]["status"]["code"], 2,
            "the failed attempt is an error"
        );
        assert_eq!(
            attempts[1]["attributes"]["kvroute.worker"],
            live.url.as_str()
        );
        assert_eq!(attempts[1]["status"]["code"], 0);
        assert_eq!(retried["attributes"]["kvroute.worker"], live.url.as_str());
        assert_eq!(retried["attributes"]["kvroute.policy"], "round_robin");
    }
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_away_costs_spans_not_requests() {
    let live = MockWorker::start("live", &["m"]).await;
    let away = closed_url().await;
    let router = TestRouter::start(settings(&[
        "--worker-urls",
        &live.url,
        "--otlp-traces-endpoint",
        &away,
    ]))
    .await;
    for _ in 0..3 {
        let r = post(
            &router.url,
            "/v1/completions",
            &[],
            r#"{"model":"m","prompt":"hi"}"#,
        )
        .await;
        assert_eq!(r.status, 200);
    }
    // Three server spans and three attempts, dropped once the export fails.
    let dropped = || async {
        let m = router.metrics().await;
        metric_value(
            &m,
            "kvroute_otlp_spans_dropped_total",
            "{reason=\"export_failed\"}",
        )
    };
    wait_until_async("the failed export counted", || async {
        dropped().await == Some(6.0)
    })
    .await;
    let m = router.metrics().await;
    assert_metric(&m, "kvroute_otlp_spans_exported_total", "", Some(0.0));
    assert_metric(
        &m,
        "kvroute_otlp_spans_dropped_total",
        "{reason=\"queue_full\"}",
        Some(0.0),
    );
    router.stop().await;
}

#[test]
fn trace_flags_are_validated_at_start() {
    let exe = env!("CARGO_BIN_EXE_kvroute");
    for (args, names) in [
        (
            &["--otlp-traces-endpoint", "grpc://collector:4317"][..],
            "otlp_traces_endpoint",
        ),
        (&["--otlp-traces-endpoint", "collector"], "host:port"),
        (&["--otlp-sampling-ratio", "1.5"], "otlp_sampling_ratio"),
    ] {
        let out = Command::new(exe)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(names), "{args:?}: {err}");
    }
    // --enable-trace alone sends to smg's default, over gRPC.
    let s = settings(&["--enable-trace"]).trace.expect("tracing on");
    assert_eq!(
        s.endpoint,
        kvroute_gateway::otlp::Endpoint::Grpc("localhost:4317".parse().unwrap())
    );
    assert_eq!(s.sampling_ratio, 1.0);
    assert!(settings(&[]).trace.is_none());
    assert!(settings(&["--otlp-sampling-ratio", "0.5"]).trace.is_none());
    let s = settings(&["--otlp-traces-endpoint", "https://otel.example.com"]);
    assert_eq!(
        s.trace.unwrap().endpoint.to_string(),
        "https://otel.example.com/v1/traces (OTLP/HTTP)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migrated_stream_counts_its_migration_and_both_attempts() {
    // An engine that dies after one chunk (a 5xx error event), and a kvroute-sim.
    const DIED: &str = concat!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n",
        "data: {\"id\":\"cmpl-1\",\"created\":1,\"model\":\"kvroute-sim\",\"choices\":[{\"index\":0,\"text\":\"ab\"}]}\n\n",
        "data: {\"error\":{\"object\":\"error\",\"message\":\"EngineDeadError\",\"type\":\"InternalServerError\",\"code\":500}}\n\n",
        "data: [DONE]\n\n"
    );
    let receiver = Receiver::start("http");
    let shutdown = tokio_util::sync::CancellationToken::new();
    let sim = serve_sim(&[], &shutdown).await;
    let dying = scripted(DIED).await;
    let endpoint = format!("http://127.0.0.1:{}", receiver.port);
    let router = TestRouter::start(settings(&[
        "--worker-urls",
        &dying,
        &sim,
        "--policy",
        "round_robin",
        "--otlp-traces-endpoint",
        &endpoint,
    ]))
    .await;
    let body = r#"{"model":"kvroute-sim","prompt":"x","max_tokens":5,"stream":true}"#;
    // Round robin: one of a few streams starts on the dying engine.
    let mut found = None;
    for i in 0..4 {
        let trace = format!("5af7651916cd43dd8448eb211c8031{i:02x}");
        let tp = format!("00-{trace}-{PARENT}-01");
        let r = post(
            &router.url,
            "/v1/completions",
            &[("traceparent", &tp)],
            body,
        )
        .await;
        assert_eq!(r.status, 200);
        if r.worker() == dying {
            found = Some(trace);
            break;
        }
    }
    let trace = found.expect("a stream on the dying engine");
    let spans = receiver.trace(&trace, 3).await;
    assert_eq!(
        spans[0]["attributes"]["kvroute.migrations"], 1,
        "{spans:#?}"
    );
    let workers: Vec<&Value> = spans[1..]
        .iter()
        .map(|s| &s["attributes"]["kvroute.worker"])
        .collect();
    assert!(
        workers.contains(&&Value::from(dying.as_str())),
        "{workers:?}"
    );
    assert!(workers.contains(&&Value::from(sim.as_str())), "{workers:?}");
    router.stop().await;
    shutdown.cancel();
}
