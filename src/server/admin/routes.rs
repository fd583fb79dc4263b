//! The admin port's routes: `/metrics`, `/healthz`, `/readyz`, `/debug/pods`,
//! `POST /debug/explain`, `GET /debug/explain?id=`, `GET /debug/index/snapshot`. Who may call them, and what they may cost:
//! [`super`].

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use prometheus_client::registry::Registry;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::time::Instant;

use crate::budget::BodyBudget;
use crate::decide::{DecideRequest, Decider};
use crate::extproc::reply::Rejection;
use crate::observe::Receipts;
use crate::pods::{prefill_models, PodRegistry};
use crate::scoring::SessionStore;
use crate::server::fds::ConnCaps;
use crate::server::readiness::Readiness;

/// What the admin handlers read.
#[derive(Clone)]
pub struct AdminState {
    /// Metric registry.
    pub registry: Arc<Registry>,
    /// Pods.
    pub pods: Arc<PodRegistry>,
    /// Decision path (for explain).
    pub decider: Arc<Decider>,
    /// Sessions (sizes only).
    pub sessions: Arc<SessionStore>,
    /// Recent decisions by id (`receipts.enabled`).
    pub receipts: Option<Arc<Receipts>>,
    /// Metrics older than this are stale.
    pub stale_after: Duration,
    /// Routing mode description.
    pub mode: &'static str,
    /// `/readyz`: the same rule as the gRPC health services.
    pub readiness: Readiness,
    /// Largest `POST /debug/explain` input: the configured body limit plus room for its JSON
    /// wrapping (axum's own default is 2 MB).
    pub body_limit: usize,
    /// What explain inputs being read may hold at once, all callers together.
    pub bodies: BodyBudget,
    /// Bearer token `/debug/*` requires; `None` = open.
    pub token: Option<Arc<str>>,
    /// Both ports' connection caps, for `/debug/pods`.
    pub caps: ConnCaps,
    /// `GET /debug/index/snapshot`: one at a time, at most so many entries.
    pub snapshots: IndexSnapshots,
}

/// What `GET /debug/index/snapshot` may cost: one snapshot built at a time (a second caller gets
/// 503), of at most `index.warm_start.max_entries` entries.
#[derive(Clone)]
pub struct IndexSnapshots {
    one: Arc<tokio::sync::Semaphore>,
    max_entries: usize,
}

impl IndexSnapshots {
    /// Snapshots of at most `max_entries` entries.
    pub fn new(max_entries: usize) -> Self {
        Self {
            one: Arc::new(tokio::sync::Semaphore::new(1)),
            max_entries,
        }
    }
}

/// The admin router.
pub fn router(state: AdminState) -> Router {
    let limit = axum::extract::DefaultBodyLimit::max(state.body_limit);
    let debug = Router::new()
        .route("/debug/pods", get(debug_pods))
        .route("/debug/index/snapshot", get(index_snapshot))
        .route(
            "/debug/explain",
            post(explain)
                .layer(limit)
                .layer(axum::middleware::from_fn_with_state(
                    (state.bodies.clone(), state.body_limit),
                    reserve_body,
                ))
                // A lookup reads no body: it reserves none.
                .get(explain_by_id),
        )
        .route_layer(axum::middleware::from_fn_with_state(
            state.token.clone(),
            require_token,
        ));
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .merge(debug)
        .with_state(state)
}

/// `/debug/*` shows pod addresses and explains decisions: with a token configured, only
/// callers presenting it get in.
/// An explain input's bytes are reserved from the body budget before any is read: its
/// Content-Length, or the whole explain limit when it has none (chunked). Past the budget: 503.
async fn reserve_body(
    State((bodies, limit)): State<(BodyBudget, usize)>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let announced = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
        .unwrap_or(limit)
        .min(limit);
    let mut held = bodies.reservation();
    if !held.grow(announced) {
        let msg = json!({"error": {"message": "the router's buffered-body budget is spent (server.max_buffered_body_bytes); retry later", "type": "ServiceUnavailableError", "param": null, "code": 503}});
        return (StatusCode::SERVICE_UNAVAILABLE, Json(msg)).into_response();
    }
    let response = next.run(req).await;
    drop(held);
    response
}

