//! The settings of the service around routing: admission control, tracing, overload
//! protection and `least_load`'s knobs, validated from their flags.

use std::time::Duration;

use kvroute_core::overload::{OverloadProtection, SMG_TOKEN_USAGE, SMG_WAITING_REQUESTS};
use kvroute_core::LeastLoadConfig;

use super::validate::positive;
use super::{
    AdmissionSettings, CircuitSettings, ConfigError, HealthSettings, MigrationSettings,
    RetrySettings, SyncConfig,
};

/// `--otlp-traces-endpoint`, `--enable-trace` and `--otlp-sampling-ratio`: tracing is on with
/// an endpoint, or with `--enable-trace` to smg's default.
pub(super) fn trace_settings(
    endpoint: Option<&str>,
    enabled: bool,
    ratio: Option<f64>,
) -> Result<Option<crate::otlp::TraceSettings>, ConfigError> {
    let ratio = ratio.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&ratio) {
        return Err(ConfigError::Invalid {
            name: "otlp_sampling_ratio",
            reason: "must be between 0 and 1",
        });
    }
    let endpoint = match (endpoint, enabled) {
        (Some(e), _) => e,
        (None, true) => crate::otlp::DEFAULT_ENDPOINT,
        (None, false) => return Ok(None),
    };
    let endpoint = crate::otlp::Endpoint::parse(endpoint).map_err(ConfigError::OtlpEndpoint)?;
    let service_name = std::env::var("OTEL_SERVICE_NAME")
        .ok()
        .filter(|s| !s.trim().is_empty())
        .unwrap_or_else(|| "kvroute".to_owned());
    Ok(Some(crate::otlp::TraceSettings {
        endpoint,
        sampling_ratio: ratio,
        service_name,
    }))
}

/// Admission control (see the `admission` module): on with a concurrency limit or a rate.
pub(super) fn admission(
    limit: Option<i64>,
    queue_size: Option<usize>,
    queue_timeout_secs: Option<u64>,
    rate: Option<f64>,
) -> Result<Option<AdmissionSettings>, ConfigError> {
    let limit = match limit {
        None | Some(0) => None,
        // smg's "derived": 1024 per available core, at least 4096.
        Some(-1) => {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            Some((1024 * cores).max(4096))
        }
        Some(n) if n > 0 => Some(n as usize),
        Some(_) => {
            return Err(ConfigError::Invalid {
                name: "max_concurrent_requests",
                reason: "must be positive, 0 (no limit) or -1 (1024 per core, at least 4096)",
            })
        }
    };
    let rate = match rate {
        None => None,
        Some(0.0) => None,
        Some(r) if r.is_finite() && r > 0.0 => Some(r),
        Some(_) => {
            return Err(ConfigError::Invalid {
                name: "rate_limit_tokens_per_second",
                reason: "must be a positive number of requests per second, or 0 (none)",
            })
        }
    };
    let queue_timeout = positive("queue_timeout_secs", queue_timeout_secs, 60)?;
    Ok(
        (limit.is_some() || rate.is_some()).then(|| AdmissionSettings {
            limit,
            queue_size: queue_size.unwrap_or(100),
            queue_timeout: Duration::from_secs(queue_timeout),
            rate,
        }),
    )
}

/// The headers a session key is read from, in order, unless `--routing-key-headers` says
/// otherwise; the body's `user` comes after them.
pub const DEFAULT_ROUTING_KEY_HEADERS: [&str; 3] =
    ["x-session-id", "x-smg-routing-key", "x-user-id"];

/// `--routing-key-headers`, as header names (smg's default list when none is given).
pub(super) fn routing_key_headers(names: &[String]) -> Result<Vec<http::HeaderName>, ConfigError> {
    let names: Vec<&str> = if names.is_empty() {
        DEFAULT_ROUTING_KEY_HEADERS.to_vec()
    } else {
        names.iter().map(String::as_str).collect()
    };
    names
        .iter()
        .map(|n| {
            http::HeaderName::from_bytes(n.trim().to_ascii_lowercase().as_bytes()).map_err(|_| {
                ConfigError::Invalid {
                    name: "routing_key_headers",
                    reason: "must be HTTP header names",
                }
            })
        })
        .collect()
}

