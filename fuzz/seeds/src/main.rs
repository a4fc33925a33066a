//! Writes the seed inputs of the fuzz targets: `cargo run --manifest-path fuzz/seeds/Cargo.toml`
//! (from the repository root) fills `fuzz/corpus/<target>/seed-*`.
//!
//! - `kv_events`: batches as vLLM and SGLang publish them, written both by kvroute's own encoder
//!   (`encode_batch`, both layouts) and by hand with rmpv in the layouts the encoder does not
//!   produce (the map batch, the two-element batch of older vLLM, short positional events,
//!   negative and string hashes, vLLM 0.32's extra fields).
//! - `request`: the header lines and JSON bodies of real chat, completion, SGLang, embeddings
//!   and responses requests, with every routing hint.
//! - `config`: the config files of the README and the gateway's tests, in YAML and JSON.
//!
//! Seeds are small on purpose: the fuzzer grows them, `cargo fuzz cmin` keeps what adds
//! coverage.

use std::fs;
use std::path::{Path, PathBuf};

use kvroute_protocol::kv_events::{
    encode_batch, BlockHashValue, BlockRemoved, BlockStored, Encoding, KvEvent, KvEventBatch,
};
use rmpv::Value;

fn main() -> std::io::Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../corpus");
    write_all(&root.join("kv_events"), kv_event_seeds())?;
    write_all(&root.join("request"), request_seeds())?;
    write_all(&root.join("config"), config_seeds())?;
    Ok(())
}

fn write_all(dir: &PathBuf, seeds: Vec<(String, Vec<u8>)>) -> std::io::Result<()> {
    fs::create_dir_all(dir)?;
    for (name, bytes) in &seeds {
        fs::write(dir.join(format!("seed-{name}")), bytes)?;
    }
    println!("{}: {} seeds", dir.display(), seeds.len());
    Ok(())
}

// ---- KV events -------------------------------------------------------------------------

const TS: f64 = 1_717_171_717.25;

fn msgpack(value: &Value) -> Vec<u8> {
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, value).expect("writing into a Vec");
    bytes
}

fn map(entries: Vec<(&str, Value)>) -> Value {
    Value::Map(
        entries
            .into_iter()
            .map(|(k, v)| (Value::from(k), v))
            .collect(),
    )
}

fn ints<T: Into<Value> + Copy>(items: &[T]) -> Value {
    Value::Array(items.iter().map(|&i| i.into()).collect())
}

fn tokens(start: u32, n: u32) -> Vec<u32> {
    (start..start + n).collect()
}

fn stored(hashes: &[u64], parent: Option<u64>, token_ids: Vec<u32>, block_size: u32) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.iter().map(|&h| BlockHashValue::U64(h)).collect(),
        parent_block_hash: parent.map(BlockHashValue::U64),
        token_ids,
        block_size,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
        extra_keys: None,
    })
}

fn removed(hashes: &[u64], medium: Option<&str>) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: hashes.iter().map(|&h| BlockHashValue::U64(h)).collect(),
        medium: medium.map(|m| m.to_owned().into()),
    })
}

fn batch(events: Vec<KvEvent>, dp_rank: Option<u32>) -> KvEventBatch {
    KvEventBatch {
        ts: TS,
        events,
        dp_rank,
    }
}

