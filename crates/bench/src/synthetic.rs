//! Synthetic workloads, made in the trace's own form ([`TraceRequest`]: arrival, lengths, hash
//! ids) so that prompt synthesis and everything after it are the same as for a trace.
//!
//! - **shared-prefix** (the workload of llm-d's benchmarks, after inference-perf): `groups`
//!   system prompts of `system_prompt_len` tokens, each followed by `prompts_per_group` unique
//!   questions of `question_len` tokens. The prompts of all groups arrive in a shuffled order.
//! - **multi-turn**: `conversations` chats of `turns` turns. Turn k's prompt is turn k-1's
//!   prompt, its answer (`output_len` tokens) and a new user message (`turn_len` tokens), so
//!   its hash ids extend the previous turn's. The chats go in rounds, every chat's turn k in
//!   a shuffled order, then every chat's turn k + 1 in another: a chat's turns are N arrivals
//!   apart on average (N / rate seconds, time for the answer to come back), and no fixed
//!   rotation lines chats up with a round-robin router.
//! - **agentic** ([`agentic`]): agent sessions over a few agent types' shared system prompts,
//!   each a loop of short tool calls whose heavy-tailed results grow the context to tens of
//!   thousands of tokens; a session's next step arrives when its answer would be back and its
//!   tool has run.
//!
//! Arrivals of shared-prefix and multi-turn are a Poisson process: gaps are exponential with
//! mean 1 / `request_rate` seconds, the first arrival at 0; agentic sessions start as one
//! (see [`agentic`]). Everything is a function of the seed. The flags are [`args`]'.
//!
//! Every new block of `hash_block` tokens gets a fresh id, so ids are equal exactly where the
//! content is; a prompt's last block may be partial. Ids name whole blocks, which has two
//! consequences:
//! - A group can share only whole blocks: the block where a system prompt ends and its
//!   question begins belongs to the question, so a group shares the first
//!   `floor(system_prompt_len / hash_block)` blocks. A hash block size that divides the
//!   system prompt's length (e.g. 16) shares all of it.
//! - A multi-turn prompt keeps its previous turn's last, partial block id. Prompt synthesis
//!   draws a block's tokens as one stream seeded by its id and cuts it, so the longer block
//!   starts with the tokens the partial one had: the next turn's tokens extend the previous
//!   turn's exactly, and [`crate::trace::hit_bound`] counts the partial block's reuse.

use std::fmt;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use crate::trace::TraceRequest;

pub mod agentic;
pub mod args;

pub use agentic::Agentic;
pub use args::{SyntheticArgs, SyntheticError};

/// The generators, as named on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SyntheticKind {
    SharedPrefix,
    MultiTurn,
    Agentic,
}

impl SyntheticKind {
    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            SyntheticKind::SharedPrefix => "shared-prefix",
            SyntheticKind::MultiTurn => "multi-turn",
            SyntheticKind::Agentic => "agentic",
        }
    }
}

/// Groups of prompts that share a system prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct SharedPrefix {
    pub groups: usize,
    pub prompts_per_group: usize,
    pub system_prompt_len: usize,
    pub question_len: usize,
    pub output_len: usize,
    /// Mean arrivals per second.
    pub request_rate: f64,
}

impl Default for SharedPrefix {
    /// llm-d's benchmark defaults (150 x 5, 6000 + 1200 tokens, 1000 out), at 10 req/s.
    fn default() -> Self {
        SharedPrefix {
            groups: 150,
            prompts_per_group: 5,
            system_prompt_len: 6000,
            question_len: 1200,
            output_len: 1000,
            request_rate: 10.0,
        }
    }
}

impl SharedPrefix {
    /// The tokens a group shares: its system prompt's whole hash blocks.
    pub fn shared_len(&self, hash_block: usize) -> usize {
        let block = hash_block.max(1);
        self.system_prompt_len / block * block
    }
}

