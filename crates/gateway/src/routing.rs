//! Turning a request into a routing decision: tokens, block hashes, overlaps, candidates,
//! and the policy's choice. Shared by the proxy path and `POST /debug/route`, so the debug
//! answer is the decision the router would make.

use std::sync::Arc;
use std::time::Instant;

use kvroute_core::affinity::{Affinity, AffinityMode};
use kvroute_core::eligibility::{eligible, BusyThresholds, Hints, Ineligible, WorkerView};
use kvroute_core::overload::{OverloadProtection, PressureSum, Protected, WorkerPressure};
use kvroute_core::policy::predict::{predict, Prediction};
use kvroute_core::policy::Policy;
use kvroute_core::slo::{SloChoice, SloTargets};
use kvroute_core::{
    AdapterFit, Candidate, EngineLoad, KvTerms, Overlap, PolicyKind, RequestLoad, RouteRequest,
};
use kvroute_index::{BlockHash, TierCounts};
use kvroute_protocol::{Prompt, RoutingFields};
use kvroute_tokenizer::ChatFields;

use crate::error::GatewayError;
use crate::kv::KvState;
use crate::prompts::{Prompts, Tokens};
use crate::workers::{Pool, Worker};

mod hints;
mod lean;
mod slo;

use hints::with_routing_hints;
pub use hints::{parse_hints, prefill_pin, session_key};
pub use lean::LEAN_FROM_WORKERS;
pub use slo::{slo_targets, TPOT_HEADERS, TTFT_HEADERS};

/// One (worker, rank) considered for a request.
#[derive(Debug, Clone)]
pub struct Choice {
    pub worker: Arc<Worker>,
    /// Index into `worker.ranks`.
    pub rank: usize,
    pub in_flight: u64,
    pub kv: KvTerms,
    pub engine: EngineLoad,
    /// Where the request's LoRA adapter stands there.
    pub adapter: AdapterFit,
}

/// A decision and everything it was made from.
#[derive(Debug)]
pub struct Plan {
    pub policy: PolicyKind,
    pub choices: Vec<Choice>,
    pub costs: Option<Vec<f64>>,
    pub chosen: usize,
    /// Prompt tokens (0 when the policy does not tokenise).
    pub prompt_tokens: usize,
    pub hashes: Vec<BlockHash>,
    /// Pinned to one worker (by a hint or a hard session binding): never moved elsewhere.
    pub pinned: bool,
    /// The candidates carry the KV index's overlap (kv_aware; llm_d's exact prefix).
    pub reads_kv_index: bool,
    /// kv_aware: each candidate's predicted latencies and its rank's fitted models
    /// (`policy::predict`, whichever cost model decides).
    pub predictions: Option<Vec<Prediction>>,
    /// The request's latency targets (SLO headers).
    pub slo_targets: SloTargets,
    /// kv_aware with targets: the choice by headroom that decided (see `kvroute_core::slo`).
    pub slo: Option<SloChoice>,
    /// The ranks whose cost was computed: every choice, or in a large pool every eligible
    /// rank, of which `choices` keeps those read under their lock and the winner (see
    /// `routing/lean.rs`).
    pub ranks_scored: usize,
}

impl Plan {
    pub fn choice(&self) -> &Choice {
        &self.choices[self.chosen]
    }

    /// What the chosen request adds to its rank's load.
    pub fn request_load(&self, block_size: usize) -> RequestLoad {
        RequestLoad::for_prompt(
            self.hashes.iter().map(|h| h.0).collect(),
            self.prompt_tokens,
            self.choice().kv.overlap.device as usize,
            block_size,
        )
    }

    /// [`Self::request_load`], which with `track` (`--router-track-output-blocks`) a stream
    /// grows as it generates, toward the body's `nvext.agent_hints.osl`.
    pub fn answer_load(
        &self,
        block_size: usize,
        track: bool,
        fields: &RoutingFields,
    ) -> RequestLoad {
        let load = self.request_load(block_size);
        if !(track && fields.stream) {
            return load;
        }
        let osl = kvroute_protocol::NvExt::osl(fields.nvext.as_ref());
        load.tracking_output(self.prompt_tokens, block_size, osl)
    }
}

