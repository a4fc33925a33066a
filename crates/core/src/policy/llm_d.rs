//! `llm_d`: llm-d's default scoring profile (its endpoint picker's prefix-cache, queue and
//! KV-cache-utilisation scorers, with the max-score picker).
//!
//! Each candidate gets a weighted sum of three scorers, each in [0, 1]:
//!
//! ```text
//! total = prefix_weight * prefix + queue_weight * queue + kv_weight * kv
//!       + lora_weight * lora
//! prefix = leading blocks of the prompt found in the candidate's LRU / full blocks of the prompt
//! queue  = (max_q - q) / (max_q - min_q)       (1 when every known q is equal)
//! kv     = 1 - kv_usage
//! ```
//!
//! and the highest total wins, ties broken uniformly at random.
//!
//! - **Prefix cache** (weight 3). The prompt's token ids ([`RouteRequest::tokens`]) are cut
//!   into blocks of `max(block_size, 64)` tokens (a trailing partial block is ignored), at
//!   most [`MAX_PREFIX_BLOCKS`] of them (llm-d's `maxPrefixBlocksToMatch`: longer prompts
//!   are truncated), and hashed in a chain: `h_i = stable_hash(h_{i-1} as LE bytes ++
//!   tokens of block i as LE u32 bytes)`, with `h_{-1} = 0`. llm-d hashes the prompt's
//!   characters instead; kvroute has the token ids, which is what the engine caches. A
//!   candidate's score is the number of *leading* blocks found in its LRU (the count stops
//!   at the first block it lacks, as an engine's prefix cache would) over the number of
//!   blocks; 0 for a prompt with no full block (or not tokenised). The LRUs hold no more
//!   than what the policy itself decided: after each choice the request's block hashes are
//!   recorded for the chosen candidate (llm-d's `PreRequest`), leading blocks most recent,
//!   so that under pressure a prompt's tail is forgotten before its head, as an engine
//!   evicts. Lookups do not refresh entries (llm-d's do not either).
//! - **Queue** (weight 2), over the candidates' `EngineLoad::waiting`
//!   (`vllm:num_requests_waiting`). A candidate whose value is unknown or stale scores 0.5
//!   (neutral: llm-d would read a stale value instead; kvroute has none) and is left out of
//!   `min_q`/`max_q`.
//! - **KV-cache utilisation** (weight 2): `1 - EngineLoad::kv_usage`, clamped to [0, 1];
//!   0.5 when unknown.
//! - **LoRA affinity** (weight 0: optional, llm-d's `lora-affinity-scorer`), over the
//!   candidate's [`AdapterFit`](crate::AdapterFit) for the request's adapter: 1 where it
//!   runs, 0.8 with a slot to spare, 0.6 where it waits, 0 where every slot is taken (and 0 for
//!   a request with no adapter).
//!
//! # Capacity and memory
//!
//! One LRU per (worker, data-parallel rank), created when the candidate is first chosen.
//! Its capacity, in blocks of the policy's size, is `num_gpu_blocks * 16 / block_size`
//! when the engine reports `num_gpu_blocks` (the router does not know the engine's block
//! size, so vLLM's default of 16 tokens per block is assumed), else
//! [`DEFAULT_LRU_CAPACITY`] (llm-d's default per pod, 31250 entries), and at most
//! 2^24; it follows the engine's value as that changes. Memory is thus bounded by the
//! capacities of the candidates seen; [`LlmD::forget_worker`] drops a removed worker's.

mod lru;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::fmt;
use std::sync::Mutex;

use kvroute_protocol::{stable_hash, WorkerId};
use rand::{Rng, RngCore};

use self::lru::{BlockHashState, BlockLru};
use super::{Observation, Observed, Policy, PolicyKind};
use crate::{Candidate, Decision, EngineLoad, RouteRequest};

