//! Kubernetes service discovery end to end: a fake API server speaking the real list/watch
//! wire format ([`FakeApi`]), kvroute's kube-rs client reaching it through a kubeconfig, and
//! engines on 127.0.0.2, 127.0.0.3, ... sharing one port, as pods do.

mod support;

use std::collections::BTreeSet;

use http::StatusCode;
use http_body_util::BodyExt;
use kvroute_core::PolicyKind;
use kvroute_gateway::{Args, Settings};
use serde_json::json;
use support::*;
use tokio_util::sync::CancellationToken;

const ENGINE: &[(&str, &str)] = &[("app", "engine")];

/// A router discovering `app=engine` pods on `port` through `api`, round robin, re-listing
/// every `relist_secs`.
fn discovering(api: &FakeApi, port: u16, relist_secs: u64) -> Settings {
    Args {
        service_discovery: true,
        selector: vec!["app=engine".into()],
        service_discovery_port: Some(port),
        service_discovery_namespace: Some("ml".into()),
        kubeconfig: Some(api.kubeconfig.clone()),
        discovery_check_interval_secs: Some(relist_secs),
        policy: Some(PolicyKind::RoundRobin),
        ..Args::default()
    }
    .into_settings()
    .unwrap()
}

fn completion(prompt: &str) -> String {
    json!({"model": "kvroute-sim", "prompt": prompt, "max_tokens": 2}).to_string()
}

/// The router's worker ids now.
fn ids(r: &TestRouter) -> BTreeSet<String> {
    r.gateway
        .workers()
        .statuses()
        .into_iter()
        .map(|w| w.id)
        .collect()
}

/// Waits until the router's workers are exactly `urls`, each probed and healthy.
async fn wait_workers(r: &TestRouter, urls: &[&String]) {
    let want: BTreeSet<String> = urls.iter().map(|u| u.to_string()).collect();
    let gw = r.gateway.clone();
    wait_until(&format!("workers {want:?}"), || {
        let statuses = gw.workers().statuses();
        statuses
            .iter()
            .map(|w| &w.id)
            .cloned()
            .collect::<BTreeSet<_>>()
            == want
            && statuses.iter().all(|w| w.healthy)
    })
    .await;
}

/// Two Ready `app=engine` pods, a and b, on kvroute-sim engines at 127.0.0.2 and 127.0.0.3,
/// and a router (re-listing every `relist_secs`) that has found both: the engines' stop
/// token, their URLs, the API and the router.
async fn two_pods(relist_secs: u64) -> (CancellationToken, Vec<String>, FakeApi, TestRouter) {
    let engines = CancellationToken::new();
    let (port, urls) = sim_pods(2, &[], &engines).await;
    let api = FakeApi::start().await;
    api.put(pod("a", "127.0.0.2", ENGINE, true));
    api.put(pod("b", "127.0.0.3", ENGINE, true));
    let r = TestRouter::start_unready(discovering(&api, port, relist_secs)).await;
    wait_workers(&r, &[&urls[0], &urls[1]]).await;
    (engines, urls, api, r)
}

