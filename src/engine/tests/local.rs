//! Local rules: every algorithm, keys, overrides, dry runs, worker stashes and costs.

use super::*;

#[test]
fn a_token_bucket_admits_its_burst_then_refuses_with_the_time_to_wait() {
    let mut rig = Rig::new(ONE_RULE);
    let alice = req(&[("x-user", b"alice")]);
    for left in [2, 1, 0] {
        let a = admit(rig.step(&alice, NOW));
        assert_eq!(a.report.map(|r| r.remaining), Some(left));
    }
    let r = refusal_of(rig.step(&alice, NOW));
    assert_eq!((r.rule, r.retry_after_secs), (0, Some(60)));
    // Another key has its own bucket.
    assert_eq!(rig.admitted(&req(&[("x-user", b"bob")]), NOW, 5), 3);
    // Refilled at the rate.
    assert!(matches!(rig.step(&alice, NOW + 60 * SEC), Step::Admit(_)));
    assert_eq!(rig.stat(0, RuleStat::Allowed), 7);
    assert_eq!(rig.stat(0, RuleStat::Limited), 3);

    let mut h = HeaderSet::default();
    let response = rig.engine.render_refusal(&mut h, &r);
    assert_eq!(response.status, 429);
    let headers: Vec<_> = h.iter().collect();
    assert_eq!(
        headers,
        [
            ("content-type", "text/plain"),
            ("ratelimit-policy", "\"r\";q=1;w=60"),
            ("ratelimit", "\"r\";r=0;t=60"),
            ("retry-after", "60"),
            ("x-tollgate-rule", "r"),
        ]
    );
}

#[test]
fn key_values_are_bytes_and_requests_without_the_key_are_skipped() {
    let mut rig = Rig::new(ONE_RULE);
    let latin1 = req(&[("x-user", b"caf\xe9")]);
    let utf8 = req(&[("x-user", "café".as_bytes())]);
    assert_eq!(rig.admitted(&latin1, NOW, 5), 3);
    assert_eq!(rig.admitted(&utf8, NOW, 5), 3);
    assert!(rig.inputs(&req(&[])).is_empty());
}

#[test]
fn windows_warm_up_and_leaky_buckets_follow_their_formulas() {
    let mut rig = Rig::new(
        r#"{"rules":[
          {"name":"fw","match":{"path":"/fw"},"algorithm":"fixed_window","limit":{"requests":4,"per":"10s"}},
          {"name":"sw","match":{"path":"/sw"},"algorithm":"sliding_window","limit":{"requests":4,"per":"10s"}},
          {"name":"wu","match":{"path":"/wu"},"limit":{"requests":30,"per":"1s"},"warmup":"10s"},
          {"name":"lb","match":{"path":"/lb"},"algorithm":"leaky_bucket","limit":{"requests":10,"per":"1s"},"burst":3}
        ]}"#,
    );
    let at = |p: &'static [u8]| req(&[(":path", p)]);
    let edge = (NOW / (10 * SEC) + 1) * 10 * SEC;
    assert_eq!(rig.admitted(&at(b"/fw"), edge - 1, 6), 4);
    assert_eq!(rig.admitted(&at(b"/fw"), edge, 6), 4, "fixed: a new window");
    assert_eq!(rig.admitted(&at(b"/sw"), edge - 1, 6), 4);
    assert_eq!(
        rig.admitted(&at(b"/sw"), edge, 6),
        0,
        "sliding: no second burst"
    );
    // A cold warm-up bucket admits one request at a time, at a third of the rate.
    assert_eq!(rig.admitted(&at(b"/wu"), NOW, 5), 1);
    // nginx limit_req: the first in rate, the next three delayed 100, 200, 300 ms, then refused.
    let delays: Vec<u64> = (0..4)
        .map(|_| admit(rig.step(&at(b"/lb"), NOW)).delay_ns)
        .collect();
    assert_eq!(delays, [0, 100_000_000, 200_000_000, 300_000_000]);
    assert!(matches!(rig.step(&at(b"/lb"), NOW), Step::Refuse(_)));
    assert_eq!(rig.stat(3, RuleStat::Delayed), 3);
}

