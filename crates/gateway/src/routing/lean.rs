//! kv_aware's decision in a large pool, without a candidate per rank.
//!
//! A prompt's prefix is held by a few ranks of a thousand, in the index and among their
//! active requests; every other rank's cost is a function of its load alone. So in a pool of
//! [`LEAN_FROM_WORKERS`] workers or more, a plain request (no pin, allowed list, taints,
//! latency targets, adapter, session binding, busy thresholds or overload protection: those
//! take the full path, [`super::plan`]'s) is decided in two passes over the ranks, neither
//! taking a rank's lock nor allocating per rank:
//!
//! 1. the cluster's terms ([`KvAware::cluster_of`]: saturation, mean speeds and capacity)
//!    from each rank's engine gauges and published speed factors;
//! 2. each rank's cost: from its published [`LoadSummary`] when the index reports none of
//!    the prompt there and no active request there starts in the bucket of the prompt's
//!    first block ([`LoadSummary::terms_apart`]), else from its locked load, as the full
//!    path reads it. The cheapest wins, exact ties at random.
//!
//! The cost is [`KvAware::cost_in`], the full path's, on the same terms: the choice is the
//! one the full path would make on the same state. The plan keeps as choices the ranks
//! costed from their locked load and the winner (the dashboard shows those, and how many
//! ranks were costed); `POST /debug/route` takes the full path and shows every candidate.
//! What it saves: at 1,024 workers, a locked read, a speed model's copy, a candidate and a
//! predicted latency per rank (BENCHMARKS.md, "A kv_aware decision at 16, 256 and 1,024
//! workers").

use std::time::Instant;

use kvroute_core::eligibility::{BusyThresholds, Hints};
use kvroute_core::policy::predict::predict;
use kvroute_core::policy::KvAware;
use kvroute_core::{AdapterFit, Candidate, RequestLoad, RouteRequest};
use kvroute_index::{OverlapScores, ReplicaId};
use rand::Rng;

use super::{overlap, Choice, Limits, Plan};
use crate::kv::KvState;
use crate::prompts::Tokens;
use crate::workers::{Pool, Worker};

/// Pools of this many workers or more take the lean path (smaller ones show every
/// candidate on the dashboard, and cost little either way).
pub const LEAN_FROM_WORKERS: usize = 64;

/// `pool`'s kv_aware policy when the request may take the lean path (see the module docs).
pub(super) fn applies<'p>(
    pool: &'p Pool,
    hints: &Hints,
    limits: &Limits,
    dry_run: bool,
) -> Option<&'p KvAware> {
    let plain = hints.allowed_workers.is_none()
        && hints.pinned_worker.is_none()
        && hints.pinned_rank.is_none()
        && hints.required_taints.is_empty()
        && hints.preferred_taints.is_empty()
        && !hints.slo.is_set()
        && limits.busy == BusyThresholds::default()
        && !limits.overload.is_on();
    if dry_run || !plain || pool.workers.len() < LEAN_FROM_WORKERS {
        return None;
    }
    pool.policy.kv_aware().filter(|k| k.decides_on_load())
}

/// One rank and its terms, costed.
struct Costed<'a> {
    worker: &'a std::sync::Arc<Worker>,
    rank: usize,
    candidate: Candidate<'a>,
    cost: f64,
}

