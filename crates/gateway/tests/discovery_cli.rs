//! The discovery flags of the `kvroute` binary, from the command line to a request served
//! by a discovered worker.

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};

use serde_json::json;
use support::*;
use tokio_util::sync::CancellationToken;

fn kvroute() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvroute"))
}

#[test]
fn discovery_flags_that_cannot_work_exit_2_and_say_why() {
    for (args, says) in [
        (
            &[
                "--service-discovery",
                "--discovery-provider",
                "kubernetes",
                "--selector",
                "app=e",
            ][..],
            "not both",
        ),
        (&["--selector", "app=e"][..], "need --service-discovery"),
        (&["--service-discovery"][..], "needs --selector"),
        (
            &["--service-discovery", "--selector", "app"][..],
            "label=value",
        ),
        (
            &["--discovery-provider", "file"][..],
            "needs --discovery-file",
        ),
        (
            &[
                "--discovery-file",
                "w.yaml",
                "--discovery-check-interval-secs",
                "0",
            ][..],
            "must be positive",
        ),
    ] {
        let out = kvroute().args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

/// The lines a child writes to stderr, collected as they come.
fn collect_stderr(child: &mut std::process::Child) -> Arc<Mutex<Vec<String>>> {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let stderr = BufReader::new(child.stderr.take().unwrap());
    let into = lines.clone();
    std::thread::spawn(move || {
        for line in stderr.lines().map_while(Result::ok) {
            into.lock().unwrap().push(line);
        }
    });
    lines
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_finds_its_workers_in_kubernetes_and_keeps_them_when_forbidden() {
    let engines = CancellationToken::new();
    let (port, urls) = sim_pods(1, &[], &engines).await;
    let api = FakeApi::start().await;
    let (api_port, metrics_port) = (free_port(), free_port());
    let mut child = ChildGuard(
        kvroute()
            .args([
                "--service-discovery",
                "--selector",
                "app=engine",
                "--service-discovery-port",
            ])
            .arg(port.to_string())
            .args(["--discovery-check-interval-secs", "1", "--port"])
            .arg(api_port.to_string())
            .arg("--prometheus-port")
            .arg(metrics_port.to_string())
            .env("KUBECONFIG", &api.kubeconfig)
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env_remove("RUST_LOG")
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let log = collect_stderr(&mut child.0);
    let base = format!("http://127.0.0.1:{api_port}");
    let metrics = format!("http://127.0.0.1:{metrics_port}");
    let body = json!({"model": "kvroute-sim", "max_tokens": 2,
                      "messages": [{"role": "user", "content": "hi"}]})
    .to_string();
    // No pod yet: no embedded engine either, and requests have no endpoint.
    let (health, readiness) = (format!("{base}/health"), format!("{base}/readiness"));
    wait_until_async("kvroute listening", || answers(&health)).await;
    post(&base, "/v1/chat/completions", &[], &body)
        .await
        .assert_error(503, "no_endpoint");

    api.put(pod("engine-0", "127.0.0.2", &[("app", "engine")], true));
    wait_until_async("kvroute ready", || answers(&readiness)).await;
    let reply = post(&base, "/v1/chat/completions", &[], &body).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert_eq!(reply.worker(), urls[0]);

    api.forbid(true);
    wait_until_async("forbidden calls counted", || {
        let metrics = metrics.clone();
        async move {
            metric_value(
                &scrape(&metrics).await,
                "kvroute_discovery_errors_total",
                "reason=\"forbidden\"",
            )
            .is_some_and(|n| n >= 3.0)
        }
    })
    .await;
    let reply = post(&base, "/v1/chat/completions", &[], &body).await;
    assert_eq!(reply.status, 200, "the worker stays while the API forbids");
    drop(child);
    let log = log.lock().unwrap();
    let failures: Vec<&String> = log
        .iter()
        .filter(|l| l.contains("Kubernetes API call failed"))
        .collect();
    assert_eq!(
        failures.len(),
        1,
        "one line for the whole outage: {failures:#?}"
    );
    assert!(failures[0].contains("forbidden"), "{}", failures[0]);
    assert!(
        !log.iter().any(|l| l.contains("embedded simulated engines")),
        "{log:#?}"
    );
    engines.cancel();
}
