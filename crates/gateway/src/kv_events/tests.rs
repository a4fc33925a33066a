//! The synchronous parts, without sockets: endpoints, sequence rules, replay coverage,
//! event conversion and counting. The sockets are tested in `tests/kv_events.rs`.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use kvroute_index::{EngineHash, IndexError, StorageTier, StoredBlocks};
use kvroute_protocol::kv_events::{
    encode_batch, encode_seq, BlockHashValue, BlockRemoved, BlockStored, Encoding, KvEvent,
    KvEventBatch, END_OF_REPLAY_SEQ,
};
use kvroute_protocol::stable_hash;
use prometheus_client::registry::Registry;

use super::apply::{Applier, RankState, Step};
use super::metrics::Status;
use super::sequence::{ReplayCollector, ReplayError, Sequence, Verdict};
use super::*;

/// Records each call as one line; a parent of 404 is unknown.
#[derive(Default)]
struct Recorder(Mutex<Vec<String>>);

impl EventSink for Recorder {
    fn stored(&self, rank: u32, e: &StoredBlocks<'_>) -> Result<(), IndexError> {
        if e.parent == Some(EngineHash(404)) {
            return Err(IndexError::UnknownParent(EngineHash(404)));
        }
        let hashes: Vec<_> = e.engine_hashes.iter().map(|h| h.0).collect();
        let (parent, tokens) = (e.parent.map(|h| h.0), e.token_ids.len());
        let (size, tier, salt) = (e.block_size, e.tier, e.salt);
        let line = format!("stored {rank} {parent:?} {hashes:?} {tokens}/{size} {tier:?} {salt}");
        self.0.lock().unwrap().push(line);
        Ok(())
    }
    fn removed(&self, rank: u32, tier: StorageTier, hashes: &[EngineHash]) {
        let hashes: Vec<_> = hashes.iter().map(|h| h.0).collect();
        let line = format!("removed {rank} {tier:?} {hashes:?}");
        self.0.lock().unwrap().push(line);
    }
    fn cleared(&self, rank: u32) {
        self.0.lock().unwrap().push(format!("cleared {rank}"));
    }
}

impl Recorder {
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut self.0.lock().unwrap())
    }
}

fn stored(hash: u64, parent: Option<u64>, block_size: u32) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: [BlockHashValue::U64(hash)].into_iter().collect(),
        parent_block_hash: parent.map(BlockHashValue::U64),
        token_ids: (0..block_size).collect(),
        block_size,
        lora_id: None,
        medium: None,
        lora_name: None,
        extra_keys: None,
    })
}

fn batch(events: Vec<KvEvent>, dp_rank: Option<u32>) -> KvEventBatch {
    let ts = 1.0;
    KvEventBatch {
        ts,
        events,
        dp_rank,
    }
}

fn encoded(events: Vec<KvEvent>) -> Bytes {
    Bytes::from(encode_batch(&batch(events, None), Encoding::Map))
}

/// A published message `[topic, seq, payload]`.
fn message(seq: u64, events: Vec<KvEvent>) -> Vec<Bytes> {
    let seq = Bytes::copy_from_slice(&encode_seq(seq));
    vec![Bytes::from_static(b"kv"), seq, encoded(events)]
}

