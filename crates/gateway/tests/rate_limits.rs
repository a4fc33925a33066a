//! Per-tenant rate limits end to end, from the flags (`--tenant-rate-limit-enabled`,
//! `--tenant-rate-limit-config` with smg's YAML) to the answers of kvroute-sim engines:
//! requests and tokens per minute, model rules (exact and prefix), 429 with `Retry-After`
//! and smg's error code, a request larger than the whole bucket, other tenants untouched,
//! settling from the response's usage, and Anthropic's error shape.
//!
//! The limits are chosen so that the buckets' refill (a sixtieth of the figure per second)
//! could change an answer only if the test stalled for tens of seconds.

mod support;

use http::StatusCode;
use http_body_util::BodyExt;
use serde_json::json;
use support::*;
use tokio_util::sync::CancellationToken;

const A: (&str, &str) = ("authorization", "Bearer key-a");
const B: (&str, &str) = ("authorization", "Bearer key-b");

/// A router over `sims` (URLs) with the rate-limit file `yaml` and tenants `auth:a` and
/// `auth:b` (their keys `key-a` and `key-b`).
async fn router(yaml: &str, sims: &[String]) -> TestRouter {
    router_with(yaml, sims, &[]).await
}

/// [`router`] with more flags.
async fn router_with(yaml: &str, sims: &[String], more: &[&str]) -> TestRouter {
    let dir = std::env::temp_dir().join(format!("kvroute-rl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join(format!("{}.yaml", free_port()));
    std::fs::write(&file, yaml).unwrap();
    let mut argv = vec!["kvroute", "--policy", "round_robin", "--worker-urls"];
    argv.extend(sims.iter().map(String::as_str));
    let file = file.to_str().unwrap();
    argv.extend([
        "--tenant-api-key",
        "a:key-a",
        "--tenant-api-key",
        "b:key-b",
        "--tenant-rate-limit-enabled",
        "--tenant-rate-limit-config",
        file,
    ]);
    argv.extend_from_slice(more);
    TestRouter::from_flags(&argv[1..]).await
}

fn ask(model: &str, max_tokens: u64) -> String {
    json!({"model": model, "max_tokens": max_tokens,
           "messages": [{"role": "user", "content": "hello there"}]})
    .to_string()
}

async fn chat_as(r: &TestRouter, who: (&str, &str), body: &str) -> Reply {
    post(&r.url, "/v1/chat/completions", &[who], body).await
}

/// A refusal by the rate limit: 429, smg's code in the body and its header; the wait it
/// announces, if any.
fn refused(reply: &Reply) -> Option<u64> {
    assert_eq!(
        reply.status,
        StatusCode::TOO_MANY_REQUESTS,
        "{:?}",
        reply.body
    );
    assert_eq!(reply.error_code(), "tenant_rate_limit_exceeded");
    assert_eq!(
        reply.headers["x-smg-error-code"],
        "tenant_rate_limit_exceeded"
    );
    reply
        .headers
        .get("retry-after")
        .map(|v| v.to_str().unwrap().parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_per_minute_refuse_with_retry_after_and_leave_other_tenants_alone() {
    let shutdown = CancellationToken::new();
    let sim = serve_sim(&["--speedup", "50"], &shutdown).await;
    let yaml = "default_policy: {tokens_per_minute: 100000, requests_per_minute: 2}\n";
    let r = router(yaml, &[sim]).await;
    for _ in 0..2 {
        assert_eq!(chat_as(&r, A, &ask("kvroute-sim", 4)).await.status, 200);
    }
    let reply = chat_as(&r, A, &ask("kvroute-sim", 4)).await;
    // Two requests a minute: the next one refills in 30 s.
    let wait = refused(&reply).expect("a Retry-After");
    assert!((1..=30).contains(&wait), "{wait}");
    // The other tenant has its own buckets.
    for _ in 0..2 {
        assert_eq!(chat_as(&r, B, &ask("kvroute-sim", 4)).await.status, 200);
    }
    let text = r.metrics().await;
    let name = "kvroute_tenant_rate_limited_total";
    assert_metric(&text, name, "tenant=\"auth:a\"", Some(1.0));
    assert_metric(&text, name, "tenant=\"auth:b\"", None);
    r.stop().await;
    shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_per_minute_count_the_prompt_and_max_tokens_and_a_request_beyond_the_bucket_never_fits(
) {
    let shutdown = CancellationToken::new();
    let sim = serve_sim(&["--speedup", "100"], &shutdown).await;
    let yaml = "default_policy: {tokens_per_minute: 1000, requests_per_minute: 100}\n";
    let r = router(yaml, &[sim]).await;
    // 880 tokens of answer and the prompt: most of the bucket.
    let first = chat_as(&r, A, &ask("kvroute-sim", 880)).await;
    assert_eq!(first.status, 200);
    assert_eq!(first.json()["usage"]["completion_tokens"], 880);
    // The same again needs ~780 more tokens: at 1000 a minute, about 47 s.
    let wait = refused(&chat_as(&r, A, &ask("kvroute-sim", 880)).await).expect("a wait");
    assert!((30..=60).contains(&wait), "{wait}");
    // A small one still fits.
    assert_eq!(chat_as(&r, A, &ask("kvroute-sim", 4)).await.status, 200);
    // More than the whole bucket: refused without a Retry-After, and it says why.
    let reply = chat_as(&r, B, &ask("kvroute-sim", 5000)).await;
    assert_eq!(refused(&reply), None);
    let message = reply.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(message.contains("never"), "{message}");
    // max_completion_tokens counts as max_tokens does.
    let body = json!({"model": "kvroute-sim", "max_completion_tokens": 5000,
                      "messages": [{"role": "user", "content": "hi"}]});
    assert_eq!(refused(&chat_as(&r, B, &body.to_string()).await), None);
    // B was never charged for what it was refused.
    assert_eq!(chat_as(&r, B, &ask("kvroute-sim", 880)).await.status, 200);
    r.stop().await;
    shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_rules_match_exactly_or_by_prefix_and_bind_only_their_models() {
    let shutdown = CancellationToken::new();
    let big = serve_sim(&["--speedup", "50", "--model", "big-70b"], &shutdown).await;
    let small = serve_sim(&["--speedup", "50", "--model", "small-8b"], &shutdown).await;
    let yaml = "default_policy: {tokens_per_minute: 100000, requests_per_minute: 100}
tenants:
  - tenant_key: auth:a
    tokens_per_minute: 100000
    requests_per_minute: 100
    model_rules:
      - rule_id: big-models
        matcher: {type: prefix, value: big-}
        tokens_per_minute: 100000
        requests_per_minute: 2
      - rule_id: small-one
        matcher: {type: exact, value: small-8b}
        tokens_per_minute: 100000
        requests_per_minute: 1
";
    let r = router(yaml, &[big, small]).await;
    for _ in 0..2 {
        assert_eq!(chat_as(&r, A, &ask("big-70b", 4)).await.status, 200);
    }
    refused(&chat_as(&r, A, &ask("big-70b", 4)).await).expect("a wait");
    // The exact rule is the small model's own.
    assert_eq!(chat_as(&r, A, &ask("small-8b", 4)).await.status, 200);
    refused(&chat_as(&r, A, &ask("small-8b", 4)).await).expect("a wait");
    // Tenant b has only the default policy, without rules.
    for _ in 0..3 {
        assert_eq!(chat_as(&r, B, &ask("big-70b", 4)).await.status, 200);
    }
    r.stop().await;
    shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_early_gives_back_what_it_did_not_use() {
    let shutdown = CancellationToken::new();
    // Real time: 880 tokens take seconds, so the stream is cut long before its end.
    let sim = serve_sim(&[], &shutdown).await;
    let yaml = "default_policy: {tokens_per_minute: 1000, requests_per_minute: 100}\n";
    let r = router(yaml, std::slice::from_ref(&sim)).await;
    let body = json!({"model": "kvroute-sim", "max_tokens": 880, "stream": true,
                      "messages": [{"role": "user", "content": "hello there"}]})
    .to_string();
    let response = open_stream_with(&r.url, "/v1/chat/completions", &[A], &body).await;
    assert_eq!(response.status(), 200);
    let mut stream = response.into_body();
    stream.frame().await.expect("a first chunk").unwrap();
    // Without the refund, the same request would wait ~47 s for the bucket.
    drop(stream);
    wait_idle(&r, &sim).await;
    let again = open_stream_with(&r.url, "/v1/chat/completions", &[A], &body).await;
    assert_eq!(again.status(), 200, "the unused tokens were given back");
    drop(again);
    wait_idle(&r, &sim).await;
    r.stop().await;
    shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_the_messages_api_the_refusal_is_anthropics_rate_limit_error() {
    let shutdown = CancellationToken::new();
    let sim = serve_sim(&["--speedup", "50"], &shutdown).await;
    let yaml = "default_policy: {tokens_per_minute: 100000, requests_per_minute: 1}\n";
    let r = router(yaml, &[sim]).await;
    let body = json!({"model": "kvroute-sim", "max_tokens": 4,
                      "messages": [{"role": "user", "content": "hi"}]})
    .to_string();
    let ok = post(&r.url, "/v1/messages", &[A], &body).await;
    assert_eq!(ok.status, 200, "{:?}", ok.body);
    let reply = post(&r.url, "/v1/messages", &[A], &body).await;
    assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
    let v = reply.json();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "rate_limit_error");
    assert_eq!(
        reply.headers["x-smg-error-code"],
        "tenant_rate_limit_exceeded"
    );
    let wait: u64 = reply.headers["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&wait), "{wait}");
    // count_tokens is a request too (it takes no token).
    let count = post(&r.url, "/v1/messages/count_tokens", &[A], &body).await;
    assert_eq!(count.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(count.json()["error"]["type"], "rate_limit_error");
    r.stop().await;
    shutdown.cancel();
}

/// Waits until `r` has taken `n` rate-limit charges from its peers.
async fn charges_in(r: &TestRouter, n: f64) {
    wait_until_async("the peer's charges arrive", || async {
        let labels = "direction=\"in\",kind=\"rate_charged\"";
        let seen = metric_value(
            &r.metrics().await,
            "kvroute_replica_sync_messages_total",
            labels,
        );
        seen.unwrap_or(0.0) >= n
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_in_sync_share_the_counts() {
    let nats = nats().await;
    let shutdown = CancellationToken::new();
    let sim = serve_sim(&["--speedup", "50"], &shutdown).await;
    let yaml = "default_policy: {tokens_per_minute: 100000, requests_per_minute: 2}\n";
    let sync = [
        "--replica-sync",
        &nats.1,
        "--replica-sync-subject-prefix",
        "rl",
    ];
    let a = router_with(yaml, std::slice::from_ref(&sim), &sync).await;
    let b = router_with(yaml, std::slice::from_ref(&sim), &sync).await;
    for r in [&a, &b] {
        wait_until_async("the replicas see each other", || async {
            metric_value(&r.metrics().await, "kvroute_replica_peers", "") == Some(1.0)
        })
        .await;
    }
    // Two requests a minute for tenant a, over both replicas: one on each.
    assert_eq!(chat_as(&a, A, &ask("kvroute-sim", 4)).await.status, 200);
    charges_in(&b, 1.0).await;
    assert_eq!(chat_as(&b, A, &ask("kvroute-sim", 4)).await.status, 200);
    charges_in(&a, 1.0).await;
    // Alone, either replica would still have room for a second request.
    refused(&chat_as(&a, A, &ask("kvroute-sim", 4)).await).expect("a wait");
    refused(&chat_as(&b, A, &ask("kvroute-sim", 4)).await).expect("a wait");
    assert_eq!(chat_as(&b, B, &ask("kvroute-sim", 4)).await.status, 200);
    a.stop().await;
    b.stop().await;
    shutdown.cancel();
}
