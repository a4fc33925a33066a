//! KV events on a ZMQ PUB socket, in vLLM's wire format.
//!
//! Each rank binds its own socket (vLLM offsets the endpoint's port by the rank) and sends
//! one multipart message per step that changed the cache: `[topic, seq (u64 big-endian,
//! +1 per message from 0), msgpack batch [ts, [events], rank]]`, with the events in the map
//! encoding of vLLM 0.32 or the positional one.
//!
//! While the faults say `drop_kv_events`, messages are withheld but still numbered, so a
//! subscriber sees the gap in `seq` when they resume, as it would after lost messages.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use kvroute_protocol::kv_events::{
    encode_batch, encode_seq, BlockHashValue, BlockRemoved, BlockStored, Encoding, KvEvent,
    KvEventBatch,
};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketSend, ZmqMessage};

use super::adapters::Adapters;
use super::faults::Faults;
use crate::config::KvEventsFormat;
use crate::engine::{CacheEvent, LoraId};

/// `tcp://*:5557` with the port offset by `rank`, and `*` made bindable.
pub fn rank_endpoint(endpoint: &str, rank: usize) -> Result<String, String> {
    let (base, port) = endpoint
        .rsplit_once(':')
        .ok_or_else(|| format!("'{endpoint}' has no port (expected tcp://HOST:PORT)"))?;
    let port: u16 = port
        .parse()
        .map_err(|_| format!("'{endpoint}' has an invalid port"))?;
    let port = port
        .checked_add(rank as u16)
        .ok_or_else(|| format!("'{endpoint}': port + rank overflows"))?;
    if !base.starts_with("tcp://") {
        return Err(format!("'{endpoint}': only tcp:// endpoints are supported"));
    }
    let base = base.replace("tcp://*", "tcp://0.0.0.0");
    Ok(format!("{base}:{port}"))
}

/// The wire form of one step's cache events.
pub fn to_batch(
    events: &[CacheEvent],
    block_size: usize,
    rank: usize,
    lora_name: &dyn Fn(LoraId) -> Option<String>,
) -> KvEventBatch {
    let events = events
        .iter()
        .map(|e| match e {
            CacheEvent::Stored {
                hashes,
                parent,
                token_ids,
                lora,
            } => KvEvent::BlockStored(BlockStored {
                block_hashes: hashes.iter().map(|&h| BlockHashValue::U64(h)).collect(),
                parent_block_hash: parent.map(BlockHashValue::U64),
                token_ids: token_ids.clone(),
                block_size: block_size as u32,
                lora_id: lora.map(|l| i64::from(l.0)),
                medium: Some("GPU".into()),
                lora_name: lora.and_then(lora_name),
                // vLLM 0.32 sends one (empty) entry per block.
                extra_keys: Some(vec![None; hashes.len()]),
            }),
            CacheEvent::Removed { hash } => KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: [BlockHashValue::U64(*hash)].into_iter().collect(),
                medium: Some("GPU".into()),
            }),
            CacheEvent::Cleared => KvEvent::AllBlocksCleared,
        })
        .collect();
    KvEventBatch {
        ts: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64()),
        events,
        dp_rank: Some(rank as u32),
    }
}

/// A bound PUB socket and what it needs to frame batches.
pub struct Publisher {
    socket: zeromq::PubSocket,
    topic: Bytes,
    encoding: Encoding,
    block_size: usize,
    rank: usize,
    seq: u64,
    adapters: Arc<Adapters>,
}

impl Publisher {
    /// Binds the rank's socket.
    pub async fn bind(
        endpoint: &str,
        rank: usize,
        topic: &str,
        format: KvEventsFormat,
        block_size: usize,
        adapters: Arc<Adapters>,
    ) -> anyhow::Result<Self> {
        let endpoint = rank_endpoint(endpoint, rank).map_err(anyhow::Error::msg)?;
        let mut socket = zeromq::PubSocket::new();
        socket
            .bind(&endpoint)
            .await
            .map_err(|e| anyhow::anyhow!("cannot bind KV events socket {endpoint}: {e}"))?;
        tracing::info!(%endpoint, rank, "Publishing KV events");
        Ok(Self {
            socket,
            topic: Bytes::copy_from_slice(topic.as_bytes()),
            encoding: match format {
                KvEventsFormat::Map => Encoding::Map,
                KvEventsFormat::Array => Encoding::Array,
            },
            block_size,
            rank,
            seq: 0,
            adapters,
        })
    }

    /// Sends each batch of events as it comes, until the channel closes or shutdown.
    pub async fn run(
        mut self,
        mut rx: mpsc::UnboundedReceiver<Vec<CacheEvent>>,
        faults: Arc<Faults>,
        shutdown: CancellationToken,
    ) {
        loop {
            // Stopping first: nothing is published after a crash.
            let events = tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                events = rx.recv() => match events {
                    Some(events) => events,
                    None => break,
                },
            };
            if faults.drop_kv_message() {
                self.seq += 1;
                continue;
            }
            let adapters = self.adapters.clone();
            let name = move |id| adapters.name(id);
            let batch = to_batch(&events, self.block_size, self.rank, &name);
            let payload = encode_batch(&batch, self.encoding);
            let frames = vec![
                self.topic.clone(),
                Bytes::copy_from_slice(&encode_seq(self.seq)),
                Bytes::from(payload),
            ];
            let message = ZmqMessage::try_from(frames).expect("three frames");
            if let Err(error) = self.socket.send(message).await {
                tracing::warn!(%error, rank = self.rank, "Cannot publish KV events");
            }
            self.seq += 1;
        }
        let _ = self.socket.close().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_offset_by_rank() {
        assert_eq!(
            rank_endpoint("tcp://*:5557", 0).unwrap(),
            "tcp://0.0.0.0:5557"
        );
        assert_eq!(
            rank_endpoint("tcp://127.0.0.1:5557", 2).unwrap(),
            "tcp://127.0.0.1:5559"
        );
        assert!(rank_endpoint("tcp://*", 0).is_err());
        assert!(rank_endpoint("ipc:///tmp/x:1", 0).is_err());
    }
}
