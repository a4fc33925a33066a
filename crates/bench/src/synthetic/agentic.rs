//! **agentic**: coding and tool-using agents, the workload of agent frameworks served by
//! Dynamo and llm-d.
//!
//! - `agent_types` agents, each with a system prompt and tool definitions of
//!   `system_prompt_len` tokens that all its sessions share (as whole hash blocks, like a
//!   shared-prefix group's).
//! - `sessions` sessions, each of one agent type drawn uniformly and of `n` steps, `n` drawn
//!   uniformly in `min_turns..=max_turns`. Step 1's prompt is the system prompt and the user's
//!   task ([`TASK_LEN`] tokens, uniform). Each step but the last answers with a tool call
//!   ([`TOOL_CALL_LEN`] tokens, uniform); step k + 1's prompt is step k's prompt, its tool call
//!   and the tool's result, so its hash ids extend step k's (the last, partial block keeps its
//!   id, as a multi-turn chat's). The last step answers with `output_len` tokens.
//! - A tool result is heavy-tailed: log-normal with median `tool_result_len` and
//!   σ = [`TOOL_RESULT_SIGMA`] (of ln tokens), at most [`TOOL_RESULT_CAP`] times the median.
//!   At the defaults (300 tokens) the median is a short command's output, one in ten exceeds
//!   2,000 tokens and the longest (9,600) are file reads. Contexts grow by about 1,000 tokens
//!   a step, to tens of thousands.
//!
//! **Arrivals.** Sessions start as a Poisson process of `session_rate` a second (exponential
//! gaps, the first at 0). Within a session, step k + 1 arrives when step k's answer would have
//! come back from a nominal engine, plus the tool's run time:
//!
//! ```text
//! t(k+1) = t(k) + PREFILL_MS_PER_TOKEN x new(k) + DECODE_MS_PER_TOKEN x output(k) + think
//! ```
//!
//! where `new(k)` is the tokens step k added to the context (its task or tool result, and the
//! tool call before it) and `think` is exponential with mean `tool_time_ms`. The nominal engine
//! is kvroute-sim's reference one at a moderate load (prefill about 50,000 tokens/s, a decode
//! step of about 20 ms). The trace is open-loop, like every trace: arrivals do not wait for the
//! simulated answers, so on a cluster slower than the nominal engine a session's next step can
//! arrive before its previous answer, and a faster one idles. `--rate-scale` scales the gaps
//! between sessions and within them alike.
//!
//! Everything is a function of the seed; the requests come out in arrival order (a tie keeps
//! session order).

use std::ops::RangeInclusive;

use rand::rngs::StdRng;
use rand::Rng;

use super::{exponential, Ids};
use crate::trace::TraceRequest;

/// Tokens of a session's task, its user's first message.
pub const TASK_LEN: RangeInclusive<usize> = 200..=1000;
/// Tokens of a tool call, every step's answer but the last.
pub const TOOL_CALL_LEN: RangeInclusive<usize> = 50..=300;
/// The tool results' spread: σ of their natural log.
pub const TOOL_RESULT_SIGMA: f64 = 1.5;
/// The longest tool result, in medians.
pub const TOOL_RESULT_CAP: usize = 32;
/// The nominal engine's prefill, per new prompt token.
pub const PREFILL_MS_PER_TOKEN: f64 = 0.02;
/// The nominal engine's decode, per output token.
pub const DECODE_MS_PER_TOKEN: f64 = 20.0;

/// Agent sessions: loops of tool calls over a growing context.
#[derive(Debug, Clone, PartialEq)]
pub struct Agentic {
    pub agent_types: usize,
    pub sessions: usize,
    /// The fewest steps (requests) in a session.
    pub min_turns: usize,
    /// The most.
    pub max_turns: usize,
    /// Tokens of an agent type's system prompt and tool definitions.
    pub system_prompt_len: usize,
    /// The median tokens of a tool's result.
    pub tool_result_len: usize,
    /// The mean time a tool runs, in milliseconds.
    pub tool_time_ms: u64,
    /// Tokens of a session's final answer.
    pub output_len: usize,
    /// Sessions started per second.
    pub session_rate: f64,
}

