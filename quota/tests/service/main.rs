//! The quota service's API and stores: in memory, and against a real redis-server.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod api;
mod binary;
mod lost_state;
mod memory_store;
mod permits;
mod redis_store;
mod tls;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use testkit::{eventually, free_port, resume_process, stop_process, Redis};
use tollgate_core::global::lease::ColdStart;
use tollgate_core::global::lease::{LeaseGrant, LeaseItem, LeaseRequest, LeaseResponse};
use tollgate_core::global::permits::{PermitAnswer, PermitItem, PermitRequest, PermitResponse};
use tollgate_quota::credentials::{Credentials, ProxyToken, DEFAULT_MAX_INSTANCES};
use tollgate_quota::metrics::Metrics;
use tollgate_quota::service::{router, Service};
use tollgate_quota::store::redis::{MasterAccess, RedisStore, RedisTarget, RedisTls};
use tollgate_quota::store::{MemoryStore, Store, StoreError};
use tower::ServiceExt;

fn item(key: &str, burst: u64, wanted: u64) -> LeaseItem {
    LeaseItem {
        rule: "r".into(),
        limit_id: "lim".into(),
        key: key.into(),
        requests: 1,
        per_ms: 86_400_000,
        burst,
        wanted,
        ..LeaseItem::default()
    }
}

fn service(store: Store, token: Option<&str>) -> Arc<Service> {
    Arc::new(Service {
        store,
        credentials: Credentials::new(
            token.map(str::to_string),
            Vec::new(),
            DEFAULT_MAX_INSTANCES,
            Duration::from_secs(10),
        ),
        lease_ttl_ms: 10_000,
        metrics: Metrics::default(),
        body_timeout: Duration::from_secs(5),
    })
}

async fn call(svc: &Arc<Service>, body: String, auth: Option<&str>) -> (StatusCode, String) {
    call_as(svc, body, auth, Some("application/json")).await
}

async fn call_as(
    svc: &Arc<Service>,
    body: String,
    auth: Option<&str>,
    content_type: Option<&str>,
) -> (StatusCode, String) {
    let mut req = Request::post("/v1/lease");
    if let Some(t) = content_type {
        req = req.header("content-type", t);
    }
    if let Some(a) = auth {
        req = req.header("authorization", a);
    }
    let resp = router(svc.clone())
        .oneshot(req.body(Body::from(body)).unwrap())
        .await
        .unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

fn lease_body(instance: &str, items: Vec<LeaseItem>) -> String {
    serde_json::to_string(&LeaseRequest {
        instance: instance.into(),
        items,
    })
    .unwrap()
}

fn grants(body: &str) -> Vec<LeaseGrant> {
    serde_json::from_str::<LeaseResponse>(body).unwrap().items
}

fn single(redis: &Redis) -> RedisTarget {
    RedisTarget::Single(redis.url())
}

/// `n` items of new keys, each with a rate lease asked for.
fn many(n: usize, round: usize) -> Vec<LeaseItem> {
    (0..n)
        .map(|i| LeaseItem {
            requests: 100,
            per_ms: 1_000,
            demand: 50.0,
            ..item(&format!("k{round}-{i}"), 100, 25)
        })
        .collect()
}

/// A rated item of a 100/s rule with burst 100, asking for 25 tokens.
fn rated(key: &str) -> LeaseItem {
    LeaseItem {
        requests: 100,
        per_ms: 1_000,
        demand: 50.0,
        ..item(key, 100, 25)
    }
}

/// The same with a proxy's evidence: an answer `known_ms` ago said `remaining` were left.
fn known(key: &str, known_ms: u64, remaining: u64) -> LeaseItem {
    LeaseItem {
        known_ms,
        known_remaining: remaining,
        ..rated(key)
    }
}

fn slot(key: &str, wanted: u64, keep: u64) -> PermitItem {
    PermitItem {
        rule: "r".into(),
        limit_id: "lim".into(),
        key: key.into(),
        concurrent: 10,
        wanted,
        keep,
        known_held: 0,
    }
}

async fn held(store: &Store, instance: &str, item: PermitItem, ttl: u64) -> PermitAnswer {
    store.slots(instance, &[item], ttl).await.unwrap()[0]
}
