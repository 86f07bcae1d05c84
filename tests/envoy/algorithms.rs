//! Every algorithm against its formula in a real Envoy with two workers.

use crate::harness::{parallel, sleep_until_unix, statuses, unix_ns, Client, Envoy};
use serde_json::json;
use std::time::{Duration, Instant};

const DAY_NS: u64 = 86_400_000_000_000;
const MS: u64 = 1_000_000;

/// Status of each of `threads × per_thread` requests sent at once on `threads` connections.
fn storm(url: &str, threads: usize, per_thread: usize) -> Vec<u16> {
    parallel(threads, |_| {
        let c = Client::new();
        (0..per_thread)
            .map(|_| c.get(url, &[]).status)
            .collect::<Vec<_>>()
    })
    .concat()
}

fn count(statuses: &[u16], status: u16) -> usize {
    statuses.iter().filter(|s| **s == status).count()
}

#[test]
fn each_algorithm_admits_its_formula_under_concurrent_load() {
    let envoy = Envoy::start(&json!({"rules": [
        {"name": "fixed", "match": {"path": "/fixed"}, "algorithm": "fixed_window",
         "limit": {"requests": 50, "per": "1d"}},
        {"name": "sliding", "match": {"path": "/sliding"}, "algorithm": "sliding_window",
         "limit": {"requests": 50, "per": "1d"}},
        // nginx: 1 request in rate + 49 of burst, nothing drains in a day's rate.
        {"name": "leaky", "match": {"path": "/leaky"}, "algorithm": "leaky_bucket",
         "limit": {"requests": 1, "per": "1d"}, "burst": 49, "delay": "nodelay"},
        {"name": "bucket", "match": {"path": "/bucket"},
         "limit": {"requests": 1, "per": "1d"}, "burst": 50}
    ]}));
    for path in ["/fixed", "/sliding", "/leaky", "/bucket"] {
        let day = unix_ns() / DAY_NS;
        let results = storm(&envoy.url(path), 40, 5);
        let (ok, limited) = (count(&results, 200), count(&results, 429));
        assert_eq!(ok + limited, 200, "{path}: {results:?}");
        if unix_ns() / DAY_NS == day {
            assert_eq!(ok, 50, "{path}: 50 of 200 concurrent requests");
        } else {
            // The run straddled midnight UTC, a window edge: only the 2-window bound holds.
            assert!(ok <= 100, "{path}: {ok}");
        }
    }
    assert_eq!(envoy.counter("leaky", "delayed"), 0);
}

#[test]
fn sliding_window_stays_within_the_limit_across_an_edge_where_fixed_doubles() {
    let period = 2_000 * MS;
    let envoy = Envoy::start(&json!({"rules": [
        {"name": "fixed", "match": {"path": "/fixed"}, "algorithm": "fixed_window",
         "limit": {"requests": 10, "per": "2s"}},
        {"name": "sliding", "match": {"path": "/sliding"}, "algorithm": "sliding_window",
         "limit": {"requests": 10, "per": "2s"}}
    ]}));
    let mut edge = unix_ns().div_ceil(period) * period;
    if edge - unix_ns() < 800 * MS {
        edge += period;
    }
    // A burst of 20 to each just before the edge and again just after it.
    let burst = |path: &str| {
        let c = Client::new();
        (0..20)
            .map(|_| c.get(&envoy.url(path), &[]).status)
            .collect::<Vec<_>>()
    };
    sleep_until_unix(edge - 500 * MS);
    let before = (burst("/fixed"), burst("/sliding"));
    assert!(
        unix_ns() < edge,
        "the first bursts must end before the edge"
    );
    sleep_until_unix(edge + 50 * MS);
    let after = (burst("/fixed"), burst("/sliding"));
    let elapsed = unix_ns() - edge;

    let fixed = count(&before.0, 200) + count(&after.0, 200);
    assert_eq!(
        fixed, 20,
        "the fixed window admits its limit on each side: 2x"
    );
    assert_eq!(count(&before.1, 200), 10);
    // After the edge the previous window still weighs (1 − elapsed/period): only the elapsed
    // fraction of the limit is free again.
    let allowed_after = (10 * elapsed).div_ceil(period) as usize;
    let sliding_after = count(&after.1, 200);
    assert!(
        sliding_after <= allowed_after,
        "sliding admitted {sliding_after} after the edge, {elapsed} ns in: at most {allowed_after}"
    );
}