fn frames(frames: &[&'static [u8]]) -> Vec<Bytes> {
    frames.iter().map(|f| Bytes::from_static(f)).collect()
}

fn setup() -> (Arc<Recorder>, Applier, Registry) {
    let mut registry = Registry::default();
    let metrics = KvEventMetrics::register(&mut registry);
    let sink = Arc::new(Recorder::default());
    let applier = Applier::new("w1".into(), sink.clone(), metrics.worker("w1"), 16);
    (sink, applier, registry)
}

fn count(registry: &Registry, event: &str, status: &str) -> u64 {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
    let series =
        format!(r#"kvroute_kv_events_total{{worker="w1",event="{event}",status="{status}"}} "#);
    let value = text.lines().find_map(|l| l.strip_prefix(&series));
    value.map_or(0, |v| v.parse().unwrap())
}

#[test]
fn endpoints_are_offset_by_rank() {
    let offset = |e, r| rank_endpoint(e, r).unwrap();
    assert_eq!(offset("tcp://10.0.0.1:5557", 0), "tcp://10.0.0.1:5557");
    assert_eq!(offset("tcp://engine-a:5557", 3), "tcp://engine-a:5560");
    assert_eq!(offset("tcp://[::1]:5557", 1), "tcp://[::1]:5558");
    for bad in [
        "tcp://*:5557",
        "ipc:///tmp/kv",
        "tcp://h",
        "tcp://h:x",
        "tcp://:1",
    ] {
        assert!(rank_endpoint(bad, 0).is_err(), "{bad}");
    }
    assert!(rank_endpoint("tcp://host:65535", 1).is_err());
}

#[test]
fn the_configuration_is_checked_without_io() {
    let config = SubscriberConfig {
        worker: "w1".into(),
        endpoint: "tcp://127.0.0.1:5557".into(),
        replay_endpoint: Some("tcp://127.0.0.1:5600".into()),
        dp_start_rank: 2,
        dp_size: 2,
        router_block_size: 16,
    };
    let metrics = KvEventMetrics::default();
    let sink: Arc<dyn EventSink> = Arc::new(Recorder::default());
    let sub = KvEventSubscriber::new(config.clone(), sink.clone(), &metrics).unwrap();
    let last = &sub.ranks[1];
    assert_eq!(
        (last.rank, last.events.as_str()),
        (3, "tcp://127.0.0.1:5560")
    );
    assert_eq!(last.replay.as_deref(), Some("tcp://127.0.0.1:5603"));
    let bad = |f: fn(&mut SubscriberConfig)| {
        let mut c = config.clone();
        f(&mut c);
        KvEventSubscriber::new(c, sink.clone(), &metrics).unwrap_err()
    };
    assert_eq!(bad(|c| c.dp_size = 0), KvEventsConfigError::DpSize);
    assert_eq!(
        bad(|c| c.router_block_size = 0),
        KvEventsConfigError::BlockSize
    );
    let wildcard = bad(|c| c.replay_endpoint = Some("tcp://*:1".into()));
    assert!(matches!(wildcard, KvEventsConfigError::Endpoint { .. }));
}

#[test]
fn sequence_rules() {
    let gap = |missing, replayable| Verdict::Gap {
        missing,
        replayable,
    };
    let mut seq = Sequence::default();
    assert_eq!(
        seq.check(7),
        Verdict::InOrder,
        "the first message is the baseline"
    );
    seq.accept(7);
    assert_eq!(seq.check(8), Verdict::InOrder);
    assert_eq!(seq.check(11), gap(8..11, true));
    assert_eq!(seq.check(7), Verdict::Restart);
    assert_eq!(seq.check(0), Verdict::Restart);
    seq.reconnected();
    assert_eq!(seq.check(8), Verdict::InOrder);
    assert_eq!(
        seq.check(9),
        gap(8..9, false),
        "no replay across a reconnect"
    );
    seq.accept(9);
    assert_eq!(seq.check(11), gap(10..11, true));
}

#[test]
fn a_replay_must_cover_the_gap_exactly() {
    let answer = |seq: u64| {
        let seq_frame = Bytes::copy_from_slice(&encode_seq(seq));
        vec![Bytes::new(), seq_frame, Bytes::from(vec![seq as u8])]
    };
    let end = frames(&[b"", &END_OF_REPLAY_SEQ, b""]);
    let mut c = ReplayCollector::new(5..8);
    for seq in [3, 4, 5, 6, 7, 8, 9] {
        assert!(!c.push(&answer(seq)).unwrap());
    }
    assert!(c.push(&end).unwrap());
    assert_eq!(c.finish().unwrap(), [5, 6, 7].map(|s| Bytes::from(vec![s])));

    let mut c = ReplayCollector::new(5..8);
    let missing = c.push(&answer(6));
    assert!(matches!(
        missing,
        Err(ReplayError::Missing {
            missing: 5,
            found: 6
        })
    ));
    let mut c = ReplayCollector::new(5..8);
    c.push(&answer(5)).unwrap();
    assert!(c.push(&end).unwrap());
    assert!(matches!(c.finish(), Err(ReplayError::Incomplete(6))));
    let mut c = ReplayCollector::new(5..8);
    assert!(matches!(
        c.push(&frames(&[b""])),
        Err(ReplayError::FrameCount(1))
    ));
}

#[test]
fn events_reach_the_sink_converted_and_counted() {
    let (sink, applier, registry) = setup();
    let lora = KvEvent::BlockStored(BlockStored {
        block_hashes: [BlockHashValue::Bytes(vec![7; 32])].into_iter().collect(),
        parent_block_hash: Some(BlockHashValue::U64(3)),
        token_ids: (0..16).collect(),
        block_size: 16,
        lora_id: Some(1),
        medium: Some("CPU".into()),
        lora_name: Some("adapter".into()),
        extra_keys: None,
    });
    let removed = KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: [BlockHashValue::U64(9)].into_iter().collect(),
        medium: Some("DISK".into()),
    });
    let events = vec![stored(1, None, 8), lora, removed, KvEvent::AllBlocksCleared];
    let rank = applier.apply(0, &batch(events, Some(3)), Status::Ok);
    assert_eq!(rank, 3, "the batch's rank wins over the socket's");
    let (bytes_hash, salt) = (stable_hash(&[7; 32]), stable_hash(b"adapter"));
    assert_eq!(
        sink.take(),
        [
            "stored 3 None [1] 8/8 Device 0".to_owned(),
            format!("stored 3 Some(3) [{bytes_hash}] 16/16 Host {salt}"),
            "removed 3 Disk [9]".to_owned(),
            "cleared 3".to_owned(),
        ]
    );
    assert_eq!(applier.apply(5, &batch(vec![], None), Status::Ok), 5);
    assert_eq!(count(&registry, "stored", "ok"), 2);
    assert_eq!(count(&registry, "removed", "ok"), 1);
    assert_eq!(count(&registry, "cleared", "ok"), 1);
    assert_eq!(count(&registry, "batch", "ok"), 2);
}