/// Chats whose every turn resends the whole conversation so far.
#[derive(Debug, Clone, PartialEq)]
pub struct MultiTurn {
    pub conversations: usize,
    pub turns: usize,
    /// Tokens of each new user message.
    pub turn_len: usize,
    /// Tokens of each answer (the request's output, and part of the next turn's prompt).
    pub output_len: usize,
    /// Mean arrivals per second.
    pub request_rate: f64,
}

impl Default for MultiTurn {
    fn default() -> Self {
        MultiTurn {
            conversations: 100,
            turns: 5,
            turn_len: 500,
            output_len: 200,
            request_rate: 10.0,
        }
    }
}

/// A generated workload.
#[derive(Debug, Clone, PartialEq)]
pub enum Synthetic {
    SharedPrefix(SharedPrefix),
    MultiTurn(MultiTurn),
    Agentic(Agentic),
}

impl fmt::Display for Synthetic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Synthetic::SharedPrefix(s) => write!(
                f,
                "shared-prefix {} groups x {} ({} + {} tokens in, {} out, {} req/s)",
                s.groups,
                s.prompts_per_group,
                s.system_prompt_len,
                s.question_len,
                s.output_len,
                s.request_rate
            ),
            Synthetic::MultiTurn(m) => write!(
                f,
                "multi-turn {} chats x {} turns ({} tokens a message, {} an answer, {} req/s)",
                m.conversations, m.turns, m.turn_len, m.output_len, m.request_rate
            ),
            Synthetic::Agentic(a) => write!(
                f,
                "agentic {} sessions x {}-{} steps over {} agent types ({} system tokens, tool results ~{}, {} an answer, {} sessions/s)",
                a.sessions,
                a.min_turns,
                a.max_turns,
                a.agent_types,
                a.system_prompt_len,
                a.tool_result_len,
                a.output_len,
                a.session_rate
            ),
        }
    }
}

/// Hands out fresh hash ids.
struct Ids(u64);

impl Ids {
    fn take(&mut self, n: usize) -> impl Iterator<Item = u64> + '_ {
        (0..n).map(|_| {
            self.0 += 1;
            self.0
        })
    }
}

/// An exponential draw of mean 1 / `rate`.
fn exponential(rng: &mut StdRng, rate: f64) -> f64 {
    // Inverse transform: -ln(1 - u) / rate is exponential for u uniform in [0, 1).
    -(1.0 - rng.random::<f64>()).ln() / rate
}

impl Synthetic {
    /// The requests, in arrival order, with `hash_block` tokens per hash id.
    pub fn generate(&self, hash_block: usize, seed: u64) -> Vec<TraceRequest> {
        let block = hash_block.max(1);
        let mut rng = StdRng::seed_from_u64(seed);
        let mut ids = Ids(0);
        let (mut requests, rate) = match self {
            Synthetic::SharedPrefix(s) => {
                (shared_prefix(s, block, &mut ids, &mut rng), s.request_rate)
            }
            Synthetic::MultiTurn(m) => (multi_turn(m, block, &mut ids, &mut rng), m.request_rate),
            Synthetic::Agentic(a) => return agentic::agentic(a, block, &mut ids, &mut rng),
        };
        let mut t = 0.0f64;
        for (i, r) in requests.iter_mut().enumerate() {
            if i > 0 {
                t += exponential(&mut rng, rate);
            }
            r.timestamp = (t * 1000.0).round() as u64;
        }
        requests
    }

    /// A note when a system prompt is not whole hash blocks, so that its last, partial block
    /// is not shared.
    pub fn sharing_note(&self, hash_block: usize) -> Option<String> {
        let (who, len, shared) = match self {
            Synthetic::SharedPrefix(s) => {
                ("a group", s.system_prompt_len, s.shared_len(hash_block))
            }
            Synthetic::Agentic(a) => (
                "an agent type",
                a.system_prompt_len,
                a.shared_len(hash_block),
            ),
            Synthetic::MultiTurn(_) => return None,
        };
        (shared < len).then(|| {
            format!("note: {who} shares {shared} of its {len} system prompt tokens (whole hash blocks); a --hash-block-size dividing {len} shares them all")
        })
    }
}