/// The smallest block the prefix scorer uses, in tokens (llm-d's default hash block size).
pub const MIN_BLOCK_SIZE: usize = 64;
/// The most leading blocks of a prompt the prefix scorer hashes (llm-d's default).
pub const MAX_PREFIX_BLOCKS: usize = 256;
/// LRU capacity, in blocks, of a candidate whose engine has not reported `num_gpu_blocks`
/// (llm-d's `DefaultLRUCapacityPerServer`).
pub const DEFAULT_LRU_CAPACITY: usize = 31_250;
/// Tokens per engine KV block assumed when sizing an LRU from `num_gpu_blocks` (vLLM's
/// default; the engine's own block size is not among the scraped values).
pub const ASSUMED_ENGINE_BLOCK_SIZE: u64 = 16;

/// The most hashes in one snapshot observation.
pub const SNAPSHOT_PIECE: usize = 4096;

/// Totals closer than this are a tie.
const TIE_EPSILON: f64 = 1e-9;

/// `llm_d`'s scorer weights and prefix-cache parameters (llm-d's defaults).
#[derive(Debug, Clone, PartialEq)]
pub struct LlmDConfig {
    pub prefix_weight: f64,
    pub queue_weight: f64,
    pub kv_weight: f64,
    /// The LoRA-affinity scorer's weight (0: not in the profile).
    pub lora_weight: f64,
    /// Tokens per block of the approximate prefix cache (at least 64).
    pub block_size: usize,
    /// Where the prefix scorer learns what each candidate caches.
    pub prefix: PrefixSource,
}

/// The prefix scorer's source: llm-d's approximate prefix index (its
/// `approx-prefix-cache-producer`) or the engines' own KV events (its
/// `precise-prefix-cache-producer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefixSource {
    /// The policy's own LRUs of what it routed (module doc).
    #[default]
    Approximate,
    /// The KV index's device overlap, in the index's blocks (`Candidate::kv`), read as
    /// `min(overlap, prompt blocks) / prompt blocks` with blocks of `block_size` tokens.
    Exact { block_size: usize },
}

impl Default for LlmDConfig {
    fn default() -> Self {
        Self {
            prefix_weight: 3.0,
            queue_weight: 2.0,
            kv_weight: 2.0,
            lora_weight: 0.0,
            block_size: 64,
            prefix: PrefixSource::Approximate,
        }
    }
}

/// The LRUs of one worker, one per data-parallel rank it was chosen on.
type WorkerLrus = Vec<(Option<u32>, BlockLru)>;

/// The `llm_d` policy.
pub struct LlmD {
    config: LlmDConfig,
    /// `max(config.block_size, MIN_BLOCK_SIZE)`.
    block_size: usize,
    hasher: BlockHashState,
    lrus: Mutex<HashMap<WorkerId, WorkerLrus>>,
}

impl LlmD {
    pub fn new(config: LlmDConfig) -> Self {
        Self {
            block_size: config.block_size.max(MIN_BLOCK_SIZE),
            config,
            hasher: BlockHashState::new(),
            lrus: Mutex::new(HashMap::new()),
        }
    }

