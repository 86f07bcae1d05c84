//! The HTTP API: `POST /v1/lease`, `POST /v1/slots`, `GET /healthz`, `GET /metrics`.

use crate::calendar::CalendarClock;
use crate::credentials::{Caller, Credentials};
use crate::metrics::{Holder, Metrics, Outcome};
use crate::store::{Answers, Store, StoreError};
use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tollgate_core::global::lease::{
    merge_refused, ErrorBody, ItemError, LeaseGrant, LeaseRequest, LeaseResponse,
};
use tollgate_core::global::permits::{PermitAnswer, PermitRequest, PermitResponse};

pub struct Service {
    pub store: Store,
    /// Who may call (`Authorization: Bearer <token>`), and as which instances.
    pub credentials: Credentials,
    pub lease_ttl_ms: u64,
    pub metrics: Metrics,
    /// A lease call's body must arrive within this long.
    pub body_timeout: Duration,
    /// The clock calendar quotas' periods are read by.
    pub calendar: CalendarClock,
}

/// Largest lease call body accepted (1 000 items of the longest names fit).
pub const MAX_BODY: usize = 2 << 20;

pub fn router(service: Arc<Service>) -> Router {
    Router::new()
        .route("/v1/lease", post(lease))
        .route("/v1/slots", post(slots))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/metrics", get(metrics))
        .with_state(service)
}

/// An error answer: `{"error": message}`.
pub(crate) fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (
        status,
        Json(ErrorBody {
            error: message.into(),
        }),
    )
        .into_response()
}

fn caller(service: &Service, headers: &HeaderMap) -> Option<Caller> {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    service.credentials.caller(given)
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

/// A call's instance, bound to its caller's credential ([`Credentials::bind`]).
trait Call {
    fn instance(&mut self) -> &mut String;
}

impl Call for LeaseRequest {
    fn instance(&mut self) -> &mut String {
        &mut self.instance
    }
}

impl Call for PermitRequest {
    fn instance(&mut self) -> &mut String {
        &mut self.instance
    }
}

/// Check a call's credentials and type, read its JSON body and check it (`problem`), and bind
/// its instance to the caller; or the error to answer (counted in `calls` by outcome).
async fn read_call<T: serde::de::DeserializeOwned + Call>(
    service: &Service,
    calls: &Family<Outcome, Counter>,
    headers: &HeaderMap,
    body: Body,
    problem: impl Fn(&T) -> Option<String>,
) -> Result<T, Response> {
    let outcome = |o: &'static str| calls.get_or_create(&Outcome { outcome: o }).inc();
    let Some(caller) = caller(service, headers) else {
        outcome("unauthorized");
        return Err(error(
            StatusCode::UNAUTHORIZED,
            "missing or wrong bearer token",
        ));
    };
    if !is_json(headers) {
        outcome("bad_request");
        return Err(error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "content-type must be application/json",
        ));
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
            return Err(error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the body must be at most {MAX_BODY} bytes"),
            ));
        }
        Err(_) => {
            outcome("bad_request");
            return Err(error(
                StatusCode::REQUEST_TIMEOUT,
                format!("the body did not arrive within {:?}", service.body_timeout),
            ));
        }
    };
    let mut request: T = serde_json::from_slice(&body).map_err(|e| {
        outcome("bad_request");
        error(StatusCode::BAD_REQUEST, format!("invalid request: {e}"))
    })?;
    if let Some(p) = problem(&request) {
        outcome("bad_request");
        return Err(error(StatusCode::BAD_REQUEST, p));
    }
    match service.credentials.bind(&caller, request.instance()) {
        Ok(bound) => *request.instance() = bound,
        Err(e) => {
            outcome("forbidden");
            return Err(error(StatusCode::FORBIDDEN, e));
        }
    }
    Ok(request)
}

/// The name a bucket is stored under: the caller's `limit_id` bound to the whole limit the item
/// states, `<limit_id>.<n>.<n>…` in decimal. A caller that states another limit for a key reaches
/// another bucket, never rewrites the one the proxies of that limit use (one call with `burst: 1`
/// could cut their bucket to 1 token). The numbers themselves, not a hash of them: 32 bits of a
/// public hash let about 2^32 tries find another limit bound to the same name. Numbers hold no
/// `.`, so read from the right the name gives back its limit: no two limits share one.
pub fn bound_limit_id(limit_id: &str, limit: &[u64]) -> String {
    use std::fmt::Write;
    let mut bound = String::with_capacity(limit_id.len() + 21 * limit.len());
    bound.push_str(limit_id);
    for n in limit {
        // Writing to a String cannot fail.
        let _ = write!(bound, ".{n}");
    }
    bound
}

/// The items without a problem, in order, each `bind`ed: the ones the store serves.
fn serve<I>(items: Vec<I>, problems: &[Option<String>], bind: impl Fn(&mut I)) -> Vec<I> {
    items
        .into_iter()
        .zip(problems)
        .filter(|(_, p)| p.is_none())
        .map(|(mut item, _)| {
            bind(&mut item);
            item
        })
        .collect()
}

/// Fold the store's refusals of single items into the call's `problems` (one answer per item
/// that had none): the answers of the items it served, in order.
fn fold_refused<A>(problems: &mut [Option<String>], answers: Answers<A>) -> Vec<A> {
    let mut refused = answers.refused.into_iter().peekable();
    let mut served = Vec::new();
    let open = problems.iter_mut().filter(|p| p.is_none());
    for (n, (problem, answer)) in open.zip(answers.items).enumerate() {
        match refused.next_if(|(i, _)| *i == n) {
            Some((_, e)) => *problem = Some(e),
            None => served.push(answer),
        }
    }
    served
}

