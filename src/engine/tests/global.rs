//! Global rules in lease mode: first leases, rate leases, refused items, failure modes, answers, floods of new keys.

use super::*;

#[test]
fn a_global_key_waits_for_its_first_lease_then_spends_it() {
    let mut rig = global("deny", "wait");
    let u = req(&[("x-user", b"u")]);
    assert_eq!(rig.step(&u, NOW), Step::Wait);
    assert_eq!(rig.step(&u, NOW), Step::Wait, "one claim per key");
    let (refills, call) = rig.lease_call(NOW).unwrap();
    assert!(rig.lease_call(NOW).is_none());
    assert_eq!((refills.len(), call.items.len()), (1, 1));
    assert_eq!(call.instance, "me");
    let item = &call.items[0];
    assert_eq!((item.rule.as_str(), item.wanted, item.burst), ("g", 5, 40));
    assert_eq!(item.key, format!("{:032x}", refills[0].key));
    rig.engine
        .apply_grants(&rig.store, &refills, Some(&grant(5)), NOW);
    // The headers tell the global story as of that answer: 4 held here + 7 left in the global
    // bucket, which is full again in (40 - 7) × 0.6 s = 19.8 s.
    let first = admit(rig.step(&u, NOW));
    let report = first.report.unwrap();
    assert_eq!((report.remaining, report.reset_secs), (11, 20));
    assert_eq!(rig.admitted(&u, NOW, 8), 4);
    assert_eq!(
        rig.engine
            .stats
            .pending(Stat::Process(ProcessStat::QuotaGranted)),
        5
    );
    // Nothing granted: refused until a token can come back, without asking again meanwhile.
    let (refills, _) = rig.lease_call(NOW).unwrap();
    rig.engine
        .apply_grants(&rig.store, &refills, Some(&grant(0)), NOW);
    let r = refusal_of(rig.step(&u, NOW));
    assert_eq!(r.rule, 0);
}

#[test]
fn a_rate_lease_admits_at_its_rate_and_refuses_beyond_it_at_once() {
    let mut rig = global("deny", "wait");
    let u = req(&[("x-user", b"u")]);
    assert_eq!(rig.step(&u, NOW), Step::Wait);
    let (mut refills, _) = rig.lease_call(NOW).unwrap();
    // Asked for 20 per second, given nothing outright and 10 per second for 10 s: capped, so
    // it does not ask again before the renewal.
    refills[0].ask.demand_mtps = 20_000;
    let mut answer = grant(0);
    answer.items[0].rate = 10.0;
    answer.items[0].remaining = 0;
    rig.engine
        .apply_grants(&rig.store, &refills, Some(&answer), NOW);
    // Nothing accrued yet, and the global bucket is empty: refused at once (not held), told to
    // come back when a token has.
    let r = refusal_of(rig.step(&u, NOW + 50 * MS));
    assert_eq!((r.rule, r.retry_after_secs), (0, Some(1)));
    // 10 per second: 6 of 50 requests sent over 0.6 s.
    let admitted = (1..=50)
        .filter(|i| matches!(rig.step(&u, NOW + i * 12 * MS), Step::Admit(_)))
        .count();
    assert_eq!(admitted, 6);
    assert_eq!(rig.stat(0, RuleStat::Limited), 45);
    // It ran dry: the renewal (claimed after a sixteenth of the lease, since it was capped)
    // asks for the whole rate.
    admit(rig.step(&u, NOW + 700 * MS));
    let (_, call) = rig.lease_call(NOW + 705 * MS).unwrap();
    assert_eq!(call.items[0].demand, 1.666);
}

#[test]
fn a_capped_rate_lease_whose_bucket_has_tokens_waits_for_them() {
    let mut rig = global("deny", "wait");
    let u = req(&[("x-user", b"u")]);
    assert_eq!(rig.step(&u, NOW), Step::Wait);
    let (mut refills, _) = rig.lease_call(NOW).unwrap();
    // Asked for the whole rate and got it, with 2 tokens; the global bucket still holds 7.
    refills[0].ask.demand_mtps = 1_666;
    let mut answer = grant(2);
    answer.items[0].rate = 1.666;
    rig.engine
        .apply_grants(&rig.store, &refills, Some(&answer), NOW);
    admit(rig.step(&u, NOW + MS));
    admit(rig.step(&u, NOW + MS));
    // Spent, but the service said the bucket has more: the request waits for a refill (claimed
    // as the lease ran low), it is not refused.
    assert_eq!(rig.step(&u, NOW + 2 * MS), Step::Wait);
    let (refills, call) = rig.lease_call(NOW + 3 * MS).expect("a refill");
    assert!(call.items[0].wanted > 0);
    rig.engine
        .apply_grants(&rig.store, &refills, Some(&grant(5)), NOW + 4 * MS);
    admit(rig.step(&u, NOW + 5 * MS));
    assert_eq!(rig.stat(0, RuleStat::Limited), 0);
}

