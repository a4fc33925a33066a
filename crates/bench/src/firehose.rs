//! `kvroute-bench firehose`: KV events published as a fleet of engines publishes them, for a
//! router to absorb: N engines, engine `i` on its own ZMQ PUB socket at the endpoint's port +
//! `i`, in vLLM's wire format (`[topic, seq, msgpack batch]`, the positional encoding), at a
//! set rate of block events a second across the fleet.
//!
//! Each engine is a cache of `--engine-blocks` blocks serving one request a step: a shared
//! system prompt (one of `--prefixes`, the same blocks and tokens on every engine, stored
//! once per engine and kept) and a suffix of its own. A step's message evicts the oldest
//! suffixes the new one needs room for, each block a `BlockRemoved` of its own and the
//! suffix's last block first, as vLLM evicts, then stores the prompt's new blocks (one
//! `BlockStored` a chain). Once full, every step stores and evicts as many blocks: the fleet
//! churns at full size, every stored block's parent held. A PUB socket drops what a slow
//! subscriber cannot take (ZMQ's rule), so a router that does not keep up sees gaps in the
//! sequence numbers (`kvroute_kv_events_total{event="batch",status="gap"}`).
//!
//! Until the stream starts, each engine sends an empty batch every 10 ms (a primer): a
//! subscriber that joins takes its first sequence number from one and misses nothing after.
//! It prints what it sent: messages, events and block events, at what rate, and how far
//! behind its schedule it fell (on a machine it shares with the router, its own pace is
//! bounded too). `bench/firehose.sh` puts a router with that many workers in front of it.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use clap::Args;
use kvroute_protocol::kv_events::{
    encode_batch, encode_seq, BlockHashValue, BlockRemoved, BlockStored, Encoding, KvEvent,
    KvEventBatch,
};
use kvroute_protocol::mix64;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use zeromq::{Socket, SocketSend, ZmqMessage};

/// `kvroute-bench firehose`'s flags.
#[derive(Debug, Clone, Args)]
pub struct FirehoseArgs {
    /// Engines publishing: engine i binds the endpoint's port + i.
    #[arg(long, default_value_t = 1024)]
    pub engines: usize,
    /// Engine 0's endpoint, `tcp://HOST:PORT`.
    #[arg(long, default_value = "tcp://127.0.0.1:24000")]
    pub endpoint: String,
    /// Block events a second (stored and removed), the fleet together.
    #[arg(long, default_value_t = 1_000_000)]
    pub rate: u64,
    /// How long to publish, once the subscribers had `--warmup-secs` to connect.
    #[arg(long, default_value_t = 10.0)]
    pub duration_secs: f64,
    /// How long to send primers before the stream (empty batches, every 10 ms: a PUB socket
    /// drops what it sends before a subscriber joined, and one that joins in time takes its
    /// first sequence number from a primer).
    #[arg(long, default_value_t = 3.0)]
    pub warmup_secs: f64,
    #[command(flatten)]
    pub shape: Shape,
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
}

/// What each engine holds and stores.
#[derive(Debug, Clone, Copy, Args)]
pub struct Shape {
    /// Blocks an engine's cache holds: once full, each store evicts as many.
    #[arg(long, default_value_t = 4096)]
    pub engine_blocks: usize,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// System prompts the engines share (each engine stores one the first time it serves it).
    #[arg(long, default_value_t = 64)]
    pub prefixes: usize,
    /// Blocks of a system prompt.
    #[arg(long, default_value_t = 32)]
    pub prefix_blocks: usize,
    /// Blocks of a request's own suffix.
    #[arg(long, default_value_t = 32)]
    pub suffix_blocks: usize,
}

impl Shape {
    fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.block_size > 0, "--block-size must be at least 1");
        anyhow::ensure!(self.prefixes > 0, "--prefixes must be at least 1");
        anyhow::ensure!(self.suffix_blocks > 0, "--suffix-blocks must be at least 1");
        let needed = self.prefixes * self.prefix_blocks + self.suffix_blocks;
        anyhow::ensure!(
            self.engine_blocks >= needed,
            "--engine-blocks {} cannot hold every system prompt and a suffix ({needed} blocks)",
            self.engine_blocks
        );
        Ok(())
    }
}

/// One engine's cache and its stream of steps (deterministic for its seed).
#[derive(Debug)]
pub struct Engine {
    id: u64,
    rng: SmallRng,
    has_prefix: Vec<bool>,
    /// Suffixes held, oldest first: each its blocks' hashes.
    suffixes: VecDeque<Vec<u64>>,
    held: usize,
    next_hash: u64,
}

