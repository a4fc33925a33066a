//! A run's state between events: the engines and their steps in progress, the router's index
//! and load accounting, the requests in flight, the router queue and the running totals.
//! [`super::run`] moves it from event to event.

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap};
use std::time::{Duration, Instant};

use kvroute_core::latency::{DecodeFeatures, PrefillFeatures};
use kvroute_core::RequestLoad;
use kvroute_index::{block_hashes, KvIndex, KvIndexer, OverlapScores, ReplicaId};
use kvroute_sim::engine::{
    EngineConfig, EngineCore, EngineRequest, LoraId, PromptKv, RequestId, StepOutput,
};
use rand::rngs::SmallRng;
use rand::SeedableRng;

use super::queue::{Queued, RouterQueue};
use super::result::{percentiles, PdResult, PolicyResult};
use super::route::{Arrival, Placement, Router};
use super::scrapes::Scrapes;
use super::slo::SloTally;
use super::{Cluster, Run, SimConfig};
use crate::trace::{prompt_tokens, TraceRequest};

mod events;
mod levels;
mod oracle;
mod tenants;
use events::apply_events;
use levels::Levels;
use tenants::{tenant_count, tenant_results, TenantTally};

/// A request on an engine.
struct Live {
    arrival: Duration,
    tenant: u32,
    load: RequestLoad,
    role: Role,
    /// What the router knew when it sent it there (fed to the TTFT model with its TTFT).
    features: PrefillFeatures,
    /// When its last token came out (the inter-token gaps feed the decode model).
    last_token: Option<Duration>,
    /// Tokens it has produced.
    outputs: u64,
}

enum Role {
    /// Its tokens are the client's; `computes_prompt` says whether its engine's cache hits
    /// count (not when the prompt's KV was received).
    Answer {
        answered: bool,
        computes_prompt: bool,
    },
    /// A split request's prefill: when it ends the request goes to `decode`.
    Prefill {
        decode: usize,
        decode_load: RequestLoad,
        request: EngineRequest,
    },
}

/// Characters standing for tokens, for the text-keyed policies (cache_aware, prefix_hash).
fn text_of(tokens: &[u32]) -> String {
    tokens
        .iter()
        .map(|&t| char::from_u32(0x4E00 + t % 20000).unwrap_or('?'))
        .collect()
}

/// The block-hash salt of an adapter's requests (0 for the base model), engines' and index's.
pub(super) fn lora_salt(lora: Option<LoraId>) -> u64 {
    lora.map_or(0, |l| {
        kvroute_protocol::stable_hash(format!("lora-{}", l.0).as_bytes())
    })
}

/// The adapter of the trace's request `r` when there are `loras` (see the module docs).
fn lora_of(r: &TraceRequest, loras: u32) -> Option<LoraId> {
    let first = r.hash_ids.first().copied().unwrap_or(0);
    (loras > 0).then(|| LoraId((first % u64::from(loras)) as u32))
}

/// Running totals.
#[derive(Default)]
struct Tally {
    ttft: Vec<f64>,
    e2e: Vec<f64>,
    prompt: u64,
    cached: u64,
    output: u64,
    rejected: usize,
    /// Requests answered per engine (all engines; the decode ones are reported).
    answered_by: Vec<usize>,
    prefills_on: Vec<usize>,
    tokens_by: Vec<u64>,
    decode_only: usize,
    split: usize,
    /// By tenant number (one, tenant 0, without tenants).
    by_tenant: Vec<TenantTally>,
    slo: SloTally,
}

/// See the module docs.
pub(super) struct State<'a> {
    cfg: &'a SimConfig,
    router: Router,
    engines: Vec<EngineCore>,
    /// Each engine's step in progress, with its end.
    pending: Vec<Option<(Duration, StepOutput)>>,
    /// The ends of the steps in `pending`, earliest first: the next one without a pass over
    /// every engine (at 1,024 engines that pass, three times an event, was a quarter of a run).
    ends: BinaryHeap<Reverse<(Duration, usize)>>,
    /// Engines that may have work and no step in progress: given a request, or their step
    /// just ended. With P/D every engine is looked at instead (transfers land on idle ones).
    wake: BTreeSet<usize>,
    index: KvIndex,
    /// The engines' gauges as the router's scrapes read them.
    scrapes: Scrapes,
    rng: SmallRng,
    base: Instant,
    /// Keyed by engine: a split request has the same id on both of its engines.
    live: HashMap<(usize, RequestId), Live>,
    tally: Tally,
    queue: Option<RouterQueue>,
    levels: Levels,
    /// The order requests were routed in, and when (the tests read it).
    routed: Vec<(RequestId, Duration)>,
    /// The last arrival: tokens served until then count in the tenants' shares.
    last_arrival: Duration,
    /// The end of the last step: the run's makespan (a later queue deadline does not count).
    last_end: Duration,
}

