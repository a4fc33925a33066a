//! A client's request as the router reads it before forwarding: the routing hints of its
//! headers, the routing fields of its JSON body, its prompt tokens (fallback tokenizer and the
//! tiny Llama tokenizer with its chat template), and the routing decision itself, the way
//! `POST /debug/route` makes it (`crates/gateway/src/server.rs`), for every policy.
//!
//! The input reads like an HTTP request without its request line: header lines
//! `name: value`, an empty line, then the body. Without an empty line it is all body. Two
//! pseudo-headers steer the harness and are not passed on: `x-fuzz-policy: NAME` (the
//! policy, default `kv_aware`) and `x-fuzz-affinity: hard|soft` (session affinity, off by
//! default).
//!
//! Checked: nothing panics; an error becomes a response with its status; accepted hints are
//! well formed (non-empty trimmed names, finite non-negative weights); a session key is never
//! empty; block hashes cover the full blocks of the tokens; a decision names one of its
//! candidates and has one cost per candidate.

#![no_main]

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use axum::response::IntoResponse;
use http::{HeaderMap, HeaderName, HeaderValue};
use kvroute_core::affinity::{Affinity, AffinityMode};
use kvroute_core::PolicyKind;
use kvroute_gateway::error::GatewayError;
use kvroute_gateway::kv::KvState;
use kvroute_gateway::metrics::GatewayMetrics;
use kvroute_gateway::prompts::Prompts;
use kvroute_gateway::routing::{parse_hints, plan, prompt_tokens, session_key, Limits};
use kvroute_gateway::workers::WorkerSet;
use kvroute_gateway::{Settings, WorkerSpec};
use kvroute_index::{block_hashes, EngineHash, ReplicaId, StorageTier, StoredBlocks};
use kvroute_protocol::{fallback, RoutingFields};
use kvroute_tokenizer::Tokenizer;
use libfuzzer_sys::fuzz_target;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// The tiny Llama tokenizer and chat template the tests use.
const TINY_LLAMA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/tiny-llama");

/// A prefix the index holds the blocks of on worker `a`'s rank 0 (fallback tokens), so that
/// kv_aware sees overlap: how the fallback renders a chat that opens with this system message.
const CACHED_PREFIX: &str =
    "system: You are a helpful assistant. Answer briefly and cite sources.\n";

struct Fixture {
    fallback: Prompts,
    llama: Prompts,
    /// The workers, as the hints read them.
    specs: Vec<WorkerSpec>,
    /// The headers a session key is read from (the default `--routing-key-headers`).
    keys: Vec<HeaderName>,
    kv: KvState,
    /// One worker set per policy, in `PolicyKind::ALL` order.
    sets: Vec<WorkerSet>,
    hard: Affinity,
    soft: Affinity,
}

fn workers() -> Vec<WorkerSpec> {
    let spec = |id: &str, model: &str, taints: &[&str]| WorkerSpec {
        id: Some(id.to_owned()),
        model: Some(model.to_owned()),
        taints: taints.iter().map(|t| (*t).to_owned()).collect(),
        ..WorkerSpec::url(format!("http://{id}:8000"))
    };
    vec![
        WorkerSpec {
            dp_size: Some(2),
            max_num_batched_tokens: Some(8192),
            // Its cache is known from events: the fixture's blocks (a `tcp://` address is
            // only a flag here; nothing connects).
            kv_events: Some("tcp://a:5557".to_owned()),
            ..spec("a", "m", &["gpu", "zone-a"])
        },
        spec("b", "m", &["gpu"]),
        WorkerSpec {
            dp_size: Some(2),
            dp_start_rank: Some(4),
            ..spec("c", "other", &[])
        },
        spec("d", "m", &["cpu"]),
    ]
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let specs = workers();
        let settings = Settings::with_workers(specs.clone()).expect("valid fixture workers");
        let sets = PolicyKind::ALL
            .iter()
            .map(|&kind| {
                let mut registry = Registry::default();
                let metrics = GatewayMetrics::register(&mut registry);
                let settings = Settings {
                    policy: kind,
                    ..settings.clone()
                };
                let set = WorkerSet::new(&settings, &metrics);
                for id in ["a", "b", "c"] {
                    set.set_healthy(id, true);
                }
                // "d" stays unhealthy.
                set.set_healthy("d", false);
                set
            })
            .collect();
        let prompts = |tokenizer: Tokenizer| {
            let tokenizer = Arc::new(tokenizer);
            Prompts::new(tokenizer, settings.block_size, 0, &mut Registry::default())
        };
        let kv = KvState::new(
            &settings,
            prompts(Tokenizer::fallback()),
            (Gauge::default(), Gauge::default()),
        );
        let tokens = fallback::encode(CACHED_PREFIX);
        let full = tokens.len() / settings.block_size * settings.block_size;
        let hashes: Vec<EngineHash> = (0..full / settings.block_size)
            .map(|i| EngineHash(1000 + i as u64))
            .collect();
        kv.stored(
            ReplicaId(0),
            &StoredBlocks {
                parent: None,
                engine_hashes: &hashes,
                token_ids: &tokens[..full],
                block_size: settings.block_size,
                tier: StorageTier::Device,
                salt: 0,
            },
        )
        .expect("fixture blocks apply");
        let now = Instant::now();
        let ttl = Duration::from_secs(3600);
        let (hard, soft) = (
            Affinity::new(AffinityMode::Hard, ttl, 1024),
            Affinity::new(AffinityMode::Soft, ttl, 1024),
        );
        for affinity in [&hard, &soft] {
            affinity.bind("s-a", "a", Some(1), now);
            affinity.bind("s-b", "b", None, now);
            affinity.bind("s-c", "c", Some(5), now);
            affinity.bind("s-gone", "gone", Some(9), now);
        }
        let llama =
            Tokenizer::load(std::path::Path::new(TINY_LLAMA)).expect("testdata/tiny-llama loads");
        Fixture {
            fallback: prompts(Tokenizer::fallback()),
            llama: prompts(llama),
            keys: settings.routing_key_headers.clone(),
            specs,
            kv,
            sets,
            hard,
            soft,
        }
    })
}

