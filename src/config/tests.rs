//! Parsing and validation: documented examples, defaults, every option and every error message.

use super::*;
use tollgate_core::{Limit, TokenBucket};

fn parse(s: &str) -> Result<Config, String> {
    Config::parse(s.as_bytes()).map_err(|e| e.0)
}

const MIN: &str = r#"{"rules":[{"name":"r","limit":{"requests":10,"per":"1s"}}]}"#;

#[test]
fn the_documented_example_parses() {
    let c = parse(
        r#"{
          "rules": [{
            "name": "per-ip",
            "match": { "path_prefix": "/api/", "methods": ["GET", "post"],
                       "hosts": ["API.example.com"], "headers": { "X-Tier": "free" } },
            "key": ["client_ip", "header:X-User", "query:page"],
            "limit": { "requests": 100, "per": "1m" },
            "burst": 20,
            "algorithm": "token_bucket",
            "missing_key": "limit",
            "dry_run": false
          }],
          "response": { "status": 429, "body": "rate limited\n",
                        "headers": { "content-type": "text/plain" } },
          "rate_limit_headers": "both",
          "client_ip": { "trusted_hops": 1 },
          "dry_run": true
        }"#,
    )
    .unwrap();
    let r = &c.rules[0];
    assert_eq!(
        r.quota().unwrap().limit,
        Limit::TokenBucket(TokenBucket::new(100, 60_000_000_000, 20).unwrap())
    );
    assert_eq!(r.matcher.methods, ["GET", "POST"]);
    assert_eq!(r.matcher.hosts, ["api.example.com"]);
    assert_eq!(
        r.matcher.headers,
        [("x-tier".to_string(), "free".to_string())]
    );
    assert_eq!(
        r.key,
        [
            KeyPart::ClientIp,
            KeyPart::Header("x-user".into()),
            KeyPart::Query("page".into())
        ]
    );
    assert!(r.dry_run);
    assert_eq!(r.missing_key, MissingKey::Limit);
    assert_eq!(c.client_ip.trusted_hops, 1);
    assert_eq!(c.rate_limit_headers, HeaderFormat::Both);
    assert!(!r.quota().unwrap().table.prefix().contains('/'));
}

#[test]
fn defaults() {
    let c = parse(MIN).unwrap();
    let r = &c.rules[0];
    assert_eq!(
        describe(&r.quota().unwrap().limit),
        "token_bucket 10 per 1s, burst 10"
    );
    assert_eq!(
        r.quota().unwrap().table.capacity(),
        u64::from(DEFAULT_MAX_KEYS)
    );
    assert_eq!(r.quota().unwrap().policy, (10, Some(1)));
    assert_eq!(r.cost, Cost::Fixed(1));
    assert_eq!(r.missing_key, MissingKey::Skip);
    assert_eq!(c.response.status, 429);
    assert_eq!(c.rate_limit_headers, HeaderFormat::Draft);
    assert_eq!(c.client_ip.trusted_hops, 0);
    assert!(!r.dry_run);
}

#[test]
fn changed_parameters_change_the_slot_names() {
    let a = parse(MIN).unwrap();
    let b = parse(&MIN.replace("10", "11")).unwrap();
    assert_ne!(
        a.rules[0].quota().unwrap().table,
        b.rules[0].quota().unwrap().table
    );
    assert_eq!(
        a.rules[0].quota().unwrap().table,
        parse(MIN).unwrap().rules[0].quota().unwrap().table
    );
}

