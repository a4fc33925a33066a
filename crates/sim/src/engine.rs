//! The engine core: a vLLM-like scheduler over a paged KV cache, in virtual time.
//!
//! [`EngineCore::step`] plans and "runs" one forward pass starting at `now` and returns
//! what it produced and how long it took ([`StepOutput::duration`]); the caller makes the
//! outputs visible at `now + duration` (the HTTP server sleeps, a virtual-time simulation
//! advances its clock) and calls `step` again. Nothing here does I/O, reads a clock or uses
//! a random source it was not given.
//!
//! **Scheduling** (vLLM v1, FCFS). Each step has a budget of `max_num_batched_tokens`.
//! Running sequences come first, in admission order: a decoding sequence takes one token,
//! a prefilling one the rest of its prompt, cut to what the budget allows (chunked
//! prefill). A sequence that needs a new KV block when none is free preempts the newest
//! running sequence (its blocks are freed, it goes back to the head of the queue and is
//! recomputed later), as vLLM does. Then, if nothing was preempted, waiting sequences are
//! admitted in order while fewer than `max_num_seqs` run, budget remains and their blocks
//! fit; the head of the queue that does not fit blocks the rest. What must fit is this step's
//! chunk (vLLM v1), or with [`Scheduler::Dynamo`] the whole known sequence (Dynamo's mocker;
//! only the chunk's blocks are taken either way).
//!
//! **Prefix cache.** A sequence's full blocks are hashed by prefix (each hash chains the
//! previous one). At admission the longest run of leading blocks already cached is reused
//! (a hit skips their prefill), capped so that at least one prompt token is computed (vLLM
//! recomputes the last token of a fully cached prompt). Blocks become cached when their
//! last token's KV is computed (a `Stored` event per sequence per step), or with
//! [`Scheduler::Dynamo`] when that token is scheduled, as vLLM v1 does, so that a sequence
//! admitted later in the same step can reuse them; cached blocks of
//! finished sequences stay until evicted, least recently used first (a `Removed` event).
//!
//! **Outputs.** The step that completes a prompt samples the first token; every later step
//! samples one token per decoding sequence; a sequence finishes after exactly `max_tokens`
//! tokens.
//!
//! **KV transfer** (prefill/decode disaggregation, [`PromptKv::Transfer`]): a request whose
//! prompt KV a prefill engine computed is admitted in its FCFS turn like any other (the same
//! prefix-cache lookup, then blocks for its whole prompt), but computes nothing: it waits,
//! holding its blocks and counted as waiting, while the KV its cache lacks crosses the link
//! ([`TimingModel::transfer_time`]; transfers overlap the steps of other requests). When it
//! has landed the blocks are cached (`Stored` events) as if computed, and the request is
//! scheduled with every prompt token but the last computed, as vLLM's scheduler does after a
//! NIXL transfer: that last token, run as a decode, samples the first output token. A
//! preempted request recomputes its prompt locally. See the `transfer` module.
//!
//! **Priority scheduling** ([`SchedulingPolicy::Priority`]): see the `order` module.
//!
//! **LoRA adapters** ([`EngineRequest::lora`]): at most `max_loras` per step, loaded before
//! the step that needs them (see the `lora` module).

mod blocks;
mod lora;
mod order;
mod sequence;
pub mod timing;
mod transfer;
mod work;

use std::collections::VecDeque;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

pub use blocks::BlockId;
use blocks::BlockPool;
use lora::LoraSlots;
pub use lora::{LoraConfig, LoraId, LoraState};
use order::unschedule;
pub use order::SchedulingPolicy;
pub use sequence::block_hash;
use sequence::{PromptSource, Sequence};
pub use timing::{Scheduler, StepWork, TimingFamily, TimingModel};
use transfer::Receiving;

