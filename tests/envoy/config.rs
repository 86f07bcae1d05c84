//! Bad configurations are refused at load, and Envoy's log names the field and the reason.

use crate::harness::{Envoy, Options};
use serde_json::{json, Value};

fn rule(extra: Value) -> Value {
    let mut r = json!({"name": "r", "limit": {"requests": 10, "per": "1s"}});
    for (k, v) in extra.as_object().unwrap() {
        r[k] = v.clone();
    }
    r
}

#[test]
fn invalid_configurations_are_refused_with_the_field_named() {
    let corpus: Vec<(Value, &str)> = vec![
        (json!("not json at all {"), "configuration: expected ident"),
        (json!({}), "configuration: missing field `rules`"),
        (json!({"rules": []}), "rules: at least one rule is required"),
        (
            json!({"rules": [rule(json!({}))], "extra": 1}),
            "extra: unknown field `extra`",
        ),
        (
            json!({"rules": [rule(json!({})), rule(json!({"name": "s", "limit": {"requests": 1, "per": "5x"}}))]}),
            r#"rules[1].limit.per: invalid duration "5x""#,
        ),
        (
            json!({"rules": [rule(json!({"limit": {"requests": 0, "per": "1s"}}))]}),
            "rules[0].limit.requests: invalid value: integer `0`",
        ),
        (
            json!({"rules": [rule(json!({"limit": {"requests": -1, "per": "1s"}}))]}),
            "rules[0].limit.requests: invalid value: integer `-1`",
        ),
        (
            json!({"rules": [rule(json!({"burst": "ten"}))]}),
            "rules[0].burst: invalid type: string",
        ),
        (
            json!({"rules": [rule(json!({"scope": "global"}))],
                   "quota_service": {"upstream": "quota", "lease_size": 2_000_000_000u64}}),
            "quota_service.lease_size: must be from 1 to 1000000000",
        ),
        (
            json!({"rules": [rule(json!({})), rule(json!({}))]}),
            r#"rules[1].name: duplicate rule name "r""#,
        ),
        (
            json!({"rules": [rule(json!({"name": "Per IP"}))]}),
            r#"rules[0].name: invalid rule name "Per IP""#,
        ),
        (
            json!({"rules": [rule(json!({"algorithm": "gcra2"}))]}),
            "rules[0].algorithm: unknown variant `gcra2`",
        ),
        (
            json!({"rules": [rule(json!({"algorithm": "fixed_window", "burst": 3}))]}),
            "rules[0].burst: does not apply to window algorithms",
        ),
        (
            json!({"rules": [rule(json!({"algorithm": "leaky_bucket", "delay": "soon"}))]}),
            r#"rules[0].delay: invalid delay "soon""#,
        ),
        (
            json!({"rules": [rule(json!({"algorithm": "concurrency"}))]}),
            "rules[0].limit: a concurrency limit is",
        ),
        (
            json!({"rules": [rule(json!({"key": ["client_ip"],
                                          "overrides": [{"values": ["x"], "block": true}]}))]}),
            r#"rules[0].overrides[0].values[0]: "x" is not an IP address"#,
        ),
        (
            json!({"rules": [rule(json!({"key": ["cookie:session"]}))]}),
            r#"rules[0].key[0]: unknown key part "cookie:session""#,
        ),
        (
            json!({"rules": [rule(json!({"match": {"path": "/a", "path_prefix": "/"}}))]}),
            "rules[0].match: give either path or path_prefix",
        ),
        (
            json!({"rules": [rule(json!({"match": {"hosts": "a.example"}}))]}),
            "rules[0].match.hosts: invalid type: string",
        ),
        (
            json!({"rules": [rule(json!({"missing_key": "ignore"}))]}),
            "rules[0].missing_key: unknown variant `ignore`",
        ),
        (
            json!({"rules": [rule(json!({}))], "response": {"status": 700}}),
            "response.status: 700 is not an HTTP status",
        ),
        (
            json!({"rules": [rule(json!({}))], "rate_limit_headers": "rfc"}),
            "rate_limit_headers: unknown variant `rfc`",
        ),
        (
            json!({"rules": [rule(json!({}))], "client_ip": {"trusted_hops": "1"}}),
            "client_ip.trusted_hops: invalid type: string",
        ),
        (
            json!({"rules": [rule(json!({}))],
                   "response": {"headers": {"x-why": "limited\r\nset-cookie: session=stolen"}}}),
            r"response.headers.x-why: the value contains '\r'",
        ),
        (
            json!({"rules": [rule(json!({"response": {"headers": {"x why": "b"}}}))]}),
            r#"rules[0].response.headers["x why"]: not a header name"#,
        ),
        (
            json!({"rules": [rule(json!({"cost": {"header": "x-cost", "max": "10"}}))]}),
            "rules[0].cost.max: invalid type: string",
        ),
        (
            json!({"rules": [rule(json!({"cost": {"header": "x-cost"}}))]}),
            "rules[0].cost: missing field `max`",
        ),
    ];
    // A configuration refused at start-up stops Envoy with an error.
    let refused = Envoy::expect_refusal(&corpus[0].0);
    assert!(!refused.status.success(), "Envoy must exit with an error");
    assert!(refused
        .log
        .contains(&format!("invalid configuration: {}", corpus[0].1)));
    // The others are served to one running Envoy through LDS: each is refused in turn (the
    // listener update is rejected), and the Envoy keeps serving the configuration it had.
    let opts = Options {
        lds: true,
        concurrency: 1,
        ..Options::default()
    };
    let good = json!({"rules": [rule(json!({}))]});
    let envoy = Envoy::start_with(&good, &opts);
    for (config, want) in &corpus[1..] {
        let line = envoy.refuse_reconfiguration(config, &opts);
        let message = line.split("invalid configuration: ").nth(1).unwrap();
        assert!(
            message.starts_with(want),
            "for {config}\n got: {message}\nwant: {want}…"
        );
    }
    assert_eq!(
        crate::harness::Client::new()
            .get(&envoy.url("/"), &[])
            .status,
        200
    );
}
