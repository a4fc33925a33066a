//! `kv_aware`: NVIDIA Dynamo's KV router cost model, with three terms of kvroute's. Lower cost
//! wins.
//!
//! For a request of `ISL` prompt tokens in blocks of `B` tokens, each candidate
//! (worker, rank) costs
//!
//! ```text
//! credit = overlap_score_credit * (device + pending)
//!        + host_cache_hit_weight * host
//!        + disk_cache_hit_weight * disk + shared_cache_multiplier * external
//! cost   = prefill_load_scale * max(0, (P + ISL) / B - credit) - surplus
//!        + prefill_load_scale * S * max(0, ISL / B - credit)
//!        + memory(M)                       M = decode_blocks + min(new_blocks, ceil(ISL / B) - device)
//!        + prefill_interference_weight * U * D
//!        + decode_active_request_weight * active_requests
//!        + lora_load_cost * L
//! memory(M) = M * M / C   (memory_cost utilisation, C the engine's KV blocks, when known)
//!           = M           (memory_cost linear, or C unknown: Dynamo's)
//! pending = max(0, (ceil(ISL / B) - new_blocks) - (device + host + disk + external))
//! U       = max(0, ceil(ISL / B) - (device + host + disk + external + pending))
//! S       = min over the candidates of the engine's waiting requests (unknown: 0)
//! surplus = min(prefill_load_scale * max(0, credit - (P + ISL) / B), memory(decode_blocks))
//!           on a rank with room (no requests waiting, KV under 90% with the request), with a
//!           credit above 1, every candidate's speed seen; else 0 ("Surplus credit")
//! ```
//!
//! where `device`, `host`, `disk`, `external` are the leading blocks of the prompt the
//! candidate holds in each tier, `P` the prompt tokens routed there that have not produced
//! a first token, `decode_blocks` the distinct blocks of its requests still generating,
//! `new_blocks` the request's blocks not already among them, `U` the blocks the engine must
//! compute for this request and `D` the requests there that have produced a first token
//! (decoding), and `L` the adapter loads the request is expected to cost there (0 without an
//! adapter or where it runs, 1 with a slot to spare or where it waits, 2 where every slot is
//! taken: [`AdapterFit::expected_loads`](crate::AdapterFit::expected_loads); see "LoRA adapters"
//! below). When the request names preferred taints, the cost is multiplied by
//! `exp(-tanh(w))`, `w` the summed weights of those the worker has. Exact ties are broken
//! uniformly at random. With `temperature > 0` the choice is sampled from
//! `softmax(-(cost - min) / ((max - min) * temperature))`.
//! [`KvAwareConfig::dynamo`] is Dynamo 1.6.1's model exactly (credit 1, scale 1, linear memory,
//! no interference term, every rank priced alike); the defaults are kvroute's (credit 2, scale
//! 4, linear memory, interference 0.25, each rank priced at its learned speed: "Calibrated"
//! below), measured in `docs/policies.md` ("kv_aware") and BENCHMARKS.md.
//!
//! The terms estimate what the request adds to the rank: compute (the prefill term: the
//! work queued ahead of it plus its own uncached prompt), KV memory (the memory term: the
//! blocks its active requests hold plus the blocks this request would add) and the decodes its
//! prefill stalls (the interference term). A block is added only if the rank does not already
//! hold it, either for another active request (a shared prefix) or in its device prefix cache
//! (`device`): a prefix-cache hit pins a block that is already resident instead of
//! allocating, filling and later evicting a copy. So `min(new_blocks, ceil(ISL / B) - device)`
//! (the two sets are both leading runs of the prompt's hash chain, so the resident blocks are
//! the longer of the two). Counting the cached prefix as new memory, as Dynamo's formula does,
//! charges the warm rank for memory it does not spend; on decode-heavy traffic, where the
//! ranks' `decode_blocks` differ by more than a whole prompt, it made the load term drown the
//! overlap and spread conversations over every rank (half the prefix reuse of `cache_aware` on
//! multi-turn chats). Host, disk and external hits still allocate device blocks and are
//! counted.
//!
//! **Memory by utilisation** (`memory_cost` utilisation, opt-in): each block weighted by the
//! utilisation it brings the rank to (why it is not the default: the `priced` module).
//!
//! **Prefill interference.** A chunked prefill runs in the same forward pass as the rank's
//! decodes, and the step takes as long as both: each of the `D` requests decoding there
//! waits for every chunk of this request's `U` uncached blocks. Its cost to them is about
//! `U * D` block-times, which the prefill term (this request's own wait) does not see. The
//! term moves long uncached prompts away from ranks that are busy decoding, towards ranks
//! with few decodes or with the prefix cached (a cached block interferes with nothing), and
//! leaves short or cached prompts where their prefix is. In Dynamo's engine model on the
//! Mooncake trace at 4x its rate it cut E2E p90 by 30% (13.9 s against 20.0 s with credit 2 /
//! scale 4 alone) at about the same TTFT (BENCHMARKS.md).
//!
//! Two terms keep a shared prefix in one place when the cluster is overloaded:
//!
//! - **Pending hits** (`pending`). The prompt's blocks already held by the rank's active
//!   requests (`ceil(ISL / B) - new_blocks`, a leading run as above) are resident when
//!   this request's prefill runs: the requests still decoding pin them, and those still
//!   prefilling are ahead of it in the engine's queue. They are device hits the KV events
//!   have not reported yet (an engine reports a block once it is computed, which under a
//!   queue is long after the routing of the requests that share it), so the blocks beyond
//!   the reported overlap are credited as device blocks. Without it the second request of
//!   a group gets no prefill credit while the first waits in a queue, and the load terms
//!   send it elsewhere.
//! - **Saturation** (`S`). When every candidate's engine has requests waiting, no choice
//!   avoids a queue, and an uncached prompt block is compute taken from requests that
//!   wait: in a steady overload about `S` of them will queue behind this one on whichever
//!   rank it joins, each delayed by its uncached prefill. So the request's own uncached
//!   prefill is counted `1 + S` times. `S` is the same for every candidate: it scales the
//!   prefix credit's weight against the load terms, is 0 as long as one engine has an empty
//!   queue (the model is then exactly the one above), and is 0 when any engine's queue is
//!   unknown. On llm-d's shared-prefix workload with 4 replicas (2.5x overloaded), these two
//!   terms took the hit rate from 34% to 47% (`cache_aware`: 48%); without them groups were
//!   spread over two or three ranks, each recomputing the system prompt.
//!
//! **Surplus credit.** Where a cached prefix is worth more than the whole prefill the rank would
//! do for the request, the surplus comes off the cost, up to the blocks the rank's other
//! requests hold, so that a long prefix holds its request against the rank's decode load; only
//! where the rank has room, once every rank's speed is seen (the rules and why: the `priced`
//! module).
//!
//! **Calibrated** (`--router-cost-model calibrated`, the default; `weighted` is the model
//! above with every rank priced alike). The terms above count work in blocks,
//! the same for every rank. On a cluster of mixed GPUs a block of prefill or a step of
//! decode costs more on a slower rank, and the router is not told which is which. The
//! calibrated model prices each rank's terms at its learned speed: the prefill terms
//! (prefill, saturation, interference) are multiplied by the rank's prefill price, the
//! request's own new blocks in the memory term and the active-request term by its decode
//! price,
//!
//! ```text
//! price = exp(sign(l) * max(0, |l| - 0.1)),   l = ln(factor / mean factor of the candidates)
//! memory = (C / C_i) * (decode_blocks + d * new)       (M's two parts, as above)
//! ```
//!
//! with `C_i` the rank's KV capacity in blocks and `C` the candidates' mean (where known): a
//! block is a larger share of a smaller engine, which preempts sooner. The blocks already
//! held are not priced by speed (memory held is memory held on any GPU; priced, they drove
//! long agent sessions off the slow engines and made them re-prefill elsewhere, TTFT p90
//! 1.5-2.3x, BENCHMARKS.md). The factors are the rank's robust speed factors
//! ([`crate::latency`], "Speed factors": TTFT over the prior model's, decode step over the
//! reference step). Prices are relative to the candidates' mean, so the weights keep their
//! balance, and differences within 10% (the factors' spread between identical engines) are
//! taken as none, so that on identical engines the model is the weighted one. A rank with
//! fewer than 10 observations is priced at the mean of those with more while it is busy;
//! while it is idle, and some rank is faster than the mean beyond the noise, at the fastest
//! rank's prices, so that it gets tried (at the mean, an unseen fast engine could stay idle
//! for ever beside the engine that served first and holds the prefixes), until its first
//! reading ([`FACTOR_EARLY`](crate::latency::FACTOR_EARLY) observations on) says it is
//! slower. On three speed
//! tiers it sends less of the work to the slow ranks, and a rank made slower at run time
//! loses traffic as its factors rise.
//!
//! **Own decode** (`own_decode_weight`, 3,000; calibrated model only). The terms above weigh
//! the work queued at a rank, not the request's own decode, a step a token for its whole
//! answer and most of its end-to-end time: on a rank twice as slow to step, twice as long,
//! and its slot held twice as long. The term adds
//!
//! ```text
//! + own_decode_weight * (d' - 1)
//! d' = d brought one more noise band (10%) toward 1, where p is beyond its band on the same
//!      side of 1 as d; else d' = 1
//! ```
//!
//! A faster rank is preferred by up to the weight's worth of blocks (3,000: 750 uncached
//! prompt blocks at scale 4), so a fast rank with a long prefill queue still loses to an idle
//! slow one. It is a constant, not the answer's expected length times a step: scaled with the
//! answer (1,000 tokens on shared-prefix groups) it piled an overloaded cluster's long answers
//! onto the fast ranks (TTFT p90 1.4-2.1x). Why both prices must agree: a decode factor also
//! rises with a rank's load where the engine's steps outgrow the reference step (in Dynamo's
//! engine model, identical engines at five times an agentic trace's rate read up to 2.2x
//! apart while their prefill factors stayed within the band), and with the decode price alone
//! the term moved those identical engines' TTFT p90 by up to 11%; on mixed GPUs both prices
//! part (BENCHMARKS.md). The second band keeps small strays off a term this heavy.
//!
//! **KV overflow** (`kv_overflow_weight`, 4; 0 in Dynamo's model). An engine whose running
//! requests need more KV than it has preempts one and recomputes it later, and one whose KV is
//! full holds new requests in its queue until blocks free: those requests are a workload's TTFT
//! tail. The blocks the request would take the engine beyond 90% of its capacity `C_i` cost as
//! prefill again, `kv_overflow_weight` times (a preemption recomputes a whole sequence, many
//! blocks for each block short):
//!
//! ```text
//! + prefill_load_scale * kv_overflow_weight * max(0, K + new - 0.9 * C_i)
//! K = max(decode_blocks, kv_usage * C_i)
//! ```
//!
//! (priced at the rank's prefill price under the calibrated model), `kv_usage` the engine's
//! reported KV utilisation: without `--router-track-output-blocks` the router's count misses
//! the answers' blocks, which the engine's figure holds (on shared-prefix groups with 1,000-token
//! answers an engine was full, its queue waiting for KV, while the router counted 87%, and a
//! group's prefix kept sending requests there). The term is 0 when no candidate is under 90%
//! (`Cluster::kv_room`): with nowhere to go with room it would only balance memory at four
//! times the prefill price, recomputing prefixes for nothing (on the Mooncake trace at 5x, where
//! every engine is full, it cost TTFT p50 a third). Not so with the answers' blocks tracked
//! (`answers_counted`): the router's counts then tell full engines apart by how far over they
//! are, where the engines' reported utilisation stops at 100%, and the term keeps spreading
//! (without it there, shared-prefix groups at 3x had TTFT p99 2.2 s against 0.28 s).
//! Agentic sessions grow where they started,
//! and the prefix credit keeps them there; without the term one engine filled and its sessions
//! queued for KV (TTFT p99 1-16 s at 3-5x their rate in Dynamo's engine model, against Dynamo's
//! 0.3 s; with it 0.37-1.05 s; BENCHMARKS.md).
//!
//! **LoRA adapters** (`lora_load_cost`). An engine runs at most `max_lora` adapters per step and
//! loads an adapter before the step that needs it; a request of an adapter that the engine
//! does not run costs a load, and on an engine whose slots are all taken, a wait for one to
//! free as well. Each expected load costs `lora_load_cost` (in the cost's unit, blocks of
//! prefill at scale 1), so an adapter's requests stay on the engines that run it until the
//! load terms there outweigh a load elsewhere. (Its KV overlap is per adapter already: an
//! adapter's blocks are hashed with its name.) [`KvAwareConfig::dynamo`] keeps the term: it
//! is 0 for a request without an adapter, all that Dynamo routes. The predicted cost model
//! adds the loads' time to the predicted TTFT instead
//! ([`predicted_adapter_load_ms`](crate::predicted_adapter_load_ms) at the rank's fitted load
//! time, 50 ms a load until its answers have taught it: see [`crate::latency`]).

