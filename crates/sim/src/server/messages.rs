//! Anthropic's Messages API: `POST /v1/messages` (whole or streamed) and
//! `POST /v1/messages/count_tokens` (`{"input_tokens": N}`).
//!
//! The body is read as vLLM reads it ([`kvroute_protocol::anthropic::chat_request`]): the
//! same chat prompt, the same ids, one engine path with the chat route. Answers are in
//! Anthropic's shape (see [`super::openai`] for the bodies and the stream's events), and so are
//! errors: `{"type": "error", "error": {"type", "message"}}`.
//!
//! Usage is counted as Anthropic counts it: `input_tokens` is the prompt less its cached
//! tokens, `cache_read_input_tokens` the cached tokens, `cache_creation_input_tokens` 0.
//! vLLM's `/v1/messages` reports the whole prompt as `input_tokens` and no cache fields.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvroute_tokenizer::ChatFields;
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::{bad_request, json_body, ApiError};
use super::generate::{generate, Generate};
use super::openai::{self, Api};
use super::AppState;

/// The chat request a Messages body stands for, or a 400 naming what is wrong.
fn chat_of(body: &Value) -> Result<Value, ApiError> {
    kvroute_protocol::anthropic::chat_request(body).map_err(|e| bad_request(e.0))
}

pub(super) async fn messages(State(state): State<Arc<AppState>>, req: Request) -> Response {
    match create(&state, req).await {
        Ok(response) => response,
        Err(e) => anthropic_error(e),
    }
}

async fn create(state: &AppState, req: Request) -> Result<Response, ApiError> {
    state.faults.before_inference(&state.stopping).await?;
    let (headers, body) = json_body::<Value>(req).await?;
    let chat = chat_of(&body)?;
    let max_tokens = match body.get("max_tokens") {
        Some(v) => v
            .as_u64()
            .filter(|n| *n > 0)
            .ok_or_else(|| bad_request("max_tokens: must be a positive integer"))?,
        None => return Err(bad_request("max_tokens: field required")),
    };
    let request = openai::ChatRequest::deserialize(&chat)
        .map_err(|e| bad_request(format!("invalid request: {e}")))?;
    let lora = state.check_model(request.model.as_deref())?;
    let prompt = state.chat_tokens(&request.prompt)?;
    generate(
        state,
        &headers,
        Generate {
            api: Api::Messages,
            prompt,
            max_tokens: max_tokens as usize,
            stream: request.stream.unwrap_or(false),
            usage: openai::StreamUsage::Final,
            salt: 0,
            lora,
            priority: request.priority,
            disagg: request.disagg,
        },
    )
    .await
}

pub(super) async fn count_tokens(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let counted = async {
        let (_, body) = json_body::<Value>(req).await?;
        let chat = chat_of(&body)?;
        let fields = ChatFields::deserialize(&chat)
            .map_err(|e| bad_request(format!("invalid request: {e}")))?;
        let model = chat["model"].as_str();
        state.check_model(model)?;
        let ids = state.chat_tokens(&fields)?;
        Ok::<_, ApiError>(Json(json!({"input_tokens": ids.len()})).into_response())
    };
    match counted.await {
        Ok(response) => response,
        Err(e) => anthropic_error(e),
    }
}

/// An error in Anthropic's shape, its type named after the status.
fn anthropic_error(e: ApiError) -> Response {
    let body = kvroute_protocol::anthropic::error_body(e.status.as_u16(), e.message());
    (e.status, Json(body)).into_response()
}
