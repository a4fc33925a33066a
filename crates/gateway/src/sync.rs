//! Router replicas in sync over NATS (`--replica-sync nats://...`).
//!
//! Each replica publishes on `{prefix}.load` what its own requests do — routed (worker, rank,
//! load, and what its policy learnt: the session key, the text for cache_aware, the tokens
//! for llm_d), first token, finished — and a heartbeat listing its live requests; it applies
//! what the others publish as the same rank load operations and policy updates
//! (`Policy::observe`) a local request performs, and ignores its own messages. [`Ledger`]
//! is the pure part: a peer's messages as load operations, reconciled by its heartbeats,
//! all taken back when it falls silent. [`transport`] is the NATS side: connection with
//! retry (routing goes on with local state meanwhile), the snapshot a starting replica asks
//! the live ones for (their requests in flight) before it reports ready, and the metrics.
//! KV events are not relayed: every replica subscribes to every engine's publisher.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvroute_core::RequestLoad;
use serde::{Deserialize, Serialize};

/// A router replica's id (random at start).
pub type ReplicaTag = u64;

/// One message on the sync subjects.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    pub sender: ReplicaTag,
    /// The sender's message counter (gaps say messages were lost).
    pub seq: u64,
    /// When it was sent, milliseconds since the Unix epoch (for the sync lag).
    #[serde(default)]
    pub sent_ms: u64,
    pub body: Message,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Message {
    /// A request was sent to (worker, rank) with this load.
    Routed {
        request: u64,
        /// The model whose policy chose (each model has its own policy state).
        model: String,
        worker: String,
        dp_rank: Option<u32>,
        /// The session key, for session maps (`manual`).
        session_key: Option<String>,
        /// The routing text, for text-keyed trees (`cache_aware`); empty otherwise.
        text: String,
        /// The prompt's tokens, for token-keyed caches (`llm_d`); empty otherwise.
        #[serde(default)]
        tokens: Vec<u32>,
        prefill_tokens: u64,
        blocks: Vec<u64>,
        own_blocks: u64,
    },
    /// Its first token came back: its prefill load ends.
    FirstToken { request: u64 },
    /// It ended (completed, failed or abandoned).
    Finished { request: u64 },
    /// The sender is alive, with these requests in flight (the others it sent are over:
    /// a peer that missed their `Finished` drops them here).
    Heartbeat { live: Vec<u64> },
}

impl Message {
    /// The `kind` label of `kvroute_replica_sync_messages_total`.
    pub fn kind(&self) -> &'static str {
        match self {
            Message::Routed { .. } => "routed",
            Message::FirstToken { .. } => "first_token",
            Message::Finished { .. } => "finished",
            Message::Heartbeat { .. } => "heartbeat",
        }
    }
}

/// What a peer's policy learnt from its decision, for this replica's policy to learn too.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Learnt {
    pub model: String,
    pub session_key: Option<String>,
    /// `cache_aware`'s key.
    pub text: String,
    /// `llm_d`'s key.
    pub tokens: Vec<u32>,
}

/// What to do to a local rank's load on behalf of a peer.
#[derive(Debug, Clone, PartialEq)]
pub enum LoadOp {
    /// Several at once (a heartbeat's reconciliation).
    Many(Vec<LoadOp>),
    Start {
        worker: String,
        dp_rank: Option<u32>,
        load: RequestLoad,
        /// What the peer's policy learnt from the decision.
        learnt: Option<Learnt>,
    },
    FirstToken {
        worker: String,
        dp_rank: Option<u32>,
        load: RequestLoad,
    },
    Finish {
        worker: String,
        dp_rank: Option<u32>,
        load: RequestLoad,
        /// Whether it never saw its first token (its prefill load is still counted).
        prefilling: bool,
    },
}

#[derive(Debug)]
struct Remote {
    worker: String,
    dp_rank: Option<u32>,
    load: RequestLoad,
    first_token: bool,
}

