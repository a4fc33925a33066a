//! JSON Web Tokens, checked as kvroute checks them: a compact JWS signed with RS256, RS384,
//! RS512, ES256 or ES384 by a key of the issuer's JWKS, never `none` nor HMAC. The
//! algorithm comes from the key (the JWK's `alg`, else its type and curve); a token whose
//! header names another is refused, so a public key is never used as an HMAC secret.
//!
//! Claims: `exp` is required, `nbf` is honoured, both with [`CLOCK_SKEW_SECS`] of skew;
//! `iss` must be the issuer and `aud` (a string or a list) must hold the audience. The
//! subject is `sub`, else `email`, else `preferred_username`; the roles are the strings of
//! `role`, `roles`, `groups` and `group` (each a string or a list).
//!
//! Pure: the time comes in as a parameter. Fetching the keys is [`super::jwks`]'s.

use std::collections::HashMap;
use std::sync::Arc;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use ring::signature::{self, RsaPublicKeyComponents, UnparsedPublicKey};
use serde::Deserialize;

/// The clock skew allowed on `exp` and `nbf`, in seconds (smg's leeway).
pub const CLOCK_SKEW_SECS: u64 = 30;

/// The signature algorithms kvroute verifies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alg {
    Rs256,
    Rs384,
    Rs512,
    Es256,
    Es384,
}

impl Alg {
    fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "RS256" => Alg::Rs256,
            "RS384" => Alg::Rs384,
            "RS512" => Alg::Rs512,
            "ES256" => Alg::Es256,
            "ES384" => Alg::Es384,
            _ => return None,
        })
    }
}

/// A public key of the JWKS, with the one algorithm it verifies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PublicKey {
    /// RSA: the modulus and exponent, big-endian.
    Rsa { alg: Alg, n: Vec<u8>, e: Vec<u8> },
    /// ECDSA: the uncompressed point `0x04 || x || y`.
    Ec { alg: Alg, point: Vec<u8> },
}

impl PublicKey {
    pub fn alg(&self) -> Alg {
        match self {
            PublicKey::Rsa { alg, .. } | PublicKey::Ec { alg, .. } => *alg,
        }
    }

    /// Whether `sig` is this key's signature of `message`.
    fn verifies(&self, message: &[u8], sig: &[u8]) -> bool {
        match self {
            PublicKey::Rsa { alg, n, e } => {
                let params = match alg {
                    Alg::Rs384 => &signature::RSA_PKCS1_2048_8192_SHA384,
                    Alg::Rs512 => &signature::RSA_PKCS1_2048_8192_SHA512,
                    _ => &signature::RSA_PKCS1_2048_8192_SHA256,
                };
                RsaPublicKeyComponents { n, e }
                    .verify(params, message, sig)
                    .is_ok()
            }
            PublicKey::Ec { alg, point } => {
                let params = match alg {
                    Alg::Es384 => &signature::ECDSA_P384_SHA384_FIXED,
                    _ => &signature::ECDSA_P256_SHA256_FIXED,
                };
                UnparsedPublicKey::new(params, point)
                    .verify(message, sig)
                    .is_ok()
            }
        }
    }

