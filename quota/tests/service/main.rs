//! The quota service's API and stores: in memory, and against a real redis-server.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod admin;
mod api;
mod binary;
mod calendar;
mod lost_state;
mod memory_store;
mod permits;
mod redis_store;
mod rlqs;
mod rls;
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
        calendar: Default::default(),
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

/// A bucket as the Redis store keeps it (one string, see lease.lua): tokens and reserve in
/// millionths, when it was updated, and its holders by name: wanted, demand, asked, share, until,
/// outstanding.
#[derive(Debug, Clone, PartialEq)]
struct StoredBucket {
    tokens: f64,
    reserve: f64,
    updated: f64,
    holders: Vec<(Vec<u8>, [f64; 6])>,
}

impl StoredBucket {
    fn decode(v: &[u8]) -> Self {
        let num = |at: usize| f64::from_le_bytes(v[at..at + 8].try_into().unwrap());
        let mut holders = Vec::new();
        let mut at = 24;
        while at < v.len() {
            let len = usize::from(u16::from_le_bytes([v[at], v[at + 1]]));
            let name = v[at + 2..at + 2 + len].to_vec();
            at += 2 + len;
            let mut fields = [0.0; 6];
            for (i, f) in fields.iter_mut().enumerate() {
                *f = num(at + 8 * i);
            }
            at += 48;
            holders.push((name, fields));
        }
        Self {
            tokens: num(0),
            reserve: num(8),
            updated: num(16),
            holders,
        }
    }

    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::new();
        for n in [self.tokens, self.reserve, self.updated] {
            v.extend_from_slice(&n.to_le_bytes());
        }
        for (name, fields) in &self.holders {
            v.extend_from_slice(&u16::try_from(name.len()).unwrap().to_le_bytes());
            v.extend_from_slice(name);
            for f in fields {
                v.extend_from_slice(&f.to_le_bytes());
            }
        }
        v
    }

    /// Read `key`'s bucket from the Redis of `conn`.
    async fn get(conn: &mut redis::aio::MultiplexedConnection, key: &str) -> Self {
        let v: Vec<u8> = redis::cmd("GET").arg(key).query_async(conn).await.unwrap();
        Self::decode(&v)
    }

    /// Write it back under `key`, keeping the key's expiry.
    async fn set(&self, conn: &mut redis::aio::MultiplexedConnection, key: &str) {
        let _: () = redis::cmd("SET")
            .arg(key)
            .arg(self.encode())
            .arg("KEEPTTL")
            .query_async(conn)
            .await
            .unwrap();
    }
}
