//! The issuer's keys: the JWKS, fetched over the router's HTTP client from `--jwt-jwks-uri`,
//! else from the `jwks_uri` of `<issuer>/.well-known/openid-configuration`.
//!
//! - At start, the server's task fetches it; a failure is logged and retried with backoff
//!   (1 s doubling to 60 s), and every token is refused (401) until a fetch succeeds. After
//!   that, it is fetched again every hour (smg's cache lifetime), so a removed key stops
//!   working within the hour.
//! - A token whose `kid` is not in the set refetches it at once, at most once every
//!   [`REFETCH_INTERVAL`] whatever the kids asked for: a rotated key works within seconds,
//!   and a flood of made-up kids costs the issuer one request per interval.
//!
//! Readers take the set from an `ArcSwap`; only a refetch takes the lock that serialises
//! refetches, so concurrent tokens with the new kid wait for one fetch, not one each.
//!
//! A token verified once is remembered ([`VERIFIED_CAPACITY`] of them), so a client's next
//! request with the same token costs a lookup instead of a signature check (an RS256 or
//! ES256 verification is 70-150 µs here, more than the rest of a proxied request). It is
//! taken again only while its claims hold (`nbf` to `exp`, with the skew), against the same
//! issuer and audience, and while its key is still the one the set holds for its kid: a
//! refetched set (rotation, the hourly refresh) holds new keys, so every token is checked
//! again once.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::jwt::{self, Expected, Identity, KeySet, TokenError};
use crate::http::HttpClient;

/// The least time between two refetches for unknown kids.
pub const REFETCH_INTERVAL: Duration = Duration::from_secs(10);
/// How often the set is fetched again anyway.
const REFRESH_INTERVAL: Duration = Duration::from_secs(3600);
const FETCH_TIMEOUT: Duration = Duration::from_secs(10);
const MAX_BODY_BYTES: usize = 1 << 20;
/// Verified tokens remembered; when full, the memory starts again empty.
pub const VERIFIED_CAPACITY: usize = 4096;

/// Why the key set could not be fetched.
#[derive(Debug, thiserror::Error)]
pub enum JwksError {
    #[error("GET {uri}: {reason}")]
    Fetch { uri: String, reason: String },
    #[error("the discovery document has no usable jwks_uri (https, or http to loopback)")]
    NoJwksUri,
    #[error("the JWKS holds no key kvroute can use (RS256/384/512, ES256/384 with a kid)")]
    NoKeys,
}

/// Where the key set comes from.
pub trait Fetch: Send + Sync + 'static {
    fn fetch(&self) -> impl Future<Output = Result<KeySet, JwksError>> + Send;
}

/// The key set, refetched on unknown kids.
#[derive(Debug)]
pub struct Jwks<F> {
    fetcher: F,
    keys: ArcSwap<KeySet>,
    /// When an unknown kid last refetched the set.
    last_refetch: tokio::sync::Mutex<Option<Instant>>,
    /// Tokens verified lately, by their text.
    verified: Mutex<HashMap<Box<str>, Verified>>,
}

/// A token that verified: with which key, against what, and whom it names.
#[derive(Debug)]
struct Verified {
    kid: String,
    key: Arc<jwt::PublicKey>,
    expected: Expected,
    identity: Identity,
}

impl<F: Fetch> Jwks<F> {
    /// An empty set (every token refused) until [`Jwks::refresh`] or [`Jwks::run`].
    pub fn new(fetcher: F) -> Self {
        Self {
            fetcher,
            keys: ArcSwap::from_pointee(KeySet::default()),
            last_refetch: tokio::sync::Mutex::new(None),
            verified: Mutex::default(),
        }
    }

    /// Fetches the set and uses it; returns how many usable keys it holds.
    pub async fn refresh(&self) -> Result<usize, JwksError> {
        let set = self.fetcher.fetch().await?;
        if set.is_empty() {
            return Err(JwksError::NoKeys);
        }
        let n = set.len();
        self.keys.store(Arc::new(set));
        Ok(n)
    }

    /// Checks `token` at `now` (seconds since the epoch) against the set, refetching it once
    /// (within the rate limit) when the token's kid is not in it.
    pub async fn verify(
        &self,
        token: &str,
        expected: &Expected,
        now: u64,
    ) -> Result<Identity, TokenError> {
        if let Some(identity) = self.remembered(token, expected, now) {
            return Ok(identity);
        }
        let header = jwt::header(token)?;
        let key = match self.keys.load().get(&header.kid) {
            Some(key) => key,
            None => self.refetch_for(&header.kid).await?,
        };
        let identity = jwt::verify(token, &key, expected, now)?;
        let mut verified = self.verified.lock().unwrap_or_else(|e| e.into_inner());
        if verified.len() >= VERIFIED_CAPACITY {
            verified.clear();
        }
        let entry = Verified {
            kid: header.kid,
            key,
            expected: expected.clone(),
            identity: identity.clone(),
        };
        verified.insert(token.into(), entry);
        Ok(identity)
    }

