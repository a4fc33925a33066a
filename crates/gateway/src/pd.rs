//! Prefill/decode disaggregation: one request, two workers. The shape of a disaggregated
//! request's plan is a pair ([`plan`]), and its dispatch sends the pair's halves ([`send`]).
//!
//! The decode worker is chosen first, by the decode policy over the model's decode workers
//! (`x-kvroute-worker` pins it); when it already holds all but fewer than
//! `--pd-min-uncached-tokens` prompt tokens, the request goes to it alone ("decode-only",
//! llm-d's decider). Otherwise the prefill worker is chosen by the prefill policy over the
//! prefill workers (`x-kvroute-prefill-worker` pins it) and the two halves go out in the
//! engines' protocol:
//!
//! - vLLM (NIXL): the prompt to the prefill worker with `max_tokens` 1, `stream` false and
//!   `kv_transfer_params: {"do_remote_decode": true, ...}`; then the original request to the
//!   decode worker with the `kv_transfer_params` the prefill answered. A failed prefill is the
//!   client's answer and the decode half is never sent.
//! - SGLang (bootstrap): `bootstrap_host`, `bootstrap_port` and a random `bootstrap_room`
//!   added to the body, sent to both at once; the decode answer is the client's, unless the
//!   prefill fails first.
//!
//! Each half holds its own in-flight guard (the prefill half's load is the prompt, the decode
//! half's the blocks it decodes over), released on every outcome. A prefill half that fails
//! before any byte is retried on another prefill worker (SGLang's: both halves sent again with
//! a new bootstrap room); a decode half that fails mid-stream migrates ([`crate::migrate`],
//! driven by [`crate::forward`]) to a new pair chosen for the prompt and the text so far, the
//! failed workers excluded.

mod plan;
mod send;

use axum::response::Response;
use bytes::Bytes;
use http::HeaderValue;
use kvroute_protocol::WorkerId;

use crate::context::AppState;
use crate::error::GatewayError;
use crate::pick::Attempt;
use crate::proxy;

/// Names the prefill worker of a disaggregated request (hint in, header out).
pub const PREFILL_WORKER_HEADER: http::HeaderName =
    http::HeaderName::from_static("x-kvroute-prefill-worker");

/// What the halves answered: the decode worker's response, or an answer that ends the
/// request (a failed prefill's).
pub(crate) enum PdAnswer {
    Decode {
        response: Box<http::Response<proxy::TrackedBody>>,
        worker: WorkerId,
        /// The prefill worker's name, for [`PREFILL_WORKER_HEADER`] (none when decode-only).
        prefill: Option<HeaderValue>,
    },
    Answered(Response),
}

/// Plans a pair for `a` (no worker in `excluded`) and sends its halves with `body`: the
/// decode worker's response, or the answer that ends the request.
pub(crate) async fn halves(
    state: &AppState,
    a: &Attempt<'_>,
    body: Bytes,
    excluded: &[WorkerId],
) -> Result<PdAnswer, GatewayError> {
    // SGLang's halves go out together: a prefill that fails before any byte sends both again,
    // with another prefill worker (vLLM's prefill is retried alone, in `send`).
    let mut excluded = excluded.to_vec();
    let max_retries = state.settings.retry.max_retries;
    for attempt in 0..=max_retries {
        let pair = plan::pair(state, a, &excluded)?;
        match send::pair(state, a, body.clone(), &excluded, pair).await? {
            Once::Done(answer) => return Ok(answer),
            Once::RetryPrefill(worker) if attempt < max_retries => {
                tracing::warn!(%worker, attempt = attempt + 1, "Prefill half failed before any byte; sending both halves again with another prefill worker");
                state.metrics.retries.inc();
                if let Some(span) = a.span {
                    span.add("kvroute.retries", 1);
                }
                excluded.push(worker);
            }
            Once::RetryPrefill(worker) => {
                return Err(GatewayError::UpstreamStatus {
                    worker,
                    status: 502,
                })
            }
        }
    }
    unreachable!("the last attempt returns")
}

/// One try of the halves: their answer, or a prefill worker to leave out and try again.
enum Once {
    Done(PdAnswer),
    RetryPrefill(WorkerId),
}
