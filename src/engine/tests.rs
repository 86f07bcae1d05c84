//! The engine without a proxy: every algorithm path, leases, strict answers and failure modes,
//! over an in-memory store with the strict CAS semantics of nginx-like hosts.

use super::*;
use crate::headers::HeaderSet;
use crate::stats::Stat;
use tollgate_core::lease::{LeaseGrant, LeaseResponse};
use tollgate_core::MemoryStore;

const SEC: u64 = 1_000_000_000;
const MS: u64 = 1_000_000;
const NOW: u64 = 1_700_000_000 * SEC;

/// A request as a fake host shows it.
#[derive(Default, Clone)]
struct Req {
    headers: Vec<(&'static str, Vec<u8>)>,
    peer: &'static str,
}

impl RequestView for Req {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.clone())
    }
    fn source_address(&self) -> Option<Vec<u8>> {
        Some(self.peer.as_bytes().to_vec())
    }
}

fn req(headers: &[(&'static str, &[u8])]) -> Req {
    Req {
        headers: headers.iter().map(|(n, v)| (*n, v.to_vec())).collect(),
        peer: "10.0.0.1:4000",
    }
}

struct Rig {
    engine: Engine,
    store: MemoryStore,
}

impl Rig {
    fn new(json: &str) -> Self {
        let config = Config::parse(json.as_bytes()).unwrap();
        let engine = Engine::new(config, KeyPlacement::new([7; 16]));
        let store = MemoryStore::new();
        engine.initialize(&store).unwrap();
        Self { engine, store }
    }

    fn inputs(&mut self, r: &Req) -> Inputs {
        let trusted = self.engine.config().client_ip;
        let mut inputs = Inputs::new();
        if let Some(b) = self.engine.gather(&Request::new(r, trusted), &mut inputs) {
            panic!("blocked: {b:?}");
        }
        inputs
    }

    fn step(&mut self, r: &Req, now: u64) -> Step {
        let mut inputs = self.inputs(r);
        self.engine.evaluate(&self.store, &mut inputs, now, false)
    }

    fn admitted(&mut self, r: &Req, now: u64, n: usize) -> usize {
        (0..n)
            .filter(|_| matches!(self.step(r, now), Step::Admit(_)))
            .count()
    }

    /// The lease call a tick would send now, if any.
    fn lease_call(
        &mut self,
        now: u64,
    ) -> Option<(Vec<Refill>, tollgate_core::lease::LeaseRequest)> {
        self.engine
            .take_refills(&self.store, "me", now)
            .into_iter()
            .find_map(|c| match c {
                Call::Lease(r, request) => Some((r, request)),
                Call::Slots(..) | Call::GiveBack(_) => None,
            })
    }

    fn stat(&self, rule: usize, stat: RuleStat) -> i64 {
        self.engine.stats.pending(Stat::Rule(rule, stat))
    }
}

fn admit(step: Step) -> Admitted {
    match step {
        Step::Admit(a) => a,
        other => panic!("not admitted: {other:?}"),
    }
}

fn reject(step: Step) -> Rejection {
    match step {
        Step::Reject(r) => r,
        other => panic!("not rejected: {other:?}"),
    }
}

const ONE_RULE: &str = r#"{"rules":[{"name":"r","key":["header:x-user"],"limit":{"requests":1,"per":"1m"},"burst":3,"worker_batch":0}]}"#;

#[test]
fn a_token_bucket_admits_its_burst_then_refuses_with_the_time_to_wait() {
    let mut rig = Rig::new(ONE_RULE);
    let alice = req(&[("x-user", b"alice")]);
    for left in [2, 1, 0] {
        let a = admit(rig.step(&alice, NOW));
        assert_eq!(a.report.map(|r| r.remaining), Some(left));
    }
    let r = reject(rig.step(&alice, NOW));
    assert_eq!((r.rule, r.retry_after_secs), (0, Some(60)));
    // Another key has its own bucket.
    assert_eq!(rig.admitted(&req(&[("x-user", b"bob")]), NOW, 5), 3);
    // Refilled at the rate.
    assert!(matches!(rig.step(&alice, NOW + 60 * SEC), Step::Admit(_)));
    assert_eq!(rig.stat(0, RuleStat::Allowed), 7);
    assert_eq!(rig.stat(0, RuleStat::Limited), 3);

    let mut h = HeaderSet::default();
    let response = rig.engine.render_rejection(&mut h, &r);
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
    assert!(matches!(rig.step(&at(b"/lb"), NOW), Step::Reject(_)));
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
    assert!(matches!(rig.step(&r, NOW), Step::Reject(_)));
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
    assert!(matches!(blocked, Some(Rejection { rule: 0, .. })));
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
    assert!(reject(rest.unwrap()).retry_after_secs.is_some());
    // A request that cannot be held again (its configuration goes away) is decided at once.
    let (_, _, mut waiting, a, mut b) = drain_beside_a_stash(true);
    let now = b.evaluate_at_once(&a.store, &mut waiting, NOW + 3 * MS, true);
    assert!(matches!(now, Step::Reject(_)), "{now:?}");
}

#[test]
fn where_the_host_cannot_hold_a_request_it_is_refused_at_once() {
    // nginx: the bound docs/architecture.md states (at most 20 ms, at the end of a burst).
    let (stashed, step, ..) = drain_beside_a_stash(false);
    assert!(stashed > 0);
    assert!(matches!(step, Step::Reject(_)), "{step:?}");
}

const GLOBAL: &str = r#"{"rules":[{"name":"g","scope":"global","key":["header:x-user"],
    "limit":{"requests":100,"per":"1m"},"burst":40,"worker_batch":0}],
  "quota_service":{"upstream":"quota","failure_mode":"FAILURE","first_lease":"FIRST","instances_hint":2}}"#;

