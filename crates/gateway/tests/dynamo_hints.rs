//! Dynamo's routing hints: `nvext.backend_instance_id` / `decode_worker_id` and
//! `nvext.dp_rank` in the body, the `x-worker-instance-id` and `x-dp-rank` headers, as pins
//! under every policy, over workers whose ids are Dynamo instance ids.

mod support;

use kvroute_core::PolicyKind;
use support::*;

fn body(nvext: &str) -> String {
    format!(r#"{{"model":"m","prompt":"hello","nvext":{nvext}}}"#)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nvext_and_dynamos_headers_pin_under_every_policy() {
    let [a, b, c] = mocks(["a", "b", "c"]).await;
    let mut ranked = named_spec("33", "m", c.url.clone());
    ranked.dp_size = Some(2);
    let specs = vec![
        named_spec("11", "m", a.url.clone()),
        named_spec("22", "m", b.url.clone()),
        ranked,
    ];
    for policy in PolicyKind::ALL {
        let mut s = kvroute_gateway::Settings::with_workers(specs.clone()).unwrap();
        s.policy = policy;
        let router = TestRouter::start(s).await;
        for _ in 0..3 {
            let r = post(
                &router.url,
                "/v1/completions",
                &[],
                &body(r#"{"backend_instance_id":22,"annotations":["x"]}"#),
            )
            .await;
            assert_eq!(r.status, 200, "{policy}: {:?}", r.body);
            assert_eq!(r.worker(), "22", "{policy}");
            // Forwarded as sent.
            assert!(r.json()["body"]
                .as_str()
                .unwrap()
                .contains("backend_instance_id"));
            let r = post(
                &router.url,
                "/v1/completions",
                &[],
                &body(r#"{"decode_worker_id":33,"dp_rank":1}"#),
            )
            .await;
            assert_eq!(r.status, 200, "{policy}: {:?}", r.body);
            assert_eq!(
                r.placed(),
                ("33".to_owned(), Some("1".to_owned())),
                "{policy}"
            );
            // The header wins over the body, and x-dp-rank over nvext.dp_rank.
            let r = post(
                &router.url,
                "/v1/completions",
                &[("x-worker-instance-id", "33"), ("x-dp-rank", "0")],
                &body(r#"{"backend_instance_id":11,"dp_rank":1}"#),
            )
            .await;
            assert_eq!(
                r.placed(),
                ("33".to_owned(), Some("0".to_owned())),
                "{policy}"
            );
        }
        router.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_dynamo_hints_are_clear_400s() {
    let [a, b] = mocks(["a", "b"]).await;
    let specs = vec![
        named_spec("11", "m", a.url.clone()),
        named_spec("22", "m", b.url.clone()),
    ];
    let router = TestRouter::start(kvroute_gateway::Settings::with_workers(specs).unwrap()).await;
    let cases = [
        (vec![], body(r#"{"backend_instance_id":99}"#), "invalid_pin"),
        (
            vec![],
            body(r#"{"backend_instance_id":"eleven"}"#),
            "invalid_json",
        ),
        (
            vec![],
            body(r#"{"backend_instance_id":11,"dp_rank":3}"#),
            "invalid_pin",
        ),
        (
            vec![("x-worker-instance-id", "w1")],
            body("{}"),
            "invalid_hint",
        ),
        (vec![("x-dp-rank", "-1")], body("{}"), "invalid_hint"),
    ];
    for (headers, b, code) in cases {
        let r = post(&router.url, "/v1/completions", &headers, &b).await;
        assert_eq!(r.status, 400, "{b}: {:?}", r.body);
        assert_eq!(r.error_code(), code, "{b}");
        let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
        assert!(!message.is_empty());
    }
    assert_eq!(a.requests() + b.requests(), 0, "nothing reached an engine");
    router.stop().await;
}