/// Overload protection (smg's flags): on with a threshold or `--worker-overload-protection`
/// (smg's thresholds where not given), off with `--disable-worker-overload-protection`, which
/// the others contradict.
pub(super) fn overload_protection(
    waiting_requests: Option<u64>,
    token_usage: Option<f64>,
    protection: bool,
    disable: bool,
    shed: bool,
) -> Result<OverloadProtection, ConfigError> {
    if disable {
        if protection || shed || waiting_requests.is_some() || token_usage.is_some() {
            return Err(ConfigError::Invalid {
                name: "disable_worker_overload_protection",
                reason: "contradicts the other worker_overload settings given",
            });
        }
        return Ok(OverloadProtection::default());
    }
    if waiting_requests == Some(0) {
        return Err(ConfigError::Invalid {
            name: "worker_overload_waiting_requests",
            reason: "must be at least 1",
        });
    }
    if token_usage.is_some_and(|u| !(u > 0.0 && u <= 1.0)) {
        return Err(ConfigError::Invalid {
            name: "worker_overload_token_usage",
            reason: "must be in (0, 1]",
        });
    }
    let on = protection || waiting_requests.is_some() || token_usage.is_some();
    if shed && !on {
        return Err(ConfigError::Invalid {
            name: "worker_overload_shed",
            reason: "needs overload protection on (a threshold or --worker-overload-protection)",
        });
    }
    // `--worker-overload-protection` fills in smg's thresholds where none is given.
    let (waiting_requests, token_usage) = match (protection, waiting_requests, token_usage) {
        (true, None, None) => (Some(SMG_WAITING_REQUESTS), Some(SMG_TOKEN_USAGE)),
        (true, w, None) => (w, Some(SMG_TOKEN_USAGE)),
        (true, None, u) => (Some(SMG_WAITING_REQUESTS), u),
        (_, w, u) => (w, u),
    };
    Ok(OverloadProtection {
        waiting_requests,
        token_usage,
        shed,
    })
}

/// `least_load`'s knobs, smg's defaults where not given.
pub(super) fn least_load(
    kv_pressure_weight: Option<f64>,
    default_throughput: Option<f64>,
    mean_prefill_tokens: Option<u64>,
    max_waiting_requests: Option<u64>,
) -> Result<LeastLoadConfig, ConfigError> {
    let d = LeastLoadConfig::default();
    let weight = kv_pressure_weight.unwrap_or(d.kv_pressure_weight);
    if !(weight.is_finite() && weight >= 0.0) {
        return Err(ConfigError::Invalid {
            name: "least_load_kv_pressure_weight",
            reason: "must be a number of at least 0",
        });
    }
    let throughput = default_throughput.unwrap_or(d.default_throughput);
    if !(throughput.is_finite() && throughput > 0.0) {
        return Err(ConfigError::Invalid {
            name: "least_load_default_throughput",
            reason: "must be a positive number of tokens per second",
        });
    }
    Ok(LeastLoadConfig {
        kv_pressure_weight: weight,
        default_throughput: throughput,
        mean_prefill_tokens: positive(
            "least_load_mean_prefill_tokens",
            mean_prefill_tokens,
            d.mean_prefill_tokens,
        )?,
        max_waiting_requests: max_waiting_requests.unwrap_or(d.max_waiting_requests),
    })
}

/// The health flags, for [`health_settings`].
pub(super) struct HealthFlags {
    pub interval_secs: Option<u64>,
    pub timeout_secs: Option<u64>,
    pub failure_threshold: Option<u32>,
    pub success_threshold: Option<u32>,
    pub endpoint: Option<String>,
    pub remove_unhealthy: bool,
    pub keep_unhealthy: bool,
    /// Whether a discovery source is on (it can add a removed worker back).
    pub discovers: bool,
    pub startup_timeout_secs: Option<u64>,
}

/// Health checks of the workers. Unhealthy workers are removed by default only under
/// discovery, as smg does: a static worker removed is gone for good.
pub(super) fn health_settings(f: HealthFlags) -> Result<HealthSettings, ConfigError> {
    let endpoint = match f.endpoint {
        Some(p) if !p.starts_with('/') => {
            return Err(ConfigError::Invalid {
                name: "health_check_endpoint",
                reason: "must be a path starting with /",
            })
        }
        Some(p) => p,
        None => "/health".to_owned(),
    };
    Ok(HealthSettings {
        interval: Duration::from_secs(positive("health_check_interval_secs", f.interval_secs, 60)?),
        timeout: Duration::from_secs(positive("health_check_timeout_secs", f.timeout_secs, 5)?),
        failure_threshold: positive(
            "health_failure_threshold",
            f.failure_threshold.map(u64::from),
            3,
        )? as u32,
        success_threshold: positive(
            "health_success_threshold",
            f.success_threshold.map(u64::from),
            2,
        )? as u32,
        endpoint,
        remove_unhealthy: match (f.remove_unhealthy, f.keep_unhealthy) {
            (true, true) => {
                return Err(ConfigError::Invalid {
                    name: "remove_unhealthy_workers",
                    reason: "contradicts no_remove_unhealthy_workers",
                })
            }
            (true, false) => true,
            (false, true) => false,
            (false, false) => f.discovers,
        },
        startup_timeout: positive("worker_startup_timeout_secs", f.startup_timeout_secs, 0)
            .map(|s| (s > 0).then(|| Duration::from_secs(s)))?,
    })
}

