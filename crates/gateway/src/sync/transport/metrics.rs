//! The sync's Prometheus series.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

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
    pub(super) peers: Gauge,
    pub(super) connected: Gauge,
    messages: Family<MessageLabels, Counter>,
    bytes: Family<DirectionLabels, Counter>,
    pub(super) lag: Gauge<f64, AtomicU64>,
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

    pub(super) fn count_bytes(&self, direction: &'static str, n: usize) {
        self.bytes
            .get_or_create(&DirectionLabels { direction })
            .inc_by(n as u64);
    }

    pub(super) fn count(&self, direction: &'static str, kind: &'static str) {
        self.messages
            .get_or_create(&MessageLabels { direction, kind })
            .inc();
    }
}