/// Log a call's refused items (the first one's reason): the caller gets them in its answer.
fn note_refused(service: &Service, errors: &[ItemError]) {
    service.metrics.items_refused.inc_by(errors.len() as u64);
    if let Some(first) = errors.first() {
        tracing::warn!(refused = errors.len(), first = %first.error, "items refused");
    }
}

/// The answer to a storage failure.
fn storage_failed(service: &Service, calls: &Family<Outcome, Counter>, e: StoreError) -> Response {
    calls
        .get_or_create(&Outcome {
            outcome: "storage_error",
        })
        .inc();
    service.metrics.storage_errors.inc();
    tracing::warn!(error = %e, "call failed");
    let status = match e {
        StoreError::Timeout(_) | StoreError::Failed(_) => StatusCode::SERVICE_UNAVAILABLE,
    };
    error(status, e.to_string())
}

async fn lease(State(service): State<Arc<Service>>, headers: HeaderMap, body: Body) -> Response {
    let started = Instant::now();
    let calls = &service.metrics.calls;
    let request = match read_call(&service, calls, &headers, body, LeaseRequest::problem).await {
        Ok(r) => r,
        Err(answer) => return answer,
    };
    let mut problems = request.item_problems();
    let mut items = request.items;
    let now_ms = crate::store::now_ms();
    for (item, problem) in items.iter_mut().zip(problems.iter_mut()) {
        if problem.is_some() {
            continue;
        }
        let limit = [item.requests, item.per_ms, item.burst];
        match service.calendar.place(item, now_ms, service.lease_ttl_ms) {
            Err(e) => *problem = Some(e),
            // A calendar quota's bucket is its period's.
            Ok(Some((start, end))) => {
                item.limit_id =
                    bound_limit_id(&item.limit_id, &[&limit[..], &[start, end]].concat());
            }
            Ok(None) => item.limit_id = bound_limit_id(&item.limit_id, &limit),
        }
    }
    let served = serve(items, &problems, |_| {});
    let result = if served.is_empty() {
        Ok(Answers::from(Vec::new()))
    } else {
        service
            .store
            .lease(&request.instance, &served, service.lease_ttl_ms)
            .await
    };
    service
        .metrics
        .latency
        .observe(started.elapsed().as_secs_f64());
    match result {
        Ok(answers) => {
            calls.get_or_create(&Outcome { outcome: "ok" }).inc();
            let m = &service.metrics;
            let mut busiest = m.busiest.recorder(crate::store::now_ms());
            for (n, (item, g)) in served.iter().zip(answers.iter()).enumerate() {
                if answers.refused.iter().any(|(i, _)| *i == n) {
                    continue;
                }
                busiest.add(item, g);
                tracing::debug!(
                    instance = %request.instance, item = ?item, grant = ?g,
                    "lease item answered"
                );
                m.items.inc();
                m.granted.inc_by(g.granted);
                m.given_back.inc_by(g.returned);
                m.owed
                    .inc_by(item.owed.min(tollgate_core::global::lease::MAX_DEBT));
                m.revoked.inc_by(g.revoked);
                m.reserved
                    .inc_by((g.rate * g.ttl_ms as f64 / 1_000.0).ceil() as u64);
                // An item that asked for nothing (tokens given back, a lease let go) was not
                // denied.
                let asked = item.wanted > 0 || item.demand_mtps() > 0;
                if asked && g.granted == 0 && g.rate == 0.0 {
                    m.denials.inc();
                }
            }
            drop(busiest);
            let grants = fold_refused(&mut problems, answers);
            let Some((items, errors)) = merge_refused(&problems, &grants, LeaseGrant::default())
            else {
                return storage_failed(&service, calls, StoreError::Failed("short answer".into()));
            };
            note_refused(&service, &errors);
            Json(LeaseResponse { items, errors }).into_response()
        }
        Err(e) => storage_failed(&service, calls, e),
    }
}

async fn slots(State(service): State<Arc<Service>>, headers: HeaderMap, body: Body) -> Response {
    let calls = &service.metrics.slot_calls;
    let request = match read_call(&service, calls, &headers, body, PermitRequest::problem).await {
        Ok(r) => r,
        Err(answer) => return answer,
    };
    let mut problems = request.item_problems();
    let served = serve(request.items, &problems, |item| {
        item.limit_id = bound_limit_id(&item.limit_id, &[item.concurrent]);
    });
    let result = if served.is_empty() {
        Ok(Answers::from(Vec::new()))
    } else {
        service
            .store
            .slots(&request.instance, &served, service.lease_ttl_ms)
            .await
    };
    match result {
        Ok(results) => {
            calls.get_or_create(&Outcome { outcome: "ok" }).inc();
            let mut held: BTreeMap<&str, i64> = BTreeMap::new();
            for (item, a) in served.iter().zip(results.iter()) {
                *held.entry(item.rule.as_str()).or_default() +=
                    i64::try_from(a.held).unwrap_or(i64::MAX);
            }
            for (rule, n) in held {
                let holder = Holder {
                    rule: rule.to_owned(),
                    instance: request.instance.clone(),
                };
                service.metrics.set_held(holder, n);
            }
            let answers = fold_refused(&mut problems, results);
            let Some((items, errors)) = merge_refused(&problems, &answers, PermitAnswer::default())
            else {
                return storage_failed(&service, calls, StoreError::Failed("short answer".into()));
            };
            note_refused(&service, &errors);
            Json(PermitResponse { items, errors }).into_response()
        }
        Err(e) => storage_failed(&service, calls, e),
    }
}

async fn metrics(State(service): State<Arc<Service>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        service.metrics.render(),
    )
        .into_response()
}
