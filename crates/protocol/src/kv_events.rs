//! vLLM's KV-event wire schema: what an engine publishes when it stores or evicts KV-cache
//! blocks, encoded and decoded here so that the router (which consumes the events) and the
//! simulated engine (which produces them) share one definition.
//!
//! # The frame
//!
//! The engine publishes on a ZMQ PUB socket. Each message is multipart:
//!
//! ```text
//! [topic, seq, payload]
//! ```
//!
//! - `topic`: bytes, often empty;
//! - `seq`: a `u64`, 8 bytes big-endian ([`encode_seq`], [`decode_seq`]). It starts at 0 and
//!   grows by one per batch, so a gap means lost batches. A replay answer ends with
//!   `seq = -1` (all bytes `0xFF`, [`END_OF_REPLAY_SEQ`]) and an empty payload;
//! - `payload`: one msgpack value, the batch ([`encode_batch`], [`decode_batch`]).
//!
//! # The batch
//!
//! vLLM encodes the batch positionally, `[ts, [event, ...], data_parallel_rank]`: `ts` is a
//! float in seconds since the epoch, `data_parallel_rank` an int or nil. Versions before
//! data parallelism send only `[ts, [event, ...]]`; newer ones may send a map
//! `{"ts": ..., "events": [...], "data_parallel_rank": ...}`. The decoder accepts all three.
//!
//! # The events
//!
//! An event is either a map tagged with `"type"` (vLLM 0.32):
//!
//! ```text
//! {"type": "BlockStored", "block_hashes": [h, ...], "parent_block_hash": h | nil,
//!  "token_ids": [t, ...], "block_size": 16, "lora_id": int | nil, "medium": "GPU" | nil,
//!  "lora_name": str | nil, "extra_keys": [nil | [any, ...], ...], "group_idx": 0, ...}
//! {"type": "BlockRemoved", "block_hashes": [h, ...], "medium": "GPU" | nil, ...}
//! {"type": "AllBlocksCleared"}
//! ```
//!
//! or a positional array whose first element is the tag (older vLLM, SGLang):
//!
//! ```text
//! ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
//!  medium, lora_name, extra_keys, ...]
//! ["BlockRemoved", block_hashes, medium, ...]
//! ["AllBlocksCleared"]
//! ```
//!
//! Older versions send shorter arrays (a `BlockStored` may end after `lora_id`, a
//! `BlockRemoved` after `block_hashes`); a field that is absent reads as nil. Fields this
//! crate does not model (`group_idx`, `kv_cache_spec_kind`, trailing array elements, unknown
//! map keys) are ignored, so newer engines stay readable.
//!
//! A block hash is a msgpack int (any width; a negative one is taken as its `u64` bit
//! pattern) or, with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`, a 32-byte bin or str
//! ([`BlockHashValue`]). `medium` names the storage tier ([`StorageTier`]). `extra_keys`
//! holds, per block, nil or the extra values vLLM mixed into that block's hash (multimodal
//! hashes, cache salt, ...); they are kept as opaque msgpack values for the router to hash.
//!
//! Decoding checks the schema, not the meaning: it does not check that `token_ids` holds
//! `block_hashes.len() * block_size` tokens, nor that `extra_keys` has one entry per block.
//! Malformed input, however truncated or corrupted, returns an error and never panics.

mod decode;
mod direct;
mod encode;
mod error;
#[cfg(test)]
mod tests;

pub use decode::{decode_batch, decode_batch_via_tree};
pub use encode::{encode_batch, Encoding};
pub use error::{KvEventError, Location};

use std::borrow::Cow;

use smallvec::SmallVec;

use crate::hash::stable_hash;

/// One payload: the events an engine published together, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventBatch {
    /// When the engine published the batch, in seconds since the Unix epoch.
    pub ts: f64,
    /// The events, to be applied in order.
    pub events: Vec<KvEvent>,
    /// The data-parallel rank that published the batch, when the engine says.
    pub dp_rank: Option<u32>,
}

/// A change to an engine's KV cache.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Blocks were filled and can now be reused by later requests.
    BlockStored(BlockStored),
    /// Blocks were evicted.
    BlockRemoved(BlockRemoved),
    /// The whole cache was dropped (a cache reset or an engine restart).
    AllBlocksCleared,
}