impl<'a> State<'a> {
    pub fn new(cfg: &'a SimConfig, last_arrival: Duration) -> Self {
        let bs = cfg.engine.block_size;
        let n = cfg.cluster.engines();
        let mut router = Router::new(&cfg.cluster, bs, cfg.shapes.capacities(n, &cfg.engine));
        router.output_blocks = cfg.output_blocks;
        router.sample_ranks = cfg.sample_ranks;
        router.told_speeds = cfg.shapes.told_speeds(n);
        let engines = (0..n)
            .map(|i| {
                EngineCore::new(EngineConfig {
                    seed: cfg.seed.wrapping_add(i as u64),
                    ..cfg.shapes.engine(i, &cfg.engine)
                })
            })
            .collect();
        let budget = cfg.engine.max_num_batched_tokens as u64;
        Self {
            cfg,
            router,
            engines,
            pending: (0..n).map(|_| None).collect(),
            ends: BinaryHeap::new(),
            wake: BTreeSet::new(),
            index: KvIndex::new(bs),
            scrapes: Scrapes::new(cfg.metrics_refresh, n, cfg.seed),
            rng: SmallRng::seed_from_u64(cfg.seed),
            base: Instant::now(),
            live: HashMap::new(),
            tally: Tally {
                answered_by: vec![0; n],
                prefills_on: vec![0; n],
                tokens_by: vec![0; n],
                by_tenant: (0..tenant_count(cfg))
                    .map(|_| TenantTally::default())
                    .collect(),
                ..Tally::default()
            },
            queue: cfg.queue.map(|q| RouterQueue::new(q, budget)),
            levels: Levels::new(cfg),
            routed: Vec::new(),
            last_arrival,
            last_end: Duration::ZERO,
        }
    }

    /// The next event after the arrival at `t_arrival`, if any: a step's end, a transfer
    /// landing on an idle engine, a queued request's deadline.
    pub fn next_event(&self, t_arrival: Option<Duration>) -> Option<Duration> {
        let t_engine = self.ends.peek().map(|Reverse((end, _))| *end);
        // An idle engine waiting only for KV wakes when the first transfer lands (P/D only).
        let t_transfer = self.router.halves().and_then(|_| {
            self.engines
                .iter()
                .zip(&self.pending)
                .filter(|(_, slot)| slot.is_none())
                .filter_map(|(e, _)| e.next_transfer_done())
                .min()
        });
        let t_deadline = self.queue.as_ref().and_then(RouterQueue::next_deadline);
        [t_arrival, t_engine, t_transfer, t_deadline]
            .into_iter()
            .flatten()
            .min()
    }

