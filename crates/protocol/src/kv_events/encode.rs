//! Encoding: the batch written straight out as msgpack, field by field; the
//! [`rmpv::ValueRef`] tree it was written through before is kept for the tests, which hold the
//! two to the same bytes.

use rmpv::ValueRef;

use super::{BlockHashValue, KvEvent, KvEventBatch};

/// How [`encode_batch`] lays out events. The batch itself is always the array
/// `[ts, [event, ...], data_parallel_rank]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// Events as maps tagged with `"type"`, as vLLM 0.32 sends them. A `BlockStored` carries
    /// `block_hashes`, `parent_block_hash`, `token_ids`, `block_size`, `lora_id`, `medium`,
    /// `lora_name`, and `extra_keys` only when it has some; a `BlockRemoved` carries
    /// `block_hashes` and `medium`.
    Map,
    /// Events as positional arrays, tag first, every field present (nil when unset), as older
    /// vLLM versions and SGLang send them.
    Array,
}

/// Encodes `batch` as a msgpack payload, the third frame of a message.
///
/// Block hashes are written as msgpack unsigned ints ([`BlockHashValue::U64`]) or bins
/// ([`BlockHashValue::Bytes`]); `ts` as a float64. [`decode_batch`](super::decode_batch)
/// reads the result back to an equal batch. Written straight out, field by field, in the
/// shortest forms, byte for byte what writing the batch's [`rmpv::ValueRef`] tree gives (a
/// test holds the two to it); only `extra_keys` values go through the tree writer.
pub fn encode_batch(batch: &KvEventBatch, encoding: Encoding) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + 16 * batch.events.len());
    rmp::encode::write_array_len(&mut out, 3).expect(VEC_WRITE);
    rmp::encode::write_f64(&mut out, batch.ts).expect(VEC_WRITE);
    rmp::encode::write_array_len(&mut out, batch.events.len() as u32).expect(VEC_WRITE);
    for event in &batch.events {
        write_event(&mut out, event, encoding);
    }
    match batch.dp_rank {
        Some(rank) => write_uint(&mut out, rank.into()),
        None => write_nil(&mut out),
    }
    out
}

/// One event: its tag, then its fields in wire order (named in the map form).
fn write_event(out: &mut Vec<u8>, event: &KvEvent, encoding: Encoding) {
    let (kind, len) = match event {
        KvEvent::BlockStored(stored) => {
            let extra = stored.extra_keys.is_some() || encoding == Encoding::Array;
            ("BlockStored", 8 + u32::from(extra))
        }
        KvEvent::BlockRemoved(_) => ("BlockRemoved", 3),
        KvEvent::AllBlocksCleared => ("AllBlocksCleared", 1),
    };
    let field = |out: &mut Vec<u8>, name: &str| {
        if encoding == Encoding::Map {
            write_str(out, name);
        }
    };
    match encoding {
        Encoding::Map => rmp::encode::write_map_len(out, len),
        Encoding::Array => rmp::encode::write_array_len(out, len),
    }
    .expect(VEC_WRITE);
    field(out, "type");
    write_str(out, kind);
    match event {
        KvEvent::BlockStored(stored) => {
            field(out, "block_hashes");
            write_hashes(out, &stored.block_hashes);
            field(out, "parent_block_hash");
            match &stored.parent_block_hash {
                Some(parent) => write_hash(out, parent),
                None => write_nil(out),
            }
            field(out, "token_ids");
            rmp::encode::write_array_len(out, stored.token_ids.len() as u32).expect(VEC_WRITE);
            for &token in &stored.token_ids {
                write_uint(out, token.into());
            }
            field(out, "block_size");
            write_uint(out, stored.block_size.into());
            field(out, "lora_id");
            match stored.lora_id {
                Some(id) if id >= 0 => write_uint(out, id as u64),
                Some(id) => {
                    rmp::encode::write_sint(out, id).expect(VEC_WRITE);
                }
                None => write_nil(out),
            }
            field(out, "medium");
            write_optional_str(out, stored.medium.as_deref());
            field(out, "lora_name");
            write_optional_str(out, stored.lora_name.as_deref());
            match &stored.extra_keys {
                Some(keys) => {
                    field(out, "extra_keys");
                    rmp::encode::write_array_len(out, keys.len() as u32).expect(VEC_WRITE);
                    for key in keys {
                        match key {
                            Some(value) => write_value(out, &value.as_ref()),
                            None => write_nil(out),
                        }
                    }
                }
                None if encoding == Encoding::Array => write_nil(out),
                None => {}
            }
        }
        KvEvent::BlockRemoved(removed) => {
            field(out, "block_hashes");
            write_hashes(out, &removed.block_hashes);
            field(out, "medium");
            write_optional_str(out, removed.medium.as_deref());
        }
        KvEvent::AllBlocksCleared => {}
    }
}

