//! Defaults and validation: `Args` into `Settings`, once, at start.

use std::num::NonZeroU32;
use std::time::Duration;

use kvroute_core::affinity::AffinityMode;
use kvroute_core::eligibility::BusyThresholds;
use kvroute_core::queue::{PolicyClass, QueueOrder};
use kvroute_core::{
    AssignmentMode, CacheAwareConfig, KvAwareConfig, LlmDConfig, PolicyConfig, PolicyKind,
};

use super::*;
use crate::auth::Secret;

/// The most data-parallel ranks one worker may have (each is a routing candidate).
const MAX_DP_SIZE: u32 = 1024;

impl Args {
    /// Applies the defaults and validates. Each section is validated by its own helper, in
    /// the order below (which fixes which error a start with several mistakes reports).
    pub fn into_settings(mut self) -> Result<Settings, ConfigError> {
        let discovery = self.discovery_settings()?;
        let epp = self.take_epp()?;
        let workers = self.take_workers()?;
        super::epp::needs_endpoints(epp.as_ref(), !workers.is_empty() || discovery.any())?;
        let prometheus_port =
            super::epp::metrics_port(self.metrics_port, self.prometheus_port, epp.is_some())?;
        let load_factor = self.prefix_hash_load_factor()?;
        let max_payload_size =
            positive("max_payload_size", self.max_payload_size, 512 * 1024 * 1024)?;
        let request_timeout_secs =
            positive("request_timeout_secs", self.request_timeout_secs, 1800)?;
        // The picker is dialled by the gateway and probed by the kubelet from other hosts, and
        // llm-d's Deployment gives no address: in EPP mode kvroute listens on every interface.
        let default_host = if epp.is_some() {
            "0.0.0.0"
        } else {
            "127.0.0.1"
        };
        let host = self.host.take().unwrap_or_else(|| default_host.to_owned());
        let block_size = positive("block_size", self.block_size, 16)?;
        let kv_aware = self.kv_aware.kv_aware_config()?;
        let cache_aware = self.cache_aware_config()?;
        let busy = self.busy_thresholds()?;
        let llm_d = self.llm_d_config(block_size)?;
        let health = self.health_settings(&discovery, epp.as_ref())?;
        let retry = self.retry_settings()?;
        let migration = self.migration_settings()?;
        let circuit = self.circuit_settings()?;
        let policy_config = self.policy_config(load_factor, kv_aware, cache_aware, llm_d)?;
        let discovers_halves = discovery
            .kubernetes
            .as_ref()
            .is_some_and(|k| k.selectors.iter().any(|s| s.role != WorkerRole::Both));
        let pd_on = self.pd_disaggregation
            || discovers_halves
            || workers.iter().any(|w| w.role != WorkerRole::Both);
        super::epp::refuse_pd(epp.as_ref(), pd_on)?;
        super::epp::refuse_engine_priority(epp.as_ref(), self.engine_priority)?;
        let pd = self.pd_settings(pd_on, &workers, &policy_config)?;
        let policy = self.policy.unwrap_or(PolicyKind::KvAware);
        let pd_policies = pd
            .iter()
            .flat_map(|pd| [pd.prefill_policy, pd.decode_policy]);
        let scrapes_per_sec =
            scrape_budget(self.metrics_scrapes_per_sec, pd_policies.chain([policy]));
        Ok(Settings {
            metrics_compat: super::MetricsCompat::new(
                &self.metrics_compat,
                self.metrics_prefix.as_deref(),
            )?,
            prometheus_host: self.prometheus_host.take().unwrap_or_else(|| host.clone()),
            host,
            port: self.port.unwrap_or(30000),
            prometheus_port,
            workers,
            policy,
            policy_config,
            max_payload_size,
            request_timeout: Duration::from_secs(request_timeout_secs),
            log_level: self.log_level.unwrap_or(LogLevel::Info),
            log_json: self.log_json,
            routing_key_headers: super::service::routing_key_headers(&self.routing_key_headers)?,
            trace: super::service::trace_settings(
                self.otlp_traces_endpoint.as_deref(),
                self.enable_trace,
                self.otlp_sampling_ratio,
            )?,
            block_size,
            track_output_blocks: self.kv_aware.router_track_output_blocks,
            kv_events: if self.no_router_kv_events {
                KvEventsMode::Approximate
            } else {
                KvEventsMode::Events
            },
            router_ttl: Duration::from_secs(self.router_ttl_secs.unwrap_or(120)),
            max_indexed_blocks: max_indexed_blocks(self.router_max_indexed_blocks)?,
            event_threads: positive("router_event_threads", self.router_event_threads, 1)?,
            sample_ranks: self.router_sample_ranks,
            metrics_refresh: Duration::from_millis(self.metrics_refresh_ms.unwrap_or(50).max(1)),
            metrics_scrapes_per_sec: scrapes_per_sec,
            busy,
            health_check_port: self.health_check_port,
            overload: self.overload_protection()?,
            slo_shed: self.slo.shed(self.policy.unwrap_or(PolicyKind::KvAware))?,
            admin_api_key: self.admin_api_key.take().and_then(Secret::new),
            client_api_key: self.client_api_key.take().and_then(Secret::new),
            tenancy: self.take_tenancy()?,
            rate_limits: self.take_rate_limits()?,
            tenant_metric_top_n: (self.priority_scheduler_tenant_metric_top_n)
                .unwrap_or(crate::metrics::tenants::DEFAULT_TOP_N),
            api_key: self.take_api_key()?,
            tls: self.take_tls()?,
            health,
            retry,
            circuit,
            migration,
            admission: self.admission()?,
            shutdown_grace: Duration::from_secs(self.shutdown_grace_period_secs.unwrap_or(180)),
            header_read_timeout: Duration::from_secs(positive(
                "header_read_timeout_secs",
                self.header_read_timeout_secs,
                30,
            )?),
            pd,
            replica_sync: self.take_replica_sync()?,
            config_path: self.config.take(),
            cli_workers: CliWorkers::default(),
            queue: self.take_queue_settings(pd_on)?,
            engine_priority: self
                .engine_priority
                .map_or_else(Default::default, Into::into),
            session_affinity: self.session_affinity(),
            tokenizer: self.tokenizer.take(),
            tokenizer_cache_bytes: self.tokenizer_cache_l1_max_memory.unwrap_or(256 << 20),
            discovery,
            timing_model: self.timing_model.unwrap_or_default(),
            epp,
        })
    }