    /// The steps ending at `now` take effect: tokens, cache events, load released.
    pub fn end_steps(&mut self, now: Duration) {
        let bs = self.cfg.engine.block_size;
        let mut ended = Vec::new();
        while let Some(&Reverse((end, e))) = self.ends.peek() {
            if end > now {
                break;
            }
            self.ends.pop();
            ended.push(e);
        }
        // In engine order, as a pass over every engine would take them.
        ended.sort_unstable();
        for e in ended {
            self.wake.insert(e);
            let (end, out) = self.pending[e].take().expect("a step in progress");
            self.last_end = self.last_end.max(end);
            apply_events(&mut self.index, ReplicaId(e as u32), &out.events, bs);
            self.tally.tokens_by[e] += out.tokens.len() as u64;
            let stats = self.engines[e].stats();
            let step = DecodeFeatures {
                running: stats.running as f64,
                kv_usage: stats.kv_usage,
            };
            // One inter-token gap per step feeds the decode model.
            let mut gap_seen = false;
            for t in &out.tokens {
                let key = (e, t.id);
                let Some(l) = self.live.get_mut(&key) else {
                    continue;
                };
                match &mut l.role {
                    Role::Answer {
                        answered,
                        computes_prompt,
                    } => {
                        if let Some(last) = l.last_token.filter(|_| !gap_seen) {
                            gap_seen = true;
                            let gap = (end - last).as_secs_f64() * 1e3;
                            self.router.models[e].observe_gap(&step, gap);
                        }
                        l.last_token = Some(end);
                        l.outputs += 1;
                        self.router.loads[e].output_tokens(&mut l.load, 1);
                        let tenant = &mut self.tally.by_tenant[l.tenant as usize];
                        if end <= self.last_arrival {
                            tenant.tokens += 1;
                        }
                        if let Some(q) = &mut self.queue {
                            q.charge(l.tenant, 1);
                        }
                        if !*answered {
                            *answered = true;
                            let ttft = (end - l.arrival).as_secs_f64() * 1e3;
                            self.tally.ttft.push(ttft);
                            tenant.ttft.push(ttft);
                            self.tally.slo.answered(self.cfg.slo.as_ref(), t.id.0, ttft);
                            if *computes_prompt {
                                self.router.models[e].observe_ttft(&l.features, ttft);
                                self.tally.cached += t.cached_tokens as u64;
                            }
                            self.router.loads[e].first_token(&l.load);
                        }
                        self.tally.output += 1;
                        if t.finished {
                            self.levels.end(t.id);
                            let l = self.live.remove(&key).expect("live");
                            self.router.models[e].observe_output(l.outputs as f64);
                            self.tally.e2e.push((end - l.arrival).as_secs_f64() * 1e3);
                            self.router.loads[e].finish(&l.load, false);
                        }
                    }
                    Role::Prefill { .. } => {
                        // One token: the prefill is done; the decode half goes out.
                        self.tally.cached += t.cached_tokens as u64;
                        let l = self.live.remove(&key).expect("live");
                        let ttft = (end - l.arrival).as_secs_f64() * 1e3;
                        self.router.models[e].observe_ttft(&l.features, ttft);
                        self.router.loads[e].first_token(&l.load);
                        self.router.loads[e].finish(&l.load, false);
                        self.send_to_decode(l, end);
                    }
                }
            }
        }
    }

    /// A split request's prefill `l` ended: the request goes to its decode engine.
    fn send_to_decode(&mut self, l: Live, now: Duration) {
        let Role::Prefill {
            decode,
            decode_load,
            request,
        } = l.role
        else {
            unreachable!("a prefill");
        };
        let id = request.id;
        self.scrapes.catch_up(decode, &self.engines[decode], now);
        if self.engines[decode]
            .add_request_from(request, PromptKv::Transfer)
            .is_err()
        {
            self.tally.rejected += 1;
            return self.levels.end(id);
        }
        self.router.loads[decode].start(&decode_load);
        self.tally.answered_by[decode] += 1;
        self.live.insert(
            (decode, id),
            Live {
                arrival: l.arrival,
                tenant: l.tenant,
                load: decode_load,
                role: Role::Answer {
                    answered: false,
                    computes_prompt: false,
                },
                features: l.features,
                last_token: None,
                outputs: 0,
            },
        );
    }

    /// The overlaps the index sees for `hashes`, when a policy or the queue needs them.
    fn scores(&self, hashes: &[kvroute_index::BlockHash]) -> OverlapScores {
        if self.router.needs_overlaps() || self.queue.is_some() {
            self.index.find_matches(hashes)
        } else {
            Default::default()
        }
    }

