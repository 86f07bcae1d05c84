//! State over time: bounded memory under a flood of keys, and state kept across a reload.

use crate::harness::{parallel, statuses, Client, Envoy, Options};
use serde_json::json;

/// Distinct keys in the flood: 100 000 in CI; `TOLLGATE_FLOOD_KEYS=1000000` for the documented figure.
fn flood_keys() -> usize {
    std::env::var("TOLLGATE_FLOOD_KEYS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000)
}

#[test]
fn a_flood_of_distinct_keys_costs_other_keys_nothing_and_memory_stays_bounded() {
    let max_keys = 1_000;
    let envoy = Envoy::start(&json!({"rules": [{
        "name": "per-key", "key": ["header:x-key"], "max_keys": max_keys,
        "limit": {"requests": 5, "per": "1h"}
    }]}));
    let url = envoy.url("/");
    // Warm up connections, the VMs and the allocator, then take the baseline.
    parallel(4, |t| {
        let c = Client::new();
        for i in 0..50 {
            c.get(&url, &[("x-key", &format!("warm-{t}-{i}"))]);
        }
    });
    // A key that is being limited: its 5, then refused.
    let limited = Client::new();
    assert_eq!(statuses(&url, &[("x-key", "limited")], 6), (5, 1));
    let before = envoy.rss_kib();

    // The flood: distinct keys, one request each (each under its limit), from 4 connections;
    // meanwhile the limited key keeps asking.
    let keys = flood_keys();
    let threads = 4;
    let refused_during = std::thread::scope(|s| {
        let asking = s.spawn(|| {
            (0..50)
                .filter(|_| limited.get(&url, &[("x-key", "limited")]).status == 429)
                .count()
        });
        parallel(threads, |t| {
            let c = Client::new();
            for i in (t..keys).step_by(threads) {
                c.get(&url, &[("x-key", &format!("flood-{i}"))]);
            }
        });
        asking.join().unwrap()
    });
    let after = envoy.rss_kib();

    // A client that never sent a request before gets exactly its limit: the flood keys it
    // evicts had spent 1 of 5 each; a flood buys nothing fresh keys would not get.
    assert_eq!(statuses(&url, &[("x-key", "hot")], 7), (5, 2));
    // The limited key stayed limited: its slot was never evicted for a fresher one.
    assert_eq!(refused_during, 50);
    assert_eq!(statuses(&url, &[("x-key", "limited")], 3), (0, 3));
    assert!(
        envoy.counter("per-key", "slot_evicted") > 0,
        "the table was saturated"
    );
    // The slots were all created at start-up: nothing grows with the keys seen.
    let growth_kib = after.saturating_sub(before);
    eprintln!(
        "key flood: {keys} keys, max_keys {max_keys}: RSS {before} KiB -> {after} KiB (+{growth_kib} KiB)"
    );
    assert!(
        growth_kib < 16 * 1024,
        "RSS grew {growth_kib} KiB over {keys} keys with max_keys {max_keys}"
    );
}

#[test]
fn a_reload_keeps_unchanged_rules_and_starts_changed_ones_fresh() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let opts = Options {
        lds: true,
        port,
        ..Options::default()
    };
    let rule = |name: &str, burst: u64| {
        json!({"name": name, "match": {"path": format!("/{name}")},
               "limit": {"requests": 1, "per": "1d"}, "burst": burst})
    };
    let envoy = Envoy::start_with(
        &json!({"rules": [rule("kept", 5), rule("changed", 5)]}),
        &opts,
    );
    assert_eq!(statuses(&envoy.url("/kept"), &[], 3), (3, 0));
    assert_eq!(statuses(&envoy.url("/changed"), &[], 3), (3, 0));

    let v2 = json!({"rules": [rule("kept", 5), rule("changed", 6), rule("probe", 1000)]});
    envoy.reconfigure(&v2, &opts);
    // New connections reach the new listener once it is serving: the probe rule shows it.
    let serving = || {
        Client::new()
            .get(&envoy.url("/probe"), &[])
            .header("ratelimit-policy")
            .is_some()
    };
    assert!(
        crate::harness::eventually(std::time::Duration::from_secs(10), serving),
        "the new configuration never served"
    );
    assert_eq!(
        statuses(&envoy.url("/kept"), &[], 4),
        (2, 2),
        "kept its 3 used tokens"
    );
    assert_eq!(
        statuses(&envoy.url("/changed"), &[], 8),
        (6, 2),
        "a fresh bucket of 6"
    );
}
