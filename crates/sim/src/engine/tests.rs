use std::collections::HashMap;

use super::*;

fn config(num_gpu_blocks: usize) -> EngineConfig {
    EngineConfig {
        num_gpu_blocks,
        ..EngineConfig::default()
    }
}

fn req(id: u64, prompt: Vec<u32>, max_tokens: usize) -> EngineRequest {
    EngineRequest {
        id: RequestId(id),
        prompt,
        max_tokens,
        salt: 0,
        lora: None,
        priority: 0,
    }
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (seed * 7919 + i * 31) % 30000)
        .collect()
}

/// Everything a run produced, per request.
#[derive(Default)]
struct Run {
    tokens: HashMap<RequestId, Vec<TokenOutput>>,
    first_token_at: HashMap<RequestId, Duration>,
    events: Vec<CacheEvent>,
    steps: Vec<StepOutput>,
    end: Duration,
}

fn run(core: &mut EngineCore, mut now: Duration) -> Run {
    let mut r = Run::default();
    let mut guard = 0;
    while core.has_work() {
        let out = core.step(now);
        assert!(!out.is_idle(), "a step with work must do some");
        now += out.duration;
        for t in &out.tokens {
            r.first_token_at.entry(t.id).or_insert(now);
            r.tokens.entry(t.id).or_default().push(t.clone());
        }
        r.events.extend(out.events.iter().cloned());
        r.steps.push(out);
        guard += 1;
        assert!(guard < 1_000_000, "the engine does not converge");
    }
    r.end = now;
    r
}

fn stored_hashes(events: &[CacheEvent]) -> Vec<u64> {
    events
        .iter()
        .flat_map(|e| match e {
            CacheEvent::Stored { hashes, .. } => hashes.clone(),
            _ => Vec::new(),
        })
        .collect()
}

#[test]
fn every_request_produces_exactly_max_tokens() {
    let mut core = EngineCore::new(EngineConfig::default());
    for i in 0..20 {
        core.add_request(req(
            i,
            prompt(i as u32, 50 + i as usize * 13),
            1 + i as usize,
        ))
        .unwrap();
    }
    let r = run(&mut core, Duration::ZERO);
    for i in 0..20 {
        let toks = &r.tokens[&RequestId(i)];
        assert_eq!(toks.len(), 1 + i as usize);
        assert!(toks.iter().enumerate().all(|(k, t)| t.index == k));
        assert!(toks.last().unwrap().finished);
        assert_eq!(toks.iter().filter(|t| t.finished).count(), 1);
    }
    assert_eq!(core.stats().kv_usage, 0.0, "every block released");
}

#[test]
fn repeated_prompt_hits_all_its_full_blocks() {
    let mut core = EngineCore::new(EngineConfig::default());
    let p = prompt(1, 100); // 6 full blocks of 16, 4 tokens over
    core.add_request(req(1, p.clone(), 4)).unwrap();
    let first = run(&mut core, Duration::ZERO);
    assert_eq!(first.tokens[&RequestId(1)][0].cached_tokens, 0);
    // Its 6 full prompt blocks were stored, chained by parent links.
    let stored: Vec<_> = first
        .events
        .iter()
        .filter_map(|e| match e {
            CacheEvent::Stored {
                hashes,
                parent,
                token_ids,
                ..
            } => Some((hashes, parent, token_ids)),
            _ => None,
        })
        .collect();
    assert_eq!(stored.len(), 1);
    let (hashes, parent, token_ids) = stored[0];
    assert_eq!(hashes.len(), 6);
    assert_eq!(*parent, None);
    assert_eq!(token_ids[..], p[..96]);

    core.add_request(req(2, p.clone(), 4)).unwrap();
    let second = run(&mut core, first.end);
    assert_eq!(second.tokens[&RequestId(2)][0].cached_tokens, 96);
    let s = core.stats();
    assert_eq!(s.prefix_cache_queries, 200);
    assert_eq!(s.prefix_cache_hits, 96);
    assert!(
        stored_hashes(&second.events).is_empty(),
        "nothing new to store"
    );

    // A prompt of exactly 6 blocks reuses 5: the last token must be computed.
    let mut core = EngineCore::new(EngineConfig::default());
    let p = prompt(2, 96);
    core.add_request(req(1, p.clone(), 1)).unwrap();
    let r = run(&mut core, Duration::ZERO);
    core.add_request(req(2, p, 1)).unwrap();
    let r = run(&mut core, r.end);
    assert_eq!(r.tokens[&RequestId(2)][0].cached_tokens, 80);
}