impl super::Args {
    /// `--health-*` and `--worker-startup-timeout-secs`; unhealthy workers are removed by
    /// default only when they are discovered.
    pub(super) fn health_settings(
        &mut self,
        discovery: &super::DiscoverySettings,
        epp: Option<&super::EppSettings>,
    ) -> Result<HealthSettings, ConfigError> {
        health_settings(HealthFlags {
            interval_secs: self.health_check_interval_secs,
            timeout_secs: self.health_check_timeout_secs,
            failure_threshold: self.health_failure_threshold,
            success_threshold: self.health_success_threshold,
            endpoint: self.health_check_endpoint.take(),
            remove_unhealthy: self.remove_unhealthy_workers,
            keep_unhealthy: self.no_remove_unhealthy_workers,
            // The picker's pool or selector is a discovery source like the others.
            discovers: discovery.any()
                || epp.is_some_and(|e| !matches!(e.endpoints, super::EppEndpoints::Static)),
            startup_timeout_secs: self.worker_startup_timeout_secs,
        })
    }

    /// `--retry-*` and `--disable-retries`.
    pub(super) fn retry_settings(&self) -> Result<RetrySettings, ConfigError> {
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
        Ok(RetrySettings {
            max_retries: if self.disable_retries {
                0
            } else {
                self.retry_max_retries.unwrap_or(5)
            },
            initial_backoff: Duration::from_millis(self.retry_initial_backoff_ms.unwrap_or(50)),
            max_backoff: Duration::from_millis(self.retry_max_backoff_ms.unwrap_or(30_000)),
            multiplier,
            jitter,
        })
    }

    /// `--migration-limit` and `--migration-stall-timeout-secs`.
    pub(super) fn migration_settings(&self) -> Result<MigrationSettings, ConfigError> {
        Ok(MigrationSettings {
            limit: self.migration_limit.unwrap_or(3),
            stall: Duration::from_secs(positive(
                "migration_stall_timeout_secs",
                self.migration_stall_timeout_secs,
                120,
            )?),
        })
    }

    /// `--cb-*`; `None` with `--disable-circuit-breaker`.
    pub(super) fn circuit_settings(&self) -> Result<Option<CircuitSettings>, ConfigError> {
        if self.disable_circuit_breaker {
            return Ok(None);
        }
        Ok(Some(CircuitSettings {
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
        }))
    }

    /// `--worker-overload-*`.
    pub(super) fn overload_protection(&self) -> Result<OverloadProtection, ConfigError> {
        overload_protection(
            self.worker_overload_waiting_requests,
            self.worker_overload_token_usage,
            self.worker_overload_protection,
            self.disable_worker_overload_protection,
            self.worker_overload_shed,
        )
    }

    /// `--max-concurrent-requests`, `--queue-*` and `--rate-limit-tokens-per-second`.
    pub(super) fn admission(&self) -> Result<Option<AdmissionSettings>, ConfigError> {
        admission(
            self.max_concurrent_requests,
            self.queue_size,
            self.queue_timeout_secs,
            self.rate_limit_tokens_per_second,
        )
    }

