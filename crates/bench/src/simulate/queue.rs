//! The router's queue in virtual time, as the gateway's admission queue
//! (`kvroute_gateway::queue`) decides it, with kvroute-core's functions and `DrrQueue`:
//!
//! - An arriving request waits when every engine it may go to is saturated, its active
//!   prefill tokens (the router's accounting) above `threshold x max_num_batched_tokens`
//!   ([`kvroute_core::queue::saturated`]), or when others already wait
//!   ([`kvroute_core::queue::must_wait`]). Its cost is its uncached tokens as the index sees
//!   them then, on the engine that holds most of its prefix.
//! - Whenever capacity may have freed (a request's first token or its end, and after each
//!   push) the queue lets go the head that [`DrrQueue::pop`] gives while one of its engines
//!   is not saturated: in arrival order (`fcfs`) or fewest uncached tokens first (`wspt`).
//!   As in the gateway, one at a time: the request let go is routed, on fresh cache and load
//!   state, and its load counted before saturation is tested again for the next. (Routing
//!   takes no virtual time, so the gateway's request *in transit* never delays one here.)
//!   The gateway's 100 ms re-examination adds nothing here: the load changes only at those
//!   events.
//! - A request still waiting `timeout` after its arrival leaves the queue unanswered (the
//!   gateway's `queue_timeout`).
//!
//! - With tenants, `--router-queue-fairness vtc` orders them by virtual token counters
//!   (`kvroute_core::queue::vtc`): a request's uncached tokens are charged when it is let go
//!   (or at once when it does not wait), each output token (weight 2) as it is produced.
//!   `fcfs` ignores tenants.
//! - With `--engine-priority` (engines scheduling by priority), a request whose tenant is
//!   below its share of the prompt tokens in flight does not wait: it goes first in its
//!   engine's own queue (`kvroute_core::queue::engine_priority`), as in the gateway.
//!
//! One policy class, `default`, and one priority tier, as the gateway's without
//! `policy_classes` (a trace names neither). A request's TTFT and E2E count from its arrival, its wait included.

use std::collections::VecDeque;
use std::time::Duration;

use kvroute_core::queue::{Arrival, DrrQueue, Fairness, PolicyClass, QueueOrder, Sharing, Ticket};
use kvroute_core::RankLoad;
use kvroute_index::BlockHash;
use kvroute_sim::engine::{LoraId, RequestId};
use serde::Serialize;

use super::result::{percentiles, Percentiles};

/// The router queue's knobs, with the gateway's meaning.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QueueConfig {
    /// `--router-queue-threshold`: a rank is saturated above this fraction of its
    /// `max_num_batched_tokens` in active prefill tokens.
    pub threshold: f64,
    /// `--router-queue-policy`.
    pub order: QueueOrder,
    /// `--router-queue-timeout-secs`.
    pub timeout: Duration,
    /// `--router-queue-fairness`.
    pub fairness: TenantFairness,
}

/// How the router queue orders tenants (`--router-queue-fairness`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TenantFairness {
    /// Tenants ignored: the queue's order alone (`fcfs`).
    #[default]
    Fcfs,
    /// Virtual token counters between tenants.
    Vtc,
}

/// A queue flag that makes no sense.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InvalidQueue {
    #[error("--router-queue-threshold must be a positive number, got {0}")]
    Threshold(f64),
    #[error("--router-queue-timeout-secs must be positive")]
    Timeout,
    #[error("--router-queue-threshold is not supported with prefill/decode disaggregation (neither is it in the gateway)")]
    Disaggregated,
}

impl QueueConfig {
    /// The gateway's default timeout.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

    /// Validated as the gateway validates its flags.
    pub fn new(threshold: f64, order: QueueOrder, timeout: Duration) -> Result<Self, InvalidQueue> {
        if !kvroute_core::queue::valid_threshold(threshold) {
            return Err(InvalidQueue::Threshold(threshold));
        }
        if timeout.is_zero() {
            return Err(InvalidQueue::Timeout);
        }
        Ok(Self {
            threshold,
            order,
            timeout,
            fairness: TenantFairness::Fcfs,
        })
    }

    /// The same, ordering tenants by `fairness`.
    pub fn with_fairness(self, fairness: TenantFairness) -> Self {
        Self { fairness, ..self }
    }

    /// The order's flag value.
    pub fn order_name(&self) -> &'static str {
        match self.order {
            QueueOrder::Fcfs => "fcfs",
            QueueOrder::Wspt => "wspt",
        }
    }
}

/// What the router queue did in a run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QueueResult {
    pub threshold: f64,
    pub policy: &'static str,
    pub timeout_s: f64,
    pub fairness: TenantFairness,
    /// Requests that entered the queue.
    pub queued: usize,
    /// Of those, the ones that waited past the timeout (no answer).
    pub timed_out: usize,
    /// Time in the queue of the requests that entered it (a timed-out one: the timeout).
    pub wait_ms: Percentiles,
    /// The most requests waiting at once.
    pub longest: usize,
}

/// A request waiting in the queue, with what it needs to be routed when let go.
#[derive(Debug)]
pub(super) struct Queued {
    pub id: RequestId,
    pub arrival: Duration,
    pub tokens: Vec<u32>,
    pub hashes: Vec<BlockHash>,
    pub max_tokens: usize,
    pub tenant: u32,
    /// Its LoRA adapter (`SimConfig::loras`).
    pub lora: Option<LoraId>,
}

