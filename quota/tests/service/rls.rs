//! Envoy's rate limit service (RLS) over the service's buckets: envoyproxy/ratelimit's matching and
//! answers, hits, shadow mode, replaces, and a bucket shared with tollgate filters, on both stores.

use super::*;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use testkit::RedisCluster;
use tollgate_quota::rls::config::RlsConfig;
use tollgate_quota::rls::Rls;

const CONFIG: &str = r#"
domain: messaging
descriptors:
  # Only allow 5 marketing messages a day
  - key: message_type
    value: marketing
    descriptors:
      - key: to_number
        rate_limit:
          unit: day
          requests_per_unit: 5

  # Only allow 100 messages a day to any unique phone number
  - key: to_number
    rate_limit:
      unit: day
      requests_per_unit: 100
"#;

const MORE: &str = r#"
domain: more
descriptors:
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 10}
  - key: remote_address
    value: 50.0.0.5
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: ldap
    rate_limit: {unlimited: true}
  - key: user
    value: user-a
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: key_1
    value: value_1
    descriptors:
      - key: user
        value: bkthomps
        rate_limit: {name: specific_limit, requests_per_unit: 5, unit: second}
  - key: key_2
    value: value_2
    descriptors:
      - key: user
        value: bkthomps
        rate_limit:
          replaces: [{name: specific_limit}]
          requests_per_unit: 10
          unit: second
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 100}
    tollgate_bucket: 4c1f0e9ad2b37a55.100.60000.100
"#;

fn rls(store: Store, token: Option<&str>, key_secret: Option<&str>) -> Rls {
    let mut config = RlsConfig::default();
    config.add(CONFIG).unwrap();
    config.add(MORE).unwrap();
    Rls {
        service: service(store, token),
        config: Arc::new(config),
        key_secret: tollgate_core::key_name::key_secret(key_secret, token),
    }
}

fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: (*k).into(),
                value: (*v).into(),
            })
            .collect(),
        ..RateLimitDescriptor::default()
    }
}

fn ask(domain: &str, descriptors: Vec<RateLimitDescriptor>, hits: u32) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors,
        hits_addend: hits,
    }
}

async fn call(rls: &Rls, request: RateLimitRequest) -> RateLimitResponse {
    rls.should_rate_limit(tonic::Request::new(request))
        .await
        .unwrap()
        .into_inner()
}

fn codes(r: &RateLimitResponse) -> Vec<i32> {
    r.statuses.iter().map(|s| s.code).collect()
}

const OK: i32 = Code::Ok as i32;
const OVER: i32 = Code::OverLimit as i32;

#[tokio::test]
async fn descriptors_are_limited_as_envoyproxy_ratelimit_configures_them() {
    let rls = rls(
        Store::Memory(MemoryStore::new(1_000, ColdStart::Full)),
        None,
        None,
    );
    let marketing = || {
        vec![
            descriptor(&[("message_type", "marketing"), ("to_number", "2061111111")]),
            descriptor(&[("to_number", "2061111111")]),
        ]
    };
    for n in 0..5 {
        let r = call(&rls, ask("messaging", marketing(), 0)).await;
        assert_eq!(r.overall_code, OK, "message {n}");
        assert_eq!(r.statuses[0].limit_remaining, 4 - n);
        assert_eq!(r.statuses[1].limit_remaining, 99 - n);
        let limit = r.statuses[0].current_limit.as_ref().unwrap();
        assert_eq!((limit.requests_per_unit, limit.unit), (5, 4));
    }
    let r = call(&rls, ask("messaging", marketing(), 0)).await;
    assert_eq!(r.overall_code, OVER);
    assert_eq!(codes(&r), [OVER, OK], "each descriptor answered alone");
    let wait = r.statuses[0].duration_until_reset.unwrap();
    // A token comes back every 86 400 / 5 s.
    assert!((17_270..=17_280).contains(&wait.seconds), "{wait:?}");
    // Another number has its own marketing budget; other messages only the per-number one.
    let other = vec![descriptor(&[
        ("message_type", "marketing"),
        ("to_number", "2062222222"),
    ])];
    assert_eq!(
        call(&rls, ask("messaging", other, 0)).await.overall_code,
        OK
    );
    let plain = vec![descriptor(&[
        ("message_type", "news"),
        ("to_number", "2061111111"),
    ])];
    let r = call(&rls, ask("messaging", plain, 0)).await;
    assert_eq!(r.overall_code, OK);
    assert!(r.statuses[0].current_limit.is_none(), "no limit matches");
    // Unknown domains and descriptors: OK, no limit.
    let r = call(&rls, ask("nowhere", vec![descriptor(&[("a", "b")])], 0)).await;
    assert_eq!((r.overall_code, codes(&r)), (OK, vec![OK]));
}

