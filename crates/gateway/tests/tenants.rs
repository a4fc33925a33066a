//! Tenants end to end, from the flags: tenant API keys, and JWTs checked against a JWKS the
//! test serves over HTTP (found through the issuer's openid-configuration), on the
//! inference and admin APIs; a rotated key works without a restart.
//!
//! Keys are real: ES256 made by ring, RSA-2048 made by the `openssl` CLI (`support::jwt`).

mod support;

use http::{Method, StatusCode};
use serde_json::json;
use support::*;

async fn router(flags: &[&str]) -> TestRouter {
    let mut argv = vec!["kvroute"];
    argv.extend_from_slice(flags);
    TestRouter::from_flags(&argv[1..]).await
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tenants_requests_and_tokens_are_counted_under_its_label_and_past_the_top_n_as_other()
{
    let shutdown = tokio_util::sync::CancellationToken::new();
    let engine = serve_sim(&[], &shutdown).await;
    let r = router(&[
        "--worker-urls",
        &engine,
        "--tenant-api-key=team-a:key-a",
        "--tenant-api-key=team-b:key-b",
        "--tenant-api-key=team-c:key-c",
        "--priority-scheduler-tenant-metric-top-n",
        "2",
    ])
    .await;
    let ask = |key: &'static str| {
        let url = r.url.clone();
        async move {
            let auth = format!("Bearer {key}");
            let headers = [("authorization", auth.as_str())];
            let body = chat("kvroute-sim", "hi");
            post(&url, "/v1/chat/completions", &headers, &body)
                .await
                .status
        }
    };
    for key in ["key-a", "key-b", "key-a", "key-c", "key-c", "key-c"] {
        assert_eq!(ask(key).await, StatusCode::OK);
    }
    // A request refused before it has a tenant is counted by route only.
    assert_eq!(ask("key-x").await, StatusCode::UNAUTHORIZED);
    let bad = post(
        &r.url,
        "/v1/chat/completions",
        &[("authorization", "Bearer key-b")],
        "{not json",
    )
    .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    let metrics = r.metrics().await;
    for line in [
        r#"kvroute_tenant_requests_total{tenant="auth:team-a",status="200"} 2"#,
        r#"kvroute_tenant_requests_total{tenant="auth:team-b",status="200"} 1"#,
        r#"kvroute_tenant_requests_total{tenant="auth:team-b",status="400"} 1"#,
        r#"kvroute_tenant_requests_total{tenant="other",status="200"} 3"#,
    ] {
        assert!(metrics.contains(line), "missing {line}");
    }
    assert!(
        !metrics.contains("team-c"),
        "a tenant past the top 2 has a label"
    );
    let tenant_401 = metrics
        .lines()
        .filter(|l| l.starts_with("kvroute_tenant_requests_total") && l.contains(r#"status="401""#))
        .count();
    assert_eq!(tenant_401, 0, "a refused caller has no tenant");
    // Each answer's usage is counted for its tenant (tenants are configured: keys), when its
    // body ends: every request asked the same, so team-a has twice team-b's prompt tokens and
    // `other` (team-c) three times.
    let tokens = |metrics: &str, tenant: &str, kind: &str| -> u64 {
        let series = format!(r#"kvroute_tenant_tokens_total{{tenant="{tenant}",kind="{kind}"}} "#);
        let line = metrics.lines().find(|l| l.starts_with(&series));
        line.map_or(0, |l| l[series.len()..].trim().parse().unwrap())
    };
    wait_until_async("every answer's usage counted for its tenant", || async {
        let m = r.metrics().await;
        let prompt = |t| tokens(&m, t, "prompt");
        let b = prompt("auth:team-b");
        b > 0 && prompt("auth:team-a") == 2 * b && prompt("other") == 3 * b
    })
    .await;
    let metrics = r.metrics().await;
    for tenant in ["auth:team-a", "auth:team-b", "other"] {
        let completion = tokens(&metrics, tenant, "completion");
        assert!(completion > 0, "{tenant}'s completion tokens");
    }
    r.stop().await;
    shutdown.cancel();
}