#[test]
fn concurrency_holds_until_released() {
    let mut rig =
        Rig::new(r#"{"rules":[{"name":"c","algorithm":"concurrency","limit":{"concurrent":2}}]}"#);
    let r = req(&[]);
    let first = admit(rig.step(&r, NOW));
    let second = admit(rig.step(&r, NOW));
    assert_eq!(first.holds.len(), 1);
    assert!(matches!(rig.step(&r, NOW), Step::Refuse(_)));
    assert_eq!(rig.stat(0, RuleStat::InFlight), 2);
    rig.engine.release(&rig.store, first.holds, NOW);
    assert!(matches!(rig.step(&r, NOW), Step::Admit(_)));
    rig.engine.release(&rig.store, second.holds, NOW);
    assert_eq!(rig.stat(0, RuleStat::InFlight), 1);
}

#[test]
fn overrides_dry_run_and_all_or_nothing() {
    let mut rig = Rig::new(
        r#"{"rules":[
          {"name":"ip","key":["client_ip"],"limit":{"requests":1,"per":"1h"},"burst":2,"worker_batch":0,
           "overrides":[{"values":["10.0.0.2"],"unlimited":true},{"values":["10.0.0.3"],"block":true},
                        {"values":["10.0.0.4"],"limit":{"requests":1,"per":"1h"},"burst":5}]},
          {"name":"dry","limit":{"requests":1,"per":"1h"},"burst":1,"dry_run":true},
          {"name":"narrow","match":{"path":"/narrow"},"limit":{"requests":1,"per":"1h"},"burst":1,"worker_batch":0}
        ]}"#,
    );
    let from = |peer: &'static str| Req { peer, ..req(&[]) };
    // The dry-run rule refuses from the second request on, but never refuses.
    assert_eq!(rig.admitted(&from("10.0.0.1:1"), NOW, 4), 2);
    assert!(rig.stat(1, RuleStat::DryRunLimited) >= 2);
    assert_eq!(
        rig.inputs(&from("10.0.0.2:1")).len(),
        1,
        "unlimited: only the dry rule"
    );
    let trusted = rig.engine.config().client_ip;
    let blocked = rig.engine.gather(
        &Request::new(&from("10.0.0.3:1"), trusted),
        &mut Inputs::new(),
    );
    assert!(matches!(blocked, Some(Refusal { rule: 0, .. })));
    assert_eq!(rig.admitted(&from("10.0.0.4:1"), NOW, 8), 5);
    // "narrow" refuses its second request, which then charges "ip" nothing.
    let narrow = Req {
        peer: "10.0.0.9:1",
        ..req(&[(":path", b"/narrow")])
    };
    assert_eq!(rig.admitted(&narrow, NOW, 3), 1);
    let plain = from("10.0.0.9:1");
    assert_eq!(rig.admitted(&plain, NOW, 3), 1, "one of the 2 tokens left");
}

#[test]
fn busy_keys_stash_tokens_and_give_back_what_they_do_not_spend() {
    let mut rig = Rig::new(
        r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1h"},"burst":100,"worker_batch":8}]}"#,
    );
    let r = req(&[]);
    // The second request within 20 ms is busy: its CAS takes 8 more.
    assert_eq!(rig.admitted(&r, NOW, 2), 2);
    assert_eq!(rig.engine.stashed(), 8);
    assert_eq!(rig.admitted(&r, NOW, 3), 3);
    assert_eq!(rig.engine.stashed(), 5);
    rig.engine.return_stashes(&rig.store, NOW + SEC);
    assert_eq!(rig.engine.stashed(), 0);
    assert_eq!(rig.stat(0, RuleStat::StashReturned), 5);
    // 5 spent + 5 returned: 95 left in the shared bucket.
    assert_eq!(rig.admitted(&req(&[]), NOW + SEC, 200), 95);
}

/// A request decided by `engine`, one worker of several sharing `store`.
fn step_on(engine: &mut Engine, store: &MemoryStore, r: &Req, now: u64) -> (Step, Inputs) {
    let trusted = engine.config().client_ip;
    let mut inputs = Inputs::new();
    assert!(engine
        .gather(&Request::new(r, trusted), &mut inputs)
        .is_none());
    let step = engine.evaluate(store, &mut inputs, now, false);
    (step, inputs)
}