    /// Each candidate's scorer values `(prefix, queue, kv)`, each in [0, 1], unweighted.
    pub fn scores(
        &self,
        candidates: &[Candidate<'_>],
        request: &RouteRequest<'_>,
    ) -> Vec<(f64, f64, f64)> {
        if let PrefixSource::Exact { block_size } = self.config.prefix {
            return self.combine(candidates, exact_prefix(candidates, request, block_size));
        }
        let hashes = block_hashes(request.tokens, self.block_size);
        self.scores_of(candidates, &hashes)
    }

    /// Drops the LRUs of `worker` (all its ranks): it left the pool.
    pub fn forget_worker(&self, worker: &WorkerId) {
        self.lock().remove(worker);
    }

    /// Blocks recorded for (`worker`, `dp_rank`).
    pub fn cached_blocks(&self, worker: &WorkerId, dp_rank: Option<u32>) -> usize {
        self.lock()
            .get(worker)
            .and_then(|ranks| ranks.iter().find(|(r, _)| *r == dp_rank))
            .map_or(0, |(_, lru)| lru.len())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<WorkerId, WorkerLrus>> {
        self.lrus.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn scores_of(&self, candidates: &[Candidate<'_>], hashes: &[u64]) -> Vec<(f64, f64, f64)> {
        let prefix = self.prefix_scores(candidates, hashes);
        self.combine(candidates, prefix)
    }

    fn combine(&self, candidates: &[Candidate<'_>], prefix: Vec<f64>) -> Vec<(f64, f64, f64)> {
        let queue = queue_scores(candidates);
        candidates
            .iter()
            .zip(prefix.into_iter().zip(queue))
            .map(|(c, (p, q))| (p, q, kv_score(&c.engine)))
            .collect()
    }

    fn prefix_scores(&self, candidates: &[Candidate<'_>], hashes: &[u64]) -> Vec<f64> {
        if hashes.is_empty() {
            return vec![0.0; candidates.len()];
        }
        let lrus = self.lock();
        candidates
            .iter()
            .map(|c| {
                let Some(lru) = lrus
                    .get(c.worker)
                    .and_then(|ranks| ranks.iter().find(|(r, _)| *r == c.dp_rank))
                    .map(|(_, lru)| lru)
                else {
                    return 0.0;
                };
                let leading = hashes.iter().take_while(|&&h| lru.contains(h)).count();
                leading as f64 / hashes.len() as f64
            })
            .collect()
    }

    fn total(&self, (prefix, queue, kv): (f64, f64, f64), candidate: &Candidate<'_>) -> f64 {
        let c = &self.config;
        c.prefix_weight * prefix
            + c.queue_weight * queue
            + c.kv_weight * kv
            + c.lora_weight * candidate.adapter.llm_d_score()
    }

    /// Each candidate's weighted total.
    fn totals<'a>(
        &'a self,
        scores: Vec<(f64, f64, f64)>,
        candidates: &'a [Candidate<'_>],
    ) -> impl Iterator<Item = f64> + 'a {
        scores
            .into_iter()
            .zip(candidates)
            .map(|(s, c)| self.total(s, c))
    }

    /// Records the request's blocks for the chosen candidate, leading blocks most recent.
    fn record(&self, chosen: &Candidate<'_>, hashes: &[u64]) {
        let capacity = lru_capacity(chosen.engine.num_gpu_blocks, self.block_size);
        self.record_at(chosen.worker, chosen.dp_rank, Some(capacity), hashes);
    }

    /// The LRU of (`worker`, `dp_rank`), made with `initial` capacity if it has none.
    fn lru_mut<'a>(
        &self,
        lrus: &'a mut HashMap<WorkerId, WorkerLrus>,
        worker: &WorkerId,
        dp_rank: Option<u32>,
        initial: usize,
    ) -> &'a mut BlockLru {
        let ranks = lrus.entry(worker.clone()).or_default();
        let i = match ranks.iter().position(|(r, _)| *r == dp_rank) {
            Some(i) => i,
            None => {
                ranks.push((dp_rank, BlockLru::new(initial, self.hasher)));
                ranks.len() - 1
            }
        };
        &mut ranks[i].1
    }

    /// Records blocks for (worker, rank); `capacity` `None` keeps the LRU's (a peer
    /// replica's decision does not say the engine's size).
    fn record_at(
        &self,
        worker: &WorkerId,
        dp_rank: Option<u32>,
        capacity: Option<usize>,
        hashes: &[u64],
    ) {
        if hashes.is_empty() {
            return;
        }
        let mut lrus = self.lock();
        let initial = capacity.unwrap_or(DEFAULT_LRU_CAPACITY);
        let lru = self.lru_mut(&mut lrus, worker, dp_rank, initial);
        if let Some(capacity) = capacity.filter(|c| *c != lru.capacity()) {
            lru.set_capacity(capacity);
        }
        for &h in hashes.iter().rev() {
            lru.insert(h);
        }
    }
}

impl fmt::Debug for LlmD {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LlmD")
            .field("prefix_weight", &self.config.prefix_weight)
            .field("queue_weight", &self.config.queue_weight)
            .field("kv_weight", &self.config.kv_weight)
            .field("lora_weight", &self.config.lora_weight)
            .field("block_size", &self.block_size)
            .field("prefix", &self.config.prefix)
            .finish()
    }
}

