//! What a new user meets first: the README's global quick starts exactly as written, the quota
//! service with every default, bursts sent back to back on fresh connections.

use crate::harness::{eventually, parallel, repo, Client, Envoy, Options, Quota, Upstream};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// The first ```json block after the README line `heading`, parsed.
fn readme_json(heading: &str) -> Value {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let after = readme
        .split_once(&format!("\n{heading}\n"))
        .unwrap_or_else(|| panic!("no {heading:?} in the README"))
        .1;
    let block = after
        .split_once("```json\n")
        .and_then(|(_, rest)| rest.split_once("\n```"))
        .unwrap_or_else(|| panic!("no json block after {heading:?}"))
        .0;
    serde_json::from_str(block).unwrap_or_else(|e| panic!("{heading}: {e}\n{block}"))
}

fn envoy(quota: &Quota, plugin: &Value) -> Envoy {
    Envoy::start_with(
        plugin,
        &Options {
            quota_port: Some(quota.port),
            ..Options::default()
        },
    )
}

/// Two Envoys with the demo's global rule (`search`, one-token leases, `instances_hint` 2) at
/// `per_minute` and `burst`.
fn demo_global_envoys(quota: &Quota, per_minute: u64, burst: u64) -> [Envoy; 2] {
    let plugin = json!({
        "rules": [{"name": "search", "scope": "global",
                   "limit": {"requests": per_minute, "per": "1m"}, "burst": burst}],
        "quota_service": {"upstream": "quota", "instances_hint": 2, "lease_size": 1}
    });
    [envoy(quota, &plugin), envoy(quota, &plugin)]
}

/// One request on a connection of its own.
fn fresh(url: &str, user: &str) -> u16 {
    Client::new().get(url, &[("x-user", user)]).status
}

/// The issue's first scenario: a global 100 per hour, `failure_mode: deny`.
fn per_user(extra_rule: Value, instances_hint: u64) -> Value {
    let mut rule = json!({"name": "per-user", "scope": "global", "key": ["header:x-user"],
                          "limit": {"requests": 100, "per": "1h"}});
    for (k, v) in extra_rule.as_object().unwrap() {
        rule[k] = v.clone();
    }
    json!({"rules": [rule],
           "quota_service": {"upstream": "quota", "timeout": "200ms", "failure_mode": "deny",
                             "instances_hint": instances_hint}})
}

#[test]
fn a_burst_back_to_back_on_fresh_connections_is_admitted_in_full() {
    let quota = Quota::start(&[]);
    // With and without worker stashes, and with small token leases: every one of the burst of
    // 100 passes, and the next is refused (the service said the bucket is empty).
    for (user, rule, sent) in [
        ("no-stash", json!({"worker_batch": 0}), 100),
        ("defaults", json!({}), 100),
        ("small-leases", json!({"worker_batch": 0}), 40),
    ] {
        let mut plugin = per_user(rule, 1);
        if user == "small-leases" {
            plugin["quota_service"]["lease_size"] = json!(5);
        }
        let e = envoy(&quota, &plugin);
        let url = e.url("/");
        let started = Instant::now();
        let statuses: Vec<u16> = (0..sent).map(|_| fresh(&url, user)).collect();
        let took = started.elapsed();
        let admitted = statuses.iter().filter(|s| **s == 200).count();
        eprintln!(
            "{user}: {admitted} of {sent} back to back in {took:?}, {} quota calls",
            e.prometheus("tollgate_quota_calls{}")
        );
        assert_eq!(admitted, sent, "{user}: {statuses:?}");
        if sent == 100 {
            let refused = Client::new().get(&url, &[("x-user", user)]);
            assert_eq!(refused.status, 429, "{user}: the 101st");
            assert_eq!(refused.header("x-tollgate-rule"), Some("per-user"));
        }
        assert_eq!(e.counter("per-user", "fallback"), 0, "{user}");
    }
}

