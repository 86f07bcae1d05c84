//! Calendar quotas: both stores count a period alike, and the service starts a new one full at
//! the zone's midnight.

use super::*;
use tollgate_quota::calendar::CalendarClock;

const DAY_MS: u64 = 86_400_000;

/// A calendar item of 10 a month in Berlin, asking for `wanted`.
fn monthly(key: &str, wanted: u64) -> LeaseItem {
    LeaseItem {
        requests: 10,
        per_ms: 31 * DAY_MS,
        calendar: Some("month".into()),
        time_zone: Some("Europe/Berlin".into()),
        ..item(key, 10, wanted)
    }
}

fn rfc3339_ms(t: &str) -> u64 {
    tollgate_core::calendar::rfc3339_ms(t).unwrap()
}

#[tokio::test]
async fn calendar_buckets_answer_alike_in_memory_and_on_redis() {
    let redis = Redis::start();
    let on_redis = Store::Redis(
        RedisStore::connect(&single(&redis), Duration::from_millis(500), ColdStart::Full)
            .await
            .unwrap(),
    );
    // Started conservative (the store lost buckets): a calendar bucket starts full anyway.
    let cold = ColdStart::Conservative {
        epoch_ms: tollgate_quota::store::now_ms(),
    };
    let memory = Store::Memory(MemoryStore::new(100, cold));
    let end = tollgate_quota::store::now_ms() + 60_000;
    let placed = |mut i: LeaseItem| {
        i.period = Some((end - 31 * DAY_MS, end));
        i
    };
    let steps: Vec<(&str, LeaseItem)> = vec![
        ("a", monthly("k", 4)),
        // A rate asked for: none granted (nothing refills the bucket).
        (
            "b",
            LeaseItem {
                demand: 50.0,
                ..monthly("k", 10)
            },
        ),
        ("a", monthly("k", 1)),
        // Given back: the bucket has them again.
        (
            "b",
            LeaseItem {
                returned: 2,
                ..monthly("k", 0)
            },
        ),
        ("a", monthly("k", 5)),
        // Charged beyond: a debt, and what the caller holds taken back toward it.
        (
            "b",
            LeaseItem {
                owed: 3,
                held: 1,
                ..monthly("k", 1)
            },
        ),
        // A bucket the store does not know, and a caller told 2 were left a moment ago: 2.
        (
            "c",
            LeaseItem {
                known_ms: 100,
                known_remaining: 2,
                ..monthly("lost", 5)
            },
        ),
        ("c", monthly("lost", 5)),
    ];
    let mut answers = Vec::new();
    for (n, (who, i)) in steps.into_iter().enumerate() {
        let items = [placed(i)];
        let m = memory.lease(who, &items, 10_000).await.unwrap()[0];
        let r = on_redis.lease(who, &items, 10_000).await.unwrap()[0];
        let same = |g: &LeaseGrant| {
            (
                g.granted,
                g.remaining,
                g.rate,
                g.returned,
                g.debt,
                g.revoked,
            )
        };
        assert_eq!(same(&m), same(&r), "step {n} ({who})");
        // Both until the period ends (the two clocks a few ms apart).
        for g in [m, r] {
            assert!(g.reset_ms.abs_diff(60_000) < 2_000, "step {n}: {g:?}");
            assert_eq!(g.ttl_ms, g.reset_ms, "step {n}: {g:?}");
        }
        answers.push(same(&m));
        assert!(m.retry_ms.abs_diff(r.retry_ms) < 1_000, "{m:?} {r:?}");
        if m.granted == 0 && m.debt == 0 && items[0].wanted > 0 {
            assert!(m.retry_ms.abs_diff(60_000) < 2_000, "step {n}: {m:?}");
        }
    }
    assert_eq!(
        answers,
        [
            (4, 6, 0.0, 0, 0, 0),
            (6, 0, 0.0, 0, 0, 0),
            (0, 0, 0.0, 0, 0, 0),
            (0, 2, 0.0, 2, 0, 0),
            (2, 0, 0.0, 0, 0, 0),
            (0, 0, 0.0, 0, 2, 1),
            (2, 0, 0.0, 0, 0, 0),
            (0, 0, 0.0, 0, 0, 0),
        ]
    );
}