fn write_hashes(out: &mut Vec<u8>, hashes: &[BlockHashValue]) {
    rmp::encode::write_array_len(out, hashes.len() as u32).expect(VEC_WRITE);
    for hash in hashes {
        write_hash(out, hash);
    }
}

fn write_hash(out: &mut Vec<u8>, hash: &BlockHashValue) {
    match hash {
        BlockHashValue::U64(hash) => write_uint(out, *hash),
        BlockHashValue::Bytes(bytes) => {
            rmp::encode::write_bin(out, bytes).expect(VEC_WRITE);
        }
    }
}

fn write_uint(out: &mut Vec<u8>, n: u64) {
    rmp::encode::write_uint(out, n).expect(VEC_WRITE);
}

fn write_nil(out: &mut Vec<u8>) {
    rmp::encode::write_nil(out).expect(VEC_WRITE);
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    rmp::encode::write_str(out, s).expect(VEC_WRITE);
}

fn write_optional_str(out: &mut Vec<u8>, s: Option<&str>) {
    match s {
        Some(s) => write_str(out, s),
        None => write_nil(out),
    }
}

const VEC_WRITE: &str = "writing msgpack into a Vec cannot fail";

/// Writes `value` as msgpack, as [`rmpv::encode::write_value_ref`] does except for a str that
/// is not UTF-8: rmpv writes it as a bin, this keeps it a str with the same bytes. Only an
/// `extra_keys` value decoded from the wire can hold one, and re-encoding it must give back
/// what the engine sent.
fn write_value(out: &mut Vec<u8>, value: &ValueRef<'_>) {
    match value {
        ValueRef::String(s) if s.as_str().is_none() => {
            rmp::encode::write_str_len(out, s.as_bytes().len() as u32).expect(VEC_WRITE);
            out.extend_from_slice(s.as_bytes());
        }
        ValueRef::Array(items) => {
            rmp::encode::write_array_len(out, items.len() as u32).expect(VEC_WRITE);
            items.iter().for_each(|item| write_value(out, item));
        }
        ValueRef::Map(entries) => {
            rmp::encode::write_map_len(out, entries.len() as u32).expect(VEC_WRITE);
            for (key, value) in entries {
                write_value(out, key);
                write_value(out, value);
            }
        }
        other => rmpv::encode::write_value_ref(out, other).expect(VEC_WRITE),
    }
}

/// The batch as a [`rmpv::ValueRef`] tree, written out: how [`encode_batch`] wrote it before it
/// wrote the batch straight out, kept as the yardstick of its tests.
#[cfg(test)]
pub(super) mod tree {
    use std::iter;

    use rmpv::ValueRef;

    use super::{write_value, BlockHashValue, Encoding, KvEvent, KvEventBatch};
    use crate::kv_events::BlockStored;

    /// [`encode_batch`] through a [`rmpv::ValueRef`] tree of the batch, as it was written before:
    /// the yardstick of its tests.
    pub(in crate::kv_events) fn encode_batch_via_tree(
        batch: &KvEventBatch,
        encoding: Encoding,
    ) -> Vec<u8> {
        let value = ValueRef::Array(vec![
            ValueRef::F64(batch.ts),
            ValueRef::Array(
                batch
                    .events
                    .iter()
                    .map(|event| event_value(event, encoding))
                    .collect(),
            ),
            batch.dp_rank.map_or(ValueRef::Nil, ValueRef::from),
        ]);
        let mut payload = Vec::new();
        write_value(&mut payload, &value);
        payload
    }

