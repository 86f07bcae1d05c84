//! What clients and operators see: quota headers, Retry-After, the refusal, dry run, metrics.

use crate::harness::{one_rule, statuses, Client, Envoy, Options, Reply};
use serde_json::json;

fn rule_with_format(format: &str) -> serde_json::Value {
    json!({
        "rules": [{"name": "quota", "limit": {"requests": 2, "per": "1m"}, "burst": 2}],
        "rate_limit_headers": format
    })
}

fn two_then_refused(envoy: &Envoy) -> (Reply, Reply, Reply) {
    let c = Client::new();
    let url = envoy.url("/");
    (c.get(&url, &[]), c.get(&url, &[]), c.get(&url, &[]))
}

#[test]
fn draft_headers_by_default() {
    // 2 per minute, burst 2: one token every 30 s.
    let envoy = Envoy::start(&one_rule(json!({
        "name": "quota", "limit": {"requests": 2, "per": "1m"}, "burst": 2
    })));
    let (first, second, refused) = two_then_refused(&envoy);
    assert_eq!(first.status, 200);
    assert_eq!(first.header("ratelimit-policy"), Some("\"quota\";q=2;w=60"));
    assert_eq!(first.header("ratelimit"), Some("\"quota\";r=1;t=30"));
    assert_eq!(second.header("ratelimit"), Some("\"quota\";r=0;t=60"));
    assert_eq!(first.header("x-ratelimit-limit"), None);
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header("ratelimit"), Some("\"quota\";r=0;t=30"));
    assert_eq!(refused.header("retry-after"), Some("30"));
    assert_eq!(refused.header("x-tollgate-rule"), Some("quota"));
    assert_eq!(refused.header("content-type"), Some("text/plain"));
    assert_eq!(refused.body, "rate limited\n");
}

#[test]
fn legacy_both_and_none_formats() {
    let legacy = Envoy::start(&rule_with_format("legacy"));
    let (first, _, refused) = two_then_refused(&legacy);
    assert_eq!(first.header("x-ratelimit-limit"), Some("2"));
    assert_eq!(first.header("x-ratelimit-remaining"), Some("1"));
    assert_eq!(first.header("x-ratelimit-reset"), Some("30"));
    assert_eq!(first.header("ratelimit"), None);
    assert_eq!(refused.header("x-ratelimit-remaining"), Some("0"));
    assert_eq!(refused.header("x-ratelimit-reset"), Some("30"));
    assert_eq!(refused.header("retry-after"), Some("30"));
    drop(legacy);

    let both = Envoy::start(&rule_with_format("both"));
    let (first, _, _) = two_then_refused(&both);
    assert_eq!(first.header("ratelimit"), Some("\"quota\";r=1;t=30"));
    assert_eq!(first.header("x-ratelimit-remaining"), Some("1"));
    drop(both);

    let none = Envoy::start(&rule_with_format("none"));
    let (first, _, refused) = two_then_refused(&none);
    for r in [&first, &refused] {
        assert!(r.header("ratelimit").is_none() && r.header("x-ratelimit-limit").is_none());
    }
    assert_eq!(refused.header("retry-after"), Some("30"));
    assert_eq!(refused.header("x-tollgate-rule"), Some("quota"));
}

#[test]
fn retry_after_is_rounded_up_to_whole_seconds() {
    let envoy = Envoy::start(&json!({"rules": [
        {"name": "quarter", "match": {"path": "/quarter"},
         "limit": {"requests": 1, "per": "250ms"}, "burst": 1},
        {"name": "one-and-half", "match": {"path": "/slow"},
         "limit": {"requests": 2, "per": "3s"}, "burst": 1}
    ]}));
    let c = Client::new();
    let sent = std::time::Instant::now();
    assert_eq!(c.get(&envoy.url("/quarter"), &[]).status, 200);
    let r = c.get(&envoy.url("/quarter"), &[]);
    if r.status == 429 {
        // Under 250 ms to wait: 1 second, never 0.
        assert_eq!(r.header("retry-after"), Some("1"));
    } else {
        // Only a slow machine gets here: the token must really have been refilled.
        assert!(
            sent.elapsed() >= std::time::Duration::from_millis(240),
            "{r:?}"
        );
    }
    assert_eq!(c.get(&envoy.url("/slow"), &[]).status, 200);
    let r = c.get(&envoy.url("/slow"), &[]);
    assert_eq!(r.status, 429);
    // Just under 1.5 s to wait: 2 seconds.
    assert_eq!(r.header("retry-after"), Some("2"));
    assert_eq!(
        r.header("ratelimit-policy"),
        Some("\"one-and-half\";q=2;w=3")
    );
}

#[test]
fn allowed_responses_report_the_most_restrictive_rule() {
    let envoy = Envoy::start(&json!({"rules": [
        {"name": "roomy", "limit": {"requests": 100, "per": "1m"}},
        {"name": "tight", "key": ["header:x-user"], "limit": {"requests": 5, "per": "1m"}}
    ]}));
    let c = Client::new();
    let r = c.get(&envoy.url("/"), &[("x-user", "u")]);
    assert_eq!(r.header("ratelimit"), Some("\"tight\";r=4;t=12"));
    let r = c.get(&envoy.url("/"), &[]);
    assert_eq!(r.header("ratelimit"), Some("\"roomy\";r=98;t=2"));
}

