//! `--metrics-compat`: the peers' metric names over kvroute's own counts, scraped from a
//! router in front of mock engines.

mod support;

use clap::Parser;
use kvroute_gateway::config::{MetricsPeer, PdProtocol, WorkerRole};
use kvroute_gateway::{Args, Settings, WorkerSpec};
use support::*;

const ALL: [MetricsPeer; 3] = [MetricsPeer::VllmRouter, MetricsPeer::Smg, MetricsPeer::LlmD];

fn with_peers(mut s: Settings, peers: &[MetricsPeer], prefix: Option<&str>) -> Settings {
    s.metrics_compat = kvroute_gateway::config::MetricsCompat::new(peers, prefix).unwrap();
    s
}

/// Round robin over two mock engines serving `mock-model`, `n` chat requests.
async fn round_robin(
    peers: &[MetricsPeer],
    prefix: Option<&str>,
    n: usize,
) -> (String, [MockWorker; 2]) {
    let a = MockWorker::start("a", &["mock-model"]).await;
    let b = MockWorker::start("b", &["mock-model"]).await;
    let router = TestRouter::start(with_peers(settings(&[&a, &b]), peers, prefix)).await;
    for i in 0..n {
        let r = router
            .post(
                "/v1/chat/completions",
                &[],
                &chat("mock-model", &format!("hi {i}")),
            )
            .await;
        assert_eq!(r.status, 200, "{:?}", r.body);
    }
    let m = router.metrics().await;
    router.stop().await;
    (m, [a, b])
}

#[tokio::test]
async fn round_robin_reads_the_same_under_every_peers_names() {
    let (m, [a, b]) = round_robin(&ALL, None, 10).await;
    for w in [&a, &b] {
        let worker = format!("worker=\"{}\"", w.url);
        assert_metric(
            &m,
            "vllm_router_processed_requests_total",
            &worker,
            Some(5.0),
        );
        assert_metric(
            &m,
            "vllm_router_policy_decisions_total",
            &format!("policy=\"round_robin\",{worker}"),
            Some(5.0),
        );
        assert_metric(&m, "vllm_router_worker_health", &worker, Some(1.0));
        assert_metric(&m, "vllm_router_cb_state", &worker, Some(0.0));
        assert_metric(&m, "smg_worker_requests_active", &worker, Some(0.0));
        assert_metric(&m, "smg_worker_health", &worker, Some(1.0));
        assert_metric(&m, "smg_worker_cb_state", &worker, Some(0.0));
        // The mocks' engine metrics are not read under round robin: unknown, not 0.
        let endpoint = format!("model_server_endpoint=\"{}\"", w.url);
        let queue = metric_value(&m, "llm_d_epp_per_endpoint_queue_size", &endpoint);
        assert!(queue.is_some_and(f64::is_nan), "{endpoint} in\n{m}");
        let pod = format!("name=\"\",model_server_pod=\"{}\"", w.url);
        let queue = metric_value(&m, "inference_pool_per_pod_queue_size", &pod);
        assert!(queue.is_some_and(f64::is_nan), "{pod} in\n{m}");
    }
    assert_metric(
        &m,
        "smg_worker_pool_size",
        "worker_type=\"regular\",connection_mode=\"http\",model=\"mock-model\"",
        Some(2.0),
    );
    assert_metric(&m, "inference_pool_ready_pods", "name=\"\"", Some(2.0));
    // The time spent choosing a worker, once per request.
    assert_metric(
        &m,
        "llm_d_epp_scheduler_e2e_duration_seconds_count",
        "",
        metric_value(&m, "kvroute_routing_seconds_count", ""),
    );
    assert_metric(
        &m,
        "llm_d_epp_scheduler_e2e_duration_seconds_count",
        "",
        Some(10.0),
    );
    // No engine reading under round robin: no average, under either name.
    assert!(!m.contains("_average_"), "{m}");
    assert_metric(&m, "vllm_router_active_workers", "", Some(2.0));
    assert_metric(
        &m,
        "vllm_router_requests_total",
        "route=\"/v1/chat/completions\"",
        Some(10.0),
    );
    assert_metric(
        &m,
        "smg_worker_selection_total",
        "worker_type=\"regular\",connection_mode=\"http\",model=\"mock-model\",policy=\"round_robin\"",
        Some(10.0),
    );
    assert_metric(&m, "llm_d_epp_ready_endpoints", "", Some(2.0));
    // kvroute's own families are unchanged beside them.
    assert_metric_at_least(&m, "kvroute_processed_requests_total", "", 5.0);
    // Not P/D: no P/D family.
    assert!(!m.contains("vllm_router_pd_"), "{m}");
    assert!(!m.contains("llm_d_epp_disagg_decision"), "{m}");
}