    /// `--replica-sync nats://HOST:PORT` and its subject prefix and timeout.
    pub(super) fn take_replica_sync(&mut self) -> Result<Option<SyncConfig>, ConfigError> {
        match self.replica_sync.take() {
            None => Ok(None),
            Some(url) if !url.starts_with("nats://") => Err(ConfigError::Invalid {
                name: "replica_sync",
                reason: "must be nats://HOST:PORT",
            }),
            Some(url) => Ok(Some(SyncConfig {
                url,
                prefix: self
                    .replica_sync_subject_prefix
                    .take()
                    .unwrap_or_else(|| "kvroute".to_owned()),
                timeout: Duration::from_secs(positive(
                    "replica_timeout_secs",
                    self.replica_timeout_secs,
                    10,
                )?),
            })),
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::config::{Args, Settings};

    fn settings(args: &[&str]) -> Result<Settings, String> {
        let argv = std::iter::once("kvroute").chain(args.iter().copied());
        Args::try_parse_from(argv)
            .map_err(|e| e.to_string())?
            .into_settings()
            .map_err(|e| e.to_string())
    }

    #[test]
    fn overload_protection_takes_smgs_flags_and_is_off_by_default() {
        let overload = |args: &[&str]| settings(args).map(|s| s.overload);
        assert_eq!(overload(&[]).unwrap(), OverloadProtection::default());
        assert!(!overload(&[]).unwrap().is_on());
        let smg = overload(&["--worker-overload-protection"]).unwrap();
        assert_eq!(
            (smg.waiting_requests, smg.token_usage, smg.shed),
            (Some(8), Some(0.8), false)
        );
        let one = overload(&["--worker-overload-waiting-requests", "3"]).unwrap();
        assert_eq!((one.waiting_requests, one.token_usage), (Some(3), None));
        let mixed = overload(&[
            "--worker-overload-protection",
            "--worker-overload-token-usage",
            "0.5",
            "--worker-overload-shed",
        ])
        .unwrap();
        assert_eq!(
            (mixed.waiting_requests, mixed.token_usage, mixed.shed),
            (Some(8), Some(0.5), true)
        );
        assert_eq!(
            overload(&["--disable-worker-overload-protection"]).unwrap(),
            OverloadProtection::default()
        );
        for (bad, names) in [
            (
                &[
                    "--disable-worker-overload-protection",
                    "--worker-overload-shed",
                ][..],
                "--worker-overload-shed",
            ),
            (&["--worker-overload-token-usage", "1.5"], "token_usage"),
            (&["--worker-overload-token-usage", "0"], "token_usage"),
            (
                &["--worker-overload-waiting-requests", "0"],
                "waiting_requests",
            ),
            (&["--worker-overload-shed"], "worker_overload_shed"),
        ] {
            let e = overload(bad).unwrap_err();
            assert!(e.contains(names), "{bad:?}: {e}");
        }
        // The file and the command line together contradict each other too.
        let file = Args::from_text("disable_worker_overload_protection: true\n").unwrap();
        let cli =
            Args::try_parse_from(["kvroute", "--worker-overload-waiting-requests", "4"]).unwrap();
        assert!(cli.merge(file).into_settings().is_err());
    }

    #[test]
    fn unhealthy_workers_are_removed_by_default_only_under_discovery() {
        let health = |args: &[&str]| settings(args).map(|s| s.health);
        let h = health(&[]).unwrap();
        assert!(!h.remove_unhealthy);
        assert_eq!(h.startup_timeout, None);
        let file = ["--discovery-file", "/nonexistent/workers.yaml"];
        assert!(health(&file).unwrap().remove_unhealthy);
        let kept = [&file[..], &["--no-worker-auto-recovery"]].concat();
        assert!(!health(&kept).unwrap().remove_unhealthy);
        assert!(
            health(&["--worker-auto-recovery"])
                .unwrap()
                .remove_unhealthy
        );
        assert!(health(&[
            "--remove-unhealthy-workers",
            "--no-remove-unhealthy-workers"
        ])
        .is_err());
        let t = health(&["--worker-startup-timeout-secs", "600"]).unwrap();
        assert_eq!(t.startup_timeout, Some(Duration::from_secs(600)));
        let e = health(&["--worker-startup-timeout-secs", "0"]).unwrap_err();
        assert!(e.contains("worker_startup_timeout_secs"), "{e}");
        let port = settings(&["--health-check-port", "8081"]).unwrap();
        assert_eq!(port.health_check_port, Some(8081));
    }

    #[test]
    fn least_load_takes_smgs_knobs_and_defaults() {
        let config = |args: &[&str]| settings(args).map(|s| s.policy_config.least_load);
        assert_eq!(config(&[]).unwrap(), LeastLoadConfig::default());
        let c = config(&[
            "--policy",
            "least_load",
            "--least-load-kv-pressure-weight",
            "0",
            "--least-load-default-throughput",
            "500",
            "--least-load-mean-prefill-tokens",
            "64",
            "--least-load-max-waiting-requests",
            "4",
        ])
        .unwrap();
        assert_eq!(
            c,
            LeastLoadConfig {
                kv_pressure_weight: 0.0,
                default_throughput: 500.0,
                mean_prefill_tokens: 64,
                max_waiting_requests: 4,
            }
        );
        for bad in [
            &["--least-load-default-throughput", "0"][..],
            &["--least-load-kv-pressure-weight", "-1"],
            &["--least-load-mean-prefill-tokens", "0"],
        ] {
            assert!(config(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            settings(&["--policy", "passthrough"]).unwrap().policy,
            kvroute_core::PolicyKind::Passthrough
        );
    }
}
