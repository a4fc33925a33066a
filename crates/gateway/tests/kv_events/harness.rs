//! The test harness: a recording sink, a running subscriber, the engine's sockets (PUB and
//! vLLM's replay ROUTER) and kvroute-sim helpers.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvroute_gateway::kv_events::{
    EventSink, KvEventMetrics, KvEventSubscriber, SubscriberConfig, SubscriberTiming,
};
use kvroute_index::{EngineHash, IndexError, StorageTier, StoredBlocks};
use kvroute_protocol::kv_events::{
    encode_batch, encode_seq, BlockHashValue, BlockRemoved, BlockStored, Encoding, KvEvent,
    KvEventBatch, END_OF_REPLAY_SEQ,
};
use prometheus_client::registry::Registry;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

#[derive(Debug, Clone, PartialEq)]
pub enum Call {
    Stored {
        rank: u32,
        parent: Option<u64>,
        hashes: Vec<u64>,
        tokens: Vec<u32>,
        block_size: usize,
        tier: StorageTier,
        salt: u64,
    },
    Removed(u32, Vec<u64>),
    Cleared(u32),
}

/// A sink that records every call, rejecting stored events whose token count is wrong.
#[derive(Default)]
pub struct Recorder {
    calls: Mutex<Vec<Call>>,
    changed: Notify,
}

impl Recorder {
    pub fn push(&self, call: Call) {
        self.calls.lock().unwrap().push(call);
        self.changed.notify_waiters();
    }

    pub fn take(&self) -> Vec<Call> {
        std::mem::take(&mut self.calls.lock().unwrap())
    }

    /// Waits up to `limit` for `found` to return something from the calls recorded so far.
    pub async fn find<T>(
        &self,
        limit: Duration,
        mut found: impl FnMut(&[Call]) -> Option<T>,
    ) -> Option<T> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let changed = self.changed.notified();
            if let Some(t) = found(&self.calls.lock().unwrap()) {
                return Some(t);
            }
            tokio::time::timeout_at(deadline, changed).await.ok()?;
        }
    }

    /// Waits (20 s at most) until the calls recorded so far satisfy `done`.
    pub async fn wait(&self, what: &str, done: impl Fn(&[Call]) -> bool) -> Vec<Call> {
        self.find(Duration::from_secs(20), |calls| {
            done(calls).then(|| calls.to_vec())
        })
        .await
        .unwrap_or_else(|| {
            panic!(
                "timed out waiting for {what}: {:?}",
                self.calls.lock().unwrap()
            )
        })
    }
}

impl EventSink for Recorder {
    fn stored(&self, rank: u32, e: &StoredBlocks<'_>) -> Result<(), IndexError> {
        if e.token_ids.len() != e.engine_hashes.len() * e.block_size {
            return Err(IndexError::TokenCount {
                tokens: e.token_ids.len(),
                blocks: e.engine_hashes.len(),
                block_size: e.block_size,
            });
        }
        self.push(Call::Stored {
            rank,
            parent: e.parent.map(|h| h.0),
            hashes: e.engine_hashes.iter().map(|h| h.0).collect(),
            tokens: e.token_ids.to_vec(),
            block_size: e.block_size,
            tier: e.tier,
            salt: e.salt,
        });
        Ok(())
    }
    fn removed(&self, rank: u32, _tier: StorageTier, hashes: &[EngineHash]) {
        self.push(Call::Removed(rank, hashes.iter().map(|h| h.0).collect()));
    }
    fn cleared(&self, rank: u32) {
        self.push(Call::Cleared(rank));
    }
}

/// A subscriber running in the background, with its sink and metrics.
pub struct Running {
    pub sink: Arc<Recorder>,
    registry: Registry,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    pub fn start(config: SubscriberConfig) -> Running {
        let mut registry = Registry::default();
        let metrics = KvEventMetrics::register(&mut registry);
        let sink = Arc::new(Recorder::default());
        let timing = SubscriberTiming {
            replay_timeout: Duration::from_secs(5),
            probe_interval: Duration::from_millis(100),
            connect_timeout: Duration::from_secs(5),
            max_backoff: Duration::from_millis(200),
        };
        let subscriber = KvEventSubscriber::new(config, sink.clone(), &metrics)
            .unwrap()
            .with_timing(timing);
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(subscriber.run(shutdown.clone()));
        Running {
            sink,
            registry,
            shutdown,
            task,
        }
    }

