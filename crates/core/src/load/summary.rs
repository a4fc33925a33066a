//! A rank's load in five numbers, which a router can publish on every change and read
//! without the rank's lock: what `kv_aware` reads of a rank that holds none of a request's
//! blocks (the usual case at a thousand workers, where a prompt's prefix is on a few).

use super::{first_bucket, RequestLoad};
use crate::{KvTerms, Overlap};

/// [`RankLoad::summary`](super::RankLoad::summary).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadSummary {
    pub prefill_tokens: u64,
    pub decode_blocks: u64,
    pub active_requests: u64,
    pub prefilling_requests: u64,
    /// Bit `b` set: some active request's first block is in first-block bucket `b`.
    pub first_buckets: u64,
}

impl LoadSummary {
    /// The rank's `kv_aware` terms for `request` when its load alone answers them: no
    /// active request there starts in the bucket of the request's first block, so (block
    /// hashes being chained) none holds any of its blocks, and every block is new. The
    /// overlap is none: the caller has found the rank absent from the index's answer.
    /// `None` when an active request may share the prompt: read
    /// [`RankLoad::kv_terms`](super::RankLoad::kv_terms) under the rank's lock.
    pub fn terms_apart(
        &self,
        request: &RequestLoad,
        preferred_taint_weight: f64,
    ) -> Option<KvTerms> {
        if let Some(&first) = request.blocks.first() {
            if self.first_buckets >> first_bucket(first) & 1 == 1 {
                return None;
            }
        }
        Some(KvTerms {
            overlap: Overlap::default(),
            prefill_tokens: self.prefill_tokens,
            decode_blocks: self.decode_blocks,
            new_blocks: request.blocks.len() as u64 + request.own_blocks,
            active_requests: self.active_requests,
            prefilling_requests: self.prefilling_requests,
            preferred_taint_weight,
        })
    }
}
