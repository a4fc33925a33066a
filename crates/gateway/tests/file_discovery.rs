//! `--discovery-file`: workers listed in a file, picked up on real edits of it.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kvroute_core::PolicyKind;
use kvroute_gateway::{Args, Settings};
use serde_json::json;
use support::*;
use tokio_util::sync::CancellationToken;

/// A fresh directory for the file.
fn dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-fd-{:x}", rand::random::<u64>()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Replaces the file as editors and ConfigMap volumes do: a new file renamed over it.
fn replace(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

fn watching(path: &Path, static_urls: Vec<String>) -> Settings {
    Args {
        discovery_file: Some(path.to_owned()),
        // Far off: every change below is seen through the file watch.
        discovery_check_interval_secs: Some(3600),
        worker_urls: static_urls,
        policy: Some(PolicyKind::RoundRobin),
        ..Args::default()
    }
    .into_settings()
    .unwrap()
}

/// id -> source of the router's workers.
fn sources(r: &TestRouter) -> BTreeMap<String, String> {
    r.gateway
        .workers()
        .statuses()
        .into_iter()
        .map(|w| (w.id, w.source.to_owned()))
        .collect()
}

async fn wait_sources(r: &TestRouter, want: &[(&str, &str)]) {
    let want: BTreeMap<String, String> = want
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let gw = r.gateway.clone();
    wait_until(&format!("workers {want:?}"), || {
        let statuses = gw.workers().statuses();
        statuses
            .iter()
            .map(|w| (w.id.clone(), w.source.to_owned()))
            .collect::<BTreeMap<_, _>>()
            == want
            && statuses.iter().all(|w| w.healthy)
    })
    .await;
}

fn completion() -> String {
    json!({"model": "kvroute-sim", "prompt": "hello", "max_tokens": 2}).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_edits_add_replace_and_drain_workers_and_a_bad_file_changes_nothing() {
    let stop = CancellationToken::new();
    let (a, b, s) = (
        serve_sim(&[], &stop).await,
        serve_sim(&[], &stop).await,
        serve_sim(&[], &stop).await,
    );
    let dir = dir();
    let path = dir.join("workers.yaml");
    // The file is not there yet: only the static worker.
    let r = TestRouter::start_unready(watching(&path, vec![s.clone()])).await;
    wait_sources(&r, &[(&s, "static")]).await;

    std::fs::write(&path, format!("workers:\n  - url: {a}\n")).unwrap();
    wait_sources(&r, &[(&s, "static"), (&a, "file")]).await;

    replace(
        &path,
        &format!("workers:\n  - url: {a}\n  - url: {b}\n    taints: [zone-a]\n"),
    );
    wait_sources(&r, &[(&s, "static"), (&a, "file"), (&b, "file")]).await;
    let only_b = [("x-kvroute-required-taints", "zone-a")];
    r.assert_routed(&only_b, [completion()], &b).await;

    // b changes (its taint): replaced, and requests follow the new spec.
    replace(
        &path,
        &format!("workers:\n  - url: {a}\n  - url: {b}\n    taints: [zone-b]\n"),
    );
    let gw = r.gateway.clone();
    let b_id = b.clone();
    wait_until("b replaced", || {
        gw.workers()
            .get(&b_id)
            .is_some_and(|w| w.taints == ["zone-b"])
    })
    .await;
    r.complete(&only_b, &completion())
        .await
        .assert_error(503, "no_endpoint");

    // A file that does not parse, or lists a bad worker, changes nothing.
    replace(&path, "workers: [\n");
    r.wait_metric(
        "kvroute_discovery_errors_total",
        "reason=\"file\"",
        Some(1.0),
    )
    .await;
    replace(
        &path,
        &format!("workers:\n  - url: {a}\n  - url: gopher://{b}\n"),
    );
    r.wait_metric(
        "kvroute_discovery_errors_total",
        "reason=\"file\"",
        Some(2.0),
    )
    .await;
    assert_eq!(sources(&r).len(), 3);

    // a dropped from the file: it leaves; the static worker stays whatever the file says.
    replace(&path, &format!("- url: {b}\n"));
    wait_sources(&r, &[(&s, "static"), (&b, "file")]).await;
    std::fs::write(&path, "workers: []\n").unwrap();
    wait_sources(&r, &[(&s, "static")]).await;
    r.wait_metric("kvroute_discovered_workers", "source=\"file\"", Some(0.0))
        .await;
    r.wait_metric("kvroute_discovered_workers", "source=\"static\"", Some(1.0))
        .await;
    r.stop_idle().await;
    stop.cancel();
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_workers_survive_the_file_and_the_file_survives_admin_calls() {
    let stop = CancellationToken::new();
    let (a, m) = (serve_sim(&[], &stop).await, serve_sim(&[], &stop).await);
    let dir = dir();
    let path = dir.join("workers.yaml");
    std::fs::write(&path, format!("workers:\n  - url: {a}\n")).unwrap();
    let r = TestRouter::start_unready(watching(&path, vec![])).await;
    wait_sources(&r, &[(&a, "file")]).await;
    let added = r
        .post("/workers", &[], &json!({"url": m}).to_string())
        .await;
    assert_eq!(added.status, 201, "{:?}", added.body);
    wait_sources(&r, &[(&a, "file"), (&m, "admin")]).await;
    replace(&path, "workers: []\n");
    wait_sources(&r, &[(&m, "admin")]).await;
    let listed = r.get_json("/workers").await;
    assert_eq!(listed["workers"][0]["source"], "admin");
    assert!(listed["workers"][0].get("pod").is_none());
    r.stop_idle().await;
    stop.cancel();
    std::fs::remove_dir_all(dir).unwrap();
}
