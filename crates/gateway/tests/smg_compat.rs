//! smg's request headers, as smg users send them: `x-smg-target-worker` pins a request to a
//! worker (by id, or by its index in `--worker-urls`) under every policy, and the routed
//! worker comes back in `x-smg-routed-worker-id`.

mod support;

use kvroute_core::PolicyKind;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn x_smg_target_worker_pins_under_every_policy_by_index_or_id() {
    let workers = mocks(["a", "b", "c"]).await;
    let urls: Vec<&str> = workers.iter().map(|w| w.url.as_str()).collect();
    for policy in PolicyKind::ALL {
        let mut s = settings(&workers.iter().collect::<Vec<_>>());
        s.policy = policy;
        let router = TestRouter::start(s).await;
        let body = r#"{"model":"m","prompt":"pinned"}"#;
        for _ in 0..3 {
            let r = post(
                &router.url,
                "/v1/completions",
                &[("x-smg-target-worker", "2")],
                body,
            )
            .await;
            assert_eq!(r.status, 200, "{policy}: {:?}", r.body);
            assert_eq!(r.worker(), urls[2], "{policy}: by index");
            assert_eq!(r.headers["x-smg-routed-worker-id"], urls[2]);
            let r = post(
                &router.url,
                "/v1/completions",
                &[("x-smg-target-worker", urls[1])],
                body,
            )
            .await;
            assert_eq!(r.status, 200, "{policy}: {:?}", r.body);
            assert_eq!(r.worker(), urls[1], "{policy}: by id");
        }
        // kvroute's own pin wins over smg's.
        let r = post(
            &router.url,
            "/v1/completions",
            &[("x-smg-target-worker", "2"), ("x-kvroute-worker", urls[0])],
            body,
        )
        .await;
        assert_eq!(r.worker(), urls[0], "{policy}");
        let r = post(
            &router.url,
            "/v1/completions",
            &[("x-smg-target-worker", "3")],
            body,
        )
        .await;
        assert_eq!(r.status, 400, "{policy}");
        assert_eq!(r.error_code(), "invalid_hint");
        assert!(r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("x-smg-target-worker"));
        router.stop().await;
    }
}

/// The key each request names, and where consistent_hash sent it.
async fn placements(
    router: &TestRouter,
    header: &str,
    keys: usize,
) -> std::collections::HashMap<String, std::collections::HashSet<String>> {
    let mut seen: std::collections::HashMap<String, std::collections::HashSet<String>> =
        Default::default();
    for round in 0..3 {
        for k in 0..keys {
            let key = format!("tenant-{k}");
            // Each request's prompt differs, so only the key can keep it in place.
            let body = format!(r#"{{"model":"m","prompt":"round {round} key {k}"}}"#);
            let r = post(&router.url, "/v1/completions", &[(header, &key)], &body).await;
            assert_eq!(r.status, 200);
            seen.entry(key).or_default().insert(r.worker().to_owned());
        }
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_key_headers_name_where_the_session_key_is_read() {
    let workers = mocks(["a", "b", "c"]).await;
    let argv = [
        "kvroute",
        "--worker-urls",
        &workers[0].url,
        &workers[1].url,
        &workers[2].url,
        "--policy",
        "consistent_hash",
        "--routing-key-headers",
        "X-Tenant",
        "x-session-id",
    ];
    let settings = <kvroute_gateway::Args as clap::Parser>::parse_from(argv)
        .load()
        .unwrap();
    let router = TestRouter::start(settings).await;
    let seen = placements(&router, "x-tenant", 12).await;
    assert!(seen.values().all(|w| w.len() == 1), "a key moved: {seen:?}");
    let used: std::collections::HashSet<_> = seen.values().flatten().collect();
    assert!(used.len() > 1, "every key on one worker: {seen:?}");
    // smg's header is no longer in the list: it keys nothing.
    let unkeyed = placements(&router, "x-smg-routing-key", 12).await;
    assert!(unkeyed.values().any(|w| w.len() > 1), "{unkeyed:?}");
    router.stop().await;

    let bad = ["kvroute", "--routing-key-headers", "not a header"];
    let err = <kvroute_gateway::Args as clap::Parser>::parse_from(bad)
        .load()
        .unwrap_err();
    assert!(err.to_string().contains("routing_key_headers"), "{err}");
}
