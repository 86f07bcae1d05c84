//! Global concurrency: permits leased fairly, checked, counted and ended with their term.

use super::*;

/// The same holdings story in a store: fair shares, never over the limit, holders keep what they
/// use, a holding that is not renewed ends.
async fn slots_story(store: &Store) {
    let ttl = 400;
    let a = held(store, "a", slot("k", 10, 0), ttl).await;
    assert_eq!((a.held, a.share, a.free, a.ttl_ms), (10, 10, 0, ttl));
    let b = held(store, "b", slot("k", 10, 0), ttl).await;
    assert_eq!((b.held, b.share, b.free), (0, 5, 0));
    // a has 6 in flight: it keeps 6 and b gets the other 4; then both settle at 5.
    assert_eq!(held(store, "a", slot("k", 10, 6), ttl).await.held, 6);
    assert_eq!(held(store, "b", slot("k", 10, 0), ttl).await.held, 4);
    assert_eq!(held(store, "a", slot("k", 10, 5), ttl).await.held, 5);
    let b = held(store, "b", slot("k", 10, 4), ttl).await;
    assert_eq!((b.held, b.free), (5, 0));
    // Another key is another limit.
    assert_eq!(held(store, "a", slot("k2", 3, 0), ttl).await.held, 3);
    // a stops renewing (it died): its slots are b's one term later.
    std::thread::sleep(Duration::from_millis(ttl + 50));
    let b = held(store, "b", slot("k", 10, 5), ttl).await;
    assert_eq!((b.held, b.share, b.free), (10, 10, 0));
    // Given back.
    let b = held(store, "b", slot("k", 0, 0), ttl).await;
    assert_eq!((b.held, b.free), (0, 10));
}

#[tokio::test]
async fn global_concurrency_slots_are_leased_fairly_and_end_with_their_term_in_both_stores() {
    slots_story(&Store::Memory(MemoryStore::new(100, ColdStart::Full))).await;
    let redis = Redis::start();
    let timeout = Duration::from_millis(200);
    let target = single(&redis);
    let replica = || RedisStore::connect(&target, timeout, ColdStart::Full);
    let (one, two) = (replica().await.unwrap(), replica().await.unwrap());
    slots_story(&Store::Redis(one)).await;
    // Two replicas on one Redis share one limit.
    let two = Store::Redis(two);
    let three = Store::Redis(replica().await.unwrap());
    assert_eq!(held(&two, "x", slot("r", 7, 0), 10_000).await.held, 7);
    assert_eq!(held(&three, "y", slot("r", 7, 0), 10_000).await.held, 3);
}

#[tokio::test]
async fn slot_calls_are_checked_served_and_counted_per_instance() {
    let svc = service(
        Store::Memory(MemoryStore::new(100, ColdStart::Full)),
        Some("t"),
    );
    let body = |items: Vec<PermitItem>| {
        serde_json::to_string(&PermitRequest {
            instance: "proxy-1".into(),
            items,
        })
        .unwrap()
    };
    let post = |body: String, auth: Option<&'static str>| {
        let svc = svc.clone();
        async move {
            let mut req = Request::post("/v1/slots").header("content-type", "application/json");
            if let Some(a) = auth {
                req = req.header("authorization", a);
            }
            let resp = router(svc)
                .oneshot(req.body(Body::from(body)).unwrap())
                .await
                .unwrap();
            let status = resp.status();
            let bytes = resp.into_body().collect().await.unwrap().to_bytes();
            (status, String::from_utf8_lossy(&bytes).into_owned())
        }
    };
    let (status, _) = post(body(vec![slot("k", 3, 0)]), None).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, text) = post(
        body(vec![slot("k", 3, 0), slot("j", 2, 0)]),
        Some("Bearer t"),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let answers = serde_json::from_str::<PermitResponse>(&text).unwrap().items;
    assert_eq!(
        answers.iter().map(|a| a.held).collect::<Vec<_>>(),
        [3, 2],
        "{text}"
    );
    let (status, text) = post(
        body(vec![PermitItem {
            concurrent: 0,
            ..slot("k", 1, 0)
        }]),
        Some("Bearer t"),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let answer: PermitResponse = serde_json::from_str(&text).unwrap();
    assert_eq!(answer.items[0], PermitAnswer::default());
    assert!(
        answer.errors[0]
            .error
            .starts_with("items[0]: concurrent must be 1 to"),
        "{text}"
    );
    let metrics = svc.metrics.render();
    assert!(
        metrics.contains("tollgate_quota_slots_held{rule=\"r\",instance=\"proxy-1\"} 5"),
        "{metrics}"
    );
    assert!(metrics.contains("tollgate_quota_slot_calls_total{outcome=\"ok\"} 2"));
}