    /// `kvroute_kv_events_total{worker="w1",event,status}`, read with the text encoder.
    pub fn count(&self, event: &str, status: &str) -> u64 {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry).unwrap();
        let series =
            format!(r#"kvroute_kv_events_total{{worker="w1",event="{event}",status="{status}"}} "#);
        text.lines()
            .find_map(|l| l.strip_prefix(&series))
            .map_or(0, |v| v.parse().unwrap())
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(10), self.task)
            .await
            .expect("stops")
            .unwrap();
    }
}

pub fn config(port: u16, replay_port: Option<u16>, dp_size: u32) -> SubscriberConfig {
    SubscriberConfig {
        worker: "w1".into(),
        endpoint: format!("tcp://127.0.0.1:{port}"),
        replay_endpoint: replay_port.map(|p| format!("tcp://127.0.0.1:{p}")),
        dp_start_rank: 0,
        dp_size,
        router_block_size: 16,
    }
}

pub fn stored(hashes: &[u64], parent: Option<u64>, block_size: u32, tokens: u32) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.iter().map(|&h| BlockHashValue::U64(h)).collect(),
        parent_block_hash: parent.map(BlockHashValue::U64),
        token_ids: (0..tokens).collect(),
        block_size,
        lora_id: None,
        medium: None,
        lora_name: None,
        extra_keys: None,
    })
}

pub fn payload(events: Vec<KvEvent>) -> Bytes {
    Bytes::from(encode_batch(
        &KvEventBatch {
            ts: 0.0,
            events,
            dp_rank: None,
        },
        Encoding::Map,
    ))
}

/// Probes are `BlockRemoved` of hash `PROBE + seq`.
pub const PROBE: u64 = 1 << 40;

/// The engine's side: a PUB socket on loopback.
pub struct Publisher {
    pub socket: PubSocket,
    pub port: u16,
}

/// A publisher on a free port and a subscriber to it (one rank, replay at `replay_port` if
/// any), in sync from `seq`: the next seq to publish.
pub async fn connected(seq: u64, replay_port: Option<u16>) -> (Publisher, Running, u64) {
    let mut publisher = Publisher::bind(0).await;
    let sub = Running::start(config(publisher.port, replay_port, 1));
    let (seq, _) = publisher.sync(&sub.sink, seq).await;
    (publisher, sub, seq)
}

impl Publisher {
    pub async fn bind(port: u16) -> Publisher {
        let mut socket = PubSocket::new();
        let port = match socket
            .bind(&format!("tcp://127.0.0.1:{port}"))
            .await
            .unwrap()
        {
            zeromq::Endpoint::Tcp(_, port) => port,
            other => panic!("{other:?}"),
        };
        Publisher { socket, port }
    }

    pub async fn frames(&mut self, frames: Vec<Bytes>) {
        self.socket
            .send(ZmqMessage::try_from(frames).unwrap())
            .await
            .unwrap();
    }

    pub async fn publish(&mut self, seq: u64, payload: Bytes) {
        let seq = Bytes::copy_from_slice(&encode_seq(seq));
        self.frames(vec![Bytes::from_static(b"kv"), seq, payload])
            .await;
    }

    /// Publishes probes from `seq` until the subscriber has applied the last one sent;
    /// returns the next seq and the calls recorded until then (which it takes).
    pub async fn sync(&mut self, sink: &Recorder, mut seq: u64) -> (u64, Vec<Call>) {
        let is_probe = |c: &Call| matches!(c, Call::Removed(_, h) if h[0] >= PROBE);
        for _ in 0..200 {
            self.publish(seq, payload(vec![removed(PROBE + seq)])).await;
            seq += 1;
            let limit = Duration::from_millis(100);
            if sink
                .find(limit, |calls| calls.iter().find(|c| is_probe(c)).cloned())
                .await
                .is_some()
            {
                let last = Call::Removed(0, vec![PROBE + seq - 1]);
                sink.wait("the last probe", |calls| calls.contains(&last))
                    .await;
                return (seq, sink.take());
            }
        }
        panic!("no probe arrived");
    }
}

pub fn removed(hash: u64) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: [BlockHashValue::U64(hash)].into_iter().collect(),
        medium: None,
    })
}

pub fn stored_hashes(calls: &[Call]) -> Vec<u64> {
    calls
        .iter()
        .filter_map(|c| match c {
            Call::Stored { hashes, .. } => Some(hashes[0]),
            _ => None,
        })
        .collect()
}

