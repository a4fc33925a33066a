//! A real nats-server on the loopback, for replicas in sync (`.ci/run` installs it).

use std::process::{Command, Stdio};

use super::{free_port, wait_until_async};

/// A nats-server, killed when dropped; `.1` is its URL.
pub struct Nats(pub std::process::Child, pub String);

impl Drop for Nats {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub async fn nats() -> Nats {
    nats_on(free_port()).await
}

/// A nats-server on `port` of the loopback.
pub async fn nats_on(port: u16) -> Nats {
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
