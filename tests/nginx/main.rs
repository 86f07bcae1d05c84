//! The behaviour checks in nginx with Kong's ngx_wasm_module: the built `.wasm` in a real nginx
//! (2 workers) named by `NGINX_BIN`. `make test-nginx` runs them; without `NGINX_BIN` every test
//! says it skipped. CI has no such nginx (docs/nginx.md says how to build one).

// Test code: a failed expectation is meant to panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod harness;

use harness::{parallel, raw, raw_status, statuses, Client, Location, Nginx, Quota};
use serde_json::{json, Value};
use std::collections::HashSet;
use std::time::{Duration, Instant};

fn count(statuses: &[u16], status: u16) -> usize {
    statuses.iter().filter(|s| **s == status).count()
}

#[test]
fn a_token_bucket_admits_exactly_its_burst_across_two_workers() {
    nginx_or_skip!();
    // Local rules make no calls: they work in nginx's default phase too (rewrite).
    let nginx = Nginx::start_with(vec![Location {
        path: "/",
        plugin: json!({"rules": [
            {"name": "burst", "limit": {"requests": 1, "per": "1h"}, "burst": 10}
        ]}),
        in_access: false,
    }]);
    let replies = parallel(50, |_| {
        let r = Client::new().get(&nginx.url("/"), &[]);
        (r.status, r.header("x-worker").map(str::to_string))
    });
    let codes: Vec<u16> = replies.iter().map(|(s, _)| *s).collect();
    assert_eq!(count(&codes, 200), 10, "{codes:?}");
    assert_eq!(count(&codes, 429), 40);
    let workers: HashSet<_> = replies.iter().filter_map(|(_, w)| w.clone()).collect();
    assert_eq!(workers.len(), 2, "both workers served: {workers:?}");
    assert!(nginx.workers_healthy(), "{}", nginx.log());
}

#[test]
fn an_invalid_configuration_is_refused_with_the_field_named() {
    nginx_or_skip!();
    let log = harness::Nginx::expect_refusal(&json!({"rules": [
        {"name": "r", "limit": {"requests": 1, "per": "5x"}}
    ]}));
    assert!(
        log.contains("invalid configuration: rules[0].limit.per: invalid duration \"5x\""),
        "{log}"
    );
}

#[test]
fn holding_requests_is_refused_at_load_with_the_host_named_and_nodelay_works() {
    nginx_or_skip!();
    let log = Nginx::expect_refusal(&json!({"rules": [
        {"name": "slow", "algorithm": "leaky_bucket", "limit": {"requests": 10, "per": "1s"},
         "burst": 3}
    ]}));
    assert!(
        log.contains("rules[0].delay: nginx (ngx_wasm_module) cannot resume a held request"),
        "{log}"
    );
    let nginx = Nginx::start(&json!({"rules": [
        {"name": "slow", "algorithm": "leaky_bucket", "limit": {"requests": 1, "per": "1h"},
         "burst": 3, "delay": "nodelay"}
    ]}));
    // nginx limit_req nodelay: the first request and a burst of 3, the rest refused at once.
    assert_eq!(statuses(&nginx.url("/"), &[], 10), (4, 6));
}

#[test]
fn each_header_value_gets_its_own_bucket_with_headers_and_retry_after() {
    nginx_or_skip!();
    let nginx = Nginx::start(&json!({"rules": [
        {"name": "per-user", "key": ["header:x-user"], "limit": {"requests": 2, "per": "1h"}}
    ]}));
    let c = Client::new();
    let ok = c.get(&nginx.url("/"), &[("x-user", "alice")]);
    assert_eq!(ok.status, 200);
    assert_eq!(
        ok.header("ratelimit-policy"),
        Some("\"per-user\";q=2;w=3600")
    );
    assert_eq!(ok.header("ratelimit"), Some("\"per-user\";r=1;t=1800"));
    assert_eq!(c.get(&nginx.url("/"), &[("x-user", "alice")]).status, 200);
    let refused = c.get(&nginx.url("/"), &[("x-user", "alice")]);
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header("retry-after"), Some("1800"));
    assert_eq!(refused.header("x-tollgate-rule"), Some("per-user"));
    assert!(refused.body.starts_with("rate limited"));
    assert_eq!(statuses(&nginx.url("/"), &[("x-user", "bob")], 3), (2, 1));
    // No header: the rule does not apply.
    assert_eq!(statuses(&nginx.url("/"), &[], 5), (5, 0));
}