#[tokio::test]
async fn hits_blocklists_unlimited_shadow_mode_and_replaces() {
    let rls = rls(
        Store::Memory(MemoryStore::new(1_000, ColdStart::Full)),
        None,
        None,
    );
    let ip = |a: &str| vec![descriptor(&[("remote_address", a)])];
    // The call's hits_addend: 4 + 4 of 10, then 4 more are over (and take nothing).
    for (hits, code, left) in [(4, OK, 6), (4, OK, 2), (4, OVER, 2), (2, OK, 0)] {
        let r = call(&rls, ask("more", ip("10.0.0.1"), hits)).await;
        assert_eq!(
            (r.overall_code, r.statuses[0].limit_remaining),
            (code, left),
            "{hits}"
        );
    }
    // A descriptor's own hits_addend wins over the call's, also 0 (a look that takes nothing).
    let mut look = descriptor(&[("remote_address", "10.0.0.2")]);
    look.hits_addend = Some(UInt64Value { value: 0 });
    let r = call(&rls, ask("more", vec![look.clone()], 7)).await;
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, 10));
    // More than the bucket holds is over at once and takes nothing.
    let r = call(&rls, ask("more", ip("10.0.0.2"), 11)).await;
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OVER, 10));
    // Negative hits give back what this service took.
    let mut back = descriptor(&[("remote_address", "10.0.0.1")]);
    back.hits_addend = Some(UInt64Value { value: 3 });
    back.is_negative_hits = true;
    call(&rls, ask("more", vec![back], 0)).await;
    let r = call(&rls, ask("more", vec![look_at("10.0.0.1")], 0)).await;
    assert_eq!(r.statuses[0].limit_remaining, 3);
    // requests_per_unit 0: every request is over.
    let r = call(&rls, ask("more", ip("50.0.0.5"), 0)).await;
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OVER, 0));
    // Unlimited: OK, remaining u32::MAX, nothing stored.
    let r = call(&rls, ask("more", vec![descriptor(&[("ldap", "x")])], 0)).await;
    assert_eq!(
        (r.overall_code, r.statuses[0].limit_remaining),
        (OK, u32::MAX)
    );
    // Shadow mode: counted, never over.
    let shadow = || vec![descriptor(&[("user", "user-a")])];
    let mut remaining = Vec::new();
    for _ in 0..4 {
        let r = call(&rls, ask("more", shadow(), 0)).await;
        assert_eq!(codes(&r), [OK]);
        remaining.push(r.statuses[0].limit_remaining);
    }
    assert_eq!(remaining, [1, 0, 0, 0]);
    let metrics = rls.service.metrics.render();
    assert!(
        metrics.contains(r#"tollgate_quota_rls_descriptors_total{domain="more",descriptor="more.user_user-a",code="shadow_over_limit"} 2"#),
        "{metrics}"
    );
    // Replaces: with both, only the replacing limit (10/s) counts; the replaced one (5/s) is
    // untouched.
    let both = || {
        vec![
            descriptor(&[("key_1", "value_1"), ("user", "bkthomps")]),
            descriptor(&[("key_2", "value_2"), ("user", "bkthomps")]),
        ]
    };
    for _ in 0..6 {
        let r = call(&rls, ask("more", both(), 0)).await;
        assert_eq!(r.overall_code, OK);
        assert!(r.statuses[0].current_limit.is_none(), "replaced");
    }
    let alone = vec![descriptor(&[("key_1", "value_1"), ("user", "bkthomps")])];
    let r = call(&rls, ask("more", alone, 0)).await;
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, 4));
}

fn look_at(ip: &str) -> RateLimitDescriptor {
    let mut d = descriptor(&[("remote_address", ip)]);
    d.hits_addend = Some(UInt64Value { value: 0 });
    d
}