/// The engine's configuration (vLLM's defaults).
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub num_gpu_blocks: usize,
    pub block_size: usize,
    pub timing: TimingModel,
    /// The scheduler's rules (the timing family's, unless set).
    pub scheduler: Scheduler,
    /// LoRA adapter slots and load time.
    pub lora: LoraConfig,
    /// The waiting queue's order and the preemption victim (see the module docs).
    pub policy: SchedulingPolicy,
    /// Token ids sampled for outputs (uniformly).
    pub output_tokens: Vec<u32>,
    pub seed: u64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            num_gpu_blocks: 16384,
            block_size: 16,
            timing: TimingModel::default(),
            scheduler: Scheduler::default(),
            lora: LoraConfig::default(),
            policy: SchedulingPolicy::Fcfs,
            // Lowercase letters and space: printable through the fallback tokenizer.
            output_tokens: (b'a'..=b'z').chain([b' ']).map(u32::from).collect(),
            seed: 0,
        }
    }
}

/// A request's id, unique within an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// A request to generate.
#[derive(Debug, Clone)]
pub struct EngineRequest {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    /// Mixed into every block hash (LoRA name, cache salt): different salts never share
    /// cached blocks.
    pub salt: u64,
    /// The LoRA adapter it runs with (`None`: the base model).
    pub lora: Option<LoraId>,
    /// Its place under [`SchedulingPolicy::Priority`]: lower goes first (vLLM's `priority`).
    pub priority: i64,
}

/// Where a request's prompt KV comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PromptKv {
    /// Computed here, less what the prefix cache holds.
    #[default]
    Compute,
    /// Received from a prefill engine, less what the prefix cache holds (see the module
    /// docs).
    Transfer,
}

/// Why a request cannot be accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("max_tokens must be at least 1")]
    NoOutput,
    #[error("prompt ({prompt} tokens) plus max_tokens ({max_tokens}) exceeds the KV cache capacity of {capacity} tokens")]
    TooLong {
        prompt: usize,
        max_tokens: usize,
        capacity: usize,
    },
    #[error("request id {0:?} is already in use")]
    DuplicateId(RequestId),
}

/// A change of the prefix cache, for KV events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    /// Full blocks now cached: their hashes, the hash of the block before the first (if
    /// any) and their tokens, `block_size` per block.
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        token_ids: Vec<u32>,
        /// The adapter of the sequence that computed them.
        lora: Option<LoraId>,
    },
    Removed {
        hash: u64,
    },
    Cleared,
}

/// One token produced by a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenOutput {
    pub id: RequestId,
    pub token: u32,
    /// 0 for the first token of the request.
    pub index: usize,
    pub finished: bool,
    /// Prompt tokens found in the prefix cache when the request was first scheduled.
    pub cached_tokens: usize,
    /// On the last token only: the blocks that held the prompt's KV (vLLM's block ids, as
    /// a prefill engine names them to its decode engine). They are released, their full
    /// blocks stay cached until evicted.
    pub prompt_blocks: Vec<BlockId>,
}

/// What one step did.
#[derive(Debug, Clone, Default)]
pub struct StepOutput {
    /// The step's compute time; its outputs exist at `now + duration`.
    pub duration: Duration,
    pub work: StepWork,
    pub tokens: Vec<TokenOutput>,
    pub events: Vec<CacheEvent>,
    pub preempted: Vec<RequestId>,
    /// Requests admitted for the first time in this step, with their cached tokens.
    pub started: Vec<(RequestId, usize)>,
}

impl StepOutput {
    /// Whether it computed nothing (KV transfers may be in flight).
    pub fn is_idle(&self) -> bool {
        self.work.scheduled_tokens == 0
    }
}

/// Counters and gauges, as vLLM's `/metrics` exports them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    pub running: usize,
    pub waiting: usize,
    pub kv_usage: f64,
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub preemptions: u64,
    pub cached_blocks: usize,
    /// Tokens whose KV a prefill (or a chunk of one) computed: prompt tokens neither found in
    /// the prefix cache nor received, and the tokens a preempted sequence recomputes.
    pub prefill_tokens_computed: u64,
    /// Requests whose prompt KV has arrived by transfer.
    pub kv_transfers_received: u64,
    /// Tokens of KV those transfers carried (their prompts less the local cache hits).
    pub kv_transfer_tokens_received: u64,
    /// LoRA adapters loaded into a device slot.
    pub lora_loads: u64,
}

