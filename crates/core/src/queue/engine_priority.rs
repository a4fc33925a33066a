//! Engine priorities: the place a request takes in its engine's own queue, for engines that
//! schedule by priority (vLLM's `--scheduling-policy priority`, SGLang's
//! `--enable-priority-scheduling`).
//!
//! The router queue orders requests only until it lets them go. An engine runs what it
//! holds first come, first served, so a light tenant's request let go first still waits
//! behind the flood's requests already queued in the engine, and is the first preempted when
//! the engine's KV cache runs out. With engine priorities each request carries a **level**
//! (lower goes first), decided when it is sent:
//!
//! `level = 2 x tier + over`
//!
//! - `tier`: its priority class (0 the highest: smg's `system`, `interactive`, `default`,
//!   `bulk`; one tier without the priority scheduler);
//! - `over`: 1 when its tenant already has at least its share of the work in flight, 0 when
//!   below. The work in flight is the prompt tokens of the requests sent and not finished;
//!   a tenant's share of it is `weight / (sum of the weights of the tenants with work in
//!   flight, its own included)`, weights as VTC's (1 unless the priority file says).
//!
//! A tenant alone is always at its share: one tenant's requests keep their arrival order.
//! The tokens in flight are tracked by [`InFlight`]; the level is written into the request
//! in the engine's convention by [`EnginePriority::value`].

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::Hash;

/// Which engines' priority field the router writes (`--engine-priority`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EnginePriority {
    /// Nothing written: the request's body goes as it came.
    #[default]
    Off,
    /// vLLM's `priority`: lower first.
    Vllm,
    /// SGLang's `priority`: higher first (its default without
    /// `--schedule-low-priority-values-first`).
    Sglang,
}

impl EnginePriority {
    /// The `priority` field for `level` of `levels` (`2 x tiers`), `None` when off.
    pub fn value(self, level: u32, levels: u32) -> Option<i64> {
        let level = i64::from(level.min(levels.saturating_sub(1)));
        match self {
            EnginePriority::Off => None,
            EnginePriority::Vllm => Some(level),
            EnginePriority::Sglang => Some(i64::from(levels.saturating_sub(1)) - level),
        }
    }
}

/// The level of a request of `tier` whose tenant is `over` its share (see the module docs).
pub fn level(tier: usize, over: bool) -> u32 {
    u32::try_from(tier).unwrap_or(u32::MAX / 2) * 2 + u32::from(over)
}

#[derive(Debug, Clone, Copy)]
struct Share {
    tokens: u64,
    weight: f64,
}

/// The prompt tokens in flight, per tenant.
#[derive(Debug)]
pub struct InFlight<K> {
    tenants: HashMap<K, Share>,
    total: u64,
    /// The sum of the weights of the tenants in `tenants`.
    weights: f64,
}

impl<K> Default for InFlight<K> {
    fn default() -> Self {
        Self {
            tenants: HashMap::new(),
            total: 0,
            weights: 0.0,
        }
    }
}

