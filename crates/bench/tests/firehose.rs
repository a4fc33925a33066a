//! `kvroute-bench firehose` through the router's own KV-event subscriber: every block event a
//! firehose engine publishes arrives, in order and without a gap, every event applies to the
//! index without an error, and each engine's replica ends with the blocks its cache holds.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvroute_bench::firehose::{FirehoseArgs, Shape};
use kvroute_gateway::kv_events::{
    EachEvent, EventSink, KvEventMetrics, KvEventSubscriber, RankEvents, SubscriberConfig,
};
use kvroute_index::{
    EngineHash, IndexError, KvIndex, KvIndexer, ReplicaId, StorageTier, StoredBlocks,
};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// What every replica shares: the index, and who is waiting for what arrives.
struct Shared {
    index: Mutex<KvIndex>,
    /// Replicas that have received a batch (a primer, at first).
    joined: AtomicUsize,
    /// Woken at every batch.
    arrived: Notify,
}

/// One engine's replica in the shared index, with what reached it.
struct Replica {
    shared: Arc<Shared>,
    replica: ReplicaId,
    batches: AtomicU64,
    /// Blocks stored and removed.
    block_events: AtomicU64,
    refused: AtomicU64,
    cleared: AtomicU64,
}

impl EventSink for Replica {
    fn stored(&self, _: u32, event: &StoredBlocks<'_>) -> Result<(), IndexError> {
        let blocks = event.engine_hashes.len() as u64;
        self.block_events.fetch_add(blocks, Ordering::Relaxed);
        let mut index = self.shared.index.lock().unwrap();
        let result = index.apply_stored(self.replica, event);
        if result.is_err() {
            self.refused.fetch_add(1, Ordering::Relaxed);
        }
        result
    }

    fn removed(&self, _: u32, tier: StorageTier, hashes: &[EngineHash]) {
        let blocks = hashes.len() as u64;
        self.block_events.fetch_add(blocks, Ordering::Relaxed);
        let mut index = self.shared.index.lock().unwrap();
        index.apply_removed(self.replica, tier, hashes);
    }

    fn cleared(&self, _: u32) {
        self.cleared.fetch_add(1, Ordering::Relaxed);
        self.shared
            .index
            .lock()
            .unwrap()
            .clear_replica(self.replica);
    }

    fn batch(&self, rank: u32, apply: &mut dyn FnMut(&mut dyn RankEvents)) {
        apply(&mut EachEvent::new(self, rank));
        if self.batches.fetch_add(1, Ordering::Relaxed) == 0 {
            self.shared.joined.fetch_add(1, Ordering::Relaxed);
        }
        self.shared.arrived.notify_one();
    }
}

impl Shared {
    /// Until `done()`, woken at each batch (a permit kept between checks is not lost); a
    /// minute at most, however slow the machine.
    async fn until(&self, done: impl Fn() -> bool) {
        let wait = async {
            while !done() {
                self.arrived.notified().await;
            }
        };
        tokio::time::timeout(Duration::from_secs(60), wait)
            .await
            .expect("within a minute");
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
    let args = FirehoseArgs {
        engines: ENGINES,
        endpoint: format!("tcp://127.0.0.1:{port}"),
        rate: 40_000,
        duration_secs: 1.0,
        warmup_secs: 0.0,
        shape,
        seed: 3,
    };
    let mut firehose = args.bind().await.unwrap();
    let shared = Arc::new(Shared {
        index: Mutex::new(KvIndex::new(16)),
        joined: AtomicUsize::new(0),
        arrived: Notify::new(),
    });
    let metrics = KvEventMetrics::default();
    let shutdown = CancellationToken::new();
    let mut replicas = Vec::new();
    for i in 0..ENGINES {
        let replica = Arc::new(Replica {
            shared: shared.clone(),
            replica: ReplicaId(i as u32),
            batches: AtomicU64::new(0),
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
    // The stream starts once every subscriber has taken a primer.
    let joined = shared.until(|| shared.joined.load(Ordering::Relaxed) == ENGINES);
    let sent = firehose.publish(joined).await.unwrap();
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
    shared.until(|| arrived() >= sent.block_events).await;
    shutdown.cancel();
    firehose.close().await;
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
        let held = (shared.index.lock().unwrap())
            .replica_blocks(replica.replica)
            .device as usize;
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
