//! Round trips through both encodings, hand-built payloads in every variant vLLM sends
//! (built with rmpv, independent of the encoder), error messages, and a seeded no-panic sweep
//! over truncated and corrupted payloads.

use rmpv::Value;
use smallvec::smallvec;

use super::*;
use crate::stable_hash;

/// Writes a hand-built value as msgpack.
fn msgpack(value: &Value) -> Vec<u8> {
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, value).unwrap();
    bytes
}

fn map(entries: Vec<(&str, Value)>) -> Value {
    Value::Map(
        entries
            .into_iter()
            .map(|(key, value)| (Value::from(key), value))
            .collect(),
    )
}

fn ints<T: Into<Value> + Copy>(items: &[T]) -> Value {
    Value::Array(items.iter().map(|&i| i.into()).collect())
}

fn hash32(fill: u8) -> Vec<u8> {
    vec![fill; 32]
}

fn sample_batch() -> KvEventBatch {
    KvEventBatch {
        ts: 1_717_171_717.25,
        events: vec![
            KvEvent::BlockStored(BlockStored {
                block_hashes: smallvec![BlockHashValue::U64(1), BlockHashValue::U64(u64::MAX)],
                parent_block_hash: Some(BlockHashValue::U64(42)),
                token_ids: (0..8).chain([u32::MAX]).collect(),
                block_size: 4,
                lora_id: Some(-5),
                medium: Some("GPU".into()),
                lora_name: Some("adapter".into()),
                extra_keys: Some(vec![
                    None,
                    Some(Value::Array(vec![
                        Value::from("mm-hash"),
                        Value::from(3),
                        Value::Array(vec![Value::Nil, Value::from("salt")]),
                    ])),
                ]),
            }),
            KvEvent::BlockStored(BlockStored {
                block_hashes: smallvec![BlockHashValue::Bytes(hash32(0xAB))],
                parent_block_hash: Some(BlockHashValue::Bytes(hash32(0xCD))),
                token_ids: vec![1, 2, 3, 4],
                block_size: 4,
                lora_id: None,
                medium: None,
                lora_name: None,
                extra_keys: None,
            }),
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: smallvec![
                    BlockHashValue::U64(1),
                    BlockHashValue::Bytes(hash32(0xAB))
                ],
                medium: Some("CPU".into()),
            }),
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: smallvec![],
                medium: None,
            }),
            KvEvent::AllBlocksCleared,
        ],
        dp_rank: Some(3),
    }
}

/// A vLLM 0.32 payload: an array batch of tagged-map events, with fields this crate ignores.
fn vllm_032_payload() -> Vec<u8> {
    let tokens: Vec<u32> = (100..164).collect();
    msgpack(&Value::Array(vec![
        Value::from(1_717_000_000.5),
        Value::Array(vec![
            map(vec![
                ("type", "BlockStored".into()),
                ("block_hashes", ints(&[123u64, 456])),
                ("parent_block_hash", Value::Nil),
                ("token_ids", ints(&tokens)),
                ("block_size", 32.into()),
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
                ("block_hashes", ints(&[123u64])),
                ("medium", "GPU".into()),
                ("group_idx", 0.into()),
            ]),
            map(vec![("type", "AllBlocksCleared".into())]),
        ]),
        Value::from(0),
    ]))
}

#[test]
fn every_event_kind_round_trips_in_both_encodings() {
    for encoding in [Encoding::Map, Encoding::Array] {
        let batch = sample_batch();
        assert_eq!(
            decode_batch(&encode_batch(&batch, encoding)).unwrap(),
            batch
        );

        let batch = KvEventBatch {
            dp_rank: None,
            ..sample_batch()
        };
        assert_eq!(
            decode_batch(&encode_batch(&batch, encoding)).unwrap(),
            batch
        );

        let empty = KvEventBatch {
            ts: 0.0,
            events: vec![],
            dp_rank: Some(0),
        };
        assert_eq!(
            decode_batch(&encode_batch(&empty, encoding)).unwrap(),
            empty
        );
    }
}