#[test]
fn every_algorithm_and_option() {
    let c = parse(
        r#"{"rules":[
          {"name":"fw","algorithm":"fixed_window","limit":{"requests":100,"per":"1m"}},
          {"name":"sw","algorithm":"sliding_window","limit":{"requests":100,"per":"1m"}},
          {"name":"lb","algorithm":"leaky_bucket","limit":{"requests":10,"per":"1s"},"burst":5,"delay":2,"max_delay":"3s"},
          {"name":"nd","algorithm":"leaky_bucket","limit":{"requests":10,"per":"1s"},"delay":"nodelay"},
          {"name":"cc","algorithm":"concurrency","limit":{"concurrent":8},"key":["client_ip"],
           "overrides":[{"values":["10.0.0.1"],"limit":{"concurrent":50}},
                        {"values":["::0001"],"unlimited":true},
                        {"values":["192.0.2.7"],"block":true}]},
          {"name":"wu","limit":{"requests":30,"per":"1s"},"warmup":"10s",
           "cost":{"header":"X-Cost","max":10},"response":{"status":503}}
        ]}"#,
    )
    .unwrap();
    let d: Vec<String> = c
        .rules
        .iter()
        .map(|r| describe(&r.quota().unwrap().limit))
        .collect();
    assert_eq!(
        d,
        [
            "fixed_window 100 per 1m",
            "sliding_window 100 per 1m",
            "leaky_bucket 10 per 1s, burst 5, delay 2, max_delay 3s",
            "leaky_bucket 10 per 1s, burst 0, delay nodelay, max_delay 10s",
            "concurrency 8 in flight",
            "token_bucket 30 per 1s, warmup 10s",
        ]
    );
    let cc = &c.rules[4];
    assert_eq!(cc.quota().unwrap().policy, (8, None));
    assert_eq!(cc.overrides.len(), 3);
    assert_eq!(
        cc.overrides[1].key,
        // An IPv6 address stands for its /64, as IPv6 clients are keyed.
        crate::key::encode_key([Some(&b"::/64"[..])].into_iter())
    );
    assert!(matches!(cc.overrides[2].action, OverrideAction::Block));
    assert_eq!(c.quotas().count(), 7);
    let wu = &c.rules[5];
    assert_eq!(
        wu.cost,
        Cost::Header {
            name: "x-cost".into(),
            default: 1,
            min: 1,
            max: 10
        }
    );
    assert_eq!(wu.response.as_ref().map(|r| r.status), Some(503));
    assert!(c
        .summary()
        .starts_with("6 rule(s): fw (fixed_window 100 per 1m, 10000 slots)"));
}

#[test]
fn global_rules() {
    let c = parse(
        r#"{"rules":[{"name":"g","scope":"global","key":["client_ip"],
                      "limit":{"requests":100,"per":"1m"},"burst":80}],
            "quota_service":{"upstream":"quota","timeout":"50ms","token":"t",
                             "failure_mode":"local","instances_hint":4}}"#,
    )
    .unwrap();
    let qs = c.quota_service.clone().unwrap();
    assert_eq!(
        (qs.authority.as_str(), qs.timeout_ms, qs.strict),
        ("quota", 50, false)
    );
    let g = &c.rules[0];
    let global = g.global().unwrap();
    assert_eq!(
        (global.requests, global.per_ms, global.burst),
        (100, 60_000, 80)
    );
    assert_eq!(
        describe(&global.fallback.limit),
        "token_bucket 25 per 1m, burst 20"
    );
    assert_eq!(describe(&g.quota().unwrap().limit), "global, leases of 5");
    assert_eq!(g.quota().unwrap().policy, (100, Some(60)));
    assert!(c
        .summary()
        .contains("global token_bucket 100 per 1m, burst 80, leases of 5"));
}

/// Every JSON example in the README and the configuration reference is a valid configuration.
#[test]
fn documented_examples_parse() {
    let mut seen = 0;
    for doc in [
        "README.md",
        "docs/configuration.md",
        "docs/llm-budgets.md",
        "docs/global.md",
        "docs/semantics.md",
    ] {
        let path = format!("{}/{doc}", env!("CARGO_MANIFEST_DIR"));
        let text = std::fs::read_to_string(&path).unwrap();
        for block in text.split("```json").skip(1) {
            let json = block.split("```").next().unwrap();
            if let Err(e) = Config::parse(json.as_bytes()) {
                panic!("{doc}: {e} in\n{json}");
            }
            seen += 1;
        }
    }
    assert!(seen >= 10, "{seen} examples");
}

