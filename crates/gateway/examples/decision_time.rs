//! The time kv_aware takes to decide, end to end: tokenise, hash, query the index, score.
//!
//!     cargo run --release -p kvroute-gateway --example decision_time [-- TOKENIZER_DIR]
//!
//! 16 workers, each holding 4 cached prefixes of 4096 tokens (the query shares one with 3
//! of them), 8k-token prompts; prints p50/p99 of `routing::plan` and of its parts.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::PolicyKind;
use kvroute_gateway::kv::KvState;
use kvroute_gateway::prompts::Prompts;
use kvroute_gateway::routing;
use kvroute_gateway::workers::WorkerSet;
use kvroute_gateway::{Settings, WorkerSpec};
use kvroute_index::{block_hashes, EngineHash, StorageTier, StoredBlocks};
use kvroute_protocol::RoutingFields;
use kvroute_tokenizer::Tokenizer;

fn words(n: usize, seed: u64) -> String {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut s = String::new();
    for _ in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let len = 2 + (x % 7) as usize;
        for k in 0..len {
            s.push((b'a' + ((x >> (k * 5)) % 26) as u8) as char);
        }
        s.push(' ');
    }
    s
}

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() as f64 * p) as usize).min(v.len() - 1)]
}

fn main() {
    let tokenizer = match std::env::args().nth(1) {
        Some(dir) => Tokenizer::load(std::path::Path::new(&dir)).expect("tokenizer"),
        None => Tokenizer::fallback(),
    };
    let tokenizer = Arc::new(tokenizer);
    let specs: Vec<WorkerSpec> = (0..16)
        .map(|i| WorkerSpec {
            id: Some(format!("w{i}")),
            model: Some("m".into()),
            kv_events: Some(format!("tcp://127.0.0.1:{}", 6000 + i)),
            ..WorkerSpec::url(format!("http://127.0.0.1:{}", 9000 + i))
        })
        .collect();
    let mut settings = Settings::with_workers(specs).unwrap();
    settings.policy = PolicyKind::KvAware;
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = kvroute_gateway::metrics::GatewayMetrics::register(&mut registry);
    let set = WorkerSet::new(&settings, &metrics);
    for i in 0..16 {
        set.set_healthy(&format!("w{i}"), true);
    }
    // No prefix cache: every decision tokenises afresh (bench/tokenize.sh measures the cache).
    let prompts = Prompts::new(tokenizer.clone(), settings.block_size, 0, &mut registry);
    let kv = KvState::new(
        &settings,
        prompts,
        (
            metrics.kv_index_blocks.clone(),
            metrics.kv_index_bytes.clone(),
        ),
    );

    // Build the prompt until it is about 8k tokens.
    let mut n_words = 1000;
    let prompt = loop {
        let p = words(n_words, 7);
        let n = tokenizer.encode_prompt(&p).unwrap().len();
        if n >= 8192 {
            break p;
        }
        n_words = n_words * 8192 / n.max(1) + 50;
    };
    let tokens = tokenizer.encode_prompt(&prompt).unwrap();
    // Index: every worker holds 4 prefixes of 4096 tokens; workers 0..3 hold the query's.
    let bs = settings.block_size;
    for (i, w) in set.workers().iter().enumerate() {
        for p in 0..4u64 {
            let toks: Vec<u32> = if i < 3 && p == 0 {
                tokens[..4096].to_vec()
            } else {
                tokenizer
                    .encode_prompt(&words(1000, 100 + i as u64 * 10 + p))
                    .unwrap()[..4096]
                    .to_vec()
            };
            let hashes: Vec<EngineHash> = block_hashes(&toks, bs, 0)
                .iter()
                .map(|h| EngineHash(h.0 ^ (i as u64) << 1))
                .collect();
            kv.stored(
                w.ranks[0].replica,
                &StoredBlocks {
                    parent: None,
                    engine_hashes: &hashes,
                    token_ids: &toks,
                    block_size: bs,
                    tier: StorageTier::Device,
                    salt: 0,
                },
            )
            .unwrap();
        }
    }
    let body = serde_json::json!({"model": "m", "prompt": prompt}).to_string();
    let table = set.table();
    let pool = table.resolve(Some("m")).unwrap();

    let iters = 2000;
    let (mut plan_t, mut tok_t, mut hash_t, mut query_t) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut chosen = String::new();
    for _ in 0..iters {
        let fields = RoutingFields::from_json(body.as_bytes()).unwrap();
        let t = Instant::now();
        let toks = routing::prompt_tokens(&kv.prompts, body.as_bytes(), &fields).unwrap();
        let plan = routing::plan(
            &kv,
            pool,
            None,
            &Default::default(),
            &Default::default(),
            None,
            &fields,
            &toks,
            Instant::now(),
            false,
        )
        .unwrap();
        plan_t.push(t.elapsed());
        chosen = plan.choice().worker.id.to_string();
        let t = Instant::now();
        let toks = routing::prompt_tokens(&kv.prompts, body.as_bytes(), &fields).unwrap();
        tok_t.push(t.elapsed());
        let t = Instant::now();
        let hashes = block_hashes(&toks.ids, bs, 0);
        hash_t.push(t.elapsed());
        let t = Instant::now();
        let _ = kv.overlaps(&hashes, Instant::now());
        query_t.push(t.elapsed());
    }
    // The decision without tokenising (what the event loop spends when a long prompt is
    // tokenised on the blocking pool).
    let mut score_t = Vec::new();
    let toks = kv.prompts.hashed(tokens.clone());
    for _ in 0..iters {
        let fields = RoutingFields::from_json(body.as_bytes()).unwrap();
        let t = Instant::now();
        let _ = routing::plan(
            &kv,
            pool,
            None,
            &Default::default(),
            &Default::default(),
            None,
            &fields,
            &toks,
            Instant::now(),
            false,
        )
        .unwrap();
        score_t.push(t.elapsed());
    }
    println!(
        "tokenizer={} prompt_tokens={} workers=16 indexed_blocks={} chosen={chosen}",
        if tokenizer.is_fallback() {
            "fallback"
        } else {
            "hf"
        },
        tokens.len(),
        kv.index_size().0
    );
    for (name, v) in [
        ("decision (total)", &mut plan_t),
        ("  tokenise", &mut tok_t),
        ("  hash", &mut hash_t),
        ("  index query", &mut query_t),
        ("  hash+query+score", &mut score_t),
    ] {
        println!(
            "{name:<18} p50={:>9.1?} p99={:>9.1?}",
            pct(v, 0.5),
            pct(v, 0.99)
        );
    }
}