#[test]
fn the_rejection_response_is_configurable() {
    let envoy = Envoy::start(&json!({
        "rules": [{"name": "r", "limit": {"requests": 1, "per": "1d"}, "burst": 1}],
        "response": {"status": 503, "body": "{\"error\":\"slow down\"}",
                     "headers": {"Content-Type": "application/json", "x-extra": "1"}}
    }));
    let (_, _, refused) = two_then_refused(&envoy);
    assert_eq!(refused.status, 503);
    assert_eq!(refused.body, "{\"error\":\"slow down\"}");
    assert_eq!(refused.header("content-type"), Some("application/json"));
    assert_eq!(refused.header("x-extra"), Some("1"));
    assert_eq!(refused.header("x-tollgate-rule"), Some("r"));
}

#[test]
fn dry_run_counts_and_logs_but_never_refuses() {
    let envoy = Envoy::start(&json!({"rules": [
        {"name": "shadow", "dry_run": true, "limit": {"requests": 1, "per": "1d"}, "burst": 2},
        {"name": "enforced", "limit": {"requests": 1, "per": "1d"}, "burst": 4}
    ]}));
    // One connection: one worker, whose log lines are counted below.
    let c = Client::new();
    let codes: Vec<u16> = (0..6).map(|_| c.get(&envoy.url("/"), &[]).status).collect();
    assert_eq!(codes, [200, 200, 200, 200, 429, 429]);
    assert_eq!(envoy.counter("shadow", "allowed"), 2);
    // Every would-be refusal counts, also of requests the enforced rule refused.
    assert_eq!(envoy.counter("shadow", "dry_run_limited"), 4);
    assert_eq!(envoy.counter("shadow", "limited"), 0);
    assert_eq!(envoy.counter("enforced", "allowed"), 4);
    assert_eq!(envoy.counter("enforced", "limited"), 2);
    // Logged at most once a second per rule (and worker): the first would-be refusal at once,
    // the other three in the next line, a second later, by the tick (no request needed).
    assert!(envoy.log_shows("dry run: rule shadow would have refused 1 request(s)"));
    let lines = |e: &Envoy| e.log().matches("dry run: rule shadow").count();
    assert_eq!(lines(&envoy), 1, "{}", envoy.log());
    assert!(envoy.log_shows("dry run: rule shadow would have refused 3 request(s)"));
    assert_eq!(lines(&envoy), 2);

    let all_dry = Envoy::start(&json!({
        "rules": [{"name": "r", "limit": {"requests": 1, "per": "1d"}, "burst": 3}],
        "dry_run": true
    }));
    let c = Client::new();
    let replies: Vec<Reply> = (0..5).map(|_| c.get(&all_dry.url("/"), &[])).collect();
    assert!(replies.iter().all(|r| r.status == 200));
    // A would-be refusal still tells the client where it stands.
    assert_eq!(replies[4].header("ratelimit"), Some("\"r\";r=0;t=86400"));
    assert_eq!(all_dry.counter("r", "dry_run_limited"), 2);
    assert_eq!(all_dry.counter("r", "allowed"), 3);
}

#[test]
fn metrics_are_exposed_per_rule_in_prometheus_format() {
    let envoy = Envoy::start(&json!({"rules": [
        {"name": "a", "limit": {"requests": 1, "per": "1d"}, "burst": 10},
        {"name": "b", "match": {"path": "/b"}, "limit": {"requests": 1, "per": "1d"}, "burst": 1}
    ]}));
    statuses(&envoy.url("/"), &[], 2);
    statuses(&envoy.url("/b"), &[], 3);
    // a: 2 admitted on "/" and 1 on "/b"; b refused the other two "/b" (and a was not charged).
    assert_eq!(envoy.counter("a", "allowed"), 3);
    assert_eq!(envoy.counter("b", "allowed"), 1);
    assert_eq!(envoy.counter("b", "limited"), 2);
    assert_eq!(envoy.counter("a", "limited"), 0);
    assert_eq!(envoy.counter("a", "dry_run_limited"), 0);
    assert_eq!(envoy.counter("a", "contended"), 0);
    let stats = envoy.admin_get("/stats/prometheus");
    assert!(
        stats.contains("# TYPE tollgate_rule_allowed counter"),
        "{stats}"
    );
}

#[test]
fn logs_a_summary_per_load_and_a_debug_line_per_decision() {
    let rules = json!([
        {"name": "a", "algorithm": "sliding_window", "limit": {"requests": 5, "per": "1m"}},
        {"name": "b", "algorithm": "concurrency", "limit": {"concurrent": 2}, "dry_run": true}
    ]);
    let opts = Options {
        debug_log: true,
        ..Options::default()
    };
    // At the default level, no decision lines even when the host logs debug.
    let quiet = Envoy::start_with(&json!({"rules": rules}), &opts);
    assert!(quiet.log_shows(&format!(
        "configuration loaded on {}: 2 rule(s): a (sliding_window 5 per 1m, 10000 slots); \
         b (concurrency 2 in flight, 10000 slots, dry run)",
        crate::harness::host_name()
    )));
    statuses(&quiet.url("/"), &[], 1);
    assert_eq!(quiet.counter("a", "allowed"), 1);
    assert!(!quiet.log().contains("rule a key "));
    drop(quiet);
    let envoy = Envoy::start_with(&json!({"rules": rules, "log_level": "debug"}), &opts);
    statuses(&envoy.url("/"), &[], 1);
    assert!(envoy.log_shows("rule a key "));
    assert!(envoy.log_shows("Admitted { remaining: 4"));
}
