//! What every layer shares about HTTP: the one client type to the workers, and the header
//! names the router reads and writes.
//!
//! The client speaks plain HTTP to `http://` workers and TLS to `https://` ones (the
//! connector's `https_or_http`): an https URL is only ever contacted over TLS.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::HeaderName;
use http_body_util::Full;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

pub const WORKER_HEADER: HeaderName = HeaderName::from_static("x-kvroute-worker");
pub const REQUEST_ID_HEADER: HeaderName = HeaderName::from_static("x-request-id");
pub const DP_RANK_HEADER: HeaderName = HeaderName::from_static("x-kvroute-dp-rank");
/// vLLM's header choosing the data-parallel rank of a request.
pub const ENGINE_DP_RANK_HEADER: HeaderName = HeaderName::from_static("x-data-parallel-rank");

/// The one pooled keep-alive HTTP/1.1 client to the workers, over TLS to https ones.
pub type HttpClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

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
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .build(connector)
}

/// The client trusting the system's roots, with no client certificate.
pub fn build_client() -> HttpClient {
    build_client_with(crate::tls::TlsSettings::system().workers)
}
