//! One probe of one engine: a `GET` of its health endpoint, or of `/v1/models` for what it
//! serves.

use std::time::Duration;

use bytes::Bytes;
use http::HeaderValue;
use http_body_util::{BodyExt, Full};
use kvroute_protocol::ModelId;

use crate::http::{ClientError, HttpClient};
use crate::tls::tls_cause;

/// Why a probe failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ProbeError {
    /// The TLS handshake or session failed: a certificate that does not verify, or the
    /// worker's alert (e.g. it requires a client certificate).
    #[error("TLS: {0}")]
    Tls(rustls::Error),
    #[error("request failed: {0}")]
    Http(ClientError),
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("answered HTTP {0}")]
    Status(http::StatusCode),
    #[error("cannot read the answer: {0}")]
    Body(#[from] hyper::Error),
    #[error("invalid /v1/models answer: {0}")]
    Models(&'static str),
}

/// One `GET {url}{path}` within `timeout`; with `models`, the answer is a `/v1/models` list
/// and its models are returned.
pub(crate) async fn probe(
    client: &HttpClient,
    url: &str,
    path: &str,
    models: bool,
    auth: Option<&HeaderValue>,
    timeout: Duration,
) -> Result<Vec<(ModelId, serde_json::Value)>, ProbeError> {
    let mut req = http::Request::get(format!("{url}{path}"));
    if let Some(auth) = auth {
        req = req.header(http::header::AUTHORIZATION, auth);
    }
    let req = req
        .body(Full::new(Bytes::new()))
        .map_err(|_| ProbeError::Models("bad url"))?;
    let resp = tokio::time::timeout(timeout, client.request(req))
        .await
        .map_err(|_| ProbeError::Timeout(timeout))?
        .map_err(|e| match tls_cause(&e) {
            Some(tls) => ProbeError::Tls(tls.clone()),
            None => ProbeError::Http(e),
        })?;
    if !resp.status().is_success() {
        return Err(ProbeError::Status(resp.status()));
    }
    let body = tokio::time::timeout(timeout, resp.into_body().collect())
        .await
        .map_err(|_| ProbeError::Timeout(timeout))??
        .to_bytes();
    if !models {
        return Ok(Vec::new());
    }
    parse_models(&body)
}

fn parse_models(body: &[u8]) -> Result<Vec<(ModelId, serde_json::Value)>, ProbeError> {
    #[derive(serde::Deserialize)]
    struct List {
        data: Vec<serde_json::Value>,
    }
    let list: List = serde_json::from_slice(body)
        .map_err(|_| ProbeError::Models("expected {\"data\": [...]}"))?;
    let models: Vec<_> = list
        .data
        .into_iter()
        .filter_map(|card| {
            let id = card.get("id")?.as_str()?.to_owned();
            Some((ModelId::new(id), card))
        })
        .collect();
    if models.is_empty() {
        return Err(ProbeError::Models("the worker lists no model"));
    }
    Ok(models)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn models_list_is_parsed_and_empty_lists_rejected() {
        let m = parse_models(
            br#"{"object":"list","data":[{"id":"a","parent":null},{"id":"lora1","parent":"a"}]}"#,
        )
        .unwrap();
        assert_eq!(
            m.iter().map(|x| x.0.as_str()).collect::<Vec<_>>(),
            ["a", "lora1"]
        );
        assert_eq!(m[1].1["parent"], "a");
        assert!(parse_models(br#"{"data":[]}"#).is_err());
        assert!(parse_models(b"not json").is_err());
    }
}
