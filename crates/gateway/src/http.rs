//! What every layer shares about HTTP: the one client type to the workers, and the header
//! names the router reads and writes.
//!
//! The client speaks plain HTTP to `http://` workers and TLS to `https://` ones (the
//! connector's `https_or_http`): an https URL is only ever contacted over TLS. Its
//! connections are kept alive in [`pool`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderName};
use http::{HeaderValue, Request, Response};
use http_body_util::Full;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use tower_service::Service;

mod pool;

pub use pool::PooledBody;
use pool::{Origin, Pool, Sender};

pub const WORKER_HEADER: HeaderName = HeaderName::from_static("x-kvroute-worker");
pub const REQUEST_ID_HEADER: HeaderName = HeaderName::from_static("x-request-id");
pub const DP_RANK_HEADER: HeaderName = HeaderName::from_static("x-kvroute-dp-rank");
/// vLLM's header choosing the data-parallel rank of a request.
pub const ENGINE_DP_RANK_HEADER: HeaderName = HeaderName::from_static("x-data-parallel-rank");

/// The one pooled keep-alive HTTP/1.1 client to the workers, over TLS to https ones.
///
/// Cheap to clone: the clones share the connector and the pool ([`pool`]).
#[derive(Debug, Clone)]
pub struct HttpClient {
    connector: HttpsConnector<HttpConnector>,
    pool: Arc<Pool>,
}

/// Why a request got no answer from its worker.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("the url {0} has no scheme or host")]
    Url(http::Uri),
    #[error("cannot connect: {0}")]
    Connect(#[source] BoxError),
    #[error("HTTP/1.1 handshake failed: {0}")]
    Handshake(#[source] hyper::Error),
    #[error("request failed: {0}")]
    Request(#[source] hyper::Error),
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl HttpClient {
    /// Sends `req` (an absolute URI: the worker's URL and the path) on an idle connection to
    /// its origin, or a new one; with the `Host` header from the URI when it has none, as
    /// hyper_util's legacy client did.
    pub async fn request(
        &self,
        mut req: Request<Full<Bytes>>,
    ) -> Result<Response<PooledBody>, ClientError> {
        let uri = req.uri();
        let (Some(scheme), Some(authority)) = (uri.scheme(), uri.authority()) else {
            return Err(ClientError::Url(uri.clone()));
        };
        let origin = (scheme.clone(), authority.clone());
        if !req.headers().contains_key(header::HOST) {
            let host = host_header(uri).ok_or_else(|| ClientError::Url(uri.clone()))?;
            req.headers_mut().insert(header::HOST, host);
        }
        *req.uri_mut() = origin_form(req.uri());
        let now = Instant::now();
        loop {
            let (mut sender, reused) = match self.pool.take(&origin, now) {
                Some(sender) => (sender, true),
                // Boxed: the TLS connect's future is large, and rare.
                None => (Box::pin(self.connect(&origin)).await?, false),
            };
            if let Err(e) = sender.ready().await {
                if reused {
                    continue;
                }
                return Err(ClientError::Request(e));
            }
            match sender.try_send_request(req).await {
                Ok(response) => {
                    let pool = self.pool.clone();
                    return Ok(response.map(|body| PooledBody::new(body, pool, origin, sender)));
                }
                Err(mut e) => match e.take_message() {
                    // Not sent: the worker closed the idle connection meanwhile.
                    Some(unsent) if reused => req = unsent,
                    _ => return Err(ClientError::Request(e.into_error())),
                },
            }
        }
    }

    /// A new connection to `origin`, driven by a task of its own until it closes.
    async fn connect(&self, origin: &Origin) -> Result<Sender, ClientError> {
        let uri = http::Uri::builder()
            .scheme(origin.0.clone())
            .authority(origin.1.clone())
            .path_and_query("/")
            .build()
            .map_err(|e| ClientError::Connect(e.into()))?;
        let mut connector = self.connector.clone();
        std::future::poll_fn(|cx| connector.poll_ready(cx))
            .await
            .map_err(ClientError::Connect)?;
        let io = connector.call(uri).await.map_err(ClientError::Connect)?;
        let (sender, connection) = hyper::client::conn::http1::handshake(io)
            .await
            .map_err(ClientError::Handshake)?;
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%error, "Worker connection ended with an error");
            }
        });
        Ok(sender)
    }
}

/// The `Host` header for `uri`: its host, and its port unless the scheme's default.
fn host_header(uri: &http::Uri) -> Option<HeaderValue> {
    let host = uri.host()?;
    let secure = matches!(uri.scheme_str(), Some("https" | "wss"));
    let value = match uri.port_u16() {
        Some(443) if secure => HeaderValue::from_str(host),
        Some(80) if !secure => HeaderValue::from_str(host),
        Some(port) => HeaderValue::from_str(&format!("{host}:{port}")),
        None => HeaderValue::from_str(host),
    };
    value.ok()
}

/// The URI as sent on the connection: its path and query only (`/` when none).
fn origin_form(uri: &http::Uri) -> http::Uri {
    match uri.path_and_query() {
        Some(pq) if pq.as_str() != "/" => {
            let mut parts = http::uri::Parts::default();
            parts.path_and_query = Some(pq.clone());
            http::Uri::from_parts(parts).unwrap_or_default()
        }
        _ => http::Uri::default(),
    }
}

/// The client with `tls` for https workers (the settings' `tls.workers`).
pub fn build_client_with(tls: Arc<rustls::ClientConfig>) -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_keepalive(Some(Duration::from_secs(60)));
    connector.set_connect_timeout(Some(Duration::from_secs(10)));
    // The TLS layer above sees the scheme: an https URI goes through it or fails.
    connector.enforce_http(false);
    let connector = HttpsConnectorBuilder::new()
        .with_tls_config((*tls).clone())
        .https_or_http()
        .enable_http1()
        .wrap_connector(connector);
    HttpClient {
        connector,
        pool: Arc::new(Pool::new(POOL_IDLE_TIMEOUT)),
    }
}

/// How long a connection to a worker stays open unused.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);

/// The client trusting the system's roots, with no client certificate.
pub fn build_client() -> HttpClient {
    build_client_with(crate::tls::TlsSettings::system().workers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_header_omits_the_schemes_default_port() {
        let host = |u: &str| host_header(&u.parse().unwrap()).unwrap();
        assert_eq!(host("http://127.0.0.1:19001/v1"), "127.0.0.1:19001");
        assert_eq!(host("http://engine:80/v1"), "engine");
        assert_eq!(host("https://engine:443/"), "engine");
        assert_eq!(host("https://engine:80/"), "engine:80");
        assert_eq!(host("http://engine/"), "engine");
    }

    #[test]
    fn origin_form_keeps_path_and_query() {
        let form = |u: &str| origin_form(&u.parse().unwrap()).to_string();
        assert_eq!(form("http://a:1/v1/chat?x=1"), "/v1/chat?x=1");
        assert_eq!(form("http://a:1"), "/");
    }
}
