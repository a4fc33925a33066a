//! Per-tenant rate limits (`--tenant-rate-limit-enabled`): token buckets per tenant and per
//! model rule, reserved at admission and settled from the response's usage.
//!
//! **Buckets.** A scope (a tenant, or a tenant's model rule) has two buckets, tokens and
//! requests, each holding at most its per-minute figure `C` and refilled continuously at
//! `C / 60` per second: after `t` seconds a bucket holds `min(C, b + t * C / 60)`. A new
//! scope starts full.
//!
//! **Reserve.** A request asks for `n` tokens (its prompt as the router counts it, plus its
//! `max_tokens`) and one request, from its tenant's scope and, when its model matches one of
//! the tenant's rules, from that rule's too (exact match first, else the longest prefix).
//! Both scopes must have room, or nothing is taken: the refusal says how long until they
//! would ([`Refused::Wait`], the longest wait over the buckets short of room, rounded up to
//! a whole second), or that they never will ([`Refused::OverCapacity`]: `n` is more than a
//! bucket's capacity).
//!
//! **Settle.** When the response is over, its usage (`u` tokens) replaces the estimate: the
//! token buckets are given `n - u` back, or charged `u - n` more when the answer used more
//! than reserved (a bucket may go below zero, and refills from there; it never goes above
//! its capacity). A request that got no answer from an engine (refused, failed, not found)
//! gives all its tokens back; its request is still counted.
//!
//! **Replicas.** With `--replica-sync`, every charge (a reservation, a settlement) is also
//! published to the other replicas, which take it from their own copy of the buckets
//! ([`RateLimiter::charge`]): the replicas count together, each a message late. A replica
//! that starts has full buckets.
//!
//! Tenants live in 16 shards (by the tenant's hash), each a mutex held only to read and
//! update a tenant's buckets: one tenant's two scopes are in one shard, so a reservation is
//! atomic over both. Every [`MAX_IDLE_SCOPES`] new scopes, a shard forgets those that are
//! full (a full bucket and a new one are the same), so idle tenants cost nothing for long.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::auth::Tenant;
use crate::config::{Limits, RateLimitPolicy};

const SHARDS: usize = 16;
/// New scopes in a shard between two sweeps of its full ones.
pub const MAX_IDLE_SCOPES: usize = 4096;

/// One shard's scopes, and the size at which it is swept next.
#[derive(Debug, Default)]
struct Shard {
    scopes: HashMap<Scope, Bucket>,
    sweep_at: usize,
}

/// One scope's two buckets at `at`.
#[derive(Debug, Clone, PartialEq)]
pub struct Bucket {
    limits: Limits,
    tokens: f64,
    requests: f64,
    at: Instant,
}

/// Why a reservation was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Enough will have refilled in this many seconds (at least 1).
    Wait(u64),
    /// The request asks for more tokens than the bucket can ever hold.
    OverCapacity,
}

impl Bucket {
    /// A full bucket.
    pub fn new(limits: Limits, now: Instant) -> Self {
        Self {
            limits,
            tokens: f64::from(limits.tokens_per_minute),
            requests: f64::from(limits.requests_per_minute),
            at: now,
        }
    }

    pub fn tokens(&self) -> f64 {
        self.tokens
    }

    pub fn requests(&self) -> f64 {
        self.requests
    }

    fn capacity(&self) -> (f64, f64) {
        (
            f64::from(self.limits.tokens_per_minute),
            f64::from(self.limits.requests_per_minute),
        )
    }

