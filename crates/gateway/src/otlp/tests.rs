use std::sync::Arc;

use prometheus_client::registry::Registry;

use super::*;

fn tracer(ratio: f64) -> Arc<Tracer> {
    let settings = TraceSettings {
        endpoint: Endpoint::parse("localhost:4317").unwrap(),
        sampling_ratio: ratio,
        service_name: "kvroute".into(),
    };
    Arc::new(Tracer::new(
        settings,
        TraceMetrics::register(&mut Registry::default()),
    ))
}

#[test]
fn endpoints_parse_as_smg_and_otlp_http_write_them() {
    let http = |s: &str| match Endpoint::parse(s).unwrap() {
        Endpoint::Http(uri) => uri.to_string(),
        other => panic!("{s}: {other:?}"),
    };
    assert_eq!(
        http("http://collector:4318"),
        "http://collector:4318/v1/traces"
    );
    assert_eq!(
        http("http://collector:4318/"),
        "http://collector:4318/v1/traces"
    );
    assert_eq!(
        http("https://otel.example.com/custom/traces"),
        "https://otel.example.com/custom/traces"
    );
    assert_eq!(
        Endpoint::parse("localhost:4317").unwrap(),
        Endpoint::Grpc("localhost:4317".parse().unwrap())
    );
    for bad in [
        "localhost",
        "grpc://localhost:4317",
        "http://",
        "host:port",
        "",
        "a:4317/x",
    ] {
        assert!(Endpoint::parse(bad).is_err(), "{bad:?} parsed");
    }
}

#[test]
fn traceparent_parses_only_when_well_formed() {
    let p = Parent::parse(b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01").unwrap();
    assert_eq!(to_hex(&p.trace_id), "0af7651916cd43dd8448eb211c80319c");
    assert_eq!(to_hex(&p.span_id), "b7ad6b7169203331");
    assert!(p.sampled);
    let unsampled =
        Parent::parse(b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00").unwrap();
    assert!(!unsampled.sampled);
    // A later version may carry more fields.
    assert!(Parent::parse(b"01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x").is_some());
    for bad in [
        &b"00-00000000000000000000000000000000-b7ad6b7169203331-01"[..],
        b"00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
        b"ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x",
        b"00-0af7651916cd43dd8448eb211c8031-b7ad6b7169203331-01",
        b"00-0af7651916cd43dd8448eb211c80319g-b7ad6b7169203331-01",
        b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
        b"garbage",
        b"\xff",
    ] {
        assert!(
            Parent::parse(bad).is_none(),
            "{:?}",
            String::from_utf8_lossy(bad)
        );
    }
}

#[test]
fn sampling_is_parent_based_then_by_ratio() {
    let never = tracer(0.0);
    let sampled =
        Parent::parse(b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01").unwrap();
    let unsampled = Parent {
        sampled: false,
        ..sampled.clone()
    };
    for _ in 0..100 {
        assert!(never.start(|| "r".into(), None, None).is_none());
    }
    // A sampled parent is traced whatever the ratio, in its trace.
    let span = never.start(|| "r".into(), Some(&sampled), None).unwrap();
    assert_eq!(span.trace_id(), "0af7651916cd43dd8448eb211c80319c");
    assert_eq!(span.parent, Some(sampled.span_id));
    assert!(tracer(1.0)
        .start(|| "r".into(), Some(&unsampled), None)
        .is_none());

    let half = tracer(0.5);
    let traced = (0..10_000)
        .filter(|_| half.start(|| "r".into(), None, None).is_some())
        .count();
    assert!((4_500..5_500).contains(&traced), "{traced} of 10000 at 0.5");
    assert!((0..100).all(|_| tracer(1.0).start(|| "r".into(), None, None).is_some()));
}

#[test]
fn a_request_span_ends_once_with_its_attempts_as_children() {
    let t = tracer(1.0);
    let mut rx = t.take_receiver().unwrap();
    let span = t
        .start(|| "POST /v1/completions".into(), None, None)
        .unwrap();
    span.set_str("kvroute.worker", "w1");
    span.add("kvroute.retries", 1);
    span.add("kvroute.retries", 1);
    {
        let mut attempt = span.attempt("w1", Some(1), 1);
        let tp = attempt.traceparent();
        let parsed = Parent::parse(tp.as_bytes()).unwrap();
        assert_eq!(to_hex(&parsed.trace_id), span.trace_id());
        assert!(parsed.sampled);
        attempt.status(503);
    }
    span.first_byte();
    span.end();
    span.end();
    let child = rx.try_recv().unwrap();
    let parent = rx.try_recv().unwrap();
    assert!(rx.try_recv().is_err(), "one span per end");
    assert_eq!(child.parent_span_id, parent.span_id);
    assert_eq!(child.kind, proto::SPAN_KIND_CLIENT);
    assert_eq!(child.status.unwrap().code, proto::STATUS_ERROR);
    assert_eq!(parent.kind, proto::SPAN_KIND_SERVER);
    assert!(parent.parent_span_id.is_empty());
    let int = |key: &str| {
        parent
            .attributes
            .iter()
            .find(|kv| kv.key == key)
            .and_then(|kv| kv.value.clone()?.value)
    };
    assert_eq!(int("kvroute.retries"), Some(Value::Int(2)));
    assert!(matches!(int("kvroute.ttft_ms"), Some(Value::Double(ms)) if ms >= 0.0));
}

#[test]
fn a_full_queue_drops_and_counts() {
    let t = tracer(1.0);
    let _rx = t.take_receiver().unwrap();
    for _ in 0..QUEUE + 10 {
        t.start(|| "r".into(), None, None).unwrap().end();
    }
    let dropped = t
        .metrics
        .dropped
        .get_or_create(&DropLabels {
            reason: "queue_full",
        })
        .get();
    assert_eq!(dropped, 10);
}
