//! Router replicas in sync over a real nats-server: each replica's view of a worker's load is
//! the sum of every replica's requests. Needs `nats-server` on the PATH (`.ci/run` installs it).

mod support;

use std::process::{Command, Stdio};

use http_body_util::BodyExt;
use support::*;

struct Nats(std::process::Child, String);

impl Drop for Nats {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn nats() -> Nats {
    let port = free_port();
    let child = Command::new("nats-server")
        .args(["-a", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("nats-server on the PATH (apt-get install nats-server)");
    let url = format!("nats://127.0.0.1:{port}");
    wait_until_async("nats-server listening", || async move {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
    })
    .await;
    Nats(child, url)
}

fn rank_in_flight(r: &TestRouter) -> u64 {
    r.gateway.workers().statuses()[0].ranks[0].in_flight
}

#[tokio::test]
async fn each_replica_sees_the_load_of_both() {
    let nats = nats().await;
    let w = MockWorker::start("w", &["m"]).await;
    let mk = || {
        let mut s = settings(&[&w]);
        s.replica_sync = Some(kvroute_gateway::sync::transport::SyncConfig {
            url: nats.1.clone(),
            prefix: "kvroute-test".into(),
            timeout: std::time::Duration::from_secs(3),
        });
        s
    };
    let a = TestRouter::start(mk()).await;
    let b = TestRouter::start(mk()).await;
    wait_until_async("the replicas hear each other", || async {
        let (ma, mb) = (a.metrics().await, b.metrics().await);
        metric_value(&ma, "kvroute_replica_peers", "") == Some(1.0)
            && metric_value(&mb, "kvroute_replica_peers", "") == Some(1.0)
    })
    .await;
    let body = r#"{"model":"m","prompt":"x","stream":true,"max_tokens":1}"#;
    let mut streams = Vec::new();
    for url in [&a.url, &a.url, &b.url] {
        streams.push(open_stream(url, "/v1/completions", body).await);
    }
    wait_until("both see three", || {
        rank_in_flight(&a) == 3 && rank_in_flight(&b) == 3
    })
    .await;
    w.release.add_permits(3);
    for s in streams {
        s.into_body().collect().await.unwrap();
    }
    wait_until("both see none", || {
        rank_in_flight(&a) == 0 && rank_in_flight(&b) == 0
    })
    .await;
    a.stop().await;
    b.stop().await;
}
