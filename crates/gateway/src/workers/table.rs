//! The routing table readers take as a snapshot, and how the worker set rebuilds it.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use kvroute_core::policy::sample_size;
use kvroute_core::{build_policy, Policy};
use kvroute_protocol::ModelId;
use serde::Serialize;

use super::sampling::Sampling;
use super::{lock, Worker, WorkerSet};
use crate::config::WorkerSource;
use crate::error::GatewayError;
use crate::metrics::SourceLabels;

/// The workers serving one model, and that model's policy.
#[derive(Debug)]
pub struct Pool {
    pub model: ModelId,
    pub workers: Vec<Arc<Worker>>,
    pub policy: Arc<dyn Policy>,
    /// With `--router-sample-ranks`: what a sampled kv_aware decision reads (`None` for a
    /// pool narrowed for one request, which every rank's decision costs).
    pub sampling: Option<Arc<Sampling>>,
    /// The shortest context a worker of the pool says it takes ([`Worker::max_model_len`];
    /// `None` when none says): a request needing no more never has a worker filtered for it.
    pub shortest_context: Option<u64>,
}

impl Pool {
    /// A pool without sampling.
    pub fn new(model: ModelId, workers: Vec<Arc<Worker>>, policy: Arc<dyn Policy>) -> Self {
        let shortest_context = workers.iter().filter_map(|w| w.max_model_len()).min();
        Self {
            model,
            workers,
            policy,
            sampling: None,
            shortest_context,
        }
    }
}

/// One half of a disaggregated request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Half {
    Prefill,
    Decode,
}

/// Model -> pool, as of the last change.
#[derive(Debug, Default)]
pub struct RoutingTable {
    pools: BTreeMap<ModelId, Pool>,
    /// With disaggregation: each model's prefill and decode workers, with their policies.
    prefill: BTreeMap<ModelId, Pool>,
    decode: BTreeMap<ModelId, Pool>,
    /// The union of the workers' `/v1/models` entries, one per model.
    cards: Vec<serde_json::Value>,
    /// Whether every worker had been probed when the table was built.
    complete: bool,
    /// Whether there was no worker at all (discovery has found none yet).
    empty: bool,
    /// The shortest context a worker says it takes (`None`: none says), for
    /// [`Self::shortest_context`].
    shortest_context: Option<u64>,
}

impl RoutingTable {
    /// The pool for the request's `model`: that model's, or the only one when the request
    /// names none.
    pub fn resolve(&self, model: Option<&str>) -> Result<&Pool, GatewayError> {
        self.resolve_in(&self.pools, model)
    }

    /// The prefill or decode pool of the request's model (disaggregation).
    pub fn resolve_half(&self, half: Half, model: Option<&str>) -> Result<&Pool, GatewayError> {
        let pools = match half {
            Half::Prefill => &self.prefill,
            Half::Decode => &self.decode,
        };
        let pool = self.resolve(model)?;
        pools
            .get(&pool.model)
            .ok_or(GatewayError::NoEndpoint(match half {
                Half::Prefill => "no prefill worker serves this model",
                Half::Decode => "no decode worker serves this model",
            }))
    }

    fn resolve_in<'a>(
        &'a self,
        pools: &'a BTreeMap<ModelId, Pool>,
        model: Option<&str>,
    ) -> Result<&'a Pool, GatewayError> {
        match model {
            Some(name) => pools.get(name).ok_or_else(|| {
                if self.empty {
                    GatewayError::NoEndpoint("no worker is known yet")
                } else if self.complete {
                    GatewayError::UnknownModel(name.to_owned())
                } else {
                    GatewayError::NoEndpoint("workers are still being probed for their models")
                }
            }),
            None => {
                let mut pools = pools.values();
                match (pools.next(), pools.next()) {
                    (Some(only), None) => Ok(only),
                    (None, _) => Err(GatewayError::NoEndpoint("no worker serves any model yet")),
                    (Some(_), Some(_)) => Err(GatewayError::ModelRequired {
                        models: self
                            .pools
                            .keys()
                            .map(ModelId::as_str)
                            .collect::<Vec<_>>()
                            .join(", "),
                    }),
                }
            }
        }
    }

    /// Every pool with its role: each model's own (`None`), and with disaggregation its
    /// prefill and decode pools.
    pub fn every_pool(&self) -> impl Iterator<Item = (Option<Half>, &Pool)> {
        let own = self.pools.values().map(|p| (None, p));
        let prefill = self.prefill.values().map(|p| (Some(Half::Prefill), p));
        let decode = self.decode.values().map(|p| (Some(Half::Decode), p));
        own.chain(prefill).chain(decode)
    }

    /// The models served.
    pub fn models(&self) -> impl Iterator<Item = &str> {
        self.pools.keys().map(ModelId::as_str)
    }

    pub fn model_cards(&self) -> &[serde_json::Value] {
        &self.cards
    }

    /// The shortest context a worker says it takes (`None`: none says): a request's body
    /// shorter than it need not be counted for the context rule (`routing::tokens_for`).
    pub fn shortest_context(&self) -> Option<u64> {
        self.shortest_context
    }
}