#[test]
fn a_burst_spread_over_three_envoys_is_admitted_exactly_once() {
    let quota = Quota::start(&[]);
    let plugin = per_user(json!({}), 3);
    let envoys: Vec<Envoy> = (0..3).map(|_| envoy(&quota, &plugin)).collect();
    // 150 requests, round robin over the three, each on a connection of its own.
    let statuses: Vec<u16> = (0..150)
        .map(|i| fresh(&envoys[i % 3].url("/"), "spread"))
        .collect();
    let admitted = statuses.iter().filter(|s| **s == 200).count();
    assert!(statuses.iter().all(|s| *s == 200 || *s == 429));
    let per_envoy: Vec<u64> = envoys
        .iter()
        .map(|e| e.counter("per-user", "allowed"))
        .collect();
    eprintln!("3 Envoys: {admitted} of 150 admitted ({per_envoy:?})");
    assert_eq!(admitted, 100, "{statuses:?}");
    // And from many clients at once: a fresh key, 8 connections over the three Envoys.
    let counts = parallel(8, |i| {
        let url = envoys[i % 3].url("/");
        (0..30).filter(|_| fresh(&url, "many") == 200).count()
    });
    assert_eq!(counts.iter().sum::<usize>(), 100, "{counts:?}");
}

#[test]
fn the_readme_global_limit_serves_a_new_deployment_at_once() {
    let plugin = readme_json("## Global limits");
    assert_eq!(
        plugin["rules"][0]["limit"],
        json!({"requests": 1000, "per": "1m"})
    );
    let quota = Quota::start(&[]);
    let e = envoy(&quota, &plugin);
    // The rule's burst (1000) from one client, back to back: all admitted, none waiting beyond
    // its refills, and the limit's bound holds after.
    let c = Client::new();
    let url = e.url("/");
    let started = Instant::now();
    let first: Vec<u16> = (0..1000)
        .map(|_| c.get(&url, &[("x-user", "ann")]).status)
        .collect();
    let admitted = first.iter().filter(|s| **s == 200).count();
    assert_eq!(admitted, 1000, "the burst, at once");
    let more: Vec<u16> = (0..200)
        .map(|_| c.get(&url, &[("x-user", "ann")]).status)
        .collect();
    let elapsed = started.elapsed().as_secs_f64();
    let total = admitted + more.iter().filter(|s| **s == 200).count();
    let bound = 1000 + (1000.0 / 60.0 * elapsed).ceil() as usize;
    eprintln!("README global rule: {total} admitted in {elapsed:.2} s, bound {bound}");
    assert!(total <= bound, "{total} admitted, bound {bound}");
    assert!(more.contains(&429));
    assert_eq!(e.counter("per-user", "fallback"), 0);
}

#[test]
fn the_readme_global_concurrency_limit_is_served_at_once() {
    let plugin = readme_json("### Global concurrency");
    assert_eq!(plugin["rules"][0]["limit"], json!({"concurrent": 50}));
    // Each request held 2 s upstream.
    let app = Upstream::start(&["--capacity", "1000", "--service-ms", "2000"]);
    let quota = Quota::start(&[]);
    let mut plugin = plugin;
    if std::env::var("DEBUG_QS").is_ok() {
        plugin["log_level"] = json!("debug");
    }
    let e = Envoy::start_with(
        &plugin,
        &Options {
            quota_port: Some(quota.port),
            app_port: Some(app.port),
            debug_log: std::env::var("DEBUG_QS").is_ok(),
            ..Options::default()
        },
    );
    let url = e.url("/app");
    let statuses = parallel(60, |_| {
        Client::new().get(&url, &[("x-tenant", "acme")]).status
    });
    let admitted = statuses.iter().filter(|s| **s == 200).count();
    eprintln!(
        "README global concurrency: {admitted} of 60 at once admitted ({} waited, {} slot calls)",
        e.counter("tenant", "waited"),
        e.prometheus("tollgate_quota_calls{}")
    );
    if std::env::var("DEBUG_QS").is_ok() {
        eprintln!("{}", e.log());
    }
    assert_eq!(admitted, 50, "{statuses:?}");
    assert!(app.max_at_once() <= 50);
}

