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
use crate::engine::{EngineRequest, LoraId, PromptKv, RequestId};

/// An inference request, parsed.
pub(super) struct Generate {
    pub(super) api: Api,
    pub(super) prompt: Vec<u32>,
    pub(super) max_tokens: usize,
    pub(super) stream: bool,
    /// Which chunks of a stream carry usage (`stream_options`).
    pub(super) usage: openai::StreamUsage,
    pub(super) salt: u64,
    /// The adapter `model` named; its name is mixed into the salt (as the router's index
    /// salts an adapter's blocks) and answers as the model.
    pub(super) lora: Option<LoraId>,
    /// vLLM's `priority` field.
    pub(super) priority: i64,
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

/// A request the engine took, and what its answer needs.
struct Answer {
    meta: ResponseMeta,
    /// The engine's deliveries after `first`.
    rx: mpsc::UnboundedReceiver<Delivery>,
    /// The first delivery, the one that said the engine took the request.
    first: Delivery,
    guard: AbortOnDrop,
    cached_report: pd::CachedTokens,
    remote_prefill: Option<pd::RemotePrefill>,
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
        lora,
        priority,
        disagg,
    } = g;
    let adapter = lora.and_then(|id| state.adapters.name(id));
    let salt = adapter
        .as_ref()
        .map_or(salt, |n| salt ^ kvroute_protocol::stable_hash(n.as_bytes()));
    let rank = state.rank(headers)?;
    let pd::Prepared {
        max_tokens,
        prompt_kv,
        remote_prefill,
        answer_params,
        cached_tokens: cached_report,
    } = state
        .prepare(rank, &disagg, stream, max_tokens, prompt.len())
        .await?;
    let id = RequestId(state.next_id.fetch_add(1, Ordering::Relaxed));
    let mut meta = response_meta(state, api, prompt.len());
    if let Some(name) = adapter {
        meta.model = name;
    }
    let request = EngineRequest {
        id,
        prompt,
        max_tokens,
        salt,
        lora,
        priority,
    };
    let (rx, first, guard) = submit(state, rank, request, prompt_kv).await?;
    let answer = Answer {
        meta,
        rx,
        first,
        guard,
        cached_report,
        remote_prefill,
    };
    // The request that `crash_after_requests` makes the last: it dies after its first token.
    let last = state.faults.accept();
    if last && !stream {
        state.faults.crash();
        return Err(ApiError::unavailable("engine crashed"));
    }
    if !stream {
        return answer_whole(state, rank, answer, max_tokens, answer_params).await;
    }
    let crash = last.then(|| state.faults.clone());
    Ok(answer_streamed(
        answer,
        usage,
        state.tokenizer.clone(),
        crash,
    ))
}

/// The response's id, model and prompt size.
fn response_meta(state: &AppState, api: Api, prompt_tokens: usize) -> ResponseMeta {
    ResponseMeta {
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
        prompt_tokens,
    }
}

/// Queues `request` on `rank`'s engine and waits for its first delivery, which says whether
/// the engine took it. The guard aborts it if the answer is dropped before it finished.
async fn submit(
    state: &AppState,
    rank: usize,
    request: EngineRequest,
    prompt_kv: PromptKv,
) -> Result<(mpsc::UnboundedReceiver<Delivery>, Delivery, AbortOnDrop), ApiError> {
    let id = request.id;
    let (tx, mut rx) = mpsc::unbounded_channel();
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
    Ok((rx, first, guard))
}

/// Waits for every token, then answers with the whole text.
async fn answer_whole(
    state: &AppState,
    rank: usize,
    answer: Answer,
    max_tokens: usize,
    answer_params: bool,
) -> Result<Response, ApiError> {
    let Answer {
        meta,
        mut rx,
        first,
        mut guard,
        cached_report,
        mut remote_prefill,
    } = answer;
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
            let text = state.tokenizer.decode(&tokens).unwrap_or_default();
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
    Err(ApiError::unavailable("engine stopped"))
}

/// Streaming: one SSE event per token, then the usage chunk (unless `include_usage` is off)
/// and [DONE].
fn answer_streamed(
    answer: Answer,
    usage: openai::StreamUsage,
    tokenizer: Arc<Tokenizer>,
    crash: Option<Arc<Faults>>,
) -> Response {
    let prelude = prelude(&answer, usage);
    let Answer {
        meta,
        rx,
        first,
        guard,
        cached_report,
        remote_prefill,
    } = answer;
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
        crash,
        cached_report,
        remote_prefill,
    };
    // One body frame per wake-up: the tokens that arrived since the last one (one token when
    // the client keeps pace, several in one write when it lags). A stream whose engine stops
    // before its end fails, so the connection is cut without the final chunk: a truncated
    // answer never looks complete.
    let body = futures_util::stream::unfold(st, next_frame);
    Response::builder()
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .body(Body::from_stream(body))
        .expect("valid response")
}

/// What a stream sends before its first token: the Messages API's opening events, or the
/// chat API's role chunk.
fn prelude(answer: &Answer, usage: openai::StreamUsage) -> String {
    let meta = &answer.meta;
    let mut prelude = String::new();
    if meta.api == Api::Messages {
        let cached = match &answer.first {
            Delivery::Token { cached_tokens, .. } => answer.cached_report.report(*cached_tokens),
            _ => 0,
        };
        prelude.push_str(&openai::messages_prelude(meta, cached));
    }
    if meta.api == Api::Chat {
        let mut role = openai::role_chunk(meta);
        if usage == openai::StreamUsage::Continuous {
            role["usage"] = openai::running_usage(meta, 0);
        }
        prelude.push_str(&openai::sse(&role));
    }
    prelude
}

/// A streamed answer between two body frames.
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

/// The next body frame of a stream: the tokens that arrived since the last one, waiting for
/// one if none did; an error where the engine stopped (or crashed) before the end.
async fn next_frame(mut st: StreamState) -> Option<(Result<Bytes, std::io::Error>, StreamState)> {
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
            st.finish(&mut out, cached_tokens);
            break;
        }
        next = st.rx.try_recv().ok();
    }
    if !any {
        st.ended = true;
        return Some((Err(std::io::Error::other("engine stopped")), st));
    }
    Some((Ok(Bytes::from(out)), st))
}

impl StreamState {
    /// Ends the stream after its last token: the Messages API's closing events, or the usage
    /// chunk (unless `include_usage` is off) and [DONE].
    fn finish(&mut self, out: &mut String, cached_tokens: usize) {
        self.guard.done = true;
        self.ended = true;
        if let Some(prefill) = self.remote_prefill.take() {
            prefill.done(self.meta.prompt_tokens, cached_tokens);
        }
        let cached = self.cached_report.report(cached_tokens);
        if self.meta.api == Api::Messages {
            out.push_str(&openai::messages_end(&self.meta, self.count, cached));
            return;
        }
        if self.usage != openai::StreamUsage::None {
            out.push_str(&openai::sse(&openai::usage_chunk(
                &self.meta, self.count, cached,
            )));
        }
        out.push_str("data: [DONE]\n\n");
    }
}
