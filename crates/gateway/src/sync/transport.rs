//! The transport: a task that publishes this replica's messages on NATS and applies the
//! peers' to the local ranks.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use kvroute_core::affinity::Affinity;
use kvroute_core::{Observation, Observed};
use kvroute_index::BlockHash;

use super::snapshot::{self, Part};
use super::{decode, encode, Envelope, Ledger, LoadOp, Message, ReplicaTag};
use crate::config::SyncConfig;
use crate::kv::KvState;
use crate::workers::{Half, Pool, RoutingTable, WorkerSet};

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

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MessageLabels {
    direction: &'static str,
    kind: &'static str,
}

/// `kvroute_replica_peers`, `kvroute_replica_sync_messages_total{direction,kind}`
/// (direction `out` or `in`; kind routed, first_token, finished, heartbeat, snapshot (an
/// answer sent, a part received), and on `in` also malformed, own, ignored),
/// `kvroute_replica_sync_bytes_total{direction}`, `kvroute_replica_sync_lag_seconds` (send
/// to apply, of the last message applied), `kvroute_replica_sync_connected`.
#[derive(Debug, Clone, Default)]
pub struct SyncMetrics {
    peers: Gauge,
    connected: Gauge,
    messages: Family<MessageLabels, Counter>,
    bytes: Family<DirectionLabels, Counter>,
    lag: Gauge<f64, AtomicU64>,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabels {
    direction: &'static str,
}

impl SyncMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        registry.register(
            "kvroute_replica_peers",
            "Other router replicas heard from within --replica-timeout-secs",
            m.peers.clone(),
        );
        registry.register(
            "kvroute_replica_sync_connected",
            "Whether the replica sync is connected to NATS (1) or routing on local state (0)",
            m.connected.clone(),
        );
        registry.register(
            "kvroute_replica_sync_messages",
            "Replica sync messages, by direction and kind",
            m.messages.clone(),
        );
        registry.register(
            "kvroute_replica_sync_bytes",
            "Replica sync payload bytes, by direction",
            m.bytes.clone(),
        );
        registry.register(
            "kvroute_replica_sync_lag_seconds",
            "From a peer's send to this replica's apply, for the last message applied",
            m.lag.clone(),
        );
        m
    }

    fn count_bytes(&self, direction: &'static str, n: usize) {
        self.bytes
            .get_or_create(&DirectionLabels { direction })
            .inc_by(n as u64);
    }

    fn count(&self, direction: &'static str, kind: &'static str) {
        self.messages
            .get_or_create(&MessageLabels { direction, kind })
            .inc();
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
}

/// How long a starting replica waits for its peers' first answers.
const LOAD_WINDOW: Duration = Duration::from_secs(1);

/// A snapshot answer that stops for this long is given up (its sender died meanwhile).
const QUIET: Duration = Duration::from_secs(3);

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

/// The pool whose policy made a peer's decision.
fn pool_of<'a>(table: &'a RoutingTable, model: &str, half: Option<Half>) -> Option<&'a Pool> {
    let named = (!model.is_empty()).then_some(model);
    match half {
        None => table.resolve(named).ok(),
        Some(half) => table.resolve_half(half, named).ok(),
    }
}

