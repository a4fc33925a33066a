//! `llm_d`: llm-d's default scoring profile (skeleton; being written).

use rand::RngCore;

use super::load::least_loaded;
use super::{Policy, PolicyKind};
use crate::{Candidate, Decision, RouteRequest};

/// `llm_d`'s scorer weights and prefix-cache parameters (llm-d's defaults).
#[derive(Debug, Clone, PartialEq)]
pub struct LlmDConfig {
    pub prefix_weight: f64,
    pub queue_weight: f64,
    pub kv_weight: f64,
    /// Tokens per block of the approximate prefix cache (at least 64).
    pub block_size: usize,
}

impl Default for LlmDConfig {
    fn default() -> Self {
        Self {
            prefix_weight: 3.0,
            queue_weight: 2.0,
            kv_weight: 2.0,
            block_size: 64,
        }
    }
}

/// The `llm_d` policy.
#[derive(Debug)]
pub struct LlmD {
    config: LlmDConfig,
}

impl LlmD {
    pub fn new(config: LlmDConfig) -> Self {
        Self { config }
    }
}

impl Policy for LlmD {
    fn kind(&self) -> PolicyKind {
        PolicyKind::LlmD
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