    /// The workers named on the command line (`--worker-urls`, `--prefill`, `--decode`) and in
    /// the config file, validated, with no id twice.
    fn take_workers(&mut self) -> Result<Vec<WorkerSpec>, ConfigError> {
        let mut workers: Vec<WorkerSpec> = std::mem::take(&mut self.worker_urls)
            .into_iter()
            .map(WorkerSpec::url)
            .collect();
        // `--prefill URL [PORT]` occurrences arrive flattened: a number is the bootstrap port
        // of the URL before it, and `none` (the peers' spelling) says it has none.
        let mut port_may_follow = false;
        for value in &self.prefill {
            let port = match value.as_str() {
                "none" | "None" => Some(None),
                v => v.parse::<u16>().ok().map(Some),
            };
            match port {
                Some(port) if port_may_follow => {
                    let w = workers.last_mut().expect("the URL before it");
                    w.bootstrap_port = port;
                    port_may_follow = false;
                }
                Some(_) => {
                    return Err(ConfigError::Invalid {
                        name: "prefill",
                        reason: "expected URL [BOOTSTRAP_PORT|none]",
                    })
                }
                None => {
                    workers.push(WorkerSpec {
                        role: WorkerRole::Prefill,
                        ..WorkerSpec::url(value.clone())
                    });
                    port_may_follow = true;
                }
            }
        }
        for url in &self.decode {
            workers.push(WorkerSpec {
                role: WorkerRole::Decode,
                ..WorkerSpec::url(url.clone())
            });
        }
        workers.extend(std::mem::take(&mut self.workers));
        let workers = workers
            .into_iter()
            .map(WorkerSpec::validated)
            .collect::<Result<Vec<_>, _>>()?;
        let mut seen = std::collections::HashSet::new();
        for w in &workers {
            let id = w.id.as_deref().expect("validated specs have an id");
            if !seen.insert(id) {
                return Err(ConfigError::DuplicateWorker(id.to_owned()));
            }
        }
        Ok(workers)
    }

    /// `--prefix-hash-load-factor`: a positive number.
    fn prefix_hash_load_factor(&self) -> Result<f64, ConfigError> {
        let load_factor = self
            .prefix_hash_load_factor
            .unwrap_or(PolicyConfig::default().prefix_hash_load_factor);
        if !(load_factor.is_finite() && load_factor > 0.0) {
            return Err(ConfigError::Invalid {
                name: "prefix_hash_load_factor",
                reason: "must be a positive number",
            });
        }
        Ok(load_factor)
    }

