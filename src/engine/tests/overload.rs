//! Overload rules: adaptive limits, the success-rate throttle, priorities and fairness.

use super::*;

impl Rig {
    fn guard(&mut self, r: &Req, now: u64) -> Result<Seats, Refusal> {
        let trusted = self.engine.config().client_ip;
        let mut seats = Seats::new();
        match self
            .engine
            .guard(&self.store, &Request::new(r, trusted), now, &mut seats)
        {
            Some(refusal) => Err(refusal),
            None => Ok(seats),
        }
    }

    fn answer(&mut self, seats: Seats, now: u64, status: u32) {
        self.engine
            .answered(&self.store, seats, now, Some(status), |_| None);
    }
}

const ADAPTIVE: &str = r#"{"rules":[{"name":"api","algorithm":"adaptive"}],
    "priorities":[{"name":"vip","match":{"headers":{"x-tier":"vip"}},"level":3}]}"#;

/// One request per ms for a second, each answered after `rt_ms`.
fn warm(rig: &mut Rig, start: u64, rt_ms: u64) {
    for t in 0..1_000 {
        let at = start + t * MS;
        let seats = rig.guard(&req(&[]), at).expect("admitted");
        rig.answer(seats, at + rt_ms * MS, 200);
    }
}

#[test]
fn an_overloaded_upstream_sheds_the_default_level_first_with_503_and_retry_after() {
    let mut rig = Rig::new(ADAPTIVE);
    // 20 ms answers at 1000/s: 20 in flight.
    warm(&mut rig, NOW, 20);
    // Then slow answers: latency inflated 5×.
    let slow = NOW + 1_000 * MS;
    for t in 0..300 {
        let seats = rig.guard(&req(&[]), slow + t * MS).expect("admitted");
        rig.answer(seats, slow + t * MS + 100 * MS, 200);
    }
    let now = slow + 300 * MS;
    // Default level (1) fills 0.9 of 20 (18, rounded up); the vip level may fill all 20.
    let mut held = Vec::new();
    let mut normal = 0;
    while let Ok(seats) = rig.guard(&req(&[]), now) {
        held.push(seats);
        normal += 1;
    }
    assert_eq!(normal, 18);
    let vip = req(&[("x-tier", b"vip")]);
    let mut high = 0;
    while let Ok(seats) = rig.guard(&vip, now) {
        held.push(seats);
        high += 1;
    }
    assert_eq!(high, 20);
    let refusal = rig.guard(&req(&[]), now).expect_err("shed");
    assert_eq!(refusal.retry_after_secs, Some(1));
    let mut out = HeaderSet::default();
    let response = rig.engine.render_refusal(&mut out, &refusal);
    assert_eq!(response.status, 503);
    assert_eq!(rig.stat(0, RuleStat::Level1Shed), 2);
    assert_eq!(rig.stat(0, RuleStat::Level3Shed), 1);
    assert_eq!(rig.stat(0, RuleStat::InFlight), 38);
    // Seats given up leave room again.
    for seats in held.drain(..) {
        rig.engine.abandon(&rig.store, seats, now);
    }
    assert_eq!(rig.stat(0, RuleStat::InFlight), 0);
    assert!(rig.guard(&req(&[]), now).is_ok());
    // Load gone: one cool-down after the last refusal nothing is refused.
    let later = now + 1_100 * MS;
    for _ in 0..100 {
        let _kept = rig
            .guard(&req(&[]), later)
            .expect("admitted after the cool-down");
    }
}

#[test]
fn failed_answers_free_their_place_without_being_measured() {
    let mut rig = Rig::new(ADAPTIVE);
    warm(&mut rig, NOW, 20);
    let later = NOW + 1_000 * MS;
    assert_eq!(rig.stat(0, RuleStat::Estimate), 20);
    // Fast 503s (a refused connection): not the service time.
    for t in 0..200 {
        let seats = rig.guard(&req(&[]), later + t * MS).expect("admitted");
        rig.answer(seats, later + t * MS + 10_000, 503);
    }
    assert_eq!(rig.stat(0, RuleStat::InFlight), 0);
    let seats = rig.guard(&req(&[]), later + 200 * MS).expect("admitted");
    rig.answer(seats, later + 220 * MS, 200);
    assert_eq!(rig.stat(0, RuleStat::Estimate), 20);
}