#[tokio::test]
async fn calls_without_the_token_or_with_bad_shapes_are_refused() {
    let rls = rls(
        Store::Memory(MemoryStore::new(1_000, ColdStart::Full)),
        Some("s3cret-s3cret-s3cret"),
        None,
    );
    let good = || {
        ask(
            "more",
            vec![descriptor(&[("remote_address", "1.2.3.4")])],
            0,
        )
    };
    let err = rls
        .should_rate_limit(tonic::Request::new(good()))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    let mut with_token = tonic::Request::new(good());
    with_token.metadata_mut().insert(
        "authorization",
        "Bearer s3cret-s3cret-s3cret".parse().unwrap(),
    );
    assert!(rls.should_rate_limit(with_token).await.is_ok());
    let signed = |r: RateLimitRequest| {
        let mut r = tonic::Request::new(r);
        r.metadata_mut().insert(
            "authorization",
            "Bearer s3cret-s3cret-s3cret".parse().unwrap(),
        );
        r
    };
    for (bad, want) in [
        (
            ask("", vec![descriptor(&[("a", "b")])], 0),
            "domain must not be empty",
        ),
        (ask("more", vec![], 0), "descriptor list must not be empty"),
        (
            ask("more", vec![descriptor(&[("a", "b")]); 65], 0),
            "at most 64 descriptors",
        ),
        (
            ask("more", vec![descriptor(&[("a", "b"); 33])], 0),
            "at most 32 entries",
        ),
    ] {
        let err = rls.should_rate_limit(signed(bad)).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains(want), "{}", err.message());
    }
}

/// A tollgate global rule's bucket, as a filter with `key_secret` names it for client key
/// `value` (one key part).
fn filter_item(secret: &str, value: &str, wanted: u64) -> LeaseItem {
    let mut key = tollgate_core::key_name::KeyBytes::new();
    tollgate_core::key_name::push_key_part(&mut key, Some(value.as_bytes()));
    let name = tollgate_core::key_name::service_key(
        tollgate_core::key_name::key_secret(Some(secret), None),
        tollgate_core::slot::key_hash(&key),
    );
    LeaseItem {
        rule: "tenant".into(),
        limit_id: "4c1f0e9ad2b37a55".into(),
        key: format!("{name:032x}"),
        requests: 100,
        per_ms: 60_000,
        burst: 100,
        wanted,
        ..LeaseItem::default()
    }
}

