//! Costs known after the response: failed logins, an LLM stream's usage, response bytes.

use crate::harness::{Client, Envoy, Options};
use serde_json::{json, Value};

/// A direct response on `path` with `status`, `body` and a content type.
fn answer(path: &str, status: u16, body: &str, content_type: &str) -> Value {
    json!({"match": {"prefix": path},
           "direct_response": {"status": status, "body": {"inline_string": body}},
           "response_headers_to_add": [{"header": {"key": "content-type", "value": content_type},
                                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]})
}

#[test]
fn the_sixth_failed_login_is_refused_before_the_upstream_and_successes_cost_nothing() {
    let mut right = answer("/login", 200, "welcome\n", "text/plain");
    right["match"]["headers"] = json!([{"name": "x-password", "string_match": {"exact": "right"}}]);
    let opts = Options {
        routes: vec![right, answer("/login", 401, "no\n", "text/plain")],
        ..Options::default()
    };
    let envoy = Envoy::start_with(
        &json!({"rules": [{"name": "logins", "match": {"path_prefix": "/login"},
            "key": ["client_ip"], "limit": {"requests": 5, "per": "15m"},
            "settle": {"statuses": [401, 403]}}]}),
        &opts,
    );
    let client = Client::new();
    let url = envoy.url("/login");
    for _ in 0..20 {
        let reply = client.get(&url, &[("x-password", "right")]);
        assert_eq!(reply.status, 200, "a success costs nothing");
    }
    for n in 0..5 {
        let reply = client.get(&url, &[("x-password", "wrong")]);
        assert_eq!(reply.status, 401, "failure {n} reaches the upstream");
    }
    let sixth = client.get(&url, &[("x-password", "wrong")]);
    assert_eq!(sixth.status, 429, "the 6th failure within the window");
    assert!(sixth.header("retry-after").is_some());
    // Refused before the upstream: even the right password waits for the window.
    assert_eq!(client.get(&url, &[("x-password", "right")]).status, 429);
    assert_eq!(envoy.counter("logins", "refunded"), 20);
    assert_eq!(envoy.counter("logins", "settled"), 5);
}

const STREAM: &str = "data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n\
    data: {\"choices\":[],\"usage\":{\"prompt_tokens\":100,\"completion_tokens\":200,\"total_tokens\":300}}\n\n\
    data: [DONE]\n\n";

#[test]
fn a_streamed_usage_beyond_the_reservation_is_owed_and_refused_until_repaid() {
    let opts = Options {
        routes: vec![answer("/v1/chat", 200, STREAM, "text/event-stream")],
        ..Options::default()
    };
    // 1 000 tokens a minute per key; a request reserves its x-max-tokens (default 100).
    let envoy = Envoy::start_with(
        &json!({"rules": [{"name": "llm", "key": ["header:x-api-key"],
            "limit": {"requests": 1000, "per": "1m"},
            "cost": {"header": "x-max-tokens", "default": 100, "max": 1000},
            "settle": {"usage": "total"}}]}),
        &opts,
    );
    let client = Client::new();
    let url = envoy.url("/v1/chat");
    let key = [("x-api-key", "team-a")];
    for n in 0..4 {
        let reply = client.get(&url, &key);
        assert_eq!(reply.status, 200, "request {n}");
        assert!(
            reply.body.contains("total_tokens"),
            "the stream passes whole"
        );
    }
    // 4 × 300 = 1 200 of 1 000: 200 owed, and a reservation of 100 after it: 18 s.
    let refused = client.get(&url, &key);
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header("retry-after"), Some("18"));
    // A request that reserves what it may use is refused as exactly.
    let big = client.get(&url, &[("x-api-key", "team-b"), ("x-max-tokens", "1000")]);
    assert_eq!(big.status, 200, "another key is another budget");
    assert_eq!(envoy.counter("llm", "charged"), 800);
    assert_eq!(envoy.counter("llm", "refunded"), 700);
}

#[test]
fn a_byte_quota_counts_the_bytes_each_response_sent() {
    let body = "x".repeat(1_000);
    let opts = Options {
        routes: vec![answer("/files", 200, &body, "application/octet-stream")],
        ..Options::default()
    };
    // 5 000 bytes a minute per client; a request reserves 1 000.
    let envoy = Envoy::start_with(
        &json!({"rules": [{"name": "bytes", "key": ["client_ip"],
            "limit": {"requests": 5000, "per": "1m"}, "cost": 1000,
            "settle": {"body_bytes": true}}]}),
        &opts,
    );
    let client = Client::new();
    let statuses: Vec<u16> = (0..7)
        .map(|_| client.get(&envoy.url("/files"), &[]).status)
        .collect();
    assert_eq!(statuses, [200, 200, 200, 200, 200, 429, 429]);
    assert_eq!(envoy.counter("bytes", "settled"), 5_000);
}