async fn require_token(
    State(token): State<Option<Arc<str>>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(token) = token else {
        return next.run(req).await;
    };
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    if constant_time_eq(presented.as_bytes(), token.as_bytes()) {
        next.run(req).await
    } else {
        (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Bearer")],
            "admin token required",
        )
            .into_response()
    }
}

/// Equality whose time does not depend on where the inputs differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn metrics(State(s): State<AdminState>) -> Response {
    let mut out = String::new();
    match prometheus_client::encoding::text::encode(&mut out, &s.registry) {
        Ok(()) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            out,
        )
            .into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

async fn readyz(State(s): State<AdminState>) -> Response {
    match s.readiness.check() {
        Ok(()) => "ready".into_response(),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, why).into_response(),
    }
}

/// The index's entries for a starting replica (`index.warm_start`): block keys, pod addresses
/// and the time each entry has left, as `crate::index::warm` encodes them. Built off the async
/// workers, one at a time.
async fn index_snapshot(State(s): State<AdminState>) -> Response {
    let error = |status: StatusCode, message: &str| {
        let msg = json!({"error": {"message": message, "code": status.as_u16()}});
        (status, Json(msg)).into_response()
    };
    let Ok(permit) = s.snapshots.one.clone().try_acquire_owned() else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "another index snapshot is being built; retry later",
        );
    };
    let (decider, max) = (s.decider.clone(), s.snapshots.max_entries);
    let built = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        let snap = decider.index().warm_snapshot(decider.now_ms(), max)?;
        Some(crate::index::warm::encode(&snap))
    })
    .await;
    match built {
        Ok(Some(body)) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Ok(None) => error(
            StatusCode::NOT_FOUND,
            "this index hands over no snapshot (only the memory backend in approximate mode does)",
        ),
        Err(_) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "building the snapshot failed",
        ),
    }
}

async fn debug_pods(State(s): State<AdminState>) -> Json<Value> {
    let now = Instant::now();
    let snapshot = s.pods.snapshot();
    let models = prefill_models(snapshot.pods(), s.decider.ttft_prior());
    let pods: Vec<Value> = snapshot
        .pods()
        .iter()
        .zip(models)
        .map(|(p, model)| {
            let sample = p.last_sample();
            let (excluded_until, exclusions) = p.prefill_exclusion(now);
            json!({
                "address": p.id(),
                "healthy": p.is_healthy(),
                "models": p.models(),
                "labels": p.spec.labels,
                "role": p.role(),
                // Excluded from prefill picks for this long (prefills sent it went unserved).
                "prefill_excluded_for_ms": excluded_until
                    .map(|t| t.saturating_duration_since(now).as_millis() as u64),
                "prefill_exclusions": exclusions,
                "engine": p.engine().current(),
                "engine_setting": p.engine().setting(),
                "engine_setting_from": p.engine().setting_from(),
                "load": p.load(now, s.stale_after),
                "prefill_model": model,
                "hit_accuracy": p.hit_accuracy(),
                "lora": p.lora_report(now),
                "metrics": sample.map(|(_, m)| m),
                "metrics_age_ms": sample.map(|(t, _)| now.saturating_duration_since(t).as_millis() as u64),
            })
        })
        .collect();
    Json(json!({
        "mode": s.mode,
        "index": { "backend": s.decider.index().describe(), "stats": s.decider.index().stats() },
        "sessions": s.sessions.len(),
        "connections": s.caps,
        "pods": pods,
    }))
}

/// `GET /debug/explain?id=<decision id>`: a recent decision as its receipt named it.
#[derive(Debug, Deserialize)]
pub struct ExplainId {
    /// The decision id (16 hex digits, as in the receipt).
    pub id: Option<String>,
}