/// A worker as `GET /workers` shows it.
#[derive(Debug, Serialize)]
pub struct WorkerStatus {
    pub id: String,
    pub url: String,
    pub models: Vec<String>,
    /// The longest context its engine takes (the `max_model_len` its `/v1/models` lists).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<u64>,
    pub healthy: bool,
    /// The circuit breaker: closed, open or half_open.
    pub circuit: &'static str,
    pub probed: bool,
    /// Why its last probe or health check failed (e.g. "TLS: invalid peer certificate:
    /// UnknownIssuer"), until one passes.
    pub last_error: Option<String>,
    pub in_flight: u64,
    pub ranks: Vec<RankStatus>,
    /// Where it came from: static, config, admin, kubernetes, file or epp.
    pub source: &'static str,
    /// Its pod (`namespace/name`), when discovered in Kubernetes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
}

/// A rank as `GET /workers` shows it.
#[derive(Debug, Serialize)]
pub struct RankStatus {
    pub dp_rank: Option<u32>,
    pub in_flight: u64,
    pub active_prefill_tokens: u64,
    pub active_decode_blocks: u64,
}

impl WorkerSet {
    /// A pool of the table, with sampling when it is on and the pool's policy is kv_aware.
    fn pool(&self, model: ModelId, workers: Vec<Arc<Worker>>, policy: Arc<dyn Policy>) -> Pool {
        let ranks = workers.iter().map(|w| w.ranks.len()).sum();
        let n = sample_size(self.sample_ranks, ranks);
        let sampling = (self.firsts.as_ref())
            .filter(|_| policy.kv_aware().is_some() && n > 0)
            .map(|firsts| Arc::new(Sampling::new(&workers, n, firsts.clone())));
        Pool {
            sampling,
            ..Pool::new(model, workers, policy)
        }
    }

    /// Publishes a new table from the workers as they are now, and the readiness with it.
    pub(super) fn rebuild(&self) {
        let _one_at_a_time = lock(&self.rebuilds);
        let workers = self.workers.load_full();
        let mut members: BTreeMap<ModelId, Vec<Arc<Worker>>> = BTreeMap::new();
        let mut cards: BTreeMap<ModelId, serde_json::Value> = BTreeMap::new();
        for w in workers.iter() {
            for m in w.model_ids() {
                members.entry(m).or_default().push(w.clone());
            }
            if let Some(m) = &w.configured_model {
                cards
                    .entry(m.clone())
                    .or_insert_with(|| default_card(m.as_str()));
            }
            for (m, card) in lock(&w.models).iter() {
                cards.entry(m.clone()).or_insert_with(|| card.clone());
            }
        }
        let mut policies = lock(&self.policies);
        let pools: BTreeMap<ModelId, Pool> = members
            .into_iter()
            .map(|(model, workers)| {
                let policy = policies
                    .entry(model.clone())
                    .or_insert_with(|| build_policy(self.policy, &self.policy_config).into())
                    .clone();
                let pool = self.pool(model.clone(), workers, policy);
                (model, pool)
            })
            .collect();
        drop(policies);
        let (mut prefill, mut decode) = (BTreeMap::new(), BTreeMap::new());
        if let Some(pd) = &self.pd {
            let mut pd_policies = lock(&self.pd_policies);
            for (model, pool) in &pools {
                for (half, kind, config, out) in [
                    (
                        Half::Prefill,
                        pd.prefill_policy,
                        &pd.prefill_config,
                        &mut prefill,
                    ),
                    (
                        Half::Decode,
                        pd.decode_policy,
                        &pd.decode_config,
                        &mut decode,
                    ),
                ] {
                    let members: Vec<Arc<Worker>> = pool
                        .workers
                        .iter()
                        .filter(|w| match half {
                            Half::Prefill => w.role.prefills(),
                            Half::Decode => w.role.decodes(),
                        })
                        .cloned()
                        .collect();
                    if members.is_empty() {
                        continue;
                    }
                    let policy = pd_policies
                        .entry((model.clone(), half))
                        .or_insert_with(|| build_policy(kind, config).into())
                        .clone();
                    out.insert(model.clone(), self.pool(model.clone(), members, policy));
                }
            }
        }
        let complete = workers.iter().all(|w| w.probed.load(Ordering::Relaxed));
        let ready = complete
            && !pools.is_empty()
            && pools
                .values()
                .all(|p| p.workers.iter().any(|w| w.is_healthy()));
        self.table.store(Arc::new(RoutingTable {
            pools,
            prefill,
            decode,
            cards: cards.into_values().collect(),
            complete,
            empty: workers.is_empty(),
            shortest_context: workers.iter().filter_map(|w| w.max_model_len()).min(),
        }));
        let mut by_source = [0i64; WorkerSource::NAMES.len()];
        for w in workers.iter() {
            let name = w.spec.source.name();
            if let Some(i) = WorkerSource::NAMES.iter().position(|n| *n == name) {
                by_source[i] += 1;
            }
        }
        for (source, n) in WorkerSource::NAMES.into_iter().zip(by_source) {
            self.metrics
                .discovery
                .workers
                .get_or_create(&SourceLabels { source })
                .set(n);
        }
        self.ready.send_replace(ready);
    }
}

fn default_card(model: &str) -> serde_json::Value {
    serde_json::json!({"id": model, "object": "model", "created": 0, "owned_by": "kvroute"})
}