#[test]
fn a_quota_service_outage_with_failure_mode_allow_refuses_nothing() {
    let quota = Quota::start(&[]);
    let plugin = json!({
        "rules": [{"name": "per-user", "scope": "global", "key": ["header:x-user"],
                   "limit": {"requests": 20, "per": "1d"}}],
        "quota_service": {"upstream": "quota", "failure_mode": "allow", "instances_hint": 1}
    });
    let e = envoy(&quota, &plugin);
    let c = Client::new();
    let url = e.url("/");
    // Over the limit first: the service says there is nothing left, and requests are refused.
    let over: Vec<u16> = (0..40)
        .map(|_| c.get(&url, &[("x-user", "u")]).status)
        .collect();
    assert_eq!(over.iter().filter(|s| **s == 200).count(), 20, "{over:?}");
    quota.pause();
    // The outage: once the first call has failed (its timeout), the failure mode lets every
    // request through, also while each retry is out.
    let failed = || {
        c.get(&url, &[("x-user", "u")]);
        e.prometheus("tollgate_quota_failures{}") > 0
    };
    assert!(eventually(Duration::from_secs(5), failed), "no call failed");
    let started = Instant::now();
    let mut during = Vec::new();
    while started.elapsed() < Duration::from_millis(2_500) {
        during.push(c.get(&url, &[("x-user", "u")]).status);
    }
    quota.resume();
    let refused = during.iter().filter(|s| **s != 200).count();
    eprintln!(
        "outage, failure_mode allow: {refused} of {} refused, {} failed calls",
        during.len(),
        e.prometheus("tollgate_quota_failures{}")
    );
    assert_eq!(refused, 0, "{during:?}");
}

#[test]
fn after_its_burst_a_global_rule_keeps_to_its_rate_across_two_envoys() {
    // The demo's global rule, sped up: 60 a minute (1 per second) after a burst of 6, one-token
    // leases, two Envoys. Each Envoy's share of the rate is half a token per second, renewed
    // every eighth of a lease: what accrues between renewals must add up, not be lost.
    let quota = Quota::start(&[]);
    let envoys = demo_global_envoys(&quota, 60, 6);
    let started = Instant::now();
    let mut statuses = Vec::new();
    let mut i = 0;
    while started.elapsed() < Duration::from_secs(10) {
        statuses.push(fresh(&envoys[i % 2].url("/"), "anyone"));
        i += 1;
        std::thread::sleep(Duration::from_millis(250));
    }
    let elapsed = started.elapsed().as_secs_f64();
    let admitted = statuses.iter().filter(|s| **s == 200).count() as f64;
    let bound = 6.0 + elapsed;
    eprintln!(
        "60/min over 2 Envoys, a request every 250 ms for {elapsed:.1} s: {admitted} admitted \
         (bound {bound:.1})"
    );
    assert!(
        admitted <= bound.ceil(),
        "{admitted} admitted, bound {bound}"
    );
    // The burst, and most of what the rate brought in the time (losses: what accrues between a
    // renewal's claim and its answer, and a lease's last fraction).
    assert!(
        admitted >= 6.0 + 0.6 * (elapsed - 1.0),
        "{admitted} admitted: {statuses:?}"
    );
}

#[test]
fn a_global_rule_of_a_few_a_minute_keeps_to_its_rate() {
    // As low as the demo's (6 a minute): over two Envoys a share of the rate would accrue half a
    // token per lease, never a whole one. Such rates are leased as tokens: the bucket refills,
    // and the proxies ask when the service says a token has come.
    let quota = Quota::start(&[]);
    let envoys = demo_global_envoys(&quota, 6, 1);
    let started = Instant::now();
    let mut statuses = Vec::new();
    let mut i = 0;
    while started.elapsed() < Duration::from_secs(25) {
        statuses.push(fresh(&envoys[i % 2].url("/"), "anyone"));
        i += 1;
        std::thread::sleep(Duration::from_millis(500));
    }
    let elapsed = started.elapsed().as_secs_f64();
    let admitted = statuses.iter().filter(|s| **s == 200).count() as f64;
    let bound = 1.0 + elapsed / 10.0;
    eprintln!("6/min over 2 Envoys for {elapsed:.1} s: {admitted} admitted (bound {bound:.1})");
    // Before, each Envoy held half the rate, which accrued half a token per lease: 1 of 45 in
    // 90 s.
    assert!(
        admitted <= bound.floor(),
        "{admitted} admitted, bound {bound}"
    );
    // The burst and the tokens that came back at 10 s and 20 s.
    assert_eq!(admitted, 3.0, "{statuses:?}");
}

