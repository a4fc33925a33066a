//! `POST /speed {"speedup": X}`: the engine's speed factor changed at run time (every rank's,
//! from its next step on), as a GPU that throttles or a neighbour that steals compute would
//! change it. The router's tests make a worker slower this way and watch its traffic fall.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::json;

use super::driver::Command;
use super::error::{bad_request, json_body, ApiError};
use super::AppState;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SpeedBody {
    speedup: f64,
}

pub(super) async fn post_speed(
    State(state): State<Arc<AppState>>,
    req: Request,
) -> Result<Response, ApiError> {
    let (_, body): (_, SpeedBody) = json_body(req).await?;
    if !(body.speedup.is_finite() && body.speedup > 0.0) {
        return Err(bad_request(format!(
            "speedup must be a finite number > 0, got {}",
            body.speedup
        )));
    }
    for tx in &state.ranks {
        if tx.send(Command::Speed(body.speedup)).is_err() {
            return Err(ApiError::unavailable("the engine is stopping"));
        }
    }
    Ok(Json(json!({"speedup": body.speedup})).into_response())
}
