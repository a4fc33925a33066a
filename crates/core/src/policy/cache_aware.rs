//! `cache_aware`: SGLang's approximate radix tree over request text (skeleton; being
//! written).

use rand::RngCore;

use super::load::least_loaded;
use super::{Policy, PolicyKind};
use crate::{Candidate, Decision, RouteRequest};

/// `cache_aware`'s parameters (SGLang's flags and defaults).
#[derive(Debug, Clone, PartialEq)]
pub struct CacheAwareConfig {
    pub cache_threshold: f64,
    pub balance_abs_threshold: u64,
    pub balance_rel_threshold: f64,
    pub eviction_interval_secs: u64,
    pub max_tree_size: usize,
}

impl Default for CacheAwareConfig {
    fn default() -> Self {
        Self {
            cache_threshold: 0.3,
            balance_abs_threshold: 64,
            balance_rel_threshold: 1.5,
            eviction_interval_secs: 120,
            max_tree_size: 67_108_864,
        }
    }
}

/// The `cache_aware` policy.
#[derive(Debug)]
pub struct CacheAware {
    config: CacheAwareConfig,
}

impl CacheAware {
    pub fn new(config: CacheAwareConfig) -> Self {
        Self { config }
    }
}

impl Policy for CacheAware {
    fn kind(&self) -> PolicyKind {
        PolicyKind::CacheAware
    }

    fn select(
        &self,
        candidates: &[Candidate<'_>],
        _request: &RouteRequest<'_>,
        rng: &mut dyn RngCore,
    ) -> Option<Decision> {
        let _ = &self.config;
        least_loaded(candidates, rng).map(|index| Decision { index })
    }
}