/// Two workers on one store: A is busy and stashes, B takes what the bucket has left. B's
/// admissions, and its next request.
fn drain_beside_a_stash(hold: bool) -> (u64, Step, Inputs, Rig, Engine) {
    let json = r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1h"},"burst":20}]}"#;
    let mut a = Rig::new(json);
    a.engine.hold_for_stashes(hold);
    let mut b = Engine::new(
        Config::parse(json.as_bytes()).unwrap(),
        KeyPlacement::new([7; 16]),
    );
    b.hold_for_stashes(hold);
    let r = req(&[]);
    assert_eq!(a.admitted(&r, NOW, 2), 2);
    let stashed = a.engine.stashed();
    assert!(stashed > 0);
    let by_b = (0..40)
        .take_while(|_| matches!(step_on(&mut b, &a.store, &r, NOW + MS).0, Step::Admit(_)))
        .count() as u64;
    assert_eq!(by_b + 2 + stashed, 20);
    let (step, inputs) = step_on(&mut b, &a.store, &r, NOW + 2 * MS);
    (stashed, step, inputs, a, b)
}

#[test]
fn a_request_refused_while_another_worker_stashes_tokens_waits_for_them() {
    let (_, step, mut waiting, mut a, mut b) = drain_beside_a_stash(true);
    // B's request waits (not refused) while A holds tokens; A's tick returns them after 20 ms
    // and B, deciding again, is admitted.
    assert_eq!(step, Step::Wait);
    a.engine.return_stashes(&a.store, NOW + 21 * MS);
    let again = b.evaluate(&a.store, &mut waiting, NOW + 25 * MS, false);
    assert!(matches!(again, Step::Admit(_)), "{again:?}");
    // The rest of what A returned, then (every stash back or spent) a refusal at once, with its
    // time to wait: 20 admitted in all.
    let rest = (0..40)
        .map(|_| step_on(&mut b, &a.store, &req(&[]), NOW + 40 * MS).0)
        .find_map(|step| match step {
            Step::Admit(_) => None,
            other => Some(other),
        });
    assert_eq!(
        b.stats.pending(Stat::Rule(0, RuleStat::Allowed)) as u64,
        20 - 2
    );
    assert!(refusal_of(rest.unwrap()).retry_after_secs.is_some());
    // A request that cannot be held again (its configuration goes away) is decided at once.
    let (_, _, mut waiting, a, mut b) = drain_beside_a_stash(true);
    let now = b.evaluate_at_once(&a.store, &mut waiting, NOW + 3 * MS, true);
    assert!(matches!(now, Step::Refuse(_)), "{now:?}");
}

#[test]
fn where_the_host_cannot_hold_a_request_it_is_refused_at_once() {
    // nginx: the bound docs/architecture.md states (at most 20 ms, at the end of a burst).
    let (stashed, step, ..) = drain_beside_a_stash(false);
    assert!(stashed > 0);
    assert!(matches!(step, Step::Refuse(_)), "{step:?}");
}

#[test]
fn a_cost_no_bucket_can_hold_is_refused_without_a_retry_after() {
    let mut rig = Rig::new(
        r#"{"rules":[{"name":"c","limit":{"requests":1,"per":"1s"},"burst":2,
            "cost":{"header":"x-cost","max":100},"worker_batch":0}]}"#,
    );
    let trusted = rig.engine.config().client_ip;
    let five = req(&[("x-cost", b"5")]);
    let refused = rig
        .engine
        .gather(&Request::new(&five, trusted), &mut Inputs::new());
    assert_eq!(
        refused,
        Some(Refusal {
            rule: 0,
            quota: None,
            retry_after_secs: None
        })
    );
    assert_eq!(rig.stat(0, RuleStat::CostExceeded), 1);
    // A cost the bucket can hold: refused while it refills, with the true wait.
    let two = req(&[("x-cost", b"2")]);
    assert!(matches!(rig.step(&two, NOW), Step::Admit(_)));
    let r = refusal_of(rig.step(&two, NOW));
    assert_eq!(r.retry_after_secs, Some(2));
    assert!(matches!(rig.step(&two, NOW + 2 * SEC), Step::Admit(_)));
    // x-cost: 0 costs the minimum, 1.
    let zero = req(&[("x-cost", b"0")]);
    assert!(matches!(rig.step(&zero, NOW + 3 * SEC), Step::Admit(_)));
    assert!(matches!(rig.step(&zero, NOW + 3 * SEC), Step::Refuse(_)));
}