impl Default for Agentic {
    /// 100 sessions of 5-30 steps over 4 agent types with 12 blocks of 512 tokens of system
    /// prompt each; one session a second: a moderate load on 8 simulated engines.
    fn default() -> Self {
        Agentic {
            agent_types: 4,
            sessions: 100,
            min_turns: 5,
            max_turns: 30,
            system_prompt_len: 6144,
            tool_result_len: 300,
            tool_time_ms: 1000,
            output_len: 800,
            session_rate: 1.0,
        }
    }
}

impl Agentic {
    /// The tokens an agent type's sessions share: its system prompt's whole hash blocks.
    pub fn shared_len(&self, hash_block: usize) -> usize {
        let block = hash_block.max(1);
        self.system_prompt_len / block * block
    }
}

/// The requests, in arrival order, each with its timestamp.
pub(super) fn agentic(
    a: &Agentic,
    block: usize,
    ids: &mut Ids,
    rng: &mut StdRng,
) -> Vec<TraceRequest> {
    let shared = a.shared_len(block) / block;
    let systems: Vec<Vec<u64>> = (0..a.agent_types)
        .map(|_| ids.take(shared).collect())
        .collect();
    let mut out = Vec::new();
    let mut start_ms = 0.0;
    for i in 0..a.sessions {
        if i > 0 {
            start_ms += exponential(rng, a.session_rate / 1000.0);
        }
        let system = &systems[rng.random_range(0..a.agent_types)];
        session(a, block, system, start_ms, ids, rng, &mut out);
    }
    out.sort_by_key(|r| r.timestamp);
    out
}

/// One session's steps, from `start_ms`, pushed onto `out`.
fn session(
    a: &Agentic,
    block: usize,
    system: &[u64],
    start_ms: f64,
    ids: &mut Ids,
    rng: &mut StdRng,
    out: &mut Vec<TraceRequest>,
) {
    let steps = rng.random_range(a.min_turns..=a.max_turns);
    let mut new = a.system_prompt_len + rng.random_range(TASK_LEN);
    let mut len = 0;
    let mut hash_ids = system.to_vec();
    let mut t = start_ms;
    for step in 1..=steps {
        len += new;
        let more = len.div_ceil(block) - hash_ids.len();
        hash_ids.extend(ids.take(more));
        let output = match step == steps {
            true => a.output_len,
            false => rng.random_range(TOOL_CALL_LEN),
        };
        out.push(TraceRequest {
            timestamp: t.round() as u64,
            input_length: len,
            output_length: output,
            hash_ids: hash_ids.clone(),
        });
        if step == steps {
            break;
        }
        let answered = PREFILL_MS_PER_TOKEN * new as f64 + DECODE_MS_PER_TOKEN * output as f64;
        t += answered + exponential(rng, 1.0 / a.tool_time_ms as f64);
        new = output + tool_result(a.tool_result_len, rng);
    }
}