use rand::{Rng, RngCore};

use super::{Policy, PolicyKind};
use crate::latency::{FittedSpeed, SpeedFactors};
use crate::{Candidate, Decision, EngineLoad, RouteRequest};

mod calibrated;
mod priced;
mod sample;

use calibrated::has_kv_room;
pub use calibrated::{
    Cluster, DEFAULT_KV_OVERFLOW_WEIGHT, DEFAULT_OWN_DECODE_WEIGHT, SPEED_EVIDENCE, SPEED_NOISE,
};
pub use priced::PromptTerms;
pub use sample::{sample_ranks, sample_size, AUTO_SAMPLE_FROM_RANKS, AUTO_SAMPLE_RANKS};

/// How the memory term counts KV blocks (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MemoryCost {
    /// Each block counts once, as in Dynamo's model.
    #[default]
    Linear,
    /// Each block counts the engine's KV utilisation after the request (`M * M / C`).
    Utilisation,
}

impl MemoryCost {
    pub fn as_str(self) -> &'static str {
        match self {
            MemoryCost::Linear => "linear",
            MemoryCost::Utilisation => "utilisation",
        }
    }
}

/// What `kv_aware` minimises (`--router-cost-model`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CostModel {
    /// The weighted sum of blocks above (Dynamo's model, with kvroute's terms and weights).
    Weighted,
    /// Predicted milliseconds from the ranks' learned latency models (see
    /// [`super::predict`]); the weights above do not apply.
    Predicted,
    /// The weighted sum with each rank's terms priced at its learned speed relative to the
    /// cluster's (see "Calibrated" in the module docs): kvroute's default.
    #[default]
    Calibrated,
}

impl CostModel {
    pub fn as_str(self) -> &'static str {
        match self {
            CostModel::Weighted => "weighted",
            CostModel::Predicted => "predicted",
            CostModel::Calibrated => "calibrated",
        }
    }
}

impl std::str::FromStr for CostModel {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "weighted" => Ok(CostModel::Weighted),
            "predicted" => Ok(CostModel::Predicted),
            "calibrated" => Ok(CostModel::Calibrated),
            _ => Err(format!(
                "unknown cost model {s:?} (expected weighted, predicted or calibrated)"
            )),
        }
    }
}

/// The cost model's weights (Dynamo's flags, kvroute's defaults: see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct KvAwareConfig {
    pub overlap_score_credit: f64,
    pub prefill_load_scale: f64,
    pub decode_active_request_weight: f64,
    pub temperature: f64,
    pub host_cache_hit_weight: f64,
    pub disk_cache_hit_weight: f64,
    pub shared_cache_multiplier: f64,
    pub memory_cost: MemoryCost,
    pub prefill_interference_weight: f64,
    pub cost_model: CostModel,
    /// The cost of one expected adapter load (see the module docs).
    pub lora_load_cost: f64,
    /// Weight of the KV-overflow term (see the module docs; 0: off).
    pub kv_overflow_weight: f64,
    /// Weight of the own-decode term of the calibrated model (see the module docs; 0: off).
    pub own_decode_weight: f64,
    /// Whether the router's count of a rank's blocks holds its answers' blocks
    /// (`--router-track-output-blocks`): then the overflow term applies even where no
    /// candidate has room (see the module docs).
    pub answers_counted: bool,
}