#[test]
fn shared_prefix_is_reused_and_different_salt_is_not() {
    let mut core = EngineCore::new(EngineConfig::default());
    let system = prompt(3, 64);
    let mut a = system.clone();
    a.extend(prompt(4, 20));
    let mut b = system.clone();
    b.extend(prompt(5, 20));
    core.add_request(req(1, a, 1)).unwrap();
    let r = run(&mut core, Duration::ZERO);
    core.add_request(req(2, b.clone(), 1)).unwrap();
    let r = run(&mut core, r.end);
    assert_eq!(r.tokens[&RequestId(2)][0].cached_tokens, 64);
    // The new block's parent is the last shared block.
    match &r.events[..] {
        [CacheEvent::Stored { hashes, parent, .. }] => {
            assert_eq!(hashes.len(), 1);
            assert_eq!(
                *parent,
                Some(block_hash(
                    Some(block_hash(
                        Some(block_hash(
                            Some(block_hash(None, &system[..16], 0)),
                            &system[16..32],
                            0
                        )),
                        &system[32..48],
                        0
                    )),
                    &system[48..64],
                    0
                ))
            );
        }
        other => panic!("{other:?}"),
    }
    let mut salted = req(3, b, 1);
    salted.salt = 42;
    core.add_request(salted).unwrap();
    let r = run(&mut core, r.end);
    assert_eq!(r.tokens[&RequestId(3)][0].cached_tokens, 0);
}

#[test]
fn a_small_cache_evicts_least_recently_used_blocks_and_says_so() {
    // 12 blocks: room for two 4-block prompts at once, not three.
    let mut core = EngineCore::new(config(12));
    let prompts: Vec<_> = (0..3).map(|i| prompt(10 + i, 64 + 1)).collect();
    let mut now = Duration::ZERO;
    let mut events = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        core.add_request(req(i as u64, p.clone(), 1)).unwrap();
        let r = run(&mut core, now);
        now = r.end;
        events.extend(r.events);
    }
    let removed: Vec<u64> = events
        .iter()
        .filter_map(|e| match e {
            CacheEvent::Removed { hash } => Some(*hash),
            _ => None,
        })
        .collect();
    // Each prompt held 5 blocks (4 full and cached, 1 partial). The third took the 2
    // never-used blocks, then the first prompt's freed blocks from the LRU head: its
    // partial block (not cached) and its last two cached blocks, tail first.
    let first_hashes: Vec<u64> = stored_hashes(&events[..1]);
    assert_eq!(
        removed,
        vec![first_hashes[3], first_hashes[2]],
        "{events:?}"
    );
    // The second prompt is still fully cached; the first only partly.
    core.add_request(req(10, prompts[1].clone(), 1)).unwrap();
    let r = run(&mut core, now);
    assert_eq!(r.tokens[&RequestId(10)][0].cached_tokens, 64);
    core.add_request(req(11, prompts[0].clone(), 1)).unwrap();
    let r = run(&mut core, r.end);
    assert!(r.tokens[&RequestId(11)][0].cached_tokens < 64);
}

