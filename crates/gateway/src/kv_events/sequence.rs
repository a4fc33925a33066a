//! The pure parts of the wire handling: reading a message's frames, the sequence rules, and
//! checking a replay answer covers what was missed.

use std::ops::Range;

use bytes::Bytes;
use kvroute_protocol::kv_events::{decode_seq, KvEventError};

/// Why a message's frames could not be read.
#[derive(Debug, thiserror::Error)]
pub(super) enum FrameError {
    #[error("expected 3 frames [topic, seq, payload], found {0}")]
    FrameCount(usize),
    #[error(transparent)]
    Seq(#[from] KvEventError),
    #[error("the end-of-replay marker arrived as a published message")]
    EndMarker,
}

/// The `seq` and payload of a published message `[topic, seq, payload]`.
pub(super) fn read_frames(frames: &[Bytes]) -> Result<(u64, &Bytes), FrameError> {
    let [_topic, seq, payload] = frames else {
        return Err(FrameError::FrameCount(frames.len()));
    };
    let seq = decode_seq(seq)?.ok_or(FrameError::EndMarker)?;
    Ok((seq, payload))
}

/// What a message's `seq` means, given the last one accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Verdict {
    /// The first message, or the next one.
    InOrder,
    /// Messages `missing` were lost. `replayable` is false across a reconnect, where the jump
    /// may come from a restarted engine that has already overtaken the old numbering.
    Gap {
        missing: Range<u64>,
        replayable: bool,
    },
    /// `seq` did not grow: the engine restarted.
    Restart,
}

/// The sequence state of one rank's socket.
#[derive(Debug, Default)]
pub(super) struct Sequence {
    last: Option<u64>,
    reconnected: bool,
}

impl Sequence {
    pub(super) fn check(&self, seq: u64) -> Verdict {
        match self.last {
            None => Verdict::InOrder,
            Some(last) if seq <= last => Verdict::Restart,
            Some(last) if seq == last + 1 => Verdict::InOrder,
            Some(last) => Verdict::Gap {
                missing: last + 1..seq,
                replayable: !self.reconnected,
            },
        }
    }

    /// `seq` was handled: it is the new baseline.
    pub(super) fn accept(&mut self, seq: u64) {
        self.last = Some(seq);
        self.reconnected = false;
    }

    /// The connection was lost and made again; the last `seq` is kept.
    pub(super) fn reconnected(&mut self) {
        self.reconnected = true;
    }
}

/// Why a replay did not recover the missed batches.
#[derive(Debug, thiserror::Error)]
pub(super) enum ReplayError {
    #[error("replay answer has {0} frames, expected 3 [b\"\", seq, payload]")]
    FrameCount(usize),
    #[error(transparent)]
    Seq(#[from] KvEventError),
    #[error("the engine no longer buffers seq {missing} (its replay starts at {found})")]
    Missing { missing: u64, found: u64 },
    #[error("the replay ended before seq {0}")]
    Incomplete(u64),
    #[error("zeromq: {0}")]
    Zmq(#[from] zeromq::ZmqError),
    #[error("no complete answer within {0:?}")]
    Timeout(std::time::Duration),
    #[error("the zeromq crate panicked")]
    Panicked,
}

/// Collects the answer to a replay request for `missing`, which must cover it exactly.
#[derive(Debug)]
pub(super) struct ReplayCollector {
    missing: Range<u64>,
    next: u64,
    payloads: Vec<Bytes>,
}

impl ReplayCollector {
    pub(super) fn new(missing: Range<u64>) -> Self {
        Self {
            next: missing.start,
            missing,
            payloads: Vec::new(),
        }
    }

    /// Takes one answer `[b"", seq, payload]`; `Ok(true)` at the end marker.
    pub(super) fn push(&mut self, frames: &[Bytes]) -> Result<bool, ReplayError> {
        let [_empty, seq, payload] = frames else {
            return Err(ReplayError::FrameCount(frames.len()));
        };
        let Some(seq) = decode_seq(seq)? else {
            return Ok(true);
        };
        // Older batches, and the current one and later (they arrive on the SUB socket), are
        // not needed.
        if seq < self.next || seq >= self.missing.end {
            return Ok(false);
        }
        if seq > self.next {
            return Err(ReplayError::Missing {
                missing: self.next,
                found: seq,
            });
        }
        self.payloads.push(payload.clone());
        self.next += 1;
        Ok(false)
    }

    /// The missed payloads in order, once the end marker arrived.
    pub(super) fn finish(self) -> Result<Vec<Bytes>, ReplayError> {
        if self.next == self.missing.end {
            Ok(self.payloads)
        } else {
            Err(ReplayError::Incomplete(self.next))
        }
    }
}
