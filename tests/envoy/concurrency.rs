//! Concurrency limits: in-flight requests per key, released however the stream ends.

use crate::harness::{fault_filter, parallel, Client, Envoy, Options};
use serde_json::json;
use std::time::Duration;

const IN_FLIGHT: &str = "tollgate_rule_in_flight{tollgate_rule=\"conc\"}";

fn start() -> Envoy {
    Envoy::start_with(
        &json!({"rules": [{"name": "conc", "algorithm": "concurrency",
                           "limit": {"concurrent": 3}}]}),
        &Options {
            filters_after: vec![fault_filter()],
            ..Options::default()
        },
    )
}

/// Statuses of `n` requests sent at once, each held `delay_ms` after tollgate admits it.
fn slow(envoy: &Envoy, n: usize, delay_ms: u64) -> Vec<u16> {
    let delay = delay_ms.to_string();
    parallel(n, |_| {
        Client::new()
            .get(&envoy.url("/"), &[("x-envoy-fault-delay-request", &delay)])
            .status
    })
}

fn admitted(statuses: &[u16]) -> usize {
    statuses.iter().filter(|s| **s == 200).count()
}

#[test]
fn excess_concurrent_requests_are_refused_and_released_slots_reused() {
    let envoy = start();
    let first = slow(&envoy, 8, 600);
    assert_eq!(admitted(&first), 3, "{first:?}");
    assert_eq!(first.iter().filter(|s| **s == 429).count(), 5);
    assert_eq!(envoy.await_prometheus(IN_FLIGHT, 0), 0);
    // The three slots are free again.
    assert_eq!(admitted(&slow(&envoy, 5, 300)), 3);
    let alone = Client::new().get(&envoy.url("/"), &[]);
    assert_eq!(alone.status, 200, "nothing in flight now");
    assert_eq!(envoy.counter("conc", "limited"), 7);
}

#[test]
fn aborted_failed_and_locally_answered_streams_release_their_slot() {
    let envoy = start();
    // Clients that give up while their request is in flight.
    let gone = parallel(3, |_| {
        Client::with_timeout(Duration::from_millis(300))
            .try_send(
                "GET",
                &envoy.url("/"),
                &[("x-envoy-fault-delay-request", "5000")],
            )
            .is_err()
    });
    assert!(gone.iter().all(|g| *g), "the clients must have timed out");
    assert_eq!(
        envoy.await_prometheus(IN_FLIGHT, 0),
        0,
        "released on client reset"
    );
    // A local reply after admission (the fault filter aborts) and an upstream failure.
    let c = Client::new();
    for _ in 0..5 {
        let abort = c.get(&envoy.url("/"), &[("x-envoy-fault-abort-request", "503")]);
        assert_eq!(abort.status, 503);
        assert_eq!(c.get(&envoy.url("/dead"), &[]).status, 503);
    }
    assert_eq!(envoy.prometheus(IN_FLIGHT), 0);
    // The shared count itself is back to 0, not just the gauge: 3 fit again, the 4th does not.
    assert_eq!(admitted(&slow(&envoy, 4, 400)), 3);
}

#[test]
fn in_flight_returns_to_zero_after_a_mixed_load_across_workers() {
    let envoy = start();
    let statuses = parallel(24, |i| {
        let c = Client::with_timeout(Duration::from_millis(400));
        let mut seen = Vec::new();
        for j in 0..12 {
            let kind = (i + j) % 4;
            let headers: &[(&str, &str)] = match kind {
                0 => &[("x-envoy-fault-delay-request", "20")],
                1 => &[("x-envoy-fault-abort-request", "502")],
                2 => &[("x-envoy-fault-delay-request", "1000")], // the client gives up
                _ => &[],
            };
            let path = if kind == 3 { "/dead" } else { "/" };
            seen.push(
                c.try_send("GET", &envoy.url(path), headers)
                    .map(|r| r.status)
                    .ok(),
            );
        }
        seen
    })
    .concat();
    assert!(
        statuses.contains(&Some(429)),
        "the limit was reached: {statuses:?}"
    );
    assert!(statuses.contains(&Some(200)));
    assert_eq!(envoy.await_prometheus(IN_FLIGHT, 0), 0);
    let per_worker = envoy.connections_per_worker();
    assert!(
        per_worker.iter().all(|n| *n > 0),
        "both workers served: {per_worker:?}"
    );
    assert_eq!(admitted(&slow(&envoy, 5, 400)), 3);
}