#[test]
fn a_dry_run_sheds_nothing_and_counts_what_it_would_shed() {
    let json = ADAPTIVE.replace(
        r#""algorithm":"adaptive""#,
        r#""algorithm":"adaptive","dry_run":true"#,
    );
    let mut rig = Rig::new(&json);
    warm(&mut rig, NOW, 20);
    let slow = NOW + 1_000 * MS;
    for t in 0..300 {
        let seats = rig.guard(&req(&[]), slow + t * MS).expect("admitted");
        rig.answer(seats, slow + t * MS + 100 * MS, 200);
    }
    for _ in 0..30 {
        rig.guard(&req(&[]), slow + 300 * MS)
            .expect("a dry run refuses nothing");
    }
    assert_eq!(rig.stat(0, RuleStat::DryRunLimited), 12);
    assert_eq!(rig.stat(0, RuleStat::InFlight), 30);
}

#[test]
fn the_throttle_refuses_by_the_formula_and_the_lowest_level_first() {
    let mut rig = Rig::new(
        r#"{"rules":[{"name":"flaky","algorithm":"sre_throttle",
            "sre_throttle":{"k":1.5,"window":"10s"}}],
            "priorities":[{"name":"vip","match":{"headers":{"x-tier":"vip"}},"level":2}]}"#,
    );
    // Every answer a 503: soon almost everything is refused.
    let (mut sent, mut refused) = (0, 0);
    for t in 0..2_000 {
        let now = NOW + t * MS;
        sent += 1;
        match rig.guard(&req(&[]), now) {
            Ok(seats) => rig.answer(seats, now, 503),
            Err(r) => {
                refused += 1;
                assert_eq!(r.retry_after_secs, Some(1));
            }
        }
    }
    assert!(refused * 100 > sent * 95, "{refused} of {sent}");
    // 429 and 5xx are failures by default; 404 is an accept.
    let mut rig = Rig::new(r#"{"rules":[{"name":"t","algorithm":"sre_throttle"}]}"#);
    for t in 0..1_000 {
        let seats = rig.guard(&req(&[]), NOW + t * MS).expect("healthy");
        rig.answer(seats, NOW + t * MS, 404);
    }
    assert_eq!(rig.stat(0, RuleStat::Limited), 0);
}

#[test]
fn overload_rules_take_no_limit_and_other_rules_take_no_overload_settings() {
    for (json, message) in [
        (
            r#"{"rules":[{"name":"a","algorithm":"adaptive","limit":{"requests":1,"per":"1s"}}]}"#,
            "rules[0].limit: does not apply to algorithm \"adaptive\"",
        ),
        (
            r#"{"rules":[{"name":"a","algorithm":"adaptive","sre_throttle":{}}]}"#,
            "rules[0].sre_throttle: does not apply to algorithm \"adaptive\"",
        ),
        (
            r#"{"rules":[{"name":"a","limit":{"requests":1,"per":"1s"},"adaptive":{}}]}"#,
            "rules[0].adaptive: only applies to algorithm \"adaptive\"",
        ),
        (r#"{"rules":[{"name":"a"}]}"#, "rules[0].limit: required"),
        (
            r#"{"rules":[{"name":"a","algorithm":"adaptive","adaptive":{"cpu":{"header":"x-cpu","threshold":0}}}]}"#,
            "rules[0].adaptive.cpu.threshold: 0 is not a utilisation above 0",
        ),
        (
            r#"{"rules":[{"name":"a","algorithm":"sre_throttle","sre_throttle":{"failure_statuses":["6xx"]}}]}"#,
            "rules[0].sre_throttle.failure_statuses[0]: \"6xx\" is not a status class",
        ),
        (
            r#"{"rules":[{"name":"a","algorithm":"sre_throttle"}],"priorities":[{"name":"p","level":4}]}"#,
            "priorities[0].level: 4 is not a level (0 to 3)",
        ),
    ] {
        let e = Config::parse(json.as_bytes()).expect_err(json).0;
        assert!(e.starts_with(message), "{e}\nexpected: {message}");
    }
}