    /// The key a JWK describes, with its id; `None` for one kvroute cannot use (no `kid`,
    /// an encryption key, a symmetric key, another curve or algorithm, a malformed one).
    fn from_jwk(jwk: &Jwk) -> Option<(String, PublicKey)> {
        if jwk.use_.as_deref().is_some_and(|u| u != "sig") {
            return None;
        }
        let named = jwk.alg.as_deref().map(Alg::from_name);
        let key = match (jwk.kty.as_str(), jwk.crv.as_deref()) {
            ("RSA", _) => {
                let alg = named.unwrap_or(Some(Alg::Rs256))?;
                if !matches!(alg, Alg::Rs256 | Alg::Rs384 | Alg::Rs512) {
                    return None;
                }
                let n = b64(jwk.n.as_deref()?)?;
                let e = b64(jwk.e.as_deref()?)?;
                PublicKey::Rsa { alg, n, e }
            }
            ("EC", Some(crv @ ("P-256" | "P-384"))) => {
                let (alg, len) = if crv == "P-256" {
                    (Alg::Es256, 32)
                } else {
                    (Alg::Es384, 48)
                };
                if named.is_some_and(|n| n != Some(alg)) {
                    return None;
                }
                let (x, y) = (b64(jwk.x.as_deref()?)?, b64(jwk.y.as_deref()?)?);
                if x.len() != len || y.len() != len {
                    return None;
                }
                let point = [&[0x04][..], &x, &y].concat();
                PublicKey::Ec { alg, point }
            }
            _ => return None,
        };
        Some((jwk.kid.clone()?, key))
    }
}

fn b64(text: &str) -> Option<Vec<u8>> {
    URL_SAFE_NO_PAD.decode(text.trim_end_matches('=')).ok()
}

/// One JWK, the fields kvroute reads.
#[derive(Deserialize)]
struct Jwk {
    kty: String,
    kid: Option<String>,
    alg: Option<String>,
    #[serde(rename = "use")]
    use_: Option<String>,
    n: Option<String>,
    e: Option<String>,
    crv: Option<String>,
    x: Option<String>,
    y: Option<String>,
}

/// A JWKS's usable keys, by `kid`.
#[derive(Debug, Clone, Default)]
pub struct KeySet {
    keys: HashMap<String, Arc<PublicKey>>,
}

impl KeySet {
    /// A JWKS document (`{"keys": [...]}`); keys kvroute cannot use are left out.
    pub fn parse(json: &[u8]) -> Result<Self, serde_json::Error> {
        #[derive(Deserialize)]
        struct Doc {
            keys: Vec<serde_json::Value>,
        }
        let doc: Doc = serde_json::from_slice(json)?;
        let keys = doc
            .keys
            .into_iter()
            .filter_map(|v| serde_json::from_value::<Jwk>(v).ok())
            .filter_map(|jwk| PublicKey::from_jwk(&jwk))
            .map(|(kid, key)| (kid, Arc::new(key)))
            .collect();
        Ok(Self { keys })
    }

    pub fn get(&self, kid: &str) -> Option<Arc<PublicKey>> {
        self.keys.get(kid).cloned()
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

/// Why a token was refused: for the log, never for the client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("not a JWT (three base64url parts, JSON header and claims)")]
    Malformed,
    #[error("algorithm not accepted (only RS256/384/512 and ES256/384)")]
    Algorithm,
    #[error("no kid in the header")]
    NoKid,
    #[error("no key of the JWKS has this kid")]
    UnknownKid,
    #[error("the header's algorithm is not its key's")]
    AlgorithmMismatch,
    #[error("bad signature")]
    Signature,
    #[error("no exp claim")]
    NoExpiry,
    #[error("expired")]
    Expired,
    #[error("not valid yet (nbf)")]
    NotYetValid,
    #[error("wrong issuer")]
    Issuer,
    #[error("wrong audience")]
    Audience,
    #[error("no subject (sub, email or preferred_username)")]
    NoSubject,
}

/// A token's header: its algorithm and key id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub alg: Alg,
    pub kid: String,
}

/// Reads a token's header (not yet trusted: the signature is checked by [`verify`]).
pub fn header(token: &str) -> Result<Header, TokenError> {
    #[derive(Deserialize)]
    struct Raw {
        alg: String,
        kid: Option<String>,
    }
    let head = token.split('.').next().ok_or(TokenError::Malformed)?;
    let raw: Raw = b64(head)
        .and_then(|json| serde_json::from_slice(&json).ok())
        .ok_or(TokenError::Malformed)?;
    let alg = Alg::from_name(&raw.alg).ok_or(TokenError::Algorithm)?;
    let kid = raw.kid.ok_or(TokenError::NoKid)?;
    Ok(Header { alg, kid })
}