#[test]
fn ttft_grows_with_uncached_prompt_length() {
    let mut ttft = Vec::new();
    for len in [100, 1000, 4000, 8000] {
        let mut core = EngineCore::new(EngineConfig::default());
        core.add_request(req(1, prompt(9, len), 1)).unwrap();
        let r = run(&mut core, Duration::ZERO);
        ttft.push(r.first_token_at[&RequestId(1)]);
    }
    assert!(ttft.windows(2).all(|w| w[0] < w[1]), "{ttft:?}");
    // Cached tokens are cheaper than new ones but not free.
    let p = prompt(9, 4000);
    let mut core = EngineCore::new(EngineConfig::default());
    core.add_request(req(1, p.clone(), 1)).unwrap();
    let r = run(&mut core, Duration::ZERO);
    let cold = r.first_token_at[&RequestId(1)];
    let mut tail = p.clone();
    tail.extend(prompt(8, 100));
    core.add_request(req(2, tail, 1)).unwrap();
    let r2 = run(&mut core, r.end);
    let warm = r2.first_token_at[&RequestId(2)] - r.end;
    let mut core = EngineCore::new(EngineConfig::default());
    core.add_request(req(3, prompt(8, 100), 1)).unwrap();
    let bare = run(&mut core, Duration::ZERO).first_token_at[&RequestId(3)];
    assert!(warm < cold, "{warm:?} < {cold:?}");
    assert!(
        warm > bare,
        "attention over the cached context costs: {warm:?} > {bare:?}"
    );
}

#[test]
fn long_prompts_are_prefilled_in_chunks_within_the_budget() {
    let mut core = EngineCore::new(EngineConfig {
        max_num_batched_tokens: 1000,
        ..EngineConfig::default()
    });
    core.add_request(req(1, prompt(1, 3500), 2)).unwrap();
    let r = run(&mut core, Duration::ZERO);
    let prefill: Vec<usize> = r.steps.iter().map(|s| s.work.prefill_tokens).collect();
    assert_eq!(&prefill[..4], &[1000, 1000, 1000, 500]);
    assert!(r
        .steps
        .iter()
        .all(|s| s.work.prefill_tokens + s.work.decode_seqs <= 1000));
    // The first token comes with the step that completes the prompt.
    assert_eq!(r.steps[3].tokens.len(), 1);
    assert!(r.steps[..3].iter().all(|s| s.tokens.is_empty()));
}

#[test]
fn max_num_seqs_and_the_token_budget_bound_the_batch() {
    let mut core = EngineCore::new(EngineConfig {
        max_num_seqs: 4,
        max_num_batched_tokens: 300,
        ..EngineConfig::default()
    });
    for i in 0..10 {
        core.add_request(req(i, prompt(i as u32, 100), 20)).unwrap();
    }
    let r = run(&mut core, Duration::ZERO);
    for s in &r.steps {
        assert!(s.work.prefill_tokens + s.work.decode_seqs <= 300);
        assert!(s.work.decode_seqs <= 4);
    }
    // The first step admits three 100-token prompts: the budget, not max_num_seqs, binds.
    assert_eq!(r.steps[0].started.len(), 3);
    assert!(r.steps.iter().any(|s| s.work.decode_seqs == 4));
    assert_eq!(r.tokens.len(), 10);
}

#[test]
fn preemption_when_blocks_run_out_loses_nothing() {
    // 40 blocks of 16 = 640 tokens; 8 requests of 100 + 100 tokens cannot all fit.
    let mut core = EngineCore::new(config(40));
    for i in 0..8 {
        core.add_request(req(i, prompt(i as u32, 100), 100))
            .unwrap();
    }
    let r = run(&mut core, Duration::ZERO);
    assert!(
        core.stats().preemptions > 0,
        "the cache was too small: someone was preempted"
    );
    let preempted: usize = r.steps.iter().map(|s| s.preempted.len()).sum();
    assert_eq!(preempted as u64, core.stats().preemptions);
    for i in 0..8 {
        let toks = &r.tokens[&RequestId(i)];
        assert_eq!(toks.len(), 100, "request {i}");
        assert!(toks.iter().enumerate().all(|(k, t)| t.index == k));
    }
    assert_eq!(core.stats().kv_usage, 0.0);
}

#[test]
fn abort_frees_blocks_and_bad_requests_are_refused() {
    let mut core = EngineCore::new(config(64));
    core.add_request(req(1, prompt(1, 300), 50)).unwrap();
    core.step(Duration::ZERO);
    assert!(core.stats().kv_usage > 0.0);
    assert!(core.abort(RequestId(1)));
    assert!(!core.abort(RequestId(1)));
    assert_eq!(core.stats().kv_usage, 0.0);
    assert!(!core.has_work());
    assert_eq!(
        core.add_request(req(2, vec![], 1)),
        Err(AddError::EmptyPrompt)
    );
    assert_eq!(
        core.add_request(req(2, vec![1], 0)),
        Err(AddError::NoOutput)
    );
    assert!(matches!(
        core.add_request(req(2, prompt(1, 1000), 100)),
        Err(AddError::TooLong { .. })
    ));
    core.add_request(req(3, vec![1], 1)).unwrap();
    assert_eq!(
        core.add_request(req(3, vec![1], 1)),
        Err(AddError::DuplicateId(RequestId(3)))
    );
}