    /// Request `id`, the trace's `r`, arrives at `now`: it waits in the router queue or goes.
    pub fn arrive(&mut self, id: RequestId, r: &TraceRequest, now: Duration) {
        let tokens = prompt_tokens(r, self.cfg.hash_block, self.cfg.vocab);
        let lora = lora_of(r, self.cfg.loras);
        let hashes = block_hashes(&tokens, self.cfg.engine.block_size, lora_salt(lora));
        let tenant = self.cfg.tenants.as_ref().map_or(0, |of| of[id.0 as usize]);
        self.tally.by_tenant[tenant as usize].arrived += 1;
        self.tally.slo.arrived(self.cfg.slo.as_ref(), id.0);
        let req = Queued {
            id,
            arrival: now,
            tokens,
            hashes,
            max_tokens: r.output_length.max(1),
            tenant,
            lora,
        };
        let Some(queue) = &self.queue else {
            return self.route(req, now);
        };
        let direct = !queue.must_wait(&self.router.loads) || self.levels.below_share(tenant);
        // The cost: uncached tokens on the engine holding most of the prompt.
        let scores = self.scores(&req.hashes);
        let best = (0..self.engines.len())
            .map(|e| scores.get(ReplicaId(e as u32)).total() as usize)
            .max()
            .unwrap_or(0);
        let cost = req
            .tokens
            .len()
            .saturating_sub(best * self.cfg.engine.block_size) as u64;
        let queue = self.queue.as_mut().expect("checked");
        if direct {
            queue.charge_prompt(tenant, cost);
            return self.route(req, now);
        }
        queue.push(req, cost);
        self.dispatch(now);
    }

    /// Capacity may have freed: the queue lets go one request at a time, each routed (its
    /// load counted) before saturation is tested for the next.
    pub fn dispatch(&mut self, now: Duration) {
        while let Some(req) = self
            .queue
            .as_mut()
            .and_then(|q| q.release(&self.router.loads, now))
        {
            self.route(req, now);
        }
    }

    /// Takes out the queued requests whose wait ran out.
    pub fn expire(&mut self, now: Duration) {
        if let Some(queue) = &mut self.queue {
            queue.expire(now);
        }
    }

    /// Scores `req` on the current cache and load state and starts it where it goes.
    fn route(&mut self, req: Queued, now: Duration) {
        let scores = self.scores(&req.hashes);
        let text = if self.router.needs_text() {
            text_of(&req.tokens)
        } else {
            String::new()
        };
        let oracle = (self.cfg.ttft_oracle && self.router.halves().is_none())
            .then(|| self.oracle_choice(&req, now));
        let placement = self.router.place(
            &Arrival {
                oracle,
                tokens: &req.tokens,
                hashes: &req.hashes,
                text: &text,
                lora: req.lora,
                slo: self.cfg.slo.as_ref().map(|s| s.targets(req.id.0)),
                output_tokens: req.max_tokens as u32,
                now: self.base + now,
            },
            &scores,
            &self.scrapes.view(&self.engines, now),
            &mut self.rng,
        );
        self.routed.push((req.id, now));
        self.tally.prompt += req.tokens.len() as u64;
        let tenant = &mut self.tally.by_tenant[req.tenant as usize];
        tenant.waits.push((now - req.arrival).as_secs_f64() * 1e3);
        if now <= self.last_arrival {
            tenant.tokens += req.tokens.len() as u64;
        }
        let priority = self
            .levels
            .send(req.id, req.tenant, req.tokens.len() as u64);
        let request = EngineRequest {
            id: req.id,
            prompt: req.tokens,
            max_tokens: req.max_tokens,
            salt: lora_salt(req.lora),
            lora: req.lora,
            priority,
        };
        let (engine, load, role, features) = match placement {
            Placement::Whole {
                engine,
                load,
                features,
            } => {
                let role = Role::Answer {
                    answered: false,
                    computes_prompt: true,
                };
                self.wake.insert(engine);
                self.scrapes.catch_up(engine, &self.engines[engine], now);
                if self.engines[engine].add_request(request).is_err() {
                    self.tally.rejected += 1;
                    return self.levels.end(req.id);
                }
                self.tally.answered_by[engine] += 1;
                if self.router.halves().is_some() {
                    self.tally.decode_only += 1;
                }
                (engine, load, role, features)
            }
            Placement::Split {
                prefill,
                prefill_load,
                prefill_features,
                decode,
                decode_load,
            } => {
                let prefill_request = EngineRequest {
                    max_tokens: 1,
                    ..request.clone()
                };
                self.scrapes.catch_up(prefill, &self.engines[prefill], now);
                if self.engines[prefill].add_request(prefill_request).is_err() {
                    self.tally.rejected += 1;
                    return self.levels.end(req.id);
                }
                self.tally.prefills_on[prefill] += 1;
                self.tally.split += 1;
                let role = Role::Prefill {
                    decode,
                    decode_load,
                    request,
                };
                (prefill, prefill_load, role, prefill_features)
            }
        };
        self.router.loads[engine].start(&load);
        self.router
            .adapter_routed(&self.engines[engine], engine, req.lora);
        self.live.insert(
            (engine, req.id),
            Live {
                arrival: req.arrival,
                tenant: req.tenant,
                load,
                role,
                features,
                last_token: None,
                outputs: 0,
            },
        );
    }

