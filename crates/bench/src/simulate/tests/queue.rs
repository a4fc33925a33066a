//! The router queue in virtual time: who waits, for how long, and in which order they go.

use std::time::Duration;

use kvroute_core::queue::QueueOrder;

use super::*;

/// A request at `ms` of `blocks` hash blocks of 512 tokens, none shared with another.
pub(super) fn request(ms: u64, blocks: u64, first: u64) -> TraceRequest {
    TraceRequest {
        timestamp: ms,
        input_length: blocks as usize * 512,
        output_length: 4,
        hash_ids: (first..first + blocks).collect(),
    }
}

/// `workers` engines of 512 tokens a step, queueing at `queue`.
pub(super) fn queued(workers: usize, queue: Option<QueueConfig>) -> SimConfig {
    SimConfig {
        cluster: Cluster::Aggregated {
            workers,
            policy: PolicyKind::KvAware,
            policy_config: PolicyConfig::default(),
        },
        engine: EngineConfig {
            num_gpu_blocks: 4096,
            max_num_batched_tokens: 512,
            ..EngineConfig::default()
        },
        queue,
        ..cfg(PolicyKind::KvAware)
    }
}

fn at(threshold: f64, order: QueueOrder) -> Option<QueueConfig> {
    Some(QueueConfig::new(threshold, order, Duration::from_secs(60)).unwrap())
}

/// 12 requests of 2,048 uncached tokens at once: each saturates an engine of 512 tokens a
/// step (at threshold 1) until its first token.
fn burst() -> Vec<TraceRequest> {
    (0..12).map(|i| request(0, 4, 100 * i)).collect()
}

#[test]
fn a_burst_over_saturated_engines_waits_in_the_router() {
    let r = simulate(&burst(), &queued(2, at(1.0, QueueOrder::Fcfs)));
    let q = r.queue.clone().expect("the queue is on");
    assert_eq!((r.requests, r.rejected, q.timed_out), (12, 0, 0), "{r:?}");
    // The first two go to the idle engines; the others find both saturated.
    assert_eq!(q.queued, 10, "{q:?}");
    assert_eq!(q.longest, 10);
    assert!(q.wait_ms.p50 > 0.0, "{q:?}");
}

#[test]
fn a_queued_requests_ttft_counts_its_wait() {
    // One engine: 8,192 tokens take 16 steps to their first token; the second waits.
    let trace = [request(0, 16, 0), request(1, 1, 100)];
    let r = simulate(&trace, &queued(1, at(1.0, QueueOrder::Fcfs)));
    let q = r.queue.clone().expect("the queue is on");
    assert_eq!((r.requests, q.queued), (2, 1));
    let alone = simulate(&trace[1..], &queued(1, None)).ttft_ms.p50;
    // The second's TTFT (the larger): its wait, then at least its own prefill.
    assert!(
        r.ttft_ms.p99 >= q.wait_ms.p50 + alone,
        "TTFT {} < wait {} + alone {alone}",
        r.ttft_ms.p99,
        q.wait_ms.p50
    );
    assert!(q.wait_ms.p50 > alone, "{q:?}");
}

#[test]
fn without_a_threshold_or_below_it_nothing_waits() {
    let off = simulate(&burst(), &queued(2, None));
    assert_eq!(off.queue, None);
    assert_eq!(off.requests, 12);
    // 12 x 2,048 tokens never exceed 100 x 512 on one engine.
    let high = simulate(&burst(), &queued(2, at(100.0, QueueOrder::Fcfs)));
    let q = high.queue.clone().expect("the queue is on");
    assert_eq!((q.queued, q.longest, q.wait_ms.p99), (0, 0, 0.0));
    // Nothing waited: the same run as without the queue.
    assert_eq!((high.ttft_ms, high.e2e_ms), (off.ttft_ms, off.e2e_ms));
    // The run ends with its last step, not at a deadline of a request long let go.
    assert_eq!(high.throughput_rps, off.throughput_rps);
}