impl Default for KvAwareConfig {
    fn default() -> Self {
        Self {
            overlap_score_credit: 2.0,
            prefill_load_scale: 4.0,
            prefill_interference_weight: 0.25,
            lora_load_cost: DEFAULT_LORA_LOAD_COST,
            cost_model: CostModel::Calibrated,
            kv_overflow_weight: DEFAULT_KV_OVERFLOW_WEIGHT,
            ..Self::dynamo()
        }
    }
}

impl KvAwareConfig {
    /// NVIDIA Dynamo 1.6.1's KV router model and defaults: credit 1, scale 1, memory counted
    /// linearly, no interference term.
    pub fn dynamo() -> Self {
        Self {
            overlap_score_credit: 1.0,
            prefill_load_scale: 1.0,
            decode_active_request_weight: 0.0,
            temperature: 0.0,
            host_cache_hit_weight: 0.75,
            disk_cache_hit_weight: 0.25,
            shared_cache_multiplier: 0.0,
            memory_cost: MemoryCost::Linear,
            prefill_interference_weight: 0.0,
            cost_model: CostModel::Weighted,
            // Dynamo has no adapter term; it is 0 for every request without an adapter (all
            // that Dynamo routes), so its model is unchanged, and adapters still count.
            lora_load_cost: DEFAULT_LORA_LOAD_COST,
            kv_overflow_weight: 0.0,
            // A term of the calibrated model only: the weighted one (Dynamo's) prices every
            // rank alike, so it is 0 there whatever its weight.
            own_decode_weight: DEFAULT_OWN_DECODE_WEIGHT,
            answers_counted: false,
        }
    }
}

/// An engine's waiting requests as the saturation counts them (unknown: 0).
fn waiting(engine: &EngineLoad) -> f64 {
    engine.waiting.map_or(0.0, |w| w.max(0.0))
}

/// kvroute's default cost of an adapter load (see the module docs and BENCHMARKS.md).
pub const DEFAULT_LORA_LOAD_COST: f64 = 4096.0;

/// The `kv_aware` policy.
#[derive(Clone, Default)]
pub struct KvAware {
    pub config: KvAwareConfig,
}

impl std::fmt::Debug for KvAware {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let k = &self.config;
        f.debug_struct("KvAware")
            .field("overlap_score_credit", &k.overlap_score_credit)
            .field("prefill_load_scale", &k.prefill_load_scale)
            .field(
                "decode_active_request_weight",
                &k.decode_active_request_weight,
            )
            .field("temperature", &k.temperature)
            .field("host_cache_hit_weight", &k.host_cache_hit_weight)
            .field("disk_cache_hit_weight", &k.disk_cache_hit_weight)
            .field("shared_cache_multiplier", &k.shared_cache_multiplier)
            .field("memory_cost", &k.memory_cost)
            .field(
                "prefill_interference_weight",
                &k.prefill_interference_weight,
            )
            .field("cost_model", &k.cost_model)
            .field("lora_load_cost", &k.lora_load_cost)
            .field("kv_overflow_weight", &k.kv_overflow_weight)
            .field("own_decode_weight", &k.own_decode_weight)
            .finish()
    }
}

impl KvAware {
    pub fn new(config: KvAwareConfig) -> Self {
        Self { config }
    }