    /// The `cache_aware` policy's thresholds and tree limits.
    fn cache_aware_config(&self) -> Result<CacheAwareConfig, ConfigError> {
        let ca = CacheAwareConfig::default();
        Ok(CacheAwareConfig {
            cache_threshold: match self.cache_threshold {
                Some(t) if !(0.0..=1.0).contains(&t) => {
                    return Err(ConfigError::Invalid {
                        name: "cache_threshold",
                        reason: "must be between 0 and 1",
                    })
                }
                Some(t) => t,
                None => ca.cache_threshold,
            },
            balance_abs_threshold: self
                .balance_abs_threshold
                .unwrap_or(ca.balance_abs_threshold),
            balance_rel_threshold: weight(
                "balance_rel_threshold",
                self.balance_rel_threshold,
                ca.balance_rel_threshold,
            )?,
            eviction_interval_secs: self
                .eviction_interval_secs
                .unwrap_or(ca.eviction_interval_secs),
            max_tree_size: self.max_tree_size.unwrap_or(ca.max_tree_size),
        })
    }

    /// `--active-*-threshold*`: when a worker counts as busy.
    fn busy_thresholds(&self) -> Result<BusyThresholds, ConfigError> {
        Ok(BusyThresholds {
            active_prefill_tokens: self.active_prefill_tokens_threshold,
            active_prefill_tokens_frac: self
                .active_prefill_tokens_threshold_frac
                .map(|f| weight("active_prefill_tokens_threshold_frac", Some(f), 0.0))
                .transpose()?,
            active_decode_blocks: match self.active_decode_blocks_threshold {
                Some(f) if !(0.0..=1.0).contains(&f) => {
                    return Err(ConfigError::Invalid {
                        name: "active_decode_blocks_threshold",
                        reason: "must be between 0 and 1",
                    })
                }
                other => other,
            },
        })
    }

    /// The `llm_d` policy's weights; its prefix blocks follow `--block-size`.
    fn llm_d_config(&self, block_size: usize) -> Result<LlmDConfig, ConfigError> {
        let ld = LlmDConfig::default();
        Ok(LlmDConfig {
            prefix_weight: weight(
                "llm_d_prefix_weight",
                self.llm_d_prefix_weight,
                ld.prefix_weight,
            )?,
            queue_weight: weight(
                "llm_d_queue_weight",
                self.llm_d_queue_weight,
                ld.queue_weight,
            )?,
            kv_weight: weight("llm_d_kv_weight", self.llm_d_kv_weight, ld.kv_weight)?,
            lora_weight: weight("llm_d_lora_weight", self.llm_d_lora_weight, ld.lora_weight)?,
            block_size: ld.block_size.max(block_size),
            prefix: if self.llm_d_precise_prefix {
                kvroute_core::policy::PrefixSource::Exact { block_size }
            } else {
                kvroute_core::policy::PrefixSource::Approximate
            },
        })
    }

    /// The parameters every policy takes, from its validated sections.
    fn policy_config(
        &self,
        prefix_hash_load_factor: f64,
        kv_aware: KvAwareConfig,
        cache_aware: CacheAwareConfig,
        llm_d: LlmDConfig,
    ) -> Result<PolicyConfig, ConfigError> {
        let defaults = PolicyConfig::default();
        Ok(PolicyConfig {
            prefix_token_count: self
                .prefix_token_count
                .unwrap_or(defaults.prefix_token_count),
            prefix_hash_load_factor,
            max_idle: self
                .max_idle_secs
                .map_or(defaults.max_idle, Duration::from_secs),
            assignment_mode: match self.assignment_mode {
                Some(AssignmentModeArg::Random) => AssignmentMode::Random,
                Some(AssignmentModeArg::MinLoad) | None => AssignmentMode::MinLoad,
            },
            kv_aware,
            cache_aware,
            llm_d,
            least_load: super::service::least_load(
                self.least_load_kv_pressure_weight,
                self.least_load_default_throughput,
                self.least_load_mean_prefill_tokens,
                self.least_load_max_waiting_requests,
            )?,
            ..defaults
        })
    }