/// Reads back what the encoder wrote as a generic msgpack value.
#[test]
fn vllms_usual_media_are_read_without_a_copy_and_any_other_name_as_sent() {
    let mut batch = sample_batch();
    let KvEvent::BlockRemoved(removed) = &mut batch.events[3] else {
        unreachable!("the fourth event is a removal");
    };
    removed.medium = Some("LMCACHE_REMOTE".into());
    // No extra keys, so that the direct reader reads the batch (it leaves those to the tree).
    let KvEvent::BlockStored(stored) = &mut batch.events[0] else {
        unreachable!("the first event is a store");
    };
    stored.extra_keys = None;
    let borrowed = |m: &Option<Cow<'static, str>>| matches!(m, Some(Cow::Borrowed(_)));
    for encoding in [Encoding::Array, Encoding::Map] {
        let payload = encode_batch(&batch, encoding);
        for decoded in [decode_batch(&payload), decode_batch_via_tree(&payload)] {
            let decoded = decoded.unwrap();
            assert_eq!(decoded, batch, "{encoding:?}");
            let media: Vec<_> = (decoded.events.iter())
                .filter_map(|e| match e {
                    KvEvent::BlockStored(s) => Some(&s.medium),
                    KvEvent::BlockRemoved(r) => Some(&r.medium),
                    KvEvent::AllBlocksCleared => None,
                })
                .collect();
            // GPU, none, CPU, LMCACHE_REMOTE.
            let kinds: Vec<_> = media.iter().map(|m| (m.is_some(), borrowed(m))).collect();
            assert_eq!(
                kinds,
                [(true, true), (false, false), (true, true), (true, false)]
            );
            assert_eq!(media[3].as_deref(), Some("LMCACHE_REMOTE"));
        }
    }
}

#[test]
fn an_events_one_block_hash_is_read_inline_and_more_are_not() {
    let one = |hashes: BlockHashes| {
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: hashes,
            medium: None,
        })
    };
    let batch = KvEventBatch {
        ts: 1.0,
        events: vec![one(smallvec![7.into()]), one(smallvec![8.into(), 9.into()])],
        dp_rank: None,
    };
    for encoding in [Encoding::Array, Encoding::Map] {
        let payload = encode_batch(&batch, encoding);
        for decoded in [decode_batch(&payload), decode_batch_via_tree(&payload)] {
            let decoded = decoded.unwrap();
            assert_eq!(decoded, batch);
            let spilled: Vec<bool> = (decoded.events.iter())
                .map(|e| match e {
                    KvEvent::BlockRemoved(r) => r.block_hashes.spilled(),
                    _ => unreachable!("removals only"),
                })
                .collect();
            assert_eq!(spilled, [false, true], "{encoding:?}");
        }
    }
}

fn encoded_events(batch: &KvEventBatch, encoding: Encoding) -> Vec<Value> {
    let bytes = encode_batch(batch, encoding);
    let value = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
    let Value::Array(items) = value else {
        panic!("batch is not an array: {value}")
    };
    assert_eq!(items.len(), 3, "batch is [ts, events, dp_rank]");
    assert_eq!(items[0], Value::F64(batch.ts));
    assert_eq!(items[2], batch.dp_rank.map_or(Value::Nil, Value::from));
    let Value::Array(events) = items[1].clone() else {
        panic!("events are not an array")
    };
    events
}

#[test]
fn map_encoding_writes_tagged_maps_as_vllm_032_does() {
    let keys = |event: &Value| -> Vec<String> {
        let Value::Map(entries) = event else {
            panic!("event is not a map: {event}")
        };
        entries
            .iter()
            .map(|(k, _)| k.as_str().unwrap().to_owned())
            .collect()
    };
    let events = encoded_events(&sample_batch(), Encoding::Map);
    let stored = [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ];
    assert_eq!(keys(&events[0]), [&stored[..], &["extra_keys"]].concat());
    assert_eq!(keys(&events[1]), stored, "extra_keys is left out when None");
    assert_eq!(keys(&events[2]), ["type", "block_hashes", "medium"]);
    assert_eq!(keys(&events[4]), ["type"]);
    assert_eq!(events[0]["type"], Value::from("BlockStored"));
    assert_eq!(events[4]["type"], Value::from("AllBlocksCleared"));
    // U64 hashes are unsigned ints, byte hashes bins.
    assert_eq!(events[0]["block_hashes"], ints(&[1u64, u64::MAX]));
    assert_eq!(events[1]["parent_block_hash"], Value::Binary(hash32(0xCD)));
}

#[test]
fn array_encoding_writes_positional_events() {
    let events = encoded_events(&sample_batch(), Encoding::Array);
    let lens: Vec<usize> = events.iter().map(|e| e.as_array().unwrap().len()).collect();
    assert_eq!(lens, [9, 9, 3, 3, 1]);
    assert_eq!(events[0][0], Value::from("BlockStored"));
    assert_eq!(events[0][1], ints(&[1u64, u64::MAX]));
    assert_eq!(events[0][2], Value::from(42));
    assert_eq!(events[0][4], Value::from(4));
    assert_eq!(events[0][5], Value::from(-5));
    assert_eq!(events[0][6], Value::from("GPU"));
    assert_eq!(events[0][7], Value::from("adapter"));
    assert_eq!(events[1][8], Value::Nil, "extra_keys is nil when None");
    assert_eq!(events[2][0], Value::from("BlockRemoved"));
    assert_eq!(events[2][2], Value::from("CPU"));
    assert_eq!(events[4][0], Value::from("AllBlocksCleared"));
}