/// One simulated engine (one data-parallel rank).
#[derive(Debug, Clone)]
pub struct EngineCore {
    config: EngineConfig,
    pool: BlockPool,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    /// Admitted requests waiting for their prompt KV, in admission order.
    receiving: Vec<Receiving>,
    rng: SmallRng,
    stats: EngineStats,
    loras: LoraSlots,
    /// Requests added so far: the next one's arrival order.
    arrivals: u64,
}

impl EngineCore {
    pub fn new(config: EngineConfig) -> Self {
        Self {
            pool: BlockPool::new(config.num_gpu_blocks),
            rng: SmallRng::seed_from_u64(config.seed),
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            receiving: Vec::new(),
            stats: EngineStats::default(),
            loras: LoraSlots::default(),
            arrivals: 0,
        }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Changes the engine's speed (the timing model's `speedup`) from the next step on.
    pub fn set_speedup(&mut self, speedup: f64) {
        self.config.timing.speedup = speedup;
    }

    /// KV capacity in tokens.
    pub fn capacity_tokens(&self) -> usize {
        self.config.num_gpu_blocks * self.config.block_size
    }

    /// Queues a request whose prompt KV is computed here.
    pub fn add_request(&mut self, req: EngineRequest) -> Result<(), AddError> {
        self.add_request_from(req, PromptKv::Compute)
    }

    /// Queues a request whose prompt KV comes from `prompt_kv`.
    pub fn add_request_from(
        &mut self,
        req: EngineRequest,
        prompt_kv: PromptKv,
    ) -> Result<(), AddError> {
        if req.prompt.is_empty() {
            return Err(AddError::EmptyPrompt);
        }
        if req.max_tokens == 0 {
            return Err(AddError::NoOutput);
        }
        let capacity = self.capacity_tokens();
        if req.prompt.len() + req.max_tokens > capacity {
            return Err(AddError::TooLong {
                prompt: req.prompt.len(),
                max_tokens: req.max_tokens,
                capacity,
            });
        }
        if self.contains(req.id) {
            return Err(AddError::DuplicateId(req.id));
        }
        self.arrivals += 1;
        self.enqueue(Sequence {
            id: req.id,
            prompt_len: req.prompt.len(),
            tokens: req.prompt,
            max_tokens: req.max_tokens,
            salt: req.salt,
            lora: req.lora,
            computed: 0,
            blocks: Vec::new(),
            hashes: Vec::new(),
            registered: 0,
            cached_tokens: None,
            prompt_kv: prompt_kv.into(),
            priority: req.priority,
            arrival: self.arrivals,
        });
        Ok(())
    }