    /// The cluster's saturation `S`: the fewest requests waiting in any candidate's engine,
    /// 0 when one of them does not report it (see the module docs).
    pub fn saturation(candidates: &[Candidate<'_>]) -> f64 {
        (candidates.iter())
            .map(|c| waiting(&c.engine))
            .reduce(f64::min)
            .unwrap_or(0.0)
    }

    /// What the cost of each candidate reads from all of them: the saturation and, for the
    /// calibrated model, the mean speed factors.
    pub fn cluster(&self, candidates: &[Candidate<'_>]) -> Cluster {
        let prior = FittedSpeed::prior();
        self.cluster_of((candidates.iter()).map(|c| {
            let speed = c.speed.as_ref().unwrap_or(prior).factors();
            (c.engine, speed, c.kv.decode_blocks)
        }))
    }

    /// [`KvAware::cluster`] of candidates given by their engines' loads, their speed factors
    /// and their decode blocks, for a caller that has not built the candidates.
    pub fn cluster_of(
        &self,
        ranks: impl Iterator<Item = (EngineLoad, SpeedFactors, u64)>,
    ) -> Cluster {
        // One pass: a caller may read each rank's gauges from atomics as it goes.
        let (mut saturation, mut kv_room, mut seen) = (None::<f64>, self.config.answers_counted, 0);
        let (mut prefill, mut decode, mut capacity) = ((0.0, 0.0), (0.0, 0.0), (0.0, 0.0));
        let (mut prefill_best, mut decode_best) = (f64::INFINITY, f64::INFINITY);
        let mut settled = true;
        for (engine, s, blocks) in ranks {
            seen += 1;
            let queued = waiting(&engine);
            saturation = Some(saturation.map_or(queued, |s| s.min(queued)));
            kv_room = kv_room || has_kv_room(&engine, blocks);
            if s.prefill_observations >= SPEED_EVIDENCE {
                prefill = (prefill.0 + s.prefill_factor, prefill.1 + 1.0);
                prefill_best = prefill_best.min(s.prefill_factor);
            } else {
                settled = false;
            }
            if s.decode_observations >= SPEED_EVIDENCE {
                decode = (decode.0 + s.decode_factor, decode.1 + 1.0);
                decode_best = decode_best.min(s.decode_factor);
            }
            if let Some(blocks) = engine.num_gpu_blocks.filter(|&n| n > 0) {
                capacity = (capacity.0 + blocks as f64, capacity.1 + 1.0);
            }
        }
        let uniform = Cluster {
            kv_room: kv_room || seen == 0,
            ..Cluster::uniform(saturation.unwrap_or(0.0))
        };
        if self.config.cost_model != CostModel::Calibrated || seen == 0 {
            return uniform;
        }
        let mean = |(sum, n): (f64, f64)| if n > 0.0 { sum / n } else { 1.0 };
        let (prefill, decode) = (mean(prefill), mean(decode));
        Cluster {
            prefill_factor: prefill,
            decode_factor: decode,
            settled,
            prefill_best: prefill_best.min(prefill),
            decode_best: decode_best.min(decode),
            capacity: if capacity.1 > 0.0 {
                mean(capacity)
            } else {
                0.0
            },
            ..uniform
        }
    }

    /// Whether its choice is the cheapest candidate (no temperature) by a cost that reads
    /// of a candidate's speed only its factors and their observations (the weighted and
    /// calibrated models): then a caller may score a rank that holds none of the prompt
    /// from a [`LoadSummary`](crate::load::LoadSummary) and those four numbers, without
    /// building its candidate from the rank's locked state.
    pub fn decides_on_load(&self) -> bool {
        self.config.temperature <= 0.0 && self.config.cost_model != CostModel::Predicted
    }

    /// The cost of one candidate, `saturation` being [`KvAware::saturation`] of all the
    /// candidates, every rank at the same speed (see the module docs).
    pub fn cost(&self, c: &Candidate<'_>, request: &RouteRequest<'_>, saturation: f64) -> f64 {
        self.cost_in(c, request, &Cluster::uniform(saturation))
    }

    /// The cost of one candidate among the candidates `cluster` describes.
    pub fn cost_in(&self, c: &Candidate<'_>, request: &RouteRequest<'_>, cluster: &Cluster) -> f64 {
        let saturation = cluster.saturation;
        let k = &self.config;
        if k.cost_model == CostModel::Predicted {
            let cost = super::predict::predict(c, request, saturation).cost_ms;
            return if request.has_preferred_taints {
                cost * (-c.kv.preferred_taint_weight.tanh()).exp()
            } else {
                cost
            };
        }
        let speed = c.speed.as_ref().unwrap_or(FittedSpeed::prior()).factors();
        let cost = self.priced(
            &PromptTerms::of(request),
            cluster,
            &c.kv,
            &c.engine,
            &speed,
            c.adapter.expected_loads(),
        );
        if request.has_preferred_taints {
            cost * (-c.kv.preferred_taint_weight.tanh()).exp()
        } else {
            cost
        }
    }
}

impl Policy for KvAware {
    fn kind(&self) -> PolicyKind {
        PolicyKind::KvAware
    }

    fn kv_aware(&self) -> Option<&KvAware> {
        Some(self)
    }

    fn select(
        &self,
        candidates: &[Candidate<'_>],
        request: &RouteRequest<'_>,
        rng: &mut dyn RngCore,
    ) -> Option<Decision> {
        let costs = self.costs(candidates, request)?;
        Some(self.choose(&costs, rng))
    }

    fn select_costed(
        &self,
        candidates: &[Candidate<'_>],
        request: &RouteRequest<'_>,
        costs: Option<&[f64]>,
        rng: &mut dyn RngCore,
    ) -> Option<Decision> {
        match costs {
            Some(costs) if costs.len() == candidates.len() && !costs.is_empty() => {
                Some(self.choose(costs, rng))
            }
            _ => self.select(candidates, request, rng),
        }
    }

    fn target_costs(
        &self,
        candidates: &[Candidate<'_>],
        request: &RouteRequest<'_>,
    ) -> Option<Vec<f64>> {
        if self.config.cost_model != CostModel::Calibrated {
            return self.costs(candidates, request);
        }
        let neutral = KvAware::new(KvAwareConfig {
            cost_model: CostModel::Weighted,
            ..self.config.clone()
        });
        neutral.costs(candidates, request)
    }

    fn costs(&self, candidates: &[Candidate<'_>], request: &RouteRequest<'_>) -> Option<Vec<f64>> {
        if candidates.is_empty() {
            return None;
        }
        let cluster = self.cluster(candidates);
        Some(
            candidates
                .iter()
                .map(|c| self.cost_in(c, request, &cluster))
                .collect(),
        )
    }
}

impl KvAware {
    /// The cheapest of `costs` (ties at random), or with a temperature a draw from the softmax
    /// over the normalised negative costs.
    fn choose(&self, costs: &[f64], rng: &mut dyn RngCore) -> Decision {
        let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
        let max = costs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let t = self.config.temperature;
        let index = if t > 0.0 && max > min {
            // Softmax over normalised negative costs.
            let weights: Vec<f64> = costs
                .iter()
                .map(|c| (-(c - min) / ((max - min) * t)).exp())
                .collect();
            let total: f64 = weights.iter().sum();
            let mut x = rng.random::<f64>() * total;
            let mut chosen = weights.len() - 1;
            for (i, w) in weights.iter().enumerate() {
                if x < *w {
                    chosen = i;
                    break;
                }
                x -= w;
            }
            chosen
        } else {
            let mut chosen = 0;
            let mut ties = 0u32;
            for (i, &c) in costs.iter().enumerate() {
                if c == min {
                    ties += 1;
                    if rng.random_range(0..ties) == 0 {
                        chosen = i;
                    }
                }
            }
            chosen
        };
        Decision { index }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use rand::rngs::SmallRng;
    use rand::SeedableRng;

    use super::*;
    use crate::policy::test_support::ids;
    use crate::{EngineLoad, KvTerms, Overlap};

    /// Dynamo's model: the exact figures below are its formula's.
    fn dynamo() -> KvAware {
        KvAware::new(KvAwareConfig::dynamo())
    }

    fn req(prompt_tokens: usize) -> RouteRequest<'static> {
        RouteRequest {
            prompt_tokens,
            block_size: 16,
            ..RouteRequest::simple(None, "", Instant::now())
        }
    }

    fn cand<'a>(id: &'a kvroute_protocol::WorkerId, kv: KvTerms) -> Candidate<'a> {
        Candidate {
            kv,
            ..Candidate::new(id, kv.active_requests)
        }
    }

    #[test]
    fn the_cost_formula() {
        let ids = ids(1);
        let p = dynamo();
        let c = cand(
            &ids[0],
            KvTerms {
                overlap: Overlap {
                    device: 10,
                    host: 4,
                    disk: 4,
                    external: 8,
                },
                prefill_tokens: 320,
                decode_blocks: 50,
                new_blocks: 90,
                active_requests: 3,
                prefilling_requests: 0,
                preferred_taint_weight: 0.0,
            },
        );
        // (320 + 1600)/16 = 120 blocks; credit 10 + 3 + 1 + 0 = 14; 106 + 50 + 90.
        assert!((p.cost(&c, &req(1600), 0.0) - 246.0).abs() < 1e-9);
        let p = KvAware::new(KvAwareConfig {
            decode_active_request_weight: 2.0,
            shared_cache_multiplier: 0.5,
            prefill_load_scale: 2.0,
            ..KvAwareConfig::dynamo()
        });
        // credit 18; 2 * 102 + 140 + 6.
        assert!((p.cost(&c, &req(1600), 0.0) - 350.0).abs() < 1e-9);
        // Saturated: the own uncached prefill (100 - 18 blocks) counts 1 + 3 times.
        assert!((p.cost(&c, &req(1600), 3.0) - (350.0 + 3.0 * 2.0 * 82.0)).abs() < 1e-9);
        // Credit never makes the prefill term negative.
        let big = cand(
            &ids[0],
            KvTerms {
                overlap: Overlap {
                    device: 1000,
                    ..Overlap::default()
                },
                ..KvTerms::default()
            },
        );
        assert_eq!(dynamo().cost(&big, &req(160), 0.0), 0.0);
    }

    #[test]
    fn overlap_wins_until_load_outweighs_it() {
        let ids = ids(2);
        let p = dynamo();
        let mut rng = SmallRng::seed_from_u64(0);
        let warm = KvTerms {
            overlap: Overlap {
                device: 60,
                ..Overlap::default()
            },
            ..KvTerms::default()
        };
        let cold = KvTerms::default();
        let c = [cand(&ids[0], cold), cand(&ids[1], warm)];
        assert_eq!(p.select(&c, &req(1024), &mut rng).unwrap().index, 1);
        // The warm worker is busy prefilling 2000 tokens and decoding: the cold one wins.
        let busy = KvTerms {
            prefill_tokens: 2000,
            decode_blocks: 100,
            ..warm
        };
        let c = [cand(&ids[0], cold), cand(&ids[1], busy)];
        assert_eq!(p.select(&c, &req(1024), &mut rng).unwrap().index, 0);
    }

    #[test]
    fn blocks_cached_on_the_device_are_not_new_memory() {
        let ids = ids(2);
        let p = dynamo();
        // 1000 tokens: 63 blocks, the last partial; 40 of them cached on the device.
        let r = req(1000);
        let warm = KvTerms {
            overlap: Overlap {
                device: 40,
                ..Overlap::default()
            },
            new_blocks: 63,
            ..KvTerms::default()
        };
        // Prefill 62.5 - 40; new memory 63 - 40.
        assert!((p.cost(&cand(&ids[0], warm), &r, 0.0) - 45.5).abs() < 1e-9);
        // Blocks shared with an active request count once, whichever set is larger; the 10
        // beyond the cached 40 are pending hits (prefill 62.5 - 50).
        let shared = KvTerms {
            decode_blocks: 50,
            new_blocks: 13,
            ..warm
        };
        assert!((p.cost(&cand(&ids[0], shared), &r, 0.0) - (12.5 + 50.0 + 13.0)).abs() < 1e-9);
        // Host hits are loaded into fresh device blocks: still new memory.
        let host = KvTerms {
            overlap: Overlap {
                host: 40,
                ..Overlap::default()
            },
            new_blocks: 63,
            ..KvTerms::default()
        };
        assert!((p.cost(&cand(&ids[1], host), &r, 0.0) - (32.5 + 63.0)).abs() < 1e-9);
        // Never below zero, even for inconsistent inputs.
        let over = KvTerms {
            overlap: Overlap {
                device: 100,
                ..Overlap::default()
            },
            new_blocks: 63,
            ..KvTerms::default()
        };
        assert_eq!(p.cost(&cand(&ids[1], over), &r, 0.0), 0.0);
    }

    #[test]
    fn a_conversation_stays_where_its_prefix_is_despite_a_little_more_decode_load() {
        // A later turn: 75 blocks, 31 cached on the warm rank, which decodes 35 blocks more
        // than the cold one. Warm: 44 to prefill, 260 + 44 blocks held (348); cold: 75 +
        // 225 + 75 (375). Counting the cached prefix as new memory (44 + 260 + 75 = 379)
        // would move the conversation.
        let ids = ids(2);
        let p = dynamo();
        let r = req(75 * 16);
        let warm = KvTerms {
            overlap: Overlap {
                device: 31,
                ..Overlap::default()
            },
            decode_blocks: 260,
            new_blocks: 75,
            ..KvTerms::default()
        };
        let cold = KvTerms {
            decode_blocks: 225,
            new_blocks: 75,
            ..KvTerms::default()
        };
        let c = [cand(&ids[0], cold), cand(&ids[1], warm)];
        let mut rng = SmallRng::seed_from_u64(4);
        assert_eq!(p.select(&c, &r, &mut rng).unwrap().index, 1);
        // A much busier warm rank still loses.
        let busy = KvTerms {
            decode_blocks: 400,
            ..warm
        };
        let c = [cand(&ids[0], cold), cand(&ids[1], busy)];
        assert_eq!(p.select(&c, &r, &mut rng).unwrap().index, 0);
    }

    #[test]
    fn ties_are_broken_at_random_and_temperature_samples() {
        let ids = ids(3);
        let p = dynamo();
        // 100 tokens: 7 blocks, none held by an active request.
        let fresh = KvTerms {
            new_blocks: 7,
            ..KvTerms::default()
        };
        let c: Vec<_> = ids.iter().map(|id| cand(id, fresh)).collect();
        let mut rng = SmallRng::seed_from_u64(1);
        let mut seen = [0; 3];
        for _ in 0..300 {
            seen[p.select(&c, &req(100), &mut rng).unwrap().index] += 1;
        }
        assert!(seen.iter().all(|&n| n > 50), "{seen:?}");
        // With temperature, the costlier candidate is chosen sometimes, the cheap one mostly.
        let hot = KvAware::new(KvAwareConfig {
            temperature: 1.0,
            ..KvAwareConfig::dynamo()
        });
        let c = [
            cand(
                &ids[0],
                KvTerms {
                    overlap: Overlap {
                        device: 6,
                        ..Overlap::default()
                    },
                    ..fresh
                },
            ),
            cand(&ids[1], fresh),
        ];
        let mut seen = [0; 2];
        for _ in 0..1000 {
            seen[hot.select(&c, &req(100), &mut rng).unwrap().index] += 1;
        }
        assert!(seen[0] > seen[1] && seen[1] > 100, "{seen:?}");
        // Without temperature, always the cheapest.
        assert!((0..50).all(|_| p.select(&c, &req(100), &mut rng).unwrap().index == 0));
    }

    #[test]
    fn blocks_held_by_active_requests_are_pending_hits() {
        // A group's first request (450 blocks, 352 of them the shared system prompt) waits
        // in the queue of rank 1: no KV event reports its blocks yet, but the second
        // request will find them computed. Rank 1 prefills more and decodes more.
        let ids = ids(2);
        let p = dynamo();
        let r = req(450 * 16);
        let cold = KvTerms {
            prefill_tokens: 2000 * 16,
            decode_blocks: 9000,
            new_blocks: 450,
            ..KvTerms::default()
        };
        let pending = KvTerms {
            prefill_tokens: 2400 * 16,
            decode_blocks: 9300,
            new_blocks: 98,
            ..KvTerms::default()
        };
        // Cold: 2450 + 9450; pending: 2850 - 352 + 9398.
        assert!((p.cost(&cand(&ids[1], pending), &r, 0.0) - 11896.0).abs() < 1e-9);
        let c = [cand(&ids[0], cold), cand(&ids[1], pending)];
        let mut rng = SmallRng::seed_from_u64(5);
        assert_eq!(p.select(&c, &r, &mut rng).unwrap().index, 1);
        // Blocks the overlap already reports are not credited twice.
        let reported = KvTerms {
            overlap: Overlap {
                device: 352,
                ..Overlap::default()
            },
            ..pending
        };
        assert!((p.cost(&cand(&ids[1], reported), &r, 0.0) - 11896.0).abs() < 1e-9);
    }

    #[test]
    fn saturation_is_the_smallest_known_queue() {
        let ids = ids(3);
        let queued = |w: Option<f64>| Candidate {
            engine: EngineLoad {
                waiting: w,
                ..EngineLoad::default()
            },
            ..Candidate::new(&ids[0], 0)
        };
        let sat = |ws: &[Option<f64>]| {
            KvAware::saturation(&ws.iter().map(|&w| queued(w)).collect::<Vec<_>>())
        };
        assert_eq!(sat(&[Some(30.0), Some(12.0), Some(40.0)]), 12.0);
        assert_eq!(
            sat(&[Some(30.0), Some(0.0), Some(40.0)]),
            0.0,
            "one engine is idle"
        );
        assert_eq!(
            sat(&[Some(30.0), None]),
            0.0,
            "unknown counts as not saturated"
        );
        assert_eq!(sat(&[]), 0.0);
    }

    #[test]
    fn a_saturated_cluster_keeps_a_prefix_where_it_is() {
        // Every engine has a queue; the warm rank has 1200 more blocks queued than the cold
        // one (about two and a half cold prompts). Unsaturated, the queue wins; with 10
        // requests waiting everywhere, recomputing 352 blocks costs more than the wait.
        let ids = ids(2);
        let p = dynamo();
        let r = req(450 * 16);
        let waiting = |w: f64| EngineLoad {
            waiting: Some(w),
            ..EngineLoad::default()
        };
        let cold = KvTerms {
            prefill_tokens: 5000 * 16,
            decode_blocks: 20000,
            new_blocks: 450,
            ..KvTerms::default()
        };
        let warm = KvTerms {
            overlap: Overlap {
                device: 352,
                ..Overlap::default()
            },
            prefill_tokens: 6200 * 16,
            decode_blocks: 20000,
            new_blocks: 450,
            ..KvTerms::default()
        };
        let mut rng = SmallRng::seed_from_u64(6);
        let with = |kv, w| Candidate {
            kv,
            engine: waiting(w),
            ..Candidate::new(&ids[0], 0)
        };
        let idle = [with(cold, 0.0), with(warm, 10.0)];
        assert_eq!(p.select(&idle, &r, &mut rng).unwrap().index, 0);
        let saturated = [with(cold, 10.0), with(warm, 40.0)];
        assert_eq!(p.select(&saturated, &r, &mut rng).unwrap().index, 1);
        let costs = p.costs(&saturated, &r).unwrap();
        // Cold: 5450 + 10 * 450 + 20450; warm: 6298 + 10 * 98 + 20098.
        assert!((costs[0] - 30400.0).abs() < 1e-9, "{costs:?}");
        assert!((costs[1] - 27376.0).abs() < 1e-9, "{costs:?}");
    }

    #[test]
    fn debug_names_every_parameter() {
        assert_eq!(
            format!("{:?}", dynamo()),
            "KvAware { overlap_score_credit: 1.0, prefill_load_scale: 1.0, decode_active_request_weight: 0.0, temperature: 0.0, host_cache_hit_weight: 0.75, disk_cache_hit_weight: 0.25, shared_cache_multiplier: 0.0, memory_cost: Linear, prefill_interference_weight: 0.0, cost_model: Weighted, lora_load_cost: 4096.0, kv_overflow_weight: 0.0, own_decode_weight: 3000.0 }"
        );
    }

    #[test]
    fn preferred_taints_scale_the_cost() {
        let ids = ids(2);
        let p = dynamo();
        let mut r = req(320);
        r.has_preferred_taints = true;
        let fresh = KvTerms {
            new_blocks: 20,
            ..KvTerms::default()
        };
        let plain = cand(&ids[0], fresh);
        let tainted = cand(
            &ids[1],
            KvTerms {
                preferred_taint_weight: 1.0,
                ..fresh
            },
        );
        let ratio = p.cost(&tainted, &r, 0.0) / p.cost(&plain, &r, 0.0);
        assert!((ratio - (-(1.0f64).tanh()).exp()).abs() < 1e-12);
        let mut rng = SmallRng::seed_from_u64(2);
        assert_eq!(p.select(&[plain, tainted], &r, &mut rng).unwrap().index, 1);
    }

    fn sized(id: &kvroute_protocol::WorkerId, kv: KvTerms, blocks: Option<u64>) -> Candidate<'_> {
        Candidate {
            engine: EngineLoad {
                num_gpu_blocks: blocks,
                ..EngineLoad::default()
            },
            ..cand(id, kv)
        }
    }

    #[test]
    fn a_prefix_worth_more_than_the_prefill_holds_its_request_where_the_rank_has_room() {
        // An agent session's next step, 464 blocks, 429 of them cached on a rank decoding
        // eight other sessions (2,237 blocks), and an idle rank.
        let ids = ids(2);
        let p = KvAware::new(KvAwareConfig::default());
        let r = req(464 * 16);
        let home = KvTerms {
            overlap: Overlap {
                device: 429,
                ..Overlap::default()
            },
            decode_blocks: 2237,
            new_blocks: 81,
            active_requests: 8,
            ..KvTerms::default()
        };
        let idle = KvTerms {
            new_blocks: 465,
            ..KvTerms::default()
        };
        // Both ranks' speeds seen, alike.
        let at = |id, kv, waiting: f64, blocks: u64| Candidate {
            engine: EngineLoad {
                waiting: Some(waiting),
                num_gpu_blocks: Some(blocks),
                ..EngineLoad::default()
            },
            speed: fitted(1.0, 1.0, 100),
            ..cand(id, kv)
        };
        let mut rng = SmallRng::seed_from_u64(1);
        // Its prefix's surplus credit (2 x 429 blocks against a 464-block prefill) outweighs
        // the other sessions' memory: 4 * (464 - 858) + 2,272 + 70 = 766 against 2,320.
        let c = [at(&ids[0], idle, 0.0, 16384), at(&ids[1], home, 0.0, 16384)];
        let costs = p.costs(&c, &r).unwrap();
        assert!((costs[1] - 766.0).abs() < 1e-9 && (costs[0] - 2320.0).abs() < 1e-9);
        assert_eq!(p.select(&c, &r, &mut rng).unwrap().index, 1);
        // None while a rank's speed is unseen (an idle unseen rank is priced to be tried).
        let unseen = Candidate {
            speed: None,
            ..at(&ids[0], idle, 0.0, 16384)
        };
        let c = [unseen, at(&ids[1], home, 0.0, 16384)];
        assert!((p.costs(&c, &r).unwrap()[1] - 2342.0).abs() < 1e-9);
        // None on a rank with requests waiting: the prefill term stops at 0 (2,342).
        let c = [at(&ids[0], idle, 0.0, 16384), at(&ids[1], home, 2.0, 16384)];
        assert!((p.costs(&c, &r).unwrap()[1] - 2342.0).abs() < 1e-9);
        assert_eq!(p.select(&c, &r, &mut rng).unwrap().index, 0);
        // Nor on one the request would take beyond 90% of its KV (the overflow term counts).
        let c = [at(&ids[0], idle, 0.0, 16384), at(&ids[1], home, 0.0, 2500)];
        assert_eq!(p.select(&c, &r, &mut rng).unwrap().index, 0);
        // Nor beyond the memory the rank's other requests hold: an idle rank's prefix earns
        // no more than its prefill (35 blocks of memory, no surplus).
        let quiet = KvTerms {
            decode_blocks: 0,
            active_requests: 0,
            ..home
        };
        let c = [at(&ids[1], quiet, 0.0, 16384)];
        assert!((p.costs(&c, &r).unwrap()[0] - 35.0).abs() < 1e-9);
        // Nor with a credit of 1 (Dynamo's model), whatever the overlap.
        let one = KvAware::new(KvAwareConfig {
            overlap_score_credit: 1.0,
            ..KvAwareConfig::default()
        });
        let c = [at(&ids[1], home, 0.0, 16384)];
        assert!(one.costs(&c, &r).unwrap()[0] >= 2272.0);
    }

    #[test]
    fn memory_costs_by_utilisation_when_the_engine_size_is_known() {
        let ids = ids(2);
        let r = req(200 * 16);
        // A warm rank with one long conversation decoding, and an idle cold one.
        let warm = KvTerms {
            overlap: Overlap {
                device: 160,
                ..Overlap::default()
            },
            decode_blocks: 2500,
            new_blocks: 200,
            active_requests: 1,
            ..KvTerms::default()
        };
        let cold = KvTerms {
            new_blocks: 200,
            ..KvTerms::default()
        };
        let p = KvAware::new(KvAwareConfig {
            memory_cost: MemoryCost::Utilisation,
            ..KvAwareConfig::default()
        });
        let w = sized(&ids[0], warm, Some(16384));
        let c = sized(&ids[1], cold, Some(16384));
        // 2540 blocks at 2540 / 16384 utilisation, 40 uncached blocks beside 1 decode, and
        // the prefix's surplus credit (2 x 160 against a 200-block prefill: 480), up to what
        // the decoding conversation adds to the memory term (2500^2 / 16384).
        let expected =
            2540.0 * 2540.0 / 16384.0 + 0.25 * 40.0 - 480f64.min(2500.0 * 2500.0 / 16384.0);
        assert!((p.cost(&w, &r, 0.0) - expected).abs() < 1e-9);
        assert!((p.cost(&c, &r, 0.0) - (4.0 * 200.0 + 200.0 * 200.0 / 16384.0)).abs() < 1e-9);
        let mut rng = SmallRng::seed_from_u64(0);
        assert_eq!(p.select(&[c, w], &r, &mut rng).unwrap().index, 1);
        // Counted linearly (the default and Dynamo's count, or the engine's size unknown) the
        // decode outweighs the prefix, and the turn goes to the cold rank.
        let linear = KvAware::default();
        assert_eq!(linear.select(&[c, w], &r, &mut rng).unwrap().index, 0);
        let unknown = [sized(&ids[1], cold, None), sized(&ids[0], warm, None)];
        assert_eq!(p.select(&unknown, &r, &mut rng).unwrap().index, 0);
        assert!((p.cost(&unknown[1], &r, 0.0) - (2540.0 + 10.0 - 480.0)).abs() < 1e-9);
        // A nearly full rank costs nearly all its blocks: the prefix no longer holds it.
        let full = KvTerms {
            decode_blocks: 15000,
            ..warm
        };
        let f = sized(&ids[0], full, Some(16384));
        assert_eq!(p.select(&[c, f], &r, &mut rng).unwrap().index, 0);
    }

    #[test]
    fn prefill_interference_moves_long_uncached_prompts_off_decoding_ranks() {
        let ids = ids(2);
        let p = KvAware::default();
        // Rank 0 has 10 requests decoding and 2 prefilling (16 tokens left), rank 1 nothing
        // but more memory in use.
        let decoding = KvTerms {
            prefill_tokens: 16,
            decode_blocks: 1000,
            new_blocks: 1000,
            active_requests: 12,
            prefilling_requests: 2,
            ..KvTerms::default()
        };
        let quiet = KvTerms {
            decode_blocks: 3000,
            new_blocks: 1000,
            ..KvTerms::default()
        };
        let r = req(1000 * 16);
        let (a, b) = (
            sized(&ids[0], decoding, Some(16384)),
            sized(&ids[1], quiet, Some(16384)),
        );
        let no_interference = KvAware::new(KvAwareConfig {
            prefill_interference_weight: 0.0,
            ..KvAwareConfig::default()
        });
        let base = no_interference.cost(&a, &r, 0.0);
        // 1,000 uncached blocks stall the 10 decodes (not the 2 prefills).
        assert!((p.cost(&a, &r, 0.0) - (base + 0.25 * 1000.0 * 10.0)).abs() < 1e-9);
        assert_eq!(p.cost(&b, &r, 0.0), no_interference.cost(&b, &r, 0.0));
        let mut rng = SmallRng::seed_from_u64(0);
        assert_eq!(
            no_interference.select(&[a, b], &r, &mut rng).unwrap().index,
            0
        );
        assert_eq!(p.select(&[a, b], &r, &mut rng).unwrap().index, 1);
        // A prompt cached there but for its last block interferes with almost nothing: it stays.
        let cached = KvTerms {
            overlap: Overlap {
                device: 999,
                ..Overlap::default()
            },
            ..decoding
        };
        let a = sized(&ids[0], cached, Some(16384));
        assert_eq!(p.select(&[a, b], &r, &mut rng).unwrap().index, 0);
    }

    #[test]
    fn an_adapter_load_is_counted_until_load_elsewhere_outweighs_it() {
        use crate::AdapterFit;
        let ids = ids(3);
        let p = KvAware::default();
        let r = req(1024);
        let at = |i: usize, fit: AdapterFit, prefill_tokens: u64| Candidate {
            adapter: fit,
            ..cand(
                &ids[i],
                KvTerms {
                    prefill_tokens,
                    ..KvTerms::default()
                },
            )
        };
        let base = p.cost(&at(0, AdapterFit::None, 0), &r, 0.0);
        let load = p.config.lora_load_cost;
        assert_eq!(p.cost(&at(0, AdapterFit::Running, 0), &r, 0.0), base);
        assert_eq!(
            p.cost(&at(0, AdapterFit::FreeSlot, 0), &r, 0.0),
            base + load
        );
        assert_eq!(
            p.cost(&at(0, AdapterFit::Full, 0), &r, 0.0),
            base + 2.0 * load
        );
        let mut rng = SmallRng::seed_from_u64(0);
        // Equal load: where the adapter runs, then where a slot is free.
        let c = [
            at(0, AdapterFit::Full, 0),
            at(1, AdapterFit::FreeSlot, 0),
            at(2, AdapterFit::Running, 0),
        ];
        assert_eq!(p.select(&c, &r, &mut rng).unwrap().index, 2);
        assert_eq!(p.select(&c[..2], &r, &mut rng).unwrap().index, 1);
        // The engine running it is busy with more prefill than a load is worth: elsewhere.
        let busy = (load / p.config.prefill_load_scale * 16.0) as u64 + 1600;
        let c = [
            at(0, AdapterFit::FreeSlot, 0),
            at(1, AdapterFit::Running, busy),
        ];
        assert_eq!(p.select(&c, &r, &mut rng).unwrap().index, 0);
        // Without an adapter the term is 0, in Dynamo's model as in kvroute's.
        let none = at(0, AdapterFit::None, 0);
        let zero = KvAware::new(KvAwareConfig {
            lora_load_cost: 0.0,
            ..KvAwareConfig::dynamo()
        });
        assert_eq!(dynamo().cost(&none, &r, 0.0), zero.cost(&none, &r, 0.0));
    }

    /// A rank's fitted speed after `n` observations at `prefill` and `decode` times the
    /// reference.
    fn fitted(prefill: f64, decode: f64, n: u64) -> Option<crate::latency::FittedSpeed> {
        Some(crate::latency::FittedSpeed {
            prefill_factor: prefill,
            decode_factor: decode,
            prefill_observations: n,
            decode_observations: n,
            ..Default::default()
        })
    }

    #[test]
    fn calibrated_prices_each_rank_at_its_speed_against_the_clusters() {
        let ids = ids(3);
        // The own-decode term apart (its own test, below).
        let calibrated = KvAware::new(KvAwareConfig {
            cost_model: CostModel::Calibrated,
            own_decode_weight: 0.0,
            ..KvAwareConfig::default()
        });
        let weighted = KvAware::new(KvAwareConfig {
            cost_model: CostModel::Weighted,
            ..KvAwareConfig::default()
        });
        let kv = KvTerms {
            prefill_tokens: 3200,
            decode_blocks: 400,
            new_blocks: 100,
            active_requests: 4,
            prefilling_requests: 1,
            ..KvTerms::default()
        };
        let at = |i: usize, speed| Candidate {
            speed,
            ..cand(&ids[i], kv)
        };
        let r = req(1600);
        let costs = |p: &KvAware, c: &[Candidate<'_>]| p.costs(c, &r).unwrap();
        // Identical ranks within the noise: exactly the weighted costs.
        let same = [
            at(0, fitted(1.0, 1.0, 100)),
            at(1, fitted(1.08, 0.93, 100)),
            at(2, fitted(0.95, 1.05, 100)),
        ];
        assert_eq!(costs(&calibrated, &same), costs(&weighted, &same));
        // Two times slower at both: each priced term costs about twice the fast rank's; the
        // 400 blocks held there count alike everywhere.
        let tiers = [
            at(0, fitted(0.5, 0.5, 100)),
            at(1, fitted(1.0, 1.0, 100)),
            at(2, fitted(2.0, 2.0, 100)),
        ];
        let c = costs(&calibrated, &tiers);
        let w = costs(&weighted, &tiers);
        assert!(c[0] < w[0] && c[2] > w[2], "{c:?} {w:?}");
        let ratio = (c[2] - 400.0) / (c[0] - 400.0);
        assert!((3.0..4.0).contains(&ratio), "{ratio}");
        let mut rng = SmallRng::seed_from_u64(0);
        assert_eq!(calibrated.select(&tiers, &r, &mut rng).unwrap().index, 0);
        // The prices are exp(sign(l) * max(0, |l| - noise)), l = ln(factor / mean).
        let cluster = calibrated.cluster(&tiers);
        let mean = (0.5 + 1.0 + 2.0) / 3.0;
        for (c, factor) in tiers.iter().zip([0.5f64, 1.0, 2.0]) {
            let l = (factor / mean).ln();
            let expected = (l.signum() * (l.abs() - SPEED_NOISE).max(0.0)).exp();
            let (p, d) = cluster.prices_of(&c.speed.unwrap().factors(), false);
            assert!((p - expected).abs() < 1e-12 && (d - expected).abs() < 1e-12);
        }
        assert_eq!(calibrated::NOISE_BAND, SPEED_NOISE.exp());
        // A rank without evidence is priced at the mean while it is busy; while it is idle,
        // and some rank is faster than the mean beyond the noise, at the fastest rank's
        // prices, so that it gets tried (at the mean it could sit idle for ever beside a fast
        // rank holding the prefixes), until a first reading says it is slower; never at the
        // prior.
        let early = crate::latency::FACTOR_EARLY as u64;
        let unseen = [
            at(0, fitted(0.2, 0.2, 100)),
            at(1, fitted(0.4, 0.4, 100)),
            at(2, fitted(1.0, 1.0, early - 1)),
        ];
        let cluster = calibrated.cluster(&unseen);
        assert!((cluster.prefill_factor - 0.3).abs() < 1e-12);
        let prices = |c: &Candidate<'_>, idle| cluster.prices_of(&c.speed.unwrap().factors(), idle);
        assert_eq!(prices(&unseen[2], false), (1.0, 1.0));
        assert_eq!(prices(&unseen[2], true), prices(&unseen[0], true));
        assert!(prices(&unseen[2], true).0 < 1.0 && prices(&unseen[1], true).0 > 1.0);
        // Its first reading counts where it is slower than the fastest, not where faster.
        let reading = |p, n| cluster.prices_of(&fitted(p, p, n).unwrap().factors(), true);
        let band = calibrated::NOISE_BAND;
        let (p, d) = reading(1.0, early);
        assert!((p - 1.0 / 0.3 / band).abs() < 1e-12 && p == d, "{p} {d}");
        assert_eq!(reading(1.0, SPEED_EVIDENCE - 1), reading(1.0, early));
        assert_eq!(reading(0.1, early), prices(&unseen[0], true));
        assert_eq!(reading(1.0, early - 1), prices(&unseen[0], true));
        let idle_kv = KvTerms {
            active_requests: 0,
            prefilling_requests: 0,
            ..kv
        };
        let rank = |i: usize, kv, speed| Candidate {
            speed,
            ..cand(&ids[i], kv)
        };
        let unseen_idle = [
            rank(0, idle_kv, fitted(0.2, 0.2, 100)),
            rank(1, idle_kv, fitted(0.4, 0.4, 100)),
            rank(2, idle_kv, fitted(1.0, 1.0, early - 1)),
        ];
        let c = costs(&calibrated, &unseen_idle);
        assert!(c[2] == c[0] && c[2] < c[1], "{c:?}");
        // Beside ranks alike within the noise, idle or not, it costs what the weighted model
        // says.
        for kv in [kv, idle_kv] {
            let alike = [
                rank(0, kv, fitted(1.0, 1.0, 100)),
                rank(1, kv, fitted(1.08, 0.93, 100)),
                rank(2, kv, fitted(0.2, 5.0, SPEED_EVIDENCE - 1)),
            ];
            assert_eq!(
                costs(&calibrated, &alike),
                costs(&weighted, &alike),
                "the unseen rank is neither cheap nor dear"
            );
        }
        // The weighted and predicted models ignore the factors.
        assert_eq!(weighted.cluster(&tiers), Cluster::uniform(0.0));
        // A block of memory on an engine with half the KV counts as two on the other.
        let sized = |i: usize, blocks| Candidate {
            engine: EngineLoad {
                num_gpu_blocks: Some(blocks),
                ..EngineLoad::default()
            },
            ..at(i, fitted(1.0, 1.0, 100))
        };
        let mem = [sized(0, 16384), sized(1, 8192)];
        let (c, w) = (costs(&calibrated, &mem), costs(&weighted, &mem));
        let memory = (kv.decode_blocks + kv.new_blocks) as f64;
        assert!((c[0] - (w[0] - memory / 4.0)).abs() < 1e-9, "{c:?} {w:?}");
        assert!((c[1] - (w[1] + memory / 2.0)).abs() < 1e-9, "{c:?} {w:?}");
    }

    #[test]
    fn the_own_decode_term_prefers_a_faster_rank_where_both_its_speeds_say_so() {
        let ids = ids(3);
        let model = |cost_model, own_decode_weight| {
            KvAware::new(KvAwareConfig {
                cost_model,
                own_decode_weight,
                ..KvAwareConfig::default()
            })
        };
        let on = model(CostModel::Calibrated, DEFAULT_OWN_DECODE_WEIGHT);
        let off = model(CostModel::Calibrated, 0.0);
        let kv = KvTerms {
            decode_blocks: 400,
            new_blocks: 100,
            active_requests: 4,
            ..KvTerms::default()
        };
        let at = |i: usize, speed, prefill_tokens| Candidate {
            speed,
            ..cand(
                &ids[i],
                KvTerms {
                    prefill_tokens,
                    ..kv
                },
            )
        };
        let r = req(1600);
        // The term alone: on - off, per rank.
        let term = |c: &[Candidate<'_>]| -> Vec<f64> {
            let (a, b) = (on.costs(c, &r).unwrap(), off.costs(c, &r).unwrap());
            a.iter().zip(&b).map(|(a, b)| a - b).collect()
        };
        // Three tiers, both speeds apart: the weight times the decode price brought one more
        // noise band toward 1, less 1.
        let tiers = [
            at(0, fitted(0.5, 0.5, 100), 0),
            at(1, fitted(1.0, 1.0, 100), 0),
            at(2, fitted(2.0, 2.0, 100), 0),
        ];
        let cluster = on.cluster(&tiers);
        let t = term(&tiers);
        let band = SPEED_NOISE.exp();
        for (i, c) in tiers.iter().enumerate() {
            let (_, d) = cluster.prices_of(&c.speed.unwrap().factors(), false);
            let expected = if d > band {
                d / band - 1.0
            } else if d * band < 1.0 {
                d * band - 1.0
            } else {
                0.0
            };
            let expected = DEFAULT_OWN_DECODE_WEIGHT * expected;
            assert!((t[i] - expected).abs() < 1e-6, "{i}: {t:?} {expected}");
        }
        assert!(t[0] < -1000.0 && t[2] > 1000.0, "{t:?}");
        // The mean rank (1/1.17 of the mean factor: one band and a half) is inside the second.
        assert_eq!(t[1], 0.0, "{t:?}");
        // A fast rank with prefill queued: without the term the idle slow rank wins, with it
        // the fast one, until its queue outweighs the term.
        let pair = |queued| {
            [
                at(0, fitted(0.5, 0.5, 100), queued),
                at(1, fitted(2.0, 2.0, 100), 0),
            ]
        };
        let mut rng = SmallRng::seed_from_u64(0);
        let choose = |p: &KvAware, c: &[Candidate<'_>], rng: &mut SmallRng| {
            p.select(c, &r, rng).unwrap().index
        };
        assert_eq!(choose(&off, &pair(16_000), &mut rng), 1);
        assert_eq!(choose(&on, &pair(16_000), &mut rng), 0);
        assert_eq!(choose(&on, &pair(400_000), &mut rng), 1);
        // A decode factor apart without the prefill factor (as load alone can make it), or
        // the two on opposite sides: no term. Within the noise: none.
        for speeds in [
            [(1.0, 2.0), (1.0, 1.0), (1.0, 0.5)],
            [(0.5, 2.0), (1.0, 1.0), (2.0, 0.5)],
            [(1.0, 1.0), (1.08, 1.09), (0.93, 0.92)],
        ] {
            let c: Vec<_> = speeds
                .iter()
                .enumerate()
                .map(|(i, &(p, d))| at(i, fitted(p, d, 100), 0))
                .collect();
            assert_eq!(term(&c), vec![0.0; 3], "{speeds:?}");
        }
        // The weighted model prices every rank alike: no term whatever its weight.
        let weighted = model(CostModel::Weighted, DEFAULT_OWN_DECODE_WEIGHT);
        let plain = model(CostModel::Weighted, 0.0);
        assert_eq!(weighted.costs(&tiers, &r), plain.costs(&tiers, &r));
    }

    #[test]
    fn blocks_beyond_nine_tenths_of_the_kv_cost_as_prefill_again_where_another_engine_has_room() {
        let ids = ids(3);
        let weighted = |kv_overflow_weight| {
            KvAware::new(KvAwareConfig {
                cost_model: CostModel::Weighted,
                kv_overflow_weight,
                ..KvAwareConfig::default()
            })
        };
        let at = |i: usize, decode_blocks, kv_usage| Candidate {
            engine: EngineLoad {
                num_gpu_blocks: Some(1000),
                kv_usage,
                ..EngineLoad::default()
            },
            ..cand(
                &ids[i],
                KvTerms {
                    decode_blocks,
                    new_blocks: 100,
                    ..KvTerms::default()
                },
            )
        };
        let r = req(1600);
        let (on, off) = (weighted(DEFAULT_KV_OVERFLOW_WEIGHT), weighted(0.0));
        assert_eq!(
            KvAwareConfig::default().kv_overflow_weight,
            DEFAULT_KV_OVERFLOW_WEIGHT
        );
        assert_eq!(KvAwareConfig::dynamo().kv_overflow_weight, 0.0);
        let extra = |c: &[Candidate<'_>]| -> Vec<f64> {
            let (a, b) = (on.costs(c, &r).unwrap(), off.costs(c, &r).unwrap());
            a.iter().zip(&b).map(|(a, b)| a - b).collect()
        };
        let per_block = 4.0 * DEFAULT_KV_OVERFLOW_WEIGHT;
        // 750 + 100 blocks of 1,000: under 900, no term; 850 + 100: 50 blocks over, each at
        // the prefill scale times the weight (the first engine has room).
        let e = extra(&[at(0, 750, None), at(1, 850, None)]);
        assert_eq!(e[0], 0.0);
        assert!((e[1] - 50.0 * per_block).abs() < 1e-9, "{e:?}");
        // The engine's reported utilisation counts where the router's count is lower (the
        // answers' blocks it does not track): 85% of 1,000 and 100 more, 50 over.
        let e = extra(&[at(0, 750, None), at(1, 500, Some(0.85))]);
        assert!((e[1] - 50.0 * per_block).abs() < 1e-9, "{e:?}");
        // and the router's count where it is higher.
        let e = extra(&[at(0, 750, None), at(1, 850, Some(0.5))]);
        assert!((e[1] - 50.0 * per_block).abs() < 1e-9, "{e:?}");
        // No engine under nine tenths: nowhere to go with room, no term.
        assert_eq!(
            extra(&[at(0, 950, None), at(1, 500, Some(0.95))]),
            vec![0.0, 0.0]
        );
        // Unless the router's counts hold the answers' blocks: they tell full engines apart.
        let counted = KvAware::new(KvAwareConfig {
            answers_counted: true,
            ..on.config.clone()
        });
        let full = [at(0, 950, None), at(1, 1000, None)];
        let (a, b) = (
            counted.costs(&full, &r).unwrap(),
            off.costs(&full, &r).unwrap(),
        );
        assert!(
            (a[0] - b[0] - 150.0 * per_block).abs() < 1e-9,
            "{a:?} {b:?}"
        );
        assert!(
            (a[1] - b[1] - 200.0 * per_block).abs() < 1e-9,
            "{a:?} {b:?}"
        );
        // Unknown capacity: no term, and room to go to.
        let unknown = Candidate {
            engine: EngineLoad::default(),
            ..at(2, 5000, None)
        };
        let e = extra(&[at(0, 950, None), unknown]);
        assert!((e[0] - 150.0 * per_block).abs() < 1e-9, "{e:?}");
        assert_eq!(e[1], 0.0);
    }
}