#[test]
fn concurrency_slots_are_released_also_when_the_client_goes_away() {
    nginx_or_skip!();
    let nginx = Nginx::start(&json!({"rules": [
        {"name": "slots", "algorithm": "concurrency", "limit": {"concurrent": 2},
         "match": {"path_prefix": "/slow"}, "response": {"status": 503}}
    ]}));
    // 1.5 s at the backend: all four overlap even on a loaded machine.
    let first = parallel(4, |_| {
        Client::new()
            .get(&nginx.url("/slow"), &[("x-delay-ms", "1500")])
            .status
    });
    assert_eq!(
        (count(&first, 200), count(&first, 503)),
        (2, 2),
        "{first:?}"
    );
    assert_eq!(
        nginx.backend.peak.load(std::sync::atomic::Ordering::SeqCst),
        2
    );
    // Two clients give up while their requests are at the backend (a quick 503 means the first
    // four's slots were not all back yet: ask again).
    let gave_up = parallel(2, |_| {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match Client::with_timeout(Duration::from_millis(150)).try_send(
                "GET",
                &nginx.url("/slow"),
                &[],
            ) {
                Err(_) => break true,
                Ok(r) if r.status == 503 && Instant::now() < deadline => continue,
                Ok(_) => break false,
            }
        }
    });
    assert_eq!(gave_up, [true, true]);
    // Their slots come back: two requests are admitted again (retried until the aborts land).
    let mut again = Vec::new();
    let released = testkit::eventually(Duration::from_secs(5), || {
        again = parallel(2, |_| {
            Client::new()
                .get(&nginx.url("/slow"), &[("x-delay-ms", "0")])
                .status
        });
        again == [200, 200]
    });
    assert!(released, "slots not released: {again:?}");
    assert!(nginx.workers_healthy(), "{}", nginx.log());
}

#[test]
fn ipv6_clients_are_limited_by_their_64_and_overrides_take_cidr_ranges() {
    nginx_or_skip!();
    let nginx = Nginx::start(&testkit::client_networks_plugin());
    testkit::check_client_networks(&nginx.url("/"));
}

#[test]
fn hosts_match_and_key_by_the_host_header() {
    nginx_or_skip!();
    let nginx = Nginx::start(&json!({"rules": [
        {"name": "a-only", "match": {"hosts": ["a.example"]}, "limit": {"requests": 1, "per": "1h"},
         "burst": 2},
        {"name": "per-host", "key": ["host"], "match": {"path": "/k"},
         "limit": {"requests": 1, "per": "1h"}, "burst": 1}
    ]}));
    let url = nginx.url("/");
    assert_eq!(statuses(&url, &[("host", "A.Example:8080")], 4), (2, 2));
    assert_eq!(statuses(&url, &[("host", "b.example")], 4), (4, 0));
    let k = nginx.url("/k");
    assert_eq!(statuses(&k, &[("host", "c.example")], 2), (1, 1));
    assert_eq!(statuses(&k, &[("host", "d.example")], 2), (1, 1));
}

fn global(rule: Value, service: Value) -> Value {
    json!({"rules": [rule], "quota_service": service})
}

#[test]
fn strict_global_mode_counts_every_request_at_the_quota_service() {
    nginx_or_skip!();
    let quota = Quota::start(&[]);
    let nginx = Nginx::start(&global(
        json!({"name": "exact", "scope": "global", "limit": {"requests": 1, "per": "1d"}, "burst": 7}),
        json!({"upstream": format!("127.0.0.1:{}", quota.port), "mode": "strict"}),
    ));
    let codes = parallel(4, |_| {
        let c = Client::new();
        (0..5)
            .map(|_| c.get(&nginx.url("/"), &[]).status)
            .collect::<Vec<_>>()
    })
    .concat();
    assert_eq!(
        (count(&codes, 200), count(&codes, 429)),
        (7, 13),
        "{codes:?}"
    );
    let r = Client::new().get(&nginx.url("/"), &[]);
    assert_eq!(r.header("x-tollgate-rule"), Some("exact"));
    assert!(nginx.workers_healthy(), "{}", nginx.log());
}

#[test]
fn strict_mode_gives_back_what_a_refused_request_was_granted() {
    nginx_or_skip!();
    let quota = Quota::start(&[]);
    let upstream = format!("127.0.0.1:{}", quota.port);
    let nginx = Nginx::start(&testkit::strict_give_back_plugin(&upstream));
    testkit::check_strict_give_back(&nginx.url("/"), &quota);
    assert!(nginx.workers_healthy(), "{}", nginx.log());
}

#[test]
fn lease_mode_waits_for_a_first_lease_by_a_call_of_the_requests_own() {
    nginx_or_skip!();
    let quota = Quota::start(&[]);
    let upstream = format!("127.0.0.1:{}", quota.port);
    for first_lease in ["wait", "provisional"] {
        let nginx = Nginx::start(&global(
            json!({"name": "leased", "scope": "global", "key": ["header:x-user"],
                   "limit": {"requests": 1, "per": "1d"}, "burst": 40}),
            json!({"upstream": upstream, "first_lease": first_lease, "timeout": "1s"}),
        ));
        let user = format!("user-{first_lease}");
        let codes = parallel(4, |_| {
            let c = Client::new();
            (0..15)
                .map(|_| c.get(&nginx.url("/"), &[("x-user", &user)]).status)
                .collect::<Vec<_>>()
        })
        .concat();
        // Never more than the global bucket; with a provisional first lease, at most the local
        // stand-in's 40 more. Waiting, never less: a request is refused only when the service
        // said the bucket is empty.
        let admitted = count(&codes, 200);
        let (least, bound) = if first_lease == "wait" {
            (40, 40)
        } else {
            (30, 80)
        };
        assert!(
            admitted >= least && admitted <= bound,
            "{first_lease}: {admitted} admitted: {codes:?}"
        );
        assert!(codes.iter().all(|s| *s == 200 || *s == 429), "{codes:?}");
        assert!(nginx.workers_healthy(), "{}", nginx.log());
    }
}

