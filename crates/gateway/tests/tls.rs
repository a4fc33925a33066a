//! TLS end to end, with certificates made in the test: https kvroute-sim workers behind a
//! router serving https, a worker whose certificate does not verify, mTLS to a worker that
//! requires it, and the API certificate replaced by a reload.

mod support;

use http::StatusCode;
use kvroute_gateway::Args;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

/// kvroute-sim serving https with `identity` (written into `dir`), plus `extra` flags.
async fn https_sim(
    dir: &CertDir,
    identity: &Identity,
    extra: &[&str],
    stop: &CancellationToken,
) -> String {
    let (cert, key) = dir.identity("sim", identity);
    let mut argv = vec!["--tls-cert-path", arg(&cert), "--tls-key-path", arg(&key)];
    argv.extend_from_slice(extra);
    let url = serve_sim(&argv, stop).await;
    assert!(url.starts_with("https://127.0.0.1:"), "{url}");
    url
}

/// The worker's `last_error` once it holds `reason`, with the worker still unhealthy.
async fn wait_for_reason(router: &TestRouter, reason: &str) -> String {
    let last_error = || router.gateway.workers().statuses()[0].last_error.clone();
    let said = holds_within(std::time::Duration::from_secs(20), || async {
        last_error().is_some_and(|e| e.contains(reason))
    })
    .await;
    assert!(
        said,
        "the last error should say {reason}: {:?}",
        last_error()
    );
    assert!(!router.gateway.workers().statuses()[0].healthy);
    last_error().unwrap()
}

