//! Applying decoded batches to the sink, and one rank's message handling, synchronously: the
//! socket code only moves frames and runs replays.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use kvroute_index::{EngineHash, IndexError, StoredBlocks};
use kvroute_protocol::kv_events::{decode_batch, BlockStored, KvEvent, KvEventBatch, KvEventError};

use super::metrics::{EventKind, Status, WorkerCounters};
use super::sequence::{read_frames, Sequence, Verdict};
use super::{EventSink, RankEvents};

/// Applies one worker's batches to the sink and counts the outcomes.
pub(super) struct Applier {
    worker: String,
    sink: Arc<dyn EventSink>,
    counters: WorkerCounters,
    router_block_size: usize,
    mismatch_logged: AtomicBool,
}

impl Applier {
    pub(super) fn new(
        worker: String,
        sink: Arc<dyn EventSink>,
        counters: WorkerCounters,
        router_block_size: usize,
    ) -> Self {
        Self {
            worker,
            sink,
            counters,
            router_block_size,
            mismatch_logged: AtomicBool::new(false),
        }
    }

    pub(super) fn worker(&self) -> &str {
        &self.worker
    }

    /// Applies the batch's events in order to the rank it names (else `socket_rank`), counts
    /// the batch under `status`, and returns the rank used.
    pub(super) fn apply(&self, socket_rank: u32, batch: &KvEventBatch, status: Status) -> u32 {
        let rank = batch.dp_rank.unwrap_or(socket_rank);
        self.sink.batch(rank, &mut |sink| {
            // Each event's engine hashes, in one buffer for the batch.
            let mut hashes = Vec::new();
            for event in &batch.events {
                match event {
                    KvEvent::BlockStored(stored) => self.stored(sink, rank, stored, &mut hashes),
                    KvEvent::BlockRemoved(removed) => {
                        EngineHash::all_into(&removed.block_hashes, &mut hashes);
                        sink.removed(removed.tier(), &hashes);
                        self.counters.inc(EventKind::Removed, Status::Ok);
                    }
                    KvEvent::AllBlocksCleared => {
                        sink.cleared();
                        self.counters.inc(EventKind::Cleared, Status::Ok);
                    }
                }
            }
        });
        self.counters.inc(EventKind::Batch, status);
        rank
    }

    fn stored(
        &self,
        sink: &mut dyn RankEvents,
        rank: u32,
        stored: &BlockStored,
        hashes: &mut Vec<EngineHash>,
    ) {
        let block_size = stored.block_size as usize;
        let router = self.router_block_size;
        // One divides the other (and neither is 0).
        if block_size.max(router).checked_rem(block_size.min(router)) != Some(0) {
            self.block_size_mismatch(block_size);
            return;
        }
        let event = StoredBlocks::from_event(stored, hashes);
        let status = match sink.stored(&event) {
            Ok(()) => Status::Ok,
            Err(IndexError::BlockSizeMismatch { engine, .. }) => {
                self.block_size_mismatch(engine);
                return;
            }
            Err(error @ IndexError::UnknownParent(_)) => {
                tracing::debug!(worker = %self.worker, rank, %error, "KV event not applied");
                Status::UnknownParent
            }
            Err(error @ IndexError::TokenCount { .. }) => {
                tracing::debug!(worker = %self.worker, rank, %error, "KV event not applied");
                Status::TokenCount
            }
        };
        self.counters.inc(EventKind::Stored, status);
    }

    fn block_size_mismatch(&self, engine: usize) {
        self.counters
            .inc(EventKind::Stored, Status::BlockSizeMismatch);
        if !self.mismatch_logged.swap(true, Ordering::Relaxed) {
            tracing::error!(
                worker = %self.worker,
                engine_block_size = engine,
                router_block_size = self.router_block_size,
                "Engine block size is neither a divisor nor a multiple of the router's: \
                 its KV events are dropped and routing cannot see its cache"
            );
        }
    }

    /// Clears a rank the subscriber lost track of, counting why (`gap` or `restart`).
    pub(super) fn clear(&self, rank: u32, why: Status) {
        self.sink.cleared(rank);
        self.counters.inc(EventKind::Batch, why);
    }

    pub(super) fn malformed(&self, rank: u32, error: &dyn std::error::Error) {
        tracing::debug!(
            worker = %self.worker,
            rank,
            %error,
            "Malformed KV-event message skipped"
        );
        self.counters.inc(EventKind::Batch, Status::Malformed);
    }
}

