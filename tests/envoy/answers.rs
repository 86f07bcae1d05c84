//! Every answer a client gets is true: costs that no bucket holds, zero costs, the advertised
//! policy, one key per client whatever the address family.

use crate::harness::{statuses, Client, Envoy};
use serde_json::json;

#[test]
fn a_request_costing_more_than_the_burst_is_refused_without_a_retry_after() {
    let envoy = Envoy::start(&json!({"rules": [
        {"name": "cost", "limit": {"requests": 1, "per": "1s"}, "burst": 2, "worker_batch": 0,
         "cost": {"header": "x-cost", "max": 100}}
    ]}));
    let c = Client::new();
    let never = c.get(&envoy.url("/"), &[("x-cost", "5")]);
    assert_eq!(never.status, 429);
    assert_eq!(never.header("retry-after"), None, "waiting would not help");
    assert_eq!(never.header("x-tollgate-rule"), Some("cost"));
    assert_eq!(envoy.counter("cost", "cost_exceeded"), 1);
    // It took nothing: the bucket still holds its 2.
    assert_eq!(c.get(&envoy.url("/"), &[("x-cost", "2")]).status, 200);
    // A cost the bucket can hold gets a Retry-After that is then honoured.
    let wait = c.get(&envoy.url("/"), &[("x-cost", "2")]);
    assert_eq!(wait.status, 429);
    let secs: u64 = wait.header("retry-after").unwrap().parse().unwrap();
    assert_eq!(secs, 2);
    std::thread::sleep(std::time::Duration::from_secs(secs));
    assert_eq!(c.get(&envoy.url("/"), &[("x-cost", "2")]).status, 200);
}

#[test]
fn a_zero_cost_is_not_free_unless_the_configuration_says_so() {
    let envoy = Envoy::start(&json!({"rules": [
        {"name": "strict", "match": {"path": "/a"}, "limit": {"requests": 2, "per": "1h"},
         "worker_batch": 0, "cost": {"header": "x-cost", "max": 10}},
        {"name": "free", "match": {"path": "/b"}, "limit": {"requests": 2, "per": "1h"},
         "worker_batch": 0, "cost": {"header": "x-cost", "max": 10, "min": 0}}
    ]}));
    assert_eq!(statuses(&envoy.url("/a"), &[("x-cost", "0")], 4), (2, 2));
    assert_eq!(statuses(&envoy.url("/b"), &[("x-cost", "0")], 4), (4, 0));
    // A number too large for 64 bits is above the maximum: it costs the maximum (10 > 2).
    let c = Client::new();
    let huge = c.get(&envoy.url("/b"), &[("x-cost", "99999999999999999999999")]);
    assert_eq!(huge.status, 429);
    assert_eq!(huge.header("retry-after"), None);
}

#[test]
fn the_advertised_policy_is_true_of_the_rate_and_never_zero() {
    let envoy = Envoy::start(&json!({"rules": [
        {"name": "slow", "limit": {"requests": 1, "per": "1500ms"}}
    ]}));
    let r = Client::new().get(&envoy.url("/"), &[]);
    assert_eq!(r.header("ratelimit-policy"), Some("\"slow\";q=2;w=3"));
}

#[test]
fn an_ipv4_mapped_address_is_the_same_client_as_its_ipv4_address() {
    let envoy = Envoy::start(&json!({
        "client_ip": {"trusted_hops": 1},
        "rules": [{"name": "per-ip", "key": ["client_ip"], "limit": {"requests": 2, "per": "1h"},
                   "worker_batch": 0,
                   "overrides": [{"values": ["::ffff:198.51.100.7"], "block": true}]}]
    }));
    let url = envoy.url("/");
    let c = Client::new();
    assert_eq!(
        c.get(&url, &[("x-forwarded-for", "203.0.113.10")]).status,
        200
    );
    assert_eq!(
        c.get(&url, &[("x-forwarded-for", "::ffff:203.0.113.10")])
            .status,
        200
    );
    assert_eq!(
        c.get(&url, &[("x-forwarded-for", "203.0.113.10")]).status,
        429
    );
    // The override written in either form matches both.
    assert_eq!(
        c.get(&url, &[("x-forwarded-for", "198.51.100.7")]).status,
        429
    );
    assert_eq!(envoy.counter("per-ip", "blocked"), 1);
}