#[test]
fn golden_bytes_of_a_small_batch() {
    let batch = KvEventBatch {
        ts: 1.0,
        events: vec![KvEvent::AllBlocksCleared],
        dp_rank: None,
    };
    let mut expected = vec![0x93, 0xCB, 0x3F, 0xF0, 0, 0, 0, 0, 0, 0, 0x91, 0x91, 0xB0];
    expected.extend_from_slice(b"AllBlocksCleared");
    expected.push(0xC0);
    assert_eq!(encode_batch(&batch, Encoding::Array), expected);
}

#[test]
fn decodes_vllm_032_map_events_in_an_array_batch() {
    let batch = decode_batch(&vllm_032_payload()).unwrap();
    assert_eq!(batch.ts, 1_717_000_000.5);
    assert_eq!(batch.dp_rank, Some(0));
    assert_eq!(
        batch.events,
        vec![
            KvEvent::BlockStored(BlockStored {
                block_hashes: smallvec![123.into(), 456.into()],
                parent_block_hash: None,
                token_ids: (100..164).collect(),
                block_size: 32,
                lora_id: None,
                medium: Some("GPU".into()),
                lora_name: None,
                extra_keys: Some(vec![None, None]),
            }),
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: smallvec![123.into()],
                medium: Some("GPU".into()),
            }),
            KvEvent::AllBlocksCleared,
        ]
    );
}

#[test]
fn map_events_may_leave_out_defaulted_fields() {
    let payload = msgpack(&Value::Array(vec![
        Value::from(5.0),
        Value::Array(vec![
            map(vec![
                ("type", "BlockStored".into()),
                ("block_hashes", ints(&[1u64])),
                ("token_ids", ints(&[7u32, 8])),
                ("block_size", 2.into()),
            ]),
            map(vec![
                ("type", "BlockRemoved".into()),
                ("block_hashes", ints(&[1u64])),
            ]),
        ]),
    ]));
    let batch = decode_batch(&payload).unwrap();
    let KvEvent::BlockStored(stored) = &batch.events[0] else {
        panic!("not a BlockStored: {:?}", batch.events[0])
    };
    assert_eq!(stored.parent_block_hash, None);
    assert_eq!(stored.extra_keys, None);
    assert_eq!(stored.lora_id, None);
    assert_eq!(stored.tier(), StorageTier::Device);
    let KvEvent::BlockRemoved(removed) = &batch.events[1] else {
        panic!("not a BlockRemoved: {:?}", batch.events[1])
    };
    assert_eq!(removed.medium, None);
}

#[test]
fn decodes_a_map_form_batch() {
    let events = Value::Array(vec![
        map(vec![("type", "AllBlocksCleared".into())]),
        Value::Array(vec!["BlockRemoved".into(), ints(&[9u64]), "DISK".into()]),
    ]);
    let payload = msgpack(&map(vec![
        ("ts", Value::from(2.5)),
        ("events", events.clone()),
        ("data_parallel_rank", Value::from(1)),
        ("some_future_field", Value::from("ignored")),
    ]));
    let batch = decode_batch(&payload).unwrap();
    assert_eq!(batch.ts, 2.5);
    assert_eq!(batch.dp_rank, Some(1));
    assert_eq!(batch.events.len(), 2);
    let KvEvent::BlockRemoved(removed) = &batch.events[1] else {
        panic!("not a BlockRemoved")
    };
    assert_eq!(removed.tier(), StorageTier::Disk);

    // Keys in any order, an int ts, no rank.
    let payload = msgpack(&map(vec![("events", events), ("ts", Value::from(3))]));
    let batch = decode_batch(&payload).unwrap();
    assert_eq!(batch.ts, 3.0);
    assert_eq!(batch.dp_rank, None);
}

#[test]
fn decodes_the_shorter_arrays_of_older_vllm() {
    let payload = msgpack(&Value::Array(vec![
        Value::from(10.0),
        Value::Array(vec![
            // Up to lora_id only: no medium, lora_name, extra_keys.
            Value::Array(vec![
                "BlockStored".into(),
                ints(&[1u64, 2]),
                Value::Nil,
                ints(&[1u32, 2, 3, 4]),
                2.into(),
                Value::Nil,
            ]),
            // No medium.
            Value::Array(vec!["BlockRemoved".into(), ints(&[1u64])]),
        ]),
        // A two-element batch: no data_parallel_rank.
    ]));
    let batch = decode_batch(&payload).unwrap();
    assert_eq!(batch.dp_rank, None);
    assert_eq!(
        batch.events,
        vec![
            KvEvent::BlockStored(BlockStored {
                block_hashes: smallvec![1.into(), 2.into()],
                parent_block_hash: None,
                token_ids: vec![1, 2, 3, 4],
                block_size: 2,
                lora_id: None,
                medium: None,
                lora_name: None,
                extra_keys: None,
            }),
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: smallvec![1.into()],
                medium: None,
            }),
        ]
    );
}

