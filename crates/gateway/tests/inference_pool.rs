//! The endpoint picker's endpoints from Kubernetes, end to end: an InferencePool (or a
//! label selector) on a fake API server speaking the real list/watch wire format
//! ([`FakeApi`]), kvroute's kube-rs client reaching it through a kubeconfig, and engines on
//! 127.0.0.2, 127.0.0.3, ... sharing their ports, as pods do. Each pod is an endpoint per
//! target port, `<pod>-rank-<i>` as llm-d names them.

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use http::StatusCode;
use kvroute_gateway::config::{EppEndpoints, EppServing, EppSettings, PoolRef};
use kvroute_gateway::Settings;
use support::*;

const ENGINE: &[(&str, &str)] = &[("app", "engine")];

/// A router picking among `endpoints`, re-listing every `relist_secs`.
fn picking(endpoints: EppEndpoints, relist_secs: u64) -> Settings {
    let mut s = Settings::with_workers(vec![]).unwrap();
    s.discovery.interval = Duration::from_secs(relist_secs);
    s.epp = Some(EppSettings {
        grpc_port: 0,
        grpc_health_port: 0,
        serving: EppServing::H2c,
        endpoints,
        kv_events_port: None,
    });
    s
}

/// A router picking among the InferencePool `pool` in `ml` on `api`.
fn pool_router_settings(api: &FakeApi, relist_secs: u64) -> Settings {
    picking(
        EppEndpoints::Pool(PoolRef {
            name: "pool".into(),
            namespace: "ml".into(),
            group: "inference.networking.k8s.io".into(),
            kubeconfig: Some(api.kubeconfig.clone()),
        }),
        relist_secs,
    )
}

/// Mock engines on `n` pods (127.0.0.2, ...) serving `ports` ports each: the ports, and per
/// pod its engines' URLs (one per port, in order).
async fn engines(n: usize, ports: usize) -> (Vec<u16>, Vec<Vec<String>>, Vec<MockWorker>) {
    let (mut numbers, mut urls, mut mocks) = (Vec::new(), vec![Vec::new(); n], Vec::new());
    for _ in 0..ports {
        let (port, listeners) = pod_listeners(n).await;
        numbers.push(port);
        for (i, l) in listeners.into_iter().enumerate() {
            let mock = MockWorker::start_on(l, &format!("pod{i}"), &["kvroute-sim"]);
            urls[i].push(mock.url.clone());
            mocks.push(mock);
        }
    }
    (numbers, urls, mocks)
}

/// The router's endpoints now: (id, url).
fn endpoints(r: &TestRouter) -> BTreeSet<(String, String)> {
    let statuses = r.gateway.workers().statuses();
    statuses.into_iter().map(|w| (w.id, w.url)).collect()
}

/// Waits until the router's endpoints are exactly `want` (id, url), each probed and healthy.
async fn wait_endpoints(r: &TestRouter, want: &[(&str, &String)]) {
    let want: BTreeSet<(String, String)> = want
        .iter()
        .map(|(id, url)| (id.to_string(), url.to_string()))
        .collect();
    let gw = r.gateway.clone();
    wait_until(&format!("endpoints {want:?}"), || {
        let statuses = gw.workers().statuses();
        statuses
            .iter()
            .map(|w| (w.id.clone(), w.url.clone()))
            .collect::<BTreeSet<_>>()
            == want
            && statuses.iter().all(|w| w.healthy)
    })
    .await;
}

async fn readiness(r: &TestRouter) -> StatusCode {
    get_url(&format!("{}/readiness", r.url)).await.0
}