/// Tokens are drawn below this (a vocabulary's size).
const VOCABULARY: u64 = 50_000;

impl Engine {
    pub fn new(id: usize, shape: &Shape, seed: u64) -> Self {
        Self {
            id: id as u64,
            rng: SmallRng::seed_from_u64(mix64(seed, id as u64)),
            has_prefix: vec![false; shape.prefixes],
            suffixes: VecDeque::new(),
            held: 0,
            next_hash: 0,
        }
    }

    /// Blocks the engine holds.
    pub fn held(&self) -> usize {
        self.held
    }

    /// The next step's batch, and its block events (blocks stored plus blocks removed).
    pub fn step(&mut self, shape: &Shape) -> (KvEventBatch, usize) {
        let prefix = self.rng.random_range(0..shape.prefixes);
        let new_prefix = !self.has_prefix[prefix];
        let stored = shape.suffix_blocks + if new_prefix { shape.prefix_blocks } else { 0 };
        let mut events = Vec::new();
        let mut blocks = 0;
        while self.held + stored > shape.engine_blocks {
            let suffix = self.suffixes.pop_front().expect("the prompts alone fit");
            self.held -= suffix.len();
            blocks += suffix.len();
            events.extend(suffix.iter().rev().map(|&hash| {
                KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: [BlockHashValue::U64(hash)].into_iter().collect(),
                    medium: Some("GPU".into()),
                })
            }));
        }
        let prefix_hashes: Vec<u64> = (0..shape.prefix_blocks)
            .map(|j| prefix_hash(prefix, j))
            .collect();
        if new_prefix {
            let tokens = (0..shape.prefix_blocks * shape.block_size)
                .map(|t| (mix64(prefix as u64, t as u64) % VOCABULARY) as u32)
                .collect();
            events.push(stored_event(&prefix_hashes, None, tokens, shape));
            self.has_prefix[prefix] = true;
        }
        let suffix: Vec<u64> = (0..shape.suffix_blocks)
            .map(|_| {
                self.next_hash += 1;
                mix64(self.id << 40 | self.next_hash, SUFFIX_SALT)
            })
            .collect();
        let tokens = (0..shape.suffix_blocks * shape.block_size)
            .map(|_| self.rng.random_range(0..VOCABULARY) as u32)
            .collect();
        let parent = prefix_hashes.last().copied();
        events.push(stored_event(&suffix, parent, tokens, shape));
        self.held += stored;
        self.suffixes.push_back(suffix);
        let batch = KvEventBatch {
            ts: 0.0,
            events,
            dp_rank: Some(0),
        };
        (batch, blocks + stored)
    }
}

const PREFIX_SALT: u64 = 0x5EED_0F51_57E3;
const SUFFIX_SALT: u64 = 0x5EED_0F50_FF1C;

/// The engine hash of block `j` of system prompt `prefix`: the same on every engine.
fn prefix_hash(prefix: usize, j: usize) -> u64 {
    mix64((prefix as u64) << 32 | j as u64, PREFIX_SALT)
}

fn stored_event(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>, shape: &Shape) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.iter().map(|&h| BlockHashValue::U64(h)).collect(),
        parent_block_hash: parent.map(BlockHashValue::U64),
        token_ids: tokens,
        block_size: shape.block_size as u32,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
        extra_keys: None,
    })
}

/// What was published.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Sent {
    pub messages: u64,
    pub events: u64,
    pub block_events: u64,
    /// From the first message to the last.
    pub elapsed: Duration,
    /// Block events the schedule asked for by the end and were not sent.
    pub behind: u64,
}

