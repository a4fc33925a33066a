//! Virtual token counters (VTC): fair sharing between tenants inside one policy class.
//!
//! Each tenant has a counter `c_u`, in weighted tokens per unit of tenant weight:
//!
//! - at dispatch, the request's cost (its uncached prompt tokens, input weight 1) is charged:
//!   `c_u += cost / weight_u`;
//! - later the caller reports output tokens with [`DrrQueue::charge`](super::DrrQueue::charge):
//!   `c_u += output_weight * tokens / weight_u` (`output_weight` 2 by default, as in the VTC
//!   paper: a decoded token costs the engine more than a prefilled one).
//!
//! A tenant is *backlogged* in a class while it has requests queued there (in any tier). The
//! class's *virtual time* is `V = max(floor, min { c_u : u backlogged })`, where `floor` is
//! raised, each time a tenant stops being backlogged, to the new minimum over the others, or
//! to that tenant's own counter when nobody else is backlogged. `V` never decreases.
//!
//! - **Lift.** A tenant that becomes backlogged (its first queued request in the class) starts
//!   at `c_u = max(c_u, V)`; a tenant the queue has never seen (or has forgotten) at `V`. An
//!   idle tenant charged with output tokens is lifted the same way first. So nobody banks
//!   credit while idle, and a newcomer is not favoured over tenants already waiting.
//! - **Forgetting.** An idle tenant whose counter is at most `floor` is dropped: lifting would
//!   give it `V` anyway, so the map holds only tenants that are backlogged or ahead of `V`.

use std::collections::HashMap;
use std::sync::Arc;

/// A tenant's counter and its queued requests in the class.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Account {
    counter: f64,
    queued: usize,
}

/// One class's counters.
#[derive(Debug, Default)]
pub(super) struct Counters {
    tenants: HashMap<Arc<str>, Account>,
    floor: f64,
}

impl Counters {
    /// The class's virtual time `V` (see the module docs).
    pub fn virtual_time(&self) -> f64 {
        self.min_backlogged()
            .map_or(self.floor, |m| m.max(self.floor))
    }

    /// The smallest counter of a backlogged tenant.
    fn min_backlogged(&self) -> Option<f64> {
        self.tenants
            .values()
            .filter(|a| a.queued > 0)
            .map(|a| a.counter)
            .reduce(f64::min)
    }

    /// The counter `tenant` has, or would start at if it became backlogged now.
    pub fn counter(&self, tenant: &str) -> f64 {
        match self.tenants.get(tenant) {
            Some(a) if a.queued > 0 => a.counter,
            Some(a) => a.counter.max(self.virtual_time()),
            None => self.virtual_time(),
        }
    }

    /// The counter of a backlogged `tenant` (for ordering heads).
    pub fn backlogged(&self, tenant: &str) -> f64 {
        self.tenants.get(tenant).map_or(self.floor, |a| a.counter)
    }

    /// `tenant` queues one more request: lifted if it was not backlogged.
    pub fn enter(&mut self, tenant: &Arc<str>) {
        let lifted = self.counter(tenant);
        let account = self.tenants.entry(tenant.clone()).or_insert(Account {
            counter: lifted,
            queued: 0,
        });
        account.counter = lifted;
        account.queued += 1;
    }

    /// One of `tenant`'s queued requests leaves, charged `served` (0 when it was removed
    /// unserved).
    pub fn leave(&mut self, tenant: &str, served: f64) {
        let Some(account) = self.tenants.get_mut(tenant) else {
            debug_assert!(false, "a queued tenant has an account");
            return;
        };
        account.counter += served;
        account.queued -= 1;
        if account.queued > 0 {
            return;
        }
        let own = account.counter;
        let others = self.min_backlogged();
        self.floor = self.floor.max(others.unwrap_or(own));
        let floor = self.floor;
        self.tenants
            .retain(|_, a| a.queued > 0 || a.counter > floor);
    }

    /// `tenant` was served `amount` more (output tokens, already weighted).
    pub fn charge(&mut self, tenant: &str, amount: f64) {
        if let Some(a) = self.tenants.get_mut(tenant).filter(|a| a.queued > 0) {
            a.counter += amount;
            return;
        }
        let counter = self.counter(tenant) + amount;
        self.tenants
            .insert(Arc::from(tenant), Account { counter, queued: 0 });
    }

    /// Tenants the class remembers (backlogged or ahead of the virtual time).
    pub fn known(&self) -> usize {
        self.tenants.len()
    }
}
