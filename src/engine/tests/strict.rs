//! Strict mode: pre-checks, answers, give-backs and failed calls.

use super::*;

#[test]
fn strict_grants_a_request_will_not_spend_go_back_on_the_next_tick() {
    let strict = GLOBAL
        .replace(
            r#""upstream":"quota""#,
            r#""upstream":"quota","mode":"strict""#,
        )
        .replace(
            r#""worker_batch":0}]"#,
            r#""worker_batch":0},{"name":"l","limit":{"requests":1,"per":"1h"},"burst":1,"worker_batch":0}]"#,
        )
        .replace("FAILURE", "allow")
        .replace("FIRST", "wait");
    let mut rig = Rig::new(&strict);
    let u = req(&[("x-user", b"u")]);
    let inputs = rig.inputs(&u);
    let s = rig.engine.split(inputs);
    // Two requests pass the pre-check; the first takes the local rule's one token, so the
    // second is refused after its call granted it a global token.
    assert_eq!(rig.engine.local_refusal(&rig.store, &s.locals, NOW), None);
    admit(
        rig.engine
            .finish_strict(&rig.store, s.clone(), Some(&grant(1)), NOW),
    );
    refusal_of(
        rig.engine
            .finish_strict(&rig.store, s.clone(), Some(&grant(1)), NOW),
    );
    // A request costing 3 granted 2 (a partial grant) is refused by the global rule: its 2 go
    // back as well.
    let mut costly = s.clone();
    costly.globals[0].cost = 3;
    refusal_of(
        rig.engine
            .finish_strict(&rig.store, costly, Some(&grant(2)), NOW),
    );
    let calls = rig.engine.take_refills(&rig.store, "me", NOW + MS);
    let [Call::GiveBack(request)] = calls.as_slice() else {
        panic!("one give-back call")
    };
    let item = &request.items[0];
    assert_eq!((item.returned, item.wanted, item.used), (3, 0, 0));
    assert_eq!(item.key, format!("{:032x}", s.globals[0].key));
    // Given back once.
    assert!(rig
        .engine
        .take_refills(&rig.store, "me", NOW + 2 * MS)
        .is_empty());
}

#[test]
fn strict_answers_grant_refuse_or_fall_back() {
    let strict = GLOBAL.replace(
        r#""upstream":"quota""#,
        r#""upstream":"quota","mode":"strict""#,
    );
    let with_local = strict.replace(
        r#""worker_batch":0}]"#,
        r#""worker_batch":0},{"name":"l","limit":{"requests":1,"per":"1h"},"burst":1,"worker_batch":0}]"#,
    );
    let u = req(&[("x-user", b"u")]);
    let mut rig = Rig::new(
        &with_local
            .replace("FAILURE", "deny")
            .replace("FIRST", "wait"),
    );
    let inputs = rig.inputs(&u);
    assert!(rig.engine.is_strict(&inputs));
    let s = rig.engine.split(inputs);
    assert_eq!((s.globals.len(), s.locals.len()), (1, 1));
    assert_eq!(
        rig.engine.local_refusal(&rig.store, &s.locals, NOW),
        None,
        "the local rule has its token: ask the service"
    );
    let items = rig.engine.strict_items(&s);
    assert_eq!((items[0].wanted, items[0].used), (1, 1));
    // Granted: the local rule decides (its one token, then refusals).
    let step = rig
        .engine
        .finish_strict(&rig.store, s.clone(), Some(&grant(1)), NOW);
    assert!(matches!(step, Step::Admit(_)));
    // Only global rules: the headers state the global bucket as the service answered.
    let only_global = Strict {
        globals: s.globals.clone(),
        locals: Inputs::new(),
    };
    let a = admit(
        rig.engine
            .finish_strict(&rig.store, only_global, Some(&grant(1)), NOW),
    );
    let report = a.report.unwrap();
    assert_eq!((report.remaining, report.reset_secs), (7, 30));
    let step = rig
        .engine
        .finish_strict(&rig.store, s.clone(), Some(&grant(1)), NOW);
    assert_eq!(refusal_of(step).rule, 1);
    // From now on the local rule refuses before any call: no global quota is spent on it.
    let step = rig.engine.local_refusal(&rig.store, &s.locals, NOW);
    let r = refusal_of(step.expect("refused before the call"));
    assert_eq!((r.rule, r.retry_after_secs), (1, Some(3600)));
    assert_eq!(rig.stat(1, RuleStat::Limited), 2);
    // Short: refused by the global rule, with the time a token takes (60 s / 100 = 0.6 s → 1).
    let r = refusal_of(
        rig.engine
            .finish_strict(&rig.store, s.clone(), Some(&grant(0)), NOW),
    );
    assert_eq!((r.rule, r.retry_after_secs), (0, Some(1)));
    assert_eq!(r.quota.map(|q| (q.remaining, q.reset_secs)), Some((7, 30)));
    // Failed: deny.
    let r = refusal_of(rig.engine.finish_strict(&rig.store, s, None, NOW));
    assert_eq!(r.retry_after_secs, Some(1));

    for (mode, admitted) in [("allow", 10), ("local", 10)] {
        let mut rig = Rig::new(&strict.replace("FAILURE", mode).replace("FIRST", "wait"));
        let mut n = 0;
        for _ in 0..10 {
            let inputs = rig.inputs(&u);
            let s = rig.engine.split(inputs);
            n += usize::from(matches!(
                rig.engine.finish_strict(&rig.store, s, None, NOW),
                Step::Admit(_)
            ));
        }
        assert_eq!(n, admitted, "{mode}");
    }
    // Lease mode: no call of its own.
    let mut rig = global("allow", "wait");
    let inputs = rig.inputs(&u);
    assert!(!rig.engine.is_strict(&inputs));
}

