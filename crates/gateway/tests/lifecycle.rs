//! The `kvroute` process's lifecycle, with real signals: SIGTERM drains in-flight requests
//! (up to the grace period) and exits 0; SIGHUP re-reads the config's workers; a client that
//! never finishes its headers is cut off.

mod support;

use std::process::{Command, Stdio};
use std::time::Duration;

use http_body_util::BodyExt;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Signals to the `kvroute` process under test.
trait Signals {
    fn signal(&self, name: &str);
    async fn exit_code(&mut self) -> Option<i32>;
}

impl Signals for ChildGuard {
    fn signal(&self, name: &str) {
        let ok = Command::new("kill")
            .args([format!("-{name}"), self.0.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{name}");
    }

    /// Waits for the process to exit (20 s at most) and returns its status code.
    async fn exit_code(&mut self) -> Option<i32> {
        let mut status = None;
        wait_until("kvroute to exit", || {
            status = self.0.try_wait().unwrap();
            status.is_some()
        })
        .await;
        status.unwrap().code()
    }
}

/// What [`start`] does with the process's stderr.
#[derive(PartialEq)]
enum Log {
    Discard,
    /// Read on a thread: [`Kvroute::log`].
    Keep,
}

/// A `kvroute` process, ready.
struct Kvroute {
    child: ChildGuard,
    url: String,
    metrics_url: String,
    /// With [`Log::Keep`]: the thread reading stderr, which returns all of it once the
    /// process has ended.
    log: Option<std::thread::JoinHandle<String>>,
}

/// Starts `kvroute` with `args` on free ports and waits until it is ready.
async fn start(args: &[&str], log: Log) -> Kvroute {
    let (port, metrics_port) = (free_port(), free_port());
    let mut child = ChildGuard(
        Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(["--port", &port.to_string()])
            .args(["--prometheus-port", &metrics_port.to_string()])
            .args(args)
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(if log == Log::Keep {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .spawn()
            .unwrap(),
    );
    // Read from the start: a full pipe would stall the process.
    let log = child.0.stderr.take().map(|mut stderr| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = std::io::Read::read_to_string(&mut stderr, &mut s);
            s
        })
    });
    let url = format!("http://127.0.0.1:{port}");
    let ready = format!("{url}/readiness");
    wait_until_async("kvroute ready", || answers(&ready)).await;
    Kvroute {
        child,
        url,
        metrics_url: format!("http://127.0.0.1:{metrics_port}"),
        log,
    }
}

const STREAM: &str = r#"{"model":"m","prompt":"x","stream":true,"max_tokens":2}"#;

#[tokio::test]
async fn sigterm_finishes_in_flight_requests_then_exits_0() {
    let w = MockWorker::start("w", &["m"]).await;
    let Kvroute { mut child, url, .. } = start(&["--worker-urls", &w.url], Log::Discard).await;
    let stream = open_stream(&url, "/v1/completions", STREAM).await;
    assert_eq!(stream.status(), 200);
    child.signal("TERM");
    // It stops accepting...
    wait_until_async("new connections refused", || {
        let u = url.clone();
        async move { tokio::net::TcpStream::connect(addr_of(&u)).await.is_err() }
    })
    .await;
    // ...and the open stream still completes.
    w.release.add_permits(1);
    let body = stream.into_body().collect().await.unwrap().to_bytes();
    assert!(String::from_utf8_lossy(&body).contains("[DONE]"));
    assert_eq!(child.exit_code().await, Some(0));
}

#[tokio::test]
async fn sigterm_gives_up_on_requests_after_the_grace_period() {
    let w = MockWorker::start("w", &["m"]).await;
    let Kvroute { mut child, url, .. } = start(
        &["--worker-urls", &w.url, "--shutdown-grace-period-secs", "1"],
        Log::Discard,
    )
    .await;
    let stream = open_stream(&url, "/v1/completions", STREAM).await;
    child.signal("TERM");
    // Never released: the grace period ends it.
    assert_eq!(child.exit_code().await, Some(0));
    assert!(stream.into_body().collect().await.is_err());
}

#[tokio::test]
async fn sighup_rereads_the_workers_of_the_config_file() {
    let a = MockWorker::start("a", &["m"]).await;
    let b = MockWorker::start("b", &["m"]).await;
    let dir = std::env::temp_dir().join(format!("kvroute-hup-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("router.yaml");
    let config = |id: &str, url: &str| format!("workers:\n  - id: {id}\n    url: {url}\n");
    std::fs::write(&path, config("a", &a.url)).unwrap();
    let Kvroute {
        child,
        url,
        metrics_url,
        ..
    } = start(&["--config", path.to_str().unwrap()], Log::Discard).await;
    let ids = || async {
        let (_, _, body) = get_url(&format!("{url}/workers")).await;
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        v["workers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w["id"].as_str().unwrap().to_owned())
            .collect::<Vec<_>>()
    };
    assert_eq!(ids().await, ["a"]);
    std::fs::write(&path, config("b", &b.url)).unwrap();
    child.signal("HUP");
    wait_until_async("b replaced a", || async { ids().await == ["b"] }).await;
    // b serves once probed.
    wait_until_async("b serves", || async {
        let r = post(
            &url,
            "/v1/completions",
            &[],
            r#"{"model":"m","prompt":"x"}"#,
        )
        .await;
        r.status == 200 && r.worker() == "b"
    })
    .await;
    // A broken file changes nothing, and the router lives on.
    std::fs::write(&path, "workers: [").unwrap();
    child.signal("HUP");
    wait_until_async("the failed reload is counted", || async {
        let m = scrape(&metrics_url).await;
        metric_value(&m, "kvroute_config_reloads_total", "result=\"error\"") == Some(1.0)
    })
    .await;
    assert_eq!(ids().await, ["b"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn a_client_that_never_finishes_its_headers_is_cut_off() {
    let w = MockWorker::start("w", &["m"]).await;
    let Kvroute {
        child: _child, url, ..
    } = start(
        &["--worker-urls", &w.url, "--header-read-timeout-secs", "1"],
        Log::Discard,
    )
    .await;
    let mut sock = tokio::net::TcpStream::connect(addr_of(&url)).await.unwrap();
    sock.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(20), sock.read_to_end(&mut buf)).await;
    assert!(read.is_ok(), "the connection stayed open");
    // The router itself still serves.
    assert!(answers(&format!("{url}/health")).await);
}

#[tokio::test]
async fn keys_never_reach_the_logs_even_at_debug_level() {
    let w = MockWorker::start("w", &["m"]).await;
    let Kvroute {
        mut child,
        url,
        log,
        ..
    } = start(
        &[
            "--worker-urls",
            &w.url,
            "--log-level",
            "debug",
            "--client-api-key",
            "client-s3cret",
            "--api-key",
            "worker-s3cret",
            "--admin-api-key",
            "admin-s3cret",
        ],
        Log::Keep,
    )
    .await;
    for key in ["client-s3cret", "wrong-s3cret"] {
        let auth = format!("Bearer {key}");
        post(
            &url,
            "/v1/completions",
            &[("authorization", &auth)],
            r#"{"model":"m","prompt":"x"}"#,
        )
        .await;
        post(&url, "/workers", &[("authorization", &auth)], "{}").await;
    }
    child.signal("TERM");
    assert_eq!(child.exit_code().await, Some(0));
    let log = log.unwrap().join().unwrap();
    assert!(log.contains("DEBUG"), "debug logging was on");
    for key in [
        "client-s3cret",
        "worker-s3cret",
        "admin-s3cret",
        "wrong-s3cret",
    ] {
        assert!(!log.contains(key), "{key} in the log");
    }
}

#[tokio::test]
async fn after_the_grace_period_open_connections_are_closed_and_their_load_released() {
    let w = MockWorker::start("w", &["m"]).await;
    let mut s = settings(&[&w]);
    s.shutdown_grace = Duration::from_millis(300);
    let router = TestRouter::start(s).await;
    let gateway = router.gateway.clone();
    let stream = open_stream(&router.url, "/v1/completions", STREAM).await;
    assert_eq!(in_flight(&router, &w.url), 1);
    // Never released: the grace period ends it, in this process too (no exit to rely on).
    router.stop().await;
    let body = tokio::time::timeout(Duration::from_secs(20), stream.into_body().collect())
        .await
        .expect("the connection was closed");
    assert!(body.is_err());
    assert_eq!(gateway.workers().statuses()[0].in_flight, 0);
}
