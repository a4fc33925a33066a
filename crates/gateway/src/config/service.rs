//! The settings of the service around routing: admission control and tracing, validated
//! from their flags.

use std::time::Duration;

use super::validate::positive;
use super::{AdmissionSettings, ConfigError};

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