#[test]
fn an_item_the_service_refuses_fails_its_key_alone() {
    let mut rig = global("deny", "wait");
    let (u, v) = (req(&[("x-user", b"u")]), req(&[("x-user", b"v")]));
    assert_eq!(rig.step(&u, NOW), Step::Wait);
    assert_eq!(rig.step(&v, NOW), Step::Wait);
    let (refills, call) = rig.lease_call(NOW).unwrap();
    assert_eq!(call.items.len(), 2);
    let mut answer = grant(5);
    answer.items = vec![LeaseGrant::default(), grant(5).items[0]];
    answer.errors = vec![tollgate_core::global::lease::ItemError {
        item: 0,
        error: "items[0]: key must be 1 to 128 bytes".into(),
    }];
    let body = serde_json::to_vec(&answer).unwrap();
    let answer = read_answer(Some(b"200"), Some(&body), 2).unwrap();
    rig.engine
        .apply_grants(&rig.store, &refills, Some(&answer), NOW);
    // The refused item's key (u's, claimed first) takes the failure mode (deny); v is served.
    assert_eq!(refusal_of(rig.step(&u, NOW)).retry_after_secs, Some(1));
    admit(rig.step(&v, NOW));
    assert_eq!(
        rig.engine
            .stats
            .pending(Stat::Process(ProcessStat::QuotaFailures)),
        0,
        "no call failed"
    );
}

#[test]
fn failure_modes_decide_when_the_quota_service_fails() {
    for (mode, admitted) in [("allow", 50), ("deny", 0), ("local", 20)] {
        let mut rig = global(mode, "wait");
        let u = req(&[("x-user", b"u")]);
        assert_eq!(rig.step(&u, NOW), Step::Wait);
        let (refills, _) = rig.lease_call(NOW).unwrap();
        rig.engine.apply_grants(&rig.store, &refills, None, NOW);
        assert_eq!(rig.admitted(&u, NOW, 50), admitted, "{mode}");
        assert!(rig.stat(0, RuleStat::Fallback) >= 1, "{mode}");
        if mode == "deny" {
            let r = refusal_of(rig.step(&u, NOW));
            assert_eq!(r.retry_after_secs, Some(1));
        }
    }
}

#[test]
fn a_wait_without_quota_in_time_is_refused_and_provisional_quota_spends_at_once() {
    // Whatever the failure mode: a healthy service that has no quota for the request in time is
    // a refusal, not a failure.
    for mode in ["allow", "deny", "local"] {
        let mut rig = global(mode, "wait");
        let mut inputs = rig.inputs(&req(&[("x-user", b"u")]));
        assert_eq!(
            rig.engine.evaluate(&rig.store, &mut inputs, NOW, false),
            Step::Wait
        );
        let timed_out = rig.engine.evaluate(&rig.store, &mut inputs, NOW, true);
        let r = refusal_of(timed_out);
        // 60 s / 100 requests: a token comes back within 1 s.
        assert_eq!((r.rule, r.retry_after_secs), (0, Some(1)), "{mode}");
        assert_eq!(rig.stat(0, RuleStat::Limited), 1);
        assert_eq!(rig.stat(0, RuleStat::Fallback), 0);
    }

    let mut rig = global("deny", "provisional");
    // The stand-in: 40 / 2 instances.
    assert_eq!(rig.admitted(&req(&[("x-user", b"u")]), NOW, 30), 20);
}

#[test]
fn lease_answers_are_checked_before_use() {
    let ok = br#"{"items":[{"granted":1,"ttl_ms":1,"remaining":0,"reset_ms":1}]}"#;
    assert!(read_answer(Some(b"200"), Some(ok), 1).is_some());
    assert!(read_answer(Some(b"200"), Some(ok), 2).is_none());
    assert!(read_answer(Some(b"503"), Some(ok), 1).is_none());
    assert!(read_answer(None, None, 1).is_none());
    assert!(read_answer(Some(b"200"), Some(b"\xff{"), 1).is_none());
    assert!(read_answer(Some(b"2\xff0"), Some(ok), 1).is_none());
}