    /// The identity of `token` if it verified before and still holds at `now`.
    fn remembered(&self, token: &str, expected: &Expected, now: u64) -> Option<Identity> {
        let verified = self.verified.lock().unwrap_or_else(|e| e.into_inner());
        let v = verified.get(token)?;
        let (from, until) = v.identity.valid;
        let now = now as f64;
        let current = self.keys.load().get(&v.kid);
        let holds = from <= now
            && now <= until
            && v.expected == *expected
            && current.is_some_and(|key| Arc::ptr_eq(&key, &v.key));
        holds.then(|| v.identity.clone())
    }

    async fn refetch_for(&self, kid: &str) -> Result<Arc<jwt::PublicKey>, TokenError> {
        let mut last = self.last_refetch.lock().await;
        // Another token may have refetched it while this one waited.
        if let Some(key) = self.keys.load().get(kid) {
            return Ok(key);
        }
        let now = Instant::now();
        if last.is_some_and(|t| now.duration_since(t) < REFETCH_INTERVAL) {
            return Err(TokenError::UnknownKid);
        }
        *last = Some(now);
        match self.refresh().await {
            Ok(keys) => tracing::info!(keys, "JWKS refetched for an unknown kid"),
            Err(error) => tracing::warn!(%error, "JWKS refetch failed"),
        }
        self.keys.load().get(kid).ok_or(TokenError::UnknownKid)
    }

    /// Fetches the set until it succeeds (backoff 1 s doubling to 60 s), then every hour,
    /// until `shutdown`.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        let mut backoff = Duration::from_secs(1);
        loop {
            let wait = match self.refresh().await {
                Ok(keys) => {
                    tracing::info!(keys, "JWKS fetched");
                    backoff = Duration::from_secs(1);
                    REFRESH_INTERVAL
                }
                Err(error) => {
                    tracing::warn!(%error, retry_in_s = backoff.as_secs(), "JWKS fetch failed: tokens are refused until it succeeds");
                    let wait = backoff;
                    backoff = (backoff * 2).min(Duration::from_secs(60));
                    wait
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = shutdown.cancelled() => return,
            }
        }
    }
}

/// The JWKS over HTTP: the URI given, else the one the issuer's discovery document names.
#[derive(Debug)]
pub struct HttpFetch {
    client: HttpClient,
    issuer: String,
    jwks_uri: OnceLock<String>,
}

impl HttpFetch {
    pub fn new(client: HttpClient, issuer: &str, jwks_uri: Option<&str>) -> Self {
        let known = OnceLock::new();
        if let Some(uri) = jwks_uri {
            let _ = known.set(uri.to_owned());
        }
        Self {
            client,
            issuer: issuer.trim_end_matches('/').to_owned(),
            jwks_uri: known,
        }
    }

    async fn uri(&self) -> Result<String, JwksError> {
        if let Some(uri) = self.jwks_uri.get() {
            return Ok(uri.clone());
        }
        #[derive(serde::Deserialize)]
        struct Discovery {
            jwks_uri: Option<String>,
        }
        let url = format!("{}/.well-known/openid-configuration", self.issuer);
        let body = self.get(&url).await?;
        let doc: Discovery = serde_json::from_slice(&body).map_err(|e| JwksError::Fetch {
            uri: url.clone(),
            reason: format!("not an OpenID configuration: {e}"),
        })?;
        let uri = doc
            .jwks_uri
            .filter(|u| fetchable(u))
            .ok_or(JwksError::NoJwksUri)?;
        Ok(self.jwks_uri.get_or_init(|| uri).clone())
    }

    async fn get(&self, uri: &str) -> Result<Bytes, JwksError> {
        let fail = |reason: String| JwksError::Fetch {
            uri: uri.to_owned(),
            reason,
        };
        let request = http::Request::get(uri)
            .header(http::header::ACCEPT, "application/json")
            .body(Full::new(Bytes::new()))
            .map_err(|e| fail(e.to_string()))?;
        let response = tokio::time::timeout(FETCH_TIMEOUT, self.client.request(request))
            .await
            .map_err(|_| fail("timed out".into()))?
            .map_err(|e| fail(e.to_string()))?;
        if !response.status().is_success() {
            return Err(fail(format!("status {}", response.status())));
        }
        let body = tokio::time::timeout(
            FETCH_TIMEOUT,
            Limited::new(response.into_body(), MAX_BODY_BYTES).collect(),
        )
        .await
        .map_err(|_| fail("timed out".into()))?
        .map_err(|e| fail(e.to_string()))?;
        Ok(body.to_bytes())
    }
}

impl Fetch for HttpFetch {
    async fn fetch(&self) -> Result<KeySet, JwksError> {
        let uri = self.uri().await?;
        let body = self.get(&uri).await?;
        KeySet::parse(&body).map_err(|e| JwksError::Fetch {
            uri,
            reason: format!("not a JWKS: {e}"),
        })
    }
}

/// Whether kvroute fetches keys from `uri`: https, or plain http to a loopback host only
/// (smg's rule, which keeps tests and local issuers working).
pub fn fetchable(uri: &str) -> bool {
    let Ok(parsed) = uri.parse::<http::Uri>() else {
        return false;
    };
    let host = parsed.host().unwrap_or_default();
    match parsed.scheme_str() {
        Some("https") => !host.is_empty(),
        Some("http") => {
            let host = host.trim_start_matches('[').trim_end_matches(']');
            host == "localhost"
                || host
                    .parse::<std::net::IpAddr>()
                    .is_ok_and(|ip| ip.is_loopback())
        }
        _ => false,
    }
}