#[test]
fn decodes_32_byte_hashes_as_bin_or_str() {
    let text = "0123456789abcdef0123456789abcdef";
    let value = Value::Array(vec![
        Value::from(1.0),
        Value::Array(vec![Value::Array(vec![
            "BlockStored".into(),
            Value::Array(vec![Value::Binary(hash32(0x11)), Value::from(text)]),
            Value::Binary(hash32(0x22)),
            ints(&[1u32, 2]),
            1.into(),
            Value::Nil,
            "GPU".into(),
        ])]),
    ]);
    let batch = decode_batch(&msgpack(&value)).unwrap();
    let KvEvent::BlockStored(stored) = &batch.events[0] else {
        panic!("not a BlockStored")
    };
    assert_eq!(
        stored.block_hashes[..],
        [
            BlockHashValue::Bytes(hash32(0x11)),
            BlockHashValue::Bytes(text.as_bytes().to_vec())
        ]
    );
    assert_eq!(
        stored.parent_block_hash,
        Some(BlockHashValue::Bytes(hash32(0x22)))
    );
    assert_eq!(stored.block_hashes[0].to_u64(), stable_hash(&hash32(0x11)));
    assert_eq!(
        stored.block_hashes[1].to_u64(),
        stable_hash(text.as_bytes())
    );

    // A str that is not UTF-8 is still a hash: turn the bin8 header of the parent into str8.
    let mut bytes = msgpack(&value);
    let parent = bytes
        .windows(3)
        .position(|w| w == [0xC4, 32, 0x22])
        .unwrap();
    bytes[parent] = 0xD9;
    let mut raw = vec![0xFF; 32];
    raw[0] = 0x80;
    bytes[parent + 2..parent + 34].copy_from_slice(&raw);
    let batch = decode_batch(&bytes).unwrap();
    let KvEvent::BlockStored(stored) = &batch.events[0] else {
        panic!("not a BlockStored")
    };
    assert_eq!(stored.parent_block_hash, Some(BlockHashValue::Bytes(raw)));
}

#[test]
fn negative_int_hashes_are_read_as_their_u64_bits() {
    let payload = msgpack(&Value::Array(vec![
        Value::from(1.0),
        Value::Array(vec![
            Value::Array(vec![
                "BlockStored".into(),
                ints(&[-1i64, i64::MIN, -2]),
                Value::from(-7),
                ints(&[1u32]),
                1.into(),
            ]),
            Value::Array(vec!["BlockRemoved".into(), ints(&[-1i64, 5])]),
        ]),
    ]));
    let batch = decode_batch(&payload).unwrap();
    let KvEvent::BlockStored(stored) = &batch.events[0] else {
        panic!("not a BlockStored")
    };
    assert_eq!(
        stored.block_hashes[..],
        [u64::MAX.into(), (1u64 << 63).into(), (u64::MAX - 1).into()]
    );
    assert_eq!(stored.parent_block_hash, Some((-7i64 as u64).into()));
    let KvEvent::BlockRemoved(removed) = &batch.events[1] else {
        panic!("not a BlockRemoved")
    };
    assert_eq!(removed.block_hashes[..], [u64::MAX.into(), 5.into()]);
}

#[test]
fn unknown_fields_and_trailing_elements_are_ignored() {
    let payload = msgpack(&Value::Array(vec![
        Value::from(1.0),
        Value::Array(vec![
            map(vec![
                ("group_idx", 3.into()),
                ("type", "BlockRemoved".into()),
                ("future", map(vec![("nested", ints(&[1, 2]))])),
                ("block_hashes", ints(&[5u64])),
                ("medium", "CPU_PINNED".into()),
            ]),
            Value::Array(vec![
                "BlockStored".into(),
                ints(&[1u64]),
                Value::Nil,
                ints(&[1u32]),
                1.into(),
                Value::Nil,
                Value::Nil,
                Value::Nil,
                Value::Nil,
                0.into(),
                "full_attention".into(),
                map(vec![]),
            ]),
            Value::Array(vec![
                "BlockRemoved".into(),
                ints(&[5u64]),
                "GPU".into(),
                0.into(),
            ]),
            Value::Array(vec!["AllBlocksCleared".into(), 1.into(), 2.into()]),
        ]),
        Value::from(7),
        Value::from("a future batch field"),
    ]));
    let batch = decode_batch(&payload).unwrap();
    assert_eq!(batch.dp_rank, Some(7));
    assert_eq!(batch.events.len(), 4);
    let KvEvent::BlockRemoved(removed) = &batch.events[0] else {
        panic!("not a BlockRemoved")
    };
    assert_eq!(removed.block_hashes[..], [5.into()]);
    assert_eq!(removed.tier(), StorageTier::Host);
    assert!(matches!(batch.events[1], KvEvent::BlockStored(_)));
    assert_eq!(batch.events[3], KvEvent::AllBlocksCleared);
}

