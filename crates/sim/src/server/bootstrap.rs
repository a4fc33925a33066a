//! Bootstrap rooms (SGLang-style disaggregation): a prefill engine serving
//! `--bootstrap-port` tells decode engines when the prefill of a room has ended.
//!
//! The protocol is one JSON line each way over TCP. The decode engine sends
//! `{"bootstrap_room": N}`; the prefill engine answers once the prefill of room `N` has ended
//! (at once if it already has) with `{"bootstrap_room": N, "status": "ready",
//! "prompt_tokens": P, "cached_tokens": C}` or `{"bootstrap_room": N, "status": "failed"}`
//! (refused, cut by a crash, or its client went away), then closes. The router sends both
//! requests at once, so a decode engine may ask before the prefill has arrived: the room
//! waits for it. The prefill engine remembers the last [`REMEMBERED_ROOMS`] ended rooms.
//!
//! A decode engine that cannot reach a bootstrap server there, or gets an answer outside
//! this protocol, does not wait (the simple mode, for prefill engines without
//! `--bootstrap-port`); one whose room fails, whose prefill engine goes away, or that waits
//! longer than [`ROOM_TIMEOUT`], fails its request.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// Ended rooms a prefill engine still answers for.
pub const REMEMBERED_ROOMS: usize = 65_536;
/// The longest a decode engine waits for a room's prefill (real time).
pub const ROOM_TIMEOUT: Duration = Duration::from_secs(60);
/// The longest a decode engine tries to connect before it stops waiting for the room.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// The longest a bootstrap server waits for a question.
const ASK_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest question a bootstrap server reads.
const MAX_LINE: u64 = 1024;

/// How a room's prefill ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoomOutcome {
    Ready {
        prompt_tokens: usize,
        cached_tokens: usize,
    },
    Failed,
}

#[derive(Debug, Serialize, Deserialize)]
struct Ask {
    bootstrap_room: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Status {
    Ready,
    Failed,
}

#[derive(Debug, Serialize, Deserialize)]
struct Answer {
    bootstrap_room: u64,
    status: Status,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    prompt_tokens: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cached_tokens: Option<usize>,
}

impl Answer {
    fn new(room: u64, outcome: RoomOutcome) -> Self {
        match outcome {
            RoomOutcome::Ready {
                prompt_tokens,
                cached_tokens,
            } => Self {
                bootstrap_room: room,
                status: Status::Ready,
                prompt_tokens: Some(prompt_tokens),
                cached_tokens: Some(cached_tokens),
            },
            RoomOutcome::Failed => Self {
                bootstrap_room: room,
                status: Status::Failed,
                prompt_tokens: None,
                cached_tokens: None,
            },
        }
    }

    fn outcome(&self) -> RoomOutcome {
        match self.status {
            Status::Ready => RoomOutcome::Ready {
                prompt_tokens: self.prompt_tokens.unwrap_or(0),
                cached_tokens: self.cached_tokens.unwrap_or(0),
            },
            Status::Failed => RoomOutcome::Failed,
        }
    }
}

enum Room {
    /// Its prefill has not ended: the decode engines waiting for it.
    Open(Vec<oneshot::Sender<RoomOutcome>>),
    Ended(RoomOutcome),
}

#[derive(Default)]
struct RoomsInner {
    rooms: HashMap<u64, Room>,
    /// Ended rooms, oldest first, to forget beyond [`REMEMBERED_ROOMS`].
    ended: VecDeque<u64>,
}

/// A prefill engine's rooms.
#[derive(Default)]
pub struct Rooms {
    inner: Mutex<RoomsInner>,
    /// Decode engines whose question about a room is being answered (most of that time,
    /// waiting for its prefill to end).
    waiting: Gauge,
}

impl std::fmt::Debug for Rooms {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        f.debug_struct("Rooms")
            .field("rooms", &inner.rooms.len())
            .field("waiting", &self.waiting.get())
            .finish()
    }
}

impl Rooms {
    /// The gauge of decode engines waiting for a room, to export.
    pub fn waiting(&self) -> Gauge {
        self.waiting.clone()
    }

    /// A prefill for `room` starts: the guard ends the room.
    pub fn open(self: &Arc<Self>, room: u64) -> RoomGuard {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(Room::Ended(_)) | None = inner.rooms.get(&room) {
            // A room used again: its earlier end is stale.
            inner.rooms.insert(room, Room::Open(Vec::new()));
        }
        RoomGuard {
            rooms: self.clone(),
            room,
            ended: false,
        }
    }

