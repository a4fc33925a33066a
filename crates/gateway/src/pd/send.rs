//! The dispatch of a planned pair: its halves in the engines' protocol, each under its own
//! in-flight guard.

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::HeaderValue;
use http_body_util::BodyExt;
use kvroute_core::slo::Verdict;
use kvroute_core::RequestLoad;
use kvroute_protocol::WorkerId;
use serde_json::{Map, Value};

use super::plan::{self, Pair, Prefill};
use super::{Once, PdAnswer};
use crate::config::PdProtocol;
use crate::context::AppState;
use crate::error::GatewayError;
use crate::metrics::SloWatch;
use crate::pick::Attempt;
use crate::proxy::{self, Forward, InFlight};
use crate::routing::{self, Choice};
use crate::workers::Half;

/// The largest prefill answer read (it is one token).
const PREFILL_ANSWER_LIMIT: usize = 16 << 20;

/// What a prefill half ends with: the `kv_transfer_params` it returned (null when none), or
/// its failed answer, which is the client's.
type Prefilled = Result<Value, Response>;

/// Sends the halves of `pair` for `a` (`excluded`: the workers it failed on before).
pub(super) async fn pair(
    state: &AppState,
    a: &Attempt<'_>,
    body: Bytes,
    excluded: &[WorkerId],
    pair: Pair,
) -> Result<Once, GatewayError> {
    let Pair {
        decode,
        decode_load,
        prefill,
        verdicts,
    } = pair;
    let decode_half = Decode {
        choice: &decode,
        load: decode_load,
        verdicts,
    };
    let Some(prefill) = prefill else {
        let response = send_decode(state, a, decode_half, body).await?;
        return Ok(answered(response, &decode, None));
    };
    let prefill_name = HeaderValue::from_str(prefill.choice.worker.id.as_str()).ok();
    let mut json: Value = serde_json::from_slice(&body).map_err(GatewayError::InvalidJson)?;
    let Some(object) = json.as_object_mut() else {
        return Err(GatewayError::InvalidAdmin(
            "the request body must be a JSON object".into(),
        ));
    };
    let pd = state.settings.pd.as_ref().expect("disaggregation is on");
    match pd.protocol {
        PdProtocol::Vllm => {
            let first = vllm_prefill_body(object);
            let prefilled = prefill_retried(state, a, excluded, prefill, first);
            let (params, prefill_name) = match prefilled.await? {
                Ok(done) => done,
                // The prefill's own error is the client's answer.
                Err(response) => return Ok(Once::Done(PdAnswer::Answered(response))),
            };
            object.insert("kv_transfer_params".into(), params);
            let second = Bytes::from(serde_json::to_vec(&json).expect("a JSON value"));
            let response = send_decode(state, a, decode_half, second).await?;
            Ok(answered(response, &decode, prefill_name))
        }
        PdProtocol::Sglang => {
            add_bootstrap(object, &prefill.choice);
            // Both halves get the same body.
            let both = Bytes::from(serde_json::to_vec(&json).expect("a JSON value"));
            let halves = (prefill, decode_half);
            let response = match sglang_halves(state, a, halves, both).await? {
                Ok(response) => response,
                Err(once) => return Ok(once),
            };
            Ok(answered(response, &decode, prefill_name))
        }
    }
}

fn answered(
    response: http::Response<proxy::TrackedBody>,
    decode: &Choice,
    prefill: Option<HeaderValue>,
) -> Once {
    Once::Done(PdAnswer::Decode {
        response: Box::new(response),
        worker: decode.worker.id.clone(),
        prefill,
    })
}

/// vLLM's prefill half: the request for one token, not streamed, asking for the KV to be
/// kept for a remote decode.
fn vllm_prefill_body(object: &Map<String, Value>) -> Bytes {
    let mut first = object.clone();
    first.insert("max_tokens".into(), 1.into());
    if first.contains_key("max_completion_tokens") {
        first.insert("max_completion_tokens".into(), 1.into());
    }
    first.insert("stream".into(), false.into());
    first.remove("stream_options");
    first.insert(
        "kv_transfer_params".into(),
        serde_json::json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
        }),
    );
    Bytes::from(serde_json::to_vec(&first).expect("a JSON object"))
}

