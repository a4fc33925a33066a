//! The KV-event subscriber: one per worker that publishes KV events, feeding an [`EventSink`]
//! (the gateway's index) with what each data-parallel rank of that worker stores and evicts.
//!
//! # Ports: one socket per rank
//!
//! vLLM binds one ZMQ PUB socket per data-parallel rank, at the configured endpoint with the
//! port offset by the rank (`tcp://*:5557` → rank `r` binds port `5557 + r`; SGLang and
//! kvroute-sim do the same), and likewise its optional replay ROUTER socket. So
//! [`SubscriberConfig::endpoint`] is the engine's endpoint as configured (rank 0's port, with
//! a host the router can reach), and the subscriber connects one `SUB` socket per rank `r` in
//! `[dp_start_rank, dp_start_rank + dp_size)` to port `endpoint + r` ([`rank_endpoint`]),
//! subscribed to every topic.
//!
//! # Wire handling
//!
//! A message is `[topic, seq (u64 big-endian), msgpack batch]`
//! ([`kvroute_protocol::kv_events`]). A message with another frame count, a `seq` frame that is
//! not 8 bytes (or is the end-of-replay marker), or a payload that does not decode is counted
//! as `malformed`, logged at debug and skipped; nothing an engine sends stops the subscriber.
//! A payload that does not decode still advances the sequence (its `seq` was read), so it is
//! not reported a second time as a gap. A batch's events are applied in order, to the rank the
//! batch names (`data_parallel_rank`) or, when it names none, to the socket's rank:
//!
//! - `BlockStored` → [`EventSink::stored`] with the engine hashes folded to 64 bits
//!   ([`BlockHashValue::to_u64`](kvroute_protocol::kv_events::BlockHashValue::to_u64)), the tier
//!   from `medium`, and `salt` = [`stable_hash`](kvroute_protocol::stable_hash) of the LoRA
//!   name (0 without one). Per-block `extra_keys` (multimodal hashes, cache salt) are not yet
//!   folded into the salt: such blocks are indexed as if they had none.
//! - `BlockRemoved` → [`EventSink::removed`]; `AllBlocksCleared` → [`EventSink::cleared`].
//!
//! An engine block size that neither divides nor is a multiple of the router's cannot be
//! re-blocked: the event is dropped, counted as `block_size_mismatch`, and logged at error
//! level once per worker (that worker's cache is then invisible to routing). The sink's own
//! errors are counted by kind (`unknown_parent`, `token_count`, `block_size_mismatch`).
//!
//! # Sequence numbers: gaps, restarts, replay
//!
//! Each rank's socket keeps the last `seq` it accepted. The first message sets the baseline;
//! `seq == last + 1` is the normal case. `seq > last + 1` is a gap (the publisher dropped
//! messages, e.g. at its high-water mark): with a replay endpoint, the subscriber asks that
//! rank's replay socket (a `DEALER` sending `[b"", last + 1]`, reading `[b"", seq, payload]`
//! answers until `seq = -1`) and applies the missed batches in order, counted as `replayed`,
//! before the current one. When there is no replay endpoint, or the replay fails, times out or
//! does not cover every missed `seq` (the engine's buffer is bounded), the rank is cleared
//! ([`EventSink::cleared`]: its index can no longer be trusted) and a `gap` is counted.
//! `seq <= last` means the engine restarted: the rank is cleared, a `restart` counted, and the
//! batch applied as the new baseline.
//!
//! The `zeromq` crate (0.4) neither reconnects nor reports a publisher that went away, so the
//! subscriber probes an idle connection itself (every [`SubscriberTiming::probe_interval`]
//! without a message it sends an unsubscription from a topic it never subscribed to, which
//! publishers ignore; a write that fails means the peer is gone) and then reconnects. A
//! reconnect keeps the last `seq`, with one exception to the rules above: a gap across a
//! reconnect is not replayed but cleared, since it may be a restarted engine whose numbering
//! already overtook the old one. A connection that fails or hangs is retried with a backoff
//! doubling up to [`SubscriberTiming::max_backoff`], until shutdown.
//!
//! # Metrics
//!
//! `kvroute_kv_events_total{worker,event,status}` ([`KvEventMetrics`]): `event` is `stored`,
//! `removed` or `cleared` (one per engine event, `status` `ok` or the sink's error kind) or
//! `batch` (one per message: `ok`, `malformed`, `replayed`, and one per `gap` or `restart`
//! that cleared the rank).

