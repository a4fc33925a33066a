//! Router replicas in sync over NATS (`--replica-sync nats://...`).
//!
//! Each replica publishes on `{prefix}.load` what its own requests do — routed (worker, rank,
//! load, and what its policy learnt: the session key and whether session affinity bound it,
//! the text for cache_aware, the tokens for llm_d), first token, finished — and a heartbeat
//! listing its live requests; it applies what the others publish as the same rank load
//! operations, policy updates (`Policy::observe`) and session bindings a local request
//! performs, and ignores its own messages. With rate limits on, each replica also publishes
//! what it takes from (and gives back to) a tenant's buckets, and takes the same from its own
//! copy of them, so the replicas share one count. [`Ledger`] is the pure part: a peer's messages as
//! load operations, reconciled by its heartbeats, all taken back when it falls silent.
//! [`snapshot`] is what a starting replica asks the live ones for before it reports ready:
//! their requests in flight and the learnt state. [`transport`] is the NATS side: connection
//! with retry (routing goes on with local state meanwhile), the snapshot exchange, and the
//! metrics. KV events are not relayed: every replica subscribes to every engine's publisher.

pub mod snapshot;
pub mod transport;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvroute_core::RequestLoad;
use serde::{Deserialize, Serialize};

use crate::workers::Half;

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
        /// Which pool of a disaggregated model chose; `None` for the model's own.
        #[serde(default)]
        half: Option<Half>,
        worker: String,
        dp_rank: Option<u32>,
        /// The session key, for session maps (`manual`, session affinity).
        session_key: Option<String>,
        /// Whether the sender bound the session to this (worker, rank)
        /// (`--session-affinity-ttl-secs`; the decode half of a disaggregated request).
        #[serde(default)]
        bind: bool,
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
    /// The sender took `tokens` and `requests` from a tenant's rate-limit buckets (its own
    /// scope, or its model rule `rule`); negative tokens were given back.
    RateCharged {
        tenant: String,
        rule: Option<String>,
        tokens: f64,
        requests: f64,
    },
}

impl Message {
    /// The `kind` label of `kvroute_replica_sync_messages_total`.
    pub fn kind(&self) -> &'static str {
        match self {
            Message::Routed { .. } => "routed",
            Message::FirstToken { .. } => "first_token",
            Message::Finished { .. } => "finished",
            Message::Heartbeat { .. } => "heartbeat",
            Message::RateCharged { .. } => "rate_charged",
        }
    }
}

/// What a peer's policy learnt from its decision, for this replica's policy to learn too.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Learnt {
    pub model: String,
    /// The pool of a disaggregated model that chose.
    pub half: Option<Half>,
    pub session_key: Option<String>,
    /// The session was bound to this decision (session affinity).
    pub bind: bool,
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
    /// A peer's charge to a tenant's rate-limit buckets, to take from this replica's too.
    Charge(crate::rate_limit::Charge),
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
        if let Some(last) = peer.last_seq {
            if msg.seq > last + 1 {
                peer.lost += msg.seq - last - 1;
            }
        }
        peer.last_seq = Some(msg.seq.max(peer.last_seq.unwrap_or(0)));
        self.apply_body(msg.sender, msg.body, now)
    }

    /// Applies a message from a peer's snapshot answer (outside its numbered stream).
    pub fn apply_snapshot(
        &mut self,
        sender: ReplicaTag,
        body: Message,
        now: Instant,
    ) -> Result<Option<LoadOp>, Ignored> {
        if sender == self.me {
            return Err(Ignored::Own);
        }
        self.apply_body(sender, body, now)
    }

    fn apply_body(
        &mut self,
        sender: ReplicaTag,
        body: Message,
        now: Instant,
    ) -> Result<Option<LoadOp>, Ignored> {
        let peer = self.peers.entry(sender).or_default();
        peer.last_seen = Some(now);
        match body {
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
                half,
                worker,
                dp_rank,
                session_key,
                bind,
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
                    output: None,
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
                        half,
                        session_key,
                        bind,
                        text,
                        tokens,
                    }),
                }))
            }
            Message::RateCharged {
                tenant,
                rule,
                tokens,
                requests,
            } => Ok(Some(LoadOp::Charge(crate::rate_limit::Charge {
                tenant: crate::auth::Tenant::from_key(&tenant),
                rule,
                tokens,
                requests,
            }))),
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

/// The wire form of a message: MessagePack with named fields, so that replicas of different
/// versions (a rolling upgrade) understand each other: a field added since defaults, a field
/// unknown is skipped.
pub fn encode(msg: &Envelope) -> Vec<u8> {
    rmp_serde::to_vec_named(msg).expect("a sync message always encodes")
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
                half: None,
                worker: "w1".into(),
                dp_rank: Some(0),
                session_key: Some("s".into()),
                bind: true,
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

    #[test]
    fn messages_of_other_versions_are_understood() {
        // An older replica's `Routed`: no `half`, no `bind`, no `tokens`; a newer one's
        // field this version does not know.
        let older = serde_json::json!({
            "sender": 2, "seq": 1, "sent_ms": 5,
            "body": {"Routed": {
                "request": 7, "model": "m", "worker": "w1", "dp_rank": null,
                "session_key": "s", "text": "", "prefill_tokens": 10, "blocks": [1, 2],
                "own_blocks": 0, "from_the_future": [1, 2, 3]
            }}
        });
        let env = decode(&rmp_serde::to_vec_named(&older).unwrap()).expect("understood");
        let Message::Routed {
            half,
            bind,
            tokens,
            blocks,
            ..
        } = env.body
        else {
            panic!("{env:?}")
        };
        assert_eq!(
            (half, bind, tokens, blocks),
            (None, false, vec![], vec![1, 2])
        );
    }
}
