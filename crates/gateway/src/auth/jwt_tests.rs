//! The verifier against real keys (`tests/support/jwt.rs`): ES256 made by ring, RSA made by
//! the `openssl` CLI.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};

use super::*;
use crate::auth::jwks::{Fetch, Jwks, JwksError, REFETCH_INTERVAL};

#[path = "../../tests/support/jwt.rs"]
#[allow(dead_code)]
mod keys;

use keys::{enc, Key as TestKey, Signer};

const NOW: u64 = 1_800_000_000;

fn es256(kid: &'static str) -> TestKey {
    TestKey::es256(kid)
}

fn rs256(kid: &'static str) -> TestKey {
    TestKey::rs256(kid)
}

fn claims() -> Value {
    json!({"iss": "https://idp.example.com", "aud": ["kvroute", "other"], "sub": "alice",
        "exp": NOW + 300, "nbf": NOW - 10, "groups": ["Gateway.Admin"]})
}

fn with(mut c: Value, key: &str, value: Value) -> Value {
    c[key] = value;
    c
}

fn expected() -> Expected {
    Expected {
        issuer: "https://idp.example.com".into(),
        audience: "kvroute".into(),
    }
}

fn set(keys: &[&TestKey]) -> KeySet {
    let doc = json!({"keys": keys.iter().map(|k| k.jwk.clone()).collect::<Vec<_>>()});
    KeySet::parse(doc.to_string().as_bytes()).unwrap()
}

fn check(token: &str, keys: &KeySet) -> Result<Identity, TokenError> {
    let h = header(token)?;
    let key = keys.get(&h.kid).ok_or(TokenError::UnknownKid)?;
    verify(token, &key, &expected(), NOW)
}

#[test]
fn valid_es256_and_rs256_tokens_name_their_subject_and_roles() {
    let (es, rs) = (es256("e1"), rs256("r1"));
    let keys = set(&[&es, &rs]);
    assert_eq!(keys.len(), 2);
    for token in [es.sign("ES256", &claims()), rs.sign("RS256", &claims())] {
        let id = check(&token, &keys).unwrap();
        assert_eq!(id.subject, "alice");
        assert_eq!(id.roles, ["Gateway.Admin"]);
    }
    // No sub: email, then preferred_username; a single-string aud.
    let c = json!({"iss": "https://idp.example.com", "aud": "kvroute", "exp": NOW,
        "preferred_username": "bob", "role": "user"});
    let id = check(&es.sign("ES256", &c), &keys).unwrap();
    assert_eq!(
        (id.subject.as_str(), id.roles),
        ("bob", vec!["user".to_owned()])
    );
    let c = with(c, "sub", json!(""));
    let c = with(c, "preferred_username", Value::Null);
    assert_eq!(
        check(&es.sign("ES256", &c), &keys),
        Err(TokenError::NoSubject)
    );
}

#[test]
fn claims_are_checked_with_the_skew() {
    let es = es256("e1");
    let keys = set(&[&es]);
    let sign = |c: Value| es.sign("ES256", &c);
    let skew = CLOCK_SKEW_SECS;
    assert!(check(&sign(with(claims(), "exp", json!(NOW - skew))), &keys).is_ok());
    let expired = sign(with(claims(), "exp", json!(NOW - skew - 1)));
    assert_eq!(check(&expired, &keys), Err(TokenError::Expired));
    assert!(check(&sign(with(claims(), "nbf", json!(NOW + skew))), &keys).is_ok());
    let early = sign(with(claims(), "nbf", json!(NOW + skew + 1)));
    assert_eq!(check(&early, &keys), Err(TokenError::NotYetValid));
    let no_exp = sign(with(claims(), "exp", Value::Null));
    assert_eq!(check(&no_exp, &keys), Err(TokenError::NoExpiry));
    let aud = sign(with(claims(), "aud", json!("someone-else")));
    assert_eq!(check(&aud, &keys), Err(TokenError::Audience));
    let no_aud = sign(with(claims(), "aud", Value::Null));
    assert_eq!(check(&no_aud, &keys), Err(TokenError::Audience));
    let iss = sign(with(claims(), "iss", json!("https://evil.example.com")));
    assert_eq!(check(&iss, &keys), Err(TokenError::Issuer));
}