fn ineligible(e: Ineligible) -> GatewayError {
    match e {
        Ineligible::InvalidPin(why) => GatewayError::InvalidPin(why),
        Ineligible::NoEndpoint => {
            GatewayError::NoEndpoint("no healthy worker compatible with the request's hints")
        }
        Ineligible::AllOverloaded => GatewayError::AllWorkersOverloaded,
        Ineligible::PinnedOverloaded => GatewayError::PinnedWorkerOverloaded,
    }
}

/// The request's prompt tokens as the engine will see them, or `None` when it has no
/// single prompt (batched prompts, embeddings of several inputs) or the tokenizer cannot
/// render it (then routing goes on without KV overlap).
pub fn prompt_tokens(prompts: &Prompts, body: &[u8], fields: &RoutingFields<'_>) -> Option<Tokens> {
    let result = if fields.messages.is_some() {
        // The same fields, read the same way, as kvroute-sim reads them.
        let chat: ChatFields = serde_json::from_slice(body).ok()?;
        prompts.encode_chat(&chat.messages, &chat.options())
    } else {
        match fields
            .prompt
            .as_ref()
            .or(fields.text.as_ref())
            .or(fields.input_ids.as_ref())
        {
            Some(Prompt::Text(text)) => prompts.encode_prompt(text),
            Some(Prompt::Tokens(ids)) => Ok(prompts.hashed(ids.clone())),
            Some(Prompt::Texts(texts)) if texts.len() == 1 => prompts.encode_prompt(&texts[0]),
            Some(Prompt::TokenBatches(b)) if b.len() == 1 => Ok(prompts.hashed(b[0].clone())),
            _ => return None,
        }
    };
    match result {
        Ok(tokens) => Some(tokens),
        Err(error) => {
            tracing::debug!(%error, "Cannot tokenise the request; routing without KV overlap");
            None
        }
    }
}

/// The index's counts as an [`Overlap`].
fn overlap(counts: TierCounts) -> Overlap {
    Overlap {
        device: counts.device,
        host: counts.host,
        disk: counts.disk,
        external: counts.external,
    }
}

/// Prompts longer than this (bytes of body) are tokenised on the blocking pool when a real
/// tokenizer is configured: a BPE pass over an 8k-token prompt takes milliseconds.
const BLOCKING_TOKENIZE_BYTES: usize = 16 * 1024;

/// A body this many bytes shorter than a worker's context cannot need more than it: a token
/// is at least one byte of the body's text, and this much covers what a chat template adds.
const CONTEXT_MARGIN_BYTES: u64 = 256;

/// The request's prompt tokens when `policy` uses them, off the async threads when the work
/// is long. Under a policy that reads no tokens: none, only their count where the body could
/// need more than `shortest_context` (the shortest context a worker takes, for eligibility's
/// context rule), else nothing.
pub async fn tokens_for(
    kv: &Arc<KvState>,
    policy: PolicyKind,
    body: &bytes::Bytes,
    shortest_context: Option<u64>,
) -> Tokens {
    let reads_tokens = matches!(policy, PolicyKind::KvAware | PolicyKind::LlmD);
    let long = shortest_context.is_some_and(|n| body.len() as u64 + CONTEXT_MARGIN_BYTES > n);
    if !(reads_tokens || long) {
        return Tokens::default();
    }
    let work = {
        let kv = kv.clone();
        let body = body.clone();
        move || {
            RoutingFields::from_json(&body)
                .ok()
                .and_then(|fields| prompt_tokens(&kv.prompts, &body, &fields))
                .unwrap_or_default()
        }
    };
    let tokens = if kv.prompts.tokenizer.is_fallback() || body.len() < BLOCKING_TOKENIZE_BYTES {
        work()
    } else {
        tokio::task::spawn_blocking(work).await.unwrap_or_default()
    };
    match reads_tokens {
        true => tokens,
        false => Tokens::counted_only(tokens.len()),
    }
}