#[test]
fn reset_prefix_cache_clears_when_idle() {
    let mut core = EngineCore::new(EngineConfig::default());
    let p = prompt(5, 64);
    core.add_request(req(1, p.clone(), 1)).unwrap();
    let r = run(&mut core, Duration::ZERO);
    assert!(core.stats().cached_blocks > 0);
    assert!(core.reset_prefix_cache());
    assert_eq!(core.take_events(), vec![CacheEvent::Cleared]);
    core.add_request(req(2, p, 1)).unwrap();
    let r = run(&mut core, r.end);
    assert_eq!(r.tokens[&RequestId(2)][0].cached_tokens, 0);
}

#[test]
fn same_seed_same_run() {
    let go = || {
        let mut core = EngineCore::new(EngineConfig {
            seed: 7,
            ..EngineConfig::default()
        });
        for i in 0..5 {
            core.add_request(req(i, prompt(i as u32, 40), 8)).unwrap();
        }
        let r = run(&mut core, Duration::ZERO);
        let mut v: Vec<_> = r.tokens.into_iter().collect();
        v.sort_by_key(|(k, _)| *k);
        (v, r.end)
    };
    assert_eq!(go(), go());
}

/// Steps a core holding only transfers until the first lands; returns that step.
fn step_until_landed(core: &mut EngineCore, now: &mut Duration) -> StepOutput {
    loop {
        let out = core.step(*now);
        if !out.is_idle() {
            *now += out.duration;
            return out;
        }
        *now = core.next_transfer_done().expect("a transfer in flight");
    }
}

#[test]
fn a_transferred_prompt_is_received_not_computed() {
    let p = prompt(1, 100); // 6 full blocks of 16, 4 tokens over
    let mut core = EngineCore::new(EngineConfig::default());
    core.add_request_from(req(1, p.clone(), 4), PromptKv::Transfer)
        .unwrap();
    // Admitted, holding blocks for the whole prompt, computing nothing.
    let out = core.step(Duration::ZERO);
    assert!(out.is_idle());
    assert_eq!(out.started, vec![(RequestId(1), 0)]);
    let done = core.config().timing.transfer_time(100);
    assert_eq!(core.next_transfer_done(), Some(done));
    let s = core.stats();
    assert_eq!(
        (s.running, s.waiting),
        (0, 1),
        "counted as waiting, as vLLM does"
    );
    assert!(s.kv_usage > 0.0);
    assert!(core.step(done / 2).is_idle(), "not landed yet");
    // Landed: the prompt's blocks are cached (all but the last token's), and the last
    // prompt token runs as a decode that samples the first token.
    let mut now = done;
    let landed = step_until_landed(&mut core, &mut now);
    assert_eq!(
        (landed.work.prefill_tokens, landed.work.decode_seqs),
        (0, 1)
    );
    assert_eq!(landed.tokens.len(), 1);
    assert_eq!(landed.tokens[0].cached_tokens, 0);
    let rest = run(&mut core, now);
    assert_eq!(rest.tokens[&RequestId(1)].len(), 3);
    assert!(rest.tokens[&RequestId(1)].last().unwrap().finished);
    let s = core.stats();
    assert_eq!(s.prefill_tokens_computed, 0);
    assert_eq!(
        (s.kv_transfers_received, s.kv_transfer_tokens_received),
        (1, 100)
    );
    assert_eq!(s.kv_usage, 0.0);
    // The blocks stored are those a local prefill of the prompt stores.
    let mut local = EngineCore::new(EngineConfig::default());
    local.add_request(req(1, p, 1)).unwrap();
    let computed = run(&mut local, Duration::ZERO);
    assert_eq!(
        stored_hashes(&landed.events),
        stored_hashes(&computed.events)
    );
    assert_eq!(stored_hashes(&landed.events).len(), 6);
    assert_eq!(local.stats().prefill_tokens_computed, 100);
}

