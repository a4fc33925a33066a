//! KV-event decoding: what the router does with each `[topic, seq, payload]` message an engine
//! publishes (`crates/gateway/src/kv_events/{sequence,apply}.rs`), on bytes nobody vetted.
//!
//! The input is one payload (the third frame). Checked:
//! - `decode_seq` on every prefix length up to 9 bytes: never panics, accepts exactly the
//!   8-byte frames, and reads them as big-endian with `u64::MAX` as the end-of-replay marker;
//! - `decode_batch` never panics (an error is fine);
//! - a decoded batch round-trips: `encode_batch` in both layouts decodes back to the same batch,
//!   and re-encoding that gives the same bytes (so NaNs compare by their bits);
//! - the decoded events, applied as the gateway applies them (hashes folded to 64 bits, the
//!   tier from `medium`, the LoRA name as salt; router block size 16, 4, 64 or 3 by the input's
//!   length), never panic the index, and the exact index answers as its reference model does:
//!   each event's result, the block count, and the overlaps of every prefix stored so far
//!   (`corpus/kv_events/regression-k1-*`: pieces of a router block stored again differently,
//!   fixed bug K1).
//!
//! The frame handling around these calls (`read_frames`, `Sequence::check`,
//! `ReplayCollector::push`) is private to the gateway's `kv_events` module and is not reached.

#![no_main]

use std::collections::{HashMap, VecDeque};

use kvroute_index::reference::ReferenceIndex;
use kvroute_index::{
    block_hashes, BlockHash, EngineHash, KvIndex, KvIndexer, ReplicaId, StoredBlocks,
};
use kvroute_protocol::kv_events::{
    decode_batch, decode_seq, encode_batch, Encoding, KvEvent, KvEventBatch, END_OF_REPLAY_SEQ,
};
use libfuzzer_sys::fuzz_target;

/// Router block sizes tried against each batch: equal to, a divisor of, a multiple of, and
/// unrelated to the engine's usual 16.
const ROUTER_BLOCK_SIZES: [usize; 4] = [16, 4, 64, 3];

/// Events applied per batch at most, so one input cannot make a run take seconds.
const MAX_EVENTS: usize = 64;
/// Tokens per event (and per followed sequence) at most, for the same reason.
const MAX_TOKENS: usize = 4096;
/// Prefixes queried after each event at most (the latest ones).
const MAX_QUERIES: usize = 32;

/// `FUZZ_VERBOSE=1 .../kv_events FILE...` says what became of each input.
macro_rules! verbose {
    ($($arg:tt)*) => {
        if *VERBOSE.get_or_init(|| std::env::var_os("FUZZ_VERBOSE").is_some()) {
            eprintln!($($arg)*);
        }
    };
}

static VERBOSE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

fuzz_target!(|payload: &[u8]| {
    check_seq(payload);
    let batch = match decode_batch(payload) {
        Ok(batch) => batch,
        Err(error) => {
            verbose!("not decoded: {error}");
            return;
        }
    };
    check_round_trip(&batch);
    let router_block_size = ROUTER_BLOCK_SIZES[payload.len() % ROUTER_BLOCK_SIZES.len()];
    verbose!("router block size {router_block_size}, {batch:?}");
    check_index(&batch, router_block_size);
});

fn check_seq(bytes: &[u8]) {
    for len in 0..=bytes.len().min(9) {
        let frame = &bytes[..len];
        match decode_seq(frame) {
            Ok(seq) => {
                let frame: [u8; 8] = frame.try_into().expect("only 8-byte seq frames decode");
                let expected = (frame != END_OF_REPLAY_SEQ).then(|| u64::from_be_bytes(frame));
                assert_eq!(seq, expected, "seq frame {frame:02x?}");
            }
            Err(_) => assert_ne!(len, 8, "an 8-byte seq frame was refused"),
        }
    }
}