fn shared_prefix(
    s: &SharedPrefix,
    block: usize,
    ids: &mut Ids,
    rng: &mut StdRng,
) -> Vec<TraceRequest> {
    let input = s.system_prompt_len + s.question_len;
    let shared = s.shared_len(block) / block;
    let own = input.div_ceil(block) - shared;
    let mut out = Vec::with_capacity(s.groups * s.prompts_per_group);
    for _ in 0..s.groups {
        let system: Vec<u64> = ids.take(shared).collect();
        for _ in 0..s.prompts_per_group {
            let mut hash_ids = system.clone();
            hash_ids.extend(ids.take(own));
            out.push(TraceRequest {
                timestamp: 0,
                input_length: input,
                output_length: s.output_len,
                hash_ids,
            });
        }
    }
    out.shuffle(rng);
    out
}

fn multi_turn(m: &MultiTurn, block: usize, ids: &mut Ids, rng: &mut StdRng) -> Vec<TraceRequest> {
    let mut chats: Vec<(usize, Vec<u64>)> = vec![(0, Vec::new()); m.conversations];
    let mut out = Vec::with_capacity(m.conversations * m.turns);
    let mut order: Vec<usize> = (0..m.conversations).collect();
    for turn in 0..m.turns {
        order.shuffle(rng);
        for &c in &order {
            let (len, hash_ids) = &mut chats[c];
            *len += m.turn_len + if turn > 0 { m.output_len } else { 0 };
            let more = len.div_ceil(block) - hash_ids.len();
            hash_ids.extend(ids.take(more));
            out.push(TraceRequest {
                timestamp: 0,
                input_length: *len,
                output_length: m.output_len,
                hash_ids: hash_ids.clone(),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{hit_bound, prompt_tokens};

    fn shared(system: usize, question: usize) -> Synthetic {
        Synthetic::SharedPrefix(SharedPrefix {
            groups: 2,
            prompts_per_group: 3,
            system_prompt_len: system,
            question_len: question,
            output_len: 10,
            request_rate: 5.0,
        })
    }

    fn chats(turn_len: usize, output_len: usize) -> Synthetic {
        Synthetic::MultiTurn(MultiTurn {
            conversations: 2,
            turns: 3,
            turn_len,
            output_len,
            request_rate: 5.0,
        })
    }

    fn common_prefix(a: &[u64], b: &[u64]) -> usize {
        a.iter().zip(b).take_while(|(x, y)| x == y).count()
    }

    #[test]
    fn a_group_shares_exactly_its_system_prompt() {
        for (system, question, shared_blocks) in [(1024, 300, 2), (700, 300, 1)] {
            let requests = shared(system, question).generate(512, 1);
            assert_eq!(requests.len(), 6);
            let group = |r: &TraceRequest| r.hash_ids[0];
            for a in &requests {
                assert_eq!(a.input_length, system + question);
                assert_eq!(a.hash_ids.len(), (system + question).div_ceil(512));
                for b in requests.iter().filter(|b| !std::ptr::eq(*b, a)) {
                    let common = common_prefix(&a.hash_ids, &b.hash_ids);
                    if group(a) == group(b) {
                        assert_eq!(common, shared_blocks, "same group: the system blocks");
                        let (ta, tb) = (prompt_tokens(a, 512, 32000), prompt_tokens(b, 512, 32000));
                        let cut = shared_blocks * 512;
                        assert_eq!(
                            cut,
                            SharedPrefix {
                                system_prompt_len: system,
                                ..SharedPrefix::default()
                            }
                            .shared_len(512)
                        );
                        assert_eq!(ta[..cut], tb[..cut]);
                        assert_ne!(ta[cut..cut + 16], tb[cut..cut + 16], "questions differ");
                    } else {
                        assert_eq!(common, 0, "other groups share nothing");
                    }
                }
            }
        }
    }

    #[test]
    fn each_turn_extends_the_previous_one() {
        // 300 + 100 tokens a turn: the partial last block of one turn grows in the next.
        let requests = chats(300, 100).generate(512, 1);
        assert_eq!(
            requests.iter().map(|r| r.input_length).collect::<Vec<_>>(),
            [300, 300, 700, 700, 1100, 1100],
            "in rounds"
        );
        let firsts: Vec<u64> = requests[..2].iter().map(|r| r.hash_ids[0]).collect();
        assert_ne!(firsts[0], firsts[1], "conversations share nothing");
        for first in firsts {
            let turns: Vec<&TraceRequest> =
                requests.iter().filter(|r| r.hash_ids[0] == first).collect();
            assert_eq!(turns.len(), 3);
            for pair in turns.windows(2) {
                let (prev, next) = (pair[0], pair[1]);
                assert!(next.hash_ids.starts_with(&prev.hash_ids));
                assert_eq!(next.hash_ids.len(), next.input_length.div_ceil(512));
                let (tp, tn) = (
                    prompt_tokens(prev, 512, 32000),
                    prompt_tokens(next, 512, 32000),
                );
                assert_eq!(tp[..], tn[..tp.len()], "the tokens extend too");
            }
        }
    }

    #[test]
    fn rounds_go_in_different_orders() {
        let requests = Synthetic::MultiTurn(MultiTurn {
            conversations: 8,
            turns: 2,
            ..MultiTurn::default()
        })
        .generate(512, 1);
        let round = |k: usize| -> Vec<u64> {
            requests[k * 8..(k + 1) * 8]
                .iter()
                .map(|r| r.hash_ids[0])
                .collect()
        };
        assert_ne!(round(0), round(1));
    }

    #[test]
    fn a_seed_gives_the_same_workload_and_poisson_arrivals() {
        for spec in [shared(1024, 300), chats(300, 100)] {
            let (a, b) = (spec.generate(512, 7), spec.generate(512, 7));
            assert_eq!(a, b);
            assert_ne!(a, spec.generate(512, 8), "another seed, other arrivals");
            assert_eq!(a[0].timestamp, 0);
            assert!(a.windows(2).all(|w| w[0].timestamp <= w[1].timestamp));
        }
        // 2000 arrivals at 5 req/s: about 400 s (the standard deviation is ~9 s).
        let many = Synthetic::MultiTurn(MultiTurn {
            conversations: 1000,
            turns: 2,
            turn_len: 10,
            output_len: 1,
            request_rate: 5.0,
        })
        .generate(512, 3);
        let span = many.last().map_or(0, |r| r.timestamp) as f64 / 1000.0;
        assert!((360.0..440.0).contains(&span), "{span}");
    }

    #[test]
    fn the_hit_bound_of_tiny_workloads() {
        // 2 groups x 3 prompts: in each group the last two reuse the system prompt's blocks.
        let b = hit_bound(&shared(1024, 300).generate(512, 0), 512);
        assert!((b - 4.0 * 1024.0 / (6.0 * 1324.0)).abs() < 1e-12, "{b}");
        // 700 tokens of system prompt share one whole block.
        let b = hit_bound(&shared(700, 300).generate(512, 0), 512);
        assert!((b - 4.0 * 512.0 / 6000.0).abs() < 1e-12, "{b}");
        // 2 chats x 3 turns of 300 + 100 tokens: turns 2 and 3 reuse 300 and 700 tokens.
        let b = hit_bound(&chats(300, 100).generate(512, 0), 512);
        assert!((b - 2.0 * 1000.0 / (2.0 * 2100.0)).abs() < 1e-12, "{b}");
    }
}
