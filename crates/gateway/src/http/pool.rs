//! The client's keep-alive connections: one list of idle HTTP/1.1 connections per origin
//! (scheme and authority), and the answer's body that gives its connection back.
//!
//! A request takes the connection last given back for its origin, or opens one. The
//! connection goes back when the answer's body has been read to its end ([`PooledBody`]): a
//! body dropped half-way closes its connection, as it must (the rest of the answer is still
//! on the wire). A connection idle for longer than the idle timeout is closed when its
//! origin's list is next looked at (every health probe looks). A request that a reused
//! connection could not send (the worker had closed it) goes out on another one.
//!
//! hyper_util's legacy client does the same with more work per request: a task spawned to
//! give each connection back, a connect raced against every checkout. Here a request costs
//! two short lock sections.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::uri::{Authority, Scheme};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;

pub(super) type Sender = SendRequest<Full<Bytes>>;

/// Where a connection goes: a worker's scheme and authority.
pub(super) type Origin = (Scheme, Authority);

#[derive(Debug)]
struct Idle {
    sender: Sender,
    since: Instant,
}

/// The idle connections, by origin, oldest first.
#[derive(Debug)]
pub(super) struct Pool {
    idle: Mutex<HashMap<Origin, Vec<Idle>>>,
    timeout: Duration,
}

impl Pool {
    pub(super) fn new(timeout: Duration) -> Self {
        Self {
            idle: Mutex::new(HashMap::new()),
            timeout,
        }
    }

    /// The connection last given back for `origin` that is still open, if any; drops those
    /// idle for longer than the timeout.
    pub(super) fn take(&self, origin: &Origin, now: Instant) -> Option<Sender> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let list = idle.get_mut(origin)?;
        let expired = list
            .iter()
            .take_while(|c| now.saturating_duration_since(c.since) >= self.timeout)
            .count();
        list.drain(..expired);
        while let Some(c) = list.pop() {
            if !c.sender.is_closed() {
                return Some(c.sender);
            }
        }
        None
    }

    fn give_back(&self, origin: Origin, sender: Sender) {
        if sender.is_closed() {
            return;
        }
        let idle = Idle {
            sender,
            since: Instant::now(),
        };
        let mut pool = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        pool.entry(origin).or_default().push(idle);
    }

    /// Idle connections to `origin` (for tests).
    #[cfg(test)]
    fn idle(&self, origin: &Origin) -> usize {
        let idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        idle.get(origin).map_or(0, Vec::len)
    }
}

/// The connection an answer came on, until its body has been read.
#[derive(Debug)]
struct Lease {
    pool: Arc<Pool>,
    origin: Origin,
    sender: Sender,
}

/// A worker's answer body; its connection goes back to the pool at the body's end.
#[derive(Debug)]
pub struct PooledBody {
    inner: Incoming,
    lease: Option<Lease>,
}

impl PooledBody {
    pub(super) fn new(inner: Incoming, pool: Arc<Pool>, origin: Origin, sender: Sender) -> Self {
        Self {
            inner,
            lease: Some(Lease {
                pool,
                origin,
                sender,
            }),
        }
    }

    fn give_back(&mut self) {
        if let Some(lease) = self.lease.take() {
            lease.pool.give_back(lease.origin, lease.sender);
        }
    }
}

impl Body for PooledBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => self.give_back(),
            Poll::Ready(Some(Ok(_))) if self.inner.is_end_stream() => self.give_back(),
            // A connection that failed is not used again.
            Poll::Ready(Some(Err(_))) => self.lease = None,
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for PooledBody {
    /// A body whose reader stopped at its known end (hyper's server does, for a length it
    /// was told) still gives its connection back; one dropped before its end does not.
    fn drop(&mut self) {
        if self.inner.is_end_stream() {
            self.give_back();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A server answering every request on its one connection with `answer`.
    async fn one_connection_server(answer: &'static [u8]) -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut tcp, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            loop {
                match tcp.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => tcp.write_all(answer).await.unwrap(),
                }
            }
        });
        addr
    }

    async fn connected(addr: std::net::SocketAddr) -> Sender {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let io = hyper_util::rt::TokioIo::new(tcp);
        let (sender, conn) = hyper::client::conn::http1::handshake(io).await.unwrap();
        tokio::spawn(conn);
        sender
    }

    fn origin(addr: std::net::SocketAddr) -> Origin {
        (Scheme::HTTP, addr.to_string().parse().unwrap())
    }

    async fn get(sender: &mut Sender) -> http::Response<Incoming> {
        let req = http::Request::get("/")
            .body(Full::new(Bytes::new()))
            .unwrap();
        sender.send_request(req).await.unwrap()
    }

    #[tokio::test]
    async fn a_body_read_to_its_end_gives_its_connection_back_and_a_cut_one_does_not() {
        let addr = one_connection_server(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await;
        let (pool, origin) = (Arc::new(Pool::new(Duration::from_secs(90))), origin(addr));
        let mut sender = connected(addr).await;
        let answer = get(&mut sender).await;
        let body = PooledBody::new(answer.into_body(), pool.clone(), origin.clone(), sender);
        assert_eq!(body.collect().await.unwrap().to_bytes(), "ok");
        assert_eq!(pool.idle(&origin), 1);

        // The same connection again: its answer dropped unread is not given back.
        let mut sender = pool.take(&origin, Instant::now()).unwrap();
        sender.ready().await.unwrap();
        let answer = get(&mut sender).await;
        drop(PooledBody::new(
            answer.into_body(),
            pool.clone(),
            origin.clone(),
            sender,
        ));
        assert_eq!(pool.idle(&origin), 0);
    }

    #[tokio::test]
    async fn connections_idle_past_the_timeout_are_dropped() {
        let addr = one_connection_server(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").await;
        let (pool, origin) = (Arc::new(Pool::new(Duration::from_secs(90))), origin(addr));
        let sender = connected(addr).await;
        pool.give_back(origin.clone(), sender);
        let later = Instant::now() + Duration::from_secs(91);
        assert!(pool.take(&origin, later).is_none());
        assert_eq!(pool.idle(&origin), 0);
    }
}