#[test]
fn wspt_lets_the_cheaper_request_go_first_and_fcfs_the_earlier() {
    // One engine: the first request saturates it; a long then a short one wait.
    let trace = [request(0, 4, 0), request(1, 8, 100), request(2, 2, 200)];
    let fcfs = run(&trace, &queued(1, at(1.0, QueueOrder::Fcfs)));
    let wspt = run(&trace, &queued(1, at(1.0, QueueOrder::Wspt)));
    for r in [&fcfs, &wspt] {
        let q = r.result.queue.as_ref().expect("the queue is on");
        assert_eq!((q.queued, r.result.requests), (2, 3));
    }
    let ids = |r: &Run| r.routed.iter().map(|(id, _)| id.0).collect::<Vec<_>>();
    assert_eq!(ids(&fcfs), [0, 1, 2]);
    assert_eq!(ids(&wspt), [0, 2, 1]);
    // The short one, let go first, is served sooner.
    assert!(wspt.result.ttft_ms.p50 < fcfs.result.ttft_ms.p50);
}

#[test]
fn an_engine_that_frees_up_takes_only_what_keeps_it_unsaturated() {
    // Two engines, saturated above 512 prefill tokens: a request of 8,192 tokens holds one
    // for 16 steps, one of 2,048 the other for 4. Four of 512 tokens wait meanwhile.
    let mut trace = vec![request(0, 16, 0), request(0, 4, 100)];
    trace.extend((0..4).map(|i| request(1, 1, 200 + 10 * i)));
    let r = run(&trace, &queued(2, at(1.0, QueueOrder::Fcfs)));
    let q = r.result.queue.as_ref().expect("the queue is on");
    assert_eq!(
        (q.queued, q.timed_out, r.result.requests),
        (4, 0, 6),
        "{q:?}"
    );
    let at_of = |id: u64| {
        r.routed
            .iter()
            .find(|(r, _)| r.0 == id)
            .map(|(_, at)| *at)
            .expect("routed")
    };
    // The second engine frees up at its request's first token. One at a time, each counted
    // before the next: 512 tokens leave it unsaturated, 1,024 do not. Two go then, not four.
    let freed = at_of(2);
    assert!(freed > Duration::from_millis(1));
    assert_eq!(at_of(3), freed);
    assert!(at_of(4) > freed, "{:?}", r.routed);
    assert!(at_of(5) > freed, "{:?}", r.routed);
    let ids: Vec<u64> = r.routed.iter().map(|(id, _)| id.0).collect();
    assert_eq!(ids, [0, 1, 2, 3, 4, 5], "fcfs");
}

#[test]
fn a_request_waiting_past_the_timeout_gets_no_answer() {
    // 8,192 tokens take 16 steps to their first token; the second waits meanwhile.
    let trace = [request(0, 16, 0), request(1, 1, 100)];
    let short = QueueConfig::new(1.0, QueueOrder::Fcfs, Duration::from_millis(5)).unwrap();
    let r = simulate(&trace, &queued(1, Some(short)));
    let q = r.queue.expect("the queue is on");
    assert_eq!((r.requests, q.queued, q.timed_out), (1, 1, 1));
    assert_eq!(q.wait_ms.p50, 5.0);
    let r = simulate(&trace, &queued(1, at(1.0, QueueOrder::Fcfs)));
    assert_eq!((r.requests, r.queue.expect("on").timed_out), (2, 0));
}

#[test]
fn queue_flags_are_validated_as_the_gateways() {
    let minute = Duration::from_secs(60);
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let err = QueueConfig::new(bad, QueueOrder::Fcfs, minute).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("--router-queue-threshold must be a positive number"),
            "{err}"
        );
    }
    assert_eq!(
        QueueConfig::new(1.0, QueueOrder::Fcfs, Duration::ZERO),
        Err(InvalidQueue::Timeout)
    );
}