#[test]
fn a_dry_run_global_rule_never_refuses_in_strict_mode() {
    let json = GLOBAL
        .replace(
            r#""upstream":"quota""#,
            r#""upstream":"quota","mode":"strict""#,
        )
        .replace(
            r#""worker_batch":0}"#,
            r#""worker_batch":0,"dry_run":true}"#,
        )
        .replace("FAILURE", "deny")
        .replace("FIRST", "wait");
    let mut rig = Rig::new(&json);
    let inputs = rig.inputs(&req(&[("x-user", b"u")]));
    // Only dry-run globals: no call of its own.
    assert!(!rig.engine.is_strict(&inputs));
    let s = rig.engine.split(inputs);
    let step = rig
        .engine
        .finish_strict(&rig.store, s, Some(&grant(0)), NOW);
    assert!(matches!(step, Step::Admit(_)));
    assert_eq!(rig.stat(0, RuleStat::DryRunLimited), 1);
}

#[test]
fn after_a_failed_call_strict_requests_skip_the_call_for_retry() {
    let json = GLOBAL
        .replace(
            r#""upstream":"quota""#,
            r#""upstream":"quota","mode":"strict","retry":"2s""#,
        )
        .replace("FAILURE", "allow")
        .replace("FIRST", "wait");
    let mut rig = Rig::new(&json);
    let u = req(&[("x-user", b"u")]);
    assert!(rig.engine.may_call(NOW));
    let inputs = rig.inputs(&u);
    let s = rig.engine.split(inputs);
    assert!(matches!(
        rig.engine.finish_strict(&rig.store, s, None, NOW),
        Step::Admit(_)
    ));
    assert!(!rig.engine.may_call(NOW + SEC));
    // Decided without a call: no new failure counted, and retry is not extended.
    let inputs = rig.inputs(&u);
    let s = rig.engine.split(inputs);
    rig.engine.finish_strict(&rig.store, s, None, NOW + SEC);
    let failures = Stat::Process(ProcessStat::QuotaFailures);
    assert_eq!(rig.engine.stats.pending(failures), 1);
    assert!(rig.engine.may_call(NOW + 2 * SEC));
    // A clock stepped back an hour does not keep calls off for the hour.
    assert!(rig.engine.may_call(NOW - 3_600 * SEC));
}