fn global(failure: &str, first: &str) -> Rig {
    Rig::new(&GLOBAL.replace("FAILURE", failure).replace("FIRST", first))
}

fn grant(granted: u64) -> LeaseResponse {
    LeaseResponse {
        items: vec![LeaseGrant {
            granted,
            ttl_ms: 10_000,
            remaining: 7,
            reset_ms: 30_000,
            rate: 0.0,
            retry_ms: 0,
            returned: 0,
        }],
        errors: Vec::new(),
    }
}

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
    let r = reject(rig.step(&u, NOW));
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
    let r = reject(rig.step(&u, NOW + 50 * MS));
    assert_eq!((r.rule, r.retry_after_secs), (0, Some(1)));
    // 10 per second: 12 of 100 requests sent over 1.2 s.
    let admitted = (1..=100)
        .filter(|i| matches!(rig.step(&u, NOW + i * 12 * MS), Step::Admit(_)))
        .count();
    assert_eq!(admitted, 12);
    assert_eq!(rig.stat(0, RuleStat::Limited), 89);
    // It ran dry: the renewal (claimed after an eighth of the lease, since it was capped) asks
    // for the whole rate.
    admit(rig.step(&u, NOW + 1_300 * MS));
    let (_, call) = rig.lease_call(NOW + 1_305 * MS).unwrap();
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
    answer.errors = vec![tollgate_core::lease::ItemError {
        item: 0,
        error: "items[0]: key must be 1 to 128 bytes".into(),
    }];
    let body = serde_json::to_vec(&answer).unwrap();
    let answer = read_answer(Some(b"200"), Some(&body), 2).unwrap();
    rig.engine
        .apply_grants(&rig.store, &refills, Some(&answer), NOW);
    // The refused item's key (u's, claimed first) takes the failure mode (deny); v is served.
    assert_eq!(reject(rig.step(&u, NOW)).retry_after_secs, Some(1));
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
            let r = reject(rig.step(&u, NOW));
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
        let r = reject(timed_out);
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
    reject(
        rig.engine
            .finish_strict(&rig.store, s.clone(), Some(&grant(1)), NOW),
    );
    // A request costing 3 granted 2 (a partial grant) is refused by the global rule: its 2 go
    // back as well.
    let mut costly = s.clone();
    costly.globals[0].cost = 3;
    reject(
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
    assert_eq!(reject(step).rule, 1);
    // From now on the local rule refuses before any call: no global quota is spent on it.
    let step = rig.engine.local_refusal(&rig.store, &s.locals, NOW);
    let r = reject(step.expect("refused before the call"));
    assert_eq!((r.rule, r.retry_after_secs), (1, Some(3600)));
    assert_eq!(rig.stat(1, RuleStat::Limited), 2);
    // Short: refused by the global rule, with the time a token takes (60 s / 100 = 0.6 s → 1).
    let r = reject(
        rig.engine
            .finish_strict(&rig.store, s.clone(), Some(&grant(0)), NOW),
    );
    assert_eq!((r.rule, r.retry_after_secs), (0, Some(1)));
    assert_eq!(r.quota.map(|q| (q.remaining, q.reset_secs)), Some((7, 30)));
    // Failed: deny.
    let r = reject(rig.engine.finish_strict(&rig.store, s, None, NOW));
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
        Some(Rejection {
            rule: 0,
            quota: None,
            retry_after_secs: None
        })
    );
    assert_eq!(rig.stat(0, RuleStat::CostExceeded), 1);
    // A cost the bucket can hold: refused while it refills, with the true wait.
    let two = req(&[("x-cost", b"2")]);
    assert!(matches!(rig.step(&two, NOW), Step::Admit(_)));
    let r = reject(rig.step(&two, NOW));
    assert_eq!(r.retry_after_secs, Some(2));
    assert!(matches!(rig.step(&two, NOW + 2 * SEC), Step::Admit(_)));
    // x-cost: 0 costs the minimum, 1.
    let zero = req(&[("x-cost", b"0")]);
    assert!(matches!(rig.step(&zero, NOW + 3 * SEC), Step::Admit(_)));
    assert!(matches!(rig.step(&zero, NOW + 3 * SEC), Step::Reject(_)));
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

