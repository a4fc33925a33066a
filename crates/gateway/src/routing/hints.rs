//! A request's routing hints: its headers (kvroute's, smg's and Dynamo's), Dynamo's
//! `nvext` body fields, and its session key.
//!
//! Pins, strongest first: `x-kvroute-worker`, smg's `x-smg-target-worker` (an id, or an index
//! into the configured workers), Dynamo's `x-worker-instance-id` header, then the body's
//! `nvext.backend_instance_id` (or `nvext.decode_worker_id`). Dynamo's instance ids are
//! numbers: they name the worker whose id is that number (`id: "7"` in the config). A rank
//! comes from `x-kvroute-dp-rank`, Dynamo's `x-dp-rank`, then `nvext.dp_rank`. The prefill
//! half's pin: `x-kvroute-prefill-worker`, Dynamo's `x-prefill-instance-id`, then
//! `nvext.prefill_worker_id`.
//!
//! One hint comes from the request's size, not a header: the context it needs on an engine
//! ([`context_needed`]), which eligibility checks against each worker's `max_model_len`.

use http::HeaderMap;
use kvroute_core::affinity::AffinityMode;
use kvroute_core::eligibility::Hints;
use kvroute_protocol::RoutingFields;

use crate::config::WorkerSpec;
use crate::error::GatewayError;
use crate::workers::Pool;

/// `hints` with what routing adds: a hard session binding as a pin (unless the request pins
/// one itself, or the bound worker does not take the request's context), and the context the
/// request needs where some worker takes less.
pub(super) fn with_routing_hints<'h>(
    hints: &'h Hints,
    bound: Option<&(String, Option<u32>)>,
    mode: Option<AffinityMode>,
    pool: &Pool,
    prompt_tokens: usize,
    fields: &RoutingFields<'_>,
) -> std::borrow::Cow<'h, Hints> {
    let mut hints = std::borrow::Cow::Borrowed(hints);
    let need = context_needed(pool, prompt_tokens, fields);
    if let (Some((worker, rank)), Some(AffinityMode::Hard)) = (bound, mode) {
        // A binding the router made yields to a context its worker does not take (the
        // session is bound again where the request goes); a client's own pin never does.
        let outgrown = need.is_some_and(|need| {
            let bound = pool.workers.iter().find(|w| w.id.as_str() == worker);
            bound
                .and_then(|w| w.max_model_len())
                .is_some_and(|n| need > n)
        });
        if hints.pinned_worker.is_none() && !outgrown {
            let h = hints.to_mut();
            (h.pinned_worker, h.pinned_rank) = (Some(worker.clone()), *rank);
        }
    }
    if need.is_some() {
        hints.to_mut().context_tokens = need;
    }
    hints
}

/// The context (prompt tokens plus `max_tokens`, at least one) a request needs on an engine,
/// where some worker of `pool` says it takes less: then eligibility prefers the workers it
/// fits (`core::eligibility`). `None` where the prompt's tokens were neither taken nor
/// counted (`routing::tokens_for`) and wherever every worker takes it.
fn context_needed(pool: &Pool, prompt_tokens: usize, fields: &RoutingFields<'_>) -> Option<u64> {
    let answer = fields
        .max_completion_tokens
        .or(fields.max_tokens)
        .unwrap_or(0);
    let need = (prompt_tokens as u64).saturating_add(answer.max(1));
    (prompt_tokens > 0 && pool.shortest_context.is_some_and(|n| need > n)).then_some(need)
}

/// A request's session key: the first of `keys` (`--routing-key-headers`) present with a
/// non-empty visible value, else the body's `user`.
pub fn session_key<'a>(
    keys: &[http::HeaderName],
    headers: &'a HeaderMap,
    fields: &'a RoutingFields<'a>,
) -> Option<&'a str> {
    keys.iter()
        .find_map(|h| {
            headers
                .get(h)
                .and_then(|v| v.to_str().ok())
                .filter(|k| !k.is_empty())
        })
        .or(fields.user.as_deref().filter(|u| !u.is_empty()))
}

/// A hint header's trimmed value; not visible ASCII is a 400 naming the header.
fn text<'a>(headers: &'a HeaderMap, name: &'static str) -> Result<Option<&'a str>, GatewayError> {
    match headers.get(name) {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .map(|s| Some(s.trim()))
            .map_err(|_| GatewayError::InvalidHint {
                header: name,
                reason: "not visible ASCII".into(),
            }),
    }
}

/// The worker smg's `x-smg-target-worker` names: an id, or an index into `workers`.
fn smg_target(headers: &HeaderMap, workers: &[WorkerSpec]) -> Result<Option<String>, GatewayError> {
    let Some(value) = pinned_worker(headers, SMG_TARGET_HEADER)? else {
        return Ok(None);
    };
    if !value.bytes().all(|b| b.is_ascii_digit()) {
        return Ok(Some(value));
    }
    let spec = value
        .parse::<usize>()
        .ok()
        .and_then(|i| workers.get(i))
        .ok_or_else(|| GatewayError::InvalidHint {
            header: SMG_TARGET_HEADER,
            reason: format!(
                "worker index {value} is out of range ({} configured workers)",
                workers.len()
            ),
        })?;
    Ok(Some(spec.id.clone().unwrap_or_else(|| spec.url.clone())))
}