#[test]
fn forged_tokens_are_refused() {
    let (es, rs) = (es256("e1"), rs256("r1"));
    let keys = set(&[&es, &rs]);
    let good = rs.sign("RS256", &claims());
    let (head, rest) = good.split_once('.').unwrap();
    let (_, sig) = rest.split_once('.').unwrap();

    // alg none, with and without a signature.
    let none_head = enc(br#"{"alg":"none","kid":"r1"}"#);
    let body = enc(claims().to_string().as_bytes());
    for token in [
        format!("{none_head}.{body}."),
        format!("{none_head}.{body}.{sig}"),
    ] {
        assert_eq!(check(&token, &keys), Err(TokenError::Algorithm));
    }
    // HS256 with the RSA public key's bytes as the HMAC secret.
    let hs_head = enc(br#"{"alg":"HS256","kid":"r1"}"#);
    let signed = format!("{hs_head}.{body}");
    let secret = rsa_public_der(&rs);
    let mac = ring::hmac::sign(
        &ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &secret),
        signed.as_bytes(),
    );
    let hs = format!("{signed}.{}", enc(mac.as_ref()));
    assert_eq!(check(&hs, &keys), Err(TokenError::Algorithm));
    // A token naming another accepted algorithm than its key's.
    let es_head = enc(br#"{"alg":"ES256","kid":"r1"}"#);
    let mixed = format!("{es_head}.{body}.{sig}");
    assert_eq!(check(&mixed, &keys), Err(TokenError::AlgorithmMismatch));
    // A foreign key under a known kid.
    let foreign = es256("e1").sign("ES256", &claims());
    assert_eq!(check(&foreign, &keys), Err(TokenError::Signature));
    // A tampered payload under a good signature.
    let admin = with(claims(), "sub", json!("mallory"));
    let tampered = format!("{head}.{}.{sig}", enc(admin.to_string().as_bytes()));
    assert_eq!(check(&tampered, &keys), Err(TokenError::Signature));
    // Not a JWT at all.
    assert_eq!(check("sk-not-a-jwt", &keys), Err(TokenError::Malformed));
    assert_eq!(
        check(&format!("{good}.x"), &keys),
        Err(TokenError::Malformed)
    );
}

fn rsa_public_der(key: &TestKey) -> Vec<u8> {
    match &key.signer {
        Signer::Rs(pair) => pair.public().as_ref().to_vec(),
        Signer::Es(_) => unreachable!(),
    }
}

#[test]
fn the_key_set_keeps_only_keys_it_can_use() {
    let es = es256("e1");
    let doc = json!({"keys": [
        es.jwk,
        {"kty": "oct", "kid": "h1", "k": "c2VjcmV0"},
        with(es256("e2").jwk, "use", json!("enc")),
        with(es256("e3").jwk, "kid", Value::Null),
        with(es256("e4").jwk, "alg", json!("RS256")),
        {"kty": "EC", "crv": "P-521", "kid": "e5", "x": "AA", "y": "AA"},
        {"kty": "RSA", "kid": "r1", "alg": "PS256", "n": "AQAB", "e": "AQAB"},
    ]});
    let keys = KeySet::parse(doc.to_string().as_bytes()).unwrap();
    assert_eq!(keys.len(), 1);
    assert!(keys.get("e1").is_some());
}

/// A JWKS the test publishes, counting the fetches.
#[derive(Clone, Default)]
struct Served(Arc<Mutex<(Value, usize)>>);

impl Served {
    fn publish(&self, keys: &[&TestKey]) {
        self.0.lock().unwrap().0 =
            json!({"keys": keys.iter().map(|k| k.jwk.clone()).collect::<Vec<_>>()});
    }
    fn fetches(&self) -> usize {
        self.0.lock().unwrap().1
    }
}

impl Fetch for Served {
    async fn fetch(&self) -> Result<KeySet, JwksError> {
        let doc = {
            let mut served = self.0.lock().unwrap();
            served.1 += 1;
            served.0.to_string()
        };
        KeySet::parse(doc.as_bytes()).map_err(|_| JwksError::NoKeys)
    }
}

#[tokio::test(start_paused = true)]
async fn an_unknown_kid_refetches_at_most_once_every_ten_seconds() {
    let (old, new, newer) = (es256("k1"), es256("k2"), es256("k3"));
    let served = Served::default();
    served.publish(&[&old]);
    let jwks = Jwks::new(served.clone());
    assert!(jwks.refresh().await.is_ok());
    let ok = |key: &TestKey| key.sign("ES256", &claims());
    assert!(jwks.verify(&ok(&old), &expected(), NOW).await.is_ok());
    assert_eq!(served.fetches(), 1);

    // Rotated: the new kid refetches the set, and is found.
    served.publish(&[&old, &new]);
    assert!(jwks.verify(&ok(&new), &expected(), NOW).await.is_ok());
    assert_eq!(served.fetches(), 2);
    // Another new kid within ten seconds: no refetch, refused.
    served.publish(&[&old, &new, &newer]);
    let refused = jwks.verify(&ok(&newer), &expected(), NOW).await;
    assert_eq!(refused, Err(TokenError::UnknownKid));
    tokio::time::advance(REFETCH_INTERVAL - Duration::from_secs(1)).await;
    let refused = jwks.verify(&ok(&newer), &expected(), NOW).await;
    assert_eq!(refused, Err(TokenError::UnknownKid));
    assert_eq!(served.fetches(), 2);
    // Ten seconds on: refetched, found.
    tokio::time::advance(Duration::from_secs(1)).await;
    assert!(jwks.verify(&ok(&newer), &expected(), NOW).await.is_ok());
    assert_eq!(served.fetches(), 3);
    // Known kids never refetch.
    assert!(jwks.verify(&ok(&old), &expected(), NOW).await.is_ok());
    assert_eq!(served.fetches(), 3);
}

#[tokio::test(start_paused = true)]
async fn until_the_first_fetch_every_token_is_refused() {
    let key = es256("k1");
    let served = Served::default();
    served.publish(&[]);
    let jwks = Jwks::new(served.clone());
    assert!(matches!(jwks.refresh().await, Err(JwksError::NoKeys)));
    let token = key.sign("ES256", &claims());
    assert_eq!(
        jwks.verify(&token, &expected(), NOW).await,
        Err(TokenError::UnknownKid)
    );
}

#[tokio::test(start_paused = true)]
async fn a_verified_token_is_taken_again_only_while_its_claims_and_its_key_hold() {
    let (old, new) = (es256("k1"), es256("k2"));
    let served = Served::default();
    served.publish(&[&old, &new]);
    let jwks = Jwks::new(served.clone());
    assert!(jwks.refresh().await.is_ok());
    let token = old.sign("ES256", &claims());
    for _ in 0..2 {
        let id = jwks.verify(&token, &expected(), NOW).await.unwrap();
        assert_eq!(id.subject, "alice");
    }
    // Past exp and before nbf (beyond the skew), another audience: refused, remembered or not.
    let skew = CLOCK_SKEW_SECS;
    let late = jwks.verify(&token, &expected(), NOW + 300 + skew + 1).await;
    assert_eq!(late, Err(TokenError::Expired));
    let early = jwks.verify(&token, &expected(), NOW - 10 - skew - 1).await;
    assert_eq!(early, Err(TokenError::NotYetValid));
    let other = Expected {
        audience: "another-api".into(),
        ..expected()
    };
    assert_eq!(
        jwks.verify(&token, &other, NOW).await,
        Err(TokenError::Audience)
    );
    assert!(jwks.verify(&token, &expected(), NOW).await.is_ok());
    // Its key gone from a refetched set: refused, though it verified a moment ago.
    served.publish(&[&new]);
    assert!(jwks.refresh().await.is_ok());
    assert_eq!(
        jwks.verify(&token, &expected(), NOW).await,
        Err(TokenError::UnknownKid)
    );
    assert!(jwks
        .verify(&new.sign("ES256", &claims()), &expected(), NOW)
        .await
        .is_ok());
}
