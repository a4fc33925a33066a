//! The picker's listeners: Envoy's `ExternalProcessor` on `--grpc-port` (TLS by default,
//! h2c with `--secure-serving=false`) and gRPC health on `--grpc-health-port` (plain, as
//! the kubelet's gRPC probes dial it). Each stream runs an [`Exchange`] in a task of its own,
//! which ends with the stream: a cancelled stream drops its request's in-flight count.

use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Identity, Server, ServerTlsConfig};
use tonic::{Request, Response, Status, Streaming};

use super::exchange::Exchange;
use super::health::{PickerHealth, ReceiverStream};
use super::pb::ext_proc::external_processor_server::{ExternalProcessor, ExternalProcessorServer};
use super::pb::ext_proc::{ProcessingRequest, ProcessingResponse};
use crate::config::EppServing;
use crate::context::AppState;

/// The service names llm-d's chart and GIE's gateways probe (any other answers the same).
pub const HEALTH_SERVICES: [&str; 5] = [
    "",
    "liveness",
    "readiness",
    "envoy.service.ext_proc.v3.ExternalProcessor",
    "inference-extension",
];

/// The picker's sockets, bound by the caller (tests bind port 0).
#[derive(Debug)]
pub struct EppListeners {
    pub grpc: TcpListener,
    pub health: TcpListener,
}

#[derive(Debug, thiserror::Error)]
pub enum EppError {
    #[error("cannot read the picker's certificate in {dir}: {source}")]
    CertRead {
        dir: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot make a self-signed certificate: {0}")]
    SelfSigned(#[source] rcgen::Error),
    #[error("invalid TLS configuration for the picker: {0}")]
    Tls(#[source] tonic::transport::Error),
}

/// The ext_proc service.
#[derive(Debug, Clone)]
struct Picker {
    state: Arc<AppState>,
}

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(exchange(self.state.clone(), request.into_inner(), tx));
        Ok(Response::new(ReceiverStream(rx)))
    }
}

/// Runs one stream until the gateway ends it, the answer is immediate, or the gateway
/// stops listening (then whatever is waiting, routing in the queue included, is dropped).
async fn exchange(
    state: Arc<AppState>,
    mut inbound: Streaming<ProcessingRequest>,
    tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
) {
    let mut exchange = Exchange::new(state);
    loop {
        let message = tokio::select! {
            m = inbound.message() => m,
            () = tx.closed() => return,
        };
        let message = match message {
            Ok(Some(m)) => m,
            Ok(None) => return,
            Err(status) => {
                tracing::debug!(%status, "ext_proc stream ended by the gateway");
                return;
            }
        };
        let answers = tokio::select! {
            a = exchange.on(message) => a,
            () = tx.closed() => return,
        };
        for answer in answers {
            if tx.send(Ok(answer)).await.is_err() {
                return;
            }
        }
        if exchange.finished {
            return;
        }
    }
}

/// The TLS the ext_proc port serves, if any (ALPN h2).
fn tls(serving: &EppServing) -> Result<Option<ServerTlsConfig>, EppError> {
    let identity = match serving {
        EppServing::H2c => return Ok(None),
        EppServing::SelfSigned => {
            let names = vec!["localhost".to_owned(), "kvroute-epp".to_owned()];
            let made = rcgen::generate_simple_self_signed(names).map_err(EppError::SelfSigned)?;
            Identity::from_pem(made.cert.pem(), made.signing_key.serialize_pem())
        }
        EppServing::CertDir(dir) => {
            let read = |name: &str| {
                std::fs::read(dir.join(name)).map_err(|source| EppError::CertRead {
                    dir: dir.display().to_string(),
                    source,
                })
            };
            Identity::from_pem(read("tls.crt")?, read("tls.key")?)
        }
    };
    Ok(Some(ServerTlsConfig::new().identity(identity)))
}

/// Starts the picker's two servers as tasks of the router, until it shuts down.
pub(crate) fn spawn(
    state: &Arc<AppState>,
    serving: &EppServing,
    listeners: EppListeners,
) -> Result<(), EppError> {
    let mut grpc = Server::builder();
    if let Some(tls) = tls(serving)? {
        grpc = grpc.tls_config(tls).map_err(EppError::Tls)?;
    }
    // A whole body may arrive as one piece (BUFFERED): room for the largest allowed.
    let largest = state.settings.max_payload_size + (1 << 20);
    let picker = ExternalProcessorServer::new(Picker {
        state: state.clone(),
    })
    .max_decoding_message_size(largest)
    .max_encoding_message_size(largest);
    let stop = state.shutdown.clone();
    let addr = listeners.grpc.local_addr().ok();
    // TCP_NODELAY on Envoy's connections: `serve_with_incoming` ignores the builder's
    // `tcp_nodelay`, and with Nagle on each small ext_proc answer after the first waits for
    // Envoy's delayed ACK (~40 ms a request at concurrency 1; bench/overhead.sh envoy-epp).
    let incoming = TcpIncoming::from(listeners.grpc).with_nodelay(Some(true));
    state.tasks.spawn(async move {
        let served = grpc
            .add_service(picker)
            .serve_with_incoming_shutdown(incoming, stop.cancelled_owned())
            .await;
        if let Err(error) = served {
            tracing::error!(%error, "The ext_proc server failed");
        }
    });
    let health = tonic_health::pb::health_server::HealthServer::new(PickerHealth::new(
        state.workers.subscribe_ready(),
    ));
    let stop = state.shutdown.clone();
    state.tasks.spawn(async move {
        let served = Server::builder()
            .add_service(health)
            .serve_with_incoming_shutdown(
                TcpIncoming::from(listeners.health),
                stop.cancelled_owned(),
            )
            .await;
        if let Err(error) = served {
            tracing::error!(%error, "The gRPC health server failed");
        }
    });
    tracing::info!(ext_proc = ?addr, tls = !matches!(serving, EppServing::H2c), "Serving as the endpoint picker");
    Ok(())
}