#[derive(Debug, Default)]
struct Peer {
    last_seen: Option<Instant>,
    last_seq: Option<u64>,
    lost: u64,
    requests: HashMap<u64, Remote>,
}

/// The peers' requests as this replica knows them.
#[derive(Debug)]
pub struct Ledger {
    me: ReplicaTag,
    peers: HashMap<ReplicaTag, Peer>,
    /// A peer's request map is bounded: past this, the oldest entries are not tracked.
    max_requests_per_peer: usize,
}

/// Why a message was not applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ignored {
    /// This replica's own message, echoed back.
    Own,
    /// An operation on a request the ledger does not hold (its `Routed` was lost, or the
    /// peer was expired meanwhile).
    UnknownRequest,
    /// A `Routed` for a request already held.
    Duplicate,
    /// The peer has more requests in flight than the ledger tracks.
    Full,
}

impl Ledger {
    pub fn new(me: ReplicaTag, max_requests_per_peer: usize) -> Self {
        Self {
            me,
            peers: HashMap::new(),
            max_requests_per_peer,
        }
    }

    /// Applies one message received at `now`: the load operation it implies, if any.
    pub fn apply(&mut self, msg: Envelope, now: Instant) -> Result<Option<LoadOp>, Ignored> {
        if msg.sender == self.me {
            return Err(Ignored::Own);
        }
        let peer = self.peers.entry(msg.sender).or_default();
        peer.last_seen = Some(now);
        if let Some(last) = peer.last_seq {
            if msg.seq > last + 1 {
                peer.lost += msg.seq - last - 1;
            }
        }
        peer.last_seq = Some(msg.seq.max(peer.last_seq.unwrap_or(0)));
        match msg.body {
            Message::Heartbeat { live } => {
                // One sender's messages arrive in order: a request it routed before this
                // heartbeat and did not list has ended.
                let live: std::collections::HashSet<u64> = live.into_iter().collect();
                let over: Vec<u64> = peer
                    .requests
                    .keys()
                    .filter(|r| !live.contains(r))
                    .copied()
                    .collect();
                let ops: Vec<LoadOp> = over
                    .into_iter()
                    .filter_map(|r| peer.requests.remove(&r))
                    .map(finish)
                    .collect();
                Ok((!ops.is_empty()).then_some(LoadOp::Many(ops)))
            }
            Message::Routed {
                request,
                model,
                worker,
                dp_rank,
                session_key,
                text,
                tokens,
                prefill_tokens,
                blocks,
                own_blocks,
            } => {
                if peer.requests.contains_key(&request) {
                    return Err(Ignored::Duplicate);
                }
                if peer.requests.len() >= self.max_requests_per_peer {
                    return Err(Ignored::Full);
                }
                let load = RequestLoad {
                    prefill_tokens,
                    blocks,
                    own_blocks,
                };
                peer.requests.insert(
                    request,
                    Remote {
                        worker: worker.clone(),
                        dp_rank,
                        load: load.clone(),
                        first_token: false,
                    },
                );
                Ok(Some(LoadOp::Start {
                    worker,
                    dp_rank,
                    load,
                    learnt: Some(Learnt {
                        model,
                        session_key,
                        text,
                        tokens,
                    }),
                }))
            }
            Message::FirstToken { request } => {
                let remote = peer
                    .requests
                    .get_mut(&request)
                    .ok_or(Ignored::UnknownRequest)?;
                if remote.first_token {
                    return Ok(None);
                }
                remote.first_token = true;
                Ok(Some(LoadOp::FirstToken {
                    worker: remote.worker.clone(),
                    dp_rank: remote.dp_rank,
                    load: remote.load.clone(),
                }))
            }
            Message::Finished { request } => {
                let remote = peer
                    .requests
                    .remove(&request)
                    .ok_or(Ignored::UnknownRequest)?;
                Ok(Some(finish(remote)))
            }
        }
    }