/// Batches built as values, written by kvroute's encoder in both layouts.
fn encoded_batches() -> Vec<(&'static str, KvEventBatch)> {
    let chain = batch(
        vec![
            // A 40-token prompt in 16-token blocks: two full blocks, then a continuation.
            stored(&[0x1111, 0x2222], None, tokens(100, 32), 16),
            stored(&[0x3333], Some(0x2222), tokens(132, 16), 16),
            removed(&[0x3333], Some("GPU")),
        ],
        Some(0),
    );
    let offload = batch(
        vec![
            stored(&[7, 8], None, tokens(1, 32), 16),
            KvEvent::BlockStored(BlockStored {
                medium: Some("CPU".into()),
                ..match stored(&[7, 8], None, tokens(1, 32), 16) {
                    KvEvent::BlockStored(s) => s,
                    _ => unreachable!(),
                }
            }),
            removed(&[7, 8], Some("GPU")),
            removed(&[8], Some("CPU")),
            KvEvent::AllBlocksCleared,
        ],
        Some(1),
    );
    let lora_mm = batch(
        vec![KvEvent::BlockStored(BlockStored {
            block_hashes: vec![BlockHashValue::U64(u64::MAX), BlockHashValue::U64(1 << 63)].into(),
            parent_block_hash: None,
            token_ids: tokens(5000, 32),
            block_size: 16,
            lora_id: Some(3),
            medium: Some("GPU".into()),
            lora_name: Some("sql-adapter".into()),
            extra_keys: Some(vec![
                Some(Value::Array(vec![
                    Value::from("9f2c4e1a7b"),
                    Value::from(0),
                ])),
                None,
            ]),
        })],
        None,
    );
    let bytes_hashes = batch(
        vec![
            KvEvent::BlockStored(BlockStored {
                block_hashes: vec![BlockHashValue::Bytes(vec![0xAB; 32])].into(),
                parent_block_hash: Some(BlockHashValue::Bytes(vec![0xCD; 32])),
                token_ids: tokens(0, 16),
                block_size: 16,
                lora_id: None,
                medium: Some("DISK".into()),
                lora_name: None,
                extra_keys: None,
            }),
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![BlockHashValue::Bytes(vec![0xAB; 32])].into(),
                medium: Some("LMCache".into()),
            }),
        ],
        Some(2),
    );
    // Re-blocking: 64-token engine blocks (4 router blocks each), and SGLang's 1-token pages.
    let big_blocks = batch(
        vec![
            stored(&[64], None, tokens(10, 64), 64),
            stored(&[65], Some(64), tokens(74, 64), 64),
            removed(&[64], None),
        ],
        Some(0),
    );
    let pages = batch(
        (0..20u32)
            .map(|i| {
                stored(
                    &[900 + u64::from(i)],
                    i.checked_sub(1).map(|p| 900 + u64::from(p)),
                    vec![40 + i],
                    1,
                )
            })
            .collect(),
        None,
    );
    let mismatch = batch(vec![stored(&[5], None, tokens(0, 10), 5)], Some(0));
    let long = batch(
        vec![stored(
            &(0..64).map(|i| 0xABC000 + i).collect::<Vec<u64>>(),
            None,
            tokens(300, 64 * 16),
            16,
        )],
        Some(0),
    );
    vec![
        ("chain", chain),
        ("offload", offload),
        ("lora-multimodal", lora_mm),
        ("bytes-hashes", bytes_hashes),
        ("block-64", big_blocks),
        ("pages-1", pages),
        ("block-5", mismatch),
        ("long-prompt", long),
        ("empty", batch(Vec::new(), Some(0))),
    ]
}

