//! Which requests a rule applies to, and how its key is built.

use crate::harness::{one_rule, statuses, Client, Envoy, Options};
use serde_json::json;

#[test]
fn matches_by_path_prefix_method_host_and_header() {
    let envoy = Envoy::start(&one_rule(json!({
        "name": "api",
        "match": {"path_prefix": "/api/", "methods": ["POST"], "hosts": ["api.example.com"],
                  "headers": {"x-tier": "free"}},
        "limit": {"requests": 1, "per": "1d"}, "burst": 1
    })));
    let client = Client::new();
    let send = |method: &str, path: &str, host: &str, tier: &str| {
        client
            .send(
                method,
                &envoy.url(path),
                &[("host", host), ("x-tier", tier)],
            )
            .status
    };
    assert_eq!(send("POST", "/api/x", "api.example.com:8080", "free"), 200);
    assert_eq!(send("POST", "/api/y?z=1", "API.example.com", "free"), 429);
    // Change any one condition and the rule does not apply.
    for _ in 0..3 {
        assert_eq!(send("GET", "/api/x", "api.example.com", "free"), 200);
        assert_eq!(send("POST", "/apx", "api.example.com", "free"), 200);
        assert_eq!(send("POST", "/api/x", "other.example.com", "free"), 200);
        assert_eq!(send("POST", "/api/x", "api.example.com", "paid"), 200);
    }
}

#[test]
fn matches_an_exact_path_ignoring_the_query() {
    let envoy = Envoy::start(&one_rule(json!({
        "name": "login", "match": {"path": "/login"},
        "limit": {"requests": 1, "per": "1d"}, "burst": 2
    })));
    assert_eq!(statuses(&envoy.url("/login?next=/home"), &[], 3), (2, 1));
    assert_eq!(statuses(&envoy.url("/login/more"), &[], 3), (3, 0));
}

#[test]
fn missing_key_skip_leaves_the_request_unlimited() {
    let envoy = Envoy::start(&one_rule(json!({
        "name": "per-user", "key": ["header:x-user"],
        "limit": {"requests": 1, "per": "1d"}, "burst": 1
    })));
    assert_eq!(statuses(&envoy.url("/"), &[], 5), (5, 0));
    assert_eq!(statuses(&envoy.url("/"), &[("x-user", "a")], 2), (1, 1));
}

#[test]
fn missing_key_limit_puts_absent_values_in_one_bucket() {
    let envoy = Envoy::start(&one_rule(json!({
        "name": "per-user", "key": ["header:x-user"], "missing_key": "limit",
        "limit": {"requests": 1, "per": "1d"}, "burst": 2
    })));
    assert_eq!(statuses(&envoy.url("/"), &[], 3), (2, 1));
    assert_eq!(statuses(&envoy.url("/"), &[("x-user", "")], 2), (2, 0));
}

#[test]
fn keys_from_query_path_method_and_host() {
    let envoy = Envoy::start(&json!({"rules": [
        {"name": "by-query", "match": {"path_prefix": "/q"}, "key": ["query:api_key"],
         "limit": {"requests": 1, "per": "1d"}, "burst": 1},
        {"name": "by-request", "match": {"path_prefix": "/r"}, "key": ["method", "path", "host"],
         "limit": {"requests": 1, "per": "1d"}, "burst": 1}
    ]}));
    let url = |p: &str| envoy.url(p);
    assert_eq!(statuses(&url("/q?api_key=k1"), &[], 2), (1, 1));
    assert_eq!(statuses(&url("/q?x=1&api_key=k2"), &[], 2), (1, 1));
    assert_eq!(
        statuses(&url("/q?api_key=k%31"), &[], 1),
        (0, 1),
        "k%31 is k1"
    );
    assert_eq!(statuses(&url("/q"), &[], 3), (3, 0), "no api_key: skipped");
    let client = Client::new();
    let send = |m: &str, p: &str, h: &str| client.send(m, &url(p), &[("host", h)]).status;
    assert_eq!(send("GET", "/r1", "a.example"), 200);
    assert_eq!(send("GET", "/r1", "a.example"), 429);
    assert_eq!(send("POST", "/r1", "a.example"), 200);
    assert_eq!(send("GET", "/r2", "a.example"), 200);
    assert_eq!(send("GET", "/r1", "b.example"), 200);
}

