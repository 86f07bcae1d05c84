//! What the service's fuzz targets run, shared by its property test and the `cargo fuzz` target
//! (`fuzz/`): a call body of any bytes, answered by a service on a memory store.

use crate::credentials::Credentials;
use crate::metrics::Metrics;
use crate::service::{router, Service};
use crate::store::{MemoryStore, Store};
use axum::body::Body;
use axum::http::Request;
use std::sync::Arc;
use std::time::Duration;
use tollgate_core::global::lease::ColdStart;
use tower::ServiceExt;

/// The statuses a call may be answered with: anything else (or a panic) is a bug.
pub const ANSWERED: &[u16] = &[200, 400, 403, 413, 422, 503];

/// A service as `tollgate-quota` runs it by default, on a memory store of 1 000 keys.
pub fn memory_service() -> Arc<Service> {
    let term = Duration::from_secs(10);
    Arc::new(Service {
        store: Store::Memory(MemoryStore::new(1_000, ColdStart::Full)),
        credentials: Credentials::open(term),
        lease_ttl_ms: 10_000,
        metrics: Metrics::default(),
        body_timeout: Duration::from_secs(5),
        calendar: Default::default(),
    })
}

/// The status `svc` answers `body` with, posted as JSON to `/v1/slots` (`slots`) or `/v1/lease`.
pub fn answer(
    runtime: &tokio::runtime::Runtime,
    svc: &Arc<Service>,
    slots: bool,
    body: Vec<u8>,
) -> u16 {
    let path = if slots { "/v1/slots" } else { "/v1/lease" };
    let Ok(req) = Request::post(path)
        .header("content-type", "application/json")
        .body(Body::from(body))
    else {
        return 0;
    };
    match runtime.block_on(router(svc.clone()).oneshot(req)) {
        Ok(response) => response.status().as_u16(),
        Err(never) => match never {},
    }
}
