//! `kvroute_kv_events_total{worker,event,status}`.

use std::sync::OnceLock;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KvEventLabels {
    worker: String,
    event: &'static str,
    status: &'static str,
}

/// The KV-event counters of every worker, registered once into the gateway's registry.
#[derive(Debug, Clone, Default)]
pub struct KvEventMetrics {
    events: Family<KvEventLabels, Counter>,
}

impl KvEventMetrics {
    /// Registers `kvroute_kv_events_total{worker,event,status}`.
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self::default();
        registry.register(
            "kvroute_kv_events",
            "KV events and event batches received from engines, by outcome",
            metrics.events.clone(),
        );
        metrics
    }

    /// One worker's counters, created on first use so that only outcomes that happened are
    /// exported.
    pub(super) fn worker(&self, worker: &str) -> WorkerCounters {
        WorkerCounters {
            family: self.events.clone(),
            worker: worker.to_owned(),
            cells: std::array::from_fn(|_| OnceLock::new()),
        }
    }
}

/// The `event` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum EventKind {
    Stored,
    Removed,
    Cleared,
    Batch,
}

impl EventKind {
    const ALL: usize = 4;

    fn as_str(self) -> &'static str {
        match self {
            Self::Stored => "stored",
            Self::Removed => "removed",
            Self::Cleared => "cleared",
            Self::Batch => "batch",
        }
    }
}

/// The `status` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Status {
    /// Applied (an event), or received in order and applied (a batch).
    Ok,
    /// A message that could not be read; skipped.
    Malformed,
    /// A stored event whose parent block the index does not know.
    UnknownParent,
    /// A stored event whose token count does not match its blocks.
    TokenCount,
    /// A stored event with a block size the router cannot re-block.
    BlockSizeMismatch,
    /// A gap in `seq` that could not be replayed: the rank was cleared.
    Gap,
    /// `seq` went back (the engine restarted): the rank was cleared.
    Restart,
    /// A batch recovered from the engine's replay socket after a gap.
    Replayed,
    /// The connection to the publisher was lost: the rank was cleared (what happened
    /// meanwhile, an engine restart included, cannot be known).
    Disconnected,
}

impl Status {
    const ALL: usize = 9;

    fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::Malformed => "malformed",
            Self::UnknownParent => "unknown_parent",
            Self::TokenCount => "token_count",
            Self::BlockSizeMismatch => "block_size_mismatch",
            Self::Gap => "gap",
            Self::Restart => "restart",
            Self::Replayed => "replayed",
            Self::Disconnected => "disconnected",
        }
    }
}

/// One worker's series, each looked up once, so that counting touches only an atomic.
#[derive(Debug)]
pub(super) struct WorkerCounters {
    family: Family<KvEventLabels, Counter>,
    worker: String,
    cells: [OnceLock<Counter>; EventKind::ALL * Status::ALL],
}

impl WorkerCounters {
    pub(super) fn inc(&self, event: EventKind, status: Status) {
        self.cells[event as usize * Status::ALL + status as usize]
            .get_or_init(|| {
                let labels = KvEventLabels {
                    worker: self.worker.clone(),
                    event: event.as_str(),
                    status: status.as_str(),
                };
                self.family.get_or_create(&labels).clone()
            })
            .inc();
    }
}