    /// Refills for the time since the last look (never backwards, never past capacity).
    pub fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        let (tokens, requests) = self.capacity();
        self.tokens = (self.tokens + elapsed * tokens / 60.0).min(tokens);
        self.requests = (self.requests + elapsed * requests / 60.0).min(requests);
        self.at = self.at.max(now);
    }

    /// Whether `tokens` and one request fit now (after [`Bucket::refill`]).
    pub fn check(&self, tokens: f64) -> Result<(), Refused> {
        let (cap_tokens, cap_requests) = self.capacity();
        if tokens > cap_tokens {
            return Err(Refused::OverCapacity);
        }
        let wait = |have: f64, need: f64, cap: f64| -> f64 {
            if have >= need {
                0.0
            } else {
                (need - have) / (cap / 60.0)
            }
        };
        let secs =
            wait(self.tokens, tokens, cap_tokens).max(wait(self.requests, 1.0, cap_requests));
        if secs == 0.0 {
            Ok(())
        } else {
            Err(Refused::Wait((secs.ceil() as u64).max(1)))
        }
    }

    /// Takes `tokens` and one request (after a successful [`Bucket::check`]).
    pub fn take(&mut self, tokens: f64) {
        self.tokens -= tokens;
        self.requests -= 1.0;
    }

    /// Takes `delta` more tokens (gives back when negative), never above capacity. A charge
    /// refills to `now` first (else a later refill, capped, would erase it); a refund does
    /// not need the clock (the cap is the same either way).
    pub fn settle(&mut self, delta: f64, now: Instant) {
        if delta > 0.0 {
            self.refill(now);
        }
        self.tokens = (self.tokens - delta).min(self.capacity().0);
    }

    fn is_full(&self) -> bool {
        let (tokens, requests) = self.capacity();
        self.tokens >= tokens && self.requests >= requests
    }
}

/// A scope: a tenant's own (`rule: None`) or one of its model rules.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Scope {
    tenant: Tenant,
    rule: Option<Arc<str>>,
}

/// What a replica took from one scope's buckets (negative tokens: given back); shared with
/// the other replicas under `--replica-sync`.
#[derive(Debug, Clone, PartialEq)]
pub struct Charge {
    pub tenant: Tenant,
    /// The model rule's id; `None` for the tenant's own scope.
    pub rule: Option<String>,
    pub tokens: f64,
    pub requests: f64,
}

/// Where this replica's charges go (the replica sync), once set.
pub type Sink = Box<dyn Fn(Charge) + Send + Sync>;

struct Shared(std::sync::OnceLock<Sink>);

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Shared({})", self.0.get().is_some())
    }
}

/// The limiter: the checked policy and every scope's buckets.
#[derive(Debug)]
pub struct RateLimiter {
    shared: Shared,
    policy: RateLimitPolicy,
    shards: [Mutex<Shard>; SHARDS],
    /// New scopes between sweeps ([`MAX_IDLE_SCOPES`]).
    sweep_every: usize,
    hasher: std::collections::hash_map::RandomState,
}

/// A request's reservation: settled from its usage, or, dropped unsettled, all its tokens
/// given back.
#[derive(Debug)]
pub struct Reservation {
    limiter: Arc<RateLimiter>,
    scopes: Vec<Scope>,
    reserved: u64,
    settled: bool,
}

impl RateLimiter {
    pub fn new(policy: RateLimitPolicy) -> Self {
        Self {
            shared: Shared(std::sync::OnceLock::new()),
            policy,
            shards: std::array::from_fn(|_| Mutex::default()),
            sweep_every: MAX_IDLE_SCOPES,
            hasher: Default::default(),
        }
    }

    fn shard(&self, tenant: &Tenant) -> &Mutex<Shard> {
        &self.shards[self.hasher.hash_one(tenant) as usize % SHARDS]
    }