impl Policy for LlmD {
    fn kind(&self) -> PolicyKind {
        PolicyKind::LlmD
    }

    fn reads_kv_index(&self) -> bool {
        matches!(self.config.prefix, PrefixSource::Exact { .. })
    }

    fn forget_worker(&self, worker: &kvroute_protocol::WorkerId) {
        LlmD::forget_worker(self, worker);
    }

    fn observe(&self, worker: &WorkerId, dp_rank: Option<u32>, request: &RouteRequest<'_>) {
        let hashes = block_hashes(request.tokens, self.block_size);
        self.record_at(worker, dp_rank, None, &hashes);
    }

    /// Each rank's LRU, least recent first, in pieces of at most [`SNAPSHOT_PIECE`]
    /// hashes; each rank keeps its most recent hashes within an equal share of the budget.
    /// The LRUs keep no time: every age is zero.
    fn snapshot(&self, _now: std::time::Instant, max_bytes: usize) -> Vec<Observation> {
        let lrus = self.lock();
        let ranks = lrus.values().map(Vec::len).sum::<usize>().max(1);
        let share = max_bytes / ranks / 8;
        let mut out = Vec::new();
        for (worker, ranks) in lrus.iter() {
            for (dp_rank, lru) in ranks {
                let mut recent: Vec<u64> = lru.iter_recent().take(share).collect();
                recent.reverse();
                out.extend(recent.chunks(SNAPSHOT_PIECE).map(|piece| Observation {
                    worker: worker.clone(),
                    dp_rank: *dp_rank,
                    age: std::time::Duration::ZERO,
                    learnt: Observed::Blocks(piece.to_vec()),
                }));
            }
        }
        out
    }

    /// Inserts each piece's hashes in order (the last most recent); a rank's LRU grows to
    /// hold what it is sent (the engine's size is learnt at the next local decision).
    fn restore(&self, observations: &[Observation], _now: std::time::Instant) {
        let mut lrus = self.lock();
        for o in observations {
            let Observed::Blocks(hashes) = &o.learnt else {
                continue;
            };
            let lru = self.lru_mut(&mut lrus, &o.worker, o.dp_rank, DEFAULT_LRU_CAPACITY);
            if lru.len() + hashes.len() > lru.capacity() {
                lru.set_capacity(lru.len() + hashes.len());
            }
            for &h in hashes {
                lru.insert(h);
            }
        }
    }