impl FirehoseArgs {
    pub fn run(&self) -> anyhow::Result<()> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let sent = runtime.block_on(async {
            let mut firehose = self.bind().await?;
            let warmup = tokio::time::sleep(Duration::from_secs_f64(self.warmup_secs));
            let sent = firehose.publish(warmup).await?;
            // What the sockets still queue goes out before they close (a subscriber behind
            // by more loses the rest, unseen: no later message shows the gap).
            tokio::time::sleep(LINGER).await;
            firehose.close().await;
            anyhow::Ok(sent)
        })?;
        let secs = sent.elapsed.as_secs_f64().max(1e-9);
        println!(
            "firehose: {} engines, {} messages, {} events, {} block events in {:.2} s: \
             {:.3} M block events/s ({:.0} messages/s; asked {:.3} M/s, {} block events behind)",
            self.engines,
            sent.messages,
            sent.events,
            sent.block_events,
            secs,
            sent.block_events as f64 / secs / 1e6,
            sent.messages as f64 / secs,
            self.rate as f64 / 1e6,
            sent.behind,
        );
        Ok(())
    }

    /// Checks the flags and binds every engine's socket.
    pub async fn bind(&self) -> anyhow::Result<Firehose> {
        self.shape.check()?;
        anyhow::ensure!(self.engines > 0, "--engines must be at least 1");
        anyhow::ensure!(
            self.duration_secs.is_finite() && self.duration_secs > 0.0,
            "--duration-secs must be a positive number of seconds, not {}",
            self.duration_secs
        );
        anyhow::ensure!(
            self.warmup_secs.is_finite() && self.warmup_secs >= 0.0,
            "--warmup-secs must be 0 or more seconds, not {}",
            self.warmup_secs
        );
        let mut sockets = Vec::with_capacity(self.engines);
        for i in 0..self.engines {
            let endpoint = kvroute_sim::server::rank_endpoint(&self.endpoint, i)
                .map_err(anyhow::Error::msg)?;
            let mut socket = zeromq::PubSocket::new();
            socket
                .bind(&endpoint)
                .await
                .with_context(|| format!("cannot bind {endpoint}"))?;
            sockets.push(socket);
        }
        Ok(Firehose {
            engines: (0..self.engines)
                .map(|i| Engine::new(i, &self.shape, self.seed))
                .collect(),
            sockets,
            seqs: vec![0; self.engines],
            args: self.clone(),
        })
    }
}

/// How long the sockets stay open after the last message.
const LINGER: Duration = Duration::from_secs(2);

/// How often each engine sends an empty batch until the stream starts.
const PRIMER_EVERY: Duration = Duration::from_millis(10);

/// The engines, their sockets bound ([`FirehoseArgs::bind`]).
pub struct Firehose {
    args: FirehoseArgs,
    engines: Vec<Engine>,
    sockets: Vec<zeromq::PubSocket>,
    seqs: Vec<u64>,
}

impl Firehose {
    /// Until `ready`, sends an empty batch on every socket every [`PRIMER_EVERY`]: a PUB
    /// socket drops what it sends before a subscriber's subscription arrives, so a subscriber
    /// takes its first sequence number from a primer and misses nothing of the stream. Then
    /// publishes on schedule for `--duration-secs`, an engine's step at a time, engine after
    /// engine.
    pub async fn publish(
        &mut self,
        ready: impl std::future::Future<Output = ()>,
    ) -> anyhow::Result<Sent> {
        let primer = encode_batch(
            &KvEventBatch {
                ts: 0.0,
                events: Vec::new(),
                dp_rank: Some(0),
            },
            Encoding::Array,
        );
        let mut primers = tokio::time::interval(PRIMER_EVERY);
        tokio::pin!(ready);
        loop {
            tokio::select! {
                () = &mut ready => break,
                _ = primers.tick() => {
                    for engine in 0..self.engines.len() {
                        self.send(engine, primer.clone()).await?;
                    }
                }
            }
        }
        let (rate, shape) = (self.args.rate as f64, self.args.shape);
        let mut sent = Sent::default();
        let duration = Duration::from_secs_f64(self.args.duration_secs);
        let start = Instant::now();
        let mut next = 0;
        while start.elapsed() < duration {
            let due = (rate * start.elapsed().as_secs_f64()) as u64;
            if sent.block_events >= due {
                // Ahead of the schedule: its pace, not a wait for anything.
                tokio::time::sleep(Duration::from_millis(1)).await;
                continue;
            }
            let (batch, blocks) = self.engines[next].step(&shape);
            self.send(next, encode_batch(&batch, Encoding::Array))
                .await?;
            sent.messages += 1;
            sent.events += batch.events.len() as u64;
            sent.block_events += blocks as u64;
            next = (next + 1) % self.engines.len();
        }
        sent.elapsed = start.elapsed();
        let due = (rate * sent.elapsed.as_secs_f64()) as u64;
        sent.behind = due.saturating_sub(sent.block_events);
        Ok(sent)
    }