#[test]
fn a_key_from_request_metadata_another_filter_set() {
    // header_to_metadata stands for jwt_authn: it moves x-user into metadata auth/sub and
    // removes the header, so only the metadata can tell the users apart.
    let to_metadata = json!({
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
            "request_rules": [{"header": "x-user", "remove": true,
                "on_header_present": {"metadata_namespace": "auth", "key": "sub", "type": "STRING"}}]
        }
    });
    let opts = Options {
        filters_before: vec![to_metadata],
        ..Options::default()
    };
    let envoy = Envoy::start_with(
        &json!({"rules": [{"name": "per-subject", "key": ["metadata:auth/sub"],
            "limit": {"requests": 2, "per": "1h"}}]}),
        &opts,
    );
    let url = envoy.url("/");
    assert_eq!(statuses(&url, &[("x-user", "alice")], 3), (2, 1));
    assert_eq!(statuses(&url, &[("x-user", "bob")], 3), (2, 1));
    // Without the metadata the rule does not apply (missing_key "skip").
    assert_eq!(statuses(&url, &[], 5), (5, 0));
}

#[test]
fn each_tenant_gets_its_plans_limit_from_a_header_a_trusted_filter_set() {
    let envoy = Envoy::start(
        &json!({"rules": [{"name": "plans", "key": ["header:x-tenant"],
        "limit": {"requests": 3, "per": "1h"},
        "limit_from": {"header": "x-plan-requests", "max": 10}}]}),
    );
    let url = envoy.url("/");
    let plan = |tenant: &str, plan: &str, n: usize| {
        statuses(&url, &[("x-tenant", tenant), ("x-plan-requests", plan)], n)
    };
    assert_eq!(plan("small", "2", 4), (2, 2));
    assert_eq!(plan("big", "8", 10), (8, 2));
    assert_eq!(plan("greedy", "1000000", 12), (10, 2), "at most max");
    assert_eq!(
        statuses(&url, &[("x-tenant", "no-plan")], 5),
        (3, 2),
        "the rule's own"
    );
    let reply = Client::new().get(&url, &[("x-tenant", "fresh"), ("x-plan-requests", "6")]);
    assert_eq!(
        reply.header("ratelimit-policy"),
        Some("\"plans\";q=6;w=3600")
    );
}

#[test]
fn a_plan_from_request_metadata_is_read_as_a_string_or_a_number() {
    // header_to_metadata stands for an authentication filter: one plan as a string, one as a
    // number (as a JWT claim `"plan": 3` would be).
    let to_metadata = json!({
        "name": "envoy.filters.http.header_to_metadata",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
            "request_rules": [
                {"header": "x-plan-string", "remove": true,
                 "on_header_present": {"metadata_namespace": "auth", "key": "plan", "type": "STRING"}},
                {"header": "x-plan-number", "remove": true,
                 "on_header_present": {"metadata_namespace": "auth", "key": "plan", "type": "NUMBER"}}
            ]
        }
    });
    let opts = Options {
        filters_before: vec![to_metadata],
        ..Options::default()
    };
    let envoy = Envoy::start_with(
        &json!({"rules": [{"name": "plans", "key": ["header:x-tenant"],
            "limit": {"requests": 10, "per": "1h"},
            "limit_from": {"metadata": "auth/plan", "max": 100}}]}),
        &opts,
    );
    let url = envoy.url("/");
    assert_eq!(
        statuses(&url, &[("x-tenant", "s"), ("x-plan-string", "3")], 5),
        (3, 2)
    );
    assert_eq!(
        statuses(&url, &[("x-tenant", "n"), ("x-plan-number", "4")], 6),
        (4, 2)
    );
    // A plan's name is no number, even in eight bytes (a double's size): the rule's own limit,
    // 10 an hour (before: "business" read as a double, clamped to 100).
    for name in ["business", "standard", "gold"] {
        assert_eq!(
            statuses(&url, &[("x-tenant", name), ("x-plan-string", name)], 12),
            (10, 2),
            "{name}"
        );
    }
}