#[tokio::test]
async fn an_rls_descriptor_and_tollgate_filters_share_one_bucket_over_two_redis_replicas() {
    let redis = Redis::start();
    let secret = "deployment-key-secret";
    let timeout = Duration::from_millis(500);
    let replica = || async {
        Store::Redis(
            RedisStore::connect(&single(&redis), timeout, ColdStart::Full)
                .await
                .unwrap(),
        )
    };
    let (a, b) = (
        rls(replica().await, None, Some(secret)),
        rls(replica().await, None, Some(secret)),
    );
    // A filter leases 60 of tenant "acme"'s 100 through replica a's HTTP API.
    let grant = a
        .service
        .store
        .lease(
            "proxy-1",
            &[lease_item_bound(filter_item(secret, "acme", 60))],
            10_000,
        )
        .await
        .unwrap()[0];
    assert_eq!(grant.granted, 60);
    // RLS calls through both replicas get the other 40 and no more.
    let tenant = |t: &str| vec![descriptor(&[("tenant", t)])];
    let mut admitted = 0;
    for n in 0..60 {
        let rls = if n % 2 == 0 { &a } else { &b };
        if call(rls, ask("more", tenant("acme"), 0)).await.overall_code == OK {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 40, "one bucket: 100 in all");
    // Another tenant's bucket is its own.
    assert_eq!(
        call(&a, ask("more", tenant("other"), 0)).await.overall_code,
        OK
    );
}

/// An item's `limit_id` as the HTTP API binds it to its limit.
fn lease_item_bound(mut item: LeaseItem) -> LeaseItem {
    item.limit_id = tollgate_quota::service::bound_limit_id(
        &item.limit_id,
        &[item.requests, item.per_ms, item.burst],
    );
    item
}

#[tokio::test]
async fn a_failed_store_answers_unavailable_so_envoy_applies_its_failure_mode() {
    let mut redis = Redis::start();
    let store = Store::Redis(
        RedisStore::connect(&single(&redis), Duration::from_millis(100), ColdStart::Full)
            .await
            .unwrap(),
    );
    let rls = rls(store, None, None);
    let ip = || {
        ask(
            "more",
            vec![descriptor(&[("remote_address", "10.0.0.9")])],
            0,
        )
    };
    assert_eq!(call(&rls, ip()).await.overall_code, OK);
    redis.kill();
    let err = rls
        .should_rate_limit(tonic::Request::new(ip()))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    let metrics = rls.service.metrics.render();
    assert!(metrics.contains(r#"tollgate_quota_rls_calls_total{outcome="storage_error"} 1"#));
}

#[tokio::test]
async fn descriptors_spread_over_a_redis_cluster_stay_exact_across_two_replicas() {
    let cluster = RedisCluster::start();
    let nodes: Vec<String> = cluster.urls().split(',').map(str::to_owned).collect();
    let replica = || async {
        Store::Redis(
            RedisStore::connect(
                &RedisTarget::Cluster(nodes.clone()),
                Duration::from_millis(500),
                ColdStart::Full,
            )
            .await
            .unwrap(),
        )
    };
    let (a, b) = (
        rls(replica().await, None, None),
        rls(replica().await, None, None),
    );
    // 20 addresses (buckets on every master), 10 a second each: 15 calls each over both
    // replicas admit exactly 10 of each.
    for n in 0..20 {
        let ip = format!("10.1.0.{n}");
        let mut admitted = 0;
        for i in 0..15 {
            let rls = if i % 2 == 0 { &a } else { &b };
            let r = call(
                rls,
                ask("more", vec![descriptor(&[("remote_address", &ip)])], 0),
            )
            .await;
            admitted += usize::from(r.overall_code == OK);
        }
        assert!((10..=11).contains(&admitted), "{ip}: {admitted}");
    }
}

#[tokio::test]
async fn a_proxy_token_acts_as_its_own_rls_instance() {
    let service = Arc::new(Service {
        credentials: Credentials::new(
            None,
            vec![ProxyToken::parse("edge-a=edge-a-token-0123456789").unwrap()],
            DEFAULT_MAX_INSTANCES,
            Duration::from_secs(10),
        ),
        ..Arc::try_unwrap(service(
            Store::Memory(MemoryStore::new(1_000, ColdStart::Full)),
            None,
        ))
        .ok()
        .unwrap()
    });
    let mut config = RlsConfig::default();
    config.add(MORE).unwrap();
    let rls = Rls {
        service,
        config: Arc::new(config),
        key_secret: None,
    };
    let signed = |token: &str| {
        let mut r = tonic::Request::new(ask(
            "more",
            vec![descriptor(&[("remote_address", "1.2.3.4")])],
            0,
        ));
        r.metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
        r
    };
    let ok = rls
        .should_rate_limit(signed("edge-a-token-0123456789"))
        .await;
    assert_eq!(ok.unwrap().into_inner().overall_code, OK);
    let err = rls
        .should_rate_limit(signed("someone-else-0123456789"))
        .await;
    assert_eq!(err.unwrap_err().code(), tonic::Code::Unauthenticated);
    let metrics = rls.service.metrics.render();
    assert!(metrics.contains(r#"tollgate_quota_rls_calls_total{outcome="unauthorized"} 1"#));
}

#[tokio::test]
async fn taking_a_whole_full_bucket_at_once_is_charged_on_both_stores() {
    let redis = Redis::start();
    let redis_store = Store::Redis(
        RedisStore::connect(&single(&redis), Duration::from_millis(500), ColdStart::Full)
            .await
            .unwrap(),
    );
    for (name, store) in [
        (
            "memory",
            Store::Memory(MemoryStore::new(1_000, ColdStart::Full)),
        ),
        ("redis", redis_store),
    ] {
        eprintln!("{name}");
        let rls = rls(store, None, None);
        // 100 a day: nothing refills within the test.
        let mut look = descriptor(&[("to_number", "2069999999")]);
        look.hits_addend = Some(UInt64Value { value: 0 });
        let mut all = descriptor(&[("to_number", "2069999999")]);
        all.hits_addend = Some(UInt64Value { value: 100 });
        let mut admitted = 0;
        for _ in 0..10 {
            call(&rls, ask("messaging", vec![look.clone()], 0)).await;
            let r = call(&rls, ask("messaging", vec![all.clone()], 0)).await;
            if r.overall_code == OK {
                admitted += 1;
                assert_eq!(r.statuses[0].limit_remaining, 0, "{name}: {r:?}");
            }
        }
        assert_eq!(admitted, 1, "{name}: 100 of 100 once, then over");
    }
}

#[tokio::test]
async fn waits_own_limits_and_give_backs_are_answered_as_a_client_would_expect() {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
    let rls = rls(
        Store::Memory(MemoryStore::new(1_000, ColdStart::Full)),
        None,
        None,
    );
    // 100 a day for a number: 96 taken, then 6 more do not fit: when 2 more have refilled,
    // 2 × 864 s.
    let number = |hits: u64| {
        let mut d = descriptor(&[("to_number", "2065550000")]);
        d.hits_addend = Some(UInt64Value { value: hits });
        d
    };
    assert_eq!(
        call(&rls, ask("messaging", vec![number(96)], 0))
            .await
            .overall_code,
        OK
    );
    let r = call(&rls, ask("messaging", vec![number(6)], 0)).await;
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OVER, 4));
    let wait = r.statuses[0].duration_until_reset.unwrap().seconds;
    assert!((1_720..=1_730).contains(&wait), "{wait}");
    // Giving back is answered OK.
    let mut back = number(3);
    back.is_negative_hits = true;
    let r = call(&rls, ask("messaging", vec![back], 0)).await;
    assert_eq!(r.overall_code, OK, "{r:?}");
    // A call's own limit with a unit this service does not know is no limit of its own: the
    // configured one applies. Its own limit of 0 refuses.
    let mut unknown_unit = descriptor(&[("remote_address", "50.0.0.5")]);
    unknown_unit.limit = Some(RateLimitOverride {
        requests_per_unit: 1_000,
        unit: 99,
    });
    let r = call(&rls, ask("more", vec![unknown_unit], 0)).await;
    assert_eq!(r.overall_code, OVER, "the configured 0 applies: {r:?}");
    let mut zero = descriptor(&[("remote_address", "10.0.0.77")]);
    zero.limit = Some(RateLimitOverride {
        requests_per_unit: 0,
        unit: 1,
    });
    let r = call(&rls, ask("more", vec![zero], 0)).await;
    assert_eq!(r.overall_code, OVER, "{r:?}");
}

/// A Redis without persistence restarted: RLS calls carry no evidence of the buckets they used,
/// so those start as `--cold-start` says (docs/quota-api.md): `auto` and `full` full again (the
/// limit once more, as envoyproxy/ratelimit's counters start at 0), `conservative` with nothing
/// (as it serves a new deployment: nothing for a lease TTL, then a refill from empty — a day's
/// limit of 5 has none for hours).
#[tokio::test]
async fn a_redis_that_lost_its_data_starts_rls_buckets_as_cold_start_says() {
    let epoch_ms = tollgate_quota::store::now_ms();
    for (cold, before, after) in [
        (ColdStart::Auto { epoch_ms }, 5, 5),
        (ColdStart::Full, 5, 5),
        (ColdStart::Conservative { epoch_ms }, 0, 0),
    ] {
        let mut redis = Redis::start();
        let store = Store::Redis(
            RedisStore::connect(&single(&redis), Duration::from_millis(100), cold)
                .await
                .unwrap(),
        );
        let rls = rls(store, None, None);
        // Eight messages: how many are admitted (a store not reachable yet after its restart
        // answers UNAVAILABLE — Envoy's failure mode decides — and is asked again).
        let admitted = || async {
            let marketing = || {
                ask(
                    "messaging",
                    vec![descriptor(&[
                        ("message_type", "marketing"),
                        ("to_number", "2063333333"),
                    ])],
                    0,
                )
            };
            let deadline = Instant::now() + Duration::from_secs(5);
            let (mut answered, mut admitted) = (0, 0);
            while answered < 8 {
                match rls
                    .should_rate_limit(tonic::Request::new(marketing()))
                    .await
                {
                    Ok(r) => {
                        answered += 1;
                        admitted += usize::from(r.into_inner().overall_code == OK);
                    }
                    Err(e) => {
                        assert_eq!(e.code(), tonic::Code::Unavailable, "{cold:?}: {e:?}");
                        assert!(
                            Instant::now() < deadline,
                            "{cold:?}: the store never came back"
                        );
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            }
            admitted
        };
        assert_eq!(admitted().await, before, "{cold:?}, before");
        redis.kill();
        redis.restart();
        assert_eq!(admitted().await, after, "{cold:?}, after the loss");
    }
}
