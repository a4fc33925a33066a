//! The start-up snapshot: what a starting replica asks its live peers for before it reports
//! ready, so that it does not route blind.
//!
//! The replica publishes an [`Ask`] on `{prefix}.snapshot` with a reply inbox. Every live
//! peer answers with its requests in flight ([`Part::Live`]) and an [`Part::End`]. The first
//! peer to answer is then asked again, alone, for the shared state (all peers hold the same):
//! each pool's policy as [`Policy::snapshot`](kvroute_core::Policy::snapshot) gives it, the
//! session-affinity bindings, and the approximate KV index of workers without KV events. Parts are packed to stay well under NATS's message size
//! limit (1 MiB by default) and applied as they arrive, in order.

use std::time::Duration;

use kvroute_core::{Observation, Observed};
use kvroute_protocol::WorkerId;
use serde::{Deserialize, Serialize};

use super::{Message, ReplicaTag};
use crate::workers::Half;

/// The most payload bytes packed into one answer message.
pub const PART_BYTES: usize = 256 * 1024;

/// The most bytes of learnt state one pool's policy (or the affinity map) sends.
pub const STATE_BYTES: usize = 64 * 1024 * 1024;

/// A starting replica's request, on `{prefix}.snapshot` with a reply inbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ask {
    pub sender: ReplicaTag,
    /// The one peer asked for the shared state; `None` asks every peer for its load.
    pub state_from: Option<ReplicaTag>,
}

/// One message of an answer, on the asker's inbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Answer {
    pub sender: ReplicaTag,
    pub part: Part,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Part {
    /// Requests the sender has in flight, as the `Routed` messages that announced them.
    Live(Vec<Message>),
    /// Part of what one pool's policy learnt, oldest first.
    Policy {
        model: String,
        half: Option<Half>,
        observations: Vec<WireObservation>,
    },
    /// Part of the session-affinity bindings, oldest first.
    Affinity(Vec<WireObservation>),
    /// Part of the approximate KV index (workers without KV events): the blocks routed to
    /// each rank, oldest first, with their age.
    ApproxKv(Vec<WireObservation>),
    /// The answer is complete: the load (`state` false) or the shared state (`state` true).
    End { state: bool },
}

/// An [`Observation`] on the wire.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WireObservation {
    pub worker: String,
    pub dp_rank: Option<u32>,
    pub age_us: u64,
    pub learnt: WireObserved,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum WireObserved {
    Text(String),
    Blocks(Vec<u64>),
    Session(String),
}

impl From<Observation> for WireObservation {
    fn from(o: Observation) -> Self {
        Self {
            worker: o.worker.as_str().to_owned(),
            dp_rank: o.dp_rank,
            age_us: u64::try_from(o.age.as_micros()).unwrap_or(u64::MAX),
            learnt: match o.learnt {
                Observed::Text(t) => WireObserved::Text(t),
                Observed::Blocks(b) => WireObserved::Blocks(b),
                Observed::Session(s) => WireObserved::Session(s),
            },
        }
    }
}

impl From<WireObservation> for Observation {
    fn from(o: WireObservation) -> Self {
        Self {
            worker: WorkerId::new(o.worker),
            dp_rank: o.dp_rank,
            age: Duration::from_micros(o.age_us),
            learnt: match o.learnt {
                WireObserved::Text(t) => Observed::Text(t),
                WireObserved::Blocks(b) => Observed::Blocks(b),
                WireObserved::Session(s) => Observed::Session(s),
            },
        }
    }
}

/// Splits `items`, in order, into groups whose `size`s add up to at most `max_bytes` (an
/// item larger than that on its own makes a group of its own).
fn groups<T>(
    items: impl IntoIterator<Item = T>,
    size: impl Fn(&T) -> usize,
    max_bytes: usize,
) -> Vec<Vec<T>> {
    let mut groups = Vec::new();
    let mut group = Vec::new();
    let mut bytes = 0;
    for item in items {
        let n = size(&item);
        if bytes + n > max_bytes && !group.is_empty() {
            groups.push(std::mem::take(&mut group));
            bytes = 0;
        }
        bytes += n;
        group.push(item);
    }
    if !group.is_empty() {
        groups.push(group);
    }
    groups
}