#[tokio::test]
async fn without_the_flag_no_peer_family_appears() {
    let (m, _) = round_robin(&[], None, 4).await;
    for prefix in ["vllm_router_", "smg_", "llm_d_"] {
        assert!(
            !m.lines().any(|l| l
                .trim_start_matches("# HELP ")
                .trim_start_matches("# TYPE ")
                .starts_with(prefix)),
            "{prefix} in\n{m}"
        );
    }
    assert_metric_at_least(&m, "kvroute_processed_requests_total", "", 2.0);
}

#[tokio::test]
async fn only_the_named_peers_families_appear() {
    let (m, _) = round_robin(&[MetricsPeer::VllmRouter], None, 2).await;
    assert_metric_at_least(&m, "vllm_router_processed_requests_total", "", 1.0);
    assert!(!m.contains("smg_"), "{m}");
    assert!(!m.contains("llm_d_epp_"), "{m}");
}

#[tokio::test]
async fn metrics_prefix_renames_smgs_families() {
    let (m, _) = round_robin(&[MetricsPeer::Smg], Some("gateway"), 4).await;
    assert_metric(
        &m,
        "gateway_worker_selection_total",
        "worker_type=\"regular\",connection_mode=\"http\",model=\"mock-model\",policy=\"round_robin\"",
        Some(4.0),
    );
    assert!(!m.contains("smg_worker"), "{m}");
}

fn role_spec(w: &MockWorker, role: WorkerRole) -> WorkerSpec {
    WorkerSpec {
        model: Some("mock-model".into()),
        role,
        bootstrap_port: (role == WorkerRole::Prefill).then_some(8998),
        ..w.spec()
    }
}

