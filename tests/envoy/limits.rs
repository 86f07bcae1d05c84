//! Admission: exact bursts, one limit across workers, per-key buckets, client addresses.

use crate::harness::{one_rule, parallel, statuses, Client, Envoy};
use serde_json::json;
use std::sync::{Arc, Barrier};

#[test]
fn admits_exactly_the_burst_then_refuses() {
    let envoy = Envoy::start(&one_rule(json!({
        "name": "burst", "limit": {"requests": 1, "per": "1d"}, "burst": 7
    })));
    assert_eq!(statuses(&envoy.url("/"), &[], 12), (7, 5));
}

#[test]
fn two_workers_enforce_one_limit_under_concurrent_connections() {
    let envoy = Envoy::start(&one_rule(json!({
        "name": "shared", "limit": {"requests": 1, "per": "1d"}, "burst": 100
    })));
    let (threads, per_thread) = (50, 8);
    let barrier = Arc::new(Barrier::new(threads));
    let url = envoy.url("/");
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (barrier, url) = (barrier.clone(), url.clone());
            std::thread::spawn(move || {
                let client = Client::new(); // its own connection
                barrier.wait();
                (0..per_thread)
                    .map(|_| client.get(&url, &[]).status)
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let all: Vec<u16> = handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    let ok = all.iter().filter(|s| **s == 200).count();
    let limited = all.iter().filter(|s| **s == 429).count();
    assert_eq!((ok, limited), (100, 300), "of 400 concurrent requests");
    let per_worker = envoy.connections_per_worker();
    assert_eq!(per_worker.len(), 2, "two workers: {per_worker:?}");
    assert!(
        per_worker.iter().all(|n| *n > 0),
        "both workers must have served connections: {per_worker:?}"
    );
    assert_eq!(envoy.counter("shared", "allowed"), 100);
    assert_eq!(envoy.counter("shared", "limited"), 300);
}

#[test]
fn worker_stashes_are_spent_or_returned_so_no_token_is_lost_or_made() {
    // Stashes are the Wasm build's default; the dynamic module keeps them for a `worker_batch`
    // given (its compare-and-swap in the process's memory costs what a stash saves).
    let mut rule = json!({"name": "stash", "limit": {"requests": 1, "per": "1d"}, "burst": 40});
    if crate::harness::build() == crate::harness::Build::Native {
        rule["worker_batch"] = json!(8);
    }
    let envoy = Envoy::start(&one_rule(rule));
    let url = envoy.url("/");
    // Quick requests on one connection make the key busy on its worker, which takes a batch.
    let c = Client::new();
    for _ in 0..6 {
        assert_eq!(c.get(&url, &[]).status, 200);
    }
    // What the worker did not spend goes back to the shared bucket.
    envoy.wait_for_stat_above("wasmcustom.tollgate.rule.stash.stash_returned", 0);
    envoy.wait_for_stat("wasmcustom.tollgate.stash.held", 0);
    // Both workers take and spend batches under concurrent connections.
    let all = parallel(20, |_| {
        let client = Client::new();
        (0..4)
            .map(|_| client.get(&url, &[]).status)
            .collect::<Vec<_>>()
    });
    let concurrent = all.iter().flatten().filter(|s| **s == 200).count();
    envoy.wait_for_stat("wasmcustom.tollgate.stash.held", 0);
    // Whatever is left, on one connection: in all, exactly the burst.
    let (rest, _) = statuses(&url, &[], 40);
    assert_eq!(
        6 + concurrent + rest,
        40,
        "{concurrent} concurrent, then {rest}"
    );
    assert_eq!(statuses(&url, &[], 3), (0, 3));
}

#[test]
fn each_key_value_gets_its_own_bucket() {
    let envoy = Envoy::start(&one_rule(json!({
        "name": "per-user", "key": ["header:x-user"],
        "limit": {"requests": 1, "per": "1d"}, "burst": 3
    })));
    let url = envoy.url("/");
    assert_eq!(statuses(&url, &[("x-user", "alice")], 5), (3, 2));
    assert_eq!(statuses(&url, &[("x-user", "bob")], 5), (3, 2));
    assert_eq!(statuses(&url, &[("x-user", "alice")], 1), (0, 1));
}

#[test]
fn client_ip_is_the_peer_without_trusted_hops() {
    let envoy = Envoy::start(&one_rule(json!({
        "name": "per-ip", "key": ["client_ip"], "limit": {"requests": 1, "per": "1d"}, "burst": 2
    })));
    let url = envoy.url("/");
    // x-forwarded-for is not trusted: every request is 127.0.0.1's.
    assert_eq!(statuses(&url, &[("x-forwarded-for", "1.1.1.1")], 1), (1, 0));
    assert_eq!(statuses(&url, &[("x-forwarded-for", "2.2.2.2")], 1), (1, 0));
    assert_eq!(statuses(&url, &[], 1), (0, 1));
}

#[test]
fn client_ip_with_trusted_hops_reads_x_forwarded_for_from_the_right() {
    let envoy = Envoy::start(&json!({
        "rules": [{"name": "per-ip", "key": ["client_ip"],
                   "limit": {"requests": 1, "per": "1d"}, "burst": 2}],
        "client_ip": {"trusted_hops": 1}
    }));
    let url = envoy.url("/");
    assert_eq!(statuses(&url, &[("x-forwarded-for", "1.1.1.1")], 3), (2, 1));
    assert_eq!(statuses(&url, &[("x-forwarded-for", "2.2.2.2")], 2), (2, 0));
    // The client's own claims to the left do not matter: the rightmost hop is 2.2.2.2.
    assert_eq!(
        statuses(&url, &[("x-forwarded-for", "9.9.9.9, 2.2.2.2")], 1),
        (0, 1)
    );
    // No header: the downstream peer (127.0.0.1) is the client, with its own bucket.
    assert_eq!(statuses(&url, &[], 3), (2, 1));
}

#[test]
fn ipv6_clients_are_limited_by_their_64_and_overrides_take_cidr_ranges() {
    let envoy = Envoy::start(&crate::harness::client_networks_plugin());
    crate::harness::check_client_networks(&envoy.url("/"));
}

#[test]
fn a_refusal_by_one_rule_does_not_charge_the_others() {
    let envoy = Envoy::start(&json!({"rules": [
        {"name": "all", "limit": {"requests": 1, "per": "1d"}, "burst": 10},
        {"name": "narrow", "match": {"path_prefix": "/narrow"},
         "limit": {"requests": 1, "per": "1d"}, "burst": 2}
    ]}));
    let client = Client::new();
    let mut refused_by = Vec::new();
    for _ in 0..6 {
        let r = client.get(&envoy.url("/narrow"), &[]);
        if r.status == 429 {
            refused_by.push(r.header("x-tollgate-rule").unwrap().to_string());
        }
    }
    assert_eq!(refused_by, ["narrow"; 4]);
    // "all" was charged for the 2 admitted requests only: 8 left.
    assert_eq!(statuses(&envoy.url("/other"), &[], 9), (8, 1));
    let r = client.get(&envoy.url("/other"), &[]);
    assert_eq!(r.header("x-tollgate-rule"), Some("all"));
}