#[test]
fn local_cache_hits_shorten_a_transfer_and_whole_blocks_are_all_stored() {
    let mut core = EngineCore::new(EngineConfig::default());
    let head = prompt(2, 96);
    core.add_request(req(1, head.clone(), 1)).unwrap();
    let r = run(&mut core, Duration::ZERO);
    assert_eq!(stored_hashes(&r.events).len(), 6);
    // 96 cached tokens + 64 new (4 whole blocks): only the 64 cross the link.
    let mut p = head;
    p.extend(prompt(3, 64));
    core.add_request_from(req(2, p, 2), PromptKv::Transfer)
        .unwrap();
    let out = core.step(r.end);
    assert_eq!(out.started, vec![(RequestId(2), 96)]);
    assert_eq!(
        core.next_transfer_done(),
        Some(r.end + core.config().timing.transfer_time(64))
    );
    let mut now = r.end;
    let landed = step_until_landed(&mut core, &mut now);
    // Landing stores the 3 new blocks whose tokens are all received; the step that
    // computes the last prompt token stores the 4th.
    assert_eq!(stored_hashes(&landed.events).len(), 4);
    match &landed.events[..] {
        [CacheEvent::Stored { hashes: a, .. }, CacheEvent::Stored { hashes: b, .. }] => {
            assert_eq!((a.len(), b.len()), (3, 1));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(landed.tokens[0].cached_tokens, 96);
    run(&mut core, now);
    let s = core.stats();
    assert_eq!(s.kv_transfer_tokens_received, 64);
    assert_eq!(
        s.prefill_tokens_computed, 96,
        "the first request's prompt only"
    );
}

#[test]
fn transfers_hold_their_blocks_until_landed_or_aborted() {
    // 8 blocks: a 100-token transfer holds 7, so a 20-token prompt (2 blocks) waits.
    let mut core = EngineCore::new(config(8));
    core.add_request_from(req(1, prompt(4, 100), 1), PromptKv::Transfer)
        .unwrap();
    core.add_request(req(2, prompt(5, 20), 1)).unwrap();
    let out = core.step(Duration::ZERO);
    assert!(out.is_idle() && out.started.len() == 1);
    assert!(core.contains(RequestId(1)) && core.has_work());
    assert!(
        core.step(Duration::ZERO).is_idle(),
        "blocked behind the transfer"
    );
    assert!(core.abort(RequestId(1)));
    assert_eq!(core.next_transfer_done(), None);
    let r = run(&mut core, Duration::ZERO);
    assert_eq!(r.tokens[&RequestId(2)].len(), 1);
    assert_eq!(core.stats().kv_usage, 0.0);
    assert_eq!(core.stats().kv_transfers_received, 0);
}

#[test]
fn received_requests_preempted_for_blocks_recompute_and_lose_nothing() {
    // As `preemption_when_blocks_run_out_loses_nothing`, with every prompt received.
    let mut core = EngineCore::new(config(40));
    for i in 0..8 {
        core.add_request_from(req(i, prompt(i as u32, 100), 100), PromptKv::Transfer)
            .unwrap();
    }
    let mut now = Duration::ZERO;
    let mut tokens: HashMap<RequestId, Vec<TokenOutput>> = HashMap::new();
    let mut guard = 0;
    while core.has_work() {
        let out = core.step(now);
        if out.is_idle() {
            now = core
                .next_transfer_done()
                .expect("idle only while receiving");
            continue;
        }
        now += out.duration;
        for t in out.tokens {
            tokens.entry(t.id).or_default().push(t);
        }
        guard += 1;
        assert!(guard < 1_000_000, "the engine does not converge");
    }
    let s = core.stats();
    assert!(
        s.preemptions > 0,
        "the cache was too small: someone was preempted"
    );
    assert!(s.kv_transfers_received >= 1);
    assert!(
        s.prefill_tokens_computed > 0,
        "the preempted recomputed here"
    );
    for i in 0..8 {
        let toks = &tokens[&RequestId(i)];
        assert_eq!(toks.len(), 100, "request {i}");
        assert!(toks.iter().enumerate().all(|(k, t)| t.index == k));
    }
    assert_eq!(s.kv_usage, 0.0);
}

#[test]
fn a_new_speed_applies_from_the_next_step() {
    let mut core = EngineCore::new(config(1024));
    core.add_request(req(1, prompt(1, 4000), 4)).unwrap();
    let first = core.step(Duration::ZERO);
    core.set_speedup(0.25);
    assert_eq!(core.config().timing.speedup, 0.25);
    let mut slow = EngineCore::new(config(1024));
    slow.set_speedup(0.25);
    slow.add_request(req(1, prompt(1, 4000), 4)).unwrap();
    let quarter = slow.step(Duration::ZERO);
    // The same step at a quarter of the speed takes four times as long (virtual time).
    let ratio = quarter.duration.as_secs_f64() / first.duration.as_secs_f64();
    assert!((ratio - 4.0).abs() < 1e-6, "{ratio}");
}

fn lora_core(max_loras: usize, load_ms: u64) -> EngineCore {
    EngineCore::new(EngineConfig {
        lora: LoraConfig {
            max_loras,
            load_time: Duration::from_millis(load_ms),
        },
        ..EngineConfig::default()
    })
}

fn lora_req(id: u64, lora: Option<u32>, max_tokens: usize) -> EngineRequest {
    EngineRequest {
        lora: lora.map(LoraId),
        ..req(id, prompt(id as u32, 40), max_tokens)
    }
}

#[test]
fn a_step_runs_at_most_max_loras_adapters_and_skips_the_rest_without_blocking() {
    let mut core = lora_core(2, 0);
    // Adapters 1, 2, 3 and the base model: 3 finds no slot, the base model behind it runs.
    for (id, lora) in [(0, Some(1)), (1, Some(2)), (2, Some(3)), (3, None)] {
        core.add_request(lora_req(id, lora, 4)).unwrap();
    }
    let out = core.step(Duration::ZERO);
    let started: Vec<u64> = out.started.iter().map(|(id, _)| id.0).collect();
    assert_eq!(started, [0, 1, 3]);
    let state = core.lora_state();
    assert_eq!(state.running, [LoraId(1), LoraId(2)]);
    assert_eq!(state.waiting, [LoraId(3)]);
    assert_eq!(state.max_loras, 2);
    // It runs once a slot's requests are done; everything finishes.
    let r = run(&mut core, out.duration);
    assert_eq!(r.tokens[&RequestId(2)].len(), 4);
    assert_eq!(core.stats().lora_loads, 3);
    assert_eq!(core.lora_state().resident, [LoraId(2), LoraId(3)]);
}

#[test]
fn loading_an_adapter_lengthens_its_step_and_a_resident_one_does_not() {
    let base = {
        let mut core = lora_core(1, 0);
        core.add_request(lora_req(0, Some(7), 1)).unwrap();
        core.step(Duration::ZERO).duration
    };
    let mut core = lora_core(1, 40);
    core.add_request(lora_req(0, Some(7), 1)).unwrap();
    assert_eq!(
        core.step(Duration::ZERO).duration,
        base + Duration::from_millis(40)
    );
    // Again, with another prompt of the same length: resident, no load.
    core.add_request(lora_req(0, Some(7), 1)).unwrap();
    let again = core.step(Duration::ZERO).duration;
    assert!(again <= base, "{again:?} against {base:?}");
    // Another adapter evicts it (one slot): loaded, then 7 again is a load too.
    core.add_request(lora_req(1, Some(8), 1)).unwrap();
    core.step(Duration::ZERO);
    core.add_request(lora_req(2, Some(7), 1)).unwrap();
    core.step(Duration::ZERO);
    assert_eq!(core.stats().lora_loads, 3);
}

#[test]
fn an_adapters_blocks_carry_it_and_hash_apart_from_the_base_models() {
    let mut core = lora_core(1, 0);
    core.add_request(EngineRequest {
        salt: 99,
        ..lora_req(0, Some(5), 1)
    })
    .unwrap();
    let out = core.step(Duration::ZERO);
    match &out.events[..] {
        [CacheEvent::Stored { lora, .. }] => assert_eq!(*lora, Some(LoraId(5))),
        other => panic!("{other:?}"),
    }
}

fn priority_core(num_gpu_blocks: usize, max_num_seqs: usize) -> EngineCore {
    EngineCore::new(EngineConfig {
        num_gpu_blocks,
        max_num_seqs,
        policy: SchedulingPolicy::Priority,
        ..EngineConfig::default()
    })
}

fn with_priority(id: u64, len: usize, max_tokens: usize, priority: i64) -> EngineRequest {
    EngineRequest {
        priority,
        ..req(id, prompt(id as u32, len), max_tokens)
    }
}

/// Request ids in the order of their first tokens.
fn first_token_order(r: &Run) -> Vec<u64> {
    let mut ids: Vec<_> = r
        .first_token_at
        .iter()
        .map(|(id, at)| (*at, id.0))
        .collect();
    ids.sort_unstable();
    ids.into_iter().map(|(_, id)| id).collect()
}

#[test]
fn priority_orders_the_waiting_queue_and_fcfs_ignores_it() {
    // One sequence at a time: the queue's order is the order of service.
    let mut core = priority_core(16384, 1);
    let mut fcfs = EngineCore::new(EngineConfig {
        max_num_seqs: 1,
        ..EngineConfig::default()
    });
    for (id, priority) in [(1, 0), (2, 2), (3, 1), (4, 1), (5, -1)] {
        core.add_request(with_priority(id, 40, 3, priority))
            .unwrap();
        fcfs.add_request(with_priority(id, 40, 3, priority))
            .unwrap();
    }
    let r = run(&mut core, Duration::ZERO);
    // 5 comes first (lowest), then 1 (0), then 3 and 4 (1, by arrival), then 2.
    assert_eq!(first_token_order(&r), [5, 1, 3, 4, 2]);
    assert!(r.tokens.values().all(|t| t.len() == 3));
    // FCFS serves them as they came (vLLM 0.32 takes a priority and ignores it).
    assert_eq!(
        first_token_order(&run(&mut fcfs, Duration::ZERO)),
        [1, 2, 3, 4, 5]
    );
}

#[test]
fn priority_preempts_the_lowest_priority_first_and_gives_back_its_step() {
    // 20 blocks of 16 = 320 tokens: two 100-token prompts growing to 250 tokens each do not
    // fit together. The low-priority one arrives (and runs) first.
    let victims = |policy, low: i64| {
        let mut core = EngineCore::new(EngineConfig {
            num_gpu_blocks: 20,
            policy,
            ..EngineConfig::default()
        });
        core.add_request(with_priority(1, 100, 150, low)).unwrap();
        core.add_request(req(2, prompt(2, 100), 150)).unwrap();
        let r = run(&mut core, Duration::ZERO);
        for s in &r.steps {
            // A sequence preempted in a step produced nothing in it.
            assert!(s.tokens.iter().all(|t| !s.preempted.contains(&t.id)));
        }
        for id in [1, 2] {
            let toks = &r.tokens[&RequestId(id)];
            assert_eq!(toks.len(), 150, "request {id} lost nothing");
            assert!(toks.iter().enumerate().all(|(k, t)| t.index == k));
        }
        let preempted: Vec<u64> = r
            .steps
            .iter()
            .flat_map(|s| &s.preempted)
            .map(|id| id.0)
            .collect();
        let done_at = |id: u64| {
            let n = r
                .steps
                .iter()
                .position(|s| s.tokens.iter().any(|t| t.id == RequestId(id) && t.finished));
            n.unwrap()
        };
        (preempted, done_at(1) < done_at(2))
    };
    // FCFS preempts the newest: the high-priority request 2.
    let (preempted, low_first) = victims(SchedulingPolicy::Fcfs, 0);
    assert_eq!(preempted.first(), Some(&2));
    assert!(low_first);
    // Priority preempts request 1, older but lower, while it is scheduled ahead of 2 in the
    // step; 2 is never preempted and finishes first.
    let (preempted, low_first) = victims(SchedulingPolicy::Priority, 5);
    assert!(!preempted.is_empty() && preempted.iter().all(|&id| id == 1));
    assert!(!low_first);
}