#[tokio::test]
async fn a_calendar_month_begins_full_at_midnight_in_its_zone_on_both_stores() {
    let redis = Redis::start();
    let stores = [
        Store::Memory(MemoryStore::new(100, ColdStart::Full)),
        Store::Redis(
            RedisStore::connect(&single(&redis), Duration::from_millis(500), ColdStart::Full)
                .await
                .unwrap(),
        ),
    ];
    for store in stores {
        // The calendar reads 1.5 s before December begins in Berlin.
        let december = rfc3339_ms("2026-12-01T00:00:00+01:00");
        let mut svc = service(store, None);
        Arc::get_mut(&mut svc).unwrap().calendar =
            CalendarClock::reading(december - 1_500, tollgate_quota::store::now_ms());
        let five = |wanted: u64| LeaseItem {
            requests: 5,
            burst: 5,
            ..monthly("tenant", wanted)
        };
        let (status, body) = call(&svc, lease_body("p1", vec![five(5)]), None).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let g = grants(&body)[0];
        assert_eq!((g.granted, g.remaining), (5, 0));
        // The tokens are the proxy's until November ends, and the bucket is full then.
        assert!(g.reset_ms <= 1_500 && g.reset_ms > 1_000, "{g:?}");
        assert_eq!(g.ttl_ms, g.reset_ms);
        let g = grants(&call(&svc, lease_body("p2", vec![five(1)]), None).await.1)[0];
        assert_eq!(g.granted, 0);
        assert!(g.retry_ms <= 1_500 && g.retry_ms > 1_000, "{g:?}");
        // December: full again, though p1's evidence says November's bucket had nothing left
        // (it is of the month before, not of this one).
        let mut december_grant = LeaseGrant::default();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            let seen = LeaseItem {
                known_ms: 600,
                known_remaining: 0,
                ..five(5)
            };
            let (status, body) = call(&svc, lease_body("p1", vec![seen]), None).await;
            assert_eq!(status, StatusCode::OK, "{body}");
            december_grant = grants(&body)[0];
            if december_grant.granted > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!((december_grant.granted, december_grant.remaining), (5, 0));
        // Until December ends: 31 days.
        let left = december_grant.reset_ms;
        assert!(
            left > 31 * DAY_MS - 5_000 && left <= 31 * DAY_MS,
            "{december_grant:?}"
        );
    }
}

#[tokio::test]
async fn calendar_items_out_of_range_are_refused_alone_naming_the_field() {
    let svc = service(Store::Memory(MemoryStore::new(100, ColdStart::Full)), None);
    let cases = [
        (
            LeaseItem {
                time_zone: Some("Europe/Atlantis".into()),
                ..monthly("k", 1)
            },
            "time_zone \"Europe/Atlantis\" is not an IANA time zone name",
        ),
        (
            LeaseItem {
                calendar: Some("year".into()),
                ..monthly("k", 1)
            },
            "calendar must be \"day\", \"week\" or \"month\", not \"year\"",
        ),
        (
            LeaseItem {
                burst: 9,
                ..monthly("k", 1)
            },
            "a calendar item's burst is its requests",
        ),
        (
            LeaseItem {
                calendar: None,
                ..monthly("k", 1)
            },
            "time_zone needs calendar",
        ),
        // Not echoed: the error goes to the log and the answer.
        (
            LeaseItem {
                time_zone: Some("A".repeat(200_000)),
                ..monthly("k", 1)
            },
            "time_zone must be at most 64 bytes",
        ),
        (
            LeaseItem {
                calendar: Some("y".repeat(200_000)),
                ..monthly("k", 1)
            },
            "calendar must be \"day\", \"week\" or \"month\"",
        ),
    ];
    for (bad, error) in cases {
        let (status, body) = call(&svc, lease_body("p", vec![bad, monthly("ok", 1)]), None).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let answer: LeaseResponse = serde_json::from_str(&body).unwrap();
        assert_eq!(answer.errors.len(), 1, "{body}");
        assert_eq!(answer.errors[0].error, format!("items[0]: {error}"));
        assert_eq!(answer.items[1].granted, 1, "{body}");
    }
    // Without a time zone: UTC.
    let utc = LeaseItem {
        time_zone: None,
        calendar: Some("day".into()),
        ..monthly("u", 1)
    };
    let (_, body) = call(&svc, lease_body("p", vec![utc]), None).await;
    let g = grants(&body)[0];
    let now = tollgate_quota::store::now_ms();
    assert_eq!(g.granted, 1);
    assert!(g.reset_ms.abs_diff(DAY_MS - now % DAY_MS) < 2_000, "{g:?}");
}