#[test]
fn incompatible_block_sizes_and_sink_errors_are_counted_not_applied() {
    let (sink, applier, registry) = setup();
    let events = vec![
        stored(1, None, 12),
        stored(2, None, 0),
        stored(3, None, 32),
        stored(4, Some(404), 16),
    ];
    applier.apply(0, &batch(events, None), Status::Ok);
    assert_eq!(sink.take(), ["stored 0 None [3] 32/32 Device 0"]);
    assert_eq!(count(&registry, "stored", "block_size_mismatch"), 2);
    assert_eq!(count(&registry, "stored", "unknown_parent"), 1);
    assert_eq!(count(&registry, "stored", "ok"), 1);
}

#[test]
fn a_rank_follows_the_sequence_rules() {
    let (sink, applier, registry) = setup();
    let mut rank = RankState::new(1, false);
    let mut step = |frames: Vec<Bytes>| {
        assert!(matches!(rank.on_message(&applier, &frames), Step::Done));
        sink.take()
    };
    assert_eq!(step(message(10, vec![stored(1, None, 16)])).len(), 1);
    for malformed in [
        frames(&[b"", b""]),
        frames(&[b"", b"123", b""]),
        frames(&[b"", &END_OF_REPLAY_SEQ, b""]),
        frames(&[b"", &[0, 0, 0, 0, 0, 0, 0, 11], b"\xc1"]),
    ] {
        assert!(step(malformed).is_empty());
    }
    assert_eq!(count(&registry, "batch", "malformed"), 4);
    // seq 11 was read (its payload was not): 12 is in order.
    assert_eq!(
        step(message(12, vec![KvEvent::AllBlocksCleared])),
        ["cleared 1"]
    );
    // A gap, with no replay socket: cleared, then applied.
    let calls = step(message(20, vec![stored(2, None, 16)]));
    assert_eq!(calls, ["cleared 1", "stored 1 None [2] 16/16 Device 0"]);
    assert_eq!(count(&registry, "batch", "gap"), 1);
    // A restart: cleared, then the new baseline applies.
    let calls = step(message(0, vec![stored(3, None, 16)]));
    assert_eq!(calls, ["cleared 1", "stored 1 None [3] 16/16 Device 0"]);
    assert!(step(message(1, vec![])).is_empty());
    assert_eq!(count(&registry, "batch", "restart"), 1);
    assert_eq!(count(&registry, "batch", "ok"), 5);
}

#[test]
fn a_gap_with_a_replay_socket_is_replayed_or_cleared() {
    let (sink, applier, registry) = setup();
    let mut rank = RankState::new(0, true);
    let step = rank.on_message(&applier, &message(4, vec![]));
    assert!(matches!(step, Step::Done));
    let step = rank.on_message(&applier, &message(7, vec![stored(7, None, 16)]));
    let Step::Replay {
        missing,
        seq,
        batch,
    } = step
    else {
        panic!("a replay is asked for");
    };
    assert_eq!((missing.clone(), seq), (5..7, 7));
    let replayed = [5, 6].map(|h| encoded(vec![stored(h, None, 16)]));
    rank.finish_gap(&applier, missing, Ok(replayed.to_vec()), seq, batch);
    let expected = [5, 6, 7].map(|h| format!("stored 0 None [{h}] 16/16 Device 0"));
    assert_eq!(sink.take(), expected, "in order, the current batch last");
    assert_eq!(count(&registry, "batch", "replayed"), 2);
    // A failed replay clears the rank.
    let step = rank.on_message(&applier, &message(9, vec![]));
    let Step::Replay {
        missing,
        seq,
        batch,
    } = step
    else {
        panic!("a replay is asked for");
    };
    let failed = Err(ReplayError::Incomplete(8));
    rank.finish_gap(&applier, missing, failed, seq, batch);
    assert_eq!(sink.take(), ["cleared 0"]);
    assert_eq!(count(&registry, "batch", "gap"), 1);
}
