//! An inference request's life: planned (see [`super::pd`]), queued on its rank's engine,
//! answered whole or streamed as its tokens come, aborted if its client goes away.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvroute_tokenizer::Tokenizer;
use tokio::sync::mpsc;

use super::driver::{Command, Delivery};
use super::error::{bad_request, ApiError};
use super::faults::Faults;
use super::openai::{self, Api, ResponseMeta};
use super::{pd, AppState};
use crate::engine::{EngineRequest, RequestId};

/// An inference request, parsed.
pub(super) struct Generate {
    pub(super) api: Api,
    pub(super) prompt: Vec<u32>,
    pub(super) max_tokens: usize,
    pub(super) stream: bool,
    /// Which chunks of a stream carry usage (`stream_options`).
    pub(super) usage: openai::StreamUsage,
    pub(super) salt: u64,
    pub(super) disagg: pd::DisaggFields,
}

/// Sends an abort to the engine if the request's answer is dropped before it finished.
struct AbortOnDrop {
    id: RequestId,
    tx: mpsc::UnboundedSender<Command>,
    done: bool,
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.tx.send(Command::Abort(self.id));
        }
    }
}

pub(super) async fn generate(
    state: &AppState,
    headers: &HeaderMap,
    g: Generate,
) -> Result<Response, ApiError> {
    let Generate {
        api,
        prompt,
        max_tokens,
        stream,
        usage,
        salt,
        disagg,
    } = g;
    let rank = state.rank(headers)?;
    let pd::Prepared {
        max_tokens,
        prompt_kv,
        mut remote_prefill,
        answer_params,
        cached_tokens: cached_report,
    } = state
        .prepare(rank, &disagg, stream, max_tokens, prompt.len())
        .await?;
    let id = RequestId(state.next_id.fetch_add(1, Ordering::Relaxed));
    let meta = ResponseMeta {
        api,
        id: format!(
            "{}-{:016x}",
            match api {
                Api::Chat => "chatcmpl",
                Api::Completion => "cmpl",
                Api::Messages => "msg",
            },
            rand::random::<u64>()
        ),
        created: state.created,
        model: state.args.model.clone(),
        fingerprint: state.args.instance_id.clone(),
        prompt_tokens: prompt.len(),
    };
    let (tx, mut rx) = mpsc::unbounded_channel();
    let request = EngineRequest {
        id,
        prompt,
        max_tokens,
        salt,
    };
    if state.ranks[rank]
        .send(Command::Add {
            request,
            prompt_kv,
            tx,
        })
        .is_err()
    {
        return Err(ApiError::unavailable("engine stopped"));
    }
    let mut guard = AbortOnDrop {
        id,
        tx: state.ranks[rank].clone(),
        done: false,
    };
    // The first delivery says whether the engine took the request.
    let first = match rx.recv().await {
        Some(Delivery::Rejected(e)) => {
            guard.done = true;
            return Err(bad_request(e.to_string()));
        }
        Some(d) => d,
        None => {
            return Err(ApiError::unavailable("engine stopped"));
        }
    };
    // The request that `crash_after_requests` makes the last: it dies after its first token.
    let last = state.faults.accept();
    if last && !stream {
        state.faults.crash();
        return Err(ApiError::unavailable("engine crashed"));
    }
    let tokenizer = state.tokenizer.clone();
    if !stream {
        let mut tokens = Vec::with_capacity(max_tokens);
        let mut next = Some(first);
        while let Some(Delivery::Token {
            token,
            finished,
            cached_tokens,
            prompt_blocks,
            ..
        }) = next
        {
            tokens.push(token);
            if finished {
                guard.done = true;
                let text = tokenizer.decode(&tokens).unwrap_or_default();
                let mut body = openai::full_response(
                    &meta,
                    &text,
                    tokens.len(),
                    cached_report.report(cached_tokens),
                );
                if answer_params {
                    body["kv_transfer_params"] = pd::transfer_params(
                        &state.side_channel(rank),
                        &meta.id,
                        &prompt_blocks,
                        cached_tokens,
                    );
                }
                if let Some(prefill) = remote_prefill.take() {
                    prefill.done(meta.prompt_tokens, cached_tokens);
                }
                return Ok(Json(body).into_response());
            }
            next = rx.recv().await;
        }
        return Err(ApiError::unavailable("engine stopped"));
    }
    // Streaming: one SSE event per token, then the usage chunk (unless `include_usage` is
    // off) and [DONE].
    let mut prelude = String::new();
    if api == Api::Messages {
        let cached = match &first {
            Delivery::Token { cached_tokens, .. } => cached_report.report(*cached_tokens),
            _ => 0,
        };
        prelude.push_str(&openai::messages_prelude(&meta, cached));
    }
    if api == Api::Chat {
        let mut role = openai::role_chunk(&meta);
        if usage == openai::StreamUsage::Continuous {
            role["usage"] = openai::running_usage(&meta, 0);
        }
        prelude.push_str(&openai::sse(&role));
    }
    struct StreamState {
        rx: mpsc::UnboundedReceiver<Delivery>,
        first: Option<Delivery>,
        prelude: Option<String>,
        guard: AbortOnDrop,
        meta: ResponseMeta,
        chunk: openai::ChunkTemplate,
        usage: openai::StreamUsage,
        tokenizer: Arc<Tokenizer>,
        count: usize,
        ended: bool,
        /// Crash the engine once the first token is sent (`crash_after_requests`).
        crash: Option<Arc<Faults>>,
        cached_report: pd::CachedTokens,
        remote_prefill: Option<pd::RemotePrefill>,
    }
    let st = StreamState {
        rx,
        first: Some(first),
        prelude: Some(prelude),
        guard,
        chunk: openai::ChunkTemplate::new(&meta),
        usage,
        meta,
        tokenizer,
        count: 0,
        ended: false,
        crash: last.then(|| state.faults.clone()),
        cached_report,
        remote_prefill,
    };
    // One body frame per wake-up: the tokens that arrived since the last one (one token when
    // the client keeps pace, several in one write when it lags). A stream whose engine stops
    // before its end fails, so the connection is cut without the final chunk: a truncated
    // answer never looks complete.
    let body = futures_util::stream::unfold(st, |mut st| async move {
        if st.ended {
            return None;
        }
        if st.count > 0 {
            if let Some(faults) = st.crash.take() {
                // Yield once so hyper writes the first token out, then die.
                tokio::task::yield_now().await;
                faults.crash();
                st.ended = true;
                return Some((Err(std::io::Error::other("engine crashed")), st));
            }
        }
        let mut out = st.prelude.take().unwrap_or_default();
        let mut next = match st.first.take() {
            Some(d) => Some(d),
            None => st.rx.recv().await,
        };
        let mut any = false;
        while let Some(Delivery::Token {
            token,
            finished,
            cached_tokens,
            ..
        }) = next
        {
            any = true;
            st.count += 1;
            let text = st.tokenizer.decode(&[token]).unwrap_or_default();
            let running = (st.usage == openai::StreamUsage::Continuous)
                .then(|| openai::running_usage(&st.meta, st.count));
            if st.crash.is_some() {
                // The first token only, never the end.
                st.chunk.push(&mut out, &text, false, running.as_ref());
                break;
            }
            st.chunk.push(&mut out, &text, finished, running.as_ref());
            if finished {
                st.guard.done = true;
                st.ended = true;
                if let Some(prefill) = st.remote_prefill.take() {
                    prefill.done(st.meta.prompt_tokens, cached_tokens);
                }
                if st.meta.api == Api::Messages {
                    let cached = st.cached_report.report(cached_tokens);
                    out.push_str(&openai::messages_end(&st.meta, st.count, cached));
                    break;
                }
                if st.usage != openai::StreamUsage::None {
                    out.push_str(&openai::sse(&openai::usage_chunk(
                        &st.meta,
                        st.count,
                        st.cached_report.report(cached_tokens),
                    )));
                }
                out.push_str("data: [DONE]\n\n");
                break;
            }
            next = st.rx.try_recv().ok();
        }
        if !any {
            st.ended = true;
            return Some((Err(std::io::Error::other("engine stopped")), st));
        }
        Some((Ok(Bytes::from(out)), st))
    });
    Ok(Response::builder()
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .body(Body::from_stream(body))
        .expect("valid response"))
}
