//! Global concurrency: permits leased from the service, renewed, given back and failed.

use super::*;
use tollgate_core::global::permits::{PermitAnswer, PermitResponse};

const RULE: &str = r#"{"rules":[{"name":"c","scope":"global","algorithm":"concurrency",
    "key":["header:x-user"],"limit":{"concurrent":10}}],
  "quota_service":{"upstream":"quota","failure_mode":"FAILURE","first_lease":"wait",
    "instances_hint":2}}"#;

impl Rig {
    fn slot_call(
        &mut self,
        now: u64,
    ) -> Option<(Vec<Refill>, tollgate_core::global::permits::PermitRequest)> {
        self.engine
            .take_refills(&self.store, "me", now)
            .into_iter()
            .find_map(|c| match c {
                Call::Permits(r, request) => Some((r, request)),
                Call::Lease(..) | Call::GiveBack(_) => None,
            })
    }

    fn answer_slots(&mut self, refills: &[Refill], held: u64, now: u64) {
        let answer = PermitResponse {
            items: vec![PermitAnswer {
                held,
                share: 10,
                free: 10 - held,
                ttl_ms: 10_000,
            }],
            errors: Vec::new(),
        };
        self.engine
            .apply_permits(&self.store, refills, Some(&answer), now);
    }
}

#[test]
fn a_key_waits_for_its_first_slots_then_admits_up_to_them_and_renews_on_the_tick() {
    let mut rig = Rig::new(&RULE.replace("FAILURE", "deny"));
    let u = req(&[("x-user", b"u")]);
    assert_eq!(rig.step(&u, NOW), Step::Wait);
    let (refills, call) = rig.slot_call(NOW).expect("a slot call");
    let item = &call.items[0];
    assert_eq!((item.concurrent, item.wanted, item.keep), (10, 2, 0));
    rig.answer_slots(&refills, 3, NOW + MS);
    let mut holds = Vec::new();
    for _ in 0..3 {
        holds.push(admit(rig.step(&u, NOW + 2 * MS)).holds);
    }
    // Full, but the service said more is free within this proxy's share (it gave all that
    // was asked): the request waits, and asks for more with what the key keeps.
    assert_eq!(rig.step(&u, NOW + 3 * MS), Step::Wait);
    let (refills, call) = rig.slot_call(NOW + 4 * MS).expect("more");
    assert_eq!((call.items[0].wanted, call.items[0].keep), (5, 3));
    // Less than asked: the waiting request fits; the next is refused at once, as a local
    // concurrency rule would.
    rig.answer_slots(&refills, 4, NOW + 5 * MS);
    holds.push(admit(rig.step(&u, NOW + 6 * MS)).holds);
    let r = refusal_of(rig.step(&u, NOW + 6 * MS));
    assert_eq!(r.retry_after_secs, Some(1));
    // Requests end: their slots are free here at once.
    for h in holds.drain(..) {
        rig.engine.release(&rig.store, h, NOW + 7 * MS);
    }
    assert_eq!(rig.stat(0, RuleStat::InFlight), 0);
    // Halfway through the term, nothing in use: the key is given back.
    rig.engine.renew_permits(&rig.store, NOW + 5_010 * MS);
    let (refills, call) = rig.slot_call(NOW + 5_010 * MS).expect("renewal");
    assert_eq!((call.items[0].wanted, call.items[0].keep), (0, 0));
    rig.answer_slots(&refills, 0, NOW + 5_011 * MS);
    rig.engine.renew_permits(&rig.store, NOW + 5_200 * MS);
    assert!(
        rig.slot_call(NOW + 5_200 * MS).is_none(),
        "idle: nothing to renew"
    );
    assert_eq!(rig.step(&u, NOW + 5_300 * MS), Step::Wait, "asks again");
}

#[test]
fn a_failed_call_applies_the_failure_mode_once_the_lease_ends() {
    let mut rig = Rig::new(&RULE.replace("FAILURE", "local"));
    let u = req(&[("x-user", b"u")]);
    assert_eq!(rig.step(&u, NOW), Step::Wait);
    let (refills, _) = rig.slot_call(NOW).unwrap();
    rig.engine
        .apply_permits(&rig.store, &refills, None, NOW + MS);
    // No lease: the local stand-in (10 / 2 in flight) decides.
    let admitted: Vec<_> = (0..7)
        .map(|_| rig.step(&u, NOW + 2 * MS))
        .filter(|s| matches!(s, Step::Admit(_)))
        .collect();
    assert_eq!(admitted.len(), 5);
    assert!(rig.stat(0, RuleStat::Fallback) >= 5);
}

#[test]
fn global_concurrency_takes_no_strict_mode_and_no_overrides() {
    for (json, message) in [
        (
            RULE.replace("FAILURE", "deny").replace(
                r#""first_lease":"wait""#,
                r#""first_lease":"wait","mode":"strict""#,
            ),
            "rules[0].scope: global concurrency rules lease slots",
        ),
        (
            RULE.replace("FAILURE", "deny").replace(
                r#""limit":{"concurrent":10}"#,
                r#""limit":{"concurrent":10},"overrides":[{"values":["v"],"unlimited":true}]"#,
            ),
            "rules[0].overrides: not supported on global rules yet",
        ),
    ] {
        let e = Config::parse(json.as_bytes()).expect_err(&json).0;
        assert!(e.starts_with(message), "{e}");
    }
    let nginx = Config::parse(RULE.replace("FAILURE", "allow").as_bytes())
        .unwrap()
        .check_host(&crate::config::HostCaps::NGINX)
        .expect_err("nginx cannot wait")
        .0;
    assert!(nginx.contains("first_lease"), "{nginx}");
}
