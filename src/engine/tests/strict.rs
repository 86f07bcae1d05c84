//! Strict mode: pre-checks, answers, give-backs and failed calls.

use super::*;

/// [`GLOBAL`] in strict mode with failure mode `failure` and `service` (more fields of the quota
/// service, each after a comma).
fn strict_global(failure: &str, service: &str) -> String {
    let mode = format!(r#""upstream":"quota","mode":"strict"{service}"#);
    GLOBAL
        .replace(r#""upstream":"quota""#, &mode)
        .replace("FAILURE", failure)
        .replace("FIRST", "wait")
}

/// `json` with a local rule `l` after the global one: 1 an hour.
fn with_local_rule(json: &str) -> String {
    json.replace(
        r#""worker_batch":0}]"#,
        r#""worker_batch":0},{"name":"l","limit":{"requests":1,"per":"1h"},"burst":1,"worker_batch":0}]"#,
    )
}

/// The items of the one call in which a tick at `now` gives tokens back (none: it sends no call).
fn given_back(rig: &mut Rig, now: u64) -> Vec<tollgate_core::global::lease::LeaseItem> {
    match rig.engine.take_refills(&rig.store, "me", now).as_slice() {
        [] => Vec::new(),
        [Call::GiveBack(request)] => request.items.clone(),
        _ => panic!("a call other than one give-back"),
    }
}

#[test]
fn strict_grants_a_request_will_not_spend_go_back_on_the_next_tick() {
    let mut rig = Rig::new(&with_local_rule(&strict_global("allow", "")));
    let u = req(&[("x-user", b"u")]);
    let inputs = rig.inputs(&u);
    let s = rig.engine.split(inputs, NOW);
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
    let items = given_back(&mut rig, NOW + MS);
    let item = &items[0];
    assert_eq!((item.returned, item.wanted, item.used), (3, 0, 0));
    assert_eq!(item.key, format!("{:032x}", s.globals[0].key));
    // Given back once.
    assert!(given_back(&mut rig, NOW + 2 * MS).is_empty());
}

#[test]
fn strict_answers_grant_refuse_or_fall_back() {
    let u = req(&[("x-user", b"u")]);
    let mut rig = Rig::new(&with_local_rule(&strict_global("deny", "")));
    let inputs = rig.inputs(&u);
    assert!(rig.engine.is_strict(&inputs));
    let s = rig.engine.split(inputs, NOW);
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
        refused: Inputs::new(),
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
        let mut rig = Rig::new(&strict_global(mode, ""));
        let mut n = 0;
        for _ in 0..10 {
            let inputs = rig.inputs(&u);
            let s = rig.engine.split(inputs, NOW);
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
    let json = strict_global("deny", "").replace(
        r#""worker_batch":0}"#,
        r#""worker_batch":0,"dry_run":true}"#,
    );
    let mut rig = Rig::new(&json);
    let inputs = rig.inputs(&req(&[("x-user", b"u")]));
    // Only dry-run globals: no call of its own.
    assert!(!rig.engine.is_strict(&inputs));
    let s = rig.engine.split(inputs, NOW);
    let step = rig
        .engine
        .finish_strict(&rig.store, s, Some(&grant(0)), NOW);
    assert!(matches!(step, Step::Admit(_)));
    assert_eq!(rig.stat(0, RuleStat::DryRunLimited), 1);
}

#[test]
fn after_a_failed_call_strict_requests_skip_the_call_for_retry() {
    let mut rig = Rig::new(&strict_global("allow", r#","retry":"2s""#));
    let u = req(&[("x-user", b"u")]);
    assert!(rig.engine.may_call(NOW));
    let inputs = rig.inputs(&u);
    let s = rig.engine.split(inputs, NOW);
    assert!(matches!(
        rig.engine.finish_strict(&rig.store, s, None, NOW),
        Step::Admit(_)
    ));
    assert!(!rig.engine.may_call(NOW + SEC));
    // Decided without a call: no new failure counted, and retry is not extended.
    let inputs = rig.inputs(&u);
    let s = rig.engine.split(inputs, NOW + SEC);
    assert!(!rig.engine.needs_call(&s, NOW + SEC));
    rig.engine.finish_strict(&rig.store, s, None, NOW + SEC);
    let failures = Stat::Process(ProcessStat::QuotaFailures);
    assert_eq!(rig.engine.stats.pending(failures), 1);
    assert!(rig.engine.may_call(NOW + 2 * SEC));
    // A clock stepped back an hour does not keep calls off for the hour.
    assert!(rig.engine.may_call(NOW - 3_600 * SEC));
}

/// Strict mode with a second global rule `t` keyed by team, with `team` (more of its fields).
fn strict_with_team(failure: &str, team: &str) -> Rig {
    let rules = [
        r#""worker_batch":0},{"name":"t","scope":"global","key":["header:x-team"],"#,
        r#""limit":{"requests":100,"per":"1m"},"burst":40,"worker_batch":0"#,
        team,
        "}]",
    ];
    Rig::new(&strict_global(failure, "").replace(r#""worker_batch":0}]"#, &rules.concat()))
}

/// The answer to a call of `items` items that refuses item `refused` alone (all zeros, listed
/// under `errors`), as the service does for a new key its store has no room for, and grants each
/// other item `granted`.
fn refusing(items: usize, refused: usize, granted: u64) -> LeaseResponse {
    let mut answer = grant(granted);
    answer.items = vec![answer.items[0]; items];
    answer.items[refused] = LeaseGrant::default();
    answer.errors = vec![tollgate_core::global::lease::ItemError {
        item: refused,
        error: format!("items[{refused}]: this credential's share of the store is full (1 keys)"),
    }];
    answer
}

#[test]
fn an_item_the_service_refuses_fails_its_key_alone_and_calls_stay_on() {
    let mut rig = Rig::new(&strict_global("deny", r#","retry":"2s""#));
    let (u, v) = (req(&[("x-user", b"u")]), req(&[("x-user", b"v")]));
    let inputs = rig.inputs(&u);
    let s = rig.engine.split(inputs, NOW);
    assert!(rig.engine.needs_call(&s, NOW));
    let refused = rig
        .engine
        .finish_strict(&rig.store, s, Some(&refusing(1, 0, 0)), NOW);
    let r = refusal_of(refused);
    assert_eq!(
        (r.rule, r.retry_after_secs),
        (0, Some(2)),
        "failure mode deny"
    );
    // Another key's requests still call and are served as answered (before, the refusal took
    // the worker's calls off for `retry`: v was denied without a call).
    assert!(rig.engine.may_call(NOW + MS));
    let inputs = rig.inputs(&v);
    let s = rig.engine.split(inputs, NOW + MS);
    assert!(rig.engine.needs_call(&s, NOW + MS));
    admit(
        rig.engine
            .finish_strict(&rig.store, s, Some(&grant(1)), NOW + MS),
    );
    // u's key is not asked for again for `retry`: denied at once, without a call.
    let inputs = rig.inputs(&u);
    let s = rig.engine.split(inputs, NOW + SEC);
    assert_eq!((s.globals.len(), s.refused.len()), (0, 1));
    assert!(!rig.engine.needs_call(&s, NOW + SEC));
    let r = refusal_of(rig.engine.finish_strict(&rig.store, s, None, NOW + SEC));
    assert_eq!(r.retry_after_secs, Some(2));
    let failures = Stat::Process(ProcessStat::QuotaFailures);
    assert_eq!(rig.engine.stats.pending(failures), 0, "no call failed");
    assert!(rig.engine.may_call(NOW + SEC));
    assert_eq!(rig.stat(0, RuleStat::Fallback), 2);
    assert_eq!(rig.stat(0, RuleStat::Limited), 2);
    assert_eq!(rig.stat(0, RuleStat::Allowed), 1);
    // Once `retry` is over it is asked for again.
    let inputs = rig.inputs(&u);
    let s = rig.engine.split(inputs, NOW + 2 * SEC);
    assert_eq!((s.globals.len(), s.refused.len()), (1, 0));
    // Nothing was granted to give back.
    assert!(given_back(&mut rig, NOW + 2 * SEC).is_empty());
}

#[test]
fn a_refused_item_takes_the_failure_mode_and_the_calls_other_grants_stand() {
    let ut = req(&[("x-user", b"u"), ("x-team", b"t")]);
    // deny: refused by the team rule's failure mode; the user's token goes back.
    let mut rig = strict_with_team("deny", "");
    let inputs = rig.inputs(&ut);
    let s = rig.engine.split(inputs, NOW);
    let user_key = s.globals[0].key;
    let answer = refusing(2, 1, 1);
    let r = refusal_of(rig.engine.finish_strict(&rig.store, s, Some(&answer), NOW));
    assert_eq!((r.rule, r.retry_after_secs), (1, Some(1)));
    assert_eq!(rig.stat(1, RuleStat::Fallback), 1);
    assert_eq!(rig.stat(1, RuleStat::Limited), 1);
    assert_eq!(rig.stat(0, RuleStat::Allowed), 0);
    assert_eq!(rig.stat(0, RuleStat::Limited), 0);
    let items = given_back(&mut rig, NOW + MS);
    assert_eq!(items.len(), 1, "nothing of the refused item");
    assert_eq!((items[0].rule.as_str(), items[0].returned), ("g", 1));
    assert_eq!(items[0].key, format!("{user_key:032x}"));

    // allow: admitted on the user's grant, which it spends; the headers state the user's
    // bucket as answered.
    let mut rig = strict_with_team("allow", "");
    let inputs = rig.inputs(&ut);
    let s = rig.engine.split(inputs, NOW);
    let a = admit(rig.engine.finish_strict(&rig.store, s, Some(&answer), NOW));
    let report = a.report.expect("a report");
    assert_eq!((report.which, report.remaining), (QuotaRef::Rule(0), 7));
    assert_eq!(rig.stat(0, RuleStat::Allowed), 1);
    assert_eq!(rig.stat(1, RuleStat::Fallback), 1);
    assert!(given_back(&mut rig, NOW + MS).is_empty());

    // local: the team's stand-in (40 / 2 instances) decides, the user's grants are spent; the
    // team's key is asked for no more meanwhile, the user's still is.
    let mut rig = strict_with_team("local", "");
    let mut admitted = 0;
    for n in 0..25 {
        let inputs = rig.inputs(&ut);
        let s = rig.engine.split(inputs, NOW);
        let reply = if n == 0 {
            assert_eq!((s.globals.len(), s.refused.len()), (2, 0));
            answer.clone()
        } else {
            assert_eq!((s.globals.len(), s.refused.len()), (1, 1));
            grant(1)
        };
        let step = rig.engine.finish_strict(&rig.store, s, Some(&reply), NOW);
        admitted += usize::from(matches!(step, Step::Admit(_)));
    }
    assert_eq!(admitted, 20);
    assert_eq!(rig.stat(1, RuleStat::Fallback), 25);
    // The 5 requests the stand-in refused give back the user's tokens they were granted.
    let items = given_back(&mut rig, NOW + MS);
    assert_eq!((items[0].rule.as_str(), items[0].returned), ("g", 5));

    // A dry-run rule's refused item refuses nothing, even with deny.
    let mut rig = strict_with_team("deny", r#","dry_run":true"#);
    let inputs = rig.inputs(&ut);
    let s = rig.engine.split(inputs, NOW);
    admit(rig.engine.finish_strict(&rig.store, s, Some(&answer), NOW));
    assert_eq!(rig.stat(1, RuleStat::Fallback), 1);
    assert_eq!(rig.stat(1, RuleStat::Limited), 0);
    assert_eq!(rig.stat(0, RuleStat::Allowed), 1);
    let failures = Stat::Process(ProcessStat::QuotaFailures);
    assert_eq!(rig.engine.stats.pending(failures), 0);
}
