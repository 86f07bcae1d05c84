//! The API: leases, auth, metrics, bodies, credentials, per-credential caps (memory store; Redis where named).

use super::*;

const CALL_NAMES: &[&str] = &[
    "instance",
    "items",
    "rule",
    "limit_id",
    "key",
    "requests",
    "per_ms",
    "burst",
    "wanted",
    "used",
    "demand",
    "known_ms",
    "known_remaining",
    "concurrent",
    "keep",
    "known_held",
];

/// Valid call bodies to mutate for the fuzz target.
const CALL_SEEDS: &[&str] = &[
    r#"{"instance":"p1","items":[{"rule":"r","limit_id":"l","key":"k","requests":10,"per_ms":1000,
        "burst":20,"wanted":5,"used":1,"demand":2.5,"known_ms":100,"known_remaining":3}]}"#,
    r#"{"instance":"p2","items":[{"rule":"r","limit_id":"l","key":"k","requests":1,"per_ms":86400000,
        "burst":1,"wanted":1,"used":0},{"rule":"s","limit_id":"m","key":"j","requests":5,
        "per_ms":1,"burst":5,"wanted":0,"used":0}]}"#,
    r#"{"instance":"p3","items":[{"rule":"c","limit_id":"l","key":"k","concurrent":10,"wanted":3,
        "keep":1,"known_held":2}]}"#,
];

/// A service on `store` with two proxy tokens (edge-a, edge-b) and no shared one.
fn with_proxy_tokens_on(store: Store, max_instances: usize) -> Arc<Service> {
    let p = |s: &str| ProxyToken::parse(s).unwrap();
    Arc::new(Service {
        store,
        credentials: Credentials::new(
            None,
            vec![p("edge-a=aaaaaaaaaaaaaaaa"), p("edge-b=bbbbbbbbbbbbbbbb")],
            max_instances,
            Duration::from_secs(10),
        ),
        lease_ttl_ms: 10_000,
        metrics: Metrics::default(),
        body_timeout: Duration::from_secs(5),
        calendar: Default::default(),
    })
}

fn with_proxy_tokens(max_instances: usize) -> Arc<Service> {
    with_proxy_tokens_on(
        Store::Memory(MemoryStore::new(100, ColdStart::Full)),
        max_instances,
    )
}