    fn select(
        &self,
        candidates: &[Candidate<'_>],
        request: &RouteRequest<'_>,
        rng: &mut dyn RngCore,
    ) -> Option<Decision> {
        if candidates.is_empty() {
            return None;
        }
        if let PrefixSource::Exact { block_size } = self.config.prefix {
            // The engines' events say what they cache: nothing to record.
            let scores = self.combine(candidates, exact_prefix(candidates, request, block_size));
            let index = best(self.totals(scores, candidates), rng)?;
            return Some(Decision { index });
        }
        let hashes = block_hashes(request.tokens, self.block_size);
        let scores = self.scores_of(candidates, &hashes);
        let index = best(self.totals(scores, candidates), rng)?;
        if !request.dry_run {
            self.record(&candidates[index], &hashes);
        }
        Some(Decision { index })
    }

    /// The negated totals (the lowest cost is the highest score).
    fn costs(&self, candidates: &[Candidate<'_>], request: &RouteRequest<'_>) -> Option<Vec<f64>> {
        let scores = self.scores(candidates, request);
        Some(self.totals(scores, candidates).map(|t| -t).collect())
    }
}

/// The exact prefix score of each candidate: the leading blocks its engine holds (the KV
/// index's device overlap) over the prompt's full blocks; 0 with no full block.
fn exact_prefix(
    candidates: &[Candidate<'_>],
    request: &RouteRequest<'_>,
    block_size: usize,
) -> Vec<f64> {
    let blocks = request.tokens.len() / block_size.max(1);
    candidates
        .iter()
        .map(|c| {
            if blocks == 0 {
                return 0.0;
            }
            (c.kv.overlap.device as usize).min(blocks) as f64 / blocks as f64
        })
        .collect()
}

/// The chained hashes of the prompt's full blocks of `block_size` tokens, at most
/// [`MAX_PREFIX_BLOCKS`].
pub(crate) fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    let block_size = block_size.max(1);
    let blocks = (tokens.len() / block_size).min(MAX_PREFIX_BLOCKS);
    let mut hashes = Vec::with_capacity(blocks);
    let mut buf = Vec::with_capacity(8 + 4 * block_size);
    let mut prev = 0u64;
    for block in tokens.chunks_exact(block_size).take(blocks) {
        buf.clear();
        buf.extend_from_slice(&prev.to_le_bytes());
        for t in block {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        prev = stable_hash(&buf);
        hashes.push(prev);
    }
    hashes
}

/// The queue scorer: `(max_q - q) / (max_q - min_q)` over the known waiting counts, 1 when
/// they are all equal, 0.5 for a candidate whose count is unknown.
pub(crate) fn queue_scores(candidates: &[Candidate<'_>]) -> Vec<f64> {
    let known = |c: &Candidate<'_>| c.engine.waiting.filter(|q| q.is_finite());
    let (min, max) = candidates
        .iter()
        .filter_map(known)
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), q| {
            (lo.min(q), hi.max(q))
        });
    candidates
        .iter()
        .map(|c| match known(c) {
            None => 0.5,
            Some(_) if max - min <= 0.0 => 1.0,
            Some(q) => ((max - q) / (max - min)).clamp(0.0, 1.0),
        })
        .collect()
}

/// The KV-cache utilisation scorer: `1 - kv_usage`, 0.5 when unknown.
pub(crate) fn kv_score(engine: &EngineLoad) -> f64 {
    engine
        .kv_usage
        .filter(|u| u.is_finite())
        .map_or(0.5, |u| (1.0 - u).clamp(0.0, 1.0))
}

/// LRU capacity, in policy blocks, for an engine with `num_gpu_blocks` blocks of
/// [`ASSUMED_ENGINE_BLOCK_SIZE`] tokens.
pub(crate) fn lru_capacity(num_gpu_blocks: Option<u64>, block_size: usize) -> usize {
    match num_gpu_blocks {
        Some(n) if n > 0 => {
            let tokens = n.saturating_mul(ASSUMED_ENGINE_BLOCK_SIZE);
            let blocks = tokens / block_size.max(1) as u64;
            blocks.clamp(1, lru::MAX_CAPACITY as u64) as usize
        }
        _ => DEFAULT_LRU_CAPACITY,
    }
}

/// The index of the highest total, ties (within [`TIE_EPSILON`]) broken uniformly at
/// random; a NaN total never wins over a number.
fn best(totals: impl Iterator<Item = f64>, rng: &mut dyn RngCore) -> Option<usize> {
    let mut chosen = None;
    let mut top = f64::NEG_INFINITY;
    let mut ties = 0u32;
    for (i, total) in totals.enumerate() {
        let total = if total.is_nan() {
            f64::NEG_INFINITY
        } else {
            total
        };
        if chosen.is_none() || total > top + TIE_EPSILON {
            chosen = Some(i);
            top = total;
            ties = 1;
        } else if total >= top - TIE_EPSILON {
            ties += 1;
            // Reservoir sampling: the k-th tie replaces the choice with probability 1/k.
            if rng.random_range(0..ties) == 0 {
                chosen = Some(i);
            }
        }
    }
    chosen
}
