//! Criterion benchmarks of what the per-tenant rate limits cost a request:
//! - `reserve_settle`: a reservation on a tenant's scope, then its settlement, one of 1000
//!   tenants in turn;
//! - `reserve_settle_rule`: the same on a model a prefix rule matches (two scopes);
//! - `meter_stream_256`: the usage tap's meter over a 256-chunk OpenAI stream with a closing
//!   usage chunk (the whole stream; divide by 256 for a chunk).
//!
//! ```text
//! cargo bench -p kvroute-gateway --bench rate_limits -- --warm-up-time 1 --measurement-time 3
//! ```

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use criterion::{criterion_group, criterion_main, Criterion};
use kvroute_gateway::auth::Tenant;
use kvroute_gateway::rate_limit::RateLimiter;
use kvroute_gateway::usage::{Framing, Meter};

const FILE: &str = "default_policy:
  tokens_per_minute: 1000000000
  requests_per_minute: 1000000000
  model_rules:
    - {rule_id: big, matcher: {type: prefix, value: big-}, tokens_per_minute: 1000000000, requests_per_minute: 1000000000}
";

fn limiter() -> Arc<RateLimiter> {
    let path = std::env::temp_dir().join(format!("kvroute-bench-rl-{}.yaml", std::process::id()));
    std::fs::write(&path, FILE).unwrap();
    let policy = kvroute_gateway::config::load_rate_limits(&path, false).unwrap();
    std::fs::remove_file(&path).unwrap();
    Arc::new(RateLimiter::new(policy))
}

fn reserve(c: &mut Criterion) {
    let l = limiter();
    let tenants: Vec<Tenant> = (0..1000)
        .map(|i| Tenant::authenticated(&i.to_string()))
        .collect();
    let mut i = 0;
    c.bench_function("reserve_settle", |b| {
        b.iter(|| {
            i = (i + 1) % tenants.len();
            let now = Instant::now();
            let r = l.reserve(&tenants[i], Some("m"), 600, now).unwrap();
            r.settle(black_box(450), now);
        })
    });
    c.bench_function("reserve_settle_rule", |b| {
        b.iter(|| {
            i = (i + 1) % tenants.len();
            let now = Instant::now();
            let r = l.reserve(&tenants[i], Some("big-70b"), 600, now).unwrap();
            r.settle(black_box(450), now);
        })
    });
}

fn meter(c: &mut Criterion) {
    let chunk = r#"data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"tok"},"finish_reason":null}]}"#;
    let usage = r#"data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":100,"completion_tokens":256,"total_tokens":356}}"#;
    let mut frames: Vec<String> = (0..256).map(|_| format!("{chunk}\n\n")).collect();
    frames.push(format!("{usage}\n\ndata: [DONE]\n\n"));
    c.bench_function("meter_stream_256", |b| {
        b.iter(|| {
            let mut m = Meter::new(Framing::Sse);
            for f in &frames {
                m.observe(f.as_bytes());
            }
            let u = m.usage(0, true);
            assert_eq!(u.completion, 256);
            black_box(u)
        })
    });
}

criterion_group!(benches, reserve, meter);
criterion_main!(benches);