    /// Peers silent for longer than `timeout` at `now`, forgotten: the operations that take
    /// back everything they had in flight.
    pub fn expire(&mut self, now: Instant, timeout: Duration) -> Vec<LoadOp> {
        let silent: Vec<ReplicaTag> = self
            .peers
            .iter()
            .filter(|(_, p)| {
                p.last_seen
                    .is_none_or(|t| now.saturating_duration_since(t) > timeout)
            })
            .map(|(tag, _)| *tag)
            .collect();
        let mut ops = Vec::new();
        for tag in silent {
            if let Some(peer) = self.peers.remove(&tag) {
                ops.extend(peer.requests.into_values().map(finish));
            }
        }
        ops
    }

    /// Live peers.
    pub fn peers(&self) -> usize {
        self.peers.len()
    }

    /// Messages a peer sent that never arrived (sequence gaps), over all peers.
    pub fn lost(&self) -> u64 {
        self.peers.values().map(|p| p.lost).sum()
    }

    /// Requests in flight that peers routed, over all peers.
    pub fn remote_in_flight(&self) -> usize {
        self.peers.values().map(|p| p.requests.len()).sum()
    }
}

fn finish(remote: Remote) -> LoadOp {
    LoadOp::Finish {
        worker: remote.worker,
        dp_rank: remote.dp_rank,
        load: remote.load,
        prefilling: !remote.first_token,
    }
}

/// The wire form of a message (MessagePack).
pub fn encode(msg: &Envelope) -> Vec<u8> {
    rmp_serde::to_vec(msg).expect("a sync message always encodes")
}

/// A message from the wire; `None` for anything malformed or foreign (counted by the caller).
pub fn decode(bytes: &[u8]) -> Option<Envelope> {
    rmp_serde::from_slice(bytes).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routed(sender: ReplicaTag, seq: u64, request: u64) -> Envelope {
        Envelope {
            sender,
            seq,
            sent_ms: 0,
            body: Message::Routed {
                request,
                model: "m".into(),
                worker: "w1".into(),
                dp_rank: Some(0),
                session_key: Some("s".into()),
                text: "hello".into(),
                tokens: vec![1, 2, 3],
                prefill_tokens: 100,
                blocks: vec![1, 2, 3],
                own_blocks: 1,
            },
        }
    }

    fn msg(sender: ReplicaTag, seq: u64, body: Message) -> Envelope {
        Envelope {
            sender,
            seq,
            sent_ms: 0,
            body,
        }
    }

    #[test]
    fn a_peers_request_starts_and_finishes_on_the_same_rank() {
        let mut l = Ledger::new(1, 1000);
        let t = Instant::now();
        let start = l.apply(routed(2, 0, 7), t).unwrap().unwrap();
        assert!(
            matches!(start, LoadOp::Start { ref worker, dp_rank: Some(0), .. } if worker == "w1")
        );
        let first = l
            .apply(msg(2, 1, Message::FirstToken { request: 7 }), t)
            .unwrap();
        assert!(matches!(first, Some(LoadOp::FirstToken { .. })));
        let end = l
            .apply(msg(2, 2, Message::Finished { request: 7 }), t)
            .unwrap()
            .unwrap();
        assert!(matches!(
            end,
            LoadOp::Finish {
                prefilling: false,
                ..
            }
        ));
        assert_eq!(l.remote_in_flight(), 0);
        assert_eq!(
            l.apply(msg(2, 3, Message::Finished { request: 7 }), t),
            Err(Ignored::UnknownRequest)
        );
    }

    #[test]
    fn own_and_duplicate_messages_are_ignored() {
        let mut l = Ledger::new(1, 1000);
        let t = Instant::now();
        assert_eq!(l.apply(routed(1, 0, 7), t), Err(Ignored::Own));
        l.apply(routed(2, 0, 7), t).unwrap();
        assert_eq!(l.apply(routed(2, 1, 7), t), Err(Ignored::Duplicate));
    }

    #[test]
    fn a_silent_peer_takes_its_load_back() {
        let mut l = Ledger::new(1, 1000);
        let t = Instant::now();
        l.apply(routed(2, 0, 7), t).unwrap();
        l.apply(routed(2, 1, 8), t).unwrap();
        l.apply(msg(2, 2, Message::FirstToken { request: 8 }), t)
            .unwrap();
        l.apply(routed(3, 0, 9), t + Duration::from_secs(5))
            .unwrap();
        let ops = l.expire(t + Duration::from_secs(6), Duration::from_secs(3));
        assert_eq!(ops.len(), 2, "peer 2's two requests, not peer 3's");
        let prefilling: Vec<bool> = ops
            .iter()
            .map(|o| {
                matches!(
                    o,
                    LoadOp::Finish {
                        prefilling: true,
                        ..
                    }
                )
            })
            .collect();
        assert_eq!(prefilling.iter().filter(|p| **p).count(), 1);
        assert_eq!(l.peers(), 1);
        assert_eq!(l.remote_in_flight(), 1);
    }

    #[test]
    fn a_heartbeat_drops_requests_whose_finish_was_lost() {
        let mut l = Ledger::new(1, 1000);
        let t = Instant::now();
        l.apply(routed(2, 0, 7), t).unwrap();
        l.apply(routed(2, 1, 8), t).unwrap();
        // The Finished of 7 was lost; the heartbeat lists 8 only.
        let op = l
            .apply(msg(2, 3, Message::Heartbeat { live: vec![8] }), t)
            .unwrap();
        assert!(matches!(op, Some(LoadOp::Many(ref ops)) if ops.len() == 1));
        assert_eq!(l.remote_in_flight(), 1);
        assert_eq!(l.lost(), 1);
        assert_eq!(
            l.apply(msg(2, 4, Message::Heartbeat { live: vec![8] }), t),
            Ok(None)
        );
    }

    #[test]
    fn sequence_gaps_are_counted_and_the_map_is_bounded() {
        let mut l = Ledger::new(1, 2);
        let t = Instant::now();
        l.apply(routed(2, 0, 1), t).unwrap();
        l.apply(routed(2, 5, 2), t).unwrap();
        assert_eq!(l.lost(), 4);
        assert_eq!(l.apply(routed(2, 6, 3), t), Err(Ignored::Full));
    }

    #[test]
    fn the_wire_form_round_trips_and_refuses_garbage() {
        let m = routed(2, 9, 7);
        assert_eq!(decode(&encode(&m)), Some(m));
        assert_eq!(decode(b"\xc1not msgpack"), None);
        assert_eq!(decode(b""), None);
    }
}