/// A tool result's tokens: log-normal around `median`, at least 1, at most
/// [`TOOL_RESULT_CAP`] medians.
fn tool_result(median: usize, rng: &mut StdRng) -> usize {
    // Box-Muller: a standard normal from two uniforms, the first in (0, 1].
    let (u, v) = (1.0 - rng.random::<f64>(), rng.random::<f64>());
    let z = (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos();
    let tokens = (median as f64 * (TOOL_RESULT_SIGMA * z).exp()).round() as usize;
    tokens.clamp(1, median * TOOL_RESULT_CAP)
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;
    use crate::synthetic::Synthetic;
    use crate::trace::{hit_bound, prompt_tokens};

    fn small() -> Agentic {
        Agentic {
            agent_types: 2,
            sessions: 12,
            min_turns: 3,
            max_turns: 8,
            system_prompt_len: 1024,
            ..Agentic::default()
        }
    }

    /// The requests of each session, in order: a session's own first block names it.
    fn sessions(requests: &[TraceRequest], shared: usize) -> Vec<Vec<&TraceRequest>> {
        let mut out: Vec<Vec<&TraceRequest>> = Vec::new();
        for r in requests {
            match out
                .iter_mut()
                .find(|s| s[0].hash_ids[shared] == r.hash_ids[shared])
            {
                Some(s) => s.push(r),
                None => out.push(vec![r]),
            }
        }
        out
    }

    #[test]
    fn a_seed_gives_the_same_sessions_in_arrival_order() {
        let spec = Synthetic::Agentic(small());
        let (a, b) = (spec.generate(512, 7), spec.generate(512, 7));
        assert_eq!(a, b);
        assert_ne!(a, spec.generate(512, 8), "another seed, another workload");
        assert_eq!(a[0].timestamp, 0);
        assert!(a.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
        let steps = sessions(&a, 2);
        assert_eq!(steps.len(), 12);
        assert!(
            steps.iter().all(|s| (3..=8).contains(&s.len())),
            "turns in range"
        );
    }

    #[test]
    fn each_step_extends_the_previous_one() {
        let requests = Synthetic::Agentic(small()).generate(512, 1);
        for steps in sessions(&requests, 2) {
            let last = steps.len() - 1;
            for (k, r) in steps.iter().enumerate() {
                assert_eq!(r.hash_ids.len(), r.input_length.div_ceil(512));
                match k == last {
                    true => assert_eq!(r.output_length, 800, "the final answer"),
                    false => assert!(TOOL_CALL_LEN.contains(&r.output_length), "a tool call"),
                }
            }
            assert!((1024 + 200..=1024 + 1000).contains(&steps[0].input_length));
            for pair in steps.windows(2) {
                let (prev, next) = (pair[0], pair[1]);
                let result = next.input_length - prev.input_length - prev.output_length;
                assert!((1..=300 * TOOL_RESULT_CAP).contains(&result), "{result}");
                assert!(next.hash_ids.starts_with(&prev.hash_ids));
                let (tp, tn) = (
                    prompt_tokens(prev, 512, 32000),
                    prompt_tokens(next, 512, 32000),
                );
                assert_eq!(tp[..], tn[..tp.len()], "the tokens extend too");
                // The answer came back from the nominal engine, then the tool ran.
                let answered = DECODE_MS_PER_TOKEN * prev.output_length as f64;
                assert!(next.timestamp as f64 >= prev.timestamp as f64 + answered - 1.0);
            }
        }
    }

    #[test]
    fn an_agent_types_sessions_share_its_system_prompt_and_nothing_else() {
        // 1,000 tokens of system prompt: its first block, whole, is shared; the second is not.
        let spec = Agentic {
            system_prompt_len: 1000,
            ..small()
        };
        assert_eq!(spec.shared_len(512), 512);
        let requests = Synthetic::Agentic(spec).generate(512, 3);
        let firsts: Vec<&TraceRequest> = sessions(&requests, 1).iter().map(|s| s[0]).collect();
        let types: std::collections::BTreeSet<u64> = firsts.iter().map(|r| r.hash_ids[0]).collect();
        assert_eq!(types.len(), 2, "both types drawn");
        for a in &firsts {
            for b in firsts.iter().filter(|b| !std::ptr::eq(**b, *a)) {
                let common = a
                    .hash_ids
                    .iter()
                    .zip(&b.hash_ids)
                    .take_while(|(x, y)| x == y);
                match a.hash_ids[0] == b.hash_ids[0] {
                    true => assert_eq!(common.count(), 1, "same type: the whole system block"),
                    false => assert_eq!(common.count(), 0, "other types share nothing"),
                }
            }
        }
    }

    #[test]
    fn the_defaults_grow_contexts_that_reuse_most_of_their_tokens() {
        let requests = Synthetic::Agentic(Agentic::default()).generate(512, 0);
        let longest = requests.iter().map(|r| r.input_length).max().unwrap_or(0);
        assert!(longest > 20_000, "{longest}");
        let bound = hit_bound(&requests, 512);
        assert!(bound > 0.85, "{bound}");
        let calls: Vec<usize> = requests
            .iter()
            .map(|r| r.output_length)
            .filter(|&n| n < 800)
            .collect();
        let mean = calls.iter().sum::<usize>() as f64 / calls.len() as f64;
        assert!(
            (150.0..200.0).contains(&mean),
            "tool calls of {mean} tokens"
        );
    }

    #[test]
    fn tool_results_are_heavy_tailed() {
        let mut rng = StdRng::seed_from_u64(0);
        let mut draws: Vec<usize> = (0..10_000).map(|_| tool_result(300, &mut rng)).collect();
        draws.sort_unstable();
        let at = |q: f64| draws[(q * draws.len() as f64) as usize];
        assert!((270..330).contains(&at(0.5)), "median {}", at(0.5));
        assert!((1700..2400).contains(&at(0.9)), "p90 {}", at(0.9));
        assert_eq!(draws.last(), Some(&(300 * TOOL_RESULT_CAP)));
    }
}