/// Roughly the encoded size of an observation.
fn observation_size(o: &Observation) -> usize {
    o.learnt.bytes() + o.worker.as_str().len() + 24
}

/// Packs observations, in order, into groups of at most `max_bytes` each. An observation
/// larger than that on its own (a prompt of more than `max_bytes`) is left out: the
/// message could not be sent.
pub fn pack(observations: Vec<Observation>, max_bytes: usize) -> Vec<Vec<WireObservation>> {
    let fit = observations
        .into_iter()
        .filter(|o| observation_size(o) <= max_bytes);
    groups(fit, observation_size, max_bytes)
        .into_iter()
        .map(|g| g.into_iter().map(Into::into).collect())
        .collect()
}

/// Requests in flight as sent in a snapshot: without the text and tokens, which the shared
/// state carries; packed into groups of at most `max_bytes`.
pub fn pack_live(live: impl Iterator<Item = Message>, max_bytes: usize) -> Vec<Vec<Message>> {
    let stripped = live.map(|mut m| {
        if let Message::Routed { text, tokens, .. } = &mut m {
            text.clear();
            tokens.clear();
        }
        m
    });
    let size = |m: &Message| match m {
        Message::Routed {
            blocks,
            worker,
            model,
            session_key,
            ..
        } => {
            blocks.len() * 9
                + worker.len()
                + model.len()
                + session_key.as_ref().map_or(0, String::len)
                + 64
        }
        _ => 16,
    };
    groups(stripped, size, max_bytes)
}

pub fn encode(answer: &Answer) -> Vec<u8> {
    rmp_serde::to_vec_named(answer).expect("a snapshot answer always encodes")
}

/// An answer from the wire; `None` for anything malformed or foreign.
pub fn decode(bytes: &[u8]) -> Option<Answer> {
    rmp_serde::from_slice(bytes).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(worker: &str, len: usize) -> Observation {
        Observation {
            worker: WorkerId::new(worker),
            dp_rank: Some(1),
            age: Duration::from_micros(1500),
            learnt: Observed::Text("x".repeat(len)),
        }
    }

    #[test]
    fn observations_are_packed_in_order_within_the_budget() {
        let obs: Vec<Observation> = (0..10).map(|i| text(&format!("w{i}"), 100)).collect();
        let groups = pack(obs.clone(), 300);
        assert!(groups.iter().all(|g| g.len() == 2), "{groups:?}");
        let back: Vec<Observation> = groups.into_iter().flatten().map(Into::into).collect();
        assert_eq!(back, obs, "same order, same content");
        // Too large for any message: left out, the rest kept.
        let groups = pack(vec![text("a", 10), text("b", 1000), text("c", 10)], 300);
        let workers: Vec<&str> = groups.iter().flatten().map(|o| o.worker.as_str()).collect();
        assert_eq!(workers, ["a", "c"]);
    }

    #[test]
    fn live_requests_travel_without_their_text_and_round_trip() {
        let routed = Message::Routed {
            request: 3,
            model: "m".into(),
            half: Some(Half::Decode),
            worker: "w".into(),
            dp_rank: None,
            session_key: Some("s".into()),
            bind: true,
            text: "long text".into(),
            tokens: vec![1, 2, 3],
            prefill_tokens: 10,
            blocks: vec![7; 100],
            own_blocks: 1,
        };
        let groups = pack_live(std::iter::repeat_n(routed, 5), 2000);
        assert_eq!(groups.len(), 3, "two requests of ~1 kB a message");
        let Message::Routed {
            text,
            tokens,
            blocks,
            ..
        } = &groups[0][0]
        else {
            panic!()
        };
        assert!(text.is_empty() && tokens.is_empty());
        assert_eq!(blocks.len(), 100, "the load is kept");
        let answer = Answer {
            sender: 9,
            part: Part::Live(groups[0].clone()),
        };
        assert_eq!(decode(&encode(&answer)), Some(answer));
        assert_eq!(decode(b"\x93garbage"), None);
    }
}
