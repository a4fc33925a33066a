//! Keys: the client key inference calls must carry, the admin key, and the key sent to the
//! workers. A key is a [`Secret`]: its `Debug` and `Display` never show it, so no log line or
//! error can leak it, and it is compared in constant time.
//!
//! Tenants and tokens: [`tenant`] (the canonical tenant keys and the tenant API keys),
//! [`jwt`] (a token's signature and claims), [`jwks`] (the issuer's keys, fetched and
//! refetched) and [`access`] (who may call, as which tenant: the one decision for both
//! planes).

use std::net::IpAddr;

use http::HeaderMap;

pub mod access;
pub mod jwks;
pub mod jwt;
pub mod tenant;

pub use access::{Access, Caller, JwtSettings, Role, TenancySettings};
pub use tenant::Tenant;

/// A key. Printing it prints `***`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// `None` for an empty key (an unset environment variable is often set to "").
    pub fn new(key: String) -> Option<Self> {
        (!key.is_empty()).then_some(Self(key))
    }

    /// The key itself, for the one place that sends it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// `Authorization: Bearer <key>`, marked sensitive; `None` for a key that is not a valid
    /// header value (the settings refuse those).
    pub fn bearer(&self) -> Option<http::HeaderValue> {
        let mut v = http::HeaderValue::from_str(&format!("Bearer {}", self.0)).ok()?;
        v.set_sensitive(true);
        Some(v)
    }

    /// Whether `given` is this key, in time that depends only on the lengths.
    pub fn matches(&self, given: &[u8]) -> bool {
        constant_time_eq(self.0.as_bytes(), given)
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(***)")
    }
}

impl std::fmt::Display for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

/// Byte equality whose time does not depend on where the inputs differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= x ^ y;
    }
    std::hint::black_box(diff) == 0
}

/// Anthropic's key header, accepted as the client key beside `Authorization: Bearer`.
pub const API_KEY_HEADER: http::HeaderName = http::HeaderName::from_static("x-api-key");

/// The bearer token of `Authorization: Bearer TOKEN` (the scheme is case-insensitive).
pub fn bearer(headers: &HeaderMap) -> Option<&[u8]> {
    let value = headers.get(http::header::AUTHORIZATION)?.as_bytes();
    let (scheme, token) = value.split_at_checked(7)?;
    scheme
        .eq_ignore_ascii_case(b"bearer ")
        .then(|| token.trim_ascii())
}

/// The connection's peer address, which the server puts in each request's extensions
/// (`None` for a request that came another way, such as a test's `oneshot`).
pub fn peer(extensions: &http::Extensions) -> Option<IpAddr> {
    extensions
        .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
        .map(|c| c.0.ip())
}

/// The credential a call carries: `Authorization: Bearer`, else Anthropic's `x-api-key`.
pub fn credential(headers: &HeaderMap) -> Option<&[u8]> {
    bearer(headers).or_else(|| headers.get(API_KEY_HEADER).map(|v| v.as_bytes()))
}

/// Why a call was refused (the message a client sees; never the key, nor why a token was
/// refused: that is logged).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    MissingKey,
    WrongKey,
    NotLoopback,
    /// A token that is not valid (401).
    BadToken,
    /// A valid token whose role is not admin, on the admin API (403).
    NotAdmin,
}

impl Refusal {
    pub fn message(self, admin: bool) -> &'static str {
        match (self, admin) {
            (Refusal::MissingKey, false) => "this router needs Authorization: Bearer <API key>",
            (Refusal::WrongKey, false) => "the API key is not valid",
            (Refusal::MissingKey, true) => "admin calls need Authorization: Bearer <admin key>",
            (Refusal::WrongKey, true) => "the admin key is not valid",
            (Refusal::NotLoopback, _) => {
                "without --admin-api-key, admin changes are accepted from loopback only"
            }
            (Refusal::BadToken, _) => "the credentials are not valid",
            (Refusal::NotAdmin, _) => "this token's role may not call the admin API",
        }
    }
}

/// An inference call: allowed without a client key, else only with it.
pub fn check_client(key: Option<&Secret>, headers: &HeaderMap) -> Result<(), Refusal> {
    let Some(key) = key else { return Ok(()) };
    // Anthropic's clients send theirs as `x-api-key`.
    match credential(headers) {
        None => Err(Refusal::MissingKey),
        Some(given) if key.matches(given) => Ok(()),
        Some(_) => Err(Refusal::WrongKey),
    }
}

/// An admin call: with an admin key, only with it (from anywhere); without one, reads from
/// anywhere and changes from loopback only. `peer` is the connection's address, when known.
pub fn check_admin(
    key: Option<&Secret>,
    headers: &HeaderMap,
    peer: Option<IpAddr>,
    mutating: bool,
) -> Result<(), Refusal> {
    match key {
        Some(_) => check_client(key, headers),
        None if !mutating => Ok(()),
        None if peer.is_some_and(|ip| ip.is_loopback()) => Ok(()),
        None => Err(Refusal::NotLoopback),
    }
}

/// What the workers are sent as `Authorization`.
#[derive(Debug, Clone)]
pub enum WorkerAuth {
    /// The client's header, as it came (no keys configured).
    PassThrough,
    /// Nothing: the client's header carries the router's client key.
    Strip,
    /// `Bearer <--api-key>`.
    Set(http::HeaderValue),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auth(value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(http::header::AUTHORIZATION, value.parse().unwrap());
        h
    }

    #[test]
    fn keys_compare_exactly() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(!constant_time_eq(b"", b"a"));
        assert!(constant_time_eq(b"", b""));
    }

    #[test]
    fn secrets_never_print() {
        let s = Secret::new("hunter2".into()).unwrap();
        assert!(!format!("{s:?} {s}").contains("hunter2"));
        assert!(Secret::new(String::new()).is_none());
    }

    #[test]
    fn client_key_is_checked_as_a_bearer_token() {
        let key = Secret::new("k1".into());
        assert_eq!(check_client(None, &HeaderMap::new()), Ok(()));
        assert_eq!(
            check_client(key.as_ref(), &HeaderMap::new()),
            Err(Refusal::MissingKey)
        );
        assert_eq!(check_client(key.as_ref(), &auth("Bearer k1")), Ok(()));
        assert_eq!(check_client(key.as_ref(), &auth("bearer k1")), Ok(()));
        assert_eq!(
            check_client(key.as_ref(), &auth("Bearer k2")),
            Err(Refusal::WrongKey)
        );
        assert_eq!(
            check_client(key.as_ref(), &auth("Basic k1")),
            Err(Refusal::MissingKey)
        );
    }

    #[test]
    fn admin_without_a_key_is_loopback_only_for_changes() {
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        let far: IpAddr = "10.1.2.3".parse().unwrap();
        let none = HeaderMap::new();
        assert_eq!(check_admin(None, &none, Some(lo), true), Ok(()));
        assert_eq!(
            check_admin(None, &none, Some(far), true),
            Err(Refusal::NotLoopback)
        );
        assert_eq!(
            check_admin(None, &none, None, true),
            Err(Refusal::NotLoopback)
        );
        assert_eq!(check_admin(None, &none, Some(far), false), Ok(()));
        let key = Secret::new("adm".into());
        assert_eq!(
            check_admin(key.as_ref(), &none, Some(lo), false),
            Err(Refusal::MissingKey)
        );
        assert_eq!(
            check_admin(key.as_ref(), &auth("Bearer nope"), Some(lo), true),
            Err(Refusal::WrongKey)
        );
        assert_eq!(
            check_admin(key.as_ref(), &auth("Bearer adm"), Some(far), true),
            Ok(())
        );
    }
}