    fn end(&self, room: u64, outcome: RoomOutcome) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(Room::Open(watchers)) = inner.rooms.insert(room, Room::Ended(outcome)) {
            for w in watchers {
                let _ = w.send(outcome);
            }
        }
        inner.ended.push_back(room);
        while inner.ended.len() > REMEMBERED_ROOMS {
            let old = inner.ended.pop_front().expect("not empty");
            // (A room used twice is forgotten early: rooms are random 64-bit numbers.)
            if let Some(Room::Ended(_)) = inner.rooms.get(&old) {
                inner.rooms.remove(&old);
            }
        }
    }

    /// The end of `room`'s prefill, when it comes.
    fn watch(&self, room: u64) -> oneshot::Receiver<RoomOutcome> {
        let (tx, rx) = oneshot::channel();
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        match inner
            .rooms
            .entry(room)
            .or_insert_with(|| Room::Open(Vec::new()))
        {
            Room::Ended(outcome) => {
                let _ = tx.send(*outcome);
            }
            Room::Open(watchers) => watchers.push(tx),
        }
        rx
    }

    /// Forgets the decode engines no longer waiting for `room`, and the room if it was only
    /// theirs.
    fn prune(&self, room: u64) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(Room::Open(watchers)) = inner.rooms.get_mut(&room) {
            watchers.retain(|w| !w.is_closed());
            if watchers.is_empty() {
                inner.rooms.remove(&room);
            }
        }
    }
}

/// A prefill in a room: [`Self::ready`] when it is done; dropped before, the room fails.
pub struct RoomGuard {
    rooms: Arc<Rooms>,
    room: u64,
    ended: bool,
}

impl std::fmt::Debug for RoomGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoomGuard")
            .field("room", &self.room)
            .finish()
    }
}

impl RoomGuard {
    pub fn ready(mut self, prompt_tokens: usize, cached_tokens: usize) {
        self.ended = true;
        self.rooms.end(
            self.room,
            RoomOutcome::Ready {
                prompt_tokens,
                cached_tokens,
            },
        );
    }
}

impl Drop for RoomGuard {
    fn drop(&mut self) {
        if !self.ended {
            self.rooms.end(self.room, RoomOutcome::Failed);
        }
    }
}

/// Answers decode engines on `listener` until `stopping` (then closes every connection).
pub async fn serve(listener: TcpListener, rooms: Arc<Rooms>, stopping: CancellationToken) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            _ = stopping.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    connections.spawn(answer(stream, rooms.clone(), stopping.clone()));
                }
                Err(error) => {
                    tracing::warn!(%error, "Bootstrap server cannot accept");
                    // Out of descriptors, say: let connections end rather than spin.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    connections.shutdown().await;
}

async fn answer(stream: TcpStream, rooms: Arc<Rooms>, stopping: CancellationToken) {
    let (read, mut write) = stream.into_split();
    let mut reader = BufReader::new(read.take(MAX_LINE));
    let mut line = String::new();
    let ask = match tokio::time::timeout(ASK_TIMEOUT, reader.read_line(&mut line)).await {
        Ok(Ok(n)) if n > 0 => serde_json::from_str::<Ask>(line.trim()),
        _ => return,
    };
    let Ok(Ask {
        bootstrap_room: room,
    }) = ask
    else {
        tracing::debug!(line = %line.trim(), "Bootstrap server got no room");
        return;
    };
    let ended = rooms.watch(room);
    let waiting = Waiting::new(&rooms.waiting);
    let mut probe = [0u8; 1];
    let outcome = tokio::select! {
        outcome = ended => outcome.unwrap_or(RoomOutcome::Failed),
        // The engine stops: the decode engine sees the connection close unanswered.
        _ = stopping.cancelled() => return,
        // The decode engine went away (or broke the protocol).
        _ = reader.read(&mut probe) => {
            rooms.prune(room);
            return;
        }
    };
    drop(waiting);
    let mut text = serde_json::to_string(&Answer::new(room, outcome)).expect("serialisable");
    text.push('\n');
    let _ = write.write_all(text.as_bytes()).await;
    let _ = write.shutdown().await;
}

/// One decode engine counted in [`Rooms::waiting`] while this lives.
struct Waiting(Gauge);

