//! What every layer shares about HTTP: the one client type to the workers, and the header
//! names the router reads and writes.

use std::time::Duration;

use bytes::Bytes;
use http::header::HeaderName;
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

pub const WORKER_HEADER: HeaderName = HeaderName::from_static("x-kvroute-worker");
pub const REQUEST_ID_HEADER: HeaderName = HeaderName::from_static("x-request-id");
pub const DP_RANK_HEADER: HeaderName = HeaderName::from_static("x-kvroute-dp-rank");
/// vLLM's header choosing the data-parallel rank of a request.
pub const ENGINE_DP_RANK_HEADER: HeaderName = HeaderName::from_static("x-data-parallel-rank");

/// The one pooled keep-alive HTTP/1.1 client to the workers.
pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub fn build_client() -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_keepalive(Some(Duration::from_secs(60)));
    connector.set_connect_timeout(Some(Duration::from_secs(10)));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .build(connector)
}
