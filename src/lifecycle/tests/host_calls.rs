//! The host calls each request makes, by configuration: in Envoy each costs instructions of its
//! own and one that hands data back about a tenth of a do-nothing filter's request
//! (docs/benchmarks.md), so what a configuration does not use must make none.

use super::mock::Proxy;
use crate::config::HostCaps;

const NEVER: &str = r#"{"rules": [{"name": "never", "match": {"path": "/never"}, "limit": {"requests": 1, "per": "1m"}}]}"#;
const PER_IP: &str = r#"{"rules": [{"name": "ip", "key": ["client_ip"], "limit": {"requests": 1000000000, "per": "1m"}}]}"#;

/// One whole request as Envoy delivers it: headers, the upstream's answer with a body, the end.
/// Its host calls, in order.
fn one_request(proxy: &mut Proxy, body: Option<&[u8]>) -> Vec<String> {
    let _ = proxy.take_host_calls();
    let id = match body {
        Some(b) => proxy.request_with_body(&[(":path", "/api")], &[b]).0,
        None => proxy.request(&[(":path", "/api")]).0,
    };
    proxy.upstream_streams(
        id,
        200,
        &[("content-type", "text/plain")],
        &[b"hello", b"world"],
    );
    proxy.take_host_calls()
}

#[test]
fn a_request_no_rule_applies_to_reads_its_path_and_nothing_else() {
    for caps in [HostCaps::ENVOY, HostCaps::NGINX] {
        let mut proxy = Proxy::new(caps, NEVER);
        for n in 0..50 {
            let body: Option<&[u8]> = (n % 2 == 1).then_some(b"{\"x\": 1}");
            assert_eq!(
                one_request(&mut proxy, body),
                [":path"].map(|h| format!("get_request_header {h}")),
                "{} request {n}",
                caps.name
            );
            proxy.advance_ms(1);
        }
        // Nothing counted for a rule no request matched: the tick hands no stat over.
        let _ = proxy.take_host_calls();
        proxy.tick();
        let calls = proxy.take_host_calls();
        assert!(
            !calls.iter().any(|c| c.ends_with("_metric")),
            "{}: {calls:?}",
            caps.name
        );
    }
}

#[test]
fn a_per_ip_request_makes_the_four_calls_and_visits_the_bucket_once_per_batch() {
    let mut proxy = Proxy::new(HostCaps::ENVOY, PER_IP);
    let mut shared_reads = 0;
    let requests = 90;
    for n in 0..requests {
        // Bodies both ways: no body callback reads or holds anything without a rule that needs it.
        let body: Option<&[u8]> = (n % 2 == 1).then_some(b"{\"x\": 1}");
        let calls = one_request(&mut proxy, body);
        let (shared, own): (Vec<_>, Vec<_>) = calls.iter().partition(|c| c.contains("shared_data"));
        assert_eq!(
            own,
            [
                "get_property source.address",
                "get_current_time",
                "add_response_header ratelimit-policy",
                "add_response_header ratelimit"
            ],
            "request {n}"
        );
        assert!(
            shared.is_empty() || shared == ["get_shared_data", "set_shared_data"],
            "{shared:?}"
        );
        shared_reads += shared.len() / 2;
    }
    // A worker's stash serves `worker_batch` (8) requests of each 9 without the shared bucket.
    assert!(shared_reads <= requests / 9 + 1, "{shared_reads} visits");
}

#[test]
fn without_headers_a_per_ip_request_makes_two_calls() {
    let config = PER_IP.replace(r#"}]}"#, r#"}], "rate_limit_headers": "none"}"#);
    let mut proxy = Proxy::new(HostCaps::ENVOY, &config);
    // The first request of a key asks for itself; the second, a busy key's, fills the stash.
    let _ = one_request(&mut proxy, None);
    let _ = one_request(&mut proxy, None);
    for _ in 0..8 {
        assert_eq!(
            one_request(&mut proxy, None),
            ["get_property source.address", "get_current_time"]
        );
    }
}