/// What the claims must say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    pub issuer: String,
    pub audience: String,
}

/// Who a valid token names.
#[derive(Debug, Clone, PartialEq)]
pub struct Identity {
    pub subject: String,
    pub roles: Vec<String>,
    /// The seconds since the epoch between which its claims hold (`nbf` and `exp`, with
    /// the clock skew); a verified token is taken again only within them.
    pub valid: (f64, f64),
}

#[derive(Deserialize)]
struct Claims {
    iss: Option<String>,
    aud: Option<serde_json::Value>,
    exp: Option<f64>,
    nbf: Option<f64>,
    sub: Option<String>,
    email: Option<String>,
    preferred_username: Option<String>,
    role: Option<serde_json::Value>,
    roles: Option<serde_json::Value>,
    groups: Option<serde_json::Value>,
    group: Option<serde_json::Value>,
}

/// Checks `token`'s signature with `key` and its claims at `now` (seconds since the epoch).
pub fn verify(
    token: &str,
    key: &PublicKey,
    expected: &Expected,
    now: u64,
) -> Result<Identity, TokenError> {
    let header = header(token)?;
    if header.alg != key.alg() {
        return Err(TokenError::AlgorithmMismatch);
    }
    let (signed, sig) = token.rsplit_once('.').ok_or(TokenError::Malformed)?;
    let (_, payload) = signed.split_once('.').ok_or(TokenError::Malformed)?;
    if payload.contains('.') {
        return Err(TokenError::Malformed);
    }
    let sig = b64(sig).ok_or(TokenError::Malformed)?;
    if !key.verifies(signed.as_bytes(), &sig) {
        return Err(TokenError::Signature);
    }
    let claims: Claims = b64(payload)
        .and_then(|json| serde_json::from_slice(&json).ok())
        .ok_or(TokenError::Malformed)?;
    check_claims(claims, expected, now as f64)
}

fn check_claims(c: Claims, expected: &Expected, now: f64) -> Result<Identity, TokenError> {
    let skew = CLOCK_SKEW_SECS as f64;
    let exp = c.exp.ok_or(TokenError::NoExpiry)?;
    if now > exp + skew {
        return Err(TokenError::Expired);
    }
    if c.nbf.is_some_and(|nbf| now + skew < nbf) {
        return Err(TokenError::NotYetValid);
    }
    if c.iss.as_deref() != Some(expected.issuer.as_str()) {
        return Err(TokenError::Issuer);
    }
    if !strings(c.aud.as_ref()).any(|a| a == expected.audience) {
        return Err(TokenError::Audience);
    }
    let subject = (c.sub.filter(|s| !s.is_empty()))
        .or(c.email.filter(|s| !s.is_empty()))
        .or(c.preferred_username.filter(|s| !s.is_empty()))
        .ok_or(TokenError::NoSubject)?;
    let roles = [&c.role, &c.roles, &c.groups, &c.group]
        .into_iter()
        .flat_map(|v| strings(v.as_ref()))
        .map(str::to_owned)
        .collect();
    let valid = (
        c.nbf.map_or(f64::NEG_INFINITY, |nbf| nbf - skew),
        exp + skew,
    );
    Ok(Identity {
        subject,
        roles,
        valid,
    })
}

/// A claim's strings: itself if a string, its string items if a list.
fn strings(value: Option<&serde_json::Value>) -> impl Iterator<Item = &str> {
    let (one, many) = match value {
        Some(serde_json::Value::String(s)) => (Some(s.as_str()), None),
        Some(serde_json::Value::Array(items)) => (None, Some(items)),
        _ => (None, None),
    };
    one.into_iter()
        .chain(many.into_iter().flatten().filter_map(|v| v.as_str()))
}

#[cfg(test)]
#[path = "jwt_tests.rs"]
mod tests;