/// Dynamo's pin header: a worker instance id (a number).
const DYNAMO_INSTANCE_HEADER: &str = "x-worker-instance-id";

/// A Dynamo instance-id header's worker id (the number, as written).
fn instance(headers: &HeaderMap, name: &'static str) -> Result<Option<String>, GatewayError> {
    let Some(v) = text(headers, name)? else {
        return Ok(None);
    };
    let id: u64 = v.parse().map_err(|_| GatewayError::InvalidHint {
        header: name,
        reason: format!("'{v}' is not an instance id (a number)"),
    })?;
    Ok(Some(id.to_string()))
}

/// A rank header's rank.
fn rank(headers: &HeaderMap, name: &'static str) -> Result<Option<u32>, GatewayError> {
    let Some(r) = text(headers, name)? else {
        return Ok(None);
    };
    r.parse().map(Some).map_err(|_| GatewayError::InvalidHint {
        header: name,
        reason: format!("'{r}' is not a rank number"),
    })
}

/// The prefill half's pin: `x-kvroute-prefill-worker`, Dynamo's `x-prefill-instance-id`,
/// then `nvext.prefill_worker_id`.
pub fn prefill_pin(
    headers: &HeaderMap,
    fields: &RoutingFields<'_>,
) -> Result<Option<String>, GatewayError> {
    if let Some(w) = pinned_worker(headers, "x-kvroute-prefill-worker")? {
        return Ok(Some(w));
    }
    Ok(instance(headers, "x-prefill-instance-id")?.or_else(|| {
        let id = fields.nvext.as_ref()?.prefill_worker_id?;
        Some(id.to_string())
    }))
}

/// The worker a pin header (`x-kvroute-worker`, `x-kvroute-prefill-worker`) names.
fn pinned_worker(headers: &HeaderMap, name: &'static str) -> Result<Option<String>, GatewayError> {
    match text(headers, name)? {
        Some("") => Err(GatewayError::InvalidHint {
            header: name,
            reason: "empty".into(),
        }),
        w => Ok(w.map(str::to_owned)),
    }
}

/// smg's pin: a worker id, or the 0-based index of a `--worker-urls` worker when all digits.
const SMG_TARGET_HEADER: &str = "x-smg-target-worker";

/// The routing hints of a request's headers; a malformed one is a 400 naming the header.
/// `workers` are the configured workers, in order (smg's pin by index).
pub fn parse_hints(
    headers: &HeaderMap,
    workers: &[WorkerSpec],
    fields: &RoutingFields<'_>,
) -> Result<Hints, GatewayError> {
    fn list(headers: &HeaderMap, name: &'static str) -> Result<Option<Vec<String>>, GatewayError> {
        let Some(v) = text(headers, name)? else {
            return Ok(None);
        };
        let items: Vec<String> = v.split(',').map(|s| s.trim().to_owned()).collect();
        if items.iter().any(String::is_empty) {
            return Err(GatewayError::InvalidHint {
                header: name,
                reason: "empty entry in the comma-separated list".into(),
            });
        }
        Ok(Some(items))
    }
    let mut hints = Hints {
        allowed_workers: list(headers, "x-kvroute-allowed-workers")?
            .map(|v| v.into_iter().collect()),
        required_taints: list(headers, "x-kvroute-required-taints")?.unwrap_or_default(),
        slo: super::slo_targets(headers)?,
        ..Hints::default()
    };
    let nvext = fields.nvext.as_ref();
    hints.pinned_worker = match pinned_worker(headers, "x-kvroute-worker")? {
        Some(w) => Some(w),
        None => match smg_target(headers, workers)? {
            Some(w) => Some(w),
            None => instance(headers, DYNAMO_INSTANCE_HEADER)?.or_else(|| {
                let n = nvext?;
                n.backend_instance_id
                    .or(n.decode_worker_id)
                    .map(|id| id.to_string())
            }),
        },
    };
    hints.pinned_rank = match rank(headers, "x-kvroute-dp-rank")? {
        Some(r) => Some(r),
        None => rank(headers, "x-dp-rank")?.or(nvext.and_then(|n| n.dp_rank)),
    };
    for item in list(headers, "x-kvroute-preferred-taints")?.unwrap_or_default() {
        let (taint, weight) = match item.split_once('=') {
            Some((t, w)) => {
                let w: f64 = w
                    .trim()
                    .parse()
                    .ok()
                    .filter(|w: &f64| w.is_finite() && *w >= 0.0)
                    .ok_or_else(|| GatewayError::InvalidHint {
                        header: "x-kvroute-preferred-taints",
                        reason: format!("weight of '{t}' is not a non-negative number"),
                    })?;
                (t.trim().to_owned(), w)
            }
            None => (item, 1.0),
        };
        hints.preferred_taints.push((taint, weight));
    }
    Ok(hints)
}