/// (status, ms from the common start to the response) of `n` requests sent at once.
fn timed_burst(url: &str, n: usize) -> Vec<(u16, u64)> {
    let start = Instant::now();
    parallel(n, |_| {
        let status = Client::new().get(url, &[]).status;
        (status, start.elapsed().as_millis() as u64)
    })
}

fn admitted_latencies(results: &[(u16, u64)]) -> Vec<u64> {
    let mut ms: Vec<u64> = results.iter().filter(|r| r.0 == 200).map(|r| r.1).collect();
    ms.sort_unstable();
    ms
}

#[test]
fn leaky_bucket_holds_excess_and_releases_it_at_the_rate_like_nginx() {
    let leaky = |name: &str, extra: serde_json::Value| {
        let mut rule = json!({"name": name, "match": {"path": format!("/{name}")},
                              "algorithm": "leaky_bucket",
                              "limit": {"requests": 10, "per": "1s"}, "burst": 5});
        for (k, v) in extra.as_object().unwrap() {
            rule[k] = v.clone();
        }
        rule
    };
    let envoy = Envoy::start(&json!({"rules": [
        leaky("spaced", json!({})),
        leaky("nodelay", json!({"delay": "nodelay"})),
        leaky("delay2", json!({"delay": 2})),
        leaky("capped", json!({"burst": 10, "max_delay": "250ms"})),
    ]}));

    // rate 10/s, burst 5: 1 in rate + 5 held and released 100 ms apart; 2 refused.
    let spaced = timed_burst(&envoy.url("/spaced"), 8);
    assert_eq!(
        count(&spaced.iter().map(|r| r.0).collect::<Vec<_>>(), 429),
        2
    );
    let ms = admitted_latencies(&spaced);
    assert_eq!(ms.len(), 6);
    for (k, t) in ms.iter().enumerate() {
        let due = 100 * k as u64;
        // Never early; late by at most the 5 ms tick plus scheduling on a busy 2-core machine.
        assert!(
            *t + 2 >= due && *t <= due + 150,
            "request {k} after {t} ms: {ms:?}"
        );
    }
    assert_eq!(envoy.counter("spaced", "delayed"), 5);

    let nodelay = timed_burst(&envoy.url("/nodelay"), 8);
    assert_eq!(admitted_latencies(&nodelay).len(), 6);
    assert_eq!(envoy.counter("nodelay", "delayed"), 0);

    // delay=2: the in-rate request and 2 excess pass at once, the next 3 are held.
    let delay2 = timed_burst(&envoy.url("/delay2"), 8);
    let ms = admitted_latencies(&delay2);
    assert_eq!(ms.len(), 6);
    assert_eq!(envoy.counter("delay2", "delayed"), 3);
    for (k, t) in ms.iter().enumerate().skip(3) {
        let due = 100 * (k as u64 - 2);
        assert!(
            *t + 2 >= due && *t <= due + 150,
            "request {k} after {t} ms: {ms:?}"
        );
    }

    // max_delay 250 ms: waits of 0, 100 and 200 ms are taken; 300 ms would be too long.
    let capped = timed_burst(&envoy.url("/capped"), 8);
    assert_eq!(admitted_latencies(&capped).len(), 3);
    assert_eq!(envoy.counter("capped", "limited"), 5);

    assert_eq!(envoy.await_prometheus("tollgate_queue_held{}", 0), 0);
}

#[test]
fn a_held_request_whose_client_leaves_is_dropped_from_the_queue() {
    let envoy = Envoy::start(&json!({"rules": [{
        "name": "slow", "algorithm": "leaky_bucket",
        "limit": {"requests": 1, "per": "10s"}, "burst": 3
    }]}));
    assert_eq!(Client::new().get(&envoy.url("/"), &[]).status, 200);
    // The next one would be held 10 s; its client gives up after 300 ms.
    let started = Instant::now();
    let gone =
        Client::with_timeout(Duration::from_millis(300)).try_send("GET", &envoy.url("/"), &[]);
    assert!(gone.is_err(), "the request must still be held: {gone:?}");
    assert_eq!(envoy.await_prometheus("tollgate_queue_held{}", 0), 0);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "freed long before its release time"
    );
    assert_eq!(envoy.counter("slow", "delayed"), 1);
}