/// The queue and its tallies.
#[derive(Debug)]
pub(super) struct RouterQueue {
    cfg: QueueConfig,
    /// The engines' `max_num_batched_tokens`.
    budget: u64,
    queue: DrrQueue<Queued>,
    /// Each pushed request's deadline, in arrival order (those let go stay until passed).
    deadlines: VecDeque<(Duration, Ticket)>,
    waits_ms: Vec<f64>,
    timed_out: usize,
    longest: usize,
    /// The queue's key of each tenant seen, by tenant number.
    keys: Vec<String>,
}

impl RouterQueue {
    /// An empty queue before engines of `max_num_batched_tokens`.
    pub fn new(cfg: QueueConfig, max_num_batched_tokens: u64) -> Self {
        let default = PolicyClass {
            name: "default".into(),
            weight: 1,
            max_queued: None,
        };
        let sharing = Sharing {
            fairness: match cfg.fairness {
                TenantFairness::Fcfs => Fairness::Off,
                TenantFairness::Vtc => Fairness::Vtc(Default::default()),
            },
            ..Sharing::default()
        };
        Self {
            cfg,
            budget: max_num_batched_tokens,
            queue: DrrQueue::with_sharing(vec![default], cfg.order, sharing)
                .expect("one valid class"),
            deadlines: VecDeque::new(),
            waits_ms: Vec::new(),
            timed_out: 0,
            longest: 0,
            keys: Vec::new(),
        }
    }

    /// Makes sure `keys` names `tenant`.
    fn learn(&mut self, tenant: u32) {
        while self.keys.len() <= tenant as usize {
            self.keys
                .push(crate::tenants::tenant_key(self.keys.len() as u32));
        }
    }

    /// `tenant` was served `tokens` output tokens.
    pub fn charge(&mut self, tenant: u32, tokens: u64) {
        self.learn(tenant);
        self.queue.charge(0, &self.keys[tenant as usize], tokens);
    }

    /// `tenant`'s request of `cost` uncached tokens went without waiting: charged as the
    /// queue charges one it lets go (the gateway's `AdmissionQueue::admit`).
    pub fn charge_prompt(&mut self, tenant: u32, cost: u64) {
        self.learn(tenant);
        self.queue
            .charge_prompt(0, &self.keys[tenant as usize], cost);
    }

    fn all_saturated(&self, loads: &[RankLoad]) -> bool {
        let (budget, threshold) = (Some(self.budget), self.cfg.threshold);
        loads
            .iter()
            .all(|l| kvroute_core::queue::saturated(l.prefill_tokens(), budget, threshold))
    }

    /// Whether a request arriving before engines with `loads` waits.
    pub fn must_wait(&self, loads: &[RankLoad]) -> bool {
        kvroute_core::queue::must_wait(self.all_saturated(loads), !self.queue.is_empty())
    }

    /// Enqueues `item` with `cost`, its uncached tokens.
    pub fn push(&mut self, item: Queued, cost: u64) {
        let deadline = item.arrival + self.cfg.timeout;
        self.learn(item.tenant);
        let arrival = Arrival {
            class: 0,
            tier: 0,
            tenant: &self.keys[item.tenant as usize],
            cost,
            now: item.arrival,
            head_start: Duration::ZERO,
        };
        let ticket = self
            .queue
            .push_with(&arrival, item)
            .expect("the class is unbounded");
        self.deadlines.push_back((deadline, ticket));
        self.longest = self.longest.max(self.queue.len());
    }

    /// The next request let go at `now` before engines with `loads`, if any. The caller
    /// routes it, counting its load, before asking for another.
    pub fn release(&mut self, loads: &[RankLoad], now: Duration) -> Option<Queued> {
        // Every request may go to every engine: one test answers for every class's head.
        let blocked = self.all_saturated(loads);
        let (_, item) = self.queue.pop_at(now, |_, _| !blocked)?;
        self.waits_ms.push((now - item.arrival).as_secs_f64() * 1e3);
        Some(item)
    }

    /// Takes out the requests still waiting at their deadline, `now` or before.
    pub fn expire(&mut self, now: Duration) {
        while let Some(&(deadline, ticket)) = self.deadlines.front() {
            if deadline > now {
                break;
            }
            self.deadlines.pop_front();
            if self.queue.remove(ticket).is_some() {
                self.timed_out += 1;
                self.waits_ms.push(self.cfg.timeout.as_secs_f64() * 1e3);
            }
        }
    }

    /// The next deadline (maybe of a request already let go: then nothing happens at it).
    pub fn next_deadline(&self) -> Option<Duration> {
        self.deadlines.front().map(|(d, _)| *d)
    }

    pub fn result(mut self) -> QueueResult {
        QueueResult {
            threshold: self.cfg.threshold,
            policy: self.cfg.order_name(),
            timeout_s: self.cfg.timeout.as_secs_f64(),
            fairness: self.cfg.fairness,
            queued: self.waits_ms.len() + self.queue.len(),
            timed_out: self.timed_out,
            wait_ms: percentiles(&mut self.waits_ms),
            longest: self.longest,
        }
    }
}