fn kv_event_seeds() -> Vec<(String, Vec<u8>)> {
    let mut seeds = Vec::new();
    for (name, batch) in encoded_batches() {
        seeds.push((
            format!("{name}-map.msgpack"),
            encode_batch(&batch, Encoding::Map),
        ));
        seeds.push((
            format!("{name}-array.msgpack"),
            encode_batch(&batch, Encoding::Array),
        ));
    }
    let toks: Vec<u32> = tokens(100, 32);
    // vLLM 0.32: tagged maps with fields this crate ignores.
    seeds.push((
        "vllm-032.msgpack".into(),
        msgpack(&Value::Array(vec![
            Value::from(TS),
            Value::Array(vec![
                map(vec![
                    ("type", "BlockStored".into()),
                    ("block_hashes", ints(&[123u64, 456])),
                    ("parent_block_hash", Value::Nil),
                    ("token_ids", ints(&toks)),
                    ("block_size", 16.into()),
                    ("lora_id", Value::Nil),
                    ("medium", "GPU".into()),
                    ("lora_name", Value::Nil),
                    ("extra_keys", Value::Array(vec![Value::Nil, Value::Nil])),
                    ("group_idx", 0.into()),
                    ("kv_cache_spec_kind", "full_attention".into()),
                    ("kv_cache_spec_sliding_window", Value::Nil),
                ]),
                map(vec![
                    ("type", "BlockRemoved".into()),
                    ("block_hashes", ints(&[456u64])),
                    ("medium", "GPU".into()),
                    ("group_idx", 0.into()),
                ]),
                map(vec![("type", "AllBlocksCleared".into())]),
            ]),
            Value::from(0),
        ])),
    ));
    // Older vLLM: a two-element batch, short positional events, negative (signed) hashes.
    seeds.push((
        "vllm-old-positional.msgpack".into(),
        msgpack(&Value::Array(vec![
            Value::from(1_717_000_000),
            Value::Array(vec![
                Value::Array(vec![
                    "BlockStored".into(),
                    ints(&[-5i64, 77]),
                    Value::Nil,
                    ints(&toks),
                    16.into(),
                    Value::Nil,
                ]),
                Value::Array(vec!["BlockRemoved".into(), ints(&[-5i64])]),
                Value::Array(vec!["AllBlocksCleared".into()]),
            ]),
        ])),
    ));
    // A map batch (newer publishers), string hashes, a float32 ts.
    seeds.push((
        "map-batch.msgpack".into(),
        msgpack(&map(vec![
            ("ts", Value::F32(1.5)),
            (
                "events",
                Value::Array(vec![map(vec![
                    ("type", "BlockStored".into()),
                    (
                        "block_hashes",
                        Value::Array(vec!["0123456789abcdef0123456789abcdef".into()]),
                    ),
                    ("token_ids", ints(&tokens(7, 16))),
                    ("block_size", 16.into()),
                    ("medium", "CPU_PINNED".into()),
                ])]),
            ),
            ("data_parallel_rank", 3.into()),
        ])),
    ));
    seeds
}

// ---- Requests ----------------------------------------------------------------------------