/// Splits the input into headers and body; header lines that are not a valid header are
/// skipped.
fn split(data: &[u8]) -> (HeaderMap, &[u8]) {
    let Some(at) = data.windows(2).position(|w| w == b"\n\n") else {
        return (HeaderMap::new(), data);
    };
    let (head, body) = (&data[..at], &data[at + 2..]);
    let mut headers = HeaderMap::new();
    for line in head.split(|&b| b == b'\n') {
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            continue;
        };
        let (name, value) = (&line[..colon], &line[colon + 1..]);
        let value = value.strip_prefix(b" ").unwrap_or(value);
        if let (Ok(name), Ok(value)) =
            (HeaderName::from_bytes(name), HeaderValue::from_bytes(value))
        {
            headers.append(name, value);
        }
    }
    (headers, body)
}

/// The status of the response an error becomes, building that response as the server does.
fn into_status(error: GatewayError) -> u16 {
    let status = error.status();
    let response = error.into_response();
    assert_eq!(response.status(), status);
    status.as_u16()
}

/// `FUZZ_VERBOSE=1 .../request FILE...` says what became of each input.
macro_rules! verbose {
    ($($arg:tt)*) => {
        if *VERBOSE.get_or_init(|| std::env::var_os("FUZZ_VERBOSE").is_some()) {
            eprintln!($($arg)*);
        }
    };
}

static VERBOSE: OnceLock<bool> = OnceLock::new();

fuzz_target!(|data: &[u8]| {
    let fixture = fixture();
    let (mut headers, body) = split(data);
    let policy = headers
        .remove("x-fuzz-policy")
        .and_then(|v| v.to_str().ok()?.parse::<PolicyKind>().ok())
        .unwrap_or(PolicyKind::KvAware);
    let affinity = match headers
        .remove("x-fuzz-affinity")
        .as_ref()
        .map(HeaderValue::as_bytes)
    {
        Some(b"hard") => Some(&fixture.hard),
        Some(b"soft") => Some(&fixture.soft),
        _ => None,
    };

    let fields = match RoutingFields::from_json(body) {
        Ok(fields) => fields,
        Err(error) => {
            verbose!("body: {error}");
            assert_eq!(into_status(GatewayError::InvalidJson(error)), 400);
            return;
        }
    };
    let _ = fields.routing_text();
    let hints = match parse_hints(&headers, &fixture.specs, &fields) {
        Ok(hints) => {
            let names = hints
                .allowed_workers
                .iter()
                .flatten()
                .chain(&hints.required_taints)
                .chain(hints.pinned_worker.as_ref())
                .chain(hints.preferred_taints.iter().map(|(t, _)| t));
            for name in names {
                assert_eq!(name.trim(), name, "hint names are trimmed");
            }
            let required = hints
                .allowed_workers
                .iter()
                .flatten()
                .chain(&hints.required_taints)
                .chain(hints.pinned_worker.as_ref());
            for name in required {
                assert!(!name.is_empty(), "empty name in {hints:?}");
            }
            for (_, weight) in &hints.preferred_taints {
                assert!(weight.is_finite() && *weight >= 0.0, "weight {weight}");
            }
            Some(hints)
        }
        Err(error) => {
            verbose!("hints: {error}");
            assert!(
                matches!(error, GatewayError::InvalidHint { .. }),
                "{error:?}"
            );
            assert_eq!(into_status(error), 400);
            None
        }
    };

    let session = session_key(&fixture.keys, &headers, &fields);
    if let Some(key) = session {
        assert!(!key.is_empty(), "empty session key");
    }

    let tokens = prompt_tokens(&fixture.fallback, body, &fields).unwrap_or_default();
    let llama = prompt_tokens(&fixture.llama, body, &fields);
    verbose!(
        "tokens: {} (fallback), {:?} (tiny-llama)",
        tokens.ids.len(),
        llama.as_ref().map(|t| t.ids.len())
    );
    let block_size = fixture.kv.block_size;
    let hashes = block_hashes(&tokens.ids, block_size, 0);
    assert_eq!(hashes.len(), tokens.ids.len() / block_size);

    let Some(hints) = hints else {
        return;
    };
    let index = PolicyKind::ALL
        .iter()
        .position(|&k| k == policy)
        .unwrap_or(0);
    let set = &fixture.sets[index];
    let table = set.table();
    let pool = match table.resolve(fields.model.as_deref()) {
        Ok(pool) => pool,
        Err(error) => {
            verbose!("resolve: {error}");
            let _ = into_status(error);
            return;
        }
    };
    match plan(
        &fixture.kv,
        pool,
        session,
        &hints,
        &Limits::default(),
        affinity,
        &fields,
        &tokens,
        Instant::now(),
        true,
    ) {
        Ok(plan) => {
            verbose!(
                "{policy:?}: {} of {} candidates, costs {:?}",
                plan.choice().worker.id,
                plan.choices.len(),
                plan.costs
            );
            assert!(plan.chosen < plan.choices.len());
            if let Some(costs) = &plan.costs {
                assert_eq!(costs.len(), plan.choices.len());
            }
            let _ = plan.request_load(block_size);
        }
        Err(error) => {
            verbose!("{policy:?}: {error}");
            let _ = into_status(error);
        }
    }
});