#[test]
fn unknown_event_types_are_rejected_by_name() {
    let payload = msgpack(&Value::Array(vec![
        Value::from(1.0),
        Value::Array(vec![
            Value::Array(vec!["AllBlocksCleared".into()]),
            Value::Array(vec!["BlockEvicted".into(), ints(&[1u64])]),
        ]),
    ]));
    let err = decode_batch(&payload).unwrap_err();
    assert!(
        matches!(&err, KvEventError::UnknownEventType { index: 1, name } if name == "BlockEvicted"),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        r#"KV event 1 has unknown type "BlockEvicted""#
    );

    let payload = msgpack(&Value::Array(vec![
        Value::from(1.0),
        Value::Array(vec![map(vec![("type", "Mystery".into())])]),
    ]));
    let err = decode_batch(&payload).unwrap_err();
    assert_eq!(err.to_string(), r#"KV event 0 has unknown type "Mystery""#);
}

/// A batch of one event, for the error table.
fn one_event(event: Value) -> Vec<u8> {
    msgpack(&Value::Array(vec![
        Value::from(1.0),
        Value::Array(vec![event]),
    ]))
}

fn stored_with(position: usize, value: Value) -> Vec<u8> {
    let mut event = vec![
        "BlockStored".into(),
        ints(&[1u64]),
        Value::Nil,
        ints(&[1u32, 2]),
        2.into(),
        Value::Nil,
        "GPU".into(),
        Value::Nil,
        Value::Nil,
    ];
    event[position] = value;
    one_event(Value::Array(event))
}

#[test]
fn malformed_payloads_say_what_is_wrong() {
    let stored_at = Location::Event {
        index: 0,
        kind: "BlockStored",
    };
    let mut trailing = encode_batch(&sample_batch(), Encoding::Map);
    trailing.push(0xC0);
    let cases: Vec<(Vec<u8>, &str)> =
        vec![
        (vec![], "KV-event payload is not valid msgpack"),
        (vec![0xD9, 0x10, b'a'], "KV-event payload is not valid msgpack"),
        (trailing, "KV-event payload has 1 trailing bytes after the batch"),
        (
            msgpack(&Value::from(5)),
            "KV-event batch must be a msgpack array or map, found an int",
        ),
        (
            msgpack(&Value::Array(vec![Value::from(1.0)])),
            "KV-event batch: missing field `events`",
        ),
        (
            msgpack(&map(vec![("events", Value::Array(vec![]))])),
            "KV-event batch: missing field `ts`",
        ),
        (
            msgpack(&Value::Array(vec![Value::from(1.0), Value::from(5)])),
            "KV-event batch: field `events` must be an array, found an int",
        ),
        (
            msgpack(&Value::Array(vec![Value::from("now"), Value::Array(vec![])])),
            "KV-event batch: field `ts` must be a number, found a string",
        ),
        (
            msgpack(&Value::Array(vec![
                Value::from(1.0),
                Value::Array(vec![]),
                Value::from(-1),
            ])),
            "KV-event batch: field `data_parallel_rank` = -1 is out of range for u32",
        ),
        (
            one_event(Value::from(5)),
            "KV event 0 must be a msgpack array or map, found an int",
        ),
        (one_event(Value::Array(vec![])), "KV event 0 has no type tag"),
        (
            one_event(map(vec![("block_hashes", ints(&[1u64]))])),
            "KV event 0 has no type tag",
        ),
        (
            one_event(Value::Array(vec![Value::from(7)])),
            "KV event 0 has a type tag that is not a string: found an int",
        ),
        (
            one_event(Value::Array(vec!["BlockStored".into(), ints(&[1u64])])),
            "KV event 0 (BlockStored): missing field `token_ids`",
        ),
        (
            one_event(Value::Array(vec!["BlockRemoved".into()])),
            "KV event 0 (BlockRemoved): missing field `block_hashes`",
        ),
        (
            stored_with(1, Value::from(1)),
            "KV event 0 (BlockStored): field `block_hashes` must be an array, found an int",
        ),
        (
            stored_with(1, Value::Array(vec![Value::from(1.5)])),
            "KV event 0 (BlockStored): field `block_hashes` must be an int or a byte string, \
             found a float",
        ),
        (
            stored_with(3, ints(&[1i64, -1])),
            "KV event 0 (BlockStored): token id -1 is out of range for u32",
        ),
        (
            stored_with(3, ints(&[1u64 << 32])),
            "KV event 0 (BlockStored): token id 4294967296 is out of range for u32",
        ),
        (
            stored_with(3, Value::Array(vec![Value::from("a")])),
            "KV event 0 (BlockStored): field `token_ids` must be an array of ints, found a string",
        ),
        (
            stored_with(4, Value::from("32")),
            "KV event 0 (BlockStored): field `block_size` must be an int, found a string",
        ),
        (
            stored_with(4, Value::Nil),
            "KV event 0 (BlockStored): field `block_size` must be an int, found nil",
        ),
        (
            stored_with(4, Value::from(1u64 << 32)),
            "KV event 0 (BlockStored): field `block_size` = 4294967296 is out of range for u32",
        ),
        (
            stored_with(5, Value::from(u64::MAX)),
            "KV event 0 (BlockStored): field `lora_id` = 18446744073709551615 is out of range \
             for i64",
        ),
        (
            stored_with(6, Value::from(1)),
            "KV event 0 (BlockStored): field `medium` must be a string, found an int",
        ),
        (
            stored_with(8, Value::from("x")),
            "KV event 0 (BlockStored): field `extra_keys` must be an array, found a string",
        ),
    ];
    for (payload, message) in cases {
        let err = decode_batch(&payload).expect_err(message);
        assert!(
            err.to_string().starts_with(message),
            "expected {message:?}, got {:?}",
            err.to_string()
        );
    }
    let err = decode_batch(&stored_with(3, ints(&[1i64, -1]))).unwrap_err();
    assert!(matches!(
        err,
        KvEventError::TokenIdOutOfRange { at, value: -1 } if at == stored_at
    ));
}

/// xorshift64: a seeded source of bytes and positions, so the sweep below is reproducible.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// `payload` with 1 to `most` of its bytes set at random.
    fn corrupt(&mut self, payload: &[u8], most: usize) -> Vec<u8> {
        let mut corrupted = payload.to_vec();
        for _ in 0..=self.below(most) {
            let at = self.below(corrupted.len());
            corrupted[at] = self.next() as u8;
        }
        corrupted
    }
}