#[test]
fn a_burst_back_to_back_on_fresh_connections_is_admitted_in_full() {
    nginx_or_skip!();
    // The quota service and the quota_service section with their defaults (first_lease wait,
    // failure_mode allow): a global burst of 20, requests sent one after another, each on a
    // connection of its own (spread over both workers).
    let quota = Quota::start(&[]);
    for sent in [30, 40] {
        let nginx = Nginx::start(&global(
            json!({"name": "per-user", "scope": "global", "key": ["header:x-user"],
                   "limit": {"requests": 20, "per": "1h"}}),
            json!({"upstream": format!("127.0.0.1:{}", quota.port)}),
        ));
        let user = format!("burst-{sent}");
        let codes: Vec<u16> = (0..sent)
            .map(|_| {
                Client::new()
                    .get(&nginx.url("/"), &[("x-user", &user)])
                    .status
            })
            .collect();
        assert_eq!(count(&codes, 200), 20, "{sent} sent: {codes:?}");
        assert_eq!(count(&codes, 429), sent - 20, "{codes:?}");
        assert!(nginx.workers_healthy(), "{}", nginx.log());
    }
}

#[test]
fn a_daily_calendar_quota_in_tokyo_is_spent_refused_until_midnight_and_full_again() {
    nginx_or_skip!();
    // The service's calendar reads 10 s before midnight in Tokyo (nginx takes a few to load the
    // module).
    let started = Instant::now();
    let quota = Quota::start(&["--calendar-clock", "2026-11-28T23:59:50+09:00"]);
    let midnight = started + Duration::from_secs(10);
    let nginx = Nginx::start(&global(
        json!({"name": "daily", "scope": "global", "key": ["header:x-user"],
               "limit": {"requests": 4, "per": "day", "calendar": {"time_zone": "Asia/Tokyo"}}}),
        // (nginx: failure_mode allow, as first_lease wait needs there.)
        json!({"upstream": format!("127.0.0.1:{}", quota.port)}),
    ));
    let send = || Client::new().get(&nginx.url("/"), &[("x-user", "ann")]);
    let codes: Vec<u16> = (0..6).map(|_| send().status).collect();
    assert!(
        Instant::now() < midnight,
        "the day ended before it was spent: too slow a machine"
    );
    assert_eq!(count(&codes, 200), 4, "{codes:?}");
    let refused = send();
    assert_eq!(refused.status, 429);
    let wait: u64 = refused.header("retry-after").unwrap().parse().unwrap();
    let left = midnight.saturating_duration_since(Instant::now()).as_secs();
    assert!(
        wait <= 10 && wait + 1 >= left,
        "retry-after {wait}, {left} s to midnight"
    );
    // From midnight: 4 more, a day's worth.
    let mut first = None;
    while first.is_none() && started.elapsed() < Duration::from_secs(18) {
        let reply = send();
        if reply.status == 200 {
            assert!(Instant::now() >= midnight, "admitted before midnight");
            first = Some(reply);
        } else {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    assert!(first.is_some(), "still refused 8 s after midnight");
    let more = (0..6).filter(|_| send().status == 200).count();
    assert_eq!(more, 3, "the new day's 4");
    assert!(nginx.workers_healthy(), "{}", nginx.log());
}

#[test]
fn over_a_global_rate_nginx_admits_its_share_and_refuses_at_once() {
    nginx_or_skip!();
    let quota = Quota::start(&[]);
    let nginx = Nginx::start(&global(
        json!({"name": "rate", "scope": "global", "limit": {"requests": 20, "per": "1s"}}),
        json!({"upstream": format!("127.0.0.1:{}", quota.port), "first_lease": "provisional",
               "timeout": "200ms"}),
    ));
    let started = Instant::now();
    let answers = parallel(4, |_| {
        let c = Client::new();
        let mut out = Vec::new();
        while started.elapsed() < Duration::from_secs(3) {
            let sent = Instant::now();
            out.push((c.get(&nginx.url("/"), &[]).status, sent.elapsed()));
        }
        out
    })
    .concat();
    let elapsed = started.elapsed().as_secs_f64();
    let admitted = answers.iter().filter(|a| a.0 == 200).count() as f64;
    // Burst 20 + 20/s, and the provisional stand-in's 20 while the first lease is on its way.
    let bound = 20.0 + 20.0 * elapsed + 20.0;
    assert!(admitted <= bound, "{admitted} admitted, bound {bound}");
    assert!(
        admitted >= 20.0 * elapsed * 0.7,
        "{admitted} admitted in {elapsed:.1} s"
    );
    assert!(answers.iter().all(|a| a.0 == 200 || a.0 == 429));
    let mut latencies: Vec<Duration> = answers.iter().map(|a| a.1).collect();
    latencies.sort();
    let p99 = latencies[latencies.len() * 99 / 100];
    assert!(
        p99 < Duration::from_millis(100),
        "p99 {p99:?}: refusals are immediate"
    );
    assert!(nginx.workers_healthy(), "{}", nginx.log());
}

#[test]
fn failure_mode_deny_answers_when_the_quota_service_is_down() {
    nginx_or_skip!();
    let nginx = Nginx::start(&global(
        json!({"name": "g", "scope": "global", "limit": {"requests": 10, "per": "1s"}}),
        json!({"upstream": format!("127.0.0.1:{}", harness::free_port()), "failure_mode": "deny",
               "first_lease": "provisional", "timeout": "200ms"}),
    ));
    // The provisional stand-in serves while the refill is asked for; once that call has failed,
    // the failure mode refuses.
    let started = Instant::now();
    let c = Client::new();
    let refused = loop {
        let r = c.get(&nginx.url("/"), &[]);
        if r.status == 429 {
            break r;
        }
        assert_eq!(r.status, 200);
        assert!(started.elapsed() < Duration::from_secs(3), "never refused");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(refused.header("x-tollgate-rule"), Some("g"));
    assert!(nginx.workers_healthy(), "{}", nginx.log());
}

#[test]
fn refusing_after_a_failed_call_of_the_requests_own_is_refused_at_load() {
    nginx_or_skip!();
    let log = Nginx::expect_refusal(&global(
        json!({"name": "g", "scope": "global", "limit": {"requests": 10, "per": "1s"}}),
        json!({"upstream": "127.0.0.1:1", "mode": "strict", "failure_mode": "deny"}),
    ));
    assert!(
        log.contains("quota_service.failure_mode: nginx (ngx_wasm_module) drops the connection"),
        "{log}"
    );
}

#[test]
fn a_hung_quota_service_lets_strict_requests_go_on_after_the_timeout() {
    nginx_or_skip!();
    let quota = Quota::start(&[]);
    let nginx = Nginx::start(&global(
        json!({"name": "exact", "scope": "global", "limit": {"requests": 1, "per": "1d"}, "burst": 3}),
        json!({"upstream": format!("127.0.0.1:{}", quota.port), "mode": "strict",
               "timeout": "200ms"}),
    ));
    let c = Client::new();
    assert_eq!(c.get(&nginx.url("/"), &[]).status, 200);
    quota.pause();
    // failure_mode allow: each request goes on once its own call has timed out.
    let started = Instant::now();
    let during = parallel(4, |_| Client::new().get(&nginx.url("/"), &[]).status);
    let took = started.elapsed();
    quota.resume();
    assert_eq!(during, [200, 200, 200, 200]);
    assert!(
        took >= Duration::from_millis(150) && took < Duration::from_secs(3),
        "{took:?}"
    );
    // The service is back and counts again once `retry` (1 s) has passed since the failures, in
    // each worker (each keeps its own retry time, so one may still be in its window when the
    // other refuses): the bucket (3) is spent by the first request and by the calls that timed
    // out, which reach it when it wakes up (stricter, never looser).
    assert!(
        testkit::eventually(Duration::from_secs(5), || statuses(&nginx.url("/"), &[], 4)
            == (0, 4)),
        "the service never counted again"
    );
    assert!(nginx.workers_healthy(), "{}", nginx.log());
}

#[test]
fn bytes_that_are_not_utf8_never_crash_a_worker() {
    nginx_or_skip!();
    let nginx = Nginx::start(&harness::hostile_plugin());
    let hostile = harness::hostile_requests();
    for request in &hostile {
        let status = raw_status(nginx.port, request);
        assert!(
            matches!(status, Some(200 | 429 | 400)),
            "{status:?} for {}",
            String::from_utf8_lossy(request)
        );
    }
    assert_eq!(
        raw_status(nginx.port, &raw(b"/", &[b"x-user: caf\xe9"])),
        Some(200)
    );
    assert_eq!(
        raw_status(nginx.port, &raw(b"/", &[b"x-user: caf\xe9"])),
        Some(429)
    );
    assert_eq!(statuses(&nginx.url("/"), &[("x-user", "bob")], 3), (2, 1));
    let c = Client::new();
    assert_eq!(c.get(&nginx.url("/cost"), &[("x-cost", "1")]).status, 429);
    assert!(nginx.workers_healthy(), "{}", nginx.log());
}

#[test]
fn two_proxy_wasm_directives_keep_their_own_state() {
    nginx_or_skip!();
    let quota = Quota::start(&[]);
    let service = json!({"upstream": format!("127.0.0.1:{}", quota.port), "timeout": "1s"});
    // Rule indexes line up on purpose: with per-VM queues one location's tick would send the
    // other's refills under its own rule.
    let nginx = Nginx::start_with(vec![
        Location {
            path: "/a",
            plugin: json!({"rules": [{"name": "a", "scope": "global", "key": ["header:x-user"],
                                      "limit": {"requests": 1, "per": "1d"}, "burst": 20}],
                           "quota_service": service}),
            in_access: true,
        },
        Location {
            path: "/b",
            plugin: json!({"rules": [{"name": "b", "scope": "global", "key": ["header:x-user"],
                                      "limit": {"requests": 1, "per": "1d"}, "burst": 6}],
                           "quota_service": service}),
            in_access: true,
        },
    ]);
    let a = statuses(&nginx.url("/a"), &[("x-user", "u")], 30);
    let b = statuses(&nginx.url("/b"), &[("x-user", "u")], 30);
    assert_eq!((a.0, b.0), (20, 6), "a {a:?}, b {b:?}");
    assert!(nginx.workers_healthy(), "{}", nginx.log());
}

#[test]
fn a_reload_starts_every_limit_fresh() {
    nginx_or_skip!();
    let nginx = Nginx::start(&json!({"rules": [
        {"name": "r", "limit": {"requests": 1, "per": "1h"}, "burst": 2}
    ]}));
    assert_eq!(statuses(&nginx.url("/"), &[], 3), (2, 1));
    nginx.reload();
    // nginx recreates the shm_kv zone on a reload: the bucket is full again.
    let fresh = || statuses(&nginx.url("/"), &[], 1) == (1, 0);
    assert!(
        testkit::eventually(Duration::from_secs(10), fresh),
        "the limit did not start fresh"
    );
}

/// The `nginx` block of docs/nginx.md, with this machine's paths and ports.
fn documented_conf(backend: u16, quota: u16) -> String {
    let doc = std::fs::read_to_string(harness::repo().join("docs/nginx.md")).unwrap();
    let block = doc
        .split("```nginx")
        .nth(1)
        .unwrap()
        .split("```")
        .next()
        .unwrap();
    block
        .replace(
            "/etc/nginx/tollgate.wasm",
            &harness::wasm_path().display().to_string(),
        )
        .replace("listen 80;", "listen 127.0.0.1:PORT;")
        .replace("127.0.0.1:8080", &format!("127.0.0.1:{backend}"))
        .replace("127.0.0.1:8081", &format!("127.0.0.1:{quota}"))
}

#[test]
fn the_documented_nginx_conf_works_as_described() {
    nginx_or_skip!();
    let quota = Quota::start(&[]);
    let backend = harness::Backend::start();
    let conf = documented_conf(backend.port, quota.port);
    let nginx = Nginx::start_conf(&conf, backend, 2);
    // The global per-user rule leases from the quota service (5 requests of user u).
    assert_eq!(statuses(&nginx.url("/"), &[("x-user", "u")], 5), (5, 0));
    // (The refill goes out in the worker's next batched call.)
    let leased = || {
        !quota
            .metrics()
            .contains("tollgate_quota_lease_items_total 0")
    };
    assert!(
        testkit::eventually(Duration::from_secs(5), leased),
        "no lease call:\n{}",
        quota.metrics()
    );
    // per-ip: a burst of 20 for this client, 15 of them left.
    assert_eq!(
        statuses(&nginx.url("/search"), &[("x-api-key", "k")], 20),
        (15, 5)
    );
    let refused = Client::new().get(&nginx.url("/"), &[]);
    assert_eq!(refused.status, 429);
    assert_eq!(refused.body, "rate limited\n");
    assert_eq!(refused.header("x-tollgate-rule"), Some("per-ip"));
    assert!(nginx.workers_healthy(), "{}", nginx.log());
}

/// nginx in front of an upstream of 10 at once × 50 ms (200/s), with `plugin` on `/app`.
fn overload_nginx(plugin: &Value, upstream: &[&str]) -> (harness::Upstream, Nginx) {
    let app = harness::Upstream::start(upstream);
    let conf = format!(
        "worker_processes 2;\nevents {{ worker_connections 4096; }}\n\
         wasm {{\n  module tollgate {};\n  shm_kv * 16m eviction=none;\n}}\n\
         http {{\n  server {{\n    listen 127.0.0.1:PORT;\n    location /app {{\n      \
         proxy_wasm tollgate {};\n      proxy_pass http://127.0.0.1:{};\n    }}\n  }}\n}}\n",
        harness::wasm_path().display(),
        harness::nginx_string(plugin),
        app.port
    );
    let nginx = Nginx::start_conf(&conf, harness::Backend::start(), 2);
    (app, nginx)
}

fn load_numbers(v: &Value, class: &str, field: &str) -> f64 {
    v[class][field].as_f64().unwrap_or(0.0)
}

#[test]
fn adaptive_concurrency_and_priorities_protect_an_upstream_in_nginx() {
    nginx_or_skip!();
    let plugin = json!({
        "rules": [{"name": "app", "algorithm": "adaptive"}],
        "priorities": [{"name": "checkout", "match": {"headers": {"x-tier": "high"}}, "level": 3}]
    });
    let (_app, nginx) = overload_nginx(&plugin, &["--capacity", "10", "--service-ms", "50"]);
    let unloaded = harness::load(&nginx.url("/app"), &["--rate", "40", "--seconds", "2"]);
    let base = load_numbers(&unloaded, "all", "p50_ms");
    // 3x the capacity, 20% of it at level 3.
    let r = harness::load(
        &nginx.url("/app"),
        &[
            "--rate",
            "600",
            "--seconds",
            "7",
            "--warmup",
            "3",
            "--class",
            "high:20:x-tier=high",
        ],
    );
    eprintln!("nginx adaptive 3x: unloaded p50 {base} ms: {r}");
    assert!(load_numbers(&r, "all", "ok_per_s") >= 140.0, "{r}");
    assert!(load_numbers(&r, "all", "p99_ms") <= 3.0 * base, "{r}");
    let high = load_numbers(&r, "high", "ok") / load_numbers(&r, "high", "sent");
    assert!(high >= 0.95, "{r}");
    assert!(
        r["other"]["statuses"]["503"].as_u64().unwrap_or(0) > 0,
        "{r}"
    );
    assert!(nginx.workers_healthy(), "{}", nginx.log());
}

#[test]
fn the_success_rate_throttle_refuses_in_nginx() {
    nginx_or_skip!();
    let plugin = json!({"rules": [{"name": "flaky", "algorithm": "sre_throttle",
                                   "sre_throttle": {"k": 1.5, "window": "2s"},
                                   "response": {"status": 429}}]});
    let (_app, nginx) = overload_nginx(
        &plugin,
        &[
            "--capacity",
            "100",
            "--service-ms",
            "5",
            "--fail-percent",
            "50",
        ],
    );
    let r = harness::load(
        &nginx.url("/app"),
        &["--rate", "200", "--seconds", "6", "--warmup", "3"],
    );
    eprintln!("nginx throttle: {r}");
    let refused = r["all"]["statuses"]["429"].as_f64().unwrap_or(0.0);
    assert!(refused > 0.5 * load_numbers(&r, "all", "sent"), "{r}");
    assert!(nginx.workers_healthy(), "{}", nginx.log());
}

#[test]
fn a_global_concurrency_limit_holds_across_two_workers() {
    nginx_or_skip!();
    let quota = Quota::start(&[]);
    let plugin = json!({
        "rules": [{"name": "tenant", "scope": "global", "algorithm": "concurrency",
                   "key": ["header:x-user"], "limit": {"concurrent": 3}}],
        "quota_service": {"upstream": format!("127.0.0.1:{}", quota.port),
                          "first_lease": "provisional", "failure_mode": "deny"}
    });
    let nginx = Nginx::start(&plugin);
    // A first request: the stand-in admits it while the key's first slots are fetched.
    assert_eq!(
        Client::new()
            .get(&nginx.url("/"), &[("x-user", "u"), ("x-delay-ms", "10")])
            .status,
        200
    );
    let held = || quota.metrics().contains("tollgate_quota_slots_held{");
    assert!(
        testkit::eventually(Duration::from_secs(5), held),
        "no slot call:\n{}",
        quota.metrics()
    );
    nginx
        .backend
        .peak
        .store(0, std::sync::atomic::Ordering::SeqCst);
    // 12 slow requests at once over both workers: never more than 3 at the backend.
    let codes = parallel(12, |_| {
        Client::new()
            .get(&nginx.url("/"), &[("x-user", "u"), ("x-delay-ms", "600")])
            .status
    });
    let peak = nginx.backend.peak.load(std::sync::atomic::Ordering::SeqCst);
    assert!(peak <= 3, "the backend had {peak} at once: {codes:?}");
    assert!(count(&codes, 200) >= 1, "{codes:?}");
    assert_eq!(count(&codes, 200) + count(&codes, 429), 12, "{codes:?}");
    assert!(nginx.workers_healthy(), "{}", nginx.log());
    // With first_lease wait, refused at load naming nginx.
    let mut waiting = plugin.clone();
    waiting["quota_service"]["first_lease"] = json!("wait");
    let refused = Nginx::expect_refusal(&waiting);
    assert!(refused.contains("first_lease"), "{refused}");
}

/// nginx with `plugin` on `/login` and `/v1/chat`, each proxied to a location of the same server
/// that answers: 401 unless `x-password: right`, and an event stream with a usage of 300.
fn settling_nginx(plugin: &Value) -> Nginx {
    let stream = "data: {\\\"choices\\\":[],\\\"usage\\\":{\\\"prompt_tokens\\\":100,\\\"completion_tokens\\\":200,\\\"total_tokens\\\":300}}\\n\\ndata: [DONE]\\n\\n";
    let conf = format!(
        "worker_processes 2;\nevents {{ worker_connections 1024; }}\n\
         wasm {{\n  module tollgate {};\n  shm_kv * 16m eviction=none;\n}}\n\
         http {{\n  server {{\n    listen 127.0.0.1:PORT;\n    \
         location ~ ^/(login|v1/chat)$ {{\n      proxy_wasm tollgate {};\n      \
         proxy_pass http://127.0.0.1:PORT/answer/$1;\n    }}\n    \
         location = /answer/login {{\n      if ($http_x_password = right) {{ return 200 \"welcome\\n\"; }}\n      \
         return 401 \"no\\n\";\n    }}\n    \
         location = /answer/v1/chat {{\n      default_type text/event-stream;\n      return 200 \"{stream}\";\n    }}\n  }}\n}}\n",
        harness::wasm_path().display(),
        harness::nginx_string(plugin),
    );
    Nginx::start_conf(&conf, harness::Backend::start(), 2)
}

#[test]
fn failed_logins_and_streamed_usage_settle_after_the_response_in_nginx() {
    nginx_or_skip!();
    let nginx = settling_nginx(&json!({"rules": [
        {"name": "logins", "match": {"path": "/login"}, "key": ["client_ip"],
         "limit": {"requests": 5, "per": "15m"}, "settle": {"statuses": [401]}},
        {"name": "llm", "match": {"path": "/v1/chat"}, "key": ["header:x-api-key"],
         "limit": {"requests": 1000, "per": "1m"}, "cost": 100, "settle": {"usage": "total"}}
    ]}));
    let client = Client::new();
    let login = nginx.url("/login");
    for _ in 0..10 {
        assert_eq!(client.get(&login, &[("x-password", "right")]).status, 200);
    }
    for n in 0..5 {
        assert_eq!(
            client.get(&login, &[("x-password", "wrong")]).status,
            401,
            "failure {n}"
        );
    }
    assert_eq!(client.get(&login, &[("x-password", "wrong")]).status, 429);
    let chat = nginx.url("/v1/chat");
    let key = [("x-api-key", "team-a")];
    for n in 0..4 {
        let reply = client.get(&chat, &key);
        assert_eq!(reply.status, 200, "request {n}");
        assert!(reply.body.contains("total_tokens"));
    }
    let refused = client.get(&chat, &key);
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header("retry-after"), Some("18"));
    assert!(nginx.workers_healthy(), "{}", nginx.log());
}

#[test]
fn each_tenant_gets_its_plans_limit_and_metadata_is_refused_in_nginx() {
    nginx_or_skip!();
    let rule = json!({"name": "plans", "key": ["header:x-tenant"],
        "limit": {"requests": 3, "per": "1h"}, "limit_from": {"header": "x-plan", "max": 10}});
    let nginx = Nginx::start(&json!({"rules": [rule]}));
    let url = nginx.url("/");
    assert_eq!(
        statuses(&url, &[("x-tenant", "big"), ("x-plan", "8")], 10),
        (8, 2)
    );
    assert_eq!(statuses(&url, &[("x-tenant", "none")], 5), (3, 2));
    drop(nginx);
    let log = Nginx::expect_refusal(&json!({"rules": [{"name": "m",
        "key": ["metadata:auth/sub"], "limit": {"requests": 3, "per": "1h"}}]}));
    assert!(
        log.contains("rules[0].key[0]: nginx (ngx_wasm_module) gives a filter no request metadata"),
        "{log}"
    );
}

#[test]
fn reservations_and_keys_from_the_request_body_in_nginx() {
    nginx_or_skip!();
    let nginx = settling_nginx(&json!({"rules": [
        {"name": "llm", "match": {"path": "/v1/chat"}, "key": ["header:x-api-key"],
         "limit": {"requests": 1000, "per": "1m"},
         "cost": {"body": ["max_tokens", "max_completion_tokens"], "max": 1000},
         "settle": {"usage": "total"}},
        {"name": "per-model", "match": {"path": "/login"}, "key": ["body:model"],
         "limit": {"requests": 2, "per": "1h"}}
    ]}));
    let client = Client::new();
    let chat = nginx.url("/v1/chat");
    let key = [("x-api-key", "team-a")];
    // Reserves 600, uses 300: 700 left.
    let first = client.post(&chat, &key, br#"{"max_tokens":600}"#);
    assert_eq!(first.status, 200);
    assert!(
        first.body.contains("total_tokens"),
        "the request reached the upstream"
    );
    let too_much = client.post(
        &chat,
        &key,
        br#"{"max_tokens":5,"max_completion_tokens":800}"#,
    );
    assert_eq!(too_much.status, 429);
    assert!(too_much.header("retry-after").is_some());
    assert_eq!(
        client.post(&chat, &key, br#"{"max_tokens":700}"#).status,
        200
    );
    // No body: the default, `max`.
    assert_eq!(client.get(&chat, &[("x-api-key", "team-b")]).status, 200);
    assert_eq!(client.get(&chat, &[("x-api-key", "team-b")]).status, 429);
    let login = nginx.url("/login");
    let model = |m: &str| {
        client
            .post(&login, &[], format!(r#"{{"model":"{m}"}}"#).as_bytes())
            .status
    };
    assert_eq!(
        [model("a"), model("a"), model("a"), model("b")],
        [401, 401, 429, 401]
    );
    assert!(nginx.workers_healthy(), "{}", nginx.log());
}

/// Issue 34, item 5: ngx_wasm_module calls no body callback for an empty chunked body, and hands
/// over nothing of a body it spooled to a file (past `client_body_buffer_size`, 16 KiB by
/// default). Both are decided as bodies that cannot be read: a chunked request on its headers
/// (its per-IP rule applies: before, no rule did), a spooled one as the "unreadable" model
/// (before: read as having no model, so the per-model rule skipped it).
#[test]
fn chunked_and_spooled_bodies_are_decided_as_unreadable_in_nginx() {
    nginx_or_skip!();
    let nginx = settling_nginx(&json!({"rules": [
        {"name": "per-ip", "match": {"path": "/v1/chat"}, "key": ["client_ip"],
         "limit": {"requests": 3, "per": "1h"}},
        {"name": "llm", "match": {"path": "/v1/chat"}, "key": ["header:x-api-key"],
         "limit": {"requests": 100000, "per": "1m"},
         "cost": {"body": ["max_tokens"], "max": 1000}, "settle": {"usage": "total"}},
        {"name": "per-model", "match": {"path": "/login"}, "key": ["body:model"],
         "limit": {"requests": 2, "per": "1h"}}
    ]}));
    let mut chunked = raw(
        b"/v1/chat",
        &[b"x-api-key: k", b"transfer-encoding: chunked"],
    );
    chunked.extend_from_slice(b"0\r\n\r\n");
    let statuses: Vec<Option<u16>> = (0..5).map(|_| raw_status(nginx.port, &chunked)).collect();
    assert_eq!(
        statuses,
        [Some(200), Some(200), Some(200), Some(429), Some(429)],
        "the per-IP rule applies to empty chunked bodies"
    );
    let client = Client::new();
    let login = nginx.url("/login");
    let spooled = |m: &str| {
        let body = format!(r#"{{"model":"{m}","pad":"{}"}}"#, "x".repeat(40_000));
        client.post(&login, &[], body.as_bytes()).status
    };
    assert_eq!(
        [spooled("a"), spooled("b"), spooled("c")],
        [401, 401, 429],
        "spooled bodies share the unreadable model's 2 an hour"
    );
    assert!(nginx.workers_healthy(), "{}", nginx.log());
}

#[test]
fn a_byte_limit_is_refused_in_nginx_naming_it() {
    nginx_or_skip!();
    let log = Nginx::expect_refusal(&json!({"rules": [{"name": "dl", "key": ["client_ip"],
        "limit": {"bytes": 1000000, "per": "1s"}}]}));
    assert!(
        log.contains("rules[0].limit.bytes: nginx (ngx_wasm_module) cannot resume a paused body"),
        "{log}"
    );
}

#[test]
fn the_status_path_shows_the_key_refused_most_and_is_closed_to_other_addresses() {
    nginx_or_skip!();
    let plugin = |allow: &str| {
        json!({"rules": [{"name": "per-user", "key": ["header:x-user"],
                          "limit": {"requests": 5, "per": "1h"}}],
               "status": {"path": "/tollgate/status", "allow": [allow]}})
    };
    let nginx = Nginx::start(&plugin("127.0.0.0/8"));
    let url = nginx.url("/");
    for i in 0..200 {
        let user = format!("light-{i}");
        assert_eq!(statuses(&url, &[("x-user", user.as_str())], 1), (1, 0));
    }
    assert_eq!(statuses(&url, &[("x-user", "heavy")], 20), (5, 15));
    let mut shown = Value::Null;
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        let reply = Client::new().get(&nginx.url("/tollgate/status"), &[]);
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert_eq!(reply.header("content-type"), Some("application/json"));
        shown = serde_json::from_str(&reply.body).unwrap();
        if shown["rules"][0]["keys"][0]["refused"] == 15 {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(shown["rules"][0]["keys"][0]["key"], "heavy", "{shown}");
    assert_eq!(shown["rules"][0]["keys"][0]["refused"], 15, "{shown}");
    assert!(
        shown["host"].as_str().unwrap().starts_with("nginx"),
        "{shown}"
    );
    let post = Client::new()
        .try_send_body("POST", &nginx.url("/tollgate/status"), &[], Some(b""))
        .unwrap();
    assert_eq!(post.status, 405);
    // One key's state, and its reset: her burst again, once.
    let heavy = Client::new().get(&nginx.url("/tollgate/status?rule=per-user&key=heavy"), &[]);
    let heavy: Value = serde_json::from_str(&heavy.body).unwrap();
    assert_eq!(
        (heavy["limited"].clone(), heavy["available"].clone()),
        (true.into(), 0.into()),
        "{heavy}"
    );
    let reset = Client::new()
        .try_send_body(
            "POST",
            &nginx.url("/tollgate/status/reset?rule=per-user&key=heavy"),
            &[],
            Some(b""),
        )
        .unwrap();
    assert_eq!(reset.status, 200, "{}", reset.body);
    // Her burst again, once, over both workers (a worker that refused her in the last 20 ms
    // trusts that refusal for the rest of them: her requests for 300 ms are counted).
    let until = Instant::now() + Duration::from_millis(300);
    let mut admitted = 0;
    while Instant::now() < until {
        admitted += statuses(&url, &[("x-user", "heavy")], 1).0;
    }
    assert_eq!(admitted, 5, "heavy's burst again, once");
    assert!(nginx.workers_healthy(), "{}", nginx.log());
    let closed = Nginx::start(&plugin("10.0.0.0/8"));
    assert_eq!(
        Client::new()
            .get(&closed.url("/tollgate/status"), &[])
            .status,
        403
    );
    assert!(closed.workers_healthy(), "{}", closed.log());
}