/// Anthropic's Messages API: its errors are Anthropic-shaped too.
pub(crate) const ANTHROPIC_ROUTES: [&str; 2] = ["/v1/messages", "/v1/messages/count_tokens"];

/// The OpenAI chat request vLLM makes of a Messages body (a clear 400 when it cannot).
pub(crate) fn messages_as_chat(body: &bytes::Bytes) -> Result<bytes::Bytes, GatewayError> {
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(GatewayError::InvalidJson)?;
    let chat = kvroute_protocol::anthropic::chat_request(&value)
        .map_err(|e| GatewayError::InvalidRequest(e.0))?;
    Ok(bytes::Bytes::from(
        serde_json::to_vec(&chat).expect("JSON serialises"),
    ))
}

/// The (worker, rank) indexes of `pool` eligible for a request (see `core::eligibility`).
fn eligible_pairs(
    pool: &Pool,
    hints: &Hints,
    busy: &BusyThresholds,
    started: Instant,
) -> Result<Vec<(usize, usize)>, GatewayError> {
    // Eligibility first: hints, health, taints, busy thresholds. Every worker's ranks in one
    // list (a view per worker slices it): two allocations a decision, not two per worker.
    let (mut rank_list, mut overloaded) = (Vec::new(), Vec::new());
    for w in &pool.workers {
        for r in &w.ranks {
            rank_list.push(r.dp_rank);
            overloaded.push(r.overloaded(busy, w.max_num_batched_tokens, started));
        }
    }
    let mut start = 0;
    let views: Vec<WorkerView<'_>> = pool
        .workers
        .iter()
        .map(|w| {
            let ranks = start..start + w.ranks.len();
            start = ranks.end;
            WorkerView {
                id: w.id.as_str(),
                ranks: &rank_list[ranks.clone()],
                overloaded: &overloaded[ranks],
                healthy: w.available(started),
                taints: &w.taints,
                max_model_len: w.max_model_len(),
            }
        })
        .collect();
    eligible(&views, hints).map_err(ineligible)
}

/// The load limits a request's candidates must pass.
#[derive(Debug, Clone, Copy, Default)]
pub struct Limits {
    /// Dynamo's busy thresholds, per rank, on the router's own load accounting.
    pub busy: BusyThresholds,
    /// smg's overload protection, per worker, on its engine's reported load.
    pub overload: OverloadProtection,
    /// `--slo-shed`: a request whose targets no candidate is predicted to meet is refused.
    pub slo_shed: bool,
}

/// The pairs of the workers overload protection lets through (see
/// `kvroute_core::overload`): all of them with protection off.
fn protect(
    pool: &Pool,
    pairs: Vec<(usize, usize)>,
    overload: &OverloadProtection,
    now: Instant,
) -> Result<Vec<(usize, usize)>, GatewayError> {
    if !overload.is_on() {
        return Ok(pairs);
    }
    // The pairs come worker by worker.
    let mut workers: Vec<usize> = pairs.iter().map(|&(w, _)| w).collect();
    workers.dedup();
    let pressures: Vec<WorkerPressure> = workers
        .iter()
        .map(|&w| {
            let mut sum = PressureSum::default();
            for rank in &pool.workers[w].ranks {
                let engine = rank.engine.load(now);
                sum.add_rank(engine.waiting, engine.kv_usage, rank.in_flight());
            }
            sum.finish()
        })
        .collect();
    match overload.protect(&pressures, &mut rand::rng()) {
        Protected::Shed => Err(GatewayError::OverloadShed),
        Protected::Keep(kept) => {
            let kept: Vec<usize> = kept.into_iter().map(|i| workers[i]).collect();
            Ok(pairs
                .into_iter()
                .filter(|(w, _)| kept.contains(w))
                .collect())
        }
    }
}