fn request_seeds() -> Vec<(String, Vec<u8>)> {
    let system = r#"{"role":"system","content":"You are a helpful assistant. Answer briefly and cite sources."}"#;
    let chat = |extra: &str| {
        format!(
            r#"{{"model":"m","messages":[{system},{{"role":"user","content":"What is KV caching?"}}]{extra}}}"#
        )
    };
    let seeds: Vec<(&str, String)> = vec![
        ("chat", format!("\n\n{}", chat(r#","stream":true,"max_tokens":64"#))),
        (
            "chat-parts",
            r#"content-type: application/json

{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"Describe"},{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}},{"type":"text","text":"briefly"}]}],"max_completion_tokens":32,"stream":null}"#
                .to_owned(),
        ),
        (
            "chat-tools",
            r#"x-session-id: s-a
x-fuzz-affinity: hard

{"model":"m","messages":[{"role":"user","content":"weather in Paris?"},{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}}]},{"role":"tool","tool_call_id":"call_1","content":"18C"}],"tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}],"add_generation_prompt":true,"chat_template_kwargs":{"enable_thinking":false}}"#
                .to_owned(),
        ),
        (
            "chat-continue",
            format!("x-fuzz-policy: cache_aware\n\n{}", chat(r#","add_generation_prompt":false,"continue_final_message":true"#)),
        ),
        (
            "completion",
            "x-kvroute-worker: a\nx-kvroute-dp-rank: 1\n\n{\"model\":\"m\",\"prompt\":\"You are a helpful assistant. Answer briefly and cite sources. Then\",\"max_tokens\":16}".to_owned(),
        ),
        (
            "completion-texts",
            "x-fuzz-policy: prefix_hash\n\n{\"prompt\":[\"a\\u00e9\\ud83d\\ude00\",\"b\\\"c\"],\"user\":\"u-1\"}".to_owned(),
        ),
        (
            "completion-tokens",
            "x-kvroute-allowed-workers: a, b\nx-kvroute-required-taints: gpu\n\n{\"model\":\"m\",\"prompt\":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}".to_owned(),
        ),
        (
            "completion-batches",
            "x-fuzz-policy: consistent_hash\nx-smg-routing-key: k\n\n{\"prompt\":[[1,2],[3]],\"model\":\"m\"}".to_owned(),
        ),
        (
            "generate-text",
            "x-kvroute-preferred-taints: zone-a=0.5, gpu\n\n{\"text\":\"hello there, router\",\"sampling_params\":{\"max_new_tokens\":8}}".to_owned(),
        ),
        (
            "generate-ids",
            "x-fuzz-policy: llm_d\nx-user-id: 42\n\n{\"input_ids\":[0,337,472,261,71,14,361],\"stream\":false}".to_owned(),
        ),
        (
            "embeddings",
            "x-fuzz-policy: rendezvous_hash\n\n{\"model\":\"m\",\"input\":[\"one\",\"two\"]}".to_owned(),
        ),
        (
            "responses",
            "x-fuzz-policy: manual\nx-session-id: s-b\nx-fuzz-affinity: soft\n\n{\"model\":\"m\",\"input\":\"hi\"}".to_owned(),
        ),
        (
            "other-model",
            "x-kvroute-worker: c\nx-kvroute-dp-rank: 5\nx-kvroute-class: interactive\n\n{\"model\":\"other\",\"prompt\":\"x\"}".to_owned(),
        ),
        (
            "bad-hints",
            "x-kvroute-dp-rank: one\nx-kvroute-allowed-workers: a,,b\nx-kvroute-preferred-taints: gpu=-1\n\n{\"model\":\"m\",\"prompt\":\"x\"}".to_owned(),
        ),
        (
            "pin-unknown",
            "x-session-id: s-gone\nx-fuzz-affinity: hard\nx-fuzz-policy: power_of_two\n\n{\"model\":\"m\",\"prompt\":\"x\"}".to_owned(),
        ),
        ("unknown-model", "\n\n{\"model\":\"nope\",\"prompt\":\"x\"}".to_owned()),
        ("no-model", "x-fuzz-policy: round_robin\n\n{\"prompt\":\"x\"}".to_owned()),
        ("not-json", "\n\n{\"model\":".to_owned()),
    ];
    seeds
        .into_iter()
        .map(|(n, s)| (n.to_owned(), s.into_bytes()))
        .collect()
}

// ---- Config files --------------------------------------------------------------------------

