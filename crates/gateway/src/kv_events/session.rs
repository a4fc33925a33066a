//! The sockets of one rank: connect (with backoff), receive, probe an idle connection,
//! reconnect, and run replays.
//!
//! The `zeromq` crate (0.4) panics on some peer misbehaviour it leaves unfinished (a DEALER
//! whose connection errors, a ZMTP command frame), so each connection and each replay runs
//! under `catch_unwind`: a panic there ends that connection or replay, never the subscriber.

use std::ops::Range;
use std::panic::AssertUnwindSafe;

use bytes::Bytes;
use futures_util::FutureExt;
use kvroute_protocol::kv_events::encode_seq;
use tokio_util::sync::CancellationToken;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::apply::{Applier, RankState, Step};
use super::sequence::{ReplayCollector, ReplayError};
use super::{RankEndpoints, SubscriberTiming};

/// An unsubscription from this topic, never subscribed, is the liveness probe: publishers
/// ignore it, and writing it fails once the publisher has gone.
const PROBE_TOPIC: &str = "\u{0}kvroute-liveness-probe";

/// Why a connection ended.
enum End {
    Shutdown,
    Lost(String),
}

/// Subscribes one rank until `shutdown`, reconnecting whenever the connection is lost.
pub(super) async fn run_rank(
    applier: &Applier,
    timing: &SubscriberTiming,
    endpoints: &RankEndpoints,
    shutdown: &CancellationToken,
) {
    let mut state = RankState::new(endpoints.rank, endpoints.replay.is_some());
    loop {
        let Some(socket) = connect(applier, timing, endpoints, shutdown).await else {
            return;
        };
        let connection = receive(applier, timing, endpoints, socket, &mut state, shutdown);
        let reason = match AssertUnwindSafe(connection).catch_unwind().await {
            Ok(End::Shutdown) => return,
            Ok(End::Lost(reason)) => reason,
            Err(_) => "the zeromq crate panicked".to_owned(),
        };
        tracing::info!(
            worker = %applier.worker(),
            rank = endpoints.rank,
            %reason,
            "KV-event connection lost: rank cleared; reconnecting"
        );
        state.reconnected(applier);
    }
}

/// A subscribed socket connected to the rank's publisher, or `None` at shutdown. Retries
/// with a backoff doubling from 100 ms to `max_backoff`.
async fn connect(
    applier: &Applier,
    timing: &SubscriberTiming,
    endpoints: &RankEndpoints,
    shutdown: &CancellationToken,
) -> Option<SubSocket> {
    let mut delay = std::time::Duration::from_millis(100);
    let mut failures = 0u32;
    loop {
        let mut socket = SubSocket::new();
        let attempt = async {
            socket.subscribe("").await?;
            socket.connect(&endpoints.events).await
        };
        let result = tokio::select! {
            _ = shutdown.cancelled() => return None,
            result = tokio::time::timeout(timing.connect_timeout, attempt) => result,
        };
        let error = match result {
            Ok(Ok(())) => {
                tracing::info!(
                    worker = %applier.worker(),
                    rank = endpoints.rank,
                    endpoint = %endpoints.events,
                    "Connected to KV events"
                );
                return Some(socket);
            }
            Ok(Err(error)) => error.to_string(),
            Err(_) => format!("no connection within {:?}", timing.connect_timeout),
        };
        failures += 1;
        if failures == 1 {
            tracing::warn!(
                worker = %applier.worker(),
                rank = endpoints.rank,
                endpoint = %endpoints.events,
                %error,
                "Cannot connect to KV events; retrying"
            );
        } else {
            tracing::debug!(
                worker = %applier.worker(),
                rank = endpoints.rank,
                %error,
                failures,
                "KV events still unreachable"
            );
        }
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            _ = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(timing.max_backoff);
    }
}

/// Receives and applies messages until shutdown or the connection is lost.
async fn receive(
    applier: &Applier,
    timing: &SubscriberTiming,
    endpoints: &RankEndpoints,
    mut socket: SubSocket,
    state: &mut RankState,
    shutdown: &CancellationToken,
) -> End {
    loop {
        let received = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return End::Shutdown,
            received = tokio::time::timeout(timing.probe_interval, socket.recv()) => received,
        };
        let message = match received {
            Ok(Ok(message)) => message,
            Ok(Err(error)) => return End::Lost(error.to_string()),
            Err(_idle) => {
                if let Err(error) = socket.unsubscribe(PROBE_TOPIC).await {
                    return End::Lost(format!("liveness probe failed: {error}"));
                }
                continue;
            }
        };
        let frames = message.into_vec();
        let Step::Replay {
            missing,
            seq,
            batch,
        } = state.on_message(applier, &frames)
        else {
            continue;
        };
        // `on_message` asks for a replay only when the rank has a replay endpoint.
        let endpoint = endpoints.replay.as_deref().unwrap_or_default();
        let replayed = tokio::select! {
            _ = shutdown.cancelled() => return End::Shutdown,
            replayed = replay(endpoint, missing.clone(), timing) => replayed,
        };
        state.finish_gap(applier, missing, replayed, seq, batch);
    }
}

/// Asks the replay socket at `endpoint` for the batches `missing`, vLLM's protocol: send
/// `[b"", start seq]` from a DEALER, read `[b"", seq, payload]` until `seq = -1`.
async fn replay(
    endpoint: &str,
    missing: Range<u64>,
    timing: &SubscriberTiming,
) -> Result<Vec<Bytes>, ReplayError> {
    let exchange = async {
        let mut socket = DealerSocket::new();
        socket.connect(endpoint).await?;
        let request = vec![
            Bytes::new(),
            Bytes::copy_from_slice(&encode_seq(missing.start)),
        ];
        socket
            .send(ZmqMessage::try_from(request).expect("two frames"))
            .await?;
        let mut collector = ReplayCollector::new(missing);
        while !collector.push(&socket.recv().await?.into_vec())? {}
        collector.finish()
    };
    match tokio::time::timeout(
        timing.replay_timeout,
        AssertUnwindSafe(exchange).catch_unwind(),
    )
    .await
    {
        Ok(Ok(result)) => result,
        Ok(Err(_panic)) => Err(ReplayError::Panicked),
        Err(_) => Err(ReplayError::Timeout(timing.replay_timeout)),
    }
}
