//! The config file (`--config FILE`, YAML or JSON): its text through `Args::from_text`, under a
//! command line as `Args::load` merges it, validated by `Args::into_settings`, and then what
//! the server builds from the `Settings` before it does any I/O (`Gateway::new`, and per
//! worker the KV-event subscriber and the engine-metrics scraper that `Gateway::serve` starts).
//!
//! The input is the file's bytes; a file that is not UTF-8 is refused by `read_to_string`
//! before parsing, so only UTF-8 inputs go further.
//!
//! Checked: nothing panics; errors display; a configuration that validates has positive
//! block size, payload limit and timeouts, unique worker ids, `http://` worker URLs without
//! a trailing slash, and every worker at least one rank.

#![no_main]

use std::collections::HashSet;
use std::sync::Arc;

use clap::Parser;
use kvroute_gateway::engine_metrics::ScrapeTiming;
use kvroute_gateway::kv::{KvState, WorkerSink};
use kvroute_gateway::kv_events::{KvEventMetrics, KvEventSubscriber};
use kvroute_gateway::prompts::Prompts;
use kvroute_gateway::{Args, Gateway, Settings, WorkerSpec};
use kvroute_tokenizer::Tokenizer;
use libfuzzer_sys::fuzz_target;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Ranks a validated worker would have out of bounds, if any: the bugs K2 (`dp_start_rank +
/// dp_size` overflowing u32: a worker without ranks) and K3 (an unbounded `dp_size`: a
/// multi-gigabyte allocation at start), both fixed by validation in `into_settings`.
fn known_bug(w: &WorkerSpec) -> Option<&'static str> {
    let start = u64::from(w.dp_start_rank.unwrap_or(0));
    let size = u64::from(w.dp_size.unwrap_or(1));
    if start + size > u64::from(u32::MAX) {
        Some("K2: dp_start_rank + dp_size overflows u32")
    } else if size > MAX_RANKS {
        Some("K3: dp_size is not bounded")
    } else {
        None
    }
}

/// The most ranks `into_settings` accepts for one worker.
const MAX_RANKS: u64 = 1024;

/// `FUZZ_VERBOSE=1 .../config FILE...` says what became of each input.
macro_rules! verbose {
    ($($arg:tt)*) => {
        if *VERBOSE.get_or_init(|| std::env::var_os("FUZZ_VERBOSE").is_some()) {
            eprintln!($($arg)*);
        }
    };
}

static VERBOSE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let file = match Args::from_text(text) {
        Ok(args) => args,
        Err(error) => {
            let error = error.to_string();
            verbose!("unparsable: {error}");
            return;
        }
    };
    // `kvroute --config FILE`: the command line has nothing else to say.
    let cli = Args::try_parse_from(["kvroute"]).expect("an empty command line parses");
    let settings = match cli.merge(file).into_settings() {
        Ok(settings) => settings,
        Err(error) => {
            let error = error.to_string();
            verbose!("invalid: {error}");
            return;
        }
    };
    verbose!(
        "valid: {} workers, policy {:?}",
        settings.workers.len(),
        settings.policy
    );
    // K2 and K3 are fixed: a validated worker's ranks fit in u32 and number at most 1024.
    for w in &settings.workers {
        assert!(
            known_bug(w).is_none(),
            "validated config with {:?}",
            known_bug(w)
        );
    }
    check(&settings);
    build(settings);
});

fn check(s: &Settings) {
    assert!(s.block_size > 0);
    assert!(s.max_payload_size > 0);
    assert!(!s.request_timeout.is_zero());
    assert!(s.max_indexed_blocks > 0);
    let mut ids = HashSet::new();
    for w in &s.workers {
        let id = w.id.as_deref().expect("ids are filled in");
        assert!(ids.insert(id), "duplicate id {id}");
        // The scheme, http or https, is case-insensitive (RFC 3986): `HTTP://` is accepted
        // and kept as given.
        let scheme = w
            .url
            .split_once("://")
            .map(|(scheme, _)| scheme.to_ascii_lowercase());
        assert!(
            matches!(scheme.as_deref(), Some("http" | "https")),
            "{}",
            w.url
        );
        assert!(!w.url.ends_with('/'), "{}", w.url);
        assert!(!w.ranks().is_empty(), "worker {id} has no rank");
    }
    if let Some(q) = &s.queue {
        assert!(q.threshold.is_finite() && q.threshold > 0.0);
        assert_eq!(q.classes.len(), q.class_thresholds.len());
        assert!(!q.classes.is_empty());
    }
}

/// What `kvroute` builds from the settings before it binds anything.
fn build(settings: Settings) {
    let mut registry = Registry::default();
    let gateway = Gateway::new(settings.clone(), &mut registry);
    let _ = gateway.policy_description();
    let prompts = Prompts::new(
        Arc::new(Tokenizer::fallback()),
        settings.block_size,
        settings.tokenizer_cache_bytes,
        &mut registry,
    );
    let kv = Arc::new(KvState::new(
        &settings,
        prompts,
        (Gauge::default(), Gauge::default()),
    ));
    let kv_event_metrics = KvEventMetrics::register(&mut registry);
    for worker in gateway.workers().workers().iter() {
        // As `Gateway::serve` starts the engine-metrics scraper...
        let _ = worker.metrics_scraper(ScrapeTiming::default());
        // ...and the KV-event subscriber.
        let Some(config) = worker.kv_subscriber_config(kv.block_size) else {
            continue;
        };
        let sink = Arc::new(WorkerSink::new(kv.clone(), worker.clone()));
        if let Err(error) = KvEventSubscriber::new(config, sink, &kv_event_metrics) {
            let _ = error.to_string();
        }
    }
}