/// The demo's low global rule (6 a minute, burst 1, over two Envoys): a client refused on both
/// Envoys comes back when `Retry-After` says, on either, and is admitted — not refused once more
/// while its proxy asks the service again after an answer that had nothing.
#[test]
fn a_client_that_comes_back_when_told_is_admitted() {
    let quota = Quota::start(&[]);
    let envoys = demo_global_envoys(&quota, 6, 1);
    let ask = |e: &Envoy| {
        let reply = Client::new().get(&e.url("/"), &[("x-user", "anyone")]);
        let retry: Option<u64> = reply.header("retry-after").and_then(|v| v.parse().ok());
        (reply.status, retry)
    };
    assert_eq!(ask(&envoys[0]).0, 200, "the burst");
    // Both Envoys' last answers for the key had nothing.
    let mut wait = 0;
    for e in &envoys {
        let (status, retry) = ask(e);
        assert_eq!(status, 429);
        wait = wait.max(retry.expect("Retry-After"));
    }
    for (round, e) in envoys.iter().enumerate() {
        std::thread::sleep(Duration::from_secs(wait) + Duration::from_millis(100));
        let (status, retry) = ask(e);
        assert_eq!(
            status, 200,
            "round {round}: came back after {wait} s: {status} {retry:?}"
        );
        // Refused again at once (the token is spent), with the wait until the next one.
        let (status, retry) = ask(&envoys[1 - round]);
        assert_eq!(status, 429);
        wait = retry.expect("Retry-After");
        assert!((9..=10).contains(&wait), "{wait}");
    }
}

#[test]
fn a_local_burst_back_to_back_on_fresh_connections_is_admitted_in_full() {
    // 100 a minute with a burst of 20 per user, every default (worker stashes on): 21 requests
    // back to back, each on a new connection (over both workers): the burst passes, the 21st not.
    let e = Envoy::start(
        &json!({"rules": [{"name": "per-user", "key": ["header:x-user"],
        "limit": {"requests": 100, "per": "1m"}, "burst": 20}]}),
    );
    let url = e.url("/");
    for round in 0..10 {
        let user = format!("r{round}");
        let codes: Vec<u16> = (0..21).map(|_| fresh(&url, &user)).collect();
        let admitted = codes.iter().filter(|s| **s == 200).count();
        assert_eq!(admitted, 20, "round {round}: {codes:?}");
    }
}

/// The README's LLM token budget exactly as written: a request reserves its maxima and its body's
/// bytes, and settles what the provider reported; what does not fit is refused with a true
/// `Retry-After`.
#[test]
fn the_readme_llm_budget_reserves_a_requests_maxima_and_settles_its_usage() {
    let plugin = readme_json("### An LLM token budget");
    let usage = r#"{"usage":{"prompt_tokens":100,"completion_tokens":900,"total_tokens":1000}}"#;
    let opts = Options {
        routes: vec![json!({
            "match": {"prefix": "/v1/chat"},
            "direct_response": {"status": 200, "body": {"inline_string": usage}},
            "response_headers_to_add": [{"header": {"key": "content-type",
                                                    "value": "application/json"}}]
        })],
        // (The README says so: rules that read the body need it in Envoy.)
        body_readable: true,
        ..Options::default()
    };
    let envoy = Envoy::start_with(&plugin, &opts);
    let client = Client::new();
    let url = envoy.url("/v1/chat");
    let key = [
        ("x-api-key", "team-a"),
        ("content-type", "application/json"),
    ];
    let body = |max: u64| format!(r#"{{"model":"m","max_tokens":{max},"messages":[]}}"#);
    // 6 000 reserved, 1 000 used: 9 000 left.
    let first = client.post(&url, &key, body(6_000).as_bytes());
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(envoy.counter("tokens-per-key", "settled"), 1_000);
    // 9 000 and the body's bytes do not fit; 8 000 and them do.
    let refused = client.post(&url, &key, body(9_000).as_bytes());
    assert_eq!(refused.status, 429);
    let wait: u64 = refused.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=60).contains(&wait), "retry-after {wait}");
    assert_eq!(client.post(&url, &key, body(8_000).as_bytes()).status, 200);
}