    /// Idle engines with work start a step; one that only admits or lands KV computes
    /// nothing, and its cache events take effect at once.
    pub fn start_steps(&mut self, now: Duration) {
        let bs = self.cfg.engine.block_size;
        let woken = std::mem::take(&mut self.wake);
        let every: Vec<usize> = match self.router.halves() {
            Some(_) => (0..self.engines.len()).collect(),
            None => woken.into_iter().collect(),
        };
        for e in every {
            let (slot, engine) = (&mut self.pending[e], &mut self.engines[e]);
            if slot.is_none() && engine.has_work() {
                self.scrapes.catch_up(e, engine, now);
                let out = engine.step(now);
                if out.is_idle() {
                    apply_events(&mut self.index, ReplicaId(e as u32), &out.events, bs);
                    // Still work and nothing done: looked at again at the next event.
                    self.wake.insert(e);
                } else {
                    self.ends.push(Reverse((now + out.duration, e)));
                    *slot = Some((now + out.duration, out));
                }
            }
        }
    }

    /// The figures of a run that ended at `now`.
    pub fn finish(self, now: Duration) -> Run {
        let mut tally = self.tally;
        let engines = self.engines;
        let end = if self.last_end.is_zero() {
            now
        } else {
            self.last_end
        };
        let makespan = end.as_secs_f64().max(1e-9);
        let ttft_ms = percentiles(&mut tally.ttft);
        let pd = match (&self.cfg.cluster, self.router.halves()) {
            (Cluster::Disaggregated(c), Some((prefill, decode))) => Some(PdResult {
                prefill_policy: c.prefill_policy.name().to_owned(),
                decode_policy: c.decode_policy.name().to_owned(),
                min_uncached_tokens: c.min_uncached_tokens,
                prefill_requests_per_worker: tally.prefills_on[prefill].to_vec(),
                decode_requests_per_worker: tally.answered_by[decode.clone()].to_vec(),
                decode_only: tally.decode_only,
                split: tally.split,
                kv_transfer_tokens: engines[decode]
                    .iter()
                    .map(|e| e.stats().kv_transfer_tokens_received)
                    .sum(),
            }),
            _ => None,
        };
        let requests_per_worker = match &pd {
            Some(pd) => pd.decode_requests_per_worker.clone(),
            None => tally.answered_by,
        };
        let result = PolicyResult {
            policy: self.cfg.name(),
            requests: requests_per_worker.iter().sum(),
            rejected: tally.rejected,
            ttft_ms,
            ttft_sorted_ms: tally.ttft,
            e2e_ms: percentiles(&mut tally.e2e),
            throughput_rps: tally.e2e.len() as f64 / makespan,
            output_tokens_per_s: tally.output as f64 / makespan,
            hit_share: tally.cached as f64 / tally.prompt.max(1) as f64,
            requests_per_worker,
            preemptions: engines.iter().map(|e| e.stats().preemptions).sum(),
            lora_loads: engines.iter().map(|e| e.stats().lora_loads).sum(),
            fitted_lora_load_ms: match self.cfg.loras {
                0 => Vec::new(),
                _ => self
                    .router
                    .models
                    .iter()
                    .map(|m| m.speed().adapter_load_ms)
                    .collect(),
            },
            pd,
            queue: self.queue.map(RouterQueue::result),
            tenants: match self.cfg.tenants {
                Some(_) => tenant_results(&mut tally.by_tenant),
                None => Vec::new(),
            },
            slo: tally.slo.result(self.cfg.slo.as_ref(), makespan),
        };
        Run {
            result,
            engines,
            tokens_by: tally.tokens_by,
            routed: self.routed,
            speeds: self.router.models.iter().map(|m| m.speed()).collect(),
        }
    }
}