fn check_round_trip(batch: &KvEventBatch) {
    for encoding in [Encoding::Map, Encoding::Array] {
        let bytes = encode_batch(batch, encoding);
        let again = decode_batch(&bytes)
            .unwrap_or_else(|e| panic!("{encoding:?} encoding of {batch:?} does not decode: {e}"));
        if !has_nan(batch) {
            assert_eq!(&again, batch, "{encoding:?} round trip");
        }
        assert_eq!(
            encode_batch(&again, encoding),
            bytes,
            "{encoding:?} re-encoding differs"
        );
    }
}

/// Whether a float in the batch is NaN (NaN != NaN, so equality cannot be asked of it).
fn has_nan(batch: &KvEventBatch) -> bool {
    fn value_has_nan(v: &rmpv::Value) -> bool {
        match v {
            rmpv::Value::F32(x) => x.is_nan(),
            rmpv::Value::F64(x) => x.is_nan(),
            rmpv::Value::Array(items) => items.iter().any(value_has_nan),
            rmpv::Value::Map(entries) => entries
                .iter()
                .any(|(k, v)| value_has_nan(k) || value_has_nan(v)),
            _ => false,
        }
    }
    batch.ts.is_nan()
        || batch.events.iter().any(|e| match e {
            KvEvent::BlockStored(s) => s.extra_keys.iter().flatten().flatten().any(value_has_nan),
            _ => false,
        })
}

/// Applies the batch as `kv_events::apply::Applier` does, to the exact index and to its
/// reference model, and compares what they answer: each event's result, the number of
/// blocks, and after each event the overlaps of every prefix stored so far (the tokens of a
/// stored block's whole sequence, followed through the events' parents).
fn check_index(batch: &KvEventBatch, router_block_size: usize) {
    let mut index = KvIndex::new(router_block_size);
    let mut reference = ReferenceIndex::new(router_block_size);
    // The replica the batch names, folded onto a few ids.
    let replica = ReplicaId(batch.dp_rank.unwrap_or(0) % 3);
    // Per engine block, the tokens of its sequence through it (unsalted chains only).
    let mut prefixes: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut queries: VecDeque<Vec<BlockHash>> = VecDeque::new();
    for event in batch.events.iter().take(MAX_EVENTS) {
        match event {
            KvEvent::BlockStored(stored) => {
                if stored.token_ids.len() > MAX_TOKENS {
                    continue;
                }
                // As the gateway reads it.
                let mut hashes = Vec::new();
                let event = StoredBlocks::from_event(stored, &mut hashes);
                let salt = event.salt;
                let got = index.apply_stored(replica, &event);
                let want = reference.apply_stored(replica, &event);
                verbose!("stored {event:?}: {got:?}");
                assert_eq!(got, want, "apply_stored of {event:?}");
                if got.is_ok() && salt == 0 && event.block_size > 0 {
                    let start = match event.parent {
                        None => Some(Vec::new()),
                        Some(parent) => prefixes.get(&parent.0).cloned(),
                    };
                    if let Some(mut prefix) = start.filter(|p| p.len() <= MAX_TOKENS) {
                        for (hash, tokens) in event
                            .engine_hashes
                            .iter()
                            .zip(event.token_ids.chunks_exact(event.block_size))
                        {
                            prefix.extend_from_slice(tokens);
                            prefixes.insert(hash.0, prefix.clone());
                        }
                        if queries.len() == MAX_QUERIES {
                            queries.pop_front();
                        }
                        queries.push_back(block_hashes(&prefix, router_block_size, 0));
                    }
                }
            }
            KvEvent::BlockRemoved(removed) => {
                let hashes = EngineHash::all(&removed.block_hashes);
                verbose!("removed {:?} {hashes:?}", removed.tier());
                index.apply_removed(replica, removed.tier(), &hashes);
                reference.apply_removed(replica, removed.tier(), &hashes);
            }
            KvEvent::AllBlocksCleared => {
                verbose!("cleared");
                index.clear_replica(replica);
                reference.clear_replica(replica);
            }
        }
        assert_eq!(
            index.num_blocks(),
            reference.num_blocks(),
            "distinct blocks"
        );
        for query in &queries {
            assert_eq!(
                index.find_matches(query),
                reference.find_matches(query),
                "overlaps of {query:?}"
            );
        }
    }
}