/// The plugin configuration inside the LLM guide's Envoy configuration is valid, and the Envoy
/// configuration is YAML.
#[test]
fn the_llm_guides_envoy_configuration_carries_a_valid_plugin_configuration() {
    let path = format!("{}/docs/llm-budgets.md", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap();
    let yaml = text
        .split("```yaml")
        .nth(1)
        .unwrap()
        .split("```")
        .next()
        .unwrap();
    let envoy: serde_yaml_ng::Value = serde_yaml_ng::from_str(yaml).unwrap();
    let wasm = &envoy["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"]["http_filters"][0]["typed_config"]["config"];
    let plugin = wasm["configuration"]["value"].as_str().unwrap();
    let config = Config::parse(plugin.as_bytes()).unwrap();
    assert!(config.rules[0].settle.is_some());
}

#[test]
fn errors_name_the_field_and_the_reason() {
    let cases: &[(&str, &str)] = &[
        ("{", "configuration: EOF"),
        ("{}", "configuration: missing field `rules`"),
        (r#"{"rules":[]}"#, "rules: at least one rule is required"),
        (
            r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1s"}}],"x":1}"#,
            "x: unknown field `x`",
        ),
        (
            r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1s"}},{"name":"s","limit":{"requests":1,"per":"5x"}}]}"#,
            r#"rules[1].limit.per: invalid duration "5x""#,
        ),
        (
            r#"{"rules":[{"name":"r","limit":{"requests":0,"per":"1s"}}]}"#,
            "rules[0].limit.requests: invalid value: integer `0`",
        ),
        (
            r#"{"rules":[{"name":"r","limit":{"requests":-3,"per":"1s"}}]}"#,
            "rules[0].limit.requests: invalid value: integer `-3`",
        ),
        (
            r#"{"rules":[{"name":"r","limit":{"requests":"5","per":"1s"}}]}"#,
            "rules[0].limit.requests: invalid type: string",
        ),
        (
            r#"{"rules":[{"name":"r","burst":0,"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].burst: must be at least 1",
        ),
        (
            r#"{"rules":[{"name":"r","scope":"global","limit":{"requests":5,"per":"1m"}}],
                "quota_service":{"upstream":"q","lease_size":2000000000}}"#,
            "quota_service.lease_size: must be from 1 to 1000000000",
        ),
        (
            r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1s"}},{"name":"r","limit":{"requests":1,"per":"1s"}}]}"#,
            r#"rules[1].name: duplicate rule name "r""#,
        ),
        (
            r#"{"rules":[{"name":"Bad/Name","limit":{"requests":1,"per":"1s"}}]}"#,
            r#"rules[0].name: invalid rule name "Bad/Name""#,
        ),
        (
            r#"{"rules":[{"name":"r","algorithm":"gcra2","limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].algorithm: unknown variant `gcra2`, expected one of `token_bucket`, `fixed_window`, `sliding_window`, `leaky_bucket`, `concurrency`",
        ),
        (
            r#"{"rules":[{"name":"r","key":["cookie"],"limit":{"requests":1,"per":"1s"}}]}"#,
            r#"rules[0].key[0]: unknown key part "cookie""#,
        ),
        (
            r#"{"rules":[{"name":"r","key":["header:"],"limit":{"requests":1,"per":"1s"}}]}"#,
            r#"rules[0].key[0]: unknown key part "header:""#,
        ),
        (
            r#"{"rules":[{"name":"r","key":["path","path"],"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].key[1]: repeated key part",
        ),
        (
            r#"{"rules":[{"name":"r","match":{"path":"/a","path_prefix":"/b"},"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].match: give either path or path_prefix",
        ),
        (
            r#"{"rules":[{"name":"r","match":{"path_prefix":"api"},"limit":{"requests":1,"per":"1s"}}]}"#,
            r#"rules[0].match.path_prefix: "api" must start with "/""#,
        ),
        (
            r#"{"rules":[{"name":"r","match":{"methods":[]},"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].match.methods: must not be empty",
        ),
        (
            r#"{"rules":[{"name":"r","match":{"method":["GET"]},"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].match.method: unknown field `method`",
        ),
        (
            r#"{"rules":[{"name":"r","missing_key":"maybe","limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].missing_key: unknown variant `maybe`",
        ),
        (
            r#"{"rules":[{"name":"r","max_keys":2000000,"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].max_keys: 2000000 is more than the maximum",
        ),
        (
            // Found by `make fuzz`: 4 × instances_hint overflowed (a division by zero in wasm).
            r#"{"rules":[{"name":"g","scope":"global","limit":{"requests":1,"per":"1s"}}],
                "quota_service":{"upstream":"q","instances_hint":4611686018427387904}}"#,
            "quota_service.instances_hint: 4611686018427387904 is more than the maximum of 1000000",
        ),
        (
            r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1s"}}],"response":{"status":99}}"#,
            "response.status: 99 is not an HTTP status",
        ),
        (
            r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1s"}}],"rate_limit_headers":"ietf"}"#,
            "rate_limit_headers: unknown variant `ietf`",
        ),
        (
            r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1s"}}],"client_ip":{"trusted_hops":-1}}"#,
            "client_ip.trusted_hops: invalid value: integer `-1`",
        ),
        (
            r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1s"}}],"dry_run":"yes"}"#,
            "dry_run: invalid type: string",
        ),
        (
            r#"{"rules":[{"name":"r","algorithm":"fixed_window","burst":5,"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].burst: does not apply to window algorithms",
        ),
        (
            r#"{"rules":[{"name":"r","delay":2,"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].delay: only applies to algorithm \"leaky_bucket\"",
        ),
        (
            r#"{"rules":[{"name":"r","algorithm":"leaky_bucket","delay":"later","limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].delay: invalid delay \"later\"",
        ),
        (
            r#"{"rules":[{"name":"r","algorithm":"leaky_bucket","max_delay":"1x","limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].max_delay: invalid duration \"1x\"",
        ),
        (
            r#"{"rules":[{"name":"r","warmup":"10s","burst":3,"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].burst: cannot be combined with warmup",
        ),
        (
            r#"{"rules":[{"name":"r","algorithm":"concurrency","limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].limit: a concurrency limit is",
        ),
        (
            r#"{"rules":[{"name":"r","algorithm":"concurrency","limit":{}}]}"#,
            "rules[0].limit.concurrent: required",
        ),
        (
            r#"{"rules":[{"name":"r","limit":{"concurrent":3}}]}"#,
            "rules[0].limit.concurrent: only applies to algorithm \"concurrency\"",
        ),
        (
            r#"{"rules":[{"name":"r","limit":{"per":"1s"}}]}"#,
            "rules[0].limit.requests: required",
        ),
        (
            r#"{"rules":[{"name":"r","cost":{"header":"x-cost"},"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].cost: missing field `max`",
        ),
        (
            r#"{"rules":[{"name":"r","cost":{"header":"x-cost","max":"5"},"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].cost.max: invalid type: string",
        ),
        (
            r#"{"rules":[{"name":"r","cost":{"header":"x-cost","max":5,"mni":1},"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].cost.mni: unknown field `mni`",
        ),
        (
            r#"{"rules":[{"name":"r","cost":-1,"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].cost: invalid type: integer `-1`, expected a whole number of tokens",
        ),
        (
            r#"{"rules":[{"name":"r","cost":{"header":"x cost","max":5},"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].cost.header: \"x cost\" is not a header name",
        ),
        (
            r#"{"rules":[{"name":"r","cost":{"header":"x","max":5,"min":6},"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].cost.min: 6 is more than max (5)",
        ),
        (
            r#"{"rules":[{"name":"r","cost":{"header":"x","max":5,"default":9},"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].cost.default: 9 is not within min..=max (1..=5)",
        ),
        (
            r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1s"}}],"response":{"headers":{"x-a":"b\r\nset-cookie: x=1"}}}"#,
            "response.headers.x-a: the value contains '\\r'",
        ),
        (
            r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1s"}}],"response":{"headers":{"x a":"b"}}}"#,
            "response.headers[\"x a\"]: not a header name",
        ),
        (
            r#"{"rules":[{"name":"r","response":{"headers":{"":"b"}},"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].response.headers[\"\"]: not a header name",
        ),
        (
            r#"{"rules":[{"name":"r","key":["header:x user"],"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].key[0]: invalid header name \"x user\"",
        ),
        (
            r#"{"rules":[{"name":"r","match":{"headers":{"x\ny":"1"}},"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].match.headers[\"x\\ny\"]: not a header name",
        ),
        (
            r#"{"rules":[{"name":"r","algorithm":"leaky_bucket","cost":2,"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].cost: leaky_bucket requests cost 1",
        ),
        (
            r#"{"rules":[{"name":"r","scope":"global","settle":{"usage":"total"},"limit":{"requests":1,"per":"1s"}}],"quota_service":{"upstream":"q","mode":"strict"}}"#,
            "rules[0].settle: not supported with quota_service.mode \"strict\" yet",
        ),
        (
            r#"{"rules":[{"name":"r","algorithm":"adaptive","limit_from":{"header":"x-plan","max":9}}]}"#,
            "rules[0].limit_from: only applies to token_bucket rules, not to overload rules",
        ),
        (
            r#"{"rules":[{"name":"r","algorithm":"sre_throttle","settle":{"statuses":[401]}}]}"#,
            "rules[0].settle: only applies to token_bucket rules, not to overload rules",
        ),
        (
            r#"{"rules":[{"name":"r","limit_from":{"header":"x-plan","metadata":"a/b","max":9},"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].limit_from: give exactly one of header or metadata",
        ),
        (
            r#"{"rules":[{"name":"r","limit_from":{"header":"x-plan","max":0},"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].limit_from.max: from 1 to",
        ),
        (
            r#"{"rules":[{"name":"r","algorithm":"fixed_window","limit_from":{"header":"x-plan","max":9},"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].limit_from: only token_bucket rules",
        ),
        (
            r#"{"rules":[{"name":"r","limit_from":{"header":"x-plan","max":9},"worker_batch":2,"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].worker_batch: a rule that settles after the response or takes limits",
        ),
        (
            r#"{"rules":[{"name":"r","key":["metadata:auth"],"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].key[0]: invalid metadata path in key part \"metadata:auth\"",
        ),
        (
            r#"{"rules":[{"name":"r","key":["metadata:a//b"],"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].key[0]: invalid metadata path",
        ),
        (
            r#"{"rules":[{"name":"r","settle":{"statuses":[401],"body_bytes":true},"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].settle: give exactly one of statuses, header, body_bytes, usage or body_field",
        ),
        (
            r#"{"rules":[{"name":"r","settle":{"body_field":"a..b"},"limit":{"requests":1,"per":"1s"}}]}"#,
            r#"rules[0].settle.body_field: "a..b" is not a field path"#,
        ),
        (
            r#"{"rules":[{"name":"r","cost":{"body":["max_tokens",""],"max":5},"limit":{"requests":9,"per":"1s"}}]}"#,
            r#"rules[0].cost.body[1]: "" is not a field path"#,
        ),
        (
            r#"{"rules":[{"name":"r","cost":{"header":"x-c","body":["m"],"max":5},"limit":{"requests":9,"per":"1s"}}]}"#,
            r#"rules[0].cost: either "header" or "body", not both"#,
        ),
        (
            r#"{"rules":[{"name":"r","key":["body:"],"limit":{"requests":9,"per":"1s"}}]}"#,
            "rules[0].key[0]: invalid body field in key part",
        ),
        (
            r#"{"rules":[{"name":"r","limit":{"requests":9,"per":"1s"},"pace":"response"}]}"#,
            "rules[0].pace: only applies to a byte limit (limit.bytes)",
        ),
        (
            r#"{"rules":[{"name":"r","limit":{"bytes":9,"requests":9,"per":"1s"}}]}"#,
            "rules[0].limit: give requests or bytes, not both",
        ),
        (
            r#"{"rules":[{"name":"r","limit":{"bytes":9,"per":"1s"},"cost":5}]}"#,
            "rules[0].cost: does not apply to a byte limit",
        ),
        (
            r#"{"rules":[{"name":"r","algorithm":"leaky_bucket","limit":{"bytes":9,"per":"1s"}}]}"#,
            "rules[0].algorithm: a byte limit is a token bucket of bytes",
        ),
        (
            r#"{"rules":[{"name":"r","limit":{"bytes":9,"per":"1s"},"pace":"both"}]}"#,
            "rules[0].pace: unknown variant `both`",
        ),
        (
            r#"{"rules":[{"name":"r","limit":{"requests":9,"per":"1s"}}],"max_request_body_bytes":0}"#,
            "max_request_body_bytes: 0 is not within",
        ),
        (
            r#"{"rules":[{"name":"r","algorithm":"sliding_window","settle":{"statuses":[401]},"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].settle: only token_bucket rules (without warmup) settle",
        ),
        (
            r#"{"rules":[{"name":"r","settle":{"usage":"total"},"worker_batch":4,"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].worker_batch: a rule that settles after the response",
        ),
        (
            r#"{"rules":[{"name":"r","settle":{"usage":"most"},"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].settle.usage",
        ),
        (
            r#"{"rules":[{"name":"r","settle":{"header":"x y"},"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].settle.header: not a header name",
        ),
        (
            r#"{"rules":[{"name":"r","settle":{"statuses":[700]},"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].settle.statuses[0]: 700 is not an HTTP status",
        ),
        (
            r#"{"rules":[{"name":"r","settle":{"usage":{"input":1,"output":-2}},"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].settle.usage.output: a weight from 0 to 1000000",
        ),
        (
            r#"{"rules":[{"name":"r","key":["client_ip"],"overrides":[{"values":["a","b"],"unlimited":true}],"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].overrides[0].values: gives 2 value(s) for a key of 1 part(s)",
        ),
        (
            r#"{"rules":[{"name":"r","key":["client_ip"],"overrides":[{"values":["nope"],"block":true}],"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].overrides[0].values[0]: \"nope\" is not an IP address",
        ),
        (
            r#"{"rules":[{"name":"r","key":["client_ip"],"overrides":[{"values":["::1"],"block":true,"unlimited":true}],"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].overrides[0]: give exactly one of",
        ),
        (
            r#"{"rules":[{"name":"r","key":["client_ip"],"overrides":[{"values":["::1"],"block":true},{"values":["0::1"],"unlimited":true}],"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].overrides[1].values: another override has the same values",
        ),
        (
            r#"{"rules":[{"name":"r","key":["client_ip"],"overrides":[{"values":["::1"],"limit":{"requests":0,"per":"1s"}}],"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].overrides[0].limit.requests: invalid value: integer `0`",
        ),
        (
            r#"{"rules":[{"name":"r","scope":"global","limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].scope: \"global\" needs a top-level quota_service",
        ),
        (
            r#"{"rules":[{"name":"r","scope":"global","algorithm":"fixed_window","limit":{"requests":1,"per":"1s"}}],"quota_service":{"upstream":"q"}}"#,
            "rules[0].scope: \"global\" rules use the token_bucket algorithm",
        ),
        (
            r#"{"rules":[{"name":"r","scope":"everywhere","limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].scope: unknown variant `everywhere`",
        ),
        (
            r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1s"}}],"quota_service":{"upstream":"q","failure_mode":"panic"}}"#,
            "quota_service.failure_mode: unknown variant `panic`",
        ),
        (
            r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1s"}}],"quota_service":{"upstream":"q","timeout":"soon"}}"#,
            "quota_service.timeout: invalid duration \"soon\"",
        ),
        (
            r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1s"}}],"quota_service":{"upstream":""}}"#,
            "quota_service.upstream: must not be empty",
        ),
        (
            r#"{"rules":[{"name":"r","response":{"status":42},"limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].response.status: 42 is not an HTTP status",
        ),
        // Calendar quotas.
        (
            r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"month"}}]}"#,
            r#"rules[0].limit.per: "month" is a calendar period: give "calendar""#,
        ),
        (
            r#"{"rules":[{"name":"r","scope":"global","limit":{"requests":1,"per":"30d","calendar":{}}}],"quota_service":{"upstream":"q"}}"#,
            r#"rules[0].limit.calendar: needs per "day", "week" or "month""#,
        ),
        (
            r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"day","calendar":{}}}]}"#,
            r#"rules[0].limit.calendar: a calendar quota is counted by the quota service: the rule needs "scope": "global""#,
        ),
        (
            r#"{"rules":[{"name":"r","scope":"global","limit":{"requests":1,"per":"week","calendar":{"time_zone":"Europe/Atlantis"}}}],"quota_service":{"upstream":"q"}}"#,
            r#"rules[0].limit.calendar.time_zone: "Europe/Atlantis" is not an IANA time zone name"#,
        ),
        (
            r#"{"rules":[{"name":"r","scope":"global","limit":{"requests":1,"per":"week","calendar":{"zone":"UTC"}}}],"quota_service":{"upstream":"q"}}"#,
            "rules[0].limit.calendar.zone: unknown field `zone`, expected `time_zone`",
        ),
        (
            r#"{"rules":[{"name":"r","scope":"global","burst":2,"limit":{"requests":1,"per":"week","calendar":{}}}],"quota_service":{"upstream":"q"}}"#,
            "rules[0].burst: a calendar quota's bucket holds its requests",
        ),
        (
            r#"{"rules":[{"name":"r","scope":"global","algorithm":"fixed_window","limit":{"requests":1,"per":"week","calendar":{}}}],"quota_service":{"upstream":"q"}}"#,
            "rules[0].limit.calendar: a calendar quota is requests per period",
        ),
        (
            r#"{"rules":[{"name":"r","scope":"global","limit":{"requests":1,"per":"month","calendar":{}}}],"quota_service":{"upstream":"q","failure_mode":"local"}}"#,
            r#"rules[0].limit.calendar: a calendar quota has no local stand-in: quota_service.failure_mode "local""#,
        ),
        (
            r#"{"rules":[{"name":"r","scope":"global","limit":{"requests":1,"per":"month","calendar":{}}}],"quota_service":{"upstream":"q","first_lease":"provisional"}}"#,
            r#"rules[0].limit.calendar: a calendar quota has no local stand-in: quota_service.first_lease "provisional""#,
        ),
        (
            r#"{"rules":[{"name":"r","key":["header:x-user"],"limit":{"requests":1,"per":"1s"},"overrides":[{"values":["a"],"limit":{"requests":1,"per":"day","calendar":{}}}]}]}"#,
            "rules[0].overrides[0].limit.calendar: a calendar quota is a global rule's own limit",
        ),
    ];
    for (input, want) in cases {
        let got = parse(input).expect_err(input);
        assert!(
            got.starts_with(want),
            "for {input}\n got: {got}\nwant: {want}…"
        );
    }
}

