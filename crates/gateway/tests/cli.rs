//! The `kvroute` binary's start-up: exit statuses and the policy log line.

mod support;

use std::io::{BufRead, BufReader};

use std::process::{Command, Stdio};
use support::ChildGuard;

fn kvroute() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvroute"))
}

#[test]
fn unknown_policy_exits_2_and_lists_valid_names() {
    let out = kvroute()
        .args(["--worker-urls", "http://127.0.0.1:1", "--policy", "fastest"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    for name in kvroute_core::PolicyKind::ALL {
        assert!(err.contains(name.name()), "{err}");
    }
    assert!(err.contains("fastest"), "{err}");
}

#[test]
fn unknown_policy_in_config_file_exits_2() {
    let dir = std::env::temp_dir().join(format!("kvroute-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("router.yaml");
    std::fs::write(
        &path,
        "policy: fastest\nworkers:\n  - url: http://127.0.0.1:1\n",
    )
    .unwrap();
    let out = kvroute().arg("--config").arg(&path).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("valid policies") && err.contains("round_robin"),
        "{err}"
    );
    let out = kvroute()
        .arg("--config")
        .arg(dir.join("missing.yaml"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn with_no_worker_it_serves_from_embedded_simulated_engines() {
    use http_body_util::BodyExt;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = ChildGuard(
        kvroute()
            .args(["--port", &port.to_string(), "--prometheus-port", "0"])
            .env_remove("RUST_LOG")
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let stderr = BufReader::new(child.0.stderr.take().unwrap());
    // Read stderr to its end (closing it early would break the child's pipe).
    let said = std::thread::spawn(move || {
        let mut found = None;
        for line in stderr.lines().map_while(Result::ok) {
            if found.is_none() && line.contains("embedded simulated engines") {
                found = Some(line);
            }
        }
        found
    });
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build(hyper_util::client::legacy::connect::HttpConnector::new());
    let base = format!("http://127.0.0.1:{port}");
    // Readiness probe: the router answers 200 once the engines are probed.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let req = http::Request::get(format!("{base}/readiness"))
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .unwrap();
        let last = match client.request(req).await {
            Ok(r) if r.status() == 200 => break,
            Ok(r) => format!("status {}", r.status()),
            Err(e) => format!("{e:?}"),
        };
        assert!(
            tokio::time::Instant::now() < deadline,
            "never ready: {last}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let body =
        r#"{"model":"kvroute-sim","max_tokens":3,"messages":[{"role":"user","content":"hi"}]}"#;
    let req = http::Request::post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .unwrap();
    let resp = client.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["x-kvroute-worker"]
        .to_str()
        .unwrap()
        .starts_with("http://127.0.0.1:"));
    let v: serde_json::Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 3);
    drop(child);
    let line = said
        .join()
        .unwrap()
        .expect("the log says engines were started");
    assert!(line.contains("kvroute-sim"), "{line}");
}

#[test]
fn startup_logs_the_policy_with_its_parameters() {
    let mut child = kvroute()
        .args([
            "--worker-urls",
            "http://127.0.0.1:1",
            "--policy",
            "prefix_hash",
            "--port",
            "0",
            "--prometheus-port",
            "0",
        ])
        .env_remove("RUST_LOG")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let stderr = BufReader::new(child.stderr.take().unwrap());
    let mut found = None;
    for line in stderr.lines() {
        let line = line.unwrap();
        if line.contains("policy: ") {
            found = Some(line);
            break;
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let line = found.expect("a policy line");
    assert!(
        line.contains(
            "policy: PrefixHash { prefix_token_count: 256, load_factor: 1.25, virtual_nodes: 160 }"
        ),
        "{line}"
    );
}
