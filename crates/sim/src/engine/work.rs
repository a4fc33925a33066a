//! A step's work, counted as its timing family counts it (see the `timing` module docs).

use super::sequence::{PromptSource, Sequence};
use super::timing::{StepWork, TimingFamily};
use super::EngineCore;

impl EngineCore {
    /// The work of the sequences `scheduled` (index into `running`, tokens to compute),
    /// before it is applied; and the tokens it computes that are not decodes (for the
    /// engine's counters, whatever the family).
    pub(super) fn step_work(&self, scheduled: &[(usize, usize)]) -> (StepWork, usize) {
        let mut work = StepWork::default();
        let mut computed_prefill = 0;
        for &(idx, n) in scheduled {
            let seq = &self.running[idx];
            work.scheduled_tokens += n;
            if !seq.is_decoding() {
                computed_prefill += n;
                work.context_pairs += (n * seq.computed) as u64;
            }
        }
        match self.config.timing.family {
            TimingFamily::Kvroute => {
                for &(idx, n) in scheduled {
                    if self.running[idx].is_decoding() {
                        work.decode_seqs += 1;
                    } else {
                        work.prefill_tokens += n;
                    }
                }
                work.kv_utilisation =
                    self.pool.num_used() as f64 / self.pool.num_blocks().max(1) as f64;
            }
            TimingFamily::Dynamo => self.dynamo_work(scheduled, &mut work),
        }
        (work, computed_prefill)
    }

    /// Dynamo's mocker's counting: prefill is the prompt tokens computed, as the batch's
    /// count times the difference of its mean prompt end and mean prompt start (integer
    /// means); a decode is every sequence sampling a token but those whose first token this
    /// step's prefill yields; utilisation is the decodes' tokens over the cache's tokens.
    fn dynamo_work(&self, scheduled: &[(usize, usize)], work: &mut StepWork) {
        let (mut prefills, mut prompt_ends, mut prompt_starts) = (0usize, 0usize, 0usize);
        let mut decode_tokens = 0usize;
        for &(idx, n) in scheduled {
            let seq = &self.running[idx];
            let received = seq.prompt_kv == PromptSource::Received;
            let (start, end) = prompt_span(seq, n);
            if end > start && !received {
                prefills += 1;
                prompt_ends += end;
                prompt_starts += start;
            }
            let samples = seq.computed + n == seq.tokens.len();
            if samples && (seq.output_len() > 0 || received) {
                work.decode_seqs += 1;
                decode_tokens += seq.tokens.len();
            }
        }
        if prefills > 0 {
            work.prefill_tokens = prefills * (prompt_ends / prefills - prompt_starts / prefills);
        }
        let capacity = (self.config.num_gpu_blocks * self.config.block_size).max(1);
        work.kv_utilisation = (decode_tokens as f64 / capacity as f64).min(1.0);
    }
}

