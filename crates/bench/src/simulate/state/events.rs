//! The engines' cache events, applied to the router's index as the gateway's subscribers
//! apply the KV events they receive.

use kvroute_index::{EngineHash, KvIndex, KvIndexer, ReplicaId, StorageTier, StoredBlocks};
use kvroute_sim::engine::CacheEvent;

use super::lora_salt;

/// Applies `events` of engine `replica` to `index`.
pub(super) fn apply_events(
    index: &mut KvIndex,
    replica: ReplicaId,
    events: &[CacheEvent],
    block_size: usize,
) {
    for e in events {
        match e {
            CacheEvent::Stored {
                hashes,
                parent,
                token_ids,
                lora,
            } => {
                let engine_hashes: Vec<EngineHash> =
                    hashes.iter().map(|&h| EngineHash(h)).collect();
                let _ = index.apply_stored(
                    replica,
                    &StoredBlocks {
                        parent: parent.map(EngineHash),
                        engine_hashes: &engine_hashes,
                        token_ids,
                        block_size,
                        tier: StorageTier::Device,
                        salt: lora_salt(*lora),
                    },
                );
            }
            CacheEvent::Removed { hash } => {
                index.apply_removed(replica, StorageTier::Device, &[EngineHash(*hash)])
            }
            CacheEvent::Cleared => index.clear_replica(replica),
        }
    }
}