mod apply;
mod metrics;
mod sequence;
mod session;
#[cfg(test)]
mod tests;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use kvroute_index::{EngineHash, IndexError, StorageTier, StoredBlocks};
use tokio_util::sync::CancellationToken;

pub use metrics::KvEventMetrics;

/// What the subscriber feeds: the gateway implements it over its index. Calls are
/// synchronous and come from the subscriber's task, in the order the engine published them.
pub trait EventSink: Send + Sync {
    /// Blocks stored by data-parallel rank `dp_rank` of the subscriber's worker.
    fn stored(&self, dp_rank: u32, event: &StoredBlocks<'_>) -> Result<(), IndexError>;
    /// Blocks evicted from `tier` by rank `dp_rank`.
    fn removed(&self, dp_rank: u32, tier: StorageTier, hashes: &[EngineHash]);
    /// Everything rank `dp_rank` held is gone (the engine said so, or the subscriber lost
    /// track of it: a gap it could not replay, an engine restart).
    fn cleared(&self, dp_rank: u32);
    /// The events of one published batch for rank `dp_rank`, which `apply` gives in order:
    /// the gateway applies them under one write of its index (queries see all or none of
    /// them). By default each is applied as it comes.
    fn batch(&self, dp_rank: u32, apply: &mut dyn FnMut(&mut dyn RankEvents)) {
        apply(&mut EachEvent::new(self, dp_rank));
    }
}

/// One rank's events within [`EventSink::batch`].
pub trait RankEvents {
    fn stored(&mut self, event: &StoredBlocks<'_>) -> Result<(), IndexError>;
    fn removed(&mut self, tier: StorageTier, hashes: &[EngineHash]);
    fn cleared(&mut self);
}

/// [`EventSink::batch`]'s default: each event to the sink's own methods (a sink that
/// overrides `batch` to do more around the events can still apply them through it).
pub struct EachEvent<'a, S: ?Sized> {
    sink: &'a S,
    dp_rank: u32,
}

impl<S: ?Sized> std::fmt::Debug for EachEvent<'_, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EachEvent")
            .field("dp_rank", &self.dp_rank)
            .finish_non_exhaustive()
    }
}

impl<'a, S: ?Sized> EachEvent<'a, S> {
    /// Rank `dp_rank`'s events, each to `sink`'s own methods.
    pub fn new(sink: &'a S, dp_rank: u32) -> Self {
        Self { sink, dp_rank }
    }
}

impl<S: EventSink + ?Sized> RankEvents for EachEvent<'_, S> {
    fn stored(&mut self, event: &StoredBlocks<'_>) -> Result<(), IndexError> {
        self.sink.stored(self.dp_rank, event)
    }

    fn removed(&mut self, tier: StorageTier, hashes: &[EngineHash]) {
        self.sink.removed(self.dp_rank, tier, hashes);
    }

    fn cleared(&mut self) {
        self.sink.cleared(self.dp_rank);
    }
}

/// Where and how to subscribe to one worker's KV events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscriberConfig {
    /// The worker's id, used as the `worker` metric label and in logs.
    pub worker: String,
    /// The engine's KV-event endpoint, `tcp://HOST:PORT`, with PORT the port of rank 0
    /// (vLLM's `--kv-events-config` endpoint): rank `r` publishes on `PORT + r`.
    pub endpoint: String,
    /// The engine's replay endpoint, `tcp://HOST:PORT`, offset by rank in the same way.
    pub replay_endpoint: Option<String>,
    /// The first data-parallel rank this worker serves.
    pub dp_start_rank: u32,
    /// How many data-parallel ranks, from `dp_start_rank`.
    pub dp_size: u32,
    /// The router's block size (tokens per block).
    pub router_block_size: usize,
}

/// The subscriber's timeouts; the defaults suit production, tests shorten them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubscriberTiming {
    /// How long a replay may take, connection included, before the rank is cleared instead.
    pub replay_timeout: Duration,
    /// How long a connection may stay silent before the subscriber checks it is still alive.
    pub probe_interval: Duration,
    /// How long one connection attempt (TCP and ZMTP handshake) may take.
    pub connect_timeout: Duration,
    /// The longest wait between two connection attempts.
    pub max_backoff: Duration,
}