proptest::proptest! {
    /// Whatever a quota service (or something posing as one) answers, reading it never panics
    /// and only a well-formed answer for the right number of items is used.
    #[test]
    fn any_lease_answer_is_read_safely(
        status in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..4),
        body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..96),
        items in 0usize..3,
    ) {
        if let Some(answer) = read_answer(Some(&status), Some(&body), items) {
            proptest::prop_assert_eq!(answer.items.len(), items);
            proptest::prop_assert_eq!(&status[..], b"200");
        }
    }
}

#[test]
fn a_flood_of_new_keys_goes_in_calls_the_service_takes_and_a_limited_key_stays_limited() {
    use super::lease::{CALLS_PER_TICK, ITEMS_PER_CALL};
    let mut rig = Rig::new(
        &GLOBAL
            .replace("FAILURE", "allow")
            .replace("FIRST", "wait")
            .replace(
                r#""worker_batch":0"#,
                r#""worker_batch":0,"max_keys":65536"#,
            ),
    );
    let user = |name: String| Req {
        headers: vec![("x-user", name.into_bytes())],
        peer: "10.0.0.1:4000",
    };
    let victim = user("victim".into());
    assert_eq!(rig.step(&victim, NOW), Step::Wait);
    // 5 000 new keys before the next tick (the flood that made one call of 1 499 items, which
    // the service refused whole, so every key of it fell to `failure_mode: allow`).
    for i in 0..5_000 {
        assert_eq!(rig.step(&user(format!("new-{i}")), NOW + MS), Step::Wait);
    }
    let mut empty = grant(0);
    empty.items[0].remaining = 0;
    let mut sent = 0;
    let mut ticks = 0;
    loop {
        let calls = rig.engine.take_refills(&rig.store, "me", NOW + 2 * MS);
        if calls.is_empty() {
            break;
        }
        ticks += 1;
        assert!(calls.len() <= CALLS_PER_TICK, "{} calls", calls.len());
        for call in calls {
            let Call::Lease(refills, request) = call else {
                panic!("a slot call")
            };
            assert!(request.items.len() <= ITEMS_PER_CALL);
            assert_eq!(request.problem(), None, "the service takes the call");
            assert!(request.item_problems().iter().all(Option::is_none));
            assert_eq!(refills.len(), request.items.len());
            // The victim's bucket is empty; everyone else gets 5.
            let answer = LeaseResponse {
                items: (0..refills.len())
                    .map(|i| {
                        if sent == 0 && i == 0 {
                            empty.items[0]
                        } else {
                            grant(5).items[0]
                        }
                    })
                    .collect(),
                errors: Vec::new(),
            };
            sent += refills.len();
            rig.engine
                .apply_grants(&rig.store, &refills, Some(&answer), NOW + 3 * MS);
        }
    }
    assert_eq!((sent, ticks), (5_001, 3));
    refusal_of(rig.step(&victim, NOW + 4 * MS));
    admit(rig.step(&user("new-4999".into()), NOW + 4 * MS));
    assert_eq!(
        rig.stat(0, RuleStat::Fallback),
        0,
        "no key fell to its failure mode"
    );
}

#[test]
fn a_served_keys_renewal_goes_out_before_a_flood_of_new_keys_first_leases() {
    let mut rig = global("allow", "wait");
    let user = |name: &str| Req {
        headers: vec![("x-user", name.as_bytes().to_vec())],
        peer: "10.0.0.1:4000",
    };
    let friend = user("friend");
    assert_eq!(rig.step(&friend, NOW), Step::Wait);
    let (refills, _) = rig.lease_call(NOW).unwrap();
    let friend_key = refills[0].key;
    rig.engine
        .apply_grants(&rig.store, &refills, Some(&grant(5)), NOW);
    // Leases of 5 renewed below 3 left: the third request claims the renewal.
    admit(rig.step(&friend, NOW + MS));
    admit(rig.step(&friend, NOW + MS));
    for i in 0..5_000 {
        assert_eq!(rig.step(&user(&format!("new-{i}")), NOW + MS), Step::Wait);
    }
    admit(rig.step(&friend, NOW + MS));
    let calls = rig.engine.take_refills(&rig.store, "me", NOW + 2 * MS);
    let Some(Call::Lease(refills, request)) = calls.first() else {
        panic!("no lease call")
    };
    // Before, it waited behind 2 000 of the flood's first leases a tick (3 ticks).
    assert_eq!(refills[0].key, friend_key);
    assert_eq!((request.items[0].used, request.items[0].wanted), (3, 3));
}
