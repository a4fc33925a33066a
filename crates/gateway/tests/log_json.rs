//! `--log-json`: one JSON object per line, each request's lines carrying its request id and
//! the trace id of its `traceparent`.

mod support;

use std::io::Read;
use std::process::{Command, Stdio};

use serde_json::Value;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_line_is_json_and_a_requests_lines_carry_its_ids() {
    let live = MockWorker::start("live", &["m"]).await;
    let broken = broken_worker("m").await;
    let port = free_port();
    let mut child = ChildGuard(
        Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(["--port", &port.to_string(), "--prometheus-port", "0"])
            .args([
                "--worker-urls",
                &broken,
                &live.url,
                "--policy",
                "round_robin",
            ])
            .args(["--log-json", "--log-level", "info"])
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut stderr = child.0.stderr.take().unwrap();
    let log = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let url = format!("http://127.0.0.1:{port}");
    let ready = format!("{url}/readiness");
    wait_until_async("kvroute ready", || answers(&ready)).await;
    // Round robin: one of two requests tries the broken worker first, and is retried.
    let trace = "0af7651916cd43dd8448eb211c80319c";
    for i in 0..2 {
        let id = format!("req-{i}");
        let traceparent = format!("00-{trace}-b7ad6b7169203331-01");
        let r = post(
            &url,
            "/v1/completions",
            &[("x-request-id", &id), ("traceparent", &traceparent)],
            r#"{"model":"m","prompt":"hi"}"#,
        )
        .await;
        assert_eq!(r.status, 200, "{:?}", r.body);
    }
    let _ = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status();
    let _ = child.0.wait();
    let log = log.join().unwrap();
    let lines: Vec<Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(lines
        .iter()
        .all(|l| l["level"].is_string() && l["fields"]["message"].is_string()));
    let retried = lines
        .iter()
        .find(|l| {
            l["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("retrying on another worker"))
        })
        .unwrap_or_else(|| panic!("no retry line in:\n{log}"));
    let span = &retried["span"];
    assert!(
        span["request_id"]
            .as_str()
            .is_some_and(|id| id.starts_with("req-")),
        "{retried}"
    );
    assert_eq!(span["trace_id"], trace, "{retried}");
    assert_eq!(span["route"], "/v1/completions");
}
