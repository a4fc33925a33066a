//! The OpenAI-style error body: `{"error": {"message", "type", "code"}}`.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetail {
    pub message: String,
    /// OpenAI's error class, e.g. `invalid_request_error`, `server_error`.
    #[serde(rename = "type")]
    pub kind: String,
    /// kvroute's distinct code for the case, e.g. `model_required`, `no_endpoint`.
    pub code: String,
}

impl ErrorBody {
    pub fn new(message: impl Into<String>, kind: &str, code: &str) -> Self {
        Self {
            error: ErrorDetail {
                message: message.into(),
                kind: kind.to_owned(),
                code: code.to_owned(),
            },
        }
    }
}
