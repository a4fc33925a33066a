//! Criterion benchmarks of what a caller's identity costs a request: [`Access::client`], the
//! data plane's one decision (see `docs/tenants.md`), in four set-ups:
//! - `anonymous`: no keys and no JWT; the tenant is the connection's peer (`ip:...`), the
//!   baseline;
//! - `tenant_key_of_100`: 100 `--tenant-api-key`s, the caller's the last (every key is
//!   compared, in constant time);
//! - `jwt_es256` and `jwt_rs256`: JWT on, a valid token signed with a P-256 key or an
//!   RSA-2048 key from the JWKS that an issuer serves here over HTTP (fetched once), the
//!   token already seen (a client's every request after its first: the token is remembered);
//! - `jwt_es256_first` and `jwt_rs256_first`: what a token costs the first time it is seen,
//!   the signature and the claims checked (`jwt::verify`).
//!
//! ```text
//! cargo bench -p kvroute-gateway --bench tenants -- --warm-up-time 1 --measurement-time 3
//! ```
//!
//! RSA keys are made by the `openssl` CLI.

#[path = "../tests/support/jwt.rs"]
#[allow(dead_code)]
mod jwt;

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use http::{HeaderMap, HeaderValue};
use jwt::{Issuer, Key};
use kvroute_gateway::auth::access::{Access, Caller, JwtSettings, TenancySettings};
use kvroute_gateway::auth::jwt::{self as verifier, Expected, KeySet};
use kvroute_gateway::auth::Secret;
use kvroute_gateway::http::build_client;
use tokio::runtime::Runtime;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

fn bearer(token: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    let value = HeaderValue::from_str(&format!("Bearer {token}")).unwrap();
    headers.insert(http::header::AUTHORIZATION, value);
    headers
}

/// Times `access.client` for a caller with `headers`, after checking that it is `tenant`.
fn bench_caller(
    c: &mut Criterion,
    rt: &Runtime,
    name: &str,
    access: &Access,
    headers: HeaderMap,
    tenant: &str,
) {
    let caller = Caller {
        headers: &headers,
        peer: Some(IpAddr::V4(Ipv4Addr::LOCALHOST)),
        fairness_id: None,
    };
    let got = rt
        .block_on(access.client(&caller))
        .expect("the caller is admitted");
    assert_eq!(got.as_str(), tenant, "{name}");
    c.bench_function(name, |b| {
        b.iter(|| rt.block_on(access.client(black_box(&caller))).unwrap())
    });
}

/// An `Access` with JWT on against `issuer`, once its JWKS is fetched.
fn jwt_access(rt: &Runtime, issuer: &Issuer, probe: &str) -> Access {
    let tenancy = TenancySettings {
        jwt: Some(JwtSettings {
            issuer: issuer.url.clone(),
            audience: "kvroute".into(),
            jwks_uri: None,
            role_mapping: Vec::new(),
        }),
        ..TenancySettings::default()
    };
    let access = rt.block_on(async { Access::new(&tenancy, None, build_client()) });
    let tasks = TaskTracker::new();
    rt.block_on(async { access.start(&tasks, CancellationToken::new()) });
    let headers = bearer(probe);
    let caller = Caller {
        headers: &headers,
        peer: None,
        fairness_id: None,
    };
    for _ in 0..500 {
        if rt.block_on(access.client(&caller)).is_ok() {
            return access;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("the JWKS was never fetched from {}", issuer.url);
}

fn identity(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();

    let open =
        rt.block_on(async { Access::new(&TenancySettings::default(), None, build_client()) });
    bench_caller(c, &rt, "anonymous", &open, HeaderMap::new(), "ip:127.0.0.1");

    let tenant_keys: Vec<(String, Secret)> = (0..100)
        .map(|i| {
            (
                format!("team-{i}"),
                Secret::new(format!("sk-team-{i}-0123456789abcdef")).unwrap(),
            )
        })
        .collect();
    let tenancy = TenancySettings {
        tenant_keys,
        ..TenancySettings::default()
    };
    let keyed = rt.block_on(async { Access::new(&tenancy, None, build_client()) });
    let headers = bearer("sk-team-99-0123456789abcdef");
    bench_caller(c, &rt, "tenant_key_of_100", &keyed, headers, "auth:team-99");

    let (es, rs) = (Key::es256("es"), Key::rs256("rs"));
    let issuer = rt.block_on(Issuer::start(&[&es, &rs]));
    // Valid for a day: the run never sees it expire.
    let claims = issuer.claims("alice", &[], 86_400);
    let (es_token, rs_token) = (es.token(&claims), rs.token(&claims));
    let access = jwt_access(&rt, &issuer, &es_token);
    bench_caller(
        c,
        &rt,
        "jwt_es256",
        &access,
        bearer(&es_token),
        "auth:alice",
    );
    bench_caller(
        c,
        &rt,
        "jwt_rs256",
        &access,
        bearer(&rs_token),
        "auth:alice",
    );

    let jwks = serde_json::json!({"keys": [es.jwk, rs.jwk]}).to_string();
    let keys = KeySet::parse(jwks.as_bytes()).unwrap();
    let expected = Expected {
        issuer: issuer.url.clone(),
        audience: "kvroute".into(),
    };
    let now = claims["exp"].as_u64().unwrap() - 3600;
    for (name, token) in [
        ("jwt_es256_first", &es_token),
        ("jwt_rs256_first", &rs_token),
    ] {
        let key = keys.get(&verifier::header(token).unwrap().kid).unwrap();
        assert!(
            verifier::verify(token, &key, &expected, now).is_ok(),
            "{name}"
        );
        c.bench_function(name, |b| {
            b.iter(|| verifier::verify(black_box(token), &key, &expected, now).unwrap())
        });
    }
}

criterion_group!(benches, identity);
criterion_main!(benches);
