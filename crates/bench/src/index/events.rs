//! The replay file: JSON lines `{"worker": ID, "dp_rank": R, "events": [...]}`, each `events`
//! holding vLLM's KV events as `kvroute_protocol::kv_events` decodes them (positional arrays,
//! `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
//! lora_name]`, `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`, or the tagged
//! maps). Each line is turned into a msgpack batch and decoded by the router's own decoder,
//! then into the index's operations ([`Op`]), so that the replay times the index alone.

use std::collections::HashMap;
use std::io::{BufRead, Write};

use anyhow::Context;
use kvroute_index::{EngineHash, ReplicaId, StoredBlocks};
use kvroute_protocol::kv_events::{decode_batch, KvEvent};
use serde_json::{json, Value};

pub use kvroute_index::sharded::{Op, Stored};

/// A replay file, read: the operations in order and the replicas by (worker, dp_rank).
#[derive(Debug, Default)]
pub struct Replay {
    pub ops: Vec<Op>,
    /// Each line's operations (`ops[range]`, one replica's): a batch, as the router applies
    /// one message of an engine's events.
    pub lines: Vec<std::ops::Range<usize>>,
    /// `replicas[i]` is `ReplicaId(i)`'s (worker, dp_rank).
    pub replicas: Vec<(u64, u32)>,
    pub block_events: usize,
}

/// Reads a replay file.
pub fn read(input: impl BufRead) -> anyhow::Result<Replay> {
    let mut replay = Replay::default();
    let mut ids: HashMap<(u64, u32), ReplicaId> = HashMap::new();
    for (number, line) in input.lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let value: Value =
            serde_json::from_str(&line).with_context(|| format!("line {}", number + 1))?;
        let worker = value["worker"].as_u64().context("worker")?;
        let dp_rank = value["dp_rank"].as_u64().unwrap_or(0) as u32;
        let next = ReplicaId(ids.len() as u32);
        let replica = *ids.entry((worker, dp_rank)).or_insert(next);
        if replica == next {
            replay.replicas.push((worker, dp_rank));
        }
        let batch = decode(&value["events"]).with_context(|| format!("line {}", number + 1))?;
        let first = replay.ops.len();
        for event in batch {
            let op = to_op(replica, event);
            replay.block_events += op.blocks();
            replay.ops.push(op);
        }
        if replay.ops.len() > first {
            replay.lines.push(first..replay.ops.len());
        }
    }
    Ok(replay)
}

/// The events of one line, through the router's msgpack decoder.
fn decode(events: &Value) -> anyhow::Result<Vec<KvEvent>> {
    let batch = rmpv::Value::Array(vec![rmpv::Value::F64(0.0), to_msgpack(events)]);
    let mut payload = Vec::new();
    rmpv::encode::write_value(&mut payload, &batch)?;
    Ok(decode_batch(&payload)?.events)
}

fn to_msgpack(value: &Value) -> rmpv::Value {
    match value {
        Value::Null => rmpv::Value::Nil,
        Value::Bool(b) => rmpv::Value::Boolean(*b),
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => rmpv::Value::from(u),
            (None, Some(i)) => rmpv::Value::from(i),
            _ => rmpv::Value::F64(n.as_f64().unwrap_or(0.0)),
        },
        Value::String(s) => rmpv::Value::from(s.as_str()),
        Value::Array(items) => rmpv::Value::Array(items.iter().map(to_msgpack).collect()),
        Value::Object(map) => rmpv::Value::Map(
            map.iter()
                .map(|(k, v)| (rmpv::Value::from(k.as_str()), to_msgpack(v)))
                .collect(),
        ),
    }
}

fn to_op(replica: ReplicaId, event: KvEvent) -> Op {
    match event {
        KvEvent::BlockStored(stored) => {
            let mut hashes = Vec::new();
            let event = StoredBlocks::from_event(&stored, &mut hashes);
            let (parent, block_size, tier, salt) =
                (event.parent, event.block_size, event.tier, event.salt);
            Op::Stored(Stored {
                replica,
                parent,
                hashes,
                tokens: stored.token_ids,
                block_size,
                tier,
                salt,
            })
        }
        KvEvent::BlockRemoved(removed) => Op::Removed {
            replica,
            tier: removed.tier(),
            hashes: EngineHash::all(&removed.block_hashes),
        },
        KvEvent::AllBlocksCleared => Op::Cleared(replica),
    }
}

/// Writes one line: `worker`'s events (rank 0), positional as older vLLM sends them.
pub fn write_line(out: &mut impl Write, worker: u64, events: &[Value]) -> anyhow::Result<()> {
    serde_json::to_writer(
        &mut *out,
        &json!({"worker": worker, "dp_rank": 0, "events": events}),
    )?;
    out.write_all(b"\n")?;
    Ok(())
}

/// A positional `BlockStored` of 16-token blocks on the device.
pub fn stored_event(parent: Option<EngineHash>, hashes: &[EngineHash], tokens: &[u32]) -> Value {
    json!([
        "BlockStored",
        hashes.iter().map(|h| h.0).collect::<Vec<_>>(),
        parent.map(|h| h.0),
        tokens,
        tokens.len() / hashes.len().max(1),
        null,
        null
    ])
}

/// A positional `BlockRemoved` from the device.
pub fn removed_event(hashes: &[EngineHash]) -> Value {
    json!([
        "BlockRemoved",
        hashes.iter().map(|h| h.0).collect::<Vec<_>>(),
        null
    ])
}
