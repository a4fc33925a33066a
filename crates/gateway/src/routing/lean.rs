//! kv_aware's decision in a large pool, without a candidate per rank.
//!
//! A prompt's prefix is held by a few ranks of a thousand, in the index and among their
//! active requests; every other rank's cost is a function of its load alone. So in a pool of
//! [`LEAN_FROM_WORKERS`] workers or more, a plain request (no pin, allowed list, taints,
//! latency targets, adapter, session binding, busy thresholds, overload protection, or a
//! context longer than some worker takes: those take the full path, [`super::plan`]'s) is
//! decided in two passes, neither taking a rank's lock nor building a candidate for a rank
//! that holds none of the prompt:
//!
//! 1. each rank's published [`LoadSummary`], engine gauges and speed factors are read once,
//!    into a flat array of rows, and the cluster's terms ([`KvAware::cluster_of`]:
//!    saturation, mean speeds and capacity) summed on the way;
//! 2. each row's cost: from its summary when the index reports none of the prompt there
//!    and no active request there starts in the bucket of the prompt's first block
//!    ([`LoadSummary::terms_apart`]), else from its rank's locked load, as the full path
//!    reads it. The cheapest wins, exact ties at random.
//!
//! The cost is [`KvAware::priced`], what the full path's [`KvAware::cost_in`] computes, on
//! the same terms: the choice is the one the full path would make on the same state. The
//! plan keeps as choices the [`SHOWN`] cheapest ranks costed from their locked load and the
//! winner (the dashboard shows those, and how many ranks were costed); `POST /debug/route`
//! takes the full path and shows every candidate. What it saves: at 1,024 workers, a
//! locked read, a speed model's copy, a candidate and a predicted latency per rank
//! (BENCHMARKS.md, "A kv_aware decision at 16, 256 and 1,024 workers").
//!
//! Both passes still read every rank. With `--router-sample-ranks N` (a pool's
//! [`Sampling`]), the first pass reads only [`sample_rows`]: the `N` ranks the index reports
//! holding the longest prefix of the prompt, `N` of the ranks running a request that starts
//! with the prompt's first block ([`ActiveFirsts`](crate::workers::ActiveFirsts)) and `N`
//! others drawn at random; the cluster's terms are the pool's, summed over every rank at most
//! every [`CLUSTER_REFRESH`](crate::workers::CLUSTER_REFRESH). A decision then costs the same
//! at 16 workers and at 1,024 for a prompt held by a fixed number of ranks (the index's answer
//! still grows with its holders). The choice is the cheapest of those read: the exact one
//! whenever the cheapest rank is among the longest holders read, else the least loaded of
//! those read (BENCHMARKS.md, "A sampled decision in the router").

use std::time::Instant;

use kvroute_core::eligibility::{BusyThresholds, Hints};
use kvroute_core::latency::SpeedFactors;
use kvroute_core::policy::predict::predict;
use kvroute_core::policy::{sample_ranks, KvAware, PromptTerms};
use kvroute_core::{
    AdapterFit, Candidate, EngineLoad, KvTerms, LoadSummary, RequestLoad, RouteRequest,
};
use kvroute_index::{OverlapScores, ReplicaId};
use rand::Rng;

use super::{overlap, Choice, Limits, Plan};
use crate::kv::KvState;
use crate::prompts::Tokens;
use crate::workers::{Pool, Sampling, Worker};

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
        && hints.context_tokens.is_none()
        && limits.busy == BusyThresholds::default()
        && !limits.overload.is_on();
    if dry_run || !plain || pool.workers.len() < LEAN_FROM_WORKERS {
        return None;
    }
    pool.policy.kv_aware().filter(|k| k.decides_on_load())
}

/// One rank as the decision reads it, once, from its published atomics and its engine's
/// gauges: both passes read these rows, a flat array, not the ranks.
#[derive(Clone, Copy)]
struct Row {
    /// The rank's worker, by its index in the pool, and the rank's index.
    worker: u32,
    rank: u32,
    replica: ReplicaId,
    summary: LoadSummary,
    engine: EngineLoad,
    speed: SpeedFactors,
}

impl Row {
    fn read(worker: u32, rank: u32, w: &Worker, now: Instant) -> Self {
        let r = &w.ranks[rank as usize];
        Row {
            worker,
            rank,
            replica: r.replica,
            summary: r.load_summary(),
            engine: r.engine.load(now),
            speed: r.published_factors(),
        }
    }
}

