//! Defaults and validation: `Args` into `Settings`, once, at start.

use std::time::Duration;

use kvroute_core::affinity::AffinityMode;
use kvroute_core::eligibility::BusyThresholds;
use kvroute_core::queue::{PolicyClass, QueueOrder};
use kvroute_core::{
    AssignmentMode, CacheAwareConfig, KvAwareConfig, LlmDConfig, MemoryCost, PolicyConfig,
    PolicyKind,
};

use super::*;
use crate::auth::Secret;

/// The most data-parallel ranks one worker may have (each is a routing candidate).
const MAX_DP_SIZE: u32 = 1024;

impl Args {
    /// Applies the defaults and validates.
    pub fn into_settings(mut self) -> Result<Settings, ConfigError> {
        let defaults = PolicyConfig::default();
        let discovery = self.discovery_settings()?;
        let epp = self.take_epp()?;
        let mut workers: Vec<WorkerSpec> =
            self.worker_urls.into_iter().map(WorkerSpec::url).collect();
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
        workers.extend(self.workers);
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
        super::epp::needs_endpoints(epp.as_ref(), !workers.is_empty() || discovery.any())?;
        let prometheus_port =
            super::epp::metrics_port(self.metrics_port, self.prometheus_port, epp.is_some())?;
        let load_factor = self
            .prefix_hash_load_factor
            .unwrap_or(defaults.prefix_hash_load_factor);
        if !(load_factor.is_finite() && load_factor > 0.0) {
            return Err(ConfigError::Invalid {
                name: "prefix_hash_load_factor",
                reason: "must be a positive number",
            });
        }
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
        let host = self.host.unwrap_or_else(|| default_host.to_owned());
        let block_size = positive("block_size", self.block_size, 16)?;
        let kv = KvAwareConfig::default();
        let weight = |name: &'static str, v: Option<f64>, default: f64| match v {
            Some(x) if !(x.is_finite() && x >= 0.0) => Err(ConfigError::Invalid {
                name,
                reason: "must be a non-negative number",
            }),
            Some(x) => Ok(x),
            None => Ok(default),
        };
        let kv_aware = KvAwareConfig {
            overlap_score_credit: weight(
                "router_kv_overlap_score_credit",
                self.router_kv_overlap_score_credit,
                kv.overlap_score_credit,
            )?,
            prefill_load_scale: weight(
                "router_prefill_load_scale",
                self.router_prefill_load_scale,
                kv.prefill_load_scale,
            )?,
            decode_active_request_weight: weight(
                "router_decode_active_request_weight",
                self.router_decode_active_request_weight,
                kv.decode_active_request_weight,
            )?,
            memory_cost: match self.router_kv_memory_cost {
                Some(MemoryCostArg::Linear) => MemoryCost::Linear,
                Some(MemoryCostArg::Utilisation) => MemoryCost::Utilisation,
                None => kv.memory_cost,
            },
            prefill_interference_weight: weight(
                "router_prefill_interference_weight",
                self.router_prefill_interference_weight,
                kv.prefill_interference_weight,
            )?,
            temperature: weight(
                "router_temperature",
                self.router_temperature,
                kv.temperature,
            )?,
            host_cache_hit_weight: weight(
                "router_host_cache_hit_weight",
                self.router_host_cache_hit_weight,
                kv.host_cache_hit_weight,
            )?,
            disk_cache_hit_weight: weight(
                "router_disk_cache_hit_weight",
                self.router_disk_cache_hit_weight,
                kv.disk_cache_hit_weight,
            )?,
            shared_cache_multiplier: weight(
                "shared_cache_multiplier",
                self.shared_cache_multiplier,
                kv.shared_cache_multiplier,
            )?,
        };
        let ca = CacheAwareConfig::default();
        let cache_aware = CacheAwareConfig {
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
        };
        let busy = BusyThresholds {
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
        };
        let ld = LlmDConfig::default();
        let llm_d = LlmDConfig {
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
            block_size: ld.block_size.max(block_size),
            prefix: if self.llm_d_precise_prefix {
                kvroute_core::policy::PrefixSource::Exact { block_size }
            } else {
                kvroute_core::policy::PrefixSource::Approximate
            },
        };
        let health = super::service::health_settings(super::service::HealthFlags {
            interval_secs: self.health_check_interval_secs,
            timeout_secs: self.health_check_timeout_secs,
            failure_threshold: self.health_failure_threshold,
            success_threshold: self.health_success_threshold,
            endpoint: self.health_check_endpoint,
            remove_unhealthy: self.remove_unhealthy_workers,
            keep_unhealthy: self.no_remove_unhealthy_workers,
            // The picker's pool or selector is a discovery source like the others.
            discovers: discovery.any()
                || epp
                    .as_ref()
                    .is_some_and(|e| !matches!(e.endpoints, super::EppEndpoints::Static)),
            startup_timeout_secs: self.worker_startup_timeout_secs,
        })?;
        let multiplier = self.retry_backoff_multiplier.unwrap_or(1.5);
        if !(multiplier.is_finite() && multiplier >= 1.0) {
            return Err(ConfigError::Invalid {
                name: "retry_backoff_multiplier",
                reason: "must be a number of at least 1",
            });
        }
        let jitter = self.retry_jitter_factor.unwrap_or(0.2);
        if !(0.0..=1.0).contains(&jitter) {
            return Err(ConfigError::Invalid {
                name: "retry_jitter_factor",
                reason: "must be between 0 and 1",
            });
        }
        let retry = RetrySettings {
            max_retries: if self.disable_retries {
                0
            } else {
                self.retry_max_retries.unwrap_or(5)
            },
            initial_backoff: Duration::from_millis(self.retry_initial_backoff_ms.unwrap_or(50)),
            max_backoff: Duration::from_millis(self.retry_max_backoff_ms.unwrap_or(30_000)),
            multiplier,
            jitter,
        };
        let migration = MigrationSettings {
            limit: self.migration_limit.unwrap_or(3),
            stall: Duration::from_secs(positive(
                "migration_stall_timeout_secs",
                self.migration_stall_timeout_secs,
                120,
            )?),
        };
        let circuit = (!self.disable_circuit_breaker)
            .then(|| -> Result<CircuitSettings, ConfigError> {
                Ok(CircuitSettings {
                    failure_threshold: positive(
                        "cb_failure_threshold",
                        self.cb_failure_threshold.map(u64::from),
                        10,
                    )? as u32,
                    success_threshold: positive(
                        "cb_success_threshold",
                        self.cb_success_threshold.map(u64::from),
                        3,
                    )? as u32,
                    timeout: Duration::from_secs(positive(
                        "cb_timeout_duration_secs",
                        self.cb_timeout_duration_secs,
                        60,
                    )?),
                })
            })
            .transpose()?;
        let policy_config = PolicyConfig {
            prefix_token_count: self
                .prefix_token_count
                .unwrap_or(defaults.prefix_token_count),
            prefix_hash_load_factor: load_factor,
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
        };
        let discovers_halves = discovery
            .kubernetes
            .as_ref()
            .is_some_and(|k| k.selectors.iter().any(|s| s.role != WorkerRole::Both));
        let pd_on = self.pd_disaggregation
            || discovers_halves
            || workers.iter().any(|w| w.role != WorkerRole::Both);
        super::epp::refuse_pd(epp.as_ref(), pd_on)?;
        let pd = if pd_on {
            let complete = workers.iter().any(|w| w.role.prefills())
                && workers.iter().any(|w| w.role.decodes());
            if !workers.is_empty() && !complete {
                return Err(ConfigError::Invalid {
                    name: "pd_disaggregation",
                    reason: "needs at least one prefill and one decode worker",
                });
            }
            // The halves' policies take the same parameters as the main one.
            let base = policy_config.clone();
            let (decode_policy, decode_config) =
                kvroute_core::policy::decode_policy(self.decode_policy, &base);
            Some(PdSettings {
                protocol: self.pd_protocol.unwrap_or_default(),
                prefill_policy: self.prefill_policy.unwrap_or(PolicyKind::KvAware),
                prefill_config: base,
                decode_policy,
                decode_config,
                min_uncached_tokens: self.pd_min_uncached_tokens.unwrap_or(0),
            })
        } else {
            None
        };
        Ok(Settings {
            metrics_compat: super::MetricsCompat::new(
                &self.metrics_compat,
                self.metrics_prefix.as_deref(),
            )?,
            prometheus_host: self.prometheus_host.unwrap_or_else(|| host.clone()),
            host,
            port: self.port.unwrap_or(30000),
            prometheus_port,
            workers,
            policy: self.policy.unwrap_or(PolicyKind::KvAware),
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
            kv_events: if self.no_router_kv_events {
                KvEventsMode::Approximate
            } else {
                KvEventsMode::Events
            },
            router_ttl: Duration::from_secs(self.router_ttl_secs.unwrap_or(120)),
            max_indexed_blocks: self.router_max_indexed_blocks.unwrap_or(1 << 22).max(1),
            metrics_refresh: Duration::from_millis(self.metrics_refresh_ms.unwrap_or(50).max(1)),
            busy,
            health_check_port: self.health_check_port,
            overload: super::service::overload_protection(
                self.worker_overload_waiting_requests,
                self.worker_overload_token_usage,
                self.worker_overload_protection,
                self.disable_worker_overload_protection,
                self.worker_overload_shed,
            )?,
            admin_api_key: self.admin_api_key.and_then(Secret::new),
            client_api_key: self.client_api_key.and_then(Secret::new),
            api_key: match self.api_key.and_then(Secret::new) {
                Some(key) if key.bearer().is_none() => {
                    return Err(ConfigError::Invalid {
                        name: "api_key",
                        reason: "must be visible ASCII (it is sent as a header)",
                    })
                }
                key => key,
            },
            tls: super::certs::tls_settings(
                &self.ca_cert_paths,
                self.client_cert_path.as_deref(),
                self.client_key_path.as_deref(),
                self.tls_cert_path,
                self.tls_key_path,
            )?,
            health,
            retry,
            circuit,
            migration,
            admission: super::service::admission(
                self.max_concurrent_requests,
                self.queue_size,
                self.queue_timeout_secs,
                self.rate_limit_tokens_per_second,
            )?,
            shutdown_grace: Duration::from_secs(self.shutdown_grace_period_secs.unwrap_or(180)),
            header_read_timeout: Duration::from_secs(positive(
                "header_read_timeout_secs",
                self.header_read_timeout_secs,
                30,
            )?),
            pd,
            replica_sync: match self.replica_sync {
                None => None,
                Some(url) if !url.starts_with("nats://") => {
                    return Err(ConfigError::Invalid {
                        name: "replica_sync",
                        reason: "must be nats://HOST:PORT",
                    })
                }
                Some(url) => Some(SyncConfig {
                    url,
                    prefix: self
                        .replica_sync_subject_prefix
                        .unwrap_or_else(|| "kvroute".to_owned()),
                    timeout: Duration::from_secs(positive(
                        "replica_timeout_secs",
                        self.replica_timeout_secs,
                        10,
                    )?),
                }),
            },
            config_path: self.config,
            cli_workers: CliWorkers::default(),
            queue: match self.router_queue_threshold {
                None => None,
                // Disaggregated requests bypass the admission queue: refuse rather than
                // ignore the flag.
                Some(_) if pd_on => {
                    return Err(ConfigError::Invalid {
                        name: "router_queue_threshold",
                        reason: "not supported with prefill/decode disaggregation yet",
                    })
                }
                Some(t) if !kvroute_core::queue::valid_threshold(t) => {
                    return Err(ConfigError::Invalid {
                        name: "router_queue_threshold",
                        reason: "must be a positive number",
                    })
                }
                Some(threshold) => {
                    let mut class_thresholds = Vec::new();
                    let mut classes: Vec<PolicyClass> = Vec::new();
                    for c in self.policy_classes {
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
                    if let Err(e) = kvroute_core::queue::DrrQueue::<()>::new(classes.clone(), order)
                    {
                        tracing::error!(error = %e, "invalid policy classes");
                        return Err(ConfigError::Invalid {
                            name: "policy_classes",
                            reason: "need distinct names and positive weights",
                        });
                    }
                    Some(QueueSettings {
                        threshold,
                        order,
                        timeout: Duration::from_secs(positive(
                            "router_queue_timeout_secs",
                            self.router_queue_timeout_secs,
                            60,
                        )?),
                        classes,
                        class_thresholds,
                    })
                }
            },
            session_affinity: self.session_affinity_ttl_secs.map(|secs| {
                let mode = match self.session_affinity_mode {
                    Some(AffinityModeArg::Hard) => AffinityMode::Hard,
                    Some(AffinityModeArg::Soft) | None => AffinityMode::Soft,
                };
                (mode, Duration::from_secs(secs))
            }),
            tokenizer: self.tokenizer,
            tokenizer_cache_bytes: self.tokenizer_cache_l1_max_memory.unwrap_or(256 << 20),
            discovery,
            timing_model: self.timing_model.unwrap_or_default(),
            epp,
        })
    }
}

/// Checks a worker base URL (`http[s]://host:port[/prefix]`) and drops a trailing slash.
/// `v` (or `default` when unset), refusing zero.
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