impl<K: Hash + Eq> InFlight<K> {
    /// Whether `tenant` (of `weight`) has at least its share of the tokens in flight.
    pub fn over<Q>(&self, tenant: &Q, weight: f64) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let Some(own) = self.tenants.get(tenant) else {
            return false;
        };
        let share = self.total as f64 * weight / self.weights.max(f64::MIN_POSITIVE);
        own.tokens as f64 >= share
    }

    /// `tenant` (of `weight`) sends a request of `tokens` prompt tokens (at least one: a
    /// router that does not tokenise counts requests).
    pub fn start(&mut self, tenant: K, weight: f64, tokens: u64) {
        let tokens = tokens.max(1);
        let weight = if weight > 0.0 { weight } else { 1.0 };
        let share = self.tenants.entry(tenant).or_insert_with(|| {
            self.weights += weight;
            Share { tokens: 0, weight }
        });
        share.tokens += tokens;
        self.total += tokens;
    }

    /// A request of `tenant` sent with `tokens` ended (answered, failed or dropped).
    pub fn end<Q>(&mut self, tenant: &Q, tokens: u64)
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let tokens = tokens.max(1);
        let Some(share) = self.tenants.get_mut(tenant) else {
            debug_assert!(false, "a request ended that never started");
            return;
        };
        let tokens = tokens.min(share.tokens);
        share.tokens -= tokens;
        self.total -= tokens;
        if share.tokens == 0 {
            let weight = share.weight;
            self.tenants.remove(tenant);
            self.weights = (self.weights - weight).max(0.0);
            if self.tenants.is_empty() {
                self.weights = 0.0;
            }
        }
    }

    /// The tokens in flight.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Tenants with tokens in flight.
    pub fn tenants(&self) -> usize {
        self.tenants.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_below_its_share_goes_first_and_one_alone_keeps_its_order() {
        let mut f = InFlight::default();
        // Alone, a tenant is at its share: everything it sends is on one level.
        assert!(!f.over(&"heavy", 1.0), "nothing in flight yet");
        f.start("heavy", 1.0, 15_000);
        assert!(f.over(&"heavy", 1.0));
        for _ in 0..9 {
            f.start("heavy", 1.0, 15_000);
        }
        // A newcomer is below its share; the heavy tenant is over it.
        assert!(!f.over(&"light", 1.0));
        f.start("light", 1.0, 15_000);
        assert!(!f.over(&"light", 1.0), "15k of 165k is below half");
        assert!(f.over(&"heavy", 1.0));
        // Light's request ends; heavy's end too: nothing is left, and nobody is tracked.
        f.end(&"light", 15_000);
        for _ in 0..10 {
            f.end(&"heavy", 15_000);
        }
        assert_eq!((f.total(), f.tenants()), (0, 0));
        assert!(!f.over(&"heavy", 1.0));
        // Without tokens (a policy that does not tokenise), each request counts as one.
        f.start("a", 1.0, 0);
        f.start("a", 1.0, 0);
        f.start("b", 1.0, 0);
        assert!(f.over(&"a", 1.0) && !f.over(&"b", 1.0));
        f.end(&"a", 0);
        f.end(&"a", 0);
        f.end(&"b", 0);
        assert_eq!((f.total(), f.tenants()), (0, 0));
    }

    #[test]
    fn equal_tenants_are_both_at_their_share_and_weights_split_it() {
        let mut f = InFlight::default();
        f.start(1u32, 1.0, 100);
        f.start(2u32, 1.0, 100);
        assert!(f.over(&1, 1.0) && f.over(&2, 1.0));
        // Tenant 2 weighs 3: its share is 3/4 of 200 = 150, tenant 1's 50.
        let mut f = InFlight::default();
        f.start(1u32, 1.0, 100);
        f.start(2u32, 3.0, 100);
        assert!(f.over(&1, 1.0));
        assert!(!f.over(&2, 3.0));
        // A weight of 0 or less counts as 1.
        f.start(3u32, 0.0, 100);
        assert!(
            f.over(&3, 1.0),
            "100 of 300 with weights 1+3+1: its share is 60"
        );
    }

    #[test]
    fn levels_put_the_tier_first_and_each_engine_reads_them_its_way() {
        assert_eq!(level(0, false), 0);
        assert_eq!(level(0, true), 1);
        assert_eq!(level(2, false), 4);
        assert!(level(1, true) < level(2, false), "the tier comes first");
        let levels = 8;
        assert_eq!(EnginePriority::Off.value(3, levels), None);
        assert_eq!(EnginePriority::Vllm.value(3, levels), Some(3));
        assert_eq!(EnginePriority::Sglang.value(3, levels), Some(4));
        // SGLang's higher-first keeps the order: level 0 is the highest value.
        assert!(EnginePriority::Sglang.value(0, levels) > EnginePriority::Sglang.value(1, levels));
        // A level past the last is the last.
        assert_eq!(EnginePriority::Vllm.value(99, levels), Some(7));
    }
}
