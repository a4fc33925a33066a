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
