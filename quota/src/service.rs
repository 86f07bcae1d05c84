//! The HTTP API: `POST /v1/lease`, `GET /healthz`, `GET /metrics`.

use crate::metrics::{Metrics, Outcome};
use crate::store::{Store, StoreError};
use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tollgate_core::lease::{ErrorBody, LeaseRequest, LeaseResponse};

pub struct Service {
    pub store: Store,
    /// Shared secret callers must present as `Authorization: Bearer <token>`.
    pub token: Option<String>,
    pub lease_ttl_ms: u64,
    pub metrics: Metrics,
    /// A lease call's body must arrive within this long.
    pub body_timeout: Duration,
}

/// Largest lease call body accepted (1 000 items of the longest names fit).
pub const MAX_BODY: usize = 2 << 20;

pub fn router(service: Arc<Service>) -> Router {
    Router::new()
        .route("/v1/lease", post(lease))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/metrics", get(metrics))
        .with_state(service)
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (
        status,
        Json(ErrorBody {
            error: message.into(),
        }),
    )
        .into_response()
}

fn authorized(service: &Service, headers: &HeaderMap) -> bool {
    let Some(token) = &service.token else {
        return true;
    };
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|given| constant_time_eq(given.as_bytes(), token.as_bytes()))
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// True for `application/json` (with parameters or not): what the filter sends, and what no
/// browser sends cross-site without asking first.
fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
}

async fn lease(State(service): State<Arc<Service>>, headers: HeaderMap, body: Body) -> Response {
    let started = Instant::now();
    let outcome = |o: &'static str| {
        service
            .metrics
            .calls
            .get_or_create(&Outcome { outcome: o })
            .inc()
    };
    if !authorized(&service, &headers) {
        outcome("unauthorized");
        return error(StatusCode::UNAUTHORIZED, "missing or wrong bearer token");
    }
    if !is_json(&headers) {
        outcome("bad_request");
        return error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "content-type must be application/json",
        );
    }
    let body = match tokio::time::timeout(
        service.body_timeout,
        axum::body::to_bytes(body, MAX_BODY),
    )
    .await
    {
        Ok(Ok(body)) => body,
        Ok(Err(_)) => {
            outcome("bad_request");
            return error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the body must be at most {MAX_BODY} bytes"),
            );
        }
        Err(_) => {
            outcome("bad_request");
            return error(
                StatusCode::REQUEST_TIMEOUT,
                format!("the body did not arrive within {:?}", service.body_timeout),
            );
        }
    };
    let request: LeaseRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            outcome("bad_request");
            return error(
                StatusCode::BAD_REQUEST,
                format!("invalid lease request: {e}"),
            );
        }
    };
    if let Some(problem) = request.problem() {
        outcome("bad_request");
        return error(StatusCode::BAD_REQUEST, problem);
    }
    let result = service
        .store
        .lease(&request.instance, &request.items, service.lease_ttl_ms)
        .await;
    service
        .metrics
        .latency
        .observe(started.elapsed().as_secs_f64());
    match result {
        Ok(grants) => {
            outcome("ok");
            service.metrics.items.inc_by(grants.len() as u64);
            for g in &grants {
                service.metrics.granted.inc_by(g.granted);
                service
                    .metrics
                    .reserved
                    .inc_by((g.rate * g.ttl_ms as f64 / 1_000.0).ceil() as u64);
                if g.granted == 0 && g.rate == 0.0 {
                    service.metrics.denials.inc();
                }
            }
            Json(LeaseResponse { items: grants }).into_response()
        }
        Err(e) => {
            outcome("storage_error");
            service.metrics.storage_errors.inc();
            tracing::warn!(error = %e, "lease call failed");
            let status = match e {
                StoreError::Full(_) | StoreError::Timeout(_) | StoreError::Failed(_) => {
                    StatusCode::SERVICE_UNAVAILABLE
                }
            };
            error(status, e.to_string())
        }
    }
}

async fn metrics(State(service): State<Arc<Service>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        service.metrics.render(),
    )
        .into_response()
}