/// A slot call to `svc` with `auth`.
async fn slot_call(
    svc: &Arc<Service>,
    instance: &str,
    items: Vec<PermitItem>,
    auth: &str,
) -> (StatusCode, String) {
    let body = serde_json::to_string(&PermitRequest {
        instance: instance.into(),
        items,
    })
    .unwrap();
    let req = Request::post("/v1/slots")
        .header("content-type", "application/json")
        .header("authorization", auth);
    let resp = router(svc.clone())
        .oneshot(req.body(Body::from(body)).unwrap())
        .await
        .unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

#[tokio::test]
async fn leases_are_granted_fairly_with_auth_and_metrics() {
    let svc = service(
        Store::Memory(MemoryStore::new(100, ColdStart::Full)),
        Some("s3cret"),
    );
    let body = lease_body("a", vec![item("k", 120, 1000)]);
    assert_eq!(
        call(&svc, body.clone(), None).await.0,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        call(&svc, body.clone(), Some("Bearer nope")).await.0,
        StatusCode::UNAUTHORIZED
    );
    // Demands of 10 and 50 from two other instances first: "a" then gets its fair 60.
    let ok = Some("Bearer s3cret");
    call(&svc, lease_body("c", vec![item("k", 120, 10)]), ok).await;
    call(&svc, lease_body("b", vec![item("k", 120, 50)]), ok).await;
    let (status, text) = call(&svc, body, ok).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert_eq!(grants(&text)[0].granted, 60);
    let (status, text) = call(&svc, "{\"instance\":\"a\"}".into(), ok).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(text.contains("missing field `items`"), "{text}");
    // A bad item is refused alone; the call's other items are served (a call is never refused
    // whole for one item: every other key of it would fall to its failure mode).
    let (status, text) = call(
        &svc,
        lease_body("a", vec![item("k", 0, 1), item("other", 5, 1)]),
        ok,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let answer: LeaseResponse = serde_json::from_str(&text).unwrap();
    assert_eq!(answer.errors.len(), 1);
    assert_eq!(answer.errors[0].item, 0);
    assert_eq!(
        answer.errors[0].error,
        "items[0]: requests, per_ms and burst must be positive"
    );
    assert_eq!((answer.items[0].granted, answer.items[1].granted), (0, 1));
    let metrics = svc.metrics.render();
    assert!(
        metrics.contains("tollgate_quota_tokens_granted_total 121"),
        "{metrics}"
    );
    assert!(metrics.contains("tollgate_quota_lease_calls_total{outcome=\"unauthorized\"} 2"));
}

#[tokio::test]
async fn a_full_memory_store_refuses_new_keys_but_keeps_serving_known_ones() {
    let svc = service(Store::Memory(MemoryStore::new(2, ColdStart::Full)), None);
    let two = lease_body("a", vec![item("k1", 5, 1), item("k2", 5, 1)]);
    assert_eq!(call(&svc, two, None).await.0, StatusCode::OK);
    // A new key is refused alone; the known key of the same call is served.
    let (status, text) = call(
        &svc,
        lease_body("a", vec![item("k3", 5, 1), item("k1", 5, 1)]),
        None,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let answer: LeaseResponse = serde_json::from_str(&text).unwrap();
    assert_eq!(answer.errors.len(), 1, "{text}");
    assert_eq!(answer.errors[0].item, 0);
    assert!(answer.errors[0].error.contains("storage is full"), "{text}");
    assert_eq!((answer.items[0].granted, answer.items[1].granted), (0, 1));
}

#[tokio::test]
async fn a_credential_that_fills_its_share_of_the_store_leaves_room_for_the_others() {
    // 10 keys, at most 5 made by one credential.
    let store = Store::Memory(MemoryStore::with_caps(10, 5, ColdStart::Full));
    let svc = with_proxy_tokens_on(store, DEFAULT_MAX_INSTANCES);
    let (a, b) = (
        Some("Bearer aaaaaaaaaaaaaaaa"),
        Some("Bearer bbbbbbbbbbbbbbbb"),
    );
    // A leaked token A makes keys without end (long-lived buckets: 1 a day).
    let flood: Vec<LeaseItem> = (0..8).map(|i| item(&format!("junk-{i}"), 5, 1)).collect();
    let (status, text) = call(&svc, lease_body("p", flood), a).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let answer: LeaseResponse = serde_json::from_str(&text).unwrap();
    assert_eq!(answer.errors.len(), 3, "{text}");
    assert!(
        answer.errors[0]
            .error
            .contains("this credential's share of the store is full (5 keys)"),
        "{text}"
    );
    let metrics = svc.metrics.render();
    assert!(
        metrics.contains("tollgate_quota_items_refused_total 3"),
        "{metrics}"
    );
    // B's new keys are still served (before, a full store answered every new key 503), and a
    // key A made is served to B as to anyone.
    let (status, text) = call(
        &svc,
        lease_body("p", vec![item("b-1", 5, 1), item("junk-0", 5, 1)]),
        b,
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let answer: LeaseResponse = serde_json::from_str(&text).unwrap();
    assert!(answer.errors.is_empty(), "{text}");
    assert_eq!(grants(&text)[0].granted, 1);
}

#[tokio::test]
async fn only_json_bodies_are_served() {
    let svc = service(Store::Memory(MemoryStore::new(100, ColdStart::Full)), None);
    let body = lease_body("a", vec![item("k", 5, 1)]);
    for (t, status) in [
        (Some("application/json"), StatusCode::OK),
        (Some("application/json; charset=utf-8"), StatusCode::OK),
        (Some("text/plain"), StatusCode::UNSUPPORTED_MEDIA_TYPE),
        (
            Some("application/x-www-form-urlencoded"),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
        ),
        (None, StatusCode::UNSUPPORTED_MEDIA_TYPE),
    ] {
        let (got, text) = call_as(&svc, body.clone(), None, t).await;
        assert_eq!(got, status, "{t:?}: {text}");
    }
}

#[tokio::test]
async fn a_caller_that_states_another_limit_cannot_rewrite_a_bucket() {
    let svc = service(
        Store::Memory(MemoryStore::new(100, ColdStart::Full)),
        Some("s3cret"),
    );
    let ok = Some("Bearer s3cret");
    // The proxies' limit: burst 50. Someone with the token sends the same limit_id and key with
    // burst 1 and wanted 0 (the call that cut the victim's bucket from 50 tokens to 1).
    let (status, _) = call(&svc, lease_body("evil", vec![item("victim", 1, 0)]), ok).await;
    assert_eq!(status, StatusCode::OK);
    let (status, text) = call(&svc, lease_body("a", vec![item("victim", 50, 50)]), ok).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert_eq!(
        grants(&text)[0].granted,
        50,
        "the bucket still holds its 50"
    );
}

/// The binding of before: 32 bits of a public hash of `limit_id` and the limit.
fn binding_of_before(limit_id: &str, limit: [u64; 3]) -> u32 {
    let mut bytes = limit_id.as_bytes().to_vec();
    for n in limit {
        bytes.extend_from_slice(&n.to_le_bytes());
    }
    tollgate_core::slot::fingerprint(&bytes) as u32
}

#[tokio::test]
async fn a_limit_whose_32_bit_binding_collides_cannot_rewrite_a_bucket_in_either_store() {
    // Two limits of `lim` (about one a day: nothing refills during the test) whose bindings of
    // before were equal, found by a birthday search over `per_ms` (2^17 victims' limits against
    // 2^19 attackers': 0.5 s). Against one victim's limit it takes about 2^32 hashes.
    let victim = [1, 86_401_546, 50];
    let attacker = [1, 86_552_055, 1];
    assert_eq!(
        binding_of_before("lim", victim),
        binding_of_before("lim", attacker)
    );
    let limit = |[requests, per_ms, burst]: [u64; 3], wanted| LeaseItem {
        requests,
        per_ms,
        ..item("victim", burst, wanted)
    };
    let redis = Redis::start();
    let on_redis = RedisStore::connect(&single(&redis), Duration::from_secs(2), ColdStart::Full)
        .await
        .unwrap();
    let stores = [
        (
            "memory",
            Store::Memory(MemoryStore::new(100, ColdStart::Full)),
        ),
        ("redis", Store::Redis(on_redis)),
    ];
    for (name, store) in stores {
        let svc = service(store, Some("s3cret"));
        let ok = Some("Bearer s3cret");
        // The attacker's limit, burst 1, takes nothing: before, the victim's bucket was cut to
        // one token.
        let (status, text) = call(&svc, lease_body("evil", vec![limit(attacker, 0)]), ok).await;
        assert_eq!(status, StatusCode::OK, "{name}: {text}");
        let (status, text) = call(&svc, lease_body("a", vec![limit(victim, 50)]), ok).await;
        assert_eq!(status, StatusCode::OK, "{name}: {text}");
        assert_eq!(
            grants(&text)[0].granted,
            50,
            "{name}: the bucket holds its 50"
        );
    }
}

#[tokio::test]
async fn a_proxy_token_cannot_speak_for_another_proxys_instances() {
    let svc = with_proxy_tokens(DEFAULT_MAX_INSTANCES);
    let (a, b) = ("Bearer aaaaaaaaaaaaaaaa", "Bearer bbbbbbbbbbbbbbbb");
    // Proxy A holds all 10 slots as instance "proxy-1".
    let (status, text) = slot_call(&svc, "proxy-1", vec![slot("k", 10, 0)], a).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let held = |text: &str| serde_json::from_str::<PermitResponse>(text).unwrap().items[0].held;
    assert_eq!(held(&text), 10);
    // B calls as "proxy-1" keeping nothing (the call that freed A's slots while A used them, a
    // limit of 10 becoming 15), then asks for 5: its calls act as "edge-b/proxy-1".
    let (status, _) = slot_call(&svc, "proxy-1", vec![slot("k", 0, 0)], b).await;
    assert_eq!(status, StatusCode::OK);
    let (_, text) = slot_call(&svc, "proxy-1", vec![slot("k", 5, 0)], b).await;
    assert_eq!(held(&text), 0, "A's 10 are still A's: {text}");
    // Nobody names an instance under a proxy's name.
    let (status, text) = slot_call(&svc, "edge-a/proxy-1", vec![slot("k", 0, 0)], b).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{text}");
    let (status, _) = slot_call(&svc, "proxy-1", vec![slot("k", 0, 0)], "Bearer wrong").await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let m = svc.metrics.render();
    assert!(m.contains("instance=\"edge-a/proxy-1\""), "{m}");
}

#[tokio::test]
async fn a_credential_cannot_invent_instances_to_collect_fair_shares() {
    let svc = with_proxy_tokens(4);
    let a = Some("Bearer aaaaaaaaaaaaaaaa");
    for i in 0..4 {
        let (status, text) = call(
            &svc,
            lease_body(&format!("p{i}"), vec![item("k", 100, 1)]),
            a,
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{text}");
    }
    let (status, text) = call(&svc, lease_body("p4", vec![item("k", 100, 1)]), a).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert!(
        text.contains("proxy token edge-a has 4 live instances"),
        "{text}"
    );
    // Its known instances go on; another proxy is not affected.
    assert_eq!(
        call(&svc, lease_body("p0", vec![item("k", 100, 1)]), a)
            .await
            .0,
        StatusCode::OK
    );
    let b = Some("Bearer bbbbbbbbbbbbbbbb");
    assert_eq!(
        call(&svc, lease_body("p4", vec![item("k", 100, 1)]), b)
            .await
            .0,
        StatusCode::OK
    );
}

#[tokio::test]
async fn a_holder_of_the_shared_token_at_the_instance_cap_cannot_lock_out_proxies_with_their_own_tokens(
) {
    let svc = Arc::new(Service {
        store: Store::Memory(MemoryStore::new(100, ColdStart::Full)),
        credentials: Credentials::new(
            Some("shared-token".into()),
            vec![ProxyToken::parse("edge-a=aaaaaaaaaaaaaaaa").unwrap()],
            4,
            Duration::from_secs(10),
        ),
        lease_ttl_ms: 10_000,
        metrics: Metrics::default(),
        body_timeout: Duration::from_secs(5),
        calendar: Default::default(),
    });
    let (shared, own) = (Some("Bearer shared-token"), Some("Bearer aaaaaaaaaaaaaaaa"));
    // The holder keeps as many names live as the cap allows the shared token.
    for i in 0..4 {
        let (status, text) = call(&svc, lease_body(&format!("junk-{i}"), vec![]), shared).await;
        assert_eq!(status, StatusCode::OK, "{text}");
    }
    // A proxy restarted under the shared token comes back with a new name: refused for as long
    // as the holder keeps its names live, and told how to get out.
    let (status, text) = call(&svc, lease_body("proxy-2", vec![item("k", 10, 1)]), shared).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    for named in [
        "the shared token has 4 live instances",
        "--proxy-token",
        "--max-instances",
    ] {
        assert!(text.contains(named), "{named} in {text}");
    }
    // A proxy with its own token has a budget of its own.
    let (status, text) = call(&svc, lease_body("proxy-2", vec![item("k", 10, 1)]), own).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert_eq!(grants(&text)[0].granted, 1);
}

proptest::proptest! {
    /// Call bodies of any shape, near-valid ones mostly (`make fuzz` runs many more cases):
    /// every one is answered with a defined status, none panics the service.
    #[test]
    fn fuzz_call_bodies_are_answered_never_panic(
        body in tollgate_core::arbitrary_json::mutated(CALL_SEEDS, CALL_NAMES),
        raw in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
        slots in proptest::prelude::any::<bool>(),
    ) {
        use tollgate_quota::fuzz_harness::{answer, memory_service, ANSWERED};
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let svc = memory_service();
        for bytes in [body.to_string().into_bytes(), raw.clone()] {
            let status = answer(&runtime, &svc, slots, bytes);
            proptest::prop_assert!(ANSWERED.contains(&status), "{status} for {body}");
        }
    }
}