/// SGLang's bootstrap fields: where the decode worker fetches the prompt's KV from.
fn add_bootstrap(object: &mut Map<String, Value>, prefill: &Choice) {
    let host = host_of(&prefill.worker.url);
    object.insert("bootstrap_host".into(), host.into());
    object.insert(
        "bootstrap_port".into(),
        match prefill.worker.bootstrap_port {
            Some(p) => p.into(),
            None => Value::Null,
        },
    );
    object.insert("bootstrap_room".into(), (rand::random::<u64>() >> 1).into());
}

/// SGLang's halves, sent at once: the decode worker's response, or how the try ends (a
/// failed prefill's answer, or a prefill worker to leave out).
async fn sglang_halves(
    state: &AppState,
    a: &Attempt<'_>,
    (prefill, decode): (Prefill, Decode<'_>),
    both: Bytes,
) -> Result<Result<http::Response<proxy::TrackedBody>, Once>, GatewayError> {
    let prefill_worker = prefill.choice.worker.id.clone();
    // Spawned: the prefill must run to its end even when the decode answers first
    // (an engine aborts a request whose client went away).
    let mut prefill_half = tokio::spawn(prefill_task(state, a, prefill, both.clone()));
    let decode_half = send_decode(state, a, decode, both);
    tokio::pin!(decode_half);
    // Whichever ends first; a failed prefill stops the decode half.
    Ok(Ok(tokio::select! {
        prefilled = &mut prefill_half => {
            let prefilled = prefilled.map_err(|e| GatewayError::Upstream {
                worker: prefill_worker.clone(),
                source: e.into(),
            })?;
            let retry = Once::RetryPrefill(prefill_worker);
            match prefilled {
                Ok(Ok(_)) => decode_half.await?,
                Ok(Err(response)) if matches!(response.status().as_u16(), 502..=504) => {
                    return Ok(Err(retry))
                }
                Ok(Err(response)) => return Ok(Err(Once::Done(PdAnswer::Answered(response)))),
                Err(GatewayError::Upstream { .. } | GatewayError::UpstreamTimeout { .. }) => {
                    return Ok(Err(retry))
                }
                Err(error) => return Err(error),
            }
        }
        // The prefill half goes on in its task, with its guard.
        decoded = &mut decode_half => decoded?,
    }))
}

/// The vLLM prefill half, retried on another prefill worker while it fails before any byte
/// reached the client (connection errors, timeouts, 502-504), as single requests are: its
/// `kv_transfer_params` and the prefill worker that gave them, or the failed answer.
async fn prefill_retried(
    state: &AppState,
    a: &Attempt<'_>,
    excluded: &[WorkerId],
    first: Prefill,
    body: Bytes,
) -> Result<Result<(Value, Option<HeaderValue>), Response>, GatewayError> {
    let mut prefill = first;
    let mut tried: Vec<WorkerId> = excluded.to_vec();
    let max_retries = state.settings.retry.max_retries;
    for attempt in 0..=max_retries {
        let worker = prefill.choice.worker.id.clone();
        let answer = prefill_task(state, a, prefill, body.clone()).await;
        let retryable = match &answer {
            Err(GatewayError::Upstream { .. } | GatewayError::UpstreamTimeout { .. }) => true,
            Ok(Err(r)) => matches!(r.status().as_u16(), 502..=504),
            _ => false,
        };
        let name = HeaderValue::from_str(worker.as_str()).ok();
        if !retryable || attempt == max_retries {
            return Ok(answer?.map(|params| (params, name)));
        }
        tracing::warn!(%worker, attempt = attempt + 1, "Prefill half failed before any byte; retrying on another prefill worker");
        state.metrics.retries.inc();
        if let Some(span) = a.span {
            span.add("kvroute.retries", 1);
        }
        tried.push(worker);
        match plan::next_prefill(state, a, &tried)? {
            Some(next) => prefill = next,
            // No other prefill worker: the last failure is the answer.
            None => return Ok(answer?.map(|params| (params, name))),
        }
    }
    unreachable!("the last attempt returns")
}

fn host_of(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    match authority.rsplit_once(':') {
        Some((host, port)) if port.chars().all(|c| c.is_ascii_digit()) => host.to_owned(),
        _ => authority.to_owned(),
    }
}

/// The prefill half, as a future that owns what it needs (SGLang's is spawned). Its answer
/// (one token) teaches the rank's TTFT model.
fn prefill_task(
    state: &AppState,
    a: &Attempt<'_>,
    Prefill {
        choice: prefill,
        load,
        features,
    }: Prefill,
    body: Bytes,
) -> impl std::future::Future<Output = Result<Prefilled, GatewayError>> + Send + 'static {
    let mut guard = InFlight::new(prefill.worker.clone(), prefill.rank, load, None)
        .with_sync(state.sync.get(), || synced(state, a, Half::Prefill));
    if let Some(features) = features {
        guard = guard.with_ttft_timing(features);
    }
    if let Some(span) = a.span {
        let rank = prefill.worker.ranks[prefill.rank].dp_rank;
        span.set_str("kvroute.prefill_worker", prefill.worker.id.as_str());
        let attempt = span.attempt(prefill.worker.id.as_str(), rank, 1);
        guard = guard.with_span(attempt.named("prefill"));
    }
    let client = state.client.clone();
    let auth = state.worker_auth.clone();
    let timeout = state.settings.request_timeout;
    let method = a.parts.method.clone();
    let path = a.path_and_query().to_owned();
    let headers = a.parts.headers.clone();
    let request_id = a.request_id.clone();
    let worker = prefill.worker.id.clone();
    async move {
        let response = proxy::forward(
            &client,
            guard,
            Forward {
                method,
                path_and_query: &path,
                headers: &headers,
                body,
                request_id: &request_id,
                timeout,
                auth: &auth,
            },
        )
        .await?;
        let status = response.status();
        let (parts, body) = response.into_parts();
        let bytes = http_body_util::Limited::new(body, PREFILL_ANSWER_LIMIT)
            .collect()
            .await
            .map_err(|e| GatewayError::Upstream {
                worker: worker.clone(),
                source: e,
            })?
            .to_bytes();
        if !status.is_success() {
            tracing::warn!(%worker, %status, "Prefill half failed; decode half not sent");
            return Ok(Err(
                http::Response::from_parts(parts, Body::from(bytes)).into_response()
            ));
        }
        let params = serde_json::from_slice::<Value>(&bytes)
            .ok()
            .and_then(|mut v| v.get_mut("kv_transfer_params").map(Value::take))
            .unwrap_or(Value::Null);
        Ok(Ok(params))
    }
}

