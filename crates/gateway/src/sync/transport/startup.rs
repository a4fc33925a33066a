//! The start-up snapshot over NATS: a starting replica asks, the live ones answer.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use kvroute_core::{Observation, Observed};
use kvroute_index::BlockHash;

use super::apply::{apply, pool_of};
use super::{Local, SyncMetrics};
use crate::sync::snapshot::{self, Part};
use crate::sync::{Ledger, Message, ReplicaTag};

/// How long a starting replica waits for its peers' first answers.
const LOAD_WINDOW: Duration = Duration::from_secs(1);

/// A snapshot answer that stops for this long is given up (its sender died meanwhile).
const QUIET: Duration = Duration::from_secs(3);

/// Asks the live peers for their load and one of them for the shared state, applying the
/// answers as they come. Returns once every answer is complete (and at least
/// [`LOAD_WINDOW`] after asking), or when the answers stop for [`QUIET`].
pub(super) async fn take_snapshot(
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
    let mut progress = Progress::default();
    loop {
        let complete = progress.complete();
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
        progress.answered.insert(sender);
        apply_part(sender, part, ledger, local, &mut progress);
        // The first peer to answer is asked for the shared state.
        if progress.state_from.is_none() {
            progress.state_from = Some(sender);
            let asked = client
                .publish_with_reply(
                    subject.to_owned(),
                    inbox.clone(),
                    ask(progress.state_from).into(),
                )
                .await;
            progress.state_done = asked.is_err();
        }
    }
    tracing::info!(
        peers = progress.answered.len(),
        in_flight = ledger.remote_in_flight(),
        learnt = progress.learnt,
        "Replica sync: snapshot taken"
    );
}

/// Where the snapshot a starting replica takes stands.
#[derive(Default)]
struct Progress {
    /// The peers that answered.
    answered: HashSet<ReplicaTag>,
    /// Peers whose load answer has begun and not ended.
    loading: HashSet<ReplicaTag>,
    /// The peer asked for the shared state, and whether its answer has ended.
    state_from: Option<ReplicaTag>,
    state_done: bool,
    /// Observations of the shared state restored.
    learnt: usize,
}

impl Progress {
    /// Every answer begun has ended.
    fn complete(&self) -> bool {
        self.loading.is_empty() && (self.state_from.is_none() || self.state_done)
    }
}

/// Applies one part of `sender`'s answer: its requests in flight to the ledger and the local
/// ranks, the shared state to the policies, the session bindings and the approximate KV
/// index.
fn apply_part(
    sender: ReplicaTag,
    part: Part,
    ledger: &mut Ledger,
    local: &Local,
    progress: &mut Progress,
) {
    let now = Instant::now();
    match part {
        Part::Live(live) => {
            progress.loading.insert(sender);
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
            let observations: Vec<Observation> = observations.into_iter().map(Into::into).collect();
            progress.learnt += observations.len();
            if let Some(pool) = pool_of(&local.workers.table(), &model, half) {
                pool.policy.restore(&observations, now);
            }
        }
        Part::Affinity(bindings) => {
            let bindings: Vec<Observation> = bindings.into_iter().map(Into::into).collect();
            progress.learnt += bindings.len();
            if let Some(a) = &local.affinity {
                a.restore(&bindings, now);
            }
        }
        Part::ApproxKv(records) => {
            progress.learnt += records.len();
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
            progress.loading.remove(&sender);
        }
        Part::End { state: true } => {
            progress.state_done |= progress.state_from == Some(sender);
        }
    }
}

/// The parts of this replica's answer to `ask`, as payloads to publish in order: its
/// requests in flight (each as routed, then its first token if it came), or (when it is the
/// one asked) the shared state. `None` when the ask is not for it.
pub(super) fn answer_parts(
    me: ReplicaTag,
    ask: &snapshot::Ask,
    live: &std::collections::HashMap<u64, (Message, bool)>,
    local: &Local,
) -> Option<Vec<Vec<u8>>> {
    let part = |part| snapshot::encode(&snapshot::Answer { sender: me, part });
    if ask.sender == me {
        return None;
    }
    match ask.state_from {
        None => {
            let mut out: Vec<Vec<u8>> =
                snapshot::pack_live(live_messages(live), snapshot::PART_BYTES)
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

/// Each request in flight as its `Routed` message, followed by `FirstToken` once it has one.
fn live_messages(
    live: &std::collections::HashMap<u64, (Message, bool)>,
) -> impl Iterator<Item = Message> + '_ {
    live.iter().flat_map(|(request, (routed, first))| {
        let first = first.then_some(Message::FirstToken { request: *request });
        std::iter::once(routed.clone()).chain(first)
    })
}
