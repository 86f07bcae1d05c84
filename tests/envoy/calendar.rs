//! Calendar quotas through real Envoys: a monthly quota in Berlin shared by two Envoys over a
//! quota service on Redis whose calendar reads a few seconds before December (`--calendar-clock`):
//! November's quota is spent, refused with the true wait, full again at Berlin's midnight — and
//! December's count survives a restart of the service.

use crate::harness::{Client, Envoy, Options, Quota};
use serde_json::json;
use std::time::{Duration, Instant};
use testkit::{free_port, Redis};

/// The `t` (seconds until the quota resets) of a `RateLimit` header: `"monthly";r=R;t=T`.
fn reset_secs(header: Option<&str>) -> u64 {
    header
        .and_then(|h| h.rsplit(";t=").next())
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no t in {header:?}"))
}

#[test]
fn a_monthly_quota_over_two_envoys_begins_again_at_midnight_in_berlin_and_survives_a_restart() {
    let redis = Redis::start();
    let port = free_port();
    let plugin = json!({
        "rules": [{"name": "monthly", "scope": "global", "key": ["header:x-tenant"],
                   "limit": {"requests": 5, "per": "month",
                             "calendar": {"time_zone": "Europe/Berlin"}}}],
        "quota_service": {"upstream": "quota", "failure_mode": "deny"}
    });
    let options = Options {
        quota_port: Some(port),
        ..Options::default()
    };
    let envoys = [
        Envoy::start_with(&plugin, &options),
        Envoy::start_with(&plugin, &options),
    ];
    // November has 10 s left by the service's calendar: midnight comes no sooner than 10 s
    // from here (the service reads its clock after this).
    let started = Instant::now();
    let mut quota = Quota::start_on(
        port,
        &["--redis", &redis.url(), "--calendar-clock", "2026-11-30T23:59:50+01:00"],
    );
    let midnight = started + Duration::from_secs(10);
    for e in &envoys {
        e.wait_for_quota_healthy(port);
    }
    let send = |i: usize| {
        Client::new().get(&envoys[i % 2].url("/"), &[("x-tenant", "acme")])
    };
    let mut admitted = 0;
    for i in 0..12 {
        let reply = send(i);
        let left = midnight.saturating_duration_since(Instant::now()).as_secs();
        match reply.status {
            200 => {
                admitted += 1;
                // The quota resets at midnight, not when 5 a month would refill a token.
                let t = reset_secs(reply.header("ratelimit"));
                assert!(t <= 10 && t + 1 >= left, "t={t}, {left} s to midnight");
            }
            429 => {
                let wait: u64 = reply.header("retry-after").unwrap().parse().unwrap();
                assert!(wait <= 10 && wait + 1 >= left, "retry-after {wait}, {left} s left");
            }
            s => panic!("status {s}: {}", reply.body),
        }
    }
    assert_eq!(admitted, 5, "November's 5 over both Envoys");
    assert!(Instant::now() < midnight, "November ended before it was spent: too slow a machine");

    // Refused until midnight; admitted from then on, 5 in December over both Envoys.
    let mut december = 0;
    let mut i = 0;
    let deadline = midnight + Duration::from_secs(8);
    while december == 0 && Instant::now() < deadline {
        i += 1;
        let reply = send(i);
        if reply.status == 200 {
            assert!(Instant::now() >= midnight, "admitted before midnight");
            december += 1;
            let t = reset_secs(reply.header("ratelimit"));
            // December's 31 days, less the seconds of it gone.
            assert!((31 * 86_400 - 30..=31 * 86_400).contains(&t), "t={t}");
        } else {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    assert_eq!(december, 1, "still refused {} s after midnight", 8);
    for j in 0..12 {
        december += usize::from(send(j).status == 200);
    }
    assert_eq!(december, 5, "December's 5 over both Envoys");

    // The service restarts (its calendar five minutes into December): Redis kept December's
    // count, so acme is refused by a third Envoy that never saw it, told to come back when
    // December ends; another tenant has its 5.
    quota.restart_with(&["--redis", &redis.url(), "--calendar-clock", "2026-12-01T00:05:00+01:00"]);
    let third = Envoy::start_with(&plugin, &options);
    third.wait_for_quota_healthy(port);
    let ask = |tenant: &str| Client::new().get(&third.url("/"), &[("x-tenant", tenant)]);
    for _ in 0..3 {
        let reply = ask("acme");
        assert_eq!(reply.status, 429, "after the restart: {}", reply.body);
        let wait: u64 = reply.header("retry-after").unwrap().parse().unwrap();
        assert!((30 * 86_400..31 * 86_400).contains(&wait), "retry-after {wait}");
    }
    let globex = (0..8).filter(|_| ask("globex").status == 200).count();
    assert_eq!(globex, 5);
}
