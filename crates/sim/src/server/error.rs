//! [`ApiError`], an error answer in vLLM's shape and the one place the server's errors become
//! responses, and [`json_body`], which reads a request's JSON body or answers 400.

use axum::extract::Request;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::openai;

/// An error answer, in vLLM's shape; the one place errors become responses.
#[derive(Debug)]
pub(super) struct ApiError {
    pub(super) status: StatusCode,
    message: String,
    /// Its `type` where vLLM names it otherwise than after the status.
    kind: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind: None,
        }
    }

    /// vLLM's 400 for a request it rejects before the engine sees it (`InvalidUserInput`:
    /// its LoRA adapter endpoints').
    pub(super) fn invalid_user_input(message: impl Into<String>) -> Self {
        Self {
            kind: Some("InvalidUserInput"),
            ..Self::bad_request(message)
        }
    }

    pub(super) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    pub(super) fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }

    pub(super) fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, message)
    }

    /// A failure injected by `fail_rate`.
    pub(super) fn injected(status: StatusCode) -> Self {
        Self::new(status, "injected fault (kvroute-sim fail_rate)")
    }

    pub(super) fn message(&self) -> &str {
        &self.message
    }

    /// The error's `type`: named after its status (see [`openai::error_type`]) unless vLLM
    /// names it otherwise.
    pub(super) fn kind(&self) -> &'static str {
        self.kind.unwrap_or_else(|| openai::error_type(self.status))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = openai::error_body(self.status.as_u16(), self.kind(), &self.message);
        (self.status, Json(body)).into_response()
    }
}

pub(super) fn bad_request(message: impl Into<String>) -> ApiError {
    ApiError::bad_request(message)
}

/// The request's headers, and its body read as JSON into `T` (a 400 when it cannot be).
pub(super) async fn json_body<T: serde::de::DeserializeOwned>(
    req: Request,
) -> Result<(HeaderMap, T), ApiError> {
    let (parts, body) = req.into_parts();
    let bytes = axum::body::to_bytes(body, 64 * 1024 * 1024)
        .await
        .map_err(|e| bad_request(format!("cannot read body: {e}")))?;
    let value =
        serde_json::from_slice(&bytes).map_err(|e| bad_request(format!("invalid request: {e}")))?;
    Ok((parts.headers, value))
}