/// The lean decision (see the module docs), or `None` when no worker of `pool` is available
/// (the full path then says why).
pub(super) fn plan(
    kv: &KvState,
    pool: &Pool,
    policy: &KvAware,
    prompt: &Tokens,
    started: Instant,
) -> Option<Plan> {
    let available: Vec<&std::sync::Arc<Worker>> = pool
        .workers
        .iter()
        .filter(|w| w.available(started))
        .collect();
    let ranks = || {
        (available.iter().copied()).flat_map(|w| {
            w.ranks
                .iter()
                .enumerate()
                .map(move |(r, rank)| (w, r, rank))
        })
    };
    let cluster = policy.cluster_of(ranks().map(|(_, _, rank)| {
        let blocks = rank.load_summary().decode_blocks;
        (
            rank.engine.load(started),
            Some(rank.published_speed()),
            blocks,
        )
    }));
    let (tokens, block_size) = (prompt.ids.as_slice(), kv.block_size);
    let scores = kv.overlaps(&prompt.hashes, started);
    let held = Held::of(&scores);
    let request_blocks = RequestLoad::for_prompt(
        prompt.hashes.iter().map(|h| h.0).collect(),
        tokens.len(),
        0,
        block_size,
    );
    let request = RouteRequest {
        session_key: None,
        text: "",
        prompt_tokens: tokens.len(),
        tokens,
        block_size,
        has_preferred_taints: false,
        dry_run: false,
        now: started,
    };
    let mut scan = Scan::default();
    for (w, r, rank) in ranks() {
        let counts = if held.may_hold(rank.replica) {
            overlap(kv.counts(&scores, w, rank.replica)).capped(tokens.len(), block_size)
        } else {
            Default::default()
        };
        let apart = (counts.total() == 0)
            .then(|| rank.load_summary().terms_apart(&request_blocks, 0.0))
            .flatten();
        let from_lock = apart.is_none();
        let terms = apart
            .unwrap_or_else(|| rank.with_load(|load| load.kv_terms(counts, &request_blocks, 0.0)));
        let candidate = Candidate {
            worker: &w.id,
            dp_rank: rank.dp_rank,
            in_flight: rank.in_flight(),
            kv: terms,
            engine: rank.engine.load(started),
            speed: Some(rank.published_speed()),
            adapter: AdapterFit::None,
        };
        let cost = policy.cost_in(&candidate, &request, &cluster);
        let costed = Costed {
            worker: w,
            rank: r,
            candidate,
            cost,
        };
        scan.offer(costed, from_lock);
    }
    let Scanned {
        costed: locked,
        chosen,
        scored,
    } = scan.finish()?;
    let saturation = cluster.saturation;
    let predictions = (locked.iter())
        .map(|(c, _)| predict(&candidate_of(c), &request, saturation))
        .collect();
    let (choices, costs): (Vec<Choice>, Vec<f64>) = locked.into_iter().unzip();
    Some(Plan {
        policy: pool.policy.kind(),
        choices,
        costs: Some(costs),
        chosen,
        prompt_tokens: tokens.len(),
        hashes: prompt.hashes.clone(),
        pinned: false,
        reads_kv_index: true,
        predictions: Some(predictions),
        slo_targets: Default::default(),
        slo: None,
        ranks_scored: scored,
    })
}

/// The costed ranks as they come: those costed from their locked load, and the cheapest,
/// exact ties drawn uniformly (reservoir sampling).
#[derive(Default)]
struct Scan<'a> {
    locked: Vec<(Choice, f64)>,
    best: Option<Costed<'a>>,
    ties: u32,
    scored: usize,
}

impl<'a> Scan<'a> {
    fn offer(&mut self, costed: Costed<'a>, from_lock: bool) {
        self.scored += 1;
        let cost = costed.cost;
        let take = match &self.best {
            Some(b) if cost > b.cost => false,
            Some(b) if cost == b.cost => {
                self.ties += 1;
                rand::rng().random_range(0..self.ties) == 0
            }
            _ => {
                self.ties = 1;
                true
            }
        };
        if from_lock {
            self.locked.push(choice(&costed));
        }
        if take {
            self.best = Some(costed);
        }
    }

    /// The choices (the locked ones and the winner), the winner's index among them, and
    /// how many ranks were costed; `None` when none was.
    fn finish(mut self) -> Option<Scanned> {
        let best = self.best?;
        let winner = |(c, _): &(Choice, f64)| {
            std::sync::Arc::ptr_eq(&c.worker, best.worker) && c.rank == best.rank
        };
        let chosen = match self.locked.iter().position(winner) {
            Some(i) => i,
            None => {
                self.locked.push(choice(&best));
                self.locked.len() - 1
            }
        };
        Some(Scanned {
            costed: self.locked,
            chosen,
            scored: self.scored,
        })
    }
}

/// What [`Scan::finish`] keeps.
struct Scanned {
    costed: Vec<(Choice, f64)>,
    chosen: usize,
    scored: usize,
}

/// The replicas in either answer of the index, as a 256-bit filter: most ranks hold none
/// of a prompt and skip the lookup.
struct Held([u64; 4]);

impl Held {
    fn of((events, approx): &(OverlapScores, OverlapScores)) -> Self {
        let mut bits = [0u64; 4];
        for (replica, _) in events.scores.iter().chain(&approx.scores) {
            let b = replica.0 as usize % 256;
            bits[b / 64] |= 1 << (b % 64);
        }
        Self(bits)
    }

    fn may_hold(&self, replica: ReplicaId) -> bool {
        let b = replica.0 as usize % 256;
        self.0[b / 64] >> (b % 64) & 1 == 1
    }
}

/// The plan's choice of a costed rank, with its cost.
fn choice(c: &Costed<'_>) -> (Choice, f64) {
    let choice = Choice {
        worker: c.worker.clone(),
        rank: c.rank,
        in_flight: c.candidate.in_flight,
        kv: c.candidate.kv,
        engine: c.candidate.engine,
        adapter: AdapterFit::None,
    };
    (choice, c.cost)
}

/// The candidate of a choice, at its rank's published speed.
fn candidate_of(c: &Choice) -> Candidate<'_> {
    let rank = &c.worker.ranks[c.rank];
    Candidate {
        worker: &c.worker.id,
        dp_rank: rank.dp_rank,
        in_flight: c.in_flight,
        kv: c.kv,
        engine: c.engine,
        speed: Some(rank.speed()),
        adapter: AdapterFit::None,
    }
}

#[cfg(test)]
mod tests;
