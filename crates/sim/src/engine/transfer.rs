//! KV transfers in flight: requests admitted with [`PromptKv::Transfer`] wait here, holding
//! blocks for their whole prompt, until the KV their engine's prefix cache lacked has crossed
//! the link.
//!
//! A transfer of `T` tokens started at `now` lands at `now + transfer_time(T)` (see
//! [`super::TimingModel::transfer_time`]); it is noticed by the first step starting at or
//! after that time. Landing caches the prompt's full blocks as if computed (so a decode
//! engine publishes `Stored` events for them, as vLLM's does after a NIXL read) and queues
//! the request at the head of the waiting queue with all but its last prompt token computed.

use std::time::Duration;

use super::sequence::PromptSource;
use super::{EngineCore, Sequence};

/// A request whose prompt KV is on its way.
#[derive(Debug, Clone)]
pub(super) struct Receiving {
    pub(super) seq: Sequence,
    /// When the transfer ends (engine time).
    pub(super) done_at: Duration,
    /// Tokens of KV it carries.
    pub(super) tokens: usize,
}

impl EngineCore {
    /// Starts receiving `tokens` tokens of `seq`'s prompt KV at `now`; `seq` holds blocks
    /// for its whole prompt, its cache hits computed.
    pub(super) fn start_transfer(&mut self, seq: Sequence, tokens: usize, now: Duration) {
        debug_assert_eq!(seq.prompt_kv, PromptSource::Transfer);
        let done_at = now + self.config.timing.transfer_time(tokens);
        self.receiving.push(Receiving {
            seq,
            done_at,
            tokens,
        });
    }

    /// Lands the transfers done by `now`: their blocks are cached, and they wait at the head
    /// of the queue (in the order they were admitted) for their last prompt token.
    pub(super) fn land_transfers(&mut self, now: Duration) {
        if !self.receiving.iter().any(|r| r.done_at <= now) {
            return;
        }
        let bs = self.config.block_size;
        let (landed, still): (Vec<_>, Vec<_>) = std::mem::take(&mut self.receiving)
            .into_iter()
            .partition(|r| r.done_at <= now);
        self.receiving = still;
        for r in landed.into_iter().rev() {
            let mut seq = r.seq;
            // vLLM leaves the last prompt token to compute: its logits sample the first token.
            seq.computed = seq.prompt_len - 1;
            seq.cache_blocks_through(seq.computed, &mut self.pool, bs);
            seq.prompt_kv = PromptSource::Received;
            self.stats.kv_transfers_received += 1;
            self.stats.kv_transfer_tokens_received += r.tokens as u64;
            self.requeue(seq);
        }
    }

    /// When the first transfer in flight lands (engine time), if any.
    pub fn next_transfer_done(&self) -> Option<Duration> {
        self.receiving.iter().map(|r| r.done_at).min()
    }
}
