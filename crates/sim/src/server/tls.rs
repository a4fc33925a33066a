//! https for the simulator: `--tls-cert-path` and `--tls-key-path`, and with
//! `--tls-client-ca-path` a client certificate required and verified against that CA (mTLS).
//!
//! Handshakes run on tasks of their own, so a slow or failed one holds up no other
//! connection; the connections that complete one reach axum's serve loop through a channel
//! ([`TlsListener`]). Each accepted connection is counted by how its handshake went,
//! `kvroute_sim_tls_handshakes_total{result}`: `ok`, `failed`, or `plaintext` when its first
//! byte is not a TLS handshake record (a client speaking plain HTTP to the https port).

use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use super::faults::{CrashIo, Faults};
use crate::config::SimArgs;

/// The longest a client may take over its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// The first byte of a TLS handshake record.
const TLS_HANDSHAKE: u8 = 0x16;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HandshakeLabels {
    result: &'static str,
}

/// Handshakes by result (ok, failed, plaintext).
#[derive(Debug, Clone, Default)]
pub(super) struct Handshakes(Family<HandshakeLabels, Counter>);

impl Handshakes {
    pub(super) fn register(registry: &mut Registry) -> Self {
        let this = Self::default();
        registry.register(
            "kvroute_sim_tls_handshakes",
            "TLS handshakes on the https port, by result: ok, failed, plaintext (not TLS at all)",
            this.0.clone(),
        );
        this
    }

    fn count(&self, result: &'static str) {
        self.0.get_or_create(&HandshakeLabels { result }).inc();
    }
}

/// The server configuration the TLS flags describe, or `None` without them.
pub(super) fn server_config(args: &SimArgs) -> anyhow::Result<Option<Arc<ServerConfig>>> {
    let (Some(cert), Some(key)) = (&args.tls_cert_path, &args.tls_key_path) else {
        return Ok(None);
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?;
    let builder = match &args.tls_client_ca_path {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for cert in certs(ca)? {
                roots.add(cert).map_err(|e| {
                    anyhow::anyhow!("invalid CA certificate in {}: {e}", ca.display())
                })?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                .build()
                .map_err(|e| anyhow::anyhow!("cannot verify clients with {}: {e}", ca.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let key_der = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| anyhow::anyhow!("cannot read the private key {}: {e}", key.display()))?;
    let mut config = builder
        .with_single_cert(certs(cert)?, key_der)
        .map_err(|e| {
            anyhow::anyhow!(
                "the key {} does not go with the certificate {}: {e}",
                key.display(),
                cert.display()
            )
        })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Some(Arc::new(config)))
}

fn certs(path: &Path) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let read = |e| anyhow::anyhow!("cannot read the certificates {}: {e}", path.display());
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(read)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(read)?;
    anyhow::ensure!(!certs.is_empty(), "no certificate in {}", path.display());
    Ok(certs)
}

type Established = (TlsStream<CrashIo>, SocketAddr);

/// The connections that completed their handshake, as axum's serve loop takes them.
pub(super) struct TlsListener {
    ready: mpsc::Receiver<Established>,
    addr: SocketAddr,
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<CrashIo>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> Established {
        match self.ready.recv().await {
            Some(established) => established,
            // The acceptor stopped: so does the server, by its shutdown signal.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.addr)
    }
}

/// Accepts on `listener` until `stop`, each handshake on its own task; returns the listener
/// axum serves and the loop to spawn. The TCP listener is closed when the loop ends.
pub(super) fn listen(
    listener: TcpListener,
    config: Arc<ServerConfig>,
    faults: Arc<Faults>,
    handshakes: Handshakes,
    stop: CancellationToken,
) -> io::Result<(TlsListener, impl std::future::Future<Output = ()>)> {
    let addr = listener.local_addr()?;
    let (tx, ready) = mpsc::channel(64);
    let acceptor = TlsAcceptor::from(config);
    let run = async move {
        let mut pending = JoinSet::new();
        loop {
            let (tcp, peer) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(c) => c,
                    Err(error) => {
                        tracing::warn!(%error, "Accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                _ = stop.cancelled() => return,
                Some(_) = pending.join_next(), if !pending.is_empty() => continue,
            };
            let (acceptor, faults, handshakes, tx) = (
                acceptor.clone(),
                faults.clone(),
                handshakes.clone(),
                tx.clone(),
            );
            pending.spawn(async move {
                let mut first = [0u8; 1];
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, tcp.peek(&mut first)).await {
                    Ok(Ok(1..)) if first[0] == TLS_HANDSHAKE => {}
                    Ok(Ok(1..)) => {
                        tracing::warn!(%peer, "Plain-text connection to the https port");
                        handshakes.count("plaintext");
                        return;
                    }
                    _ => return,
                }
                let io = CrashIo::new(tcp, faults);
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(io)).await {
                    Ok(Ok(stream)) => {
                        handshakes.count("ok");
                        let _ = tx.send((stream, peer)).await;
                    }
                    Ok(Err(error)) => {
                        tracing::debug!(%peer, %error, "TLS handshake failed");
                        handshakes.count("failed");
                    }
                    Err(_) => handshakes.count("failed"),
                }
            });
        }
    };
    Ok((TlsListener { ready, addr }, run))
}