/// Sends `n` completions: the workers that served them (each must succeed).
async fn served_by(r: &TestRouter, n: usize) -> BTreeSet<String> {
    let bodies = (0..n).map(|i| completion(&format!("hello {i}")));
    r.tally_routes("/v1/completions", bodies)
        .await
        .into_keys()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_matching_ready_pods_are_workers_and_a_pod_that_turns_ready_joins() {
    let engines = CancellationToken::new();
    let (port, urls) = sim_pods(3, &[], &engines).await;
    let api = FakeApi::start().await;
    api.put(pod("a", "127.0.0.2", ENGINE, true));
    api.put(pod("b", "127.0.0.3", ENGINE, false));
    api.put(pod("c", "127.0.0.4", &[("app", "other")], true));
    let r = TestRouter::start_unready(discovering(&api, port, 30)).await;
    wait_workers(&r, &[&urls[0]]).await;
    assert_eq!(served_by(&r, 4).await, BTreeSet::from([urls[0].clone()]));
    let listed = r.get_json("/workers").await;
    assert_eq!(listed["workers"][0]["source"], "kubernetes");
    assert_eq!(listed["workers"][0]["pod"], "ml/a");
    assert_eq!(listed["workers"][0]["url"], urls[0].as_str());

    api.put(pod("b", "127.0.0.3", ENGINE, true));
    wait_workers(&r, &[&urls[0], &urls[1]]).await;
    assert_eq!(
        served_by(&r, 4).await,
        BTreeSet::from([urls[0].clone(), urls[1].clone()])
    );
    r.wait_metric(
        "kvroute_discovered_workers",
        "source=\"kubernetes\"",
        Some(2.0),
    )
    .await;
    // Not Ready again: it leaves.
    api.put(pod("b", "127.0.0.3", ENGINE, false));
    wait_workers(&r, &[&urls[0]]).await;
    r.stop_idle().await;
    engines.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_pod_leaves_and_its_open_stream_completes() {
    let (port, mut listeners) = pod_listeners(2).await;
    let b = MockWorker::start_on(listeners.pop().unwrap(), "b", &["kvroute-sim"]);
    let a = MockWorker::start_on(listeners.pop().unwrap(), "a", &["kvroute-sim"]);
    let api = FakeApi::start().await;
    api.put(pod("a", "127.0.0.2", ENGINE, true));
    api.put(pod("b", "127.0.0.3", ENGINE, true));
    let r = TestRouter::start_unready(discovering(&api, port, 30)).await;
    wait_workers(&r, &[&a.url, &b.url]).await;
    // A stream held open on a, then a's pod is deleted.
    let body = json!({"model": "kvroute-sim", "prompt": "x", "max_tokens": 3, "stream": true,
                      "user": "s"})
    .to_string();
    let stream = open_stream_with(
        &r.url,
        "/v1/completions",
        &[("x-kvroute-worker", &a.url)],
        &body,
    )
    .await;
    assert_eq!(stream.status(), StatusCode::OK);
    r.wait_in_flight(&a.url, |n| n == 1).await;
    api.delete("a");
    wait_workers(&r, &[&b.url]).await;
    assert_eq!(served_by(&r, 3).await, BTreeSet::from([b.url.clone()]));
    // The stream still completes, in full.
    a.release.add_permits(1);
    let text = stream.into_body().collect().await.unwrap().to_bytes();
    let text = String::from_utf8_lossy(&text);
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    r.stop_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relabelled_pod_leaves() {
    let (engines, urls, api, r) = two_pods(30).await;
    api.put(pod("b", "127.0.0.3", &[("app", "retired")], true));
    wait_workers(&r, &[&urls[0]]).await;
    assert_eq!(served_by(&r, 3).await, BTreeSet::from([urls[0].clone()]));
    r.stop_idle().await;
    engines.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_the_watch_missed_is_reconciled_by_the_relist_after_410() {
    // The periodic relist is far off: only the watcher's own relist can find the delete.
    let (engines, urls, api, r) = two_pods(3600).await;
    let (lists, _) = api.calls();
    // b goes while the watch is down; the watch resumes from before it and gets 410.
    api.delete_unseen("b", true);
    wait_workers(&r, &[&urls[0]]).await;
    assert!(
        api.calls().0 > lists,
        "the watcher listed again after the 410"
    );
    assert_eq!(served_by(&r, 3).await, BTreeSet::from([urls[0].clone()]));
    r.stop_idle().await;
    engines.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_no_watch_reported_is_reconciled_by_the_periodic_relist() {
    let (engines, urls, api, r) = two_pods(1).await;
    // The watch stays open and never hears of it: only a full list shows b gone.
    api.delete_unseen("b", false);
    wait_workers(&r, &[&urls[0]]).await;
    r.stop_idle().await;
    engines.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_server_that_goes_away_leaves_the_workers_in_place() {
    let (engines, urls, api, r) = two_pods(1).await;
    api.stop();
    let m = r.metrics_url.clone();
    wait_until_async("an unreachable API counted", || {
        let m = m.clone();
        async move {
            metric_value(
                &scrape(&m).await,
                "kvroute_discovery_errors_total",
                "reason=\"unreachable\"",
            )
            .is_some_and(|n| n >= 2.0)
        }
    })
    .await;
    assert_eq!(ids(&r), BTreeSet::from([urls[0].clone(), urls[1].clone()]));
    assert_eq!(
        served_by(&r, 4).await,
        BTreeSet::from([urls[0].clone(), urls[1].clone()])
    );
    r.stop_idle().await;
    engines.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_that_do_not_parse_are_counted_and_change_nothing() {
    let (engines, urls, api, r) = two_pods(1).await;
    api.garble(true);
    let m = r.metrics_url.clone();
    wait_until_async("unparsable answers counted", || {
        let m = m.clone();
        async move {
            metric_value(
                &scrape(&m).await,
                "kvroute_discovery_errors_total",
                "reason=\"invalid\"",
            )
            .is_some_and(|n| n >= 2.0)
        }
    })
    .await;
    assert_eq!(ids(&r), BTreeSet::from([urls[0].clone(), urls[1].clone()]));
    // Sense again: a delete made meanwhile is seen by the next list.
    api.delete_unseen("b", false);
    api.garble(false);
    wait_workers(&r, &[&urls[0]]).await;
    r.stop_idle().await;
    engines.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forbidding_api_is_counted_and_requests_get_no_endpoint() {
    let api = FakeApi::start().await;
    api.forbid(true);
    api.put(pod("a", "127.0.0.2", ENGINE, true));
    let r = TestRouter::start_unready(discovering(&api, 9, 1)).await;
    r.wait_metric(
        "kvroute_discovered_workers",
        "source=\"kubernetes\"",
        Some(0.0),
    )
    .await;
    let m = r.metrics_url.clone();
    wait_until_async("a forbidden call counted", || {
        let m = m.clone();
        async move {
            metric_value(
                &scrape(&m).await,
                "kvroute_discovery_errors_total",
                "reason=\"forbidden\"",
            )
            .is_some_and(|n| n >= 2.0)
        }
    })
    .await;
    let reply = r.complete(&[], &completion("hi")).await;
    reply.assert_error(503, "no_endpoint");
    // Allowed again: the pod becomes a worker (no engine listens there: it is unhealthy).
    api.forbid(false);
    let gw = r.gateway.clone();
    wait_until("the pod found once allowed", || {
        gw.workers()
            .statuses()
            .iter()
            .any(|w| w.pod.as_deref() == Some("ml/a"))
    })
    .await;
    r.stop().await;
}

/// Figures, not a test (`cargo test --release -p kvroute-gateway --test kubernetes -- --ignored
/// --nocapture`): how long a pod change takes to reach routing, and the API calls made at
/// rest with the default re-list interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn figures_pod_change_to_routing_and_api_calls_at_rest() {
    use std::time::{Duration, Instant};
    let engines = CancellationToken::new();
    let (port, urls) = sim_pods(1, &[], &engines).await;
    let api = FakeApi::start().await;
    let r = TestRouter::start_unready(discovering(&api, port, 30)).await;
    let gw = r.gateway.clone();
    let until = |cond: &dyn Fn() -> bool| {
        let start = Instant::now();
        while !cond() {
            std::thread::sleep(Duration::from_micros(200));
            assert!(start.elapsed() < Duration::from_secs(20));
        }
        start.elapsed()
    };
    let (mut join, mut leave) = (Vec::new(), Vec::new());
    for _ in 0..20 {
        api.put(pod("a", "127.0.0.2", ENGINE, true));
        // Routable: in the table, probed and healthy.
        join.push(until(&|| {
            gw.workers()
                .statuses()
                .iter()
                .any(|w| w.id == urls[0] && w.healthy)
        }));
        api.delete("a");
        leave.push(until(&|| gw.workers().statuses().is_empty()));
    }
    let ms = |v: &mut Vec<Duration>| {
        v.sort();
        format!(
            "p50 {:.1} ms, max {:.1} ms",
            v[v.len() / 2].as_secs_f64() * 1e3,
            v[v.len() - 1].as_secs_f64() * 1e3
        )
    };
    println!("pod Ready -> worker routable: {}", ms(&mut join));
    println!("pod deleted -> worker out of routing: {}", ms(&mut leave));
    api.put(pod("a", "127.0.0.2", ENGINE, true));
    until(&|| gw.workers().statuses().iter().any(|w| w.healthy));
    let before = api.calls();
    tokio::time::sleep(Duration::from_secs(60)).await;
    let after = api.calls();
    println!(
        "API calls in 60 s at rest (default --discovery-check-interval-secs 30): {} lists, {} watches",
        after.0 - before.0,
        after.1 - before.1
    );
    r.stop().await;
    engines.cancel();
}
