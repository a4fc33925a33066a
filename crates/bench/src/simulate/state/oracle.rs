//! The TTFT oracle (`kvroute-bench simulate --ttft-oracle`): a yardstick, not a policy. Each
//! request goes to the engine where it costs the least first-token time, found by copying
//! every engine that can take it and running the copies ahead, with and without the request:
//! its own TTFT there plus the delay it adds to the first tokens of the requests already
//! waiting there. It knows what no router can (each engine's exact queue, cache and speed),
//! but it chooses greedily, one request at a time, and does not see the requests that arrive
//! later (nor what a request's decode does to their TTFT once it has begun).

use std::collections::HashMap;
use std::time::Duration;

use kvroute_core::eligibility::retain_fitting;
use kvroute_sim::engine::{EngineCore, EngineRequest, RequestId};

use super::{lora_salt, Queued, Role, State};

/// Steps a copy runs ahead before its answer counts as never (a stuck copy).
const MAX_STEPS: usize = 1_000_000;

impl State<'_> {
    /// The engine where `req`, sent at `now`, costs the least first-token time (the lowest
    /// index on a tie), among those whose context takes it (every engine when none does).
    pub(super) fn oracle_choice(&self, req: &Queued, now: Duration) -> usize {
        let need = req.tokens.len() + req.max_tokens.max(1);
        let mut ids: Vec<usize> = (0..self.engines.len()).collect();
        retain_fitting(&mut ids, |&e| need <= self.engines[e].capacity_tokens());
        ids.into_iter()
            .min_by_key(|&e| self.first_token_cost(e, req, now))
            .expect("at least one engine")
    }

    /// What sending `req` to engine `e` at `now` costs in first-token time: its own TTFT
    /// there and the delay it adds to the first tokens of the requests waiting there for
    /// theirs, the engine's copy run ahead with and without it (no later arrival);
    /// `Duration::MAX` when the engine refuses it or never answers.
    fn first_token_cost(&self, e: usize, req: &Queued, now: Duration) -> Duration {
        let waiting: Vec<RequestId> = (self.live.iter())
            .filter(|((engine, _), l)| {
                *engine == e
                    && matches!(
                        l.role,
                        Role::Answer {
                            answered: false,
                            ..
                        }
                    )
            })
            .map(|((_, id), _)| *id)
            .collect();
        // The engine's state is already past its step in progress: a copy's next step
        // starts when that one ends.
        let start = self.pending[e]
            .as_ref()
            .map_or(now, |(end, _)| (*end).max(now));
        let mut with = self.engines[e].clone();
        let request = EngineRequest {
            id: req.id,
            prompt: req.tokens.clone(),
            max_tokens: req.max_tokens,
            salt: lora_salt(req.lora),
            lora: req.lora,
            priority: 0,
        };
        if with.add_request(request).is_err() {
            return Duration::MAX;
        }
        let mut awaited = waiting.clone();
        awaited.push(req.id);
        let Some(after) = first_tokens(with, start, &awaited) else {
            return Duration::MAX;
        };
        let Some(before) = first_tokens(self.engines[e].clone(), start, &waiting) else {
            return Duration::MAX;
        };
        let delays = (waiting.iter())
            .map(|id| after[id].saturating_sub(before[id]))
            .sum::<Duration>();
        (after[&req.id] - req.arrival) + delays
    }
}

/// When each of `ids` gets its first token from `engine` stepping from `start` with no other
/// request added; `None` when the engine stops short of one.
fn first_tokens(
    mut engine: EngineCore,
    start: Duration,
    ids: &[RequestId],
) -> Option<HashMap<RequestId, Duration>> {
    let mut at = HashMap::with_capacity(ids.len());
    let mut t = start;
    let mut idle = 0;
    for _ in 0..MAX_STEPS {
        if at.len() == ids.len() {
            return Some(at);
        }
        let out = engine.step(t);
        if out.is_idle() {
            // A step may only admit; an aggregated engine waits for nothing else, so idle
            // steps in a row mean the copy cannot go on.
            idle += 1;
            if idle > 2 {
                return None;
            }
            continue;
        }
        idle = 0;
        t += out.duration;
        for token in &out.tokens {
            if ids.contains(&token.id) {
                at.entry(token.id).or_insert(t);
            }
        }
    }
    None
}
