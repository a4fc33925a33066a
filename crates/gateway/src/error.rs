//! The gateway's errors, and the one place they become HTTP responses.
//!
//! Each variant is one case of PRODUCT.md's error table, with its status and its distinct
//! `code`; upstream failures keep their cause and the worker that failed, which is named in
//! the response's `x-kvroute-worker` header.

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode};
use kvroute_protocol::{ErrorBody, WorkerId};

use crate::http::WORKER_HEADER;

/// smg's header naming a gateway error's code.
pub const SMG_ERROR_CODE_HEADER: &str = "x-smg-error-code";

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("invalid JSON body: {0}")]
    InvalidJson(#[source] serde_json::Error),
    #[error("request body is larger than the limit of {limit} bytes")]
    PayloadTooLarge { limit: usize },
    #[error("cannot read request body: {0}")]
    BodyRead(#[source] BoxError),
    #[error("the model field is required: this router serves several models ({models})")]
    ModelRequired { models: String },
    #[error("model '{0}' is not served by any worker")]
    UnknownModel(String),
    #[error("no worker available: {0}")]
    NoEndpoint(&'static str),
    #[error("worker {worker} failed: {source}")]
    Upstream {
        worker: WorkerId,
        #[source]
        source: BoxError,
    },
    #[error("worker {worker} did not answer within {secs} s")]
    UpstreamTimeout { worker: WorkerId, secs: u64 },
    #[error("worker {worker} answered HTTP {status}")]
    UpstreamStatus { worker: WorkerId, status: u16 },
    #[error("no route for {0}")]
    NotFound(String),
    #[error("invalid {header} header: {reason}")]
    InvalidHint {
        header: &'static str,
        reason: String,
    },
    #[error("invalid pin: {0}")]
    InvalidPin(String),
    #[error("every compatible worker is overloaded")]
    AllWorkersOverloaded,
    #[error("the pinned worker is overloaded")]
    PinnedWorkerOverloaded,
    /// smg's overload protection with `--worker-overload-shed`.
    #[error("every compatible worker is overloaded (its engine's waiting requests or KV usage)")]
    OverloadShed,
    #[error("{0}")]
    Unauthorized(&'static str),
    /// A valid credential that may not make this call (a user-role token on the admin API).
    #[error("{0}")]
    Forbidden(&'static str),
    #[error("invalid admin request: {0}")]
    InvalidAdmin(String),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("policy class '{0}' has no room in the queue")]
    QueueFull(String),
    #[error("waited longer than {0} s in the queue")]
    QueueTimeout(u64),
    /// Cancelled before its first byte to let a higher priority class go (smg's preemption).
    #[error("request preempted by higher-priority traffic")]
    Preempted,
    #[error(
        "the router is at its limit of {0} concurrent requests, and its admission queue is full"
    )]
    TooManyRequests(usize),
    #[error("waited longer than {0} s for admission")]
    AdmissionTimeout(u64),
    /// Over the tenant's rate limit (`--tenant-rate-limit-config`): enough refills in
    /// `retry_after` seconds, or never (`None`: the request is larger than a bucket).
    #[error("{}", match retry_after {
        Some(secs) => format!("the tenant's rate limit is exceeded; enough refills in {secs} s"),
        None => "the request needs more tokens than the tenant's rate limit allows in a minute: it can never be admitted".to_owned(),
    })]
    TenantRateLimited { retry_after: Option<u64> },
    #[error("no worker with id '{0}'")]
    UnknownWorker(String),
    #[error("a worker with id '{0}' exists already")]
    WorkerExists(String),
    #[error("the router is shutting down")]
    ShuttingDown,
    /// No candidate is predicted to meet the request's latency targets, with `--slo-shed`.
    #[error("no worker is predicted to meet the request's latency targets: {0}")]
    SloUnattainable(String),
}

