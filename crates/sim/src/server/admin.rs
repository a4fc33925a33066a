//! The endpoints beside inference: what the engine serves (`/v1/models`, vLLM's and SGLang's
//! server and model info), `/metrics`, and `/reset_prefix_cache`. (Adapters loaded and unloaded
//! at run time: `adapters`.)

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use tokio::sync::oneshot;

use super::driver::Command;
use super::error::ApiError;
use super::AppState;
use crate::config::Role;

pub(super) async fn models(State(state): State<Arc<AppState>>) -> Response {
    let a = &state.args;
    let max_model_len = a.num_gpu_blocks * a.block_size;
    let mut data = vec![json!({
        "id": a.model, "object": "model", "created": state.created, "owned_by": "vllm",
        "root": a.model, "parent": null, "max_model_len": max_model_len,
    })];
    // Each adapter, as vLLM lists one: its root is its path, its parent the base model.
    data.extend(state.adapters.names().into_iter().map(|name| {
        json!({
            "id": name, "object": "model", "created": state.created, "owned_by": "vllm",
            "root": name, "parent": a.model, "max_model_len": max_model_len,
        })
    }));
    Json(json!({"object": "list", "data": data})).into_response()
}

pub(super) async fn server_info(State(state): State<Arc<AppState>>) -> Response {
    let a = &state.args;
    Json(json!({
        "model_path": a.model, "served_model_name": a.model, "tokenizer_path": a.tokenizer,
        "is_generation": true, "tp_size": 1, "dp_size": state.ranks.len(),
        "page_size": a.block_size, "max_total_num_tokens": a.num_gpu_blocks * a.block_size,
        "max_num_seqs": a.max_num_seqs, "max_num_batched_tokens": a.max_num_batched_tokens,
        "engine": "kvroute-sim",
        // SGLang's names for the role ("null": aggregated) and the bootstrap port.
        "disaggregation_mode": match a.role {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "null",
        },
        "disaggregation_bootstrap_port": a.bootstrap_port,
    }))
    .into_response()
}

pub(super) async fn model_info(State(state): State<Arc<AppState>>) -> Response {
    let a = &state.args;
    Json(json!({"model_path": a.model, "tokenizer_path": a.tokenizer, "is_generation": true}))
        .into_response()
}

pub(super) async fn reset_prefix_cache(
    State(state): State<Arc<AppState>>,
) -> Result<StatusCode, ApiError> {
    let mut all = true;
    for tx in &state.ranks {
        let (reply, rx) = oneshot::channel();
        if tx.send(Command::Reset(reply)).is_err() {
            all = false;
            continue;
        }
        all &= rx.await.unwrap_or(false);
    }
    if all {
        Ok(StatusCode::OK)
    } else {
        Err(ApiError::unavailable(
            "the prefix cache can only be reset when no request is running",
        ))
    }
}

pub(super) async fn metrics_text(State(state): State<Arc<AppState>>) -> Response {
    let mut text = String::new();
    match prometheus_client::encoding::text::encode(&mut text, &state.registry) {
        Ok(()) => (
            [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
            text,
        )
            .into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}