fn admin_error(status: StatusCode, message: &str) -> Response {
    let msg = json!({"error": {"message": message, "type": "BadRequestError", "param": null, "code": status.as_u16()}});
    (status, Json(msg)).into_response()
}

async fn explain_by_id(
    State(s): State<AdminState>,
    axum::extract::Query(q): axum::extract::Query<ExplainId>,
) -> Response {
    let Some(receipts) = &s.receipts else {
        return admin_error(
            StatusCode::NOT_FOUND,
            "decisions are kept only with receipts.enabled",
        );
    };
    let Some(id) = q.id.as_deref() else {
        return admin_error(
            StatusCode::BAD_REQUEST,
            "GET /debug/explain needs ?id=<decision id>; POST a request to plan one",
        );
    };
    let parsed = if !id.is_empty() && id.len() <= 16 && id.bytes().all(|b| b.is_ascii_hexdigit()) {
        u64::from_str_radix(id, 16).ok()
    } else {
        None
    };
    let Some(id) = parsed else {
        return admin_error(
            StatusCode::BAD_REQUEST,
            "a decision id is 1 to 16 hex digits",
        );
    };
    match receipts.get(id) {
        Some(summary) => Json(summary).into_response(),
        None => admin_error(
            StatusCode::NOT_FOUND,
            "no such decision among the recent ones (receipts.recent_decisions)",
        ),
    }
}

/// `POST /debug/explain` input: the request as Envoy would show it.
#[derive(Debug, Deserialize)]
pub struct ExplainInput {
    /// Request path.
    #[serde(default = "default_path")]
    pub path: String,
    /// Headers.
    #[serde(default)]
    pub headers: std::collections::BTreeMap<String, String>,
    /// The body: a JSON value (sent as is) or a string (raw body text); absent = no body.
    #[serde(default)]
    pub body: Option<Value>,
}

fn default_path() -> String {
    "/v1/chat/completions".into()
}

// Any content type is accepted: this is an operator's curl target.
async fn explain(State(s): State<AdminState>, raw: axum::body::Bytes) -> Response {
    let input: ExplainInput = match serde_json::from_slice(&raw) {
        Ok(i) => i,
        Err(e) => {
            let msg = json!({"error": {"message": format!("explain input is not valid JSON: line {}, column {}", e.line(), e.column()), "type": "BadRequestError", "param": null, "code": 400}});
            return (StatusCode::BAD_REQUEST, Json(msg)).into_response();
        }
    };
    let headers: Vec<(String, String)> = input
        .headers
        .into_iter()
        .map(|(k, v)| (k.to_ascii_lowercase(), v))
        .collect();
    let body: Option<Vec<u8>> = input.body.map(|b| match b {
        Value::String(s) => s.into_bytes(),
        other => other.to_string().into_bytes(),
    });
    // Plan only: explaining a request records nothing.
    let result = s
        .decider
        .plan(DecideRequest {
            path: &input.path,
            headers: &headers,
            body: body.as_deref(),
            subset: None,
        })
        .await;
    match result {
        Ok(d) => Json(json!({
            "destination": d.plan.destination(),
            "reason": d.plan.reason,
            "model": d.model,
            "total_blocks": d.plan.total_blocks,
            "pd": d.plan.pd,
            "ranked": d.plan.ranked.iter().map(|r| json!({
                "pod": r.pod,
                "total": r.total,
                "scores": r.scores.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
                "matched_blocks": r.matched_blocks,
                "saturated": r.saturated,
            })).collect::<Vec<_>>(),
        }))
        .into_response(),
        Err(e) => {
            // The same status and body the client would get through Envoy.
            let r = Rejection::from(e);
            (
                StatusCode::from_u16(r.status()).unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
                [(header::CONTENT_TYPE, "application/json")],
                r.openai_body(),
            )
                .into_response()
        }
    }
}