/// What the socket must do after a message.
#[derive(Debug)]
pub(super) enum Step {
    Done,
    /// Ask the replay socket for `missing`, then call [`RankState::finish_gap`].
    Replay {
        missing: Range<u64>,
        seq: u64,
        batch: Result<KvEventBatch, KvEventError>,
    },
}

/// One rank's socket: its sequence and the rank its batches were last applied to.
#[derive(Debug)]
pub(super) struct RankState {
    socket_rank: u32,
    applied_rank: u32,
    seq: Sequence,
    can_replay: bool,
    rank_warned: bool,
}

impl RankState {
    pub(super) fn new(socket_rank: u32, can_replay: bool) -> Self {
        Self {
            socket_rank,
            applied_rank: socket_rank,
            seq: Sequence::default(),
            can_replay,
            rank_warned: false,
        }
    }

    /// The connection was lost: forget the rank (an engine that restarted has lost its
    /// cache; one that did not has published events the router missed), and treat the next
    /// gap as unreplayable.
    pub(super) fn reconnected(&mut self, applier: &Applier) {
        applier.clear(self.applied_rank, Status::Disconnected);
        self.seq.reconnected();
    }

    /// Handles one published message, up to the point where a replay is needed.
    pub(super) fn on_message(&mut self, applier: &Applier, frames: &[Bytes]) -> Step {
        let (seq, payload) = match read_frames(frames) {
            Ok(read) => read,
            Err(error) => {
                applier.malformed(self.socket_rank, &error);
                return Step::Done;
            }
        };
        let batch = decode_batch(payload);
        match self.seq.check(seq) {
            Verdict::InOrder => {}
            Verdict::Restart => {
                tracing::info!(
                    worker = %applier.worker(),
                    rank = self.socket_rank,
                    seq,
                    "KV-event sequence went back (engine restarted): rank cleared"
                );
                applier.clear(self.applied_rank, Status::Restart);
            }
            Verdict::Gap {
                missing,
                replayable: true,
            } if self.can_replay => {
                return Step::Replay {
                    missing,
                    seq,
                    batch,
                };
            }
            Verdict::Gap { missing, .. } => self.clear_gap(applier, &missing, None),
        }
        self.seq.accept(seq);
        self.apply_decoded(applier, batch, Status::Ok);
        Step::Done
    }

    /// Completes a [`Step::Replay`]: applies the replayed payloads (or clears the rank when
    /// the replay failed), then the message that revealed the gap.
    pub(super) fn finish_gap(
        &mut self,
        applier: &Applier,
        missing: Range<u64>,
        replayed: Result<Vec<Bytes>, super::sequence::ReplayError>,
        seq: u64,
        batch: Result<KvEventBatch, KvEventError>,
    ) {
        match replayed {
            Ok(payloads) => {
                tracing::info!(
                    worker = %applier.worker(),
                    rank = self.socket_rank,
                    from = missing.start,
                    to = missing.end,
                    "KV-event gap replayed"
                );
                for payload in payloads {
                    self.apply_decoded(applier, decode_batch(&payload), Status::Replayed);
                }
            }
            Err(error) => self.clear_gap(applier, &missing, Some(&error)),
        }
        self.seq.accept(seq);
        self.apply_decoded(applier, batch, Status::Ok);
    }

    fn clear_gap(
        &self,
        applier: &Applier,
        missing: &Range<u64>,
        error: Option<&dyn std::error::Error>,
    ) {
        tracing::warn!(
            worker = %applier.worker(),
            rank = self.socket_rank,
            from = missing.start,
            to = missing.end,
            replay_error = error.map(tracing::field::display),
            "KV events lost: rank cleared"
        );
        applier.clear(self.applied_rank, Status::Gap);
    }

    fn apply_decoded(
        &mut self,
        applier: &Applier,
        batch: Result<KvEventBatch, KvEventError>,
        status: Status,
    ) {
        match batch {
            Ok(batch) => {
                let rank = applier.apply(self.socket_rank, &batch, status);
                if rank != self.socket_rank && !self.rank_warned {
                    self.rank_warned = true;
                    tracing::warn!(
                        worker = %applier.worker(),
                        socket_rank = self.socket_rank,
                        batch_rank = rank,
                        "KV events name another rank than their port offset says; check the endpoint"
                    );
                }
                self.applied_rank = rank;
            }
            Err(error) => applier.malformed(self.socket_rank, &error),
        }
    }
}
