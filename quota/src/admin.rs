//! The operators' API (`/admin/v1/…`, only with `--admin-token`, never with a proxy's token): the
//! limits served lately and their busiest keys, one bucket's state, and its reset.

use crate::busiest::{LimitReport, KEYS_PER_LIMIT, WINDOW_MS};
use crate::service::{error, Service};
use crate::store::{now_ms, BucketState, StoreError};
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use tollgate_core::bearer::{bearer_token, constant_time_eq};

/// The admin API's own token: at least this long.
pub const MIN_ADMIN_TOKEN: usize = 16;

/// Check `--admin-token` against the proxies' credentials: long enough, and none of theirs (a
/// proxy's token must never open the admin API).
pub fn check_admin_token(token: &str, proxy_tokens: &[&str]) -> Result<(), String> {
    if token.len() < MIN_ADMIN_TOKEN {
        return Err(format!(
            "--admin-token must be at least {MIN_ADMIN_TOKEN} bytes long"
        ));
    }
    if proxy_tokens.contains(&token) {
        return Err(
            "--admin-token must differ from --token and every --proxy-token: a proxy's token \
             must not open the admin API"
                .into(),
        );
    }
    Ok(())
}

struct Admin {
    service: Arc<Service>,
    token: String,
}

/// The admin routes, answering only calls with `Authorization: Bearer <token>`.
pub fn router(service: Arc<Service>, token: String) -> Router {
    Router::new()
        .route("/admin/v1/limits", get(limits))
        .route("/admin/v1/buckets/{limit_id}/{key}", get(bucket))
        .route("/admin/v1/buckets/{limit_id}/{key}/reset", post(reset))
        .with_state(Arc::new(Admin { service, token }))
}

/// None if the call carries the admin token; else the answer (401).
fn refuse_unless_admin(admin: &Admin, headers: &HeaderMap) -> Option<Response> {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| bearer_token(v.as_bytes()));
    match given {
        Some(given) if constant_time_eq(given, admin.token.as_bytes()) => None,
        _ => Some(error(
            StatusCode::UNAUTHORIZED,
            "the admin API needs the admin token (--admin-token); a proxy's token is not one",
        )),
    }
}

#[derive(Deserialize)]
struct LimitsQuery {
    limit_id: Option<String>,
    top: Option<usize>,
}

#[derive(Serialize)]
struct LimitsAnswer {
    /// The busiest keys are those of the current window and the one before (ms each).
    window_ms: u64,
    limits: Vec<LimitReport>,
}

async fn limits(
    State(admin): State<Arc<Admin>>,
    headers: HeaderMap,
    q: Result<Query<LimitsQuery>, QueryRejection>,
) -> Response {
    if let Some(refused) = refuse_unless_admin(&admin, &headers) {
        return refused;
    }
    let Ok(Query(q)) = q else {
        return error(
            StatusCode::BAD_REQUEST,
            "the query is limit_id=ID and top=N (a whole number, 1 to 32), each at most once",
        );
    };
    let top = q.top.unwrap_or(10).clamp(1, KEYS_PER_LIMIT);
    let limits = admin
        .service
        .metrics
        .busiest
        .report(q.limit_id.as_deref(), top, now_ms());
    Json(LimitsAnswer {
        window_ms: WINDOW_MS,
        limits,
    })
    .into_response()
}

#[derive(Serialize)]
struct HolderView {
    instance: String,
    /// Tokens it asked for with its last call.
    wanted: u64,
    /// The refill rate it asked for and the rate reserved for it (tokens per second).
    demand_per_s: f64,
    share_per_s: f64,
    asked_ms: u64,
    /// Its reservation holds until then.
    until_ms: u64,
    /// Tokens granted to it and not given back.
    outstanding: u64,
}

#[derive(Serialize)]
struct BucketView {
    limit_id: String,
    key: String,
    found: bool,
    /// Tokens as of `updated_ms` (below zero: owed; none while a reset is pending) and the
    /// reserve kept for proxies within their fair share.
    tokens: Option<f64>,
    reserve: f64,
    debt: u64,
    updated_ms: u64,
    /// Tokens it holds now, refilled at the limit's rate since `updated_ms` (when this service
    /// has served the limit lately, and so knows its rate and burst).
    #[serde(skip_serializing_if = "Option::is_none")]
    tokens_now: Option<f64>,
    /// Reset, and not yet refilled by a call (it is full at the next).
    reset_pending: bool,
    holders: Vec<HolderView>,
    epoch_ms: Option<u64>,
    lost: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    expires_in_ms: Option<u64>,
    now_ms: u64,
}

fn view(admin: &Admin, limit_id: String, key: String, state: BucketState) -> BucketView {
    let now = now_ms();
    let b = state.bucket.clone().unwrap_or_default();
    let tokens_now = match (
        &state.bucket,
        admin.service.metrics.busiest.limit(&limit_id),
    ) {
        (Some(bucket), Some(item)) => Some(bucket.tokens_at(&item, now)),
        _ => None,
    };
    BucketView {
        found: state.bucket.is_some(),
        tokens: (!b.is_reset_pending()).then_some(b.tokens),
        reserve: b.reserve,
        debt: b.debt(),
        updated_ms: b.updated_ms,
        tokens_now,
        reset_pending: b.is_reset_pending(),
        holders: b
            .holders
            .iter()
            .map(|h| HolderView {
                instance: h.instance.clone(),
                wanted: h.wanted,
                demand_per_s: h.demand as f64 / 1e3,
                share_per_s: h.share as f64 / 1e3,
                asked_ms: h.asked_ms,
                until_ms: h.until_ms,
                outstanding: h.outstanding,
            })
            .collect(),
        epoch_ms: state.epoch_ms,
        lost: state.lost,
        expires_in_ms: state.expires_in_ms,
        now_ms: now,
        limit_id,
        key,
    }
}

/// A bucket's view (404 if the store has none), or the store's failure (503).
fn answer(
    admin: &Admin,
    limit_id: String,
    key: String,
    state: Result<BucketState, StoreError>,
) -> Response {
    match state {
        Ok(state) => {
            let status = if state.bucket.is_some() {
                StatusCode::OK
            } else {
                StatusCode::NOT_FOUND
            };
            (status, Json(view(admin, limit_id, key, state))).into_response()
        }
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

async fn bucket(
    State(admin): State<Arc<Admin>>,
    headers: HeaderMap,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Response {
    look_or_reset(&admin, &headers, path, false).await
}

async fn reset(
    State(admin): State<Arc<Admin>>,
    headers: HeaderMap,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Response {
    look_or_reset(&admin, &headers, path, true).await
}

/// The bucket the call names, or (`reset`) its reset, once the call is an admin's.
async fn look_or_reset(
    admin: &Admin,
    headers: &HeaderMap,
    path: Result<Path<(String, String)>, PathRejection>,
    reset: bool,
) -> Response {
    if let Some(refused) = refuse_unless_admin(admin, headers) {
        return refused;
    }
    let Ok(Path((limit_id, key))) = path else {
        return error(
            StatusCode::BAD_REQUEST,
            "the limit id and the key must be UTF-8",
        );
    };
    let store = &admin.service.store;
    if !reset {
        let state = store.bucket(&limit_id, &key).await;
        return answer(admin, limit_id, key, state);
    }
    let state = store.reset(&limit_id, &key).await;
    if matches!(&state, Ok(s) if s.bucket.is_some()) {
        tracing::info!(%limit_id, %key, "bucket reset by the admin API");
    }
    answer(admin, limit_id, key, state)
}