    /// `payload` as engine `engine`'s next message.
    async fn send(&mut self, engine: usize, payload: Vec<u8>) -> anyhow::Result<()> {
        let frames = vec![
            Bytes::from_static(b""),
            Bytes::copy_from_slice(&encode_seq(self.seqs[engine])),
            Bytes::from(payload),
        ];
        let message = ZmqMessage::try_from(frames).expect("three frames");
        self.sockets[engine]
            .send(message)
            .await
            .context("publishing")?;
        self.seqs[engine] += 1;
        Ok(())
    }

    pub async fn close(self) {
        for socket in self.sockets {
            let _ = socket.close().await;
        }
    }
}

impl std::fmt::Debug for Firehose {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Firehose")
            .field("args", &self.args)
            .field("seqs", &self.seqs)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_index::{EngineHash, KvIndex, KvIndexer, ReplicaId, StorageTier, StoredBlocks};

    fn shape() -> Shape {
        Shape {
            engine_blocks: 256,
            block_size: 4,
            prefixes: 3,
            prefix_blocks: 8,
            suffix_blocks: 10,
        }
    }

    /// Applies a batch as the router does (each event to the engine's replica).
    fn apply(index: &mut KvIndex, replica: ReplicaId, batch: &KvEventBatch) {
        for event in &batch.events {
            match event {
                KvEvent::BlockStored(stored) => {
                    let hashes: Vec<EngineHash> = (stored.block_hashes.iter())
                        .map(|h| EngineHash(h.to_u64()))
                        .collect();
                    let event = StoredBlocks {
                        parent: stored
                            .parent_block_hash
                            .as_ref()
                            .map(|h| EngineHash(h.to_u64())),
                        engine_hashes: &hashes,
                        token_ids: &stored.token_ids,
                        block_size: stored.block_size as usize,
                        tier: stored.tier(),
                        salt: 0,
                    };
                    index
                        .apply_stored(replica, &event)
                        .expect("every parent is held");
                }
                KvEvent::BlockRemoved(removed) => {
                    let hashes: Vec<EngineHash> = (removed.block_hashes.iter())
                        .map(|h| EngineHash(h.to_u64()))
                        .collect();
                    index.apply_removed(replica, StorageTier::Device, &hashes);
                }
                KvEvent::AllBlocksCleared => index.clear_replica(replica),
            }
        }
    }

    #[test]
    fn engines_churn_at_full_size_with_every_parent_held() {
        let shape = shape();
        let mut index = KvIndex::new(shape.block_size);
        let mut engines: Vec<Engine> = (0..3).map(|i| Engine::new(i, &shape, 7)).collect();
        let mut block_events = 0;
        for step in 0..200 {
            for (i, engine) in engines.iter_mut().enumerate() {
                let (batch, blocks) = engine.step(&shape);
                let removed = (batch.events.iter())
                    .filter(|e| matches!(e, KvEvent::BlockRemoved(_)))
                    .count();
                apply(&mut index, ReplicaId(i as u32), &batch);
                let replica = index.replica_blocks(ReplicaId(i as u32)).device;
                assert_eq!(replica as usize, engine.held(), "engine {i} step {step}");
                assert!(engine.held() <= shape.engine_blocks);
                if step >= 30 {
                    // Full: a step evicts a block for each it stores (all but a new prompt's).
                    assert!(engine.held() + shape.suffix_blocks > shape.engine_blocks);
                    assert!(removed >= shape.suffix_blocks, "step {step}: {removed}");
                }
                block_events += blocks;
            }
        }
        assert!(block_events > 200 * 3 * 2 * shape.suffix_blocks * 9 / 10);
        // The system prompts' blocks are the same on every engine: the router holds each
        // once, with every engine that stored it.
        let prompt: Vec<u32> = (0..shape.prefix_blocks * shape.block_size)
            .map(|t| (mix64(1, t as u64) % VOCABULARY) as u32)
            .collect();
        let hashes = kvroute_index::block_hashes(&prompt, shape.block_size, 0);
        let scores = index.find_matches(&hashes);
        assert_eq!(scores.scores.len(), 3, "{scores:?}");
        assert!(scores
            .scores
            .iter()
            .all(|(_, c)| c.total() == shape.prefix_blocks as u32));
    }

    #[test]
    fn a_cache_too_small_for_the_prompts_is_refused() {
        let shape = Shape {
            engine_blocks: 20,
            ..shape()
        };
        let error = shape.check().unwrap_err().to_string();
        assert!(error.contains("--engine-blocks 20"), "{error}");
    }
}
