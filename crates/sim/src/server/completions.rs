//! The endpoints that take a prompt: `/v1/completions` and `/v1/chat/completions` (the model
//! checked, the prompt tokenised, then handed to `generate`), their `/render` twins, and
//! `/tokenize` and `/detokenize`; and how a request's prompt, model and data-parallel rank
//! are read.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvroute_tokenizer::ChatFields;
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::{bad_request, json_body, ApiError};
use super::generate::{generate, Generate};
use super::openai::{self, Api};
use super::{AppState, DP_RANK_HEADER};
use crate::engine::LoraId;

impl AppState {
    /// The adapter a request's `model` names: none for the base model (or no model), an
    /// adapter the server serves, or vLLM's 404.
    pub(super) fn check_model(&self, model: Option<&str>) -> Result<Option<LoraId>, ApiError> {
        match model {
            Some(m) if m != self.args.model => self.adapters.resolve(m).map(Some),
            _ => Ok(None),
        }
    }

    /// The rank a request runs on: the one its [`DP_RANK_HEADER`] names, else the next in
    /// turn.
    pub(super) fn rank(&self, headers: &HeaderMap) -> Result<usize, ApiError> {
        match headers.get(DP_RANK_HEADER) {
            Some(v) => {
                let rank = v
                    .to_str()
                    .ok()
                    .and_then(|s| s.trim().parse::<usize>().ok())
                    .ok_or_else(|| bad_request(format!("invalid {DP_RANK_HEADER} header")))?;
                if rank >= self.ranks.len() {
                    return Err(bad_request(format!(
                        "data parallel rank {rank} out of range (size {})",
                        self.ranks.len()
                    )));
                }
                Ok(rank)
            }
            None => Ok(self.next_rank.fetch_add(1, Ordering::Relaxed) % self.ranks.len()),
        }
    }

    fn completion_tokens(&self, prompt: &Value) -> Result<Vec<u32>, ApiError> {
        match prompt {
            Value::String(s) => self.encode_prompt(s),
            Value::Array(items) if items.len() == 1 && items[0].is_string() => {
                self.encode_prompt(items[0].as_str().unwrap_or_default())
            }
            Value::Array(items) if items.iter().all(Value::is_u64) => items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .and_then(|id| u32::try_from(id).ok())
                        .ok_or_else(|| bad_request("token id out of range"))
                })
                .collect(),
            Value::Array(_) => Err(bad_request(
                "kvroute-sim takes one prompt per request (a string or token ids)",
            )),
            _ => Err(bad_request(
                "prompt must be a string or a list of token ids",
            )),
        }
    }

    fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, ApiError> {
        self.tokenizer
            .encode_prompt(text)
            .map_err(|e| bad_request(format!("cannot tokenize the prompt: {e}")))
    }

    /// A chat's prompt ids, its options (`continue_final_message`, ...) honoured as vLLM
    /// honours them and as the router reads them, so both derive the same ids.
    pub(super) fn chat_tokens(&self, chat: &ChatFields) -> Result<Vec<u32>, ApiError> {
        if !chat.messages.is_array() {
            return Err(bad_request("messages must be a list"));
        }
        self.tokenizer
            .encode_chat(&chat.messages, &chat.options())
            .map_err(|e| bad_request(format!("cannot render the chat: {e}")))
    }
}

fn salt_of(cache_salt: Option<&str>) -> u64 {
    cache_salt.map_or(0, |s| kvroute_protocol::stable_hash(s.as_bytes()))
}

pub(super) async fn completions(
    State(state): State<Arc<AppState>>,
    req: Request,
) -> Result<Response, ApiError> {
    state.faults.before_inference(&state.stopping).await?;
    let (headers, body) = json_body::<openai::CompletionRequest>(req).await?;
    let lora = state.check_model(body.model.as_deref())?;
    let prompt = state.completion_tokens(&body.prompt)?;
    let max_tokens = body.max_tokens.unwrap_or(openai::DEFAULT_MAX_TOKENS);
    generate(
        &state,
        &headers,
        Generate {
            api: Api::Completion,
            prompt,
            max_tokens,
            stream: body.stream.unwrap_or(false),
            usage: openai::StreamUsage::of(body.stream_options.as_ref()),
            salt: salt_of(body.cache_salt.as_deref()),
            lora,
            priority: body.priority,
            disagg: body.disagg,
        },
    )
    .await
}

pub(super) async fn chat(
    State(state): State<Arc<AppState>>,
    req: Request,
) -> Result<Response, ApiError> {
    state.faults.before_inference(&state.stopping).await?;
    let (headers, body) = json_body::<openai::ChatRequest>(req).await?;
    let lora = state.check_model(body.model.as_deref())?;
    let prompt = state.chat_tokens(&body.prompt)?;
    let max_tokens = body
        .max_completion_tokens
        .or(body.max_tokens)
        .unwrap_or(openai::DEFAULT_MAX_TOKENS);
    generate(
        &state,
        &headers,
        Generate {
            api: Api::Chat,
            prompt,
            max_tokens,
            stream: body.stream.unwrap_or(false),
            usage: openai::StreamUsage::of(body.stream_options.as_ref()),
            salt: salt_of(body.cache_salt.as_deref()),
            lora,
            priority: body.priority,
            disagg: body.disagg,
        },
    )
    .await
}

pub(super) async fn render_completion(
    State(state): State<Arc<AppState>>,
    req: Request,
) -> Result<Response, ApiError> {
    let (_, body) = json_body::<openai::CompletionRequest>(req).await?;
    let ids = state.completion_tokens(&body.prompt)?;
    Ok(Json(json!({"token_ids": ids})).into_response())
}

pub(super) async fn render_chat(
    State(state): State<Arc<AppState>>,
    req: Request,
) -> Result<Response, ApiError> {
    let (_, body) = json_body::<openai::ChatRequest>(req).await?;
    let ids = state.chat_tokens(&body.prompt)?;
    Ok(Json(json!({"token_ids": ids})).into_response())
}

pub(super) async fn tokenize(
    State(state): State<Arc<AppState>>,
    req: Request,
) -> Result<Response, ApiError> {
    let (_, body) = json_body::<Value>(req).await?;
    let tokens = if body.get("messages").is_some() {
        let chat = ChatFields::deserialize(&body)
            .map_err(|e| bad_request(format!("invalid chat request: {e}")))?;
        state.chat_tokens(&chat)?
    } else if let Some(prompt) = body.get("prompt") {
        state.completion_tokens(prompt)?
    } else {
        return Err(bad_request("give prompt or messages"));
    };
    Ok(Json(json!({
        "count": tokens.len(),
        "max_model_len": state.args.num_gpu_blocks * state.args.block_size,
        "tokens": tokens,
        "token_strs": null,
    }))
    .into_response())
}

pub(super) async fn detokenize(
    State(state): State<Arc<AppState>>,
    req: Request,
) -> Result<Response, ApiError> {
    #[derive(serde::Deserialize)]
    struct Detokenize {
        tokens: Vec<u32>,
    }
    let (_, body) = json_body::<Detokenize>(req).await?;
    let text = state
        .tokenizer
        .decode(&body.tokens)
        .map_err(|e| bad_request(format!("cannot detokenize: {e}")))?;
    Ok(Json(json!({"prompt": text})).into_response())
}