/// The ranks a request may go to, for queue admission.
pub fn eligible_ranks(
    pool: &Pool,
    hints: &Hints,
    busy: &BusyThresholds,
    now: Instant,
) -> Result<Vec<(Arc<Worker>, usize)>, GatewayError> {
    Ok(eligible_pairs(pool, hints, busy, now)?
        .into_iter()
        .map(|(w, r)| (pool.workers[w].clone(), r))
        .collect())
}

/// Builds the candidates of `pool` for the request and lets its policy choose. `prompt` is
/// the prompt's tokens and block hashes (from [`tokens_for`]; empty for policies that do not
/// use them).
/// A `dry_run` (`/debug/route`) leaves every policy's state as it was.
#[allow(clippy::too_many_arguments)]
pub fn plan(
    kv: &KvState,
    pool: &Pool,
    session: Option<&str>,
    hints: &Hints,
    limits: &Limits,
    affinity: Option<&Affinity>,
    fields: &RoutingFields<'_>,
    prompt: &Tokens,
    started: Instant,
    dry_run: bool,
) -> Result<Plan, GatewayError> {
    let tokens = prompt.ids.as_slice();
    let policy = pool.policy.kind();
    let key = session;
    // Session affinity: the (worker, rank) the session used last, as a pin (hard) or a
    // preference (soft).
    let bound = match (affinity, key) {
        (Some(a), Some(k)) => a.get(k, started),
        _ => None,
    };
    let mode = affinity.map(|a| a.mode);
    let hints = &with_routing_hints(hints, bound.as_ref(), mode, pool, prompt.count(), fields);
    let reads_index = pool.policy.reads_kv_index();
    let adapter = fields
        .model
        .as_deref()
        .filter(|m| pool.workers.iter().any(|w| w.serves_adapter(m)));
    let salted = adapter
        .filter(|_| reads_index)
        .map(|a| salted(prompt, a, kv.block_size));
    let prompt = salted.as_ref().unwrap_or(prompt);
    let lean = (bound.is_none() && adapter.is_none())
        .then(|| lean::applies(pool, hints, limits, dry_run))
        .flatten();
    if let Some(plan) = lean.and_then(|k| lean::plan(kv, pool, k, prompt, started)) {
        remember(affinity, key, plan.choice(), started);
        return Ok(plan);
    }
    let (hashes, mut choices) = choices(kv, pool, hints, limits, prompt, reads_index, started)?;
    if let Some(adapter) = adapter {
        fit_adapter(&mut choices, adapter, started);
    }
    let text = if policy.needs_text(key) {
        fields.routing_text()
    } else {
        std::borrow::Cow::Borrowed("")
    };
    let request = RouteRequest {
        session_key: key,
        text: &text,
        prompt_tokens: tokens.len(),
        tokens,
        block_size: kv.block_size,
        has_preferred_taints: !hints.preferred_taints.is_empty(),
        dry_run,
        now: started,
    };
    let candidates = candidates(&choices);
    let costs = pool.policy.costs(&candidates, &request);
    let predictions = (policy == PolicyKind::KvAware).then(|| {
        let saturation = kvroute_core::policy::KvAware::saturation(&candidates);
        candidates
            .iter()
            .map(|c| predict(c, &request, saturation))
            .collect()
    });
    let shed = limits.slo_shed && !dry_run;
    let targets = (&hints.slo, &*pool.policy, candidates.as_slice(), &request);
    let slo = slo_choice(targets, predictions.as_deref(), shed)?;
    let soft_bound = match (&bound, affinity.map(|a| a.mode)) {
        (Some((worker, rank)), Some(AffinityMode::Soft)) => candidates
            .iter()
            .position(|c| c.worker.as_str() == worker && c.dp_rank == *rank),
        _ => None,
    };
    // A request's own targets outweigh a session's soft preference.
    let decision = match (&slo, soft_bound) {
        (Some(s), _) => kvroute_core::Decision { index: s.index },
        (None, Some(index)) => kvroute_core::Decision { index },
        (None, None) => pool
            .policy
            .select_costed(&candidates, &request, costs.as_deref(), &mut rand::rng())
            .ok_or(GatewayError::NoEndpoint("the policy chose no worker"))?,
    };
    drop(candidates);
    if let (Some(adapter), false) = (adapter, dry_run) {
        let c = &choices[decision.index];
        c.worker.ranks[c.rank].adapter_routed(adapter, started);
    }
    if !dry_run {
        remember(affinity, key, &choices[decision.index], started);
    }
    let ranks_scored = choices.len();
    Ok(Plan {
        policy,
        choices,
        costs,
        chosen: decision.index,
        prompt_tokens: tokens.len(),
        hashes,
        pinned: hints.pinned_worker.is_some(),
        reads_kv_index: reads_index,
        predictions,
        slo_targets: hints.slo,
        slo,
        ranks_scored,
    })
}