fn apply(local: &Local, op: LoadOp) {
    if let LoadOp::Many(ops) = op {
        for op in ops {
            apply(local, op);
        }
        return;
    }
    let (worker, dp_rank) = match &op {
        LoadOp::Many(_) => return,
        LoadOp::Start {
            worker, dp_rank, ..
        }
        | LoadOp::FirstToken {
            worker, dp_rank, ..
        }
        | LoadOp::Finish {
            worker, dp_rank, ..
        } => (worker, *dp_rank),
    };
    let Some(w) = local.workers.get(worker) else {
        return;
    };
    let Some(rank) = w.rank(dp_rank) else {
        return;
    };
    let kv = &local.kv;
    match &op {
        LoadOp::Start { load, learnt, .. } => {
            rank.start(load);
            let now = Instant::now();
            if !kv.uses_events(&w) {
                let hashes: Vec<BlockHash> = load.blocks.iter().map(|&h| BlockHash(h)).collect();
                kv.record_routed(rank.replica, &hashes, now);
            }
            let Some(l) = learnt else { return };
            if let (true, Some(a), Some(key)) = (l.bind, &local.affinity, &l.session_key) {
                a.bind(key, w.id.as_str(), rank.dp_rank, now);
            }
            let table = local.workers.table();
            if let Some(pool) = pool_of(&table, &l.model, l.half) {
                let request = kvroute_core::RouteRequest {
                    session_key: l.session_key.as_deref(),
                    text: &l.text,
                    prompt_tokens: l.tokens.len(),
                    tokens: &l.tokens,
                    block_size: kv.block_size,
                    has_preferred_taints: false,
                    dry_run: false,
                    now,
                };
                pool.policy.observe(&w.id, rank.dp_rank, &request);
            }
        }
        LoadOp::FirstToken { load, .. } => rank.first_token(load),
        LoadOp::Finish {
            load, prefilling, ..
        } => rank.finish(load, *prefilling),
        LoadOp::Many(_) => {}
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

/// Asks the live peers for their load and one of them for the shared state, applying the
/// answers as they come. Returns once every answer is complete (and at least
/// [`LOAD_WINDOW`] after asking), or when the answers stop for [`QUIET`].
async fn take_snapshot(
    client: &async_nats::Client,
    subject: &str,
    me: ReplicaTag,
    ledger: &mut Ledger,
    local: &Local,
    metrics: &SyncMetrics,
) {
    let inbox = client.new_inbox();
    let Ok(mut answers) = client.subscribe(inbox.clone()).await else {
        return;
    };
    let ask = |state_from| {
        let ask = snapshot::Ask {
            sender: me,
            state_from,
        };
        rmp_serde::to_vec_named(&ask).expect("an ask always encodes")
    };
    if client
        .publish_with_reply(subject.to_owned(), inbox.clone(), ask(None).into())
        .await
        .is_err()
    {
        return;
    }
    let window = tokio::time::Instant::now() + LOAD_WINDOW;
    let mut last_heard = tokio::time::Instant::now();
    // Peers whose load answer has begun and not ended; the peer asked for the state.
    let mut loading = std::collections::HashSet::new();
    let mut answered = std::collections::HashSet::new();
    let mut state_from = None;
    let mut state_done = false;
    let mut learnt = 0usize;
    loop {
        let complete = loading.is_empty() && (state_from.is_none() || state_done);
        if complete && tokio::time::Instant::now() >= window {
            break;
        }
        let wake = if complete {
            window
        } else {
            window.max(last_heard + QUIET)
        };
        let msg = tokio::select! {
            _ = tokio::time::sleep_until(wake) => {
                if !complete {
                    tracing::warn!("Replica sync: a peer's snapshot stopped part-way; ready with what came");
                }
                break;
            }
            msg = answers.next() => match msg {
                Some(msg) => msg,
                None => break,
            },
        };
        last_heard = tokio::time::Instant::now();
        metrics.count_bytes("in", msg.payload.len());
        let Some(snapshot::Answer { sender, part }) = snapshot::decode(&msg.payload) else {
            metrics.count("in", "malformed");
            continue;
        };
        if sender == me {
            continue;
        }
        metrics.count("in", "snapshot");
        answered.insert(sender);
        let now = Instant::now();
        match part {
            Part::Live(live) => {
                loading.insert(sender);
                for body in live {
                    if let Ok(Some(op)) = ledger.apply_snapshot(sender, body, now) {
                        apply(local, op);
                    }
                }
            }
            Part::Policy {
                model,
                half,
                observations,
            } => {
                let observations: Vec<Observation> =
                    observations.into_iter().map(Into::into).collect();
                learnt += observations.len();
                if let Some(pool) = pool_of(&local.workers.table(), &model, half) {
                    pool.policy.restore(&observations, now);
                }
            }
            Part::Affinity(bindings) => {
                let bindings: Vec<Observation> = bindings.into_iter().map(Into::into).collect();
                learnt += bindings.len();
                if let Some(a) = &local.affinity {
                    a.restore(&bindings, now);
                }
            }
            Part::ApproxKv(records) => {
                learnt += records.len();
                for o in records.into_iter().map(Observation::from) {
                    let replica = local
                        .workers
                        .get(o.worker.as_str())
                        .and_then(|w| w.rank(o.dp_rank).map(|r| r.replica));
                    if let (Some(replica), Observed::Blocks(blocks)) = (replica, &o.learnt) {
                        let hashes: Vec<BlockHash> = blocks.iter().map(|&b| BlockHash(b)).collect();
                        local.kv.record_routed(replica, &hashes, o.at(now));
                    }
                }
            }
            Part::End { state: false } => {
                loading.remove(&sender);
            }
            Part::End { state: true } => state_done |= state_from == Some(sender),
        }
        // The first peer to answer is asked for the shared state.
        if state_from.is_none() {
            state_from = Some(sender);
            let asked = client
                .publish_with_reply(subject.to_owned(), inbox.clone(), ask(state_from).into())
                .await;
            state_done = asked.is_err();
        }
    }
    tracing::info!(
        peers = answered.len(),
        in_flight = ledger.remote_in_flight(),
        learnt,
        "Replica sync: snapshot taken"
    );
}

/// The parts of this replica's answer to `ask`, as payloads to publish in order: its
/// requests in flight, or (when it is the one asked) the shared state. `None` when the
/// ask is not for it.
fn answer_parts(
    me: ReplicaTag,
    ask: &snapshot::Ask,
    live: &std::collections::HashMap<u64, Message>,
    local: &Local,
) -> Option<Vec<Vec<u8>>> {
    let part = |part| snapshot::encode(&snapshot::Answer { sender: me, part });
    if ask.sender == me {
        return None;
    }
    match ask.state_from {
        None => {
            let mut out: Vec<Vec<u8>> =
                snapshot::pack_live(live.values().cloned(), snapshot::PART_BYTES)
                    .into_iter()
                    .map(|group| part(Part::Live(group)))
                    .collect();
            out.push(part(Part::End { state: false }));
            Some(out)
        }
        Some(tag) if tag == me => {
            let now = Instant::now();
            let mut out = Vec::new();
            let table = local.workers.table();
            for (half, pool) in table.every_pool() {
                let obs = pool.policy.snapshot(now, snapshot::STATE_BYTES);
                for group in snapshot::pack(obs, snapshot::PART_BYTES) {
                    out.push(part(Part::Policy {
                        model: pool.model.as_str().to_owned(),
                        half,
                        observations: group,
                    }));
                }
            }
            if let Some(a) = &local.affinity {
                let obs = a.snapshot(now, snapshot::STATE_BYTES);
                for group in snapshot::pack(obs, snapshot::PART_BYTES) {
                    out.push(part(Part::Affinity(group)));
                }
            }
            let obs = routed_observations(local, now);
            for group in snapshot::pack(obs, snapshot::PART_BYTES) {
                out.push(part(Part::ApproxKv(group)));
            }
            out.push(part(Part::End { state: true }));
            Some(out)
        }
        Some(_) => None,
    }
}

/// The approximate KV index as observations of (worker, rank), oldest first.
fn routed_observations(local: &Local, now: Instant) -> Vec<Observation> {
    let ranks: std::collections::HashMap<
        kvroute_index::ReplicaId,
        (kvroute_protocol::WorkerId, Option<u32>),
    > = local
        .workers
        .workers()
        .iter()
        .flat_map(|w| {
            w.ranks
                .iter()
                .map(|r| (r.replica, (w.id.clone(), r.dp_rank)))
        })
        .collect();
    local
        .kv
        .routed_records(now, snapshot::STATE_BYTES / 8)
        .into_iter()
        .filter_map(|(replica, age, blocks)| {
            let (worker, dp_rank) = ranks.get(&replica)?.clone();
            Some(Observation {
                worker,
                dp_rank,
                age,
                learnt: Observed::Blocks(blocks.into_iter().map(|b| b.0).collect()),
            })
        })
        .collect()
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
    let (mut sub, mut snapshots) = match tokio::try_join!(
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
    let mut seq = 0u64;
    // This replica's requests in flight (listed in its heartbeats, sent whole in
    // snapshots).
    let mut live: std::collections::HashMap<u64, Message> = std::collections::HashMap::new();
    let mut tick = tokio::time::interval(config.timeout / 3);
    let mut publish = |body: Message, client: &async_nats::Client| {
        metrics.count("out", body.kind());
        let env = Envelope {
            sender: me,
            seq,
            sent_ms: now_ms(),
            body,
        };
        seq += 1;
        let payload = encode(&env);
        metrics.count_bytes("out", payload.len());
        let client = client.clone();
        let subject = subject.clone();
        async move {
            // While NATS is away the client buffers, then drops; peers reconcile from
            // the next heartbeat.
            let _ = client.publish(subject, payload.into()).await;
        }
    };
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            out = rx.recv() => {
                let Some(body) = out else { return };
                match &body {
                    Message::Routed { request, .. } => {
                        live.insert(*request, body.clone());
                    }
                    Message::Finished { request } => {
                        live.remove(request);
                    }
                    _ => {}
                }
                publish(body, &client).await;
            }
            ask = snapshots.next() => {
                let Some(ask) = ask else { return };
                let Some(reply) = ask.reply else { continue };
                let Ok(ask) = rmp_serde::from_slice::<snapshot::Ask>(&ask.payload) else {
                    metrics.count("in", "malformed");
                    continue;
                };
                let Some(parts) = answer_parts(me, &ask, &live, &local) else { continue };
                metrics.count("out", "snapshot");
                for p in &parts {
                    metrics.count_bytes("out", p.len());
                }
                // Sent in order by a task of its own: a large state does not hold up the
                // load messages.
                let client = client.clone();
                tokio::spawn(async move {
                    for p in parts {
                        if client.publish(reply.clone(), p.into()).await.is_err() {
                            break;
                        }
                    }
                });
            }
            msg = sub.next() => {
                let Some(msg) = msg else { return };
                metrics.count_bytes("in", msg.payload.len());
                let Some(env) = decode(&msg.payload) else {
                    metrics.count("in", "malformed");
                    continue;
                };
                let kind = env.body.kind();
                let sent_ms = env.sent_ms;
                match ledger.apply(env, Instant::now()) {
                    Ok(op) => {
                        metrics.count("in", kind);
                        metrics
                            .lag
                            .set(now_ms().saturating_sub(sent_ms) as f64 / 1000.0);
                        if let Some(op) = op {
                            apply(&local, op);
                        }
                    }
                    Err(super::Ignored::Own) => metrics.count("in", "own"),
                    Err(_) => metrics.count("in", "ignored"),
                }
                metrics.peers.set(ledger.peers() as i64);
            }
            _ = tick.tick() => {
                let connected =
                    client.connection_state() == async_nats::connection::State::Connected;
                metrics.connected.set(i64::from(connected));
                publish(Message::Heartbeat { live: live.keys().copied().collect() }, &client).await;
                for op in ledger.expire(Instant::now(), config.timeout) {
                    apply(&local, op);
                }
                metrics.peers.set(ledger.peers() as i64);
            }
        }
    }
}
