//! One lane of the queue: the requests of one policy class in one priority tier, by tenant.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::vtc::Counters;
use super::Key;

/// A queued request.
#[derive(Debug)]
pub(super) struct Entry<T> {
    pub item: T,
    /// Uncached tokens, a snapshot taken at push.
    pub cost: u64,
    pub tenant: Arc<str>,
}

#[derive(Debug)]
pub(super) struct Lane<T> {
    items: BTreeMap<Key, Entry<T>>,
    /// Each tenant's keys in this lane; a tenant with none has no entry.
    tenants: BTreeMap<Arc<str>, BTreeSet<Key>>,
    /// The DRR deficit of the class in this tier.
    pub deficit: u64,
}

impl<T> Default for Lane<T> {
    fn default() -> Self {
        Self {
            items: BTreeMap::new(),
            tenants: BTreeMap::new(),
            deficit: 0,
        }
    }
}

impl<T> Lane<T> {
    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn insert(&mut self, key: Key, entry: Entry<T>) {
        self.tenants
            .entry(entry.tenant.clone())
            .or_default()
            .insert(key);
        self.items.insert(key, entry);
    }

    /// Takes `key` out; an emptied lane's deficit resets to zero.
    pub fn take(&mut self, key: &Key) -> Option<Entry<T>> {
        let entry = self.items.remove(key)?;
        if let Some(keys) = self.tenants.get_mut(&entry.tenant) {
            keys.remove(key);
            if keys.is_empty() {
                self.tenants.remove(&entry.tenant);
            }
        }
        if self.items.is_empty() {
            self.deficit = 0;
        }
        Some(entry)
    }

    /// The head: the first request (by key) of the tenant with the lowest counter, the
    /// earlier arrival among equal counters. With one tenant, the lane's first key.
    /// O(tenants in the lane).
    pub fn head(&self, counters: &Counters) -> Option<(Key, &Entry<T>)> {
        let key = if self.tenants.len() <= 1 {
            *self.items.first_key_value()?.0
        } else {
            self.tenants
                .iter()
                .filter_map(|(tenant, keys)| keys.first().map(|k| (tenant, *k)))
                .min_by(|(ta, ka), (tb, kb)| {
                    counters
                        .backlogged(ta)
                        .total_cmp(&counters.backlogged(tb))
                        .then(ka.1.cmp(&kb.1))
                })?
                .1
        };
        self.items.get(&key).map(|e| (key, e))
    }
}