    /// Prefill/decode disaggregation, when on: both halves present (unless discovered), and
    /// their policies, which take the same parameters as the main one.
    fn pd_settings(
        &self,
        pd_on: bool,
        workers: &[WorkerSpec],
        policy_config: &PolicyConfig,
    ) -> Result<Option<PdSettings>, ConfigError> {
        if !pd_on {
            return Ok(None);
        }
        let complete =
            workers.iter().any(|w| w.role.prefills()) && workers.iter().any(|w| w.role.decodes());
        if !workers.is_empty() && !complete {
            return Err(ConfigError::Invalid {
                name: "pd_disaggregation",
                reason: "needs at least one prefill and one decode worker",
            });
        }
        let base = policy_config.clone();
        let (decode_policy, decode_config) =
            kvroute_core::policy::decode_policy(self.decode_policy, &base);
        Ok(Some(PdSettings {
            protocol: self.pd_protocol.unwrap_or_default(),
            prefill_policy: self.prefill_policy.unwrap_or(PolicyKind::KvAware),
            prefill_config: base,
            decode_policy,
            decode_config,
            min_uncached_tokens: self.pd_min_uncached_tokens.unwrap_or(0),
        }))
    }

    /// `--api-key`, sent to workers as a bearer header: visible ASCII only.
    fn take_api_key(&mut self) -> Result<Option<Secret>, ConfigError> {
        match self.api_key.take().and_then(Secret::new) {
            Some(key) if key.bearer().is_none() => Err(ConfigError::Invalid {
                name: "api_key",
                reason: "must be visible ASCII (it is sent as a header)",
            }),
            key => Ok(key),
        }
    }

    /// `--session-affinity-ttl-secs` and its mode.
    fn session_affinity(&self) -> Option<(AffinityMode, Duration)> {
        self.session_affinity_ttl_secs.map(|secs| {
            let mode = match self.session_affinity_mode {
                Some(AffinityModeArg::Hard) => AffinityMode::Hard,
                Some(AffinityModeArg::Soft) | None => AffinityMode::Soft,
            };
            (mode, Duration::from_secs(secs))
        })
    }
}

/// A policy weight: a non-negative number, or the default.
pub(super) fn weight(name: &'static str, v: Option<f64>, default: f64) -> Result<f64, ConfigError> {
    match v {
        Some(x) if !(x.is_finite() && x >= 0.0) => Err(ConfigError::Invalid {
            name,
            reason: "must be a non-negative number",
        }),
        Some(x) => Ok(x),
        None => Ok(default),
    }
}

/// Checks a worker base URL (`http[s]://host:port[/prefix]`) and drops a trailing slash.
/// `v` (or `default` when unset), refusing zero.
/// `--router-max-indexed-blocks`: 2^22 by default, at most the index's bound (2^27).
fn max_indexed_blocks(v: Option<usize>) -> Result<usize, ConfigError> {
    match v.unwrap_or(1 << 22).max(1) {
        n if n > kvroute_index::kv_index::MAX_BOUND => Err(ConfigError::Invalid {
            name: "router_max_indexed_blocks",
            reason: "must be at most 134217728 (2^27)",
        }),
        n => Ok(n),
    }
}

pub(super) fn positive<T: PartialEq + Default>(
    name: &'static str,
    v: Option<T>,
    default: T,
) -> Result<T, ConfigError> {
    match v {
        Some(x) if x == T::default() => Err(ConfigError::Invalid {
            name,
            reason: "must be positive",
        }),
        Some(x) => Ok(x),
        None => Ok(default),
    }
}

impl WorkerSpec {
    /// The spec with its URL normalised and its id defaulted to it, if it is valid on its
    /// own (the checks of one worker, whether from the config or `POST /workers`).
    pub fn validated(mut self) -> Result<WorkerSpec, ConfigError> {
        self.url = normalize_url(&self.url)?;
        self.id.get_or_insert_with(|| self.url.clone());
        if self.dp_size == Some(0) {
            return Err(ConfigError::Invalid {
                name: "dp_size",
                reason: "must be at least 1",
            });
        }
        if self.dp_size.is_some_and(|n| n > MAX_DP_SIZE) {
            return Err(ConfigError::Invalid {
                name: "dp_size",
                reason: "must be at most 1024",
            });
        }
        if self
            .dp_start_rank
            .unwrap_or(0)
            .checked_add(self.dp_size.unwrap_or(1))
            .is_none()
        {
            return Err(ConfigError::Invalid {
                name: "dp_start_rank",
                reason: "dp_start_rank + dp_size must fit in 32 bits",
            });
        }
        for endpoint in self.kv_events.iter().chain(&self.kv_events_replay) {
            if !endpoint.starts_with("tcp://") || endpoint.rsplit_once(':').is_none() {
                return Err(ConfigError::Invalid {
                    name: "kv_events",
                    reason: "must be tcp://HOST:PORT",
                });
            }
        }
        Ok(self)
    }
}