impl Waiting {
    fn new(gauge: &Gauge) -> Self {
        gauge.inc();
        Self(gauge.clone())
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// Why a decode engine cannot take a room's KV.
#[derive(Debug, thiserror::Error)]
pub enum RoomError {
    #[error("the prefill of bootstrap room {0} failed")]
    Failed(u64),
    #[error("the prefill engine closed bootstrap room {0} unanswered")]
    Closed(u64),
    #[error("no answer for bootstrap room {room} within {}s", ROOM_TIMEOUT.as_secs())]
    Timeout { room: u64 },
}

/// Waits until the prefill of `room` at `host:port` has ended: `Ok(None)` when no
/// bootstrap server answers there (the decode engine does not wait), the prefill's counts
/// when it is ready.
pub async fn wait_for_room(
    host: &str,
    port: u16,
    room: u64,
) -> Result<Option<RoomOutcome>, RoomError> {
    let stream = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect((host, port))).await
    {
        Ok(Ok(stream)) => stream,
        Ok(Err(error)) => {
            tracing::debug!(%error, host, port, "No bootstrap server: not waiting");
            return Ok(None);
        }
        Err(_) => {
            tracing::debug!(host, port, "Bootstrap server unreachable: not waiting");
            return Ok(None);
        }
    };
    let exchange = async {
        let (read, mut write) = stream.into_split();
        let mut ask = serde_json::to_string(&Ask {
            bootstrap_room: room,
        })
        .expect("serialisable");
        ask.push('\n');
        if write.write_all(ask.as_bytes()).await.is_err() {
            return Ok(None);
        }
        let mut line = String::new();
        let mut reader = BufReader::new(read.take(MAX_LINE));
        match reader.read_line(&mut line).await {
            Ok(0) | Err(_) => return Err(RoomError::Closed(room)),
            Ok(_) => {}
        }
        match serde_json::from_str::<Answer>(line.trim()) {
            Ok(a) if a.bootstrap_room == room => match a.outcome() {
                RoomOutcome::Failed => Err(RoomError::Failed(room)),
                ready => Ok(Some(ready)),
            },
            _ => {
                tracing::debug!(host, port, "Not a bootstrap server: not waiting");
                Ok(None)
            }
        }
    };
    tokio::time::timeout(ROOM_TIMEOUT, exchange)
        .await
        .unwrap_or(Err(RoomError::Timeout { room }))
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn server() -> (
        u16,
        Arc<Rooms>,
        CancellationToken,
        tokio::task::JoinHandle<()>,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let rooms = Arc::new(Rooms::default());
        let stop = CancellationToken::new();
        let task = tokio::spawn(serve(listener, rooms.clone(), stop.clone()));
        (port, rooms, stop, task)
    }

    /// The bound on anything that should take milliseconds.
    const PATIENCE: Duration = Duration::from_secs(20);

    /// Yields until `room` has a decode engine waiting on it; panics after [`PATIENCE`].
    async fn until_asked(rooms: &Rooms, room: u64) {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        while !rooms.inner.lock().unwrap().rooms.contains_key(&room) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "no decode engine asked for room {room}"
            );
            tokio::task::yield_now().await;
        }
    }

    /// `future`'s output; panics, saying `what`, after [`PATIENCE`].
    async fn within<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
        tokio::time::timeout(PATIENCE, future)
            .await
            .unwrap_or_else(|_| panic!("not within {PATIENCE:?}: {what}"))
    }

    #[tokio::test]
    async fn a_decode_engine_waits_for_the_rooms_prefill() {
        let (port, rooms, stop, task) = server().await;
        // Asked before the prefill arrives: answered when it is done.
        let early = tokio::spawn(async move { wait_for_room("127.0.0.1", port, 7).await });
        until_asked(&rooms, 7).await;
        assert_eq!(rooms.waiting().get(), 1);
        let guard = rooms.open(7);
        assert!(!early.is_finished());
        guard.ready(100, 32);
        let ready = Some(RoomOutcome::Ready {
            prompt_tokens: 100,
            cached_tokens: 32,
        });
        let answered = within("the early question's answer", early).await;
        assert_eq!(answered.unwrap().unwrap(), ready);
        // Asked after: answered at once.
        let asked = within("the answer", wait_for_room("127.0.0.1", port, 7)).await;
        assert_eq!(asked.unwrap(), ready);
        // A prefill dropped before its end fails its room.
        drop(rooms.open(8));
        assert!(matches!(
            within("the answer", wait_for_room("127.0.0.1", port, 8)).await,
            Err(RoomError::Failed(8))
        ));
        // Stopping closes the waiting connections unanswered.
        let waiting = tokio::spawn(async move { wait_for_room("127.0.0.1", port, 9).await });
        until_asked(&rooms, 9).await;
        stop.cancel();
        within("the server stops", task).await.unwrap();
        assert!(matches!(
            within("the connection closes", waiting).await.unwrap(),
            Err(RoomError::Closed(9))
        ));
        assert_eq!(rooms.waiting().get(), 0);
    }

    #[tokio::test]
    async fn without_a_bootstrap_server_a_decode_engine_does_not_wait() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let asked = within("no answer", wait_for_room("127.0.0.1", port, 1)).await;
        assert_eq!(asked.unwrap(), None);
        // Something else answering on the port.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").await;
        });
        let asked = within("not an answer", wait_for_room("127.0.0.1", port, 1)).await;
        assert_eq!(asked.unwrap(), None);
    }

    #[test]
    fn ended_rooms_are_forgotten_oldest_first_and_abandoned_ones_pruned() {
        let rooms = Arc::new(Rooms::default());
        for room in 0..(REMEMBERED_ROOMS as u64 + 10) {
            rooms.open(room).ready(1, 0);
        }
        let inner = rooms.inner.lock().unwrap();
        assert_eq!(inner.rooms.len(), REMEMBERED_ROOMS);
        assert!(!inner.rooms.contains_key(&9) && inner.rooms.contains_key(&10));
        drop(inner);
        let rx = rooms.watch(u64::MAX);
        drop(rx);
        rooms.prune(u64::MAX);
        assert!(!rooms.inner.lock().unwrap().rooms.contains_key(&u64::MAX));
    }
}