#[test]
fn truncated_or_corrupted_payloads_never_panic() {
    let payloads = [
        encode_batch(&sample_batch(), Encoding::Map),
        encode_batch(&sample_batch(), Encoding::Array),
        vllm_032_payload(),
    ];
    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
    for payload in &payloads {
        assert!(decode_batch(payload).is_ok());
        // A strict prefix of one msgpack value is never a whole value.
        for len in 0..payload.len() {
            assert!(
                decode_batch(&payload[..len]).is_err(),
                "prefix of {len} bytes"
            );
        }
        for _ in 0..5_000 {
            let corrupted = rng.corrupt(payload, 4);
            let cut = match rng.below(4) {
                0 => rng.below(corrupted.len()),
                _ => corrupted.len(),
            };
            let _ = decode_batch(&corrupted[..cut]);
        }
    }
    for _ in 0..20_000 {
        let noise: Vec<u8> = (0..rng.below(64)).map(|_| rng.next() as u8).collect();
        let _ = decode_batch(&noise);
    }
}

#[test]
fn hostile_lengths_and_nesting_are_errors() {
    // An array claiming 4 billion elements.
    assert!(decode_batch(&[0xDD, 0xFF, 0xFF, 0xFF, 0xFF]).is_err());
    // A bin claiming 4 GiB.
    assert!(decode_batch(&[0x92, 0xC6, 0xFF, 0xFF, 0xFF, 0xFF]).is_err());
    // Deep nesting is cut off before it can exhaust the stack.
    let deep = vec![0x91; 100_000];
    assert!(matches!(decode_batch(&deep), Err(KvEventError::Msgpack(_))));
}

#[test]
fn seq_frames() {
    assert_eq!(encode_seq(0), [0; 8]);
    assert_eq!(encode_seq(0x0102), [0, 0, 0, 0, 0, 0, 1, 2]);
    assert_eq!(decode_seq(&encode_seq(0)).unwrap(), Some(0));
    assert_eq!(
        decode_seq(&encode_seq(u64::MAX - 1)).unwrap(),
        Some(u64::MAX - 1)
    );
    assert_eq!(decode_seq(&END_OF_REPLAY_SEQ).unwrap(), None);
    assert_eq!(END_OF_REPLAY_SEQ, (-1i64).to_be_bytes());
    let err = decode_seq(&[0; 4]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "KV-event seq frame must be 8 bytes, found 4"
    );
    assert!(decode_seq(&[]).is_err());
}

