//! Encoding: the batch is laid out as an [`rmpv::ValueRef`] tree that borrows from it, then
//! written out in one pass.

use std::iter;

use rmpv::ValueRef;

use super::{BlockHashValue, BlockStored, KvEvent, KvEventBatch};

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
/// reads the result back to an equal batch.
pub fn encode_batch(batch: &KvEventBatch, encoding: Encoding) -> Vec<u8> {
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

/// Writes `value` as msgpack, as [`rmpv::encode::write_value_ref`] does except for a str that
/// is not UTF-8: rmpv writes it as a bin, this keeps it a str with the same bytes. Only an
/// `extra_keys` value decoded from the wire can hold one, and re-encoding it must give back
/// what the engine sent.
fn write_value(out: &mut Vec<u8>, value: &ValueRef<'_>) {
    match value {
        ValueRef::String(s) if s.as_str().is_none() => {
            write_header(out, Header::Str, s.as_bytes().len());
            out.extend_from_slice(s.as_bytes());
        }
        ValueRef::Array(items) => {
            write_header(out, Header::Array, items.len());
            items.iter().for_each(|item| write_value(out, item));
        }
        ValueRef::Map(entries) => {
            write_header(out, Header::Map, entries.len());
            for (key, value) in entries {
                write_value(out, key);
                write_value(out, value);
            }
        }
        other => rmpv::encode::write_value_ref(out, other)
            .expect("writing msgpack into a Vec cannot fail"),
    }
}

#[derive(Clone, Copy)]
enum Header {
    Str,
    Array,
    Map,
}

/// The header of a str (`len` bytes), an array or a map (`len` elements), in its shortest
/// form, as rmpv writes it.
fn write_header(out: &mut Vec<u8>, header: Header, len: usize) {
    // (fix marker, longest fix length, 8-bit marker, 16-bit marker, 32-bit marker)
    let (fix, fix_max, len8, len16, len32) = match header {
        Header::Str => (0xa0, 31, Some(0xd9), 0xda, 0xdb),
        Header::Array => (0x90, 15, None, 0xdc, 0xdd),
        Header::Map => (0x80, 15, None, 0xde, 0xdf),
    };
    match (len, len8) {
        (n, _) if n <= fix_max => out.push(fix | n as u8),
        (n, Some(marker)) if n <= 0xff => out.extend([marker, n as u8]),
        (n, _) if n <= 0xffff => {
            out.push(len16);
            out.extend((n as u16).to_be_bytes());
        }
        (n, _) => {
            out.push(len32);
            out.extend((n as u32).to_be_bytes());
        }
    }
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