    /// Reserves `tokens` and one request for `tenant` on `model` at `now`.
    pub fn reserve(
        self: &Arc<Self>,
        tenant: &Tenant,
        model: Option<&str>,
        tokens: u64,
        now: Instant,
    ) -> Result<Reservation, Refused> {
        let policy = self.policy.policy_for(tenant.as_str());
        let mut scopes = vec![(
            Scope {
                tenant: tenant.clone(),
                rule: None,
            },
            policy.limits(),
        )];
        if let Some(rule) = model.and_then(|m| policy.rule_for(m)) {
            let scope = Scope {
                tenant: tenant.clone(),
                rule: Some(rule.rule_id.as_str().into()),
            };
            scopes.push((scope, rule.limits));
        }
        let n = tokens as f64;
        let mut guard = self.shard(tenant).lock().expect("not poisoned");
        if guard.scopes.len() >= guard.sweep_at.max(self.sweep_every) {
            guard.scopes.retain(|_, b| {
                b.refill(now);
                !b.is_full()
            });
            guard.sweep_at = guard.scopes.len() + self.sweep_every;
        }
        let shard = &mut guard.scopes;
        let mut refusal = None;
        for (scope, limits) in &scopes {
            let b = shard
                .entry(scope.clone())
                .or_insert_with(|| Bucket::new(*limits, now));
            b.refill(now);
            refusal = match (refusal, b.check(n)) {
                (Some(Refused::OverCapacity), _) | (_, Err(Refused::OverCapacity)) => {
                    Some(Refused::OverCapacity)
                }
                (Some(Refused::Wait(a)), Err(Refused::Wait(b))) => Some(Refused::Wait(a.max(b))),
                (r, Ok(())) => r,
                (None, Err(e)) => Some(e),
            };
        }
        if let Some(refused) = refusal {
            return Err(refused);
        }
        for (scope, _) in &scopes {
            shard.get_mut(scope).expect("inserted above").take(n);
        }
        drop(guard);
        let scopes: Vec<Scope> = scopes.into_iter().map(|(s, _)| s).collect();
        self.tell(&scopes, n, 1.0);
        Ok(Reservation {
            limiter: self.clone(),
            scopes,
            reserved: tokens,
            settled: false,
        })
    }

    /// The buckets of `tenant`'s scope (`rule: None`) or rule, refilled to `now` (tests and
    /// the admin's eyes).
    pub fn bucket(&self, tenant: &Tenant, rule: Option<&str>, now: Instant) -> Option<Bucket> {
        let scope = Scope {
            tenant: tenant.clone(),
            rule: rule.map(Into::into),
        };
        let shard = self.shard(tenant).lock().expect("not poisoned");
        let mut b = shard.scopes.get(&scope)?.clone();
        b.refill(now);
        Some(b)
    }

    fn settle(&self, scopes: &[Scope], delta: f64, now: Instant) {
        let Some(first) = scopes.first() else {
            return;
        };
        {
            let mut shard = self.shard(&first.tenant).lock().expect("not poisoned");
            for scope in scopes {
                if let Some(b) = shard.scopes.get_mut(scope) {
                    b.settle(delta, now);
                }
            }
        }
        self.tell(scopes, delta, 0.0);
    }

    /// Sends this replica's charges to `sink` from now on (the replica sync).
    pub fn share(&self, sink: Sink) {
        let _ = self.shared.0.set(sink);
    }

    fn tell(&self, scopes: &[Scope], tokens: f64, requests: f64) {
        let Some(sink) = self.shared.0.get() else {
            return;
        };
        for s in scopes {
            sink(Charge {
                tenant: s.tenant.clone(),
                rule: s.rule.as_deref().map(str::to_owned),
                tokens,
                requests,
            });
        }
    }

    /// Takes a peer replica's `charge` from this replica's buckets too (without a check: a
    /// bucket may go below zero). A rule this replica's file does not have is ignored.
    pub fn charge(&self, charge: &Charge, now: Instant) {
        let policy = self.policy.policy_for(charge.tenant.as_str());
        let limits = match &charge.rule {
            None => policy.limits(),
            Some(id) => match policy.rule_by_id(id) {
                Some(rule) => rule.limits,
                None => return,
            },
        };
        let scope = Scope {
            tenant: charge.tenant.clone(),
            rule: charge.rule.as_deref().map(Into::into),
        };
        let mut shard = self.shard(&charge.tenant).lock().expect("not poisoned");
        let b = (shard.scopes)
            .entry(scope)
            .or_insert_with(|| Bucket::new(limits, now));
        b.refill(now);
        b.settle(charge.tokens, now);
        b.requests -= charge.requests;
    }
}

impl Reservation {
    /// The tokens reserved.
    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    /// Replaces the estimate by what the request used (`used` tokens in all).
    pub fn settle(mut self, used: u64, now: Instant) {
        self.settled = true;
        let delta = used as f64 - self.reserved as f64;
        self.limiter.settle(&self.scopes, delta, now);
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.settled {
            // A refund: the clock is not read.
            let delta = -(self.reserved as f64);
            let now = Instant::now();
            self.limiter.settle(&self.scopes, delta, now);
        }
    }
}

#[cfg(test)]
mod tests;