#[test]
fn token_buckets_stash_by_default_only_where_a_request_can_be_held() {
    let config = r#"{"rules":[{"name":"a","limit":{"requests":1,"per":"1s"}},
        {"name":"b","limit":{"requests":1,"per":"1s"},"worker_batch":4}]}"#;
    let batches = |host: &HostCaps| {
        let mut c = parse(config).unwrap();
        c.fit_host(host);
        c.rules.iter().map(|r| r.worker_batch).collect::<Vec<_>>()
    };
    assert_eq!(batches(&HostCaps::ENVOY), [8, 4]);
    // nginx: only a batch given explicitly stays.
    assert_eq!(batches(&HostCaps::NGINX), [0, 4]);
}

#[test]
fn options_a_proxy_cannot_carry_out_are_refused_with_the_proxy_named() {
    let held = parse(
        r#"{"rules":[{"name":"r","algorithm":"leaky_bucket","limit":{"requests":1,"per":"1s"},"burst":2}]}"#,
    )
    .unwrap();
    assert_eq!(held.check_host(&HostCaps::ENVOY), Ok(()));
    let e = held.check_host(&HostCaps::NGINX).unwrap_err().0;
    assert!(
        e.starts_with("rules[0].delay: nginx (ngx_wasm_module) cannot resume"),
        "{e}"
    );
    let global = |qs: &str| {
        parse(&format!(
            r#"{{"rules":[{{"name":"g","scope":"global","limit":{{"requests":1,"per":"1s"}}}}],"quota_service":{{"upstream":"q"{qs}}}}}"#
        ))
        .unwrap()
    };
    let refused = |qs: &str| global(qs).check_host(&HostCaps::NGINX).unwrap_err().0;
    // Requests that call the service themselves can only go on if the call fails.
    for qs in [
        r#","failure_mode":"deny""#,
        r#","failure_mode":"local""#,
        r#","mode":"strict","failure_mode":"deny""#,
    ] {
        let e = refused(qs);
        assert!(
            e.starts_with(
                "quota_service.failure_mode: nginx (ngx_wasm_module) drops the connection"
            ),
            "{e}"
        );
        assert_eq!(global(qs).check_host(&HostCaps::ENVOY), Ok(()), "{qs}");
    }
    assert!(refused(r#","failure_mode":"deny""#).contains("\"first_lease\": \"provisional\""));
    for qs in [
        "",
        r#","mode":"strict""#,
        r#","failure_mode":"deny","first_lease":"provisional""#,
        r#","failure_mode":"local","first_lease":"provisional""#,
    ] {
        assert_eq!(global(qs).check_host(&HostCaps::NGINX), Ok(()), "{qs}");
    }
}

#[test]
fn rate_limit_policies_are_true_and_never_zero() {
    let sec = 1_000_000_000;
    assert_eq!(policy_of_rate(100, 60 * sec), (100, 60));
    assert_eq!(policy_of_rate(1, 1_500_000_000), (2, 3));
    assert_eq!(policy_of_rate(1, 250_000_000), (4, 1));
    assert_eq!(policy_of_rate(3, 400_000_000), (15, 2));
    assert_eq!(policy_of_rate(1, 1_001_000_000), (1000, 1001));
    // Over an hour to be exact: rounded so as never to promise more, and never zero.
    assert_eq!(policy_of_rate(1, 4_000_000_001), (1, 5));
    assert_eq!(policy_of_rate(7, 86_400 * sec + 1), (7, 86_401));
    let c = parse(r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1500ms"}}]}"#).unwrap();
    assert_eq!(c.rules[0].quota().unwrap().policy, (2, Some(3)));
}

#[test]
fn overrides_match_ipv4_mapped_addresses_as_ipv4() {
    let c = parse(
        r#"{"rules":[{"name":"r","key":["client_ip"],"limit":{"requests":1,"per":"1s"},
            "overrides":[{"values":["::ffff:10.0.0.1"],"block":true}]}]}"#,
    )
    .unwrap();
    assert_eq!(
        c.rules[0].overrides[0].key,
        crate::key::encode_key([Some(&b"10.0.0.1"[..])].into_iter())
    );
}