#[tokio::test]
async fn pd_counts_each_half_by_worker_url() {
    let p = MockWorker::start("p", &["mock-model"]).await;
    let d = MockWorker::start("d", &["mock-model"]).await;
    let mut s = Settings::with_workers(vec![
        role_spec(&p, WorkerRole::Prefill),
        role_spec(&d, WorkerRole::Decode),
    ])
    .unwrap();
    s.pd.as_mut()
        .expect("roles turn disaggregation on")
        .protocol = PdProtocol::Sglang;
    let router = TestRouter::start(with_peers(s, &ALL, None)).await;
    for i in 0..3 {
        let r = router
            .post(
                "/generate",
                &[],
                &format!(r#"{{"text":"hello {i}","model":"mock-model"}}"#),
            )
            .await;
        assert_eq!(r.status, 200, "{:?}", r.body);
    }
    wait_until("both halves answered", || {
        p.requests() == 3 && d.requests() == 3
    })
    .await;
    let m = router.metrics().await;
    let pw = format!("worker=\"{}\"", p.url);
    let dw = format!("worker=\"{}\"", d.url);
    assert_metric(&m, "vllm_router_pd_prefill_requests_total", &pw, Some(3.0));
    assert_metric(&m, "vllm_router_pd_decode_requests_total", &dw, Some(3.0));
    // Each P/D family over its role's workers only, as vllm-router 0.1.17 writes them.
    assert_metric(&m, "vllm_router_pd_prefill_requests_total", &dw, None);
    assert_metric(&m, "vllm_router_pd_decode_requests_total", &pw, None);
    // vllm-router counts both halves' workers as processed and decided.
    for w in [&pw, &dw] {
        assert_metric(&m, "vllm_router_processed_requests_total", w, Some(3.0));
        assert_metric(&m, "vllm_router_policy_decisions_total", w, Some(3.0));
    }
    // Families vllm-router 0.1.17 does not write in P/D mode.
    for absent in [
        "vllm_router_requests_total",
        "vllm_router_active_workers",
        "vllm_router_cb_state",
    ] {
        assert!(!m.contains(absent), "{absent} in\n{m}");
    }
    assert_metric(
        &m,
        "llm_d_epp_disagg_decision_total",
        "decision_type=\"prefill-decode\"",
        Some(3.0),
    );
    assert_metric(
        &m,
        "llm_d_epp_disagg_decision_total",
        "decision_type=\"decode-only\"",
        Some(0.0),
    );
    for (t, n) in [("prefill", 3.0), ("decode", 3.0)] {
        let labels = format!("worker_type=\"{t}\",connection_mode=\"http\",model=\"mock-model\"");
        assert_eq!(
            metric_sum(&m, "smg_worker_selection_total", &labels),
            n,
            "{m}"
        );
        assert_metric(&m, "smg_worker_pool_size", &labels, Some(1.0));
    }
    router.stop().await;
}

#[test]
fn the_flag_and_the_config_file_name_the_peers() {
    let cli = Args::try_parse_from(["kvroute", "--metrics-compat", "vllm-router", "smg", "llm-d"])
        .unwrap()
        .into_settings()
        .unwrap();
    assert_eq!(cli.metrics_compat.peers, ALL.to_vec());
    assert_eq!(cli.metrics_compat.smg_prefix, "smg");
    let file = || Args::from_text("metrics_compat: [llm-d, vllm-router]\n").unwrap();
    let s = Args::default().merge(file()).into_settings().unwrap();
    assert_eq!(
        s.metrics_compat.peers,
        vec![MetricsPeer::LlmD, MetricsPeer::VllmRouter]
    );
    // The command line wins as a whole.
    let cli = Args::try_parse_from([
        "kvroute",
        "--metrics-compat",
        "smg",
        "--metrics-prefix",
        "gw",
    ])
    .unwrap();
    let s = cli.merge(file()).into_settings().unwrap();
    assert_eq!(s.metrics_compat.peers, vec![MetricsPeer::Smg]);
    assert_eq!(s.metrics_compat.smg_prefix, "gw");
    // Off by default.
    assert!(Args::default()
        .into_settings()
        .unwrap()
        .metrics_compat
        .peers
        .is_empty());
}

#[test]
fn bad_values_are_refused() {
    assert!(Args::try_parse_from(["kvroute", "--metrics-compat", "sglang-router"]).is_err());
    assert!(Args::from_text("metrics_compat: [nginx]\n").is_err());
    let prefix_alone = Args::try_parse_from(["kvroute", "--metrics-prefix", "gw"]).unwrap();
    let e = prefix_alone.into_settings().unwrap_err().to_string();
    assert!(e.contains("metrics_prefix"), "{e}");
    let bad = Args::try_parse_from([
        "kvroute",
        "--metrics-compat",
        "smg",
        "--metrics-prefix",
        "a-b",
    ])
    .unwrap();
    assert!(bad.into_settings().is_err());
}

/// kvroute as llm-d's endpoint picker behind a real Envoy (`$ENVOY` or the CI's): its picks
/// count under the peers' names too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pickers_picks_show_under_the_peers_names() {
    use kvroute_gateway::config::{EppEndpoints, EppServing, EppSettings};
    use kvroute_gateway::epp::serve::EppListeners;
    let a = MockWorker::start("a", &["m"]).await;
    let b = MockWorker::start("b", &["m"]).await;
    let mut s = with_peers(settings(&[&a, &b]), &ALL, None);
    s.epp = Some(EppSettings {
        grpc_port: 0,
        grpc_health_port: 0,
        serving: EppServing::H2c,
        endpoints: EppEndpoints::Static,
        kv_events_port: None,
    });
    let router = TestRouter::start(s).await;
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let health = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let grpc_port = grpc.local_addr().unwrap().port();
    router
        .gateway
        .serve_epp(EppListeners { grpc, health })
        .expect("the picker serves");
    let envoy = Envoy::start("envoy.yaml", &[grpc_port]).await;
    for i in 0..4 {
        let body = format!(r#"{{"model":"m","prompt":"hello {i}","max_tokens":2}}"#);
        let r = post(&envoy.url, "/v1/completions", &[], &body).await;
        assert_eq!(r.status, 200, "{:?}", r.body);
    }
    let m = router.metrics().await;
    for w in [&a, &b] {
        let worker = format!("worker=\"{}\"", w.url);
        assert_metric(
            &m,
            "vllm_router_processed_requests_total",
            &worker,
            Some(2.0),
        );
        let endpoint = format!("model_server_endpoint=\"{}\"", w.url);
        assert!(metric_value(&m, "llm_d_epp_per_endpoint_queue_size", &endpoint).is_some());
    }
    assert_metric(
        &m,
        "smg_worker_selection_total",
        "worker_type=\"regular\",connection_mode=\"http\",model=\"m\",policy=\"round_robin\"",
        Some(4.0),
    );
    assert_metric(&m, "llm_d_epp_ready_endpoints", "", Some(2.0));
    drop(envoy);
    router.stop().await;
}

/// An engine's `/metrics` with these numbers (vLLM's names, one engine).
fn engine(waiting: u32, running: u32, kv_usage: f64) -> String {
    format!(
        "# TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} {waiting}\n\
         vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} {running}\n\
         vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} {kv_usage}\n"
    )
}

#[tokio::test]
async fn llm_ds_endpoint_gauges_are_the_engines_readings() {
    let a = MockWorker::start("a", &["m"]).await;
    let b = MockWorker::start("b", &["m"]).await;
    *a.metrics.lock().unwrap() = engine(2, 1, 0.5);
    *b.metrics.lock().unwrap() = engine(4, 3, 0.25);
    // least_load reads the engines' metrics.
    let mut s = with_peers(settings(&[&a, &b]), &[MetricsPeer::LlmD], None);
    s.policy = kvroute_core::PolicyKind::LeastLoad;
    let router = TestRouter::start(s).await;
    let queue = |m: &str, w: &MockWorker| {
        let endpoint = format!("model_server_endpoint=\"{}\"", w.url);
        metric_value(m, "llm_d_epp_per_endpoint_queue_size", &endpoint)
    };
    wait_until_async("the router to read both engines", || async {
        let m = router.metrics().await;
        queue(&m, &a) == Some(2.0) && queue(&m, &b) == Some(4.0)
    })
    .await;
    let m = router.metrics().await;
    assert_metric(&m, "llm_d_epp_average_queue_size", "", Some(3.0));
    assert_metric(&m, "llm_d_epp_average_running_requests", "", Some(2.0));
    assert_metric(
        &m,
        "llm_d_epp_average_kv_cache_utilization",
        "",
        Some(0.375),
    );
    // The same readings under GIE's names, which its Grafana dashboard reads.
    for (w, n) in [(&a, 2.0), (&b, 4.0)] {
        let pod = format!("name=\"\",model_server_pod=\"{}\"", w.url);
        assert_metric(&m, "inference_pool_per_pod_queue_size", &pod, Some(n));
    }
    for (family, v) in [
        ("average_queue_size", 3.0),
        ("average_running_requests", 2.0),
        ("average_kv_cache_utilization", 0.375),
        ("ready_pods", 2.0),
    ] {
        let family = format!("inference_pool_{family}");
        assert_metric(&m, &family, "name=\"\"", Some(v));
    }
    router.stop().await;
}