#[tokio::test]
async fn a_chat_completion_goes_over_tls_on_both_hops() {
    let dir = CertDir::new("both-hops");
    let ca = TestCa::new("kvroute test CA");
    let stop = CancellationToken::new();
    let sim_url = https_sim(&dir, &ca.issue("sim"), &[], &stop).await;
    let (api_cert, api_key) = dir.identity("router", &ca.issue("router"));
    let settings = Args {
        worker_urls: vec![sim_url.clone()],
        ca_cert_paths: vec![dir.write("ca.pem", &ca.pem())],
        tls_cert_path: Some(api_cert),
        tls_key_path: Some(api_key),
        ..Args::default()
    }
    .into_settings()
    .unwrap();
    // Ready means the worker answered its /v1/models over TLS.
    let router = TestRouter::start(settings).await;
    assert!(
        router.url.starts_with("https://127.0.0.1:"),
        "{}",
        router.url
    );
    let client = https_client(&[&ca.pem()]);
    let reply = post_https(
        &client,
        &router.url,
        "/v1/chat/completions",
        &chat("kvroute-sim", "hello over TLS"),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    assert_eq!(reply.worker(), sim_url);
    assert!(reply.json()["usage"]["completion_tokens"].as_u64().unwrap() > 0);
    // The API speaks TLS only: a plain-HTTP request gets no HTTP answer.
    let plain = format!("http://{}/health", addr_of(&router.url));
    assert!(!answers(&plain).await);
    router.stop().await;
    stop.cancel();
}

#[tokio::test]
async fn a_worker_whose_certificate_does_not_verify_is_unhealthy_and_never_sent_plain_http() {
    let dir = CertDir::new("untrusted");
    let (ours, rogue) = (
        TestCa::new("kvroute test CA"),
        TestCa::new("a CA nobody trusts"),
    );
    let stop = CancellationToken::new();
    let sim_url = https_sim(&dir, &rogue.issue("sim"), &[], &stop).await;
    let settings = Args {
        workers: vec![named_spec("rogue", "kvroute-sim", sim_url.clone())],
        ca_cert_paths: vec![dir.write("ca.pem", &ours.pem())],
        ..Args::default()
    }
    .into_settings()
    .unwrap();
    let router = TestRouter::start_unready(settings).await;
    let reason = wait_for_reason(&router, "invalid peer certificate: UnknownIssuer").await;
    assert!(reason.starts_with("TLS: "), "{reason}");
    let listed = router.get_json("/workers").await;
    let worker = &listed["workers"][0];
    assert_eq!(worker["healthy"], false, "{listed}");
    let shown = worker["last_error"].as_str().unwrap();
    assert!(shown.contains("UnknownIssuer"), "{listed}");
    let reply = router
        .post("/v1/chat/completions", &[], &chat("kvroute-sim", "hi"))
        .await;
    reply.assert_error(503, "no_endpoint");
    assert!(
        reply.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no healthy worker"),
        "{:?}",
        reply.body
    );
    // The engine saw the router's handshakes fail, none in the clear, and no request.
    let sim = https_client(&[&rogue.pem()]);
    let scrape = || async {
        let body = get_https(&sim, &sim_url, "/metrics").await.body;
        String::from_utf8(body.to_vec()).unwrap()
    };
    wait_until_async("the engine to count a refused handshake", || async {
        let m = scrape().await;
        metric_value(&m, "kvroute_sim_tls_handshakes_total", "result=\"failed\"")
            .is_some_and(|n| n >= 1.0)
    })
    .await;
    let m = scrape().await;
    assert_metric(
        &m,
        "kvroute_sim_tls_handshakes_total",
        "result=\"plaintext\"",
        None,
    );
    assert_eq!(
        metric_sum(&m, "vllm:prefix_cache_queries_total", ""),
        0.0,
        "{m}"
    );
    router.stop().await;
    stop.cancel();
}

#[tokio::test]
async fn a_worker_that_requires_a_client_certificate_gets_it_with_client_cert_path() {
    let dir = CertDir::new("mtls");
    let ca = TestCa::new("kvroute test CA");
    let ca_path = dir.write("ca.pem", &ca.pem());
    let stop = CancellationToken::new();
    let sim_url = https_sim(
        &dir,
        &ca.issue("sim"),
        &["--tls-client-ca-path", arg(&ca_path)],
        &stop,
    )
    .await;
    let args = || Args {
        workers: vec![named_spec("sim", "kvroute-sim", sim_url.clone())],
        ca_cert_paths: vec![ca_path.clone()],
        ..Args::default()
    };
    // Without a client certificate the worker refuses the router.
    let router = TestRouter::start_unready(args().into_settings().unwrap()).await;
    wait_for_reason(&router, "CertificateRequired").await;
    router
        .post("/v1/chat/completions", &[], &chat("kvroute-sim", "hi"))
        .await
        .assert_error(503, "no_endpoint");
    router.stop().await;
    // With one the CA signed, requests go through.
    let (cert, key) = dir.identity("router-client", &ca.issue("kvroute"));
    let settings = Args {
        client_cert_path: Some(cert),
        client_key_path: Some(key),
        ..args()
    }
    .into_settings()
    .unwrap();
    let router = TestRouter::start(settings).await;
    let reply = router
        .post("/v1/chat/completions", &[], &chat("kvroute-sim", "hi"))
        .await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    assert_eq!(reply.worker(), "sim");
    assert_eq!(router.gateway.workers().statuses()[0].last_error, None);
    router.stop().await;
    stop.cancel();
}

/// One `GET /health` on an open HTTP/1.1 connection, which it closes: the answer's status line.
async fn health_on<S>(mut stream: S) -> String
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    stream
        .write_all(b"GET /health HTTP/1.1\r\nhost: kvroute\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    // The server closes without a close_notify at times; what came before is the answer.
    let _ = stream.read_to_end(&mut answer).await;
    let answer = String::from_utf8_lossy(&answer).into_owned();
    answer.lines().next().unwrap_or_default().to_owned()
}

#[tokio::test]
async fn the_api_certificate_is_replaced_on_reload_for_new_connections() {
    let dir = CertDir::new("reload");
    let (first_ca, second_ca) = (TestCa::new("first CA"), TestCa::new("second CA"));
    let (first, second) = (first_ca.issue("first"), second_ca.issue("second"));
    let (cert_path, key_path) = dir.identity("api", &first);
    let [worker] = mocks(["w"]).await;
    let settings = Args {
        workers: vec![worker.spec()],
        tls_cert_path: Some(cert_path.clone()),
        tls_key_path: Some(key_path.clone()),
        ..Args::default()
    }
    .into_settings()
    .unwrap();
    let router = TestRouter::start(settings).await;
    let addr = addr_of(&router.url);
    let both = [first_ca.pem(), second_ca.pem()];
    let both: Vec<&str> = both.iter().map(String::as_str).collect();
    let (before, presented) = tls_connect(addr, &both).await;
    assert_eq!(presented, first.der);

    dir.identity("api", &second);
    assert!(router.gateway.reload_tls().unwrap());
    let (after, presented) = tls_connect(addr, &both).await;
    assert_eq!(
        presented, second.der,
        "a new connection sees the new certificate"
    );
    assert_eq!(health_on(after).await, "HTTP/1.1 200 OK");
    // The connection opened before the reload goes on with the certificate it had.
    assert_eq!(
        before.get_ref().1.peer_certificates().unwrap()[0],
        first.der
    );
    assert_eq!(health_on(before).await, "HTTP/1.1 200 OK");

    // A bad new certificate: the reload fails naming the file, and the current one stays.
    dir.write("api.pem", "not a certificate\n");
    let error = router.gateway.reload_tls().unwrap_err().to_string();
    assert!(error.contains(arg(&cert_path)), "{error}");
    let (_, presented) = tls_connect(addr, &both).await;
    assert_eq!(presented, second.der);
    // A key that is not the certificate's is refused too.
    dir.write("api.pem", &first.cert_pem);
    let error = router.gateway.reload_tls().unwrap_err().to_string();
    assert!(error.contains(arg(&key_path)), "{error}");
    let (_, presented) = tls_connect(addr, &both).await;
    assert_eq!(presented, second.der);
    router.stop().await;
}