#[test]
fn cost_overrides_and_per_rule_responses() {
    let envoy = Envoy::start(&json!({"rules": [
        {"name": "weighted", "match": {"path": "/w"},
         "limit": {"requests": 1, "per": "1d"}, "burst": 10,
         "cost": {"header": "x-cost", "max": 5}},
        {"name": "per-user", "match": {"path": "/u"}, "key": ["header:x-user"],
         "limit": {"requests": 1, "per": "1d"}, "burst": 2,
         "response": {"status": 503, "body": "try the fallback\n"},
         "overrides": [
            {"values": ["vip"], "limit": {"requests": 1, "per": "1d"}, "burst": 5},
            {"values": ["partner"], "unlimited": true},
            {"values": ["banned"], "block": true}
         ]}
    ]}));
    let c = Client::new();
    let w = |cost: &str| {
        let r = c.get(&envoy.url("/w"), &[("x-cost", cost)]);
        (r.status, r.header("ratelimit").map(str::to_string))
    };
    assert_eq!(w("4"), (200, Some("\"weighted\";r=6;t=345600".into())));
    // Above the cap counts as the cap; not a number counts as the default (1).
    assert_eq!(w("100"), (200, Some("\"weighted\";r=1;t=777600".into())));
    assert_eq!(w("lots"), (200, Some("\"weighted\";r=0;t=864000".into())));
    // Zero costs the minimum (1), so the bucket is empty either way.
    assert_eq!(w("0").0, 429, "cost 0 is not free");
    assert_eq!(w("1").0, 429);

    let u = |user: &str| c.get(&envoy.url("/u"), &[("x-user", user)]);
    let count_ok = |user: &str, n: usize| (0..n).filter(|_| u(user).status == 200).count();
    assert_eq!(count_ok("someone", 4), 2);
    assert_eq!(count_ok("vip", 8), 5);
    assert_eq!(count_ok("partner", 20), 20);
    let banned = u("banned");
    assert_eq!(banned.status, 503);
    assert_eq!(banned.body, "try the fallback\n");
    assert_eq!(banned.header("x-tollgate-rule"), Some("per-user"));
    let refused = u("someone");
    assert_eq!(
        (refused.status, refused.body.as_str()),
        (503, "try the fallback\n")
    );
    assert_eq!(envoy.counter("per-user", "blocked"), 1);
}

#[test]
fn warm_up_ramps_from_a_third_of_the_rate_to_the_full_rate() {
    // 30/s with a 2 s warm-up: cold, one request per 100 ms; warm, one per 33 ms.
    let envoy = Envoy::start(&json!({"rules": [{
        "name": "warm", "limit": {"requests": 30, "per": "1s"}, "warmup": "2s"
    }]}));
    let c = Client::new();
    let start = Instant::now();
    let mut sent_at = Vec::new();
    let mut admitted_at = Vec::new();
    while start.elapsed() < Duration::from_millis(3_500) {
        sent_at.push(start.elapsed().as_micros() as u64);
        if c.get(&envoy.url("/"), &[]).status == 200 {
            admitted_at.push(start.elapsed().as_millis() as u64);
        }
    }
    let in_span = |from: u64, to: u64| {
        admitted_at
            .iter()
            .filter(|t| **t >= from && **t < to)
            .count()
    };
    // The client only sees a free slot when its next request arrives: allow for its slowest gap.
    let worst_gap_us = sent_at.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
    let first = in_span(0, 500);
    let last = in_span(3_000, 3_500);
    // Cold: at most one per 100 ms (+1 for the first, which pays forward).
    assert!(first <= 6, "first 500 ms: {first} ({admitted_at:?})");
    // Warm: one per 33.3 ms, give or take one at each end of the span.
    let slowest = (500_000.0 / (33_333.0 + worst_gap_us as f64)).floor() as usize;
    assert!(
        last >= slowest.saturating_sub(1) && last <= 16,
        "last 500 ms: {last}, expected {}..=16 (worst gap {worst_gap_us} us): {admitted_at:?}",
        slowest.saturating_sub(1)
    );
    assert!(last > 2 * first, "the rate ramped up: {first} then {last}");
}

#[test]
fn window_limits_report_their_quota() {
    let envoy = Envoy::start(&json!({"rules": [
        {"name": "minute", "algorithm": "fixed_window", "limit": {"requests": 3, "per": "1h"}}
    ]}));
    let (ok, limited) = statuses(&envoy.url("/"), &[], 5);
    assert_eq!((ok, limited), (3, 2));
    let r = Client::new().get(&envoy.url("/"), &[]);
    assert_eq!(r.header("ratelimit-policy"), Some("\"minute\";q=3;w=3600"));
    let retry: u64 = r.header("retry-after").unwrap().parse().unwrap();
    let to_edge = 3_600 - (unix_ns() / 1_000_000_000) % 3_600;
    assert!(
        retry.abs_diff(to_edge) <= 1,
        "retry-after {retry}, window ends in {to_edge} s"
    );
}