/// A kvroute-sim with `dp` ranks publishing KV events, rank r on `tcp://127.0.0.1:port + r`.
pub struct Sim {
    pub url: String,
    pub port: u16,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Sim {
    pub async fn start(dp: &str) -> Sim {
        let port = free_port_pair();
        let argv = [
            "kvroute-sim",
            "--speedup",
            "1000",
            "--data-parallel-size",
            dp,
        ];
        let mut args = <kvroute_sim::SimArgs as clap::Parser>::parse_from(argv);
        args.kv_events_endpoint = Some(format!("tcp://127.0.0.1:{port}"));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let shutdown = CancellationToken::new();
        let tokenizer = Arc::new(kvroute_tokenizer::Tokenizer::fallback());
        let server = kvroute_sim::SimServer::new(args, tokenizer);
        let task = tokio::spawn(server.serve(listener, shutdown.clone()));
        Sim {
            url,
            port,
            shutdown,
            task,
        }
    }

    /// POSTs `body` to `path` on data-parallel rank `rank`; returns the status.
    pub async fn post(&self, path: &str, rank: u32, body: serde_json::Value) -> u16 {
        let request = http::Request::post(format!("{}{path}", self.url))
            .header("content-type", "application/json")
            .header("x-data-parallel-rank", rank.to_string())
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap();
        let client = Client::builder(TokioExecutor::new()).build_http();
        let response = client.request(request).await.unwrap();
        let status = response.status().as_u16();
        response.into_body().collect().await.unwrap();
        status
    }

    pub async fn stop(self) {
        self.shutdown.cancel();
        let stopped = tokio::time::timeout(Duration::from_secs(20), self.task).await;
        stopped.expect("sim stops").unwrap().unwrap();
    }
}

/// Two consecutive free ports (kvroute-sim binds rank r's socket itself, on port + r).
fn free_port_pair() -> u16 {
    for _ in 0..100 {
        let first = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = first.local_addr().unwrap().port();
        if port < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", port + 1)).is_ok() {
            return port;
        }
    }
    panic!("no two consecutive free ports");
}

/// A prompt of `len` letters (`len` tokens with the fallback tokenizer).
pub fn prompt(len: usize, seed: usize) -> String {
    let letter = |i: usize| (b'a' + ((i * 7 + seed) % 26) as u8) as char;
    (0..len).map(letter).collect()
}

/// vLLM's replay socket on loopback: each request `[id, "", start]` is answered with every
/// buffered `[id, "", seq, payload]` with `seq >= start`, then `[id, "", -1, ""]`.
pub struct ReplayServer {
    pub port: u16,
    pub buffer: Arc<Mutex<Vec<(u64, Bytes)>>>,
    /// The start seq of each request received.
    pub starts: Arc<Mutex<Vec<u64>>>,
    task: tokio::task::JoinHandle<()>,
}

impl ReplayServer {
    pub async fn start() -> ReplayServer {
        let mut router = RouterSocket::new();
        let port = match router.bind("tcp://127.0.0.1:0").await.unwrap() {
            zeromq::Endpoint::Tcp(_, port) => port,
            other => panic!("{other:?}"),
        };
        let buffer = Arc::new(Mutex::new(Vec::new()));
        let starts = Arc::new(Mutex::new(Vec::new()));
        let task = tokio::spawn(serve_replay(router, buffer.clone(), starts.clone()));
        ReplayServer {
            port,
            buffer,
            starts,
            task,
        }
    }
}

impl Drop for ReplayServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve_replay(
    mut router: RouterSocket,
    buffer: Arc<Mutex<Vec<(u64, Bytes)>>>,
    starts: Arc<Mutex<Vec<u64>>>,
) {
    let send = |frames: Vec<Bytes>| ZmqMessage::try_from(frames).unwrap();
    while let Ok(request) = router.recv().await {
        let frames = request.into_vec();
        assert_eq!(frames.len(), 3, "{frames:?}");
        let start = u64::from_be_bytes(frames[2][..].try_into().unwrap());
        starts.lock().unwrap().push(start);
        let buffered = buffer.lock().unwrap().clone();
        let id = frames[0].clone();
        for (seq, payload) in buffered.into_iter().filter(|(s, _)| *s >= start) {
            let seq = Bytes::copy_from_slice(&encode_seq(seq));
            let answer = vec![id.clone(), Bytes::new(), seq, payload];
            router.send(send(answer)).await.unwrap();
        }
        let end = Bytes::copy_from_slice(&END_OF_REPLAY_SEQ);
        let answer = vec![id, Bytes::new(), end, Bytes::new()];
        router.send(send(answer)).await.unwrap();
    }
}