fn key_of_token(token: &str) -> (String, String) {
    let config = GLOBAL.replace(
        r#""upstream":"quota""#,
        &format!(r#""upstream":"quota","token":"{token}""#),
    );
    let mut rig = Rig::new(&config.replace("FAILURE", "deny").replace("FIRST", "wait"));
    let u = req(&[("x-user", b"victim")]);
    assert_eq!(rig.step(&u, NOW), Step::Wait);
    let (refills, call) = rig.lease_call(NOW).unwrap();
    (
        format!("{:032x}", refills[0].key),
        call.items[0].key.clone(),
    )
}

/// The groups of `keys` under a placement secret (`None`: the deployment's, as the rig has it).
fn groups_of(secret: Option<&str>, keys: &[String]) -> Vec<u32> {
    let json = r#"{"rules":[{"name":"r","key":["header:x-user"],"limit":{"requests":5,"per":"1m"},"max_keys":4096}]SECRET}"#;
    let json = json.replace(
        "SECRET",
        &secret.map_or(String::new(), |s| format!(r#","placement_secret":"{s}""#)),
    );
    let mut rig = Rig::new(&json);
    keys.iter()
        .map(|k| {
            let r = Req {
                headers: vec![("x-user", k.as_bytes().to_vec())],
                peer: "10.0.0.1:4000",
            };
            rig.inputs(&r)[0].slot.group
        })
        .collect()
}

#[test]
fn which_keys_share_a_slot_group_depends_on_the_deployments_secret() {
    // Keys an attacker found to share a group under one secret (as they could under the public
    // seed before): under another secret they are spread like any keys.
    let keys: Vec<String> = (0..20_000).map(|i| format!("user-{i}")).collect();
    let under_a = groups_of(Some("deployment-a-placement"), &keys);
    let target = under_a[0];
    let colliding: Vec<String> = keys
        .iter()
        .zip(&under_a)
        .filter(|(_, g)| **g == target)
        .map(|(k, _)| k.clone())
        .collect();
    assert!(
        colliding.len() >= 5,
        "{} keys share group {target}",
        colliding.len()
    );
    assert_eq!(
        groups_of(Some("deployment-a-placement"), &colliding),
        vec![target; colliding.len()]
    );
    for other in [Some("deployment-b-placement"), None] {
        let spread = groups_of(other, &colliding);
        let together = spread.iter().filter(|g| **g == spread[0]).count();
        assert!(
            together <= 2,
            "{together} of {} still together",
            colliding.len()
        );
    }
    let e = Config::parse(br#"{"rules":[{"name":"r","key":["header:x-user"],"limit":{"requests":5,"per":"1m"}}],"placement_secret":"short"}"#).unwrap_err();
    assert!(e.to_string().contains("placement_secret"), "{e}");
}

#[test]
fn key_hashes_sent_to_the_service_are_keyed_by_the_deployments_secret() {
    let key_of = |secret: Option<&str>| {
        let config = match secret {
            Some(s) => GLOBAL.replace(
                r#""upstream":"quota""#,
                &format!(r#""upstream":"quota","key_secret":"{s}""#),
            ),
            None => GLOBAL.to_string(),
        };
        let mut rig = Rig::new(&config.replace("FAILURE", "deny").replace("FIRST", "wait"));
        let u = req(&[("x-user", b"victim")]);
        assert_eq!(rig.step(&u, NOW), Step::Wait);
        let (refills, call) = rig.lease_call(NOW).unwrap();
        (
            format!("{:032x}", refills[0].key),
            call.items[0].key.clone(),
        )
    };
    let (plain, sent) = key_of(None);
    assert_eq!(plain, sent, "no secret and no token: the plain key hash");
    let (_, by_token) = key_of_token("token-of-deployment-a");
    assert_eq!(by_token, key_of_token("token-of-deployment-a").1);
    assert!(
        by_token != plain,
        "a token keys the names when there is no key_secret"
    );
    assert!(by_token != key_of_token("token-of-deployment-b").1);
    let (_, a) = key_of(Some("deployment-a-secret-0123"));
    let (_, a_again) = key_of(Some("deployment-a-secret-0123"));
    let (_, b) = key_of(Some("deployment-b-secret-0123"));
    assert_eq!(a, a_again, "every proxy of a deployment agrees");
    assert!(a != plain && a != b, "{a} {b} {plain}");
    let short = GLOBAL
        .replace(
            r#""upstream":"quota""#,
            r#""upstream":"quota","key_secret":"short""#,
        )
        .replace("FAILURE", "deny")
        .replace("FIRST", "wait");
    let e = crate::config::Config::parse(short.as_bytes()).unwrap_err();
    assert!(e.to_string().contains("quota_service.key_secret"), "{e}");
}

mod overload {
    use super::*;

    impl Rig {
        fn guard(&mut self, r: &Req, now: u64) -> Result<Seats, Rejection> {
            let trusted = self.engine.config().client_ip;
            let mut seats = Seats::new();
            match self
                .engine
                .guard(&self.store, &Request::new(r, trusted), now, &mut seats)
            {
                Some(rejection) => Err(rejection),
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
        let rejection = rig.guard(&req(&[]), now).expect_err("shed");
        assert_eq!(rejection.retry_after_secs, Some(1));
        let mut out = HeaderSet::default();
        let response = rig.engine.render_rejection(&mut out, &rejection);
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
}

mod global_concurrency {
    use super::*;
    use tollgate_core::slot_lease::{SlotAnswer, SlotResponse};

    const RULE: &str = r#"{"rules":[{"name":"c","scope":"global","algorithm":"concurrency",
        "key":["header:x-user"],"limit":{"concurrent":10}}],
      "quota_service":{"upstream":"quota","failure_mode":"FAILURE","first_lease":"wait",
        "instances_hint":2}}"#;

    impl Rig {
        fn slot_call(
            &mut self,
            now: u64,
        ) -> Option<(Vec<Refill>, tollgate_core::slot_lease::SlotRequest)> {
            self.engine
                .take_refills(&self.store, "me", now)
                .into_iter()
                .find_map(|c| match c {
                    Call::Slots(r, request) => Some((r, request)),
                    Call::Lease(..) | Call::GiveBack(_) => None,
                })
        }

        fn answer_slots(&mut self, refills: &[Refill], held: u64, now: u64) {
            let answer = SlotResponse {
                items: vec![SlotAnswer {
                    held,
                    share: 10,
                    free: 10 - held,
                    ttl_ms: 10_000,
                }],
                errors: Vec::new(),
            };
            self.engine
                .apply_slots(&self.store, refills, Some(&answer), now);
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
        let r = reject(rig.step(&u, NOW + 6 * MS));
        assert_eq!(r.retry_after_secs, Some(1));
        // Requests end: their slots are free here at once.
        for h in holds.drain(..) {
            rig.engine.release(&rig.store, h, NOW + 7 * MS);
        }
        assert_eq!(rig.stat(0, RuleStat::InFlight), 0);
        // Halfway through the term, nothing in use: the key is given back.
        rig.engine.renew_slots(&rig.store, NOW + 5_010 * MS);
        let (refills, call) = rig.slot_call(NOW + 5_010 * MS).expect("renewal");
        assert_eq!((call.items[0].wanted, call.items[0].keep), (0, 0));
        rig.answer_slots(&refills, 0, NOW + 5_011 * MS);
        rig.engine.renew_slots(&rig.store, NOW + 5_200 * MS);
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
        rig.engine.apply_slots(&rig.store, &refills, None, NOW + MS);
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
    reject(rig.step(&victim, NOW + 4 * MS));
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

fn from_peer(peer: &'static str) -> Req {
    Req {
        headers: Vec::new(),
        peer,
    }
}

#[test]
fn an_ipv6_client_is_limited_by_its_64_whatever_address_it_uses() {
    let mut rig = Rig::new(
        r#"{"rules":[{"name":"ip","key":["client_ip"],"limit":{"requests":3,"per":"1h"}}]}"#,
    );
    // Three addresses of one /64: one bucket of 3.
    let admitted = [
        "[2001:db8:1:2::1]:5",
        "[2001:db8:1:2::2]:5",
        "[2001:db8:1:2:ffff::9]:5",
    ]
    .iter()
    .map(|p| rig.admitted(&from_peer(p), NOW, 2))
    .sum::<usize>();
    assert_eq!(admitted, 3);
    // Another /64 has its own.
    assert_eq!(rig.admitted(&from_peer("[2001:db8:1:3::1]:5"), NOW, 5), 3);
    // With ipv6_prefix 128 every address is a key.
    let mut rig = Rig::new(
        r#"{"rules":[{"name":"ip","key":["client_ip"],"limit":{"requests":3,"per":"1h"}}],
            "client_ip":{"ipv6_prefix":128,"ipv4_prefix":24}}"#,
    );
    assert_eq!(rig.admitted(&from_peer("[2001:db8:1:2::1]:5"), NOW, 5), 3);
    assert_eq!(rig.admitted(&from_peer("[2001:db8:1:2::2]:5"), NOW, 5), 3);
    // IPv4 clients by their /24.
    assert_eq!(rig.admitted(&from_peer("10.1.2.3:5"), NOW, 2), 2);
    assert_eq!(rig.admitted(&from_peer("10.1.2.4:5"), NOW, 5), 1);
    for (field, bad) in [
        ("ipv6_prefix", "0"),
        ("ipv6_prefix", "129"),
        ("ipv4_prefix", "33"),
    ] {
        let json = format!(
            r#"{{"rules":[{{"name":"ip","key":["client_ip"],"limit":{{"requests":3,"per":"1h"}}}}],
                "client_ip":{{"{field}":{bad}}}}}"#
        );
        let e = Config::parse(json.as_bytes()).unwrap_err().to_string();
        assert!(e.contains(&format!("client_ip.{field}")), "{e}");
    }
}

#[test]
fn cidr_overrides_allow_block_and_limit_whole_ranges() {
    let mut rig = Rig::new(
        r#"{"rules":[{"name":"ip","key":["client_ip"],"limit":{"requests":1,"per":"1h"},
            "overrides":[{"values":["10.0.0.0/8"],"unlimited":true},
                         {"values":["192.0.2.0/24"],"block":true},
                         {"values":["2001:db8::/32"],"limit":{"requests":5,"per":"1h"}},
                         {"values":["198.51.100.7"],"limit":{"requests":2,"per":"1h"}}]}]}"#,
    );
    assert_eq!(rig.admitted(&from_peer("10.200.3.4:1"), NOW, 20), 20);
    assert_eq!(rig.admitted(&from_peer("11.0.0.1:1"), NOW, 20), 1);
    let trusted = rig.engine.config().client_ip;
    let blocked = rig.engine.gather(
        &Request::new(&from_peer("192.0.2.99:1"), trusted),
        &mut Inputs::new(),
    );
    assert!(blocked.is_some(), "inside the blocked range");
    // The range's own limit is per key inside it (each /64 its own 5), like any override.
    assert_eq!(rig.admitted(&from_peer("[2001:db8:7::1]:1"), NOW, 20), 5);
    assert_eq!(rig.admitted(&from_peer("[2001:db8:8::1]:1"), NOW, 20), 5);
    assert_eq!(rig.admitted(&from_peer("[2001:db9::1]:1"), NOW, 20), 1);
    assert_eq!(rig.admitted(&from_peer("198.51.100.7:1"), NOW, 20), 2);
    // A range narrower than the keys' networks could never match: refused at load.
    let e = Config::parse(
        br#"{"rules":[{"name":"ip","key":["client_ip"],"limit":{"requests":1,"per":"1h"},
            "overrides":[{"values":["2001:db8::/96"],"unlimited":true}]}]}"#,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("rules[0].overrides[0].values[0]") && e.contains("ipv6_prefix"),
        "{e}"
    );
    let e = Config::parse(
        br#"{"rules":[{"name":"ip","key":["client_ip"],"limit":{"requests":1,"per":"1h"},
            "overrides":[{"values":["10.0.0.0/33"],"unlimited":true}]}]}"#,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("CIDR"), "{e}");
}