async fn wait_errors(r: &TestRouter, reason: &str, at_least: f64) {
    let (m, labels) = (r.metrics_url.clone(), format!("reason=\"{reason}\""));
    wait_until_async(&format!("{reason} errors counted"), || {
        let (m, labels) = (m.clone(), labels.clone());
        async move {
            metric_value(&scrape(&m).await, "kvroute_discovery_errors_total", &labels)
                .is_some_and(|n| n >= at_least)
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pools_ready_pods_are_its_endpoints_and_the_picker_is_ready_once_they_are() {
    let (ports, urls, _mocks) = engines(2, 1).await;
    let api = FakeApi::start().await;
    api.put(pod("a", "127.0.0.2", ENGINE, true));
    api.put(pod("b", "127.0.0.3", ENGINE, false));
    api.put(pod("c", "127.0.0.4", &[("app", "other")], true));
    // No pool yet: no endpoint, not ready.
    let r = TestRouter::start_unready(pool_router_settings(&api, 30)).await;
    r.wait_metric("kvroute_discovered_workers", "source=\"epp\"", Some(0.0))
        .await;
    assert_eq!(readiness(&r).await, StatusCode::SERVICE_UNAVAILABLE);

    api.put(inference_pool("pool", ENGINE, &ports));
    wait_endpoints(&r, &[("a-rank-0", &urls[0][0])]).await;
    assert_eq!(urls[0][0], format!("http://127.0.0.2:{}", ports[0]));
    let gw = r.gateway.clone();
    tokio::time::timeout(Duration::from_secs(20), gw.wait_ready())
        .await
        .expect("ready once its endpoints are probed");
    assert_eq!(readiness(&r).await, StatusCode::OK);
    let listed = r.get_json("/workers").await;
    assert_eq!(listed["workers"][0]["id"], "a-rank-0");
    assert_eq!(listed["workers"][0]["source"], "epp");
    assert_eq!(listed["workers"][0]["pod"], "ml/a");

    // b turns Ready: it joins; a is deleted: it leaves.
    api.put(pod("b", "127.0.0.3", ENGINE, true));
    wait_endpoints(&r, &[("a-rank-0", &urls[0][0]), ("b-rank-0", &urls[1][0])]).await;
    api.delete("a");
    wait_endpoints(&r, &[("b-rank-0", &urls[1][0])]).await;
    // No Ready pod left: no endpoint, not ready.
    api.put(pod("b", "127.0.0.3", ENGINE, false));
    wait_endpoints(&r, &[]).await;
    assert_eq!(readiness(&r).await, StatusCode::SERVICE_UNAVAILABLE);
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_selector_change_moves_the_endpoints_and_a_deleted_pool_has_none() {
    let (ports, urls, _mocks) = engines(2, 1).await;
    let api = FakeApi::start().await;
    api.put(pod(
        "a",
        "127.0.0.2",
        &[("app", "engine"), ("model", "a")],
        true,
    ));
    api.put(pod(
        "b",
        "127.0.0.3",
        &[("app", "engine"), ("model", "b")],
        true,
    ));
    api.put(inference_pool("pool", &[("model", "a")], &ports));
    let r = TestRouter::start_unready(pool_router_settings(&api, 30)).await;
    wait_endpoints(&r, &[("a-rank-0", &urls[0][0])]).await;

    api.put(inference_pool("pool", &[("model", "b")], &ports));
    wait_endpoints(&r, &[("b-rank-0", &urls[1][0])]).await;
    // The new selector's watch follows its pods.
    api.put(pod(
        "a",
        "127.0.0.2",
        &[("app", "engine"), ("model", "b")],
        true,
    ));
    wait_endpoints(&r, &[("a-rank-0", &urls[0][0]), ("b-rank-0", &urls[1][0])]).await;

    api.delete_pool("pool");
    wait_endpoints(&r, &[]).await;
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_target_port_adds_an_endpoint_per_pod() {
    let (ports, urls, _mocks) = engines(2, 2).await;
    let api = FakeApi::start().await;
    api.put(pod("a", "127.0.0.2", ENGINE, true));
    api.put(pod("b", "127.0.0.3", ENGINE, true));
    api.put(inference_pool("pool", ENGINE, &ports[..1]));
    let r = TestRouter::start_unready(pool_router_settings(&api, 30)).await;
    wait_endpoints(&r, &[("a-rank-0", &urls[0][0]), ("b-rank-0", &urls[1][0])]).await;

    api.put(inference_pool("pool", ENGINE, &ports));
    wait_endpoints(
        &r,
        &[
            ("a-rank-0", &urls[0][0]),
            ("a-rank-1", &urls[0][1]),
            ("b-rank-0", &urls[1][0]),
            ("b-rank-1", &urls[1][1]),
        ],
    )
    .await;
    assert_eq!(urls[1][1], format!("http://127.0.0.3:{}", ports[1]));
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_that_forbids_or_garbles_or_an_unusable_pool_changes_nothing() {
    let (ports, urls, _mocks) = engines(2, 1).await;
    let api = FakeApi::start().await;
    api.put(pod("a", "127.0.0.2", ENGINE, true));
    api.put(pod("b", "127.0.0.3", ENGINE, true));
    api.put(inference_pool("pool", ENGINE, &ports));
    let r = TestRouter::start_unready(pool_router_settings(&api, 1)).await;
    let both = [("a-rank-0", &urls[0][0]), ("b-rank-0", &urls[1][0])];
    wait_endpoints(&r, &both).await;
    let before = endpoints(&r);

    api.forbid(true);
    wait_errors(&r, "forbidden", 2.0).await;
    assert_eq!(endpoints(&r), before);
    api.forbid(false);
    // A pool whose spec selects nothing usable (an empty selector) changes nothing either.
    api.put(inference_pool("pool", &[], &ports));
    wait_errors(&r, "invalid", 1.0).await;
    assert_eq!(endpoints(&r), before);
    api.put(inference_pool("pool", ENGINE, &ports));
    api.garble(true);
    wait_errors(&r, "invalid", 3.0).await;
    assert_eq!(endpoints(&r), before);
    // Sense again: a delete made meanwhile is seen by the next list.
    api.delete_unseen("b", false);
    api.garble(false);
    wait_endpoints(&r, &[("a-rank-0", &urls[0][0])]).await;
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_answered_410_relists() {
    let (ports, urls, _mocks) = engines(2, 1).await;
    let api = FakeApi::start().await;
    api.put(pod("a", "127.0.0.2", ENGINE, true));
    api.put(pod("b", "127.0.0.3", ENGINE, true));
    api.put(inference_pool("pool", ENGINE, &ports));
    // The periodic relist is far off: only the watcher's own relist can find the delete.
    let r = TestRouter::start_unready(pool_router_settings(&api, 3600)).await;
    wait_endpoints(&r, &[("a-rank-0", &urls[0][0]), ("b-rank-0", &urls[1][0])]).await;
    let (lists, _) = api.calls();
    // b goes while the watches are down; they resume from before it and get 410.
    api.delete_unseen("b", true);
    wait_endpoints(&r, &[("a-rank-0", &urls[0][0])]).await;
    assert!(api.calls().0 > lists, "the watchers listed again after 410");
    // The pool's watch relisted too: it still follows the pool.
    api.put(inference_pool("pool", &[("app", "none")], &ports));
    wait_endpoints(&r, &[]).await;
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn selector_mode_watches_the_selected_pods_on_the_target_ports() {
    let (ports, urls, _mocks) = engines(2, 2).await;
    let api = FakeApi::start().await;
    api.put(pod("a", "127.0.0.2", &[("app", "engine")], true));
    api.put(pod("b", "127.0.0.3", &[("app", "sim")], true));
    api.put(pod(
        "c",
        "127.0.0.4",
        &[("app", "engine"), ("tier", "canary")],
        true,
    ));
    api.put(pod("d", "127.0.0.5", &[("app", "other")], true));
    let selector = EppEndpoints::Selector {
        selector: "app in (engine, sim),tier!=canary".into(),
        target_ports: ports.clone(),
        namespace: "ml".into(),
        kubeconfig: Some(api.kubeconfig.clone()),
    };
    let r = TestRouter::start_unready(picking(selector, 30)).await;
    wait_endpoints(
        &r,
        &[
            ("a-rank-0", &urls[0][0]),
            ("a-rank-1", &urls[0][1]),
            ("b-rank-0", &urls[1][0]),
            ("b-rank-1", &urls[1][1]),
        ],
    )
    .await;
    api.put(pod(
        "a",
        "127.0.0.2",
        &[("app", "engine"), ("tier", "canary")],
        true,
    ));
    wait_endpoints(&r, &[("b-rank-0", &urls[1][0]), ("b-rank-1", &urls[1][1])]).await;
    r.stop().await;
}

/// Through a real Envoy: the picker's traffic follows the pool's selector.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_envoy_a_selector_change_moves_the_traffic() {
    let (ports, urls, _mocks) = engines(2, 1).await;
    let api = FakeApi::start().await;
    api.put(pod("a", "127.0.0.2", &[("model", "a")], true));
    api.put(pod("b", "127.0.0.3", &[("model", "b")], true));
    api.put(inference_pool("pool", &[("model", "a")], &ports));
    let r = TestRouter::start_unready(pool_router_settings(&api, 30)).await;
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let health = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = grpc.local_addr().unwrap().port();
    r.gateway
        .serve_epp(kvroute_gateway::epp::serve::EppListeners { grpc, health })
        .unwrap();
    let envoy = Envoy::start("envoy.yaml", &[port]).await;
    wait_endpoints(&r, &[("a-rank-0", &urls[0][0])]).await;
    let body = r#"{"model":"kvroute-sim","prompt":"hi"}"#;
    for _ in 0..3 {
        let reply = post(&envoy.url, "/v1/completions", &[], body).await;
        assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
        assert_eq!(reply.worker(), "a-rank-0");
        assert_eq!(
            reply.json()["worker"],
            "pod0",
            "the engine on pod a answered"
        );
    }
    api.put(inference_pool("pool", &[("model", "b")], &ports));
    wait_endpoints(&r, &[("b-rank-0", &urls[1][0])]).await;
    for _ in 0..3 {
        let reply = post(&envoy.url, "/v1/completions", &[], body).await;
        assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
        assert_eq!(reply.worker(), "b-rank-0");
        assert_eq!(
            reply.json()["worker"],
            "pod1",
            "the engine on pod b answered"
        );
    }
    drop(envoy);
    r.stop().await;
}
