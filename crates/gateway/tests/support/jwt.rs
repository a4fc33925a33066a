//! Real JWT keys and an OIDC issuer for the tests and benchmarks: ES256 keys made by ring,
//! RSA-2048 keys made by the `openssl` CLI (ring does not generate RSA keys), tokens signed
//! with them, and an issuer serving its openid-configuration and JWKS over HTTP.

use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::routing::get;
use axum::{Json, Router};
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use ring::rand::SystemRandom;
use ring::signature::{EcdsaKeyPair, KeyPair, RsaKeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};
use serde_json::{json, Value};
use tokio::net::TcpListener;

/// Base64url without padding, as JWTs and JWKs write bytes.
pub fn enc(bytes: &[u8]) -> String {
    URL_SAFE_NO_PAD.encode(bytes)
}

pub enum Signer {
    Es(EcdsaKeyPair),
    Rs(RsaKeyPair),
}

/// A signing key, its kid and its public JWK.
pub struct Key {
    pub kid: &'static str,
    pub signer: Signer,
    pub jwk: Value,
}

impl Key {
    pub fn es256(kid: &'static str) -> Key {
        let rng = SystemRandom::new();
        let alg = &ECDSA_P256_SHA256_FIXED_SIGNING;
        let pkcs8 = EcdsaKeyPair::generate_pkcs8(alg, &rng).unwrap();
        let pair = EcdsaKeyPair::from_pkcs8(alg, pkcs8.as_ref(), &rng).unwrap();
        let p = pair.public_key().as_ref();
        let jwk = json!({"kty": "EC", "crv": "P-256", "kid": kid, "x": enc(&p[1..33]), "y": enc(&p[33..])});
        Key {
            kid,
            signer: Signer::Es(pair),
            jwk,
        }
    }

    pub fn rs256(kid: &'static str) -> Key {
        let out = std::process::Command::new("openssl")
            .args([
                "genpkey",
                "-algorithm",
                "RSA",
                "-pkeyopt",
                "rsa_keygen_bits:2048",
            ])
            .args(["-outform", "DER"])
            .output()
            .expect("this test makes RSA keys with the `openssl` CLI: install openssl");
        assert!(out.status.success(), "openssl genpkey failed");
        let pair = RsaKeyPair::from_der(&out.stdout).unwrap();
        let (n, e) = rsa_public_parts(pair.public().as_ref());
        let jwk = json!({"kty": "RSA", "kid": kid, "alg": "RS256", "use": "sig", "n": enc(&n), "e": enc(&e)});
        Key {
            kid,
            signer: Signer::Rs(pair),
            jwk,
        }
    }

    /// A token of `claims` signed with this key, its header naming the key's algorithm.
    pub fn token(&self, claims: &Value) -> String {
        let alg = match self.signer {
            Signer::Es(_) => "ES256",
            Signer::Rs(_) => "RS256",
        };
        self.sign(alg, claims)
    }

    /// A token of `claims` signed with this key, whatever `alg` its header says.
    pub fn sign(&self, alg: &str, claims: &Value) -> String {
        let header = json!({"alg": alg, "typ": "JWT", "kid": self.kid});
        let signed = format!(
            "{}.{}",
            enc(header.to_string().as_bytes()),
            enc(claims.to_string().as_bytes())
        );
        let rng = SystemRandom::new();
        let sig = match &self.signer {
            Signer::Es(pair) => pair
                .sign(&rng, signed.as_bytes())
                .unwrap()
                .as_ref()
                .to_vec(),
            Signer::Rs(pair) => {
                let mut sig = vec![0; pair.public().modulus_len()];
                let alg = &ring::signature::RSA_PKCS1_SHA256;
                pair.sign(alg, &rng, signed.as_bytes(), &mut sig).unwrap();
                sig
            }
        };
        format!("{signed}.{}", enc(&sig))
    }
}

/// `n` and `e` of a DER `RSAPublicKey`.
pub fn rsa_public_parts(der: &[u8]) -> (Vec<u8>, Vec<u8>) {
    fn tlv(d: &[u8]) -> (&[u8], &[u8]) {
        let (len, head) = match d[1] {
            l if l < 0x80 => (l as usize, 2),
            l => {
                let k = (l & 0x7f) as usize;
                (
                    d[2..2 + k].iter().fold(0, |a, b| a << 8 | *b as usize),
                    2 + k,
                )
            }
        };
        (&d[head..head + len], &d[head + len..])
    }
    let (n, rest) = tlv(tlv(der).0);
    let strip = |x: &[u8]| x.iter().skip_while(|b| **b == 0).copied().collect();
    (strip(n), strip(tlv(rest).0))
}

/// An OIDC issuer: its discovery document and its JWKS, which the test may change.
pub struct Issuer {
    pub url: String,
    jwks: Arc<Mutex<Value>>,
}

impl Issuer {
    pub async fn start(keys: &[&Key]) -> Issuer {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let jwks = Arc::new(Mutex::new(Value::Null));
        let discovery = json!({"issuer": url, "jwks_uri": format!("{url}/keys")});
        let served = jwks.clone();
        let app = Router::new()
            .route(
                "/.well-known/openid-configuration",
                get(move || std::future::ready(Json(discovery.clone()))),
            )
            .route(
                "/keys",
                get(move || std::future::ready(Json(served.lock().unwrap().clone()))),
            );
        tokio::spawn(async move { axum::serve(listener, app).await });
        let issuer = Issuer { url, jwks };
        issuer.publish(keys);
        issuer
    }

    pub fn publish(&self, keys: &[&Key]) {
        *self.jwks.lock().unwrap() =
            json!({"keys": keys.iter().map(|k| k.jwk.clone()).collect::<Vec<_>>()});
    }

    pub fn claims(&self, sub: &str, groups: &[&str], exp_in: i64) -> Value {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        json!({"iss": self.url, "aud": "kvroute", "sub": sub, "exp": now + exp_in, "groups": groups})
    }
}
