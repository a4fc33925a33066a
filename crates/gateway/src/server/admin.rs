//! The admin API: `/debug/route`, `/workers`, `/busy_threshold`, and who may call them.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Path, Request, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use http::StatusCode;
use kvroute_protocol::RoutingFields;

use super::Gateway;
use crate::auth;
use crate::busy::{BusyControl, ThresholdsBody};
use crate::config::{WorkerSource, WorkerSpec};
use crate::context::AppState;
use crate::error::GatewayError;
use crate::proxy::read_body;
use crate::routing;
/// `POST /debug/route`: the decision the router would make for this request, with every
/// candidate's terms, without sending it or changing any state.
pub(super) async fn debug_route(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let result = async {
        check_admin(&state, &req, false).await?;
        let (parts, body) = req.into_parts();
        let body = read_body(body, state.settings.max_payload_size, &parts.headers).await?;
        let fields = RoutingFields::from_json(&body).map_err(GatewayError::InvalidJson)?;
        let shortest = state.workers.table().shortest_context();
        let tokens = routing::tokens_for(&state.kv, state.settings.policy, &body, shortest).await;
        let hints = routing::parse_hints(&parts.headers, &state.settings.workers, &fields)?;
        let table = state.workers.table();
        let pool = table.resolve(fields.model.as_deref())?;
        let busy = state.busy.get(pool.model.as_str());
        let plan = routing::plan(
            &state.kv,
            pool,
            routing::session_key(&state.settings.routing_key_headers, &parts.headers, &fields),
            &hints,
            &routing::Limits {
                busy,
                overload: state.settings.overload,
                slo_shed: state.settings.slo_shed,
            },
            state.affinity.as_deref(),
            &fields,
            &tokens,
            Instant::now(),
            true,
        )?;
        Ok::<_, GatewayError>(Json(crate::recent::plan_json(&plan, state.kv.block_size)))
    }
    .await;
    match result {
        Ok(json) => json.into_response(),
        Err(e) => e.into_response(),
    }
}

/// Admin calls: with `--admin-api-key`, the key as a bearer token; without, changes only
/// from loopback (reads from anywhere). With JWT on, also a token whose role is admin (403
/// for another valid token), and nothing without a credential.
pub(super) fn check_admin<'a>(
    state: &'a AppState,
    req: &Request,
    mutating: bool,
) -> impl std::future::Future<Output = Result<(), GatewayError>> + Send + 'a {
    // What the check reads, taken now: a `&Request` is not `Send` across the await.
    let (peer, headers) = (auth::peer(req.extensions()), req.headers().clone());
    let key = state.settings.admin_api_key.as_ref();
    async move {
        (state.access.admin(key, &headers, peer, mutating).await)
            .map_err(|r| GatewayError::refused(r, true))
    }
}

/// `POST /workers`: adds a worker (the config file's worker schema, as JSON).
pub(super) async fn add_worker(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let result = async {
        check_admin(&state, &req, true).await?;
        let (parts, body) = req.into_parts();
        let body = read_body(body, 1 << 20, &parts.headers).await?;
        let mut spec: WorkerSpec =
            serde_json::from_slice(&body).map_err(|e| GatewayError::InvalidAdmin(e.to_string()))?;
        spec.source = WorkerSource::Admin;
        let worker = Gateway {
            state: state.clone(),
        }
        .add_worker(spec)?;
        Ok::<_, GatewayError>(
            (
                StatusCode::CREATED,
                Json(serde_json::json!({"id": worker.id.as_str(), "url": worker.url})),
            )
                .into_response(),
        )
    }
    .await;
    result.unwrap_or_else(|e| e.into_response())
}

/// `DELETE /workers/{id}`: removes a worker; its in-flight requests finish.
pub(super) async fn remove_worker(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    req: Request,
) -> Response {
    let result = check_admin(&state, &req, true).await.and_then(|()| {
        let worker = super::background::remove_worker(&state, &id)?;
        Ok(Json(serde_json::json!({
            "id": worker.id.as_str(),
            "removed": true,
            "draining": worker.in_flight(),
        }))
        .into_response())
    });
    result.unwrap_or_else(|e| e.into_response())
}

/// `GET /busy_threshold`: the thresholds in force for every model.
pub(super) async fn get_busy(State(state): State<Arc<AppState>>, req: Request) -> Response {
    if let Err(e) = check_admin(&state, &req, false).await {
        return e.into_response();
    }
    let table = state.workers.table();
    let thresholds: Vec<_> = table
        .models()
        .map(|m| BusyControl::body(m, &state.busy.get(m)))
        .collect();
    Json(serde_json::json!({"thresholds": thresholds})).into_response()
}

/// `POST /busy_threshold`: sets the given fields for one model; omitted fields are a read.
pub(super) async fn set_busy(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let result = async {
        check_admin(&state, &req, true).await?;
        let (parts, body) = req.into_parts();
        let body = read_body(body, 1 << 20, &parts.headers).await?;
        let update: ThresholdsBody =
            serde_json::from_slice(&body).map_err(|e| GatewayError::InvalidAdmin(e.to_string()))?;
        if update
            .active_decode_blocks_threshold
            .is_some_and(|f| !(0.0..=1.0).contains(&f))
        {
            return Err(GatewayError::InvalidAdmin(
                "active_decode_blocks_threshold must be between 0 and 1".into(),
            ));
        }
        if update
            .active_prefill_tokens_threshold_frac
            .is_some_and(|f| !(f.is_finite() && f >= 0.0))
        {
            return Err(GatewayError::InvalidAdmin(
                "active_prefill_tokens_threshold_frac must be a non-negative number".into(),
            ));
        }
        if !state.workers.table().models().any(|m| m == update.model) {
            return Err(GatewayError::UnknownModel(update.model));
        }
        let now = state.busy.set(&update);
        tracing::info!(model = %update.model, thresholds = ?now, "Busy thresholds set");
        Ok(Json(BusyControl::body(&update.model, &now)))
    }
    .await;
    match result {
        Ok(json) => json.into_response(),
        Err(e) => e.into_response(),
    }
}

pub(super) async fn workers(State(state): State<Arc<AppState>>, req: Request) -> Response {
    if let Err(e) = check_admin(&state, &req, false).await {
        return e.into_response();
    }
    Json(serde_json::json!({"workers": state.workers.statuses()})).into_response()
}