/// The decode half of a pair.
struct Decode<'a> {
    choice: &'a Choice,
    load: RequestLoad,
    /// The routing's verdicts on the request's targets ([`Pair::verdicts`]).
    verdicts: (Option<Verdict>, Option<Verdict>),
}

/// The decode half: the client's response, whose timings count the request's targets
/// (from its arrival) and teach the rank's decode model (its gaps).
async fn send_decode(
    state: &AppState,
    a: &Attempt<'_>,
    Decode {
        choice: decode,
        load,
        verdicts,
    }: Decode<'_>,
    body: Bytes,
) -> Result<http::Response<proxy::TrackedBody>, GatewayError> {
    let stream = a.fields.stream;
    let slo = SloWatch::with_verdicts(&state.metrics.slo, a.hints.slo, verdicts, a.arrived, stream);
    let mut guard = InFlight::new(decode.worker.clone(), decode.rank, load, None)
        .with_sync(state.sync.get(), || synced(state, a, Half::Decode))
        .with_slo(slo);
    if stream {
        guard = guard
            .with_ttft(a.arrived, state.metrics.ttft_seconds.clone())
            .with_gap_timing();
    }
    if let Some(span) = a.span {
        let rank = decode.worker.ranks[decode.rank].dp_rank;
        let attempt = span.attempt(decode.worker.id.as_str(), rank, 1);
        guard = guard.with_span(attempt.named("decode"));
    }
    decode.worker.series.decisions.inc();
    decode.worker.series.processed.inc();
    proxy::forward(
        &state.client,
        guard,
        Forward {
            method: a.parts.method.clone(),
            path_and_query: a.path_and_query(),
            headers: &a.parts.headers,
            body,
            request_id: a.request_id,
            timeout: state.settings.request_timeout,
            auth: &state.worker_auth,
        },
    )
    .await
}

/// What a peer replica learns from a disaggregated half: the model and the session key (the
/// halves' policies key on tokens and load, not text).
fn synced(state: &AppState, a: &Attempt<'_>, half: Half) -> crate::sync::Learnt {
    crate::sync::Learnt {
        model: a.fields.model.as_deref().unwrap_or_default().to_owned(),
        session_key: routing::session_key(
            &state.settings.routing_key_headers,
            &a.parts.headers,
            a.fields,
        )
        .map(str::to_owned),
        // Sessions are bound to the decode half (see `plan::half`).
        bind: half == Half::Decode && state.affinity.is_some(),
        half: Some(half),
        ..Default::default()
    }
}
