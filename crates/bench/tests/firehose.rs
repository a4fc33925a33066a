//! `kvroute-bench firehose` through the router's own KV-event subscriber: every block event a
//! firehose engine publishes arrives, in order and without a gap, every event applies to the
//! index without an error, and each engine's replica ends with the blocks its cache holds.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvroute_bench::firehose::{FirehoseArgs, Shape};
use kvroute_gateway::kv_events::{EventSink, KvEventMetrics, KvEventSubscriber, SubscriberConfig};
use kvroute_index::{
    EngineHash, IndexError, KvIndex, KvIndexer, ReplicaId, StorageTier, StoredBlocks,
};
use tokio_util::sync::CancellationToken;

/// One engine's replica in a shared index, with what reached it.
struct Replica {
    index: Arc<Mutex<KvIndex>>,
    replica: ReplicaId,
    /// Blocks stored and removed (the subscriber hands on consecutive removals together).
    block_events: AtomicU64,
    refused: AtomicU64,
    cleared: AtomicU64,
}

impl EventSink for Replica {
    fn stored(&self, _: u32, event: &StoredBlocks<'_>) -> Result<(), IndexError> {
        let blocks = event.engine_hashes.len() as u64;
        self.block_events.fetch_add(blocks, Ordering::Relaxed);
        let result = self.index.lock().unwrap().apply_stored(self.replica, event);
        if result.is_err() {
            self.refused.fetch_add(1, Ordering::Relaxed);
        }
        result
    }

    fn removed(&self, _: u32, tier: StorageTier, hashes: &[EngineHash]) {
        let blocks = hashes.len() as u64;
        self.block_events.fetch_add(blocks, Ordering::Relaxed);
        (self.index.lock().unwrap()).apply_removed(self.replica, tier, hashes);
    }

    fn cleared(&self, _: u32) {
        self.cleared.fetch_add(1, Ordering::Relaxed);
        self.index.lock().unwrap().clear_replica(self.replica);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_published_reaches_the_router_s_subscriber_and_applies() {
    const ENGINES: usize = 4;
    let shape = Shape {
        engine_blocks: 512,
        block_size: 16,
        prefixes: 4,
        prefix_blocks: 8,
        suffix_blocks: 12,
    };
    // A port range of this process's own, away from other tests'.
    let port = 31_000 + (std::process::id() % 500) as usize * 8;
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let args = FirehoseArgs {
        engines: ENGINES,
        endpoint: endpoint.clone(),
        rate: 40_000,
        duration_secs: 1.0,
        warmup_secs: 1.5,
        shape,
        seed: 3,
    };
    let index = Arc::new(Mutex::new(KvIndex::new(16)));
    let metrics = KvEventMetrics::default();
    let shutdown = CancellationToken::new();
    let publishing = tokio::spawn(async move { args.publish().await });
    // The sockets bind at once; the subscribers connect during the warmup.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut replicas = Vec::new();
    for i in 0..ENGINES {
        let replica = Arc::new(Replica {
            index: index.clone(),
            replica: ReplicaId(i as u32),
            block_events: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            cleared: AtomicU64::new(0),
        });
        let config = SubscriberConfig {
            worker: format!("engine-{i}"),
            endpoint: format!("tcp://127.0.0.1:{}", port + i),
            replay_endpoint: None,
            dp_start_rank: 0,
            dp_size: 1,
            router_block_size: 16,
        };
        let sink: Arc<dyn EventSink> = replica.clone();
        let subscriber = KvEventSubscriber::new(config, sink, &metrics).unwrap();
        tokio::spawn(subscriber.run(shutdown.clone()));
        replicas.push(replica);
    }
    let sent = publishing.await.unwrap().unwrap();
    // Two full caches' worth and more: the engines churned at full size.
    assert!(
        sent.block_events > 4 * (ENGINES * shape.engine_blocks) as u64,
        "{sent:?}"
    );
    let arrived = || {
        replicas
            .iter()
            .map(|r| r.block_events.load(Ordering::Relaxed))
            .sum::<u64>()
    };
    for _ in 0..100 {
        if arrived() >= sent.block_events {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    assert_eq!(arrived(), sent.block_events, "{sent:?}");
    for replica in &replicas {
        assert_eq!(
            replica.refused.load(Ordering::Relaxed),
            0,
            "a parent not held"
        );
        assert_eq!(
            replica.cleared.load(Ordering::Relaxed),
            0,
            "a gap in the sequence"
        );
        // Full: within one step's store of the cache's size.
        let held = index.lock().unwrap().replica_blocks(replica.replica).device as usize;
        let step = shape.prefix_blocks + shape.suffix_blocks;
        assert!(
            held <= shape.engine_blocks && held + step > shape.engine_blocks,
            "{:?} holds {held}",
            replica.replica
        );
    }
}

#[test]
fn bad_flags_are_refused_by_name_before_anything_is_bound() {
    let cases = [
        ("--engine-blocks", "10", "--engine-blocks 10 cannot hold"),
        ("--engines", "0", "--engines must be at least 1"),
        (
            "--duration-secs",
            "-1",
            "--duration-secs must be a positive",
        ),
        ("--warmup-secs", "NaN", "--warmup-secs must be 0 or more"),
    ];
    for (flag, value, says) in cases {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute-bench"))
            .args(["firehose", "--endpoint", "tcp://127.0.0.1:9"])
            .arg(format!("{flag}={value}"))
            .output()
            .expect("the binary runs");
        assert!(!out.status.success(), "{flag} {value} accepted");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(says), "{flag} {value}: {stderr}");
    }
}