/// The transport: a task that publishes this replica's messages on NATS and applies the
/// peers' to the local ranks.
pub mod transport {
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

    use super::{decode, encode, Envelope, Ledger, LoadOp, Message, ReplicaTag};
    use crate::kv::KvState;
    use crate::workers::WorkerSet;

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

    /// Where and how to sync.
    #[derive(Debug, Clone)]
    pub struct SyncConfig {
        pub url: String,
        pub prefix: String,
        pub timeout: Duration,
    }

    #[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
    struct MessageLabels {
        direction: &'static str,
        kind: &'static str,
    }

    /// `kvroute_replica_peers`, `kvroute_replica_sync_messages_total{direction,kind}`
    /// (direction `out` or `in`; kind routed, first_token, finished, heartbeat, and on `in`
    /// also malformed, own, ignored), `kvroute_replica_sync_lag_seconds` (send to apply, of
    /// the last message applied), `kvroute_replica_sync_connected`.
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

    /// Starts the sync task; returns the handle for the request path.
    pub fn spawn(
        config: SyncConfig,
        workers: Arc<WorkerSet>,
        kv: Arc<KvState>,
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
            workers,
            kv,
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

    fn apply(workers: &WorkerSet, kv: &KvState, op: LoadOp) {
        let (worker, dp_rank) = match &op {
            LoadOp::Many(ops) => {
                for op in ops.clone() {
                    apply(workers, kv, op);
                }
                return;
            }
            LoadOp::Start {
                worker, dp_rank, ..
            }
            | LoadOp::FirstToken {
                worker, dp_rank, ..
            }
            | LoadOp::Finish {
                worker, dp_rank, ..
            } => (worker, dp_rank),
        };
        let Some(w) = workers.get(worker) else { return };
        let Some(rank) = w.ranks.iter().find(|r| r.dp_rank == *dp_rank) else {
            return;
        };
        match &op {
            LoadOp::Start { load, learnt, .. } => {
                rank.start(load);
                let now = Instant::now();
                if !kv.uses_events(&w) {
                    let hashes: Vec<kvroute_index::BlockHash> = load
                        .blocks
                        .iter()
                        .map(|h| kvroute_index::BlockHash(*h))
                        .collect();
                    kv.record_routed(rank.replica, &hashes, now);
                }
                if let Some(l) = learnt {
                    let table = workers.table();
                    if let Ok(pool) = table.resolve(Some(&l.model)) {
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
            }
            LoadOp::FirstToken { load, .. } => rank.first_token(load),
            LoadOp::Finish {
                load, prefilling, ..
            } => rank.finish(load, *prefilling),
            LoadOp::Many(_) => {}
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn run(
        config: SyncConfig,
        me: ReplicaTag,
        workers: Arc<WorkerSet>,
        kv: Arc<KvState>,
        metrics: SyncMetrics,
        mut rx: mpsc::UnboundedReceiver<Message>,
        synced: Arc<std::sync::atomic::AtomicBool>,
        shutdown: CancellationToken,
    ) {
        let subject = format!("{}.load", config.prefix);
        let client = loop {
            let attempt = async_nats::ConnectOptions::new()
                .connection_timeout(Duration::from_secs(2))
                .connect(config.url.as_str());
            tokio::select! {
                _ = shutdown.cancelled() => return,
                c = attempt => match c {
                    Ok(c) => break c,
                    Err(error) => {
                        metrics.connected.set(0);
                        tracing::warn!(url = %config.url, %error, "Replica sync: NATS unreachable; routing on local state, retrying");
                        // Drop what piles up meanwhile: peers cannot learn it anyway.
                        while rx.try_recv().is_ok() {}
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
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
        // Before reporting ready: the live peers' requests in flight, so as not to route
        // blind. Every peer answers on the inbox; those that answer within a second count.
        {
            let inbox = client.new_inbox();
            if let Ok(mut answers) = client.subscribe(inbox.clone()).await {
                let asked = client
                    .publish_with_reply(
                        snapshot_subject.clone(),
                        inbox,
                        me.to_be_bytes().to_vec().into(),
                    )
                    .await;
                if asked.is_ok() {
                    let deadline = tokio::time::sleep(Duration::from_secs(1));
                    tokio::pin!(deadline);
                    loop {
                        tokio::select! {
                            _ = &mut deadline => break,
                            answer = answers.next() => {
                                let Some(answer) = answer else { break };
                                let Ok(batch) = rmp_serde::from_slice::<Vec<Envelope>>(&answer.payload) else {
                                    metrics.count("in", "malformed");
                                    continue;
                                };
                                for env in batch {
                                    if let Ok(Some(op)) = ledger.apply(env, Instant::now()) {
                                        apply(&workers, &kv, op);
                                    }
                                }
                                metrics.count("in", "snapshot");
                            }
                        }
                    }
                }
            }
        }
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
                    let (Some(reply), false) = (ask.reply, ask.payload.as_ref() == me.to_be_bytes()) else {
                        continue;
                    };
                    let batch: Vec<Envelope> = live
                        .values()
                        .map(|m| Envelope { sender: me, seq: 0, sent_ms: now_ms(), body: m.clone() })
                        .collect();
                    metrics.count("out", "snapshot");
                    let _ = client
                        .publish(reply, rmp_serde::to_vec(&batch).unwrap_or_default().into())
                        .await;
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
                                apply(&workers, &kv, op);
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
                        apply(&workers, &kv, op);
                    }
                    metrics.peers.set(ledger.peers() as i64);
                }
            }
        }
    }
}