impl GatewayError {
    /// A refused call's error: 403 for a valid token without the admin role, else 401;
    /// `admin` chooses the message.
    pub fn refused(refusal: crate::auth::Refusal, admin: bool) -> Self {
        match refusal {
            crate::auth::Refusal::NotAdmin => GatewayError::Forbidden(refusal.message(admin)),
            _ => GatewayError::Unauthorized(refusal.message(admin)),
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            GatewayError::InvalidJson(_) | GatewayError::ModelRequired { .. } => {
                StatusCode::BAD_REQUEST
            }
            GatewayError::BodyRead(_)
            | GatewayError::InvalidHint { .. }
            | GatewayError::InvalidPin(_)
            | GatewayError::InvalidAdmin(_)
            | GatewayError::InvalidRequest(_) => StatusCode::BAD_REQUEST,
            GatewayError::AllWorkersOverloaded
            | GatewayError::PinnedWorkerOverloaded
            | GatewayError::OverloadShed
            | GatewayError::SloUnattainable(_) => StatusCode::SERVICE_UNAVAILABLE,
            GatewayError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            GatewayError::Forbidden(_) => StatusCode::FORBIDDEN,
            GatewayError::QueueFull(_)
            | GatewayError::TooManyRequests(_)
            | GatewayError::TenantRateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            GatewayError::UnknownWorker(_) => StatusCode::NOT_FOUND,
            GatewayError::WorkerExists(_) => StatusCode::CONFLICT,
            GatewayError::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
            GatewayError::QueueTimeout(_)
            | GatewayError::AdmissionTimeout(_)
            | GatewayError::Preempted => StatusCode::SERVICE_UNAVAILABLE,
            GatewayError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            GatewayError::UnknownModel(_) | GatewayError::NotFound(_) => StatusCode::NOT_FOUND,
            GatewayError::NoEndpoint(_) => StatusCode::SERVICE_UNAVAILABLE,
            GatewayError::Upstream { .. } | GatewayError::UpstreamStatus { .. } => {
                StatusCode::BAD_GATEWAY
            }
            GatewayError::UpstreamTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    /// The distinct `code` of the error body.
    pub fn code(&self) -> &'static str {
        match self {
            GatewayError::InvalidJson(_) => "invalid_json",
            GatewayError::BodyRead(_) => "invalid_body",
            GatewayError::PayloadTooLarge { .. } => "payload_too_large",
            GatewayError::ModelRequired { .. } => "model_required",
            GatewayError::UnknownModel(_) => "model_not_found",
            GatewayError::NoEndpoint(_) => "no_endpoint",
            GatewayError::Upstream { .. } | GatewayError::UpstreamStatus { .. } => "upstream_error",
            GatewayError::UpstreamTimeout { .. } => "upstream_timeout",
            GatewayError::NotFound(_) => "not_found",
            GatewayError::InvalidHint { .. } => "invalid_hint",
            GatewayError::InvalidPin(_) => "invalid_pin",
            GatewayError::AllWorkersOverloaded => "all_workers_overloaded",
            GatewayError::PinnedWorkerOverloaded => "pinned_worker_overloaded",
            GatewayError::OverloadShed => "worker_overload_protection_shed",
            GatewayError::Unauthorized(_) => "unauthorized",
            GatewayError::Forbidden(_) => "forbidden",
            GatewayError::InvalidAdmin(_) | GatewayError::InvalidRequest(_) => "invalid_request",
            GatewayError::QueueFull(_) => "queue_full",
            GatewayError::QueueTimeout(_) => "queue_timeout",
            GatewayError::Preempted => "scheduler_preempted",
            GatewayError::TooManyRequests(_) => "too_many_requests",
            GatewayError::AdmissionTimeout(_) => "admission_timeout",
            GatewayError::TenantRateLimited { .. } => "tenant_rate_limit_exceeded",
            GatewayError::UnknownWorker(_) => "worker_not_found",
            GatewayError::WorkerExists(_) => "worker_exists",
            GatewayError::ShuttingDown => "shutting_down",
            GatewayError::SloUnattainable(_) => "slo_unattainable",
        }
    }

    fn kind(&self) -> &'static str {
        if self.status().is_server_error() {
            "server_error"
        } else {
            "invalid_request_error"
        }
    }

    fn worker(&self) -> Option<&WorkerId> {
        match self {
            GatewayError::Upstream { worker, .. }
            | GatewayError::UpstreamTimeout { worker, .. }
            | GatewayError::UpstreamStatus { worker, .. } => Some(worker),
            _ => None,
        }
    }

    /// The message, with the cause chain of upstream errors (hyper's top-level message
    /// alone says little).
    fn message(&self) -> String {
        let mut msg = self.to_string();
        if self.worker().is_some() {
            let mut cause = std::error::Error::source(self).and_then(|s| s.source());
            while let Some(c) = cause {
                msg.push_str(": ");
                msg.push_str(&c.to_string());
                cause = c.source();
            }
        }
        msg
    }
}

impl IntoResponse for GatewayError {
    fn into_response(self) -> Response {
        let body = serde_json::to_value(ErrorBody::new(self.message(), self.kind(), self.code()))
            .expect("an error body serialises");
        self.respond(body)
    }
}

impl GatewayError {
    /// The answer on Anthropic's routes: `{"type": "error", "error": {"type", "message"}}`,
    /// the type named after the status as Anthropic names it.
    pub fn into_anthropic_response(self) -> Response {
        let body = kvroute_protocol::anthropic::error_body(self.status().as_u16(), &self.message());
        self.respond(body)
    }

    fn respond(self, body: serde_json::Value) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::warn!(error = %self.message(), code = self.code(), "Request failed");
        } else {
            tracing::debug!(error = %self, code = self.code(), "Request rejected");
        }
        let retry = matches!(
            self,
            GatewayError::AllWorkersOverloaded
                | GatewayError::OverloadShed
                | GatewayError::SloUnattainable(_)
                | GatewayError::TooManyRequests(_)
                | GatewayError::AdmissionTimeout(_)
                | GatewayError::ShuttingDown
                | GatewayError::Preempted
        );
        let mut response = (status, axum::Json(body)).into_response();
        if retry {
            response
                .headers_mut()
                .insert(http::header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if let GatewayError::Preempted = self {
            // smg's mark, so a client can tell a preemption from an overload.
            response
                .headers_mut()
                .insert("x-smg-preempted", HeaderValue::from_static("true"));
        }
        if let GatewayError::TenantRateLimited { retry_after } = self {
            // smg's code in smg's header; a wait only when one would help.
            let code = HeaderValue::from_static("tenant_rate_limit_exceeded");
            response.headers_mut().insert(SMG_ERROR_CODE_HEADER, code);
            if let Some(secs) = retry_after {
                response
                    .headers_mut()
                    .insert(http::header::RETRY_AFTER, HeaderValue::from(secs));
            }
        }
        if let Some(worker) = self.worker() {
            if let Ok(v) = HeaderValue::from_str(worker.as_str()) {
                response.headers_mut().insert(WORKER_HEADER, v);
            }
        }
        response
    }
}