    fn event_value(event: &KvEvent, encoding: Encoding) -> ValueRef<'_> {
        let (kind, fields) = match event {
            KvEvent::BlockStored(stored) => ("BlockStored", block_stored_fields(stored, encoding)),
            KvEvent::BlockRemoved(removed) => (
                "BlockRemoved",
                vec![
                    ("block_hashes", hashes(&removed.block_hashes)),
                    ("medium", optional_str(removed.medium.as_deref())),
                ],
            ),
            KvEvent::AllBlocksCleared => ("AllBlocksCleared", Vec::new()),
        };
        match encoding {
            Encoding::Map => ValueRef::Map(
                iter::once(("type", ValueRef::from(kind)))
                    .chain(fields)
                    .map(|(name, value)| (ValueRef::from(name), value))
                    .collect(),
            ),
            Encoding::Array => ValueRef::Array(
                iter::once(ValueRef::from(kind))
                    .chain(fields.into_iter().map(|(_, value)| value))
                    .collect(),
            ),
        }
    }

    /// The fields in wire order, named for the map form.
    fn block_stored_fields(
        stored: &BlockStored,
        encoding: Encoding,
    ) -> Vec<(&'static str, ValueRef<'_>)> {
        let mut fields = vec![
            ("block_hashes", hashes(&stored.block_hashes)),
            (
                "parent_block_hash",
                stored
                    .parent_block_hash
                    .as_ref()
                    .map_or(ValueRef::Nil, hash),
            ),
            (
                "token_ids",
                ValueRef::Array(
                    stored
                        .token_ids
                        .iter()
                        .copied()
                        .map(ValueRef::from)
                        .collect(),
                ),
            ),
            ("block_size", ValueRef::from(stored.block_size)),
            (
                "lora_id",
                stored.lora_id.map_or(ValueRef::Nil, ValueRef::from),
            ),
            ("medium", optional_str(stored.medium.as_deref())),
            ("lora_name", optional_str(stored.lora_name.as_deref())),
        ];
        let extra_keys = stored.extra_keys.as_ref().map(|keys| {
            ValueRef::Array(
                keys.iter()
                    .map(|key| key.as_ref().map_or(ValueRef::Nil, rmpv::Value::as_ref))
                    .collect(),
            )
        });
        match (extra_keys, encoding) {
            (Some(keys), _) => fields.push(("extra_keys", keys)),
            (None, Encoding::Array) => fields.push(("extra_keys", ValueRef::Nil)),
            (None, Encoding::Map) => {}
        }
        fields
    }

    fn hash(hash: &BlockHashValue) -> ValueRef<'_> {
        match hash {
            BlockHashValue::U64(hash) => ValueRef::from(*hash),
            BlockHashValue::Bytes(bytes) => ValueRef::Binary(bytes),
        }
    }

    fn hashes(hashes: &[BlockHashValue]) -> ValueRef<'_> {
        ValueRef::Array(hashes.iter().map(hash).collect())
    }

    fn optional_str(s: Option<&str>) -> ValueRef<'_> {
        s.map_or(ValueRef::Nil, ValueRef::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_are_rmpvs_shortest_forms_at_every_length_boundary() {
        for n in [0, 1, 15, 16, 31, 32, 255, 256, 65_535, 65_536] {
            let text = "x".repeat(n);
            let items = vec![ValueRef::Nil; n];
            let entries = vec![(ValueRef::Nil, ValueRef::Nil); n];
            for value in [
                ValueRef::from(text.as_str()),
                ValueRef::Array(items.clone()),
                ValueRef::Map(entries.clone()),
            ] {
                let mut ours = Vec::new();
                write_value(&mut ours, &value);
                let mut theirs = Vec::new();
                rmpv::encode::write_value_ref(&mut theirs, &value).unwrap();
                assert_eq!(ours, theirs, "length {n}");
            }
        }
    }
}