fn normalize_url(url: &str) -> Result<String, ConfigError> {
    let bad = |reason| ConfigError::WorkerUrl {
        url: url.to_owned(),
        reason,
    };
    let uri: http::Uri = url.parse().map_err(|_| bad("not a URL"))?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        _ => return Err(bad("must start with http:// or https://")),
    }
    if uri.authority().is_none() {
        return Err(bad("has no host"));
    }
    if uri.query().is_some() {
        return Err(bad("must not have a query"));
    }
    Ok(url.trim_end_matches('/').to_owned())
}

impl Args {
    /// `--router-queue-threshold` and the policy classes it queues by; refused with
    /// prefill/decode disaggregation.
    fn take_queue_settings(&mut self, pd_on: bool) -> Result<Option<QueueSettings>, ConfigError> {
        let sharing = self.take_queue_sharing()?;
        // The priority classes order the router queue: enabled alone, it is on at 1.0 (a rank
        // waits while its prefill exceeds one engine batch).
        let threshold = self
            .router_queue_threshold
            .or(sharing.priority.as_ref().map(|_| 1.0));
        let threshold = match threshold {
            None => return Ok(None),
            // Disaggregated requests bypass the admission queue: refuse rather than
            // ignore the flag.
            Some(_) if pd_on => {
                return Err(ConfigError::Invalid {
                    name: "router_queue_threshold",
                    reason: "not supported with prefill/decode disaggregation yet (nor is --priority-scheduler-enabled)",
                })
            }
            Some(t) if !kvroute_core::queue::valid_threshold(t) => {
                return Err(ConfigError::Invalid {
                    name: "router_queue_threshold",
                    reason: "must be a positive number",
                })
            }
            Some(threshold) => threshold,
        };
        let mut class_thresholds = Vec::new();
        let mut classes: Vec<PolicyClass> = Vec::new();
        for c in std::mem::take(&mut self.policy_classes) {
            if c.active_decode_blocks_threshold
                .is_some_and(|f| !(0.0..=1.0).contains(&f))
            {
                return Err(ConfigError::Invalid {
                    name: "policy_classes.active_decode_blocks_threshold",
                    reason: "must be between 0 and 1",
                });
            }
            class_thresholds.push(BusyThresholds {
                active_prefill_tokens: c.active_prefill_tokens_threshold,
                active_prefill_tokens_frac: c.active_prefill_tokens_threshold_frac,
                active_decode_blocks: c.active_decode_blocks_threshold,
            });
            classes.push(PolicyClass {
                name: c.name,
                weight: c.weight,
                max_queued: c.max_queued,
            });
        }
        if classes.is_empty() {
            classes.push(PolicyClass {
                name: "default".into(),
                weight: 1,
                max_queued: None,
            });
            class_thresholds.push(BusyThresholds::default());
        }
        let order = match self.router_queue_policy {
            Some(QueueOrderArg::Wspt) => QueueOrder::Wspt,
            Some(QueueOrderArg::Fcfs) | None => QueueOrder::Fcfs,
        };
        if let Err(e) = kvroute_core::queue::DrrQueue::<()>::new(classes.clone(), order) {
            tracing::error!(error = %e, "invalid policy classes");
            return Err(ConfigError::Invalid {
                name: "policy_classes",
                reason: "need distinct names and positive weights",
            });
        }
        Ok(Some(QueueSettings {
            threshold,
            order,
            timeout: Duration::from_secs(positive(
                "router_queue_timeout_secs",
                self.router_queue_timeout_secs,
                60,
            )?),
            classes,
            class_thresholds,
            sharing,
        }))
    }
}

/// The fleet's scrapes a second (`--metrics-scrapes-per-sec`, see
/// `engine_metrics::ScrapePace`): 0 for none; unset, [`DEFAULT_SCRAPES_PER_SEC`] unless a
/// policy in force decides on the engines' scraped queues (`llm_d`, `least_load`), whose
/// choices go stale with their readings (BENCHMARKS.md: "Scrapes at a thousand engines").
fn scrape_budget(
    given: Option<u32>,
    mut policies: impl Iterator<Item = PolicyKind>,
) -> Option<NonZeroU32> {
    match given {
        Some(n) => NonZeroU32::new(n),
        None if policies.any(|p| matches!(p, PolicyKind::LlmD | PolicyKind::LeastLoad)) => None,
        None => NonZeroU32::new(DEFAULT_SCRAPES_PER_SEC),
    }
}

/// See [`scrape_budget`]: 1,024 workers are each scraped every 512 ms.
pub const DEFAULT_SCRAPES_PER_SEC: u32 = 2_000;