    /// vLLM's `/reset_prefix_cache`: forgets every cached block, only when idle.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.pool.clear_cache()
    }

    /// Whether a step would do anything.
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty() || !self.receiving.is_empty()
    }

    /// Cache events not yet returned by a step (from `reset_prefix_cache`).
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        self.pool.take_events()
    }

    pub fn stats(&self) -> EngineStats {
        EngineStats {
            running: self.running.len(),
            // As vLLM counts requests waiting for remote KV: in its waiting queue.
            waiting: self.waiting.len() + self.receiving.len(),
            kv_usage: self.pool.num_used() as f64 / self.pool.num_blocks().max(1) as f64,
            cached_blocks: self.pool.num_cached(),
            lora_loads: self.loras.loads,
            ..self.stats.clone()
        }
    }

    /// Runs one step starting at `now` (see the module docs): lands the KV transfers done
    /// by `now`, then schedules. Apart from transfers, the outputs depend only on the work.
    ///
    /// A step can be idle while transfers are in flight and nothing else can run; the
    /// caller then steps again at [`Self::next_transfer_done`].
    pub fn step(&mut self, now: Duration) -> StepOutput {
        self.land_transfers(now);
        let mut out = StepOutput::default();
        let mut budget = self.config.max_num_batched_tokens;
        // (index into running, new tokens) for this step.
        let mut scheduled: Vec<(usize, usize)> = Vec::new();
        let mut preempted_any = false;

        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let need = self.running[i].tokens.len() - self.running[i].computed;
            let n = need.min(budget);
            let target = self.running[i].computed + n;
            let mut scheduled_self = true;
            while !self.ensure_blocks(i, target) {
                // Preempt the newest running sequence (the lowest in priority); it may be
                // this one, or one scheduled earlier in the step, whose tokens come back.
                let victim = self.victim();
                self.preempt(victim, &mut out);
                preempted_any = true;
                if victim == i {
                    scheduled_self = false;
                    break;
                }
                if victim < i {
                    budget += unschedule(&mut scheduled, victim);
                    i -= 1;
                }
            }
            if !scheduled_self {
                break;
            }
            self.cache_scheduled(i, n);
            scheduled.push((i, n));
            budget -= n;
            i += 1;
        }

        // Waiting requests whose adapter finds no slot this step, in queue order.
        let mut skipped = Vec::new();
        while !preempted_any
            && budget > 0
            && self.running.len() < self.config.max_num_seqs
            && !self.waiting.is_empty()
        {
            if !self.lora_fits(self.waiting.front().and_then(|s| s.lora)) {
                skipped.extend(self.waiting.pop_front());
                continue;
            }
            match self.admit(budget, now) {
                Admitted::Running {
                    tokens,
                    first_cached,
                } => {
                    let idx = self.running.len() - 1;
                    if let Some(cached) = first_cached {
                        out.started.push((self.running[idx].id, cached));
                    }
                    self.cache_scheduled(idx, tokens);
                    scheduled.push((idx, tokens));
                    budget -= tokens;
                }
                Admitted::Receiving { id, cached } => out.started.push((id, cached)),
                Admitted::Blocked => break,
            }
        }
        for seq in skipped.into_iter().rev() {
            self.waiting.push_front(seq);
        }

        // The step's work and time.
        let bs = self.config.block_size;
        let (work, computed_prefill) = self.step_work(&scheduled);
        self.stats.prefill_tokens_computed += computed_prefill as u64;
        let batch = lora::distinct(scheduled.iter().map(|&(i, _)| self.running[i].lora));
        let loads = self.loras.activate(&batch, self.config.lora.max_loras);
        out.duration =
            self.config.timing.step_time(&work) + self.config.lora.load_time * loads as u32;
        out.work = work;

        // Apply: KV computed, blocks cached, tokens sampled.
        // (index into running, index into out.tokens) of the sequences done.
        let mut finished = Vec::new();
        for &(idx, n) in &scheduled {
            let seq = &mut self.running[idx];
            seq.computed += n;
            seq.cache_blocks_through(seq.computed, &mut self.pool, bs);
            if seq.computed == seq.tokens.len() {
                let pick = self.rng.random_range(0..self.config.output_tokens.len());
                let token = self.config.output_tokens[pick];
                let index = seq.output_len();
                seq.tokens.push(token);
                let done = seq.output_len() == seq.max_tokens;
                out.tokens.push(TokenOutput {
                    id: seq.id,
                    token,
                    index,
                    finished: done,
                    cached_tokens: seq.cached_tokens.unwrap_or(0),
                    prompt_blocks: Vec::new(),
                });
                if done {
                    finished.push((idx, out.tokens.len() - 1));
                }
            }
        }
        finished.sort_unstable();
        for (idx, token) in finished.into_iter().rev() {
            let mut seq = self.running.remove(idx);
            self.pool.release(&seq.blocks);
            seq.blocks.truncate(seq.prompt_len.div_ceil(bs));
            out.tokens[token].prompt_blocks = seq.blocks;
        }
        out.events = self.pool.take_events();
        out
    }

    /// With [`Scheduler::Dynamo`], caches the full blocks `running[idx]` computes when it
    /// computes `n` more tokens, now.
    fn cache_scheduled(&mut self, idx: usize, n: usize) {
        if self.config.scheduler == Scheduler::Dynamo {
            let seq = &mut self.running[idx];
            let through = seq.computed + n;
            seq.cache_blocks_through(through, &mut self.pool, self.config.block_size);
        }
    }

    /// Makes `running[i]` hold blocks for `tokens` tokens; false when no block is free.
    fn ensure_blocks(&mut self, i: usize, tokens: usize) -> bool {
        let needed = tokens.div_ceil(self.config.block_size);
        while self.running[i].blocks.len() < needed {
            match self.pool.allocate() {
                Some(b) => self.running[i].blocks.push(b),
                None => return false,
            }
        }
        true
    }

    /// Admits the head of the queue if its blocks fit: into the running batch, or, for a
    /// request whose prompt KV is to be received, into the transfers in flight.
    fn admit(&mut self, budget: usize, now: Duration) -> Admitted {
        let bs = self.config.block_size;
        let Some(seq) = self.waiting.front_mut() else {
            return Admitted::Blocked;
        };
        if seq.prompt_kv == PromptSource::Received {
            // Its KV has landed: it holds the blocks of its whole prompt (taken when it was
            // admitted for the transfer) and has one token to compute, its last.
            debug_assert_eq!(seq.tokens.len(), seq.prompt_len);
            debug_assert_eq!(seq.computed + 1, seq.prompt_len);
            debug_assert_eq!(seq.blocks.len(), seq.prompt_len.div_ceil(bs));
            let seq = self.waiting.pop_front().expect("front exists");
            self.running.push(seq);
            return Admitted::Running {
                tokens: 1,
                first_cached: None,
            };
        }
        let len = seq.tokens.len();
        seq.hash_blocks(len / bs, bs);
        // The longest cached run of leading blocks, leaving at least one token to compute.
        let max_hit_blocks = (len - 1) / bs;
        let mut hit: Vec<BlockId> = Vec::new();
        for &h in seq.hashes.iter().take(max_hit_blocks) {
            match self.pool.lookup(h) {
                Some(b) => hit.push(b),
                None => break,
            }
        }
        let hit_tokens = hit.len() * bs;
        let transfer = seq.prompt_kv == PromptSource::Transfer;
        // A transfer needs blocks for the whole prompt at once; a prefill for this step's chunk.
        let n = if transfer {
            len - hit_tokens
        } else {
            (len - hit_tokens).min(budget)
        };
        let new_blocks = (hit_tokens + n).div_ceil(bs) - hit.len();
        let must_fit = match self.config.scheduler {
            Scheduler::Kvroute => new_blocks,
            Scheduler::Dynamo => len.div_ceil(bs) - hit.len(),
        };
        let hits_on_free = hit.iter().filter(|&&b| self.pool.is_free(b)).count();
        if self.pool.num_free() < must_fit + hits_on_free {
            return Admitted::Blocked;
        }
        let mut seq = self.waiting.pop_front().expect("front exists");
        for &b in &hit {
            self.pool.touch(b);
        }
        seq.blocks = hit;
        for _ in 0..new_blocks {
            seq.blocks
                .push(self.pool.allocate().expect("counted free blocks"));
        }
        seq.computed = hit_tokens;
        seq.registered = seq.blocks.len().min(hit_tokens / bs);
        let first = seq.cached_tokens.is_none();
        if first {
            seq.cached_tokens = Some(hit_tokens);
            self.stats.prefix_cache_queries += seq.prompt_len as u64;
            self.stats.prefix_cache_hits += hit_tokens as u64;
        }
        if transfer {
            let id = seq.id;
            self.start_transfer(seq, n, now);
            return Admitted::Receiving {
                id,
                cached: hit_tokens,
            };
        }
        self.running.push(seq);
        Admitted::Running {
            tokens: n,
            first_cached: first.then_some(hit_tokens),
        }
    }
}

/// What [`EngineCore::admit`] did with the head of the queue.
enum Admitted {
    /// Into the running batch, computing `tokens` this step; with its cached tokens on its
    /// first admission.
    Running {
        tokens: usize,
        first_cached: Option<usize>,
    },
    /// Into the transfers in flight, with its cached tokens.
    Receiving { id: RequestId, cached: usize },
    /// Its blocks do not fit (or the queue is empty).
    Blocked,
}

#[cfg(test)]
mod tests;
