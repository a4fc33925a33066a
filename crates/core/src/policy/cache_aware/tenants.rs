//! The tenants of a `cache_aware` tree: (worker, dp_rank) pairs mapped onto small indices.

use std::collections::HashMap;
use std::mem::size_of;

use kvroute_protocol::WorkerId;

use super::tree::Tenant;

/// Maps each (worker, dp_rank) the tree has seen onto a [`Tenant`] index; indices of
/// forgotten workers are reused.
#[derive(Debug, Default)]
pub(super) struct Tenants {
    by_worker: HashMap<WorkerId, Vec<(Option<u32>, Tenant)>>,
    free: Vec<Tenant>,
    next: Tenant,
}

impl Tenants {
    /// The index of (`worker`, `dp_rank`), if the tree has seen it.
    pub fn get(&self, worker: &WorkerId, dp_rank: Option<u32>) -> Option<Tenant> {
        self.by_worker
            .get(worker)?
            .iter()
            .find(|(r, _)| *r == dp_rank)
            .map(|&(_, t)| t)
    }

    /// The index of (`worker`, `dp_rank`), assigned now if it has none.
    pub fn get_or_add(&mut self, worker: &WorkerId, dp_rank: Option<u32>) -> Tenant {
        if let Some(t) = self.get(worker, dp_rank) {
            return t;
        }
        let t = self.free.pop().unwrap_or_else(|| {
            self.next += 1;
            self.next - 1
        });
        self.by_worker
            .entry(worker.clone())
            .or_default()
            .push((dp_rank, t));
        t
    }

    /// Every (worker, dp_rank) with its index.
    pub fn iter(&self) -> impl Iterator<Item = (&WorkerId, Option<u32>, Tenant)> + '_ {
        self.by_worker
            .iter()
            .flat_map(|(w, ranks)| ranks.iter().map(move |&(r, t)| (w, r, t)))
    }

    /// One more than the largest index in use (the length of a per-tenant table).
    pub fn bound(&self) -> usize {
        self.next as usize
    }

    /// Forgets every rank of `worker`, returning their indices (to be emptied in the tree
    /// before they are reused, which [`Tenants::recycle`] then allows).
    pub fn remove_worker(&mut self, worker: &WorkerId) -> Vec<Tenant> {
        self.by_worker
            .remove(worker)
            .map(|ranks| ranks.into_iter().map(|(_, t)| t).collect())
            .unwrap_or_default()
    }

    /// Makes `tenant`'s index available again.
    pub fn recycle(&mut self, tenant: Tenant) {
        self.free.push(tenant);
    }

    /// An estimate of the bytes used (the map's table and each worker's rank list).
    pub fn memory_bytes(&self) -> usize {
        let entry = size_of::<(WorkerId, Vec<(Option<u32>, Tenant)>)>() + 1;
        self.by_worker.capacity() * entry
            + self
                .by_worker
                .values()
                .map(|v| v.capacity() * size_of::<(Option<u32>, Tenant)>())
                .sum::<usize>()
            + self.free.capacity() * size_of::<Tenant>()
    }
}
