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
        &[
            "--redis",
            &redis.url(),
            "--calendar-clock",
            "2026-11-30T23:59:50+01:00",
        ],
    );
    let midnight = started + Duration::from_secs(10);
    for e in &envoys {
        e.wait_for_quota_healthy(port);
    }
    let send = |i: usize| Client::new().get(&envoys[i % 2].url("/"), &[("x-tenant", "acme")]);
    let mut admitted = 0;
    for i in 0..12 {
        let reply = send(i);
        let left = midnight.saturating_duration_since(Instant::now()).as_secs();
        match reply.status {
            200 => {
                admitted += 1;
                // The quota resets at midnight, not when 5 a month would refill a token; the
                // policy's window is the month's nominal 31 days.
                let t = reset_secs(reply.header("ratelimit"));
                assert_eq!(
                    reply.header("ratelimit-policy"),
                    Some("\"monthly\";q=5;w=2678400")
                );
                assert!(t <= 10 && t + 1 >= left, "t={t}, {left} s to midnight");
            }
            429 => {
                let wait: u64 = reply.header("retry-after").unwrap().parse().unwrap();
                assert!(
                    wait <= 10 && wait + 1 >= left,
                    "retry-after {wait}, {left} s left"
                );
            }
            s => panic!("status {s}: {}", reply.body),
        }
    }
    assert_eq!(admitted, 5, "November's 5 over both Envoys");
    assert!(
        Instant::now() < midnight,
        "November ended before it was spent: too slow a machine"
    );

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
    quota.restart_with(&[
        "--redis",
        &redis.url(),
        "--calendar-clock",
        "2026-12-01T00:05:00+01:00",
        "--admin-token",
        "operator-token-0123456789",
    ]);
    let third = Envoy::start_with(&plugin, &options);
    third.wait_for_quota_healthy(port);
    let ask = |tenant: &str| Client::new().get(&third.url("/"), &[("x-tenant", tenant)]);
    for _ in 0..3 {
        let reply = ask("acme");
        assert_eq!(reply.status, 429, "after the restart: {}", reply.body);
        let wait: u64 = reply.header("retry-after").unwrap().parse().unwrap();
        assert!(
            (30 * 86_400..31 * 86_400).contains(&wait),
            "retry-after {wait}"
        );
    }
    let globex = (0..8).filter(|_| ask("globex").status == 200).count();
    assert_eq!(globex, 5);

    // The operator names December's bucket of acme as `tollgate quota-key` does (by the
    // service's calendar: December), finds it spent and resets it: acme has 5 again.
    let config = tollgate::config::Config::parse(plugin.to_string().as_bytes()).unwrap();
    let in_december = |unit, zone: &str| {
        let mid_december = 1_797_000_000_000; // 2026-12-12
        tollgate_core::calendar::period_at(unit, zone, mid_december)
    };
    let (limit_id, key) = config
        .service_bucket("monthly", &[b"acme"], &in_december)
        .unwrap();
    let admin = |method: &str, path: &str| {
        let reply = Client::new()
            .try_send_body(
                method,
                &format!("http://127.0.0.1:{port}{path}"),
                &[("authorization", "Bearer operator-token-0123456789")],
                Some(b""),
            )
            .unwrap();
        let body: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
        (reply.status, body)
    };
    let bucket = format!("/admin/v1/buckets/{limit_id}/{key}");
    let (status, b) = admin("GET", &bucket);
    assert_eq!(status, 200, "{b}");
    assert_eq!(
        (b["found"].clone(), b["tokens"].clone()),
        (true.into(), 0.0.into()),
        "{b}"
    );
    let (status, b) = admin("POST", &format!("{bucket}/reset"));
    assert_eq!(status, 200, "{b}");
    let mut again = 0;
    let deadline = Instant::now() + Duration::from_secs(5);
    while again == 0 && Instant::now() < deadline {
        again += usize::from(ask("acme").status == 200);
        if again == 0 {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    again += (0..8).filter(|_| ask("acme").status == 200).count();
    assert_eq!(again, 5, "a reset gives December's 5 again, once");
}
