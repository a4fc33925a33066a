//! Unpublished: the same KV events in Dynamo's form, so that `dynamo-kv-router` 1.6.1's
//! indexers and kvroute's `KvIndex` can be timed side by side (`benches/compare.rs`).
//!
//! Dynamo's indexers walk blocks by their `LocalBlockHash` (a hash of the block's tokens
//! alone) and name them by `ExternalSequenceBlockHash`. To give each its best case, both
//! are Dynamo's own: the local hash is `compute_block_hash_for_seq` of the block's tokens and
//! the sequence hash chains them with `compute_seq_hash_for_block` / `compute_next_seq_hash`,
//! so the `PositionalIndexer` can recompute any hash it needs, and every stored event carries
//! its `start_position`.

use std::collections::HashMap;

pub mod runs;

use dynamo_kv_router::protocols::{
    compute_block_hash_for_seq, compute_next_seq_hash, compute_seq_hash_for_block,
    BlockHashOptions, ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData,
    KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
};

/// Dynamo's local hashes of whole blocks of `tokens`.
pub fn local_hashes(tokens: &[u32], block_size: u32) -> Vec<LocalBlockHash> {
    compute_block_hash_for_seq(tokens, block_size, BlockHashOptions::default())
}

/// Converts engine events (engine hashes are any u64) into Dynamo's, keeping the chain of
/// Dynamo sequence hashes and positions per engine hash.
#[derive(Debug, Default)]
pub struct Converter {
    /// Engine hash -> (Dynamo sequence hash, position in its sequence).
    seq: HashMap<u64, (u64, u32)>,
    next_id: u64,
}

impl Converter {
    /// A `BlockStored` of `worker`: `parent` and `hashes` are the engine's, `tokens` the
    /// blocks' (`block_size` each).
    pub fn stored(
        &mut self,
        worker: u64,
        parent: Option<u64>,
        hashes: &[u64],
        tokens: &[u32],
        block_size: u32,
    ) -> RouterEvent {
        let locals = local_hashes(tokens, block_size);
        let start = parent.and_then(|p| self.seq.get(&p).copied());
        let (mut previous, position) = match start {
            Some((seq, pos)) => (Some(seq), pos + 1),
            None => (None, 0),
        };
        let first_chain = compute_seq_hash_for_block(&locals[..1.min(locals.len())]);
        let mut blocks = Vec::with_capacity(hashes.len());
        for (i, (engine, local)) in hashes.iter().zip(&locals).enumerate() {
            let seq = match previous {
                Some(p) => compute_next_seq_hash(p, *local),
                None => first_chain[0],
            };
            self.seq.insert(*engine, (seq, position + i as u32));
            previous = Some(seq);
            blocks.push(KvCacheStoredBlockData {
                block_hash: ExternalSequenceBlockHash(seq),
                tokens_hash: *local,
                mm_extra_info: None,
            });
        }
        let data = KvCacheEventData::Stored(KvCacheStoreData {
            parent_hash: start.map(|(seq, _)| ExternalSequenceBlockHash(seq)),
            start_position: Some(position),
            blocks,
        });
        self.event(worker, data)
    }

    /// A `BlockRemoved` of `worker`, by engine hashes.
    pub fn removed(&mut self, worker: u64, hashes: &[u64]) -> RouterEvent {
        let block_hashes = hashes
            .iter()
            .filter_map(|h| self.seq.get(h))
            .map(|(seq, _)| ExternalSequenceBlockHash(*seq))
            .collect();
        self.event(
            worker,
            KvCacheEventData::Removed(KvCacheRemoveData { block_hashes }),
        )
    }

    fn event(&mut self, worker: u64, data: KvCacheEventData) -> RouterEvent {
        self.next_id += 1;
        RouterEvent::new(
            worker,
            KvCacheEvent {
                event_id: self.next_id,
                data,
                dp_rank: 0,
            },
        )
    }
}