#[test]
fn medium_names_the_tier() {
    let cases = [
        (None, StorageTier::Device),
        (Some("GPU"), StorageTier::Device),
        (Some("CPU"), StorageTier::Host),
        (Some("CPU_PINNED"), StorageTier::Host),
        (Some("DISK"), StorageTier::Disk),
        (Some("LMCACHE"), StorageTier::External),
        (Some("gpu"), StorageTier::External),
        (Some(""), StorageTier::External),
    ];
    for (medium, tier) in cases {
        assert_eq!(StorageTier::from_medium(medium), tier, "{medium:?}");
    }
    assert_eq!(StorageTier::Host.as_str(), "host");
}

#[test]
fn hashes_fold_to_u64_deterministically() {
    assert_eq!(BlockHashValue::U64(7).to_u64(), 7);
    assert_eq!(
        BlockHashValue::Bytes(b"a".to_vec()).to_u64(),
        0xE6C6_32B6_1E96_4E1F
    );
    assert_eq!(
        BlockHashValue::Bytes(hash32(1)).to_u64(),
        BlockHashValue::Bytes(hash32(1)).to_u64()
    );
}

/// Found by fuzzing (`fuzz/corpus/kv_events/regression-extra-keys-str-not-utf8`): a str in
/// `extra_keys` that is not UTF-8 is kept as it came, but re-encoding wrote it as a bin, so the
/// batch did not round-trip. Lengths cover the fix, 8-bit and 16-bit str headers.
#[test]
fn extra_keys_strs_that_are_not_utf8_stay_strs_through_a_round_trip() {
    let placeholders: Vec<String> = [2, 40, 300].iter().map(|&n| "\u{7f}".repeat(n)).collect();
    let keys = Value::Array(
        placeholders
            .iter()
            .map(|p| Value::Array(vec![Value::from(p.as_str()), Value::from(1)]))
            .collect(),
    );
    // Every 0x7F byte becomes 0xFF, which is never UTF-8.
    let payload: Vec<u8> = stored_with(8, keys)
        .into_iter()
        .map(|b| if b == 0x7F { 0xFF } else { b })
        .collect();
    let batch = decode_batch(&payload).unwrap();
    for encoding in [Encoding::Map, Encoding::Array] {
        let bytes = encode_batch(&batch, encoding);
        let again = decode_batch(&bytes).unwrap();
        assert_eq!(again, batch, "{encoding:?}");
        let KvEvent::BlockStored(stored) = &again.events[0] else {
            panic!("{again:?}");
        };
        for (key, n) in stored.extra_keys.as_ref().unwrap().iter().zip([2, 40, 300]) {
            let Some(Value::Array(items)) = key else {
                panic!("{key:?}");
            };
            let Value::String(s) = &items[0] else {
                panic!("not a str: {:?}", items[0]);
            };
            assert!(s.as_str().is_none());
            assert_eq!(s.as_bytes(), vec![0xFF; n]);
        }
        for header in [
            &[0xA2, 0xFF][..],
            &[0xD9, 40, 0xFF],
            &[0xDA, 0x01, 0x2C, 0xFF],
        ] {
            assert!(
                bytes.windows(header.len()).any(|w| w == header),
                "{header:x?}"
            );
        }
    }
}

/// Whether the direct reader answered for `payload`; where it did, the tree read the same.
fn direct_answers_as_the_tree(payload: &[u8]) -> bool {
    let Some(direct) = super::direct::decode(payload) else {
        return false;
    };
    let tree = decode_batch_via_tree(payload).expect("the tree reads it too");
    // `ts` by its bits: a corrupted one may be a NaN.
    assert_eq!(direct.ts.to_bits(), tree.ts.to_bits(), "{payload:x?}");
    assert_eq!(
        (&direct.events, direct.dp_rank),
        (&tree.events, tree.dp_rank)
    );
    true
}