/// The rows of a sampled decision (`--router-sample-ranks N`): [`sample_ranks`] of the pool's
/// ranks, the holders from the index's answers and from the pool's
/// [`ActiveFirsts`](crate::workers::ActiveFirsts), a rank counting when its worker is
/// available.
fn sample_rows(
    pool: &Pool,
    sampling: &Sampling,
    (events, approx): &(OverlapScores, OverlapScores),
    prompt: &Tokens,
    now: Instant,
    rows: &mut Vec<Row>,
) {
    let cached = (events.scores.iter().chain(&approx.scores))
        .filter_map(|(replica, counts)| Some((counts.total(), sampling.position(*replica)?)))
        .collect();
    let mut active = Vec::new();
    if let Some(first) = prompt.hashes.first() {
        sampling.firsts.ranks_of(first.0, &mut active);
    }
    let active = active
        .into_iter()
        .filter_map(|r| sampling.position(r))
        .collect();
    let mut taken = vec![0u64; sampling.pairs.len().div_ceil(64)];
    let take = |i: usize| {
        if taken[i / 64] >> (i % 64) & 1 == 1 {
            return false;
        }
        taken[i / 64] |= 1 << (i % 64);
        let (w, r) = sampling.pairs[i];
        let worker = &pool.workers[w as usize];
        let available = worker.available(now);
        if available {
            rows.push(Row::read(w, r, worker, now));
        }
        available
    };
    let (total, n) = (sampling.pairs.len(), sampling.others);
    sample_ranks(cached, active, total, n, &mut rand::rng(), take);
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
    let scores = kv.overlaps(&prompt.hashes, started);
    let mut rows = Vec::new();
    let cluster = match pool.sampling.as_deref() {
        Some(s) if s.others < s.pairs.len() => {
            sample_rows(pool, s, &scores, prompt, started, &mut rows);
            s.cluster(policy, &pool.workers, started)
        }
        _ => {
            rows.reserve(pool.workers.len());
            let read = (pool.workers.iter().enumerate())
                .filter(|(_, w)| w.available(started))
                .flat_map(|(i, w)| {
                    (0..w.ranks.len()).map(move |r| Row::read(i as u32, r as u32, w, started))
                });
            policy.cluster_of(read.map(|row| {
                rows.push(row);
                (row.engine, row.speed, row.summary.decode_blocks)
            }))
        }
    };
    let (tokens, block_size) = (prompt.ids.as_slice(), kv.block_size);
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
    let terms = PromptTerms::of(&request);
    let mut scan = Scan::default();
    for (i, row) in rows.iter().enumerate() {
        // Most ranks: absent from the index's answer, no active request in the prompt's
        // first-block bucket. Their terms are their summary's, their rank not touched.
        let worker = &pool.workers[row.worker as usize];
        let counts = if held.may_hold(row.replica) {
            overlap(kv.counts(&scores, worker, row.replica)).capped(tokens.len(), block_size)
        } else {
            Default::default()
        };
        let apart = (counts.total() == 0)
            .then(|| row.summary.terms_apart(&request_blocks, 0.0))
            .flatten();
        let from_lock = apart.is_none();
        let terms_of = apart.unwrap_or_else(|| {
            let rank = &worker.ranks[row.rank as usize];
            rank.with_load(|load| load.kv_terms(counts, &request_blocks, 0.0))
        });
        let cost = policy.priced(&terms, &cluster, &terms_of, &row.engine, &row.speed, 0.0);
        scan.offer(i, terms_of, cost, from_lock);
    }
    let Scanned {
        costed,
        chosen,
        scored,
    } = scan.finish()?;
    let choices: Vec<(Choice, f64)> = (costed.into_iter())
        .map(|(i, terms, cost)| {
            let row = &rows[i];
            let worker = &pool.workers[row.worker as usize];
            let rank = row.rank as usize;
            let choice = Choice {
                worker: worker.clone(),
                rank,
                in_flight: worker.ranks[rank].in_flight(),
                kv: terms,
                engine: row.engine,
                adapter: AdapterFit::None,
            };
            (choice, cost)
        })
        .collect();
    let saturation = cluster.saturation;
    let predictions = (choices.iter())
        .map(|(c, _)| predict(&candidate_of(c), &request, saturation))
        .collect();
    let (choices, costs): (Vec<Choice>, Vec<f64>) = choices.into_iter().unzip();
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

/// The ranks costed from their locked load that a plan shows as choices, the cheapest (a
/// popular prefix may be held by a hundred ranks of a thousand: each shown costs its
/// predicted latency, read under its latency model's lock, and the dashboard a row).
const SHOWN: usize = 8;

/// A costed row: its index, its terms, its cost.
type Costed = (usize, KvTerms, f64);

/// The costed rows as they come: the [`SHOWN`] cheapest of those costed from their rank's
/// locked load, and the cheapest of all, exact ties drawn uniformly (reservoir sampling).
#[derive(Default)]
struct Scan {
    locked: Vec<Costed>,
    best: Option<Costed>,
    ties: u32,
    scored: usize,
}

impl Scan {
    fn offer(&mut self, row: usize, terms: KvTerms, cost: f64, from_lock: bool) {
        self.scored += 1;
        let take = match &self.best {
            Some(b) if cost > b.2 => false,
            Some(b) if cost == b.2 => {
                self.ties += 1;
                rand::rng().random_range(0..self.ties) == 0
            }
            _ => {
                self.ties = 1;
                true
            }
        };
        if from_lock {
            // The cheapest SHOWN, in order of cost.
            let at = self.locked.partition_point(|c| c.2 <= cost);
            if at < SHOWN {
                self.locked.truncate(SHOWN - 1);
                self.locked.insert(at, (row, terms, cost));
            }
        }
        if take {
            self.best = Some((row, terms, cost));
        }
    }

    /// The rows to show as choices (the cheapest locked ones and the winner), the winner's index
    /// among them, and how many rows were costed; `None` when none was.
    fn finish(mut self) -> Option<Scanned> {
        let best = self.best?;
        let chosen = match self.locked.iter().position(|c| c.0 == best.0) {
            Some(i) => i,
            None => {
                self.locked.push(best);
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
    costed: Vec<Costed>,
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