fn config_seeds() -> Vec<(String, Vec<u8>)> {
    let seeds: Vec<(&str, &str)> = vec![
        (
            "readme.yaml",
            "policy: consistent_hash
port: 30000
workers:
  - id: gpu-0                 # defaults to the url
    url: http://10.0.0.1:8000
    model: llama-3-8b         # else read from the worker's GET /v1/models
    kv_events: tcp://10.0.0.1:5557   # vLLM --kv-events-config endpoint (the engine binds)
    kv_events_replay: tcp://10.0.0.1:5558   # optional
    dp_size: 4                # ranks [dp_start_rank, dp_start_rank + dp_size); rank r publishes on port + r
    dp_start_rank: 0
  - url: http://10.0.0.2:8000
",
        ),
        (
            "queue.yaml",
            "router_queue_threshold: 1.0
router_queue_policy: wspt
router_queue_timeout_secs: 30
policy_classes:
  - {name: default, weight: 1024}
  - {name: interactive, weight: 4096, active_prefill_tokens_threshold: 2048}
  - {name: batch, weight: 1024, max_queued: 1000, active_decode_blocks_threshold: 0.9}
worker_urls: [http://10.0.0.1:8000]
",
        ),
        (
            "tests.json",
            r#"{"policy":"consistent_hash","port":8080,"log_level":"warning","workers":[
    {"id":"a","url":"http://10.0.0.1:8000/","model":"llama"},{"url":"http://10.0.0.2:8000"}]}"#,
        ),
        (
            "workers-flow.yaml",
            "workers: [{url: 'http://a:1', kv_events: 'tcp://a:5557', dp_size: 2, dp_start_rank: 4}]\n",
        ),
        (
            "workers-full.yaml",
            "workers:\n  - {id: a, url: 'http://a:1', model: m, taints: [gpu-h100, zone-a], role: decode, max_num_batched_tokens: 8192, num_gpu_blocks: 16384}\n  - {id: b, url: 'http://b:1/v1/', model: m, role: prefill, kv_events: 'tcp://b:6000', kv_events_replay: 'tcp://b:7000'}\n",
        ),
        (
            "kv-aware.yaml",
            "policy: kv_aware
block_size: 32
router_kv_overlap_score_credit: 1.0
router_prefill_load_scale: 0.5
router_decode_active_request_weight: 0.1
router_temperature: 0.0
router_host_cache_hit_weight: 0.75
router_disk_cache_hit_weight: 0.25
shared_cache_multiplier: 0
router_max_indexed_blocks: 1048576
router_ttl_secs: 120
active_prefill_tokens_threshold: 16384
active_prefill_tokens_threshold_frac: 2.0
active_decode_blocks_threshold: 0.95
session_affinity_ttl_secs: 600
session_affinity_mode: hard
tokenizer: /models/llama-3-8b
",
        ),
        (
            "cache-aware.yaml",
            "policy: cache_aware
cache_threshold: 0.3
balance_abs_threshold: 64
balance_rel_threshold: 1.5
eviction_interval: 120
max_tree_size: 67108864
host: 0.0.0.0
prometheus_host: 127.0.0.1
prometheus_port: 29000
log_level: debug
max_payload_size: 1048576
request_timeout_secs: 600
",
        ),
        (
            "hash-manual.yaml",
            "policy: prefix_hash
prefix_token_count: 256
prefix_hash_load_factor: 1.25
max_idle_secs: 14400
assignment_mode: random
no_router_kv_events: true
metrics_refresh_ms: 50
",
        ),
        (
            "llm-d.json",
            r#"{"policy": "llm_d", "llm_d_prefix_weight": 3, "llm_d_queue_weight": 2, "llm_d_kv_weight": 2,
 "worker_urls": ["http://10.0.0.1:8000", "http://10.0.0.2:8000"], "admin_api_key": "secret"}"#,
        ),
        (
            "resilience.yaml",
            "health_check_interval_secs: 10
health_check_timeout_secs: 2
health_failure_threshold: 3
health_success_threshold: 2
health_check_endpoint: /health
retry_max_retries: 3
retry_initial_backoff_ms: 50
retry_max_backoff_ms: 30000
retry_backoff_multiplier: 1.5
retry_jitter_factor: 0.2
cb_failure_threshold: 10
cb_success_threshold: 3
cb_timeout_duration_secs: 60
max_concurrent_requests: 256
shutdown_grace_period_secs: 180
header_read_timeout_secs: 30
client_api_key: k1
api_key: k2
worker_urls: [http://w:8000]
",
        ),
        ("empty.yaml", ""),
        ("comment.yaml", "# nothing here\n"),
        (
            "anchors.yaml",
            "host: &h 0.0.0.0\nprometheus_host: *h\nworkers:\n  - {id: a, url: &u 'http://a:1'}\nworker_urls: [*u]\n",
        ),
        // Merge keys are YAML 1.1; serde_yaml_ng leaves `<<` as a key, which is refused.
        (
            "merge-key.yaml",
            "workers:\n  - &w {url: 'http://a:1', model: m, dp_size: 2}\n  - {<<: *w, id: second}\n",
        ),
    ];
    seeds
        .into_iter()
        .map(|(n, s)| (n.to_owned(), s.as_bytes().to_vec()))
        .collect()
}