/// Binds the session `key` to the chosen rank, with session affinity on.
fn remember(affinity: Option<&Affinity>, key: Option<&str>, c: &Choice, now: Instant) {
    if let (Some(a), Some(k)) = (affinity, key) {
        a.bind(k, c.worker.id.as_str(), c.worker.ranks[c.rank].dp_rank, now);
    }
}

/// The candidates the policy sees, one per choice.
fn candidates(choices: &[Choice]) -> Vec<Candidate<'_>> {
    choices
        .iter()
        .map(|c| Candidate {
            worker: &c.worker.id,
            dp_rank: c.worker.ranks[c.rank].dp_rank,
            in_flight: c.in_flight,
            kv: c.kv,
            engine: c.engine,
            speed: Some(c.worker.ranks[c.rank].speed()),
            adapter: c.adapter,
        })
        .collect()
}

/// The request's targets, the pool's policy, the candidates and the request.
type Targeted<'a> = (
    &'a SloTargets,
    &'a dyn Policy,
    &'a [Candidate<'a>],
    &'a RouteRequest<'a>,
);

/// The choice by headroom, when the request has targets and the policy predicts latencies
/// (among the candidates that meet them, by the policy's [`Policy::target_costs`]); with
/// `shed`, an unattainable request's refusal.
fn slo_choice(
    (targets, policy, candidates, request): Targeted<'_>,
    predictions: Option<&[Prediction]>,
    shed: bool,
) -> Result<Option<SloChoice>, GatewayError> {
    let Some(p) = predictions.filter(|_| targets.is_set()) else {
        return Ok(None);
    };
    let predicted: Vec<kvroute_core::slo::Predicted> = p.iter().map(Into::into).collect();
    let costs = policy.target_costs(candidates, request);
    let choice = kvroute_core::slo::choose(targets, &predicted, costs.as_deref());
    match choice {
        Some(s) if shed && !s.attainable() => Err(unattainable(targets, &s, p)),
        choice => Ok(choice),
    }
}

/// `--slo-shed`'s refusal, with what the best candidate was predicted to do.
fn unattainable(targets: &SloTargets, s: &SloChoice, predictions: &[Prediction]) -> GatewayError {
    let p = &predictions[s.index];
    let mut parts = Vec::new();
    if let Some(t) = targets.ttft_ms {
        parts.push(format!(
            "TTFT target {t} ms, the best worker's predicted TTFT {:.0} ms",
            p.ttft_ms
        ));
    }
    if let Some(t) = targets.tpot_ms {
        parts.push(format!(
            "TPOT target {t} ms, its predicted time per output token {:.1} ms",
            p.step_ms
        ));
    }
    GatewayError::SloUnattainable(parts.join("; "))
}