#[test]
fn a_rule_settles_its_cost_from_the_response_and_stashes_nothing() {
    let c = parse(
        r#"{"rules":[{"name":"llm","key":["header:x-api-key"],"limit":{"requests":10000,"per":"1m"},
            "cost":{"header":"x-max-tokens","default":500,"max":4000},
            "settle":{"usage":{"input":1,"output":3},"max_body_bytes":65536}}]}"#,
    )
    .unwrap();
    let r = &c.rules[0];
    assert_eq!(r.worker_batch, 0);
    let settle = r.settle.as_ref().unwrap();
    assert_eq!(settle.max_body_bytes, 65_536);
    let SettleFrom::Usage(cost) = settle.from else {
        panic!("{settle:?}")
    };
    let usage = crate::usage::Usage {
        input: Some(100),
        output: Some(10),
        total: Some(110),
        complete: true,
    };
    assert_eq!(cost.of(&usage), Some(130));
}

#[test]
fn a_metadata_key_part_is_the_property_path_of_a_dynamic_metadata_field() {
    let c = parse(
        r#"{"rules":[{"name":"r","key":["metadata:envoy.filters.http.jwt_authn/payload/sub"],
            "limit":{"requests":1,"per":"1s"}}]}"#,
    )
    .unwrap();
    assert_eq!(
        c.rules[0].key,
        [KeyPart::Metadata(
            b"metadata\0filter_metadata\0envoy.filters.http.jwt_authn\0payload\0sub".to_vec()
        )]
    );
    let refused = c.check_host(&HostCaps::NGINX).unwrap_err().to_string();
    assert!(
        refused.starts_with(
            "rules[0].key[0]: nginx (ngx_wasm_module) gives a filter no request metadata"
        ),
        "{refused}"
    );
    assert!(c.check_host(&HostCaps::ENVOY).is_ok());
    let fair = parse(
        r#"{"rules":[{"name":"a","algorithm":"adaptive","adaptive":{"fair_key":["metadata:a/b"]}}]}"#,
    )
    .unwrap();
    let refused = fair.check_host(&HostCaps::NGINX).unwrap_err().to_string();
    assert!(
        refused.starts_with("rules[0].adaptive.fair_key[0]: nginx (ngx_wasm_module)"),
        "{refused}"
    );
}