/// The README's section `heading`, up to the next heading of its level or above.
fn readme_section(heading: &str) -> String {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let after = readme
        .split_once(&format!("\n{heading}\n"))
        .unwrap_or_else(|| panic!("no {heading:?} in the README"))
        .1;
    after
        .split("\n## ")
        .next()
        .unwrap()
        .split("\n### ")
        .next()
        .unwrap()
        .to_string()
}

/// The ```lang blocks of `text`, in order.
fn blocks<'a>(text: &'a str, lang: &str) -> Vec<&'a str> {
    text.split(&format!("```{lang}\n"))
        .skip(1)
        .filter_map(|b| b.split_once("```").map(|(block, _)| block))
        .collect()
}

#[test]
fn the_readme_native_quick_start_runs_as_written() {
    let section = readme_section("### Envoy, native (a dynamic module)");
    let sh = blocks(&section, "sh");
    let commands = sh[0];
    assert!(commands.contains("make build"));
    assert!(commands.contains(
        "ENVOY_DYNAMIC_MODULES_SEARCH_PATH=$PWD/dist .venv/bin/envoy -c envoy/envoy-native.yaml"
    ));
    let file = std::fs::read_to_string(repo().join("envoy/envoy-native.yaml")).unwrap();
    let bootstrap: Value = serde_yaml_ng::from_str(&file).unwrap();
    // Pasted at once, the curls wait for Envoy: its admin port's readiness, then the requests.
    let ready = commands
        .find("until curl -sf localhost:9901/ready")
        .expect("the block waits until Envoy is ready");
    assert!(ready < commands.find("for i in").unwrap());
    assert_eq!(
        bootstrap["admin"]["address"]["socket_address"]["port_value"],
        9901
    );
    // The snippets are the file's own filter and runtime layer.
    let yaml = blocks(&section, "yaml");
    let filters: Value = serde_yaml_ng::from_str(yaml[0]).unwrap();
    let chain = &bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ["typed_config"]["http_filters"];
    assert_eq!(filters["http_filters"][0], chain[0]);
    let runtime: Value = serde_yaml_ng::from_str(yaml[1]).unwrap();
    assert_eq!(runtime["layered_runtime"], bootstrap["layered_runtime"]);
    // Run as written (only the ports change): the module from dist/, by its name.
    let file = file.replace("port_value: 10000", "port_value: 0");
    let opts = Options {
        build: Some(crate::harness::Build::Native),
        module: Some(repo().join("dist/libtollgate.so")),
        ..Options::default()
    };
    let envoy = Envoy::start_bootstrap_with(serde_yaml_ng::from_str(&file).unwrap(), &opts);
    // `curl` seven times, each on a connection of its own.
    let codes: Vec<u16> = (0..7)
        .map(|_| Client::new().get(&envoy.url("/"), &[]).status)
        .collect();
    assert_eq!(codes, [200, 200, 200, 200, 200, 429, 429]);
    assert!(commands.contains("200 200 200 200 200 429 429"));
    let refused = Client::new().get(&envoy.url("/"), &[]);
    assert_eq!(
        refused.header("ratelimit-policy"),
        Some(r#""per-ip";q=5;w=60"#)
    );
    assert!(refused.header("retry-after").is_some());
    assert_eq!(envoy.counter("per-ip", "allowed"), 5);
}
