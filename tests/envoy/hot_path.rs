//! The request path's budget, counted by the `probe` build inside Envoy: heap allocations.

use crate::harness::{build, module_path, Build, Client, Envoy, Options};
use serde_json::json;
use std::collections::HashMap;

/// Requests per batch: the probe hands its counts to Envoy every 1000 calls of a callback.
const BATCH: i64 = 1000;

/// The probe points on an allowed request's path.
const CALLBACKS: [&str; 6] = [
    "create",
    "request",
    "client_address",
    "evaluate",
    "response",
    "log",
];

/// Allocations and calls of each callback, as the probe has reported them.
fn probe(envoy: &Envoy) -> HashMap<&'static str, (i64, i64)> {
    // The dynamic module's probe times whole hooks.
    let points: &[&'static str] = match build() {
        Build::Wasm => &CALLBACKS,
        Build::Native => &["create", "request", "response", "log"],
    };
    points
        .iter()
        .map(|&cb| {
            let stat = |s: &str| envoy.stat(&format!("wasmcustom.tollgate.probe.{cb}.{s}"));
            (cb, (stat("allocs"), stat("calls")))
        })
        .collect()
}

#[test]
fn an_allowed_request_allocates_nothing_of_the_filters_own() {
    // Both header sets, so that each response renders five headers.
    let plugin = json!({
        "rate_limit_headers": "both",
        "rules": [{"name": "per-ip", "key": ["client_ip"],
                   "limit": {"requests": 1_000_000_000, "per": "1m"}}]
    });
    let opts = Options {
        concurrency: 1,
        module: Some(module_path(true)),
        ..Options::default()
    };
    let envoy = Envoy::start_with(&plugin, &opts);
    let client = Client::new();
    let send = |n: i64| {
        for _ in 0..n {
            let reply = client.get(&envoy.url("/"), &[]);
            assert_eq!(reply.status, 200);
            assert!(reply.header("ratelimit").is_some());
        }
    };
    // The first batch includes one-time set-up (buffers growing, the probe's own bookkeeping).
    send(BATCH);
    envoy.wait_for_stat("wasmcustom.tollgate.probe.log.calls", BATCH);
    let before = probe(&envoy);
    send(2 * BATCH);
    envoy.wait_for_stat("wasmcustom.tollgate.probe.log.calls", 3 * BATCH);
    let after = probe(&envoy);
    let delta = |cb: &str| (after[cb].0 - before[cb].0, after[cb].1 - before[cb].1);
    let n = 2 * BATCH;
    if build() == Build::Native {
        // The dynamic module reads what Envoy lends in place: no allocation at all, neither
        // the module's nor one made for it.
        for cb in ["create", "request", "response", "log"] {
            assert_eq!(delta(cb), (0, n), "{cb}: (allocations, calls)");
        }
        return;
    }
    for cb in CALLBACKS {
        assert_eq!(delta(cb).1, n, "{cb} calls");
    }
    // A request's context lives in a table that keeps its capacity: no allocation.
    assert_eq!(delta("create").0, 0, "allocations creating a context");
    // The host allocates the client address it returns in the module's memory, one per request.
    assert_eq!(delta("client_address").0, n);
    // Reading the shared bucket is one more, for the requests that refill the worker's stash: a
    // busy key refills about once per `worker_batch + 1` requests.
    let refills = delta("evaluate").0;
    assert!(
        refills > 0 && refills <= n / 4,
        "{refills} shared reads for {n} requests"
    );
    let ours = delta("request").0 - delta("client_address").0 - refills;
    assert_eq!(ours, 0, "allocations of the request callback's own");
    assert_eq!(
        delta("response").0,
        0,
        "allocations adding rate-limit headers"
    );
    assert_eq!(delta("log").0, 0);
}