/// `prompt` hashed for LoRA adapter `adapter`: its name salts the blocks, as the engines' KV
/// events salt an adapter's blocks.
fn salted(prompt: &Tokens, adapter: &str, block_size: usize) -> Tokens {
    let salt = kvroute_protocol::stable_hash(adapter.as_bytes());
    Tokens {
        ids: prompt.ids.clone(),
        hashes: kvroute_index::block_hashes(&prompt.ids, block_size, salt),
        counted: prompt.counted,
    }
}

/// Where `adapter` stands on each choice.
fn fit_adapter(choices: &mut [Choice], adapter: &str, now: Instant) {
    for c in choices {
        c.adapter = c.worker.ranks[c.rank].adapter_fit(adapter, now);
    }
}

/// The eligible (worker, rank) pairs of `pool` as the policy sees them, each with its KV
/// terms when the policy reads the index (`reads_index`), and the prompt's block hashes then.
fn choices(
    kv: &KvState,
    pool: &Pool,
    hints: &Hints,
    limits: &Limits,
    prompt: &Tokens,
    reads_index: bool,
    started: Instant,
) -> Result<(Vec<BlockHash>, Vec<Choice>), GatewayError> {
    let tokens = prompt.ids.as_slice();
    let (hashes, scores) = if reads_index {
        let hashes = prompt.hashes.clone();
        let scores = kv.overlaps(&hashes, started);
        (hashes, scores)
    } else {
        Default::default()
    };

    let eligible_pairs = eligible_pairs(pool, hints, &limits.busy, started)?;
    let eligible_pairs = protect(pool, eligible_pairs, &limits.overload, started)?;

    // The request's blocks, once, for the new-blocks term of every candidate.
    let request_blocks = RequestLoad::for_prompt(
        hashes.iter().map(|h| h.0).collect(),
        tokens.len(),
        0,
        kv.block_size,
    );
    let mut choices = Vec::with_capacity(eligible_pairs.len());
    for (wi, rank_index) in eligible_pairs {
        let w = &pool.workers[wi];
        {
            let rank = &w.ranks[rank_index];
            let mut terms = KvTerms::default();
            if reads_index {
                let counts = kv.counts(&scores, w, rank.replica);
                let overlap = overlap(counts).capped(tokens.len(), kv.block_size);
                let taints = hints.preferred_weight(&w.taints);
                terms = rank.with_load(|load| load.kv_terms(overlap, &request_blocks, taints));
            }
            choices.push(Choice {
                worker: w.clone(),
                rank: rank_index,
                in_flight: rank.in_flight(),
                kv: terms,
                engine: rank.engine.load(started),
                adapter: AdapterFit::None,
            });
        }
    }
    if choices.is_empty() {
        return Err(GatewayError::NoEndpoint(
            "no healthy worker serves this model",
        ));
    }
    Ok((hashes, choices))
}

/// The decision's attributes on the request's span: the last attempt's win.
pub(crate) fn trace_decision(span: &crate::otlp::RequestSpan, plan: &Plan, block_size: usize) {
    let choice = plan.choice();
    span.set_str("kvroute.policy", plan.policy.name());
    span.set_str("kvroute.worker", choice.worker.id.as_str());
    if let Some(rank) = choice.worker.ranks[choice.rank].dp_rank {
        span.set_int("kvroute.dp_rank", rank.into());
    }
    if plan.policy == PolicyKind::KvAware {
        let o = choice.kv.overlap;
        span.set_int("kvroute.overlap_blocks.device", o.device.into());
        span.set_int("kvroute.overlap_blocks.host", o.host.into());
        span.set_int("kvroute.overlap_blocks.disk", o.disk.into());
        span.set_int("kvroute.overlap_blocks.external", o.external.into());
        span.set_int("kvroute.prompt_tokens", plan.prompt_tokens as i64);
        span.set_int("kvroute.block_size", block_size as i64);
    }
    if let Some(costs) = &plan.costs {
        span.set_double("kvroute.cost", costs[plan.chosen]);
    }
}