/// Consecutive full blocks of one sequence were stored.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockStored {
    /// The engine's hashes of the stored blocks, in sequence order.
    pub block_hashes: BlockHashes,
    /// The engine's hash of the block before the first one; `None` at a sequence's start.
    pub parent_block_hash: Option<BlockHashValue>,
    /// The tokens of all the stored blocks, `block_size` per block.
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: u32,
    /// The LoRA adapter's numeric id, if any.
    pub lora_id: Option<i64>,
    /// The storage tier's name as the engine spells it; see [`BlockStored::tier`]. Borrowed
    /// for vLLM's usual names (`"GPU"`, `"CPU"`), so that a batch allocates none for them.
    pub medium: Option<Cow<'static, str>>,
    /// The LoRA adapter's name, if any.
    pub lora_name: Option<String>,
    /// Per block, the extra values vLLM mixed into its hash (multimodal hashes, cache salt),
    /// or `None` for a block with none. `None` as a whole when the engine does not send them.
    pub extra_keys: Option<Vec<Option<rmpv::Value>>>,
}

impl BlockStored {
    /// The tier the blocks were stored in.
    pub fn tier(&self) -> StorageTier {
        StorageTier::from_medium(self.medium.as_deref())
    }
}

/// Blocks were evicted from one tier.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockRemoved {
    /// The engine's hashes of the evicted blocks.
    pub block_hashes: BlockHashes,
    /// The storage tier's name as the engine spells it; see [`BlockRemoved::tier`].
    pub medium: Option<Cow<'static, str>>,
}

impl BlockRemoved {
    /// The tier the blocks were evicted from.
    pub fn tier(&self) -> StorageTier {
        StorageTier::from_medium(self.medium.as_deref())
    }
}

/// An event's block hashes: held inline when there is one, as in most of vLLM's events (an
/// eviction is an event a block, and so is a block filled while decoding), so that reading
/// one allocates nothing. `vec![..].into()` or `collect()` makes one.
pub type BlockHashes = SmallVec<[BlockHashValue; 1]>;

/// An engine's hash of one KV block, as sent on the wire.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum BlockHashValue {
    /// A 64-bit hash (the default in vLLM).
    U64(u64),
    /// A byte-string hash (vLLM with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`: 32 bytes).
    Bytes(Vec<u8>),
}

impl BlockHashValue {
    /// The hash folded to 64 bits, the same in every process: a `U64` as it is, `Bytes` as the
    /// [`stable_hash`] of the bytes.
    pub fn to_u64(&self) -> u64 {
        match self {
            Self::U64(hash) => *hash,
            Self::Bytes(bytes) => stable_hash(bytes),
        }
    }
}

impl From<u64> for BlockHashValue {
    fn from(hash: u64) -> Self {
        Self::U64(hash)
    }
}

/// An event's `medium` as read: vLLM's usual names borrowed, any other copied.
fn medium(name: &str) -> Cow<'static, str> {
    match name {
        "GPU" => Cow::Borrowed("GPU"),
        "CPU" => Cow::Borrowed("CPU"),
        other => Cow::Owned(other.to_owned()),
    }
}

/// Where a block lives, from the event's `medium`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StorageTier {
    /// Accelerator memory (`"GPU"`, or no `medium` at all).
    Device,
    /// Host memory (`"CPU"` or any name starting with `"CPU"`).
    Host,
    /// Local disk (`"DISK"`).
    Disk,
    /// Any other tier (a remote cache, a connector's own medium).
    External,
}

impl StorageTier {
    /// The tier named by an event's `medium` (case-sensitive, as vLLM spells it).
    pub fn from_medium(medium: Option<&str>) -> Self {
        match medium {
            None | Some("GPU") => Self::Device,
            Some(name) if name.starts_with("CPU") => Self::Host,
            Some("DISK") => Self::Disk,
            Some(_) => Self::External,
        }
    }

    /// A short lowercase name, for logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Device => "device",
            Self::Host => "host",
            Self::Disk => "disk",
            Self::External => "external",
        }
    }
}

/// The `seq` frame that ends a replay answer: -1 as a big-endian `i64`.
pub const END_OF_REPLAY_SEQ: [u8; 8] = [0xFF; 8];

/// The `seq` frame of a batch: `seq` as 8 bytes big-endian. `u64::MAX` gives
/// [`END_OF_REPLAY_SEQ`].
pub fn encode_seq(seq: u64) -> [u8; 8] {
    seq.to_be_bytes()
}

/// Reads a `seq` frame: `Some(seq)` for a batch, `None` for the end-of-replay marker
/// ([`END_OF_REPLAY_SEQ`]). A frame that is not exactly 8 bytes is an error.
pub fn decode_seq(bytes: &[u8]) -> Result<Option<u64>, KvEventError> {
    let bytes: [u8; 8] = bytes
        .try_into()
        .map_err(|_| KvEventError::SeqLength { len: bytes.len() })?;
    Ok(match u64::from_be_bytes(bytes) {
        u64::MAX => None,
        seq => Some(seq),
    })
}