impl Default for SubscriberTiming {
    fn default() -> Self {
        Self {
            replay_timeout: Duration::from_secs(3),
            // A dead publisher is noticed at the second failed probe (the first write after
            // the peer closed still succeeds): within ~2 s, so a restarted engine's lost
            // cache is not credited for long. A probe is a few bytes.
            probe_interval: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(30),
            max_backoff: Duration::from_secs(10),
        }
    }
}

/// A configuration the subscriber cannot use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvEventsConfigError {
    #[error("KV-event endpoint '{endpoint}': {reason}")]
    Endpoint {
        endpoint: String,
        reason: &'static str,
    },
    #[error("dp_size must be at least 1")]
    DpSize,
    #[error("the router's block size must be at least 1")]
    BlockSize,
}

/// The endpoint of rank `rank`: `tcp://HOST:PORT` with PORT offset by `rank`, as vLLM binds
/// it. Only `tcp://` is supported, and the host must be one the router can connect to (not
/// the `*` an engine binds).
pub fn rank_endpoint(endpoint: &str, rank: u32) -> Result<String, KvEventsConfigError> {
    let error = |reason| KvEventsConfigError::Endpoint {
        endpoint: endpoint.to_owned(),
        reason,
    };
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| error("only tcp://HOST:PORT endpoints are supported"))?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| error("no port (expected tcp://HOST:PORT)"))?;
    if host.is_empty() || host == "*" {
        return Err(error("name the engine's host; '*' is only for binding"));
    }
    let port: u16 = port.parse().map_err(|_| error("invalid port"))?;
    let port = u16::try_from(u32::from(port) + rank)
        .map_err(|_| error("the port plus the data-parallel rank exceeds 65535"))?;
    Ok(format!("tcp://{host}:{port}"))
}

/// The endpoints of one rank.
#[derive(Debug, Clone)]
struct RankEndpoints {
    rank: u32,
    events: String,
    replay: Option<String>,
}

/// Subscribes to one worker's KV events, one socket per data-parallel rank.
pub struct KvEventSubscriber {
    config: SubscriberConfig,
    timing: SubscriberTiming,
    ranks: Vec<RankEndpoints>,
    applier: apply::Applier,
}

impl fmt::Debug for KvEventSubscriber {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvEventSubscriber")
            .field("config", &self.config)
            .field("timing", &self.timing)
            .finish_non_exhaustive()
    }
}

impl KvEventSubscriber {
    /// Validates the configuration; does no I/O.
    pub fn new(
        config: SubscriberConfig,
        sink: Arc<dyn EventSink>,
        metrics: &KvEventMetrics,
    ) -> Result<Self, KvEventsConfigError> {
        if config.dp_size == 0 {
            return Err(KvEventsConfigError::DpSize);
        }
        if config.router_block_size == 0 {
            return Err(KvEventsConfigError::BlockSize);
        }
        let last = config
            .dp_start_rank
            .checked_add(config.dp_size - 1)
            .ok_or(KvEventsConfigError::DpSize)?;
        let ranks = (config.dp_start_rank..=last)
            .map(|rank| {
                Ok(RankEndpoints {
                    rank,
                    events: rank_endpoint(&config.endpoint, rank)?,
                    replay: config
                        .replay_endpoint
                        .as_deref()
                        .map(|e| rank_endpoint(e, rank))
                        .transpose()?,
                })
            })
            .collect::<Result<Vec<_>, KvEventsConfigError>>()?;
        let applier = apply::Applier::new(
            config.worker.clone(),
            sink,
            metrics.worker(&config.worker),
            config.router_block_size,
        );
        Ok(Self {
            config,
            timing: SubscriberTiming::default(),
            ranks,
            applier,
        })
    }

    /// Replaces the default timeouts.
    pub fn with_timing(mut self, timing: SubscriberTiming) -> Self {
        self.timing = timing;
        self
    }

    pub fn config(&self) -> &SubscriberConfig {
        &self.config
    }

    /// Subscribes every rank and applies their events until `shutdown`; all ranks are
    /// driven by this one future, which spawns nothing.
    pub async fn run(self, shutdown: CancellationToken) {
        tracing::info!(
            worker = %self.config.worker,
            endpoint = %self.config.endpoint,
            dp_start_rank = self.config.dp_start_rank,
            dp_size = self.config.dp_size,
            "Subscribing to KV events"
        );
        let ranks = self
            .ranks
            .iter()
            .map(|rank| session::run_rank(&self.applier, &self.timing, rank, &shutdown));
        futures_util::future::join_all(ranks).await;
    }
}