/// The prompt tokens a sequence computes when it computes `n` more: [start, end).
fn prompt_span(seq: &Sequence, n: usize) -> (usize, usize) {
    let start = seq.computed.min(seq.prompt_len);
    let end = (seq.computed + n).min(seq.prompt_len);
    (start, end)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::{EngineConfig, EngineCore, EngineRequest, RequestId, Scheduler};
    use super::super::{StepOutput, TimingFamily};

    fn dynamo(num_gpu_blocks: usize) -> EngineCore {
        EngineCore::new(EngineConfig {
            num_gpu_blocks,
            timing: TimingFamily::Dynamo.timing(),
            scheduler: TimingFamily::Dynamo.scheduler(),
            ..EngineConfig::default()
        })
    }

    fn add(core: &mut EngineCore, id: u64, prompt: Vec<u32>, max_tokens: usize) {
        let req = EngineRequest {
            id: RequestId(id),
            prompt,
            max_tokens,
            salt: 0,
            lora: None,
            priority: 0,
        };
        core.add_request(req).unwrap();
    }

    fn tokens(seed: u32, len: usize) -> Vec<u32> {
        (0..len as u32).map(|i| seed * 100_000 + i).collect()
    }

    /// Dynamo's mocker's fits, written out.
    fn prefill_ms(t: f64) -> f64 {
        4.209989e-07 * t * t + 1.518344e-02 * t + 16.50142
    }

    fn decode_ms(p: f64) -> f64 {
        (-25.74 * p * p + 54.01 * p + 5.74).max(1.0)
    }

    fn ms(out: &StepOutput) -> f64 {
        out.duration.as_secs_f64() * 1e3
    }

    #[test]
    fn dynamo_prefill_counts_the_batchs_new_prompt_tokens_with_integer_means() {
        let mut core = dynamo(1024);
        // A 64-token prompt cached, then run again with 37 more tokens beside a fresh one.
        add(&mut core, 0, tokens(1, 64), 1);
        let first = core.step(Duration::ZERO);
        assert_eq!(first.work.prefill_tokens, 64);
        assert!(
            (ms(&first) - prefill_ms(64.0)).abs() < 1e-6,
            "{}",
            ms(&first)
        );
        let mut long = tokens(1, 64);
        long.extend(tokens(2, 37));
        add(&mut core, 1, long, 2);
        add(&mut core, 2, tokens(3, 50), 2);
        let out = core.step(Duration::ZERO);
        // Ends 101 + 50, starts 64 + 0: 2 x (151 / 2 - 64 / 2) = 2 x (75 - 32) = 86, not 87.
        assert_eq!(out.started, vec![(RequestId(1), 64), (RequestId(2), 0)]);
        assert_eq!((out.work.prefill_tokens, out.work.decode_seqs), (86, 0));
        assert_eq!(out.work.context_pairs, 37 * 64);
        assert!((ms(&out) - prefill_ms(86.0)).abs() < 1e-6);
    }

    #[test]
    fn dynamo_decode_reads_the_decoding_sequences_tokens_and_no_per_sequence_term() {
        let mut core = dynamo(64); // 1024 tokens
        add(&mut core, 0, tokens(1, 300), 3);
        add(&mut core, 1, tokens(2, 100), 3);
        core.step(Duration::ZERO); // both prefills; first tokens from the prefill: no decode
                                   // A third prompt arrives: a mixed step, two decodes (301 + 101 tokens) and its prefill.
        add(&mut core, 2, tokens(3, 200), 3);
        let out = core.step(Duration::ZERO);
        assert_eq!((out.work.prefill_tokens, out.work.decode_seqs), (200, 2));
        let u = 402.0 / 1024.0;
        assert_eq!(out.work.kv_utilisation, u);
        assert!((ms(&out) - (prefill_ms(200.0) + decode_ms(u))).abs() < 1e-6);
        // Next: three decodes, 302 + 102 + 201 tokens; the sampled token of the third is its
        // first, yet it decodes now (its first came from the prefill).
        let out = core.step(Duration::ZERO);
        assert_eq!((out.work.prefill_tokens, out.work.decode_seqs), (0, 3));
        let u = 605.0 / 1024.0;
        assert!((ms(&out) - decode_ms(u)).abs() < 1e-6);
        // kvroute's own model times the same step by blocks in use, plus 0.1 ms a sequence.
        let kvroute = TimingFamily::Kvroute.timing();
        assert!(kvroute.decode_ms(3, u) > decode_ms(u) + 0.29);
    }

    #[test]
    fn whole_sequence_admission_waits_for_the_whole_prompt_to_fit() {
        // 30 blocks, 128 tokens a step: a running 128-token prompt holds 9 blocks once it
        // decodes, 21 are free; a 400-token prompt needs 25, its first chunk (127) 8.
        let run = |scheduler| {
            let mut core = EngineCore::new(EngineConfig {
                num_gpu_blocks: 30,
                max_num_batched_tokens: 128,
                scheduler,
                ..EngineConfig::default()
            });
            add(&mut core, 0, tokens(1, 128), 50);
            core.step(Duration::ZERO);
            add(&mut core, 1, tokens(2, 400), 5);
            core.step(Duration::ZERO).started
        };
        assert_eq!(run(Scheduler::Kvroute), vec![(RequestId(1), 0)]);
        assert_eq!(run(Scheduler::Dynamo), vec![]);
    }

    #[test]
    fn the_dynamo_scheduler_caches_blocks_as_it_schedules_them() {
        // Two prompts with the same 64-token prefix in one step: with Dynamo's (and vLLM
        // v1's) rule the second reuses the first's four blocks, computed in the same step.
        let run = |scheduler| {
            let mut core = EngineCore::new(EngineConfig {
                scheduler,
                ..EngineConfig::default()
            });
            for (id, tail) in [(0, 10), (1, 20)] {
                let mut p = tokens(1, 64);
                p.extend(tokens(2 + id as u32, tail));
                add(&mut core, id, p, 1);
            }
            let out = core.step(Duration::ZERO);
            (out.started, out.work.scheduled_tokens)
        };
        let hit = vec![(RequestId(0), 0), (RequestId(1), 64)];
        assert_eq!(run(Scheduler::Dynamo), (hit, 74 + 20));
        let miss = vec![(RequestId(0), 0), (RequestId(1), 0)];
        assert_eq!(run(Scheduler::Kvroute), (miss, 74 + 84));
    }
}