/// The direct reader answers for the batches engines send, in every form the tree reads, and
/// where it answers (over the sweep's truncated and corrupted payloads too), it reads what the
/// tree reads; only a non-nil `extra_keys` entry is left to the tree.
#[test]
fn the_direct_reader_reads_what_the_tree_reads() {
    let mut plain = sample_batch();
    for event in &mut plain.events {
        if let KvEvent::BlockStored(stored) = event {
            stored.extra_keys = stored.extra_keys.take().map(|k| vec![None; k.len()]);
        }
    }
    let answered = [
        encode_batch(&plain, Encoding::Map),
        encode_batch(&plain, Encoding::Array),
        vllm_032_payload(),
        // The shorter arrays of older vLLM, and a map-form batch with unknown keys.
        msgpack(&Value::Array(vec![
            Value::from(1),
            Value::Array(vec![Value::Array(vec![
                "BlockStored".into(),
                ints(&[-7i64, 8]),
                Value::Nil,
                ints(&[1u32, 2, 3, 4]),
                2.into(),
            ])]),
        ])),
        msgpack(&map(vec![
            (
                "zz",
                Value::Array(vec![Value::Map(vec![(1.into(), Value::Nil)])]),
            ),
            ("events", Value::Array(vec![])),
            ("ts", Value::F32(2.5)),
            ("data_parallel_rank", Value::Nil),
            ("ts", "ignored: the first one counts".into()),
        ])),
    ];
    for payload in &answered {
        assert!(direct_answers_as_the_tree(payload), "{payload:x?}");
    }
    assert!(super::direct::decode(&encode_batch(&sample_batch(), Encoding::Array)).is_none());
    let mut rng = XorShift(0x2545_F491_4F6C_DD1D);
    let mut answers = 0;
    for payload in &answered {
        for len in 0..payload.len() {
            assert!(
                !direct_answers_as_the_tree(&payload[..len]),
                "prefix of {len}"
            );
        }
        for _ in 0..5_000 {
            answers += usize::from(direct_answers_as_the_tree(&rng.corrupt(payload, 3)));
        }
    }
    // Many corruptions leave a readable batch (a token changed, a hash), and those it reads.
    assert!(answers > 1_000, "{answers}");
}

/// A batch drawn from `rng`: every event kind, ints at every msgpack width, both hash forms,
/// negative LoRA ids, media and names or none, extra keys or none.
fn random_batch(rng: &mut XorShift) -> KvEventBatch {
    let int = |rng: &mut XorShift| rng.next() >> (rng.below(64) as u32);
    let hash = |rng: &mut XorShift| match rng.below(4) {
        0 => BlockHashValue::Bytes((0..rng.below(40)).map(|_| rng.next() as u8).collect()),
        _ => BlockHashValue::U64(int(rng)),
    };
    let name = |rng: &mut XorShift| {
        [None, Some("GPU"), Some("CPU_tier"), Some(""), Some("é")][rng.below(5)]
            .map(|s| s.to_owned())
    };
    let events = (0..rng.below(6))
        .map(|_| match rng.below(3) {
            0 => KvEvent::BlockStored(BlockStored {
                block_hashes: (0..rng.below(4)).map(|_| hash(rng)).collect(),
                parent_block_hash: (rng.below(2) == 0).then(|| hash(rng)),
                token_ids: (0..rng.below(20)).map(|_| int(rng) as u32).collect(),
                block_size: int(rng) as u32,
                lora_id: (rng.below(2) == 0).then(|| int(rng) as i64),
                medium: name(rng).map(Cow::Owned),
                lora_name: name(rng),
                extra_keys: (rng.below(3) == 0).then(|| {
                    (0..rng.below(3))
                        .map(|_| (rng.below(2) == 0).then(|| Value::from(int(rng))))
                        .collect()
                }),
            }),
            1 => KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: (0..rng.below(4)).map(|_| hash(rng)).collect(),
                medium: name(rng).map(Cow::Owned),
            }),
            _ => KvEvent::AllBlocksCleared,
        })
        .collect();
    KvEventBatch {
        ts: f64::from_bits(int(rng)),
        events,
        dp_rank: (rng.below(2) == 0).then(|| int(rng) as u32),
    }
}

#[test]
fn the_direct_writer_writes_what_the_tree_writes() {
    let mut rng = XorShift(0x5EED_0FE4_C0DE);
    let fixed = [
        sample_batch(),
        KvEventBatch {
            events: vec![],
            ..sample_batch()
        },
    ];
    let drawn: Vec<KvEventBatch> = (0..5_000).map(|_| random_batch(&mut rng)).collect();
    for batch in fixed.iter().chain(&drawn) {
        for encoding in [Encoding::Array, Encoding::Map] {
            let ours = encode_batch(batch, encoding);
            assert_eq!(
                ours,
                encode::tree::encode_batch_via_tree(batch, encoding),
                "{batch:?}"
            );
        }
    }
    // The draw reaches every event kind and both hash forms.
    let events = drawn.iter().flat_map(|b| &b.events);
    let kinds: std::collections::BTreeSet<u8> = events
        .map(|e| match e {
            KvEvent::BlockStored(s) if s.extra_keys.is_some() => 0,
            KvEvent::BlockStored(_) => 1,
            KvEvent::BlockRemoved(_) => 2,
            KvEvent::AllBlocksCleared => 3,
        })
        .collect();
    assert_eq!(kinds.len(), 4);
}
