//! Tenants end to end, from the flags: tenant API keys, and JWTs checked against a JWKS the
//! test serves over HTTP (found through the issuer's openid-configuration), on the
//! inference and admin APIs; a rotated key works without a restart.
//!
//! Keys are real: ES256 made by ring, RSA-2048 made by the `openssl` CLI.

mod support;

use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::routing::get;
use axum::{Json, Router};
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use clap::Parser;
use http::{Method, StatusCode};
use ring::rand::SystemRandom;
use ring::signature::{EcdsaKeyPair, KeyPair, RsaKeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};
use serde_json::{json, Value};
use support::*;
use tokio::net::TcpListener;

fn enc(bytes: &[u8]) -> String {
    URL_SAFE_NO_PAD.encode(bytes)
}

enum Signer {
    Es(EcdsaKeyPair),
    Rs(RsaKeyPair),
}

/// A signing key, its kid and its public JWK.
struct Key {
    kid: &'static str,
    signer: Signer,
    jwk: Value,
}

impl Key {
    fn es256(kid: &'static str) -> Key {
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

    fn rs256(kid: &'static str) -> Key {
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

    fn token(&self, claims: &Value) -> String {
        let alg = match self.signer {
            Signer::Es(_) => "ES256",
            Signer::Rs(_) => "RS256",
        };
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
fn rsa_public_parts(der: &[u8]) -> (Vec<u8>, Vec<u8>) {
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
struct Issuer {
    url: String,
    jwks: Arc<Mutex<Value>>,
}

impl Issuer {
    async fn start(keys: &[&Key]) -> Issuer {
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

    fn publish(&self, keys: &[&Key]) {
        *self.jwks.lock().unwrap() =
            json!({"keys": keys.iter().map(|k| k.jwk.clone()).collect::<Vec<_>>()});
    }

    fn claims(&self, sub: &str, groups: &[&str], exp_in: i64) -> Value {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        json!({"iss": self.url, "aud": "kvroute", "sub": sub, "exp": now + exp_in, "groups": groups})
    }
}

async fn router(flags: &[&str]) -> TestRouter {
    let mut argv = vec!["kvroute"];
    argv.extend_from_slice(flags);
    let settings = kvroute_gateway::Args::try_parse_from(argv)
        .unwrap()
        .into_settings()
        .unwrap();
    TestRouter::start(settings).await
}

async fn infer(router: &TestRouter, headers: &[(&str, &str)]) -> Reply {
    post(
        &router.url,
        "/v1/chat/completions",
        headers,
        &chat("m", "hi"),
    )
    .await
}

/// A refusal: 401, with nothing of why in the body.
fn assert_refused(reply: &Reply) {
    assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
    let body = String::from_utf8_lossy(&reply.body).to_lowercase();
    for why in ["expir", "kid", "signature", "audience", "issuer", "jwks"] {
        assert!(!body.contains(why), "the body says why: {body}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jwts_name_tenants_and_admins_and_a_rotated_key_works_without_a_restart() {
    let worker = MockWorker::start("w1", &["m"]).await;
    let (first, rotated, foreign) = (Key::es256("k1"), Key::rs256("k2"), Key::es256("k1"));
    let issuer = Issuer::start(&[&first]).await;
    let r = router(&[
        "--worker-urls",
        &worker.url,
        "--jwt-issuer",
        &issuer.url,
        "--jwt-audience",
        "kvroute",
        "--jwt-role-mapping",
        "Gateway.Admin=admin",
        "Gateway.User=user",
    ])
    .await;
    let bearer = |t: &str| format!("Bearer {t}");

    // A valid token is routed (the first may wait for the start's fetch of the keys).
    let user = bearer(&first.token(&issuer.claims("alice", &["Gateway.User"], 300)));
    wait_until_async("a valid token routed", || async {
        infer(&r, &[("authorization", &user)]).await.status == StatusCode::OK
    })
    .await;
    // Probes and metrics stay open.
    assert_eq!(
        get_url(&format!("{}/health", r.url)).await.0,
        StatusCode::OK
    );
    assert_eq!(
        get_url(&format!("{}/liveness", r.url)).await.0,
        StatusCode::OK
    );
    assert_eq!(
        get_url(&format!("{}/metrics", r.metrics_url)).await.0,
        StatusCode::OK
    );

    // Missing, expired, foreign, for another audience: 401, and the body says nothing of why.
    assert_refused(&infer(&r, &[]).await);
    let expired = bearer(&first.token(&issuer.claims("alice", &[], -600)));
    assert_refused(&infer(&r, &[("authorization", &expired)]).await);
    let forged = bearer(&foreign.token(&issuer.claims("mallory", &["Gateway.Admin"], 300)));
    assert_refused(&infer(&r, &[("authorization", &forged)]).await);
    let mut other = issuer.claims("alice", &[], 300);
    other["aud"] = json!("another-api");
    assert_refused(&infer(&r, &[("authorization", &bearer(&first.token(&other)))]).await);

    // The admin API: a user's token is 403, an admin's works, no token is 401.
    let url = r.url.clone();
    let workers = |auth: String| {
        let url = url.clone();
        async move {
            let headers = [("authorization", auth.as_str())];
            send(&url, Method::GET, "/workers", &headers, "")
                .await
                .status
        }
    };
    assert_eq!(workers(user.clone()).await, StatusCode::FORBIDDEN);
    let admin = bearer(&first.token(&issuer.claims("root", &["Gateway.Admin"], 300)));
    assert_eq!(workers(admin).await, StatusCode::OK);
    assert_eq!(
        send(&r.url, Method::GET, "/workers", &[], "").await.status,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(workers(forged.clone()).await, StatusCode::UNAUTHORIZED);

    // Rotation: the issuer publishes a new key (RS256) and signs with it; the router
    // refetches on the unknown kid (at most once every 10 s, hence the deadline).
    issuer.publish(&[&first, &rotated]);
    let renewed = bearer(&rotated.token(&issuer.claims("alice", &["Gateway.User"], 300)));
    wait_until_async("the rotated key accepted", || async {
        infer(&r, &[("authorization", &renewed)]).await.status == StatusCode::OK
    })
    .await;
    // The router's credential never reaches the worker: routed requests all counted.
    assert!(worker.requests() >= 2);
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_api_keys_route_their_tenants_and_refuse_other_keys() {
    let worker = MockWorker::start("w1", &["m"]).await;
    let r = router(&[
        "--worker-urls",
        &worker.url,
        "--tenant-api-key",
        "team-a:key-a",
        "--tenant-api-key=team-b:key-b",
        "--trust-tenant-header",
    ])
    .await;
    assert_eq!(
        infer(&r, &[("authorization", "Bearer key-a")]).await.status,
        StatusCode::OK
    );
    assert_eq!(
        infer(&r, &[("x-api-key", "key-b")]).await.status,
        StatusCode::OK
    );
    assert_refused(&infer(&r, &[("authorization", "Bearer key-c")]).await);
    // A trusted tenant header is no credential once keys are set.
    assert_refused(&infer(&r, &[("x-smg-tenant-id", "team-a")]).await);
    let models = send(
        &r.url,
        Method::GET,
        "/v1/models",
        &[("x-api-key", "key-a")],
        "",
    )
    .await;
    assert_eq!(models.status, StatusCode::OK);
    assert_eq!(
        get_url(&format!("{}/health", r.url)).await.0,
        StatusCode::OK
    );
    assert_eq!(worker.requests(), 2);
    r.stop().await;
}
