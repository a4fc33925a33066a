//! The transport: a task that publishes this replica's messages on NATS and applies the
//! peers' to the local ranks (`apply`), after the start-up snapshot exchange
//! (`startup`); its series are in `metrics`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use kvroute_core::affinity::Affinity;

use super::snapshot;
use super::{decode, encode, Envelope, Ledger, Message, ReplicaTag};
use crate::config::SyncConfig;
use crate::kv::KvState;
use crate::workers::WorkerSet;

mod apply;
mod metrics;
mod startup;

pub use metrics::SyncMetrics;

use apply::apply;
use startup::{answer_parts, take_snapshot};

/// What the request path holds: sends this replica's messages to the task (never blocks).
#[derive(Debug, Clone)]
pub struct SyncHandle {
    tx: mpsc::UnboundedSender<Message>,
    next_request: Arc<AtomicU64>,
    /// Set once the snapshot from the live peers was applied (or none answered).
    pub synced: Arc<std::sync::atomic::AtomicBool>,
}

impl SyncHandle {
    pub fn request_id(&self) -> u64 {
        self.next_request.fetch_add(1, Ordering::Relaxed)
    }

    pub fn send(&self, msg: Message) {
        let _ = self.tx.send(msg);
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// What the sync reads and changes on this replica.
#[derive(Debug, Clone)]
pub struct Local {
    pub workers: Arc<WorkerSet>,
    pub kv: Arc<KvState>,
    /// The session bindings (`--session-affinity-ttl-secs`).
    pub affinity: Option<Arc<Affinity>>,
    /// The tenants' rate limits, when on.
    pub rate_limits: Option<Arc<crate::rate_limit::RateLimiter>>,
}

/// Starts the sync task; returns the handle for the request path.
pub fn spawn(
    config: SyncConfig,
    local: Local,
    metrics: SyncMetrics,
    tasks: &tokio_util::task::TaskTracker,
    shutdown: CancellationToken,
) -> SyncHandle {
    let (tx, rx) = mpsc::unbounded_channel();
    let me: ReplicaTag = rand::random();
    let synced = Arc::new(std::sync::atomic::AtomicBool::new(false));
    tasks.spawn(run(
        config,
        me,
        local,
        metrics,
        rx,
        synced.clone(),
        shutdown,
    ));
    SyncHandle {
        tx,
        next_request: Arc::new(AtomicU64::new(0)),
        synced,
    }
}

/// Connects, retrying every second until it succeeds (`None`: shut down meanwhile).
/// After a first failure the replica is `synced` on its own state (it reports ready and
/// routes on local state; there is no peer to learn from until NATS is back). What it routes
/// meanwhile is dropped: peers cannot learn it anyway.
async fn connect(
    config: &SyncConfig,
    metrics: &SyncMetrics,
    rx: &mut mpsc::UnboundedReceiver<Message>,
    synced: &std::sync::atomic::AtomicBool,
    shutdown: &CancellationToken,
) -> Option<async_nats::Client> {
    loop {
        let attempt = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(2))
            .connect(config.url.as_str());
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            c = attempt => match c {
                Ok(c) => return Some(c),
                Err(error) => {
                    metrics.connected.set(0);
                    synced.store(true, Ordering::Relaxed);
                    tracing::warn!(url = %config.url, %error, "Replica sync: NATS unreachable; routing on local state, retrying");
                    while rx.try_recv().is_ok() {}
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }
}

async fn run(
    config: SyncConfig,
    me: ReplicaTag,
    local: Local,
    metrics: SyncMetrics,
    mut rx: mpsc::UnboundedReceiver<Message>,
    synced: Arc<std::sync::atomic::AtomicBool>,
    shutdown: CancellationToken,
) {
    let subject = format!("{}.load", config.prefix);
    let Some(client) = connect(&config, &metrics, &mut rx, &synced, &shutdown).await else {
        return;
    };
    let snapshot_subject = format!("{}.snapshot", config.prefix);
    let (sub, snapshots) = match tokio::try_join!(
        client.subscribe(subject.clone()),
        client.subscribe(snapshot_subject.clone())
    ) {
        Ok(s) => s,
        Err(error) => {
            tracing::error!(%error, "Replica sync: cannot subscribe");
            synced.store(true, Ordering::Relaxed);
            return;
        }
    };
    let mut ledger = Ledger::new(me, 1 << 20);
    // Before reporting ready: the live peers' requests in flight and the shared state, so
    // as not to route blind.
    take_snapshot(
        &client,
        &snapshot_subject,
        me,
        &mut ledger,
        &local,
        &metrics,
    )
    .await;
    synced.store(true, Ordering::Relaxed);
    tracing::info!(url = %config.url, subject, "Replica sync on");
    metrics.connected.set(1);
    let tick = tokio::time::interval(config.timeout / 3);
    let replica = Replica {
        me,
        config,
        client,
        subject,
        local,
        metrics,
        ledger,
        live: std::collections::HashMap::new(),
        seq: 0,
    };
    replica.serve(rx, sub, snapshots, tick, shutdown).await;
}

/// The sync task once connected and synced.
struct Replica {
    me: ReplicaTag,
    config: SyncConfig,
    client: async_nats::Client,
    /// Where the load messages go, this replica's and its peers'.
    subject: String,
    local: Local,
    metrics: SyncMetrics,
    ledger: Ledger,
    /// This replica's requests in flight (listed in its heartbeats, sent whole in snapshots):
    /// each as routed, and whether its first token has come (so that a starting replica
    /// counts it as decoding, not prefilling).
    live: std::collections::HashMap<u64, (Message, bool)>,
    /// The sequence number of this replica's next message.
    seq: u64,
}

impl Replica {
    /// Publishes this replica's messages, answers the starting peers' snapshot asks, applies
    /// the peers' messages and sends the heartbeats, until shut down.
    async fn serve(
        mut self,
        mut rx: mpsc::UnboundedReceiver<Message>,
        mut sub: async_nats::Subscriber,
        mut snapshots: async_nats::Subscriber,
        mut tick: tokio::time::Interval,
        shutdown: CancellationToken,
    ) {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                out = rx.recv() => {
                    let Some(body) = out else { return };
                    self.own(body).await;
                }
                ask = snapshots.next() => {
                    let Some(ask) = ask else { return };
                    self.answer(ask);
                }
                msg = sub.next() => {
                    let Some(msg) = msg else { return };
                    self.peer(msg);
                }
                _ = tick.tick() => self.heartbeat().await,
            }
        }
    }

    /// Publishes one of this replica's messages, after noting it in `live`.
    async fn own(&mut self, body: Message) {
        match &body {
            Message::Routed { request, .. } => {
                self.live.insert(*request, (body.clone(), false));
            }
            Message::FirstToken { request } => {
                if let Some((_, first)) = self.live.get_mut(request) {
                    *first = true;
                }
            }
            Message::Finished { request } => {
                self.live.remove(request);
            }
            _ => {}
        }
        self.publish(body).await;
    }

    async fn publish(&mut self, body: Message) {
        self.metrics.count("out", body.kind());
        let env = Envelope {
            sender: self.me,
            seq: self.seq,
            sent_ms: now_ms(),
            body,
        };
        self.seq += 1;
        let payload = encode(&env);
        self.metrics.count_bytes("out", payload.len());
        // While NATS is away the client buffers, then drops; peers reconcile from the next
        // heartbeat.
        let _ = self
            .client
            .publish(self.subject.clone(), payload.into())
            .await;
    }

    /// Answers a starting peer's snapshot ask (see [`answer_parts`]).
    fn answer(&self, ask: async_nats::Message) {
        let Some(reply) = ask.reply else { return };
        let Ok(ask) = rmp_serde::from_slice::<snapshot::Ask>(&ask.payload) else {
            self.metrics.count("in", "malformed");
            return;
        };
        let Some(parts) = answer_parts(self.me, &ask, &self.live, &self.local) else {
            return;
        };
        self.metrics.count("out", "snapshot");
        for p in &parts {
            self.metrics.count_bytes("out", p.len());
        }
        // Sent in order by a task of its own: a large state does not hold up the load
        // messages.
        let client = self.client.clone();
        tokio::spawn(async move {
            for p in parts {
                if client.publish(reply.clone(), p.into()).await.is_err() {
                    break;
                }
            }
        });
    }

    /// Applies a peer's message to the local ranks, through the ledger.
    fn peer(&mut self, msg: async_nats::Message) {
        let metrics = &self.metrics;
        metrics.count_bytes("in", msg.payload.len());
        let Some(env) = decode(&msg.payload) else {
            metrics.count("in", "malformed");
            return;
        };
        let kind = env.body.kind();
        let sent_ms = env.sent_ms;
        match self.ledger.apply(env, Instant::now()) {
            Ok(op) => {
                metrics.count("in", kind);
                metrics
                    .lag
                    .set(now_ms().saturating_sub(sent_ms) as f64 / 1000.0);
                if let Some(op) = op {
                    apply(&self.local, op);
                }
            }
            Err(super::Ignored::Own) => metrics.count("in", "own"),
            Err(_) => metrics.count("in", "ignored"),
        }
        metrics.peers.set(self.ledger.peers() as i64);
    }

    /// Sends this replica's heartbeat and expires the peers that stopped sending theirs.
    async fn heartbeat(&mut self) {
        let connected = self.client.connection_state() == async_nats::connection::State::Connected;
        self.metrics.connected.set(i64::from(connected));
        let live = self.live.keys().copied().collect();
        self.publish(Message::Heartbeat { live }).await;
        for op in self.ledger.expire(Instant::now(), self.config.timeout) {
            apply(&self.local, op);
        }
        self.metrics.peers.set(self.ledger.peers() as i64);
    }
}
