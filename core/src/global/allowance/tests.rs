//! Claims, grants, accrual, renewals and clock steps of a key's allowance.

use super::*;
use crate::state::STATE_BYTES;

const MS: u64 = 1_000_000;
const T0: u64 = 1_700_000_000_000; // ms

fn lease() -> LeaseAllowance {
    LeaseAllowance {
        lease_size: 10,
        low_water: 5,
        claim_ms: 200,
        global_burst: 0,
        global_interval_ns: 0,
        global_rate_mtps: 100_000,
        calendar: false,
    }
}

fn grant(tokens: u64, rate_mtps: u64, at: u64, ttl_ms: u64) -> Grant {
    Grant {
        tokens,
        rate_mtps,
        ttl_ms,
        sent_ms: at,
        retry_ms: 300,
        asked: Ask {
            wanted: 10,
            ..Ask::default()
        },
        ..Grant::default()
    }
}

fn allowed(l: &LeaseAllowance, s: &State, at_ms: u64) -> State {
    match l.decide(s, at_ms * MS, 1) {
        Decision::Admit { state, .. } => state,
        d => panic!("at {at_ms}: {d:?}"),
    }
}

#[test]
fn a_clock_stepped_back_claims_a_refill_at_once_instead_of_waiting_for_the_clock() {
    let l = lease();
    let mut s = l.grant(&[0; 32], T0, &grant(2, 0, T0, 10_000));
    s = allowed(&l, &s, T0 + 1);
    s = allowed(&l, &s, T0 + 2);
    // Below the low-water mark the first spend claimed the refill (its mark: T0 + 201);
    // empty, a request waits for it...
    assert_eq!(
        l.decide(&s, (T0 + 3) * MS, 1),
        Decision::Wait { claim: None }
    );
    let claimed = s;
    // ... and the clock steps back an hour before the answer comes (the call failed).
    let back = T0 - 3_600_000;
    match l.decide(&claimed, back * MS, 1) {
        // Before: Wait { claim: None } for an hour, every request timing out.
        Decision::Wait { claim: Some(again) } => {
            assert!(l.claimed(&claimed, &again));
            assert_eq!(parts(&again).base, back);
        }
        d => panic!("{d:?}"),
    }
}

#[test]
fn a_new_key_claims_a_refill_then_waits_then_spends_its_grant() {
    let l = lease();
    let fresh = [0; STATE_BYTES];
    let Decision::Wait {
        claim: Some(claimed),
    } = l.decide(&fresh, T0 * MS, 1)
    else {
        panic!("a new key waits and claims");
    };
    assert!(l.claimed(&fresh, &claimed));
    // Others wait without claiming again.
    assert_eq!(
        l.decide(&claimed, T0 * MS, 1),
        Decision::Wait { claim: None }
    );
    assert_eq!(l.ask(&claimed, T0).wanted, 10);
    let granted = l.grant(&claimed, T0, &grant(10, 0, T0, 1_000));
    let mut s = granted;
    for i in 0..10u64 {
        match l.decide(&s, (T0 + 1) * MS, 1) {
            Decision::Admit {
                state, remaining, ..
            } => {
                assert_eq!(remaining, 9 - i);
                // Below the low-water mark (5 left) the spender claims the next refill, once.
                assert_eq!(l.claimed(&s, &state), i == 5, "at {i}");
                s = state;
            }
            d => panic!("{d:?}"),
        }
    }
    // Empty with a refill in flight: wait.
    assert_eq!(
        l.decide(&s, (T0 + 1) * MS, 1),
        Decision::Wait { claim: None }
    );
    // It ran dry: the refill asks for the whole rate.
    let ask = l.ask(&s, T0 + 2);
    assert_eq!((ask.wanted, ask.used, ask.demand_mtps), (10, 10, 100_000));
}

#[test]
fn a_rate_lease_accrues_and_refuses_at_once_when_spent() {
    let l = lease();
    // 2 tokens outright and 10 per second (10 000 mtps) for 1 s from T0, capped by fairness
    // (it asked for 30).
    let mut g = grant(2, 10_000, T0, 1_000);
    g.asked.demand_mtps = 30_000;
    let mut s = l.grant(&[0; STATE_BYTES], T0, &g);
    s = allowed(&l, &s, T0);
    s = allowed(&l, &s, T0);
    // Spent: refused at once, told when the next token has accrued (at 100 ms).
    assert_eq!(
        l.decide(&s, (T0 + 50) * MS, 1),
        Decision::Refuse {
            retry_after_ns: 50 * MS,
            remaining: 0,
            reset_ns: 50 * MS
        }
    );
    s = allowed(&l, &s, T0 + 100);
    assert!(matches!(
        l.decide(&s, (T0 + 150) * MS, 1),
        Decision::Refuse { .. }
    ));
}

#[test]
fn leases_renew_in_their_last_quarter_or_every_sixteenth_when_capped() {
    let l = lease();
    // As asked, with 10 tokens in hand, spending what accrues: no claim before 750 ms.
    let mut g = grant(10, 10_000, T0, 1_000);
    g.asked.demand_mtps = 10_000;
    let mut s = l.grant(&[0; STATE_BYTES], T0, &g);
    for t in (100..=700).step_by(100) {
        let next = allowed(&l, &s, T0 + t);
        assert!(!l.claimed(&s, &next), "at {t}");
        s = next;
    }
    let renewed = allowed(&l, &s, T0 + 750);
    assert!(l.claimed(&s, &renewed));
    // The accrual stops at the claim: what is held at 750 is all there is until the answer.
    assert_eq!(l.allowance(&renewed, T0 + 750), 9);
    assert_eq!(l.allowance(&renewed, T0 + 900), 9);
    // The new lease (20 per second) accrues from the answer; the old one ends.
    let next = l.grant(&renewed, T0 + 760, &grant(0, 20_000, T0 + 750, 1_000));
    assert_eq!(l.allowance(&next, T0 + 760), 9);
    assert_eq!(l.allowance(&next, T0 + 810), 10);
    assert!(!LeaseAllowance::is_idle(&next, T0 + 1_749));
    assert!(LeaseAllowance::is_idle(&next, T0 + 1_750));

    // Capped by fairness: renewed every sixteenth of the lease (62 ms), so that shares follow
    // demand soon (a newcomer waits for its share that long at most).
    let mut g = grant(10, 10_000, T0, 1_000);
    g.asked.demand_mtps = 30_000;
    let s = l.grant(&[0; STATE_BYTES], T0, &g);
    let next = allowed(&l, &s, T0 + 50);
    assert!(!l.claimed(&s, &next));
    assert!(l.claimed(&next, &allowed(&l, &next, T0 + 62)));
}

#[test]
fn running_low_asks_again_only_when_asking_can_get_more() {
    let l = lease();
    // Capped (asked 50, got 10 per second): running low is no reason to ask before the
    // sixteenth.
    let mut g = grant(1, 10_000, T0, 1_000);
    g.asked.demand_mtps = 50_000;
    let s = l.grant(&[0; STATE_BYTES], T0, &g);
    let next = allowed(&l, &s, T0 + 50);
    assert!(!l.claimed(&s, &next));
    // Not capped, with the global bucket empty by the last answer: running low is no reason
    // either (its rate is asked again at its renewal); with nothing left it asks for more
    // rather than refuse (the service may well have it).
    let mut g = grant(0, 10_000, T0, 1_000);
    g.asked.demand_mtps = 10_000;
    let s = l.grant(&[0; STATE_BYTES], T0, &g);
    let next = allowed(&l, &s, T0 + 100);
    assert!(!l.claimed(&s, &next));
    let Decision::Wait { claim: Some(next) } = l.decide(&next, (T0 + 150) * MS, 1) else {
        panic!("dry: a claim");
    };
    assert_eq!(
        l.decide(&next, (T0 + 151) * MS, 1),
        Decision::Wait { claim: None }
    );
    // The same with tokens left in the global bucket: running low asks for them.
    g.remaining = 10;
    let s = l.grant(&[0; STATE_BYTES], T0, &g);
    let next = allowed(&l, &s, T0 + 100);
    assert!(l.claimed(&s, &next));
    // Refused for want of quota (a global bucket of 1 a second, empty by the answer): the
    // next ask wants the whole rate (not once that answer's lease has ended: tokens only), and
    // while it is on its way, before a token can be back in the bucket, requests are refused
    // rather than held (only the claim is sent).
    let slow = LeaseAllowance {
        global_interval_ns: 1_000 * MS,
        ..lease()
    };
    let none = slow.grant(&[0; STATE_BYTES], T0, &grant(0, 0, T0, 1_000));
    assert_eq!(slow.ask(&none, T0 + 200).demand_mtps, 100_000);
    let Decision::Wait { claim: Some(later) } = slow.decide(&none, (T0 + 5_000) * MS, 1) else {
        panic!("the lease ended: a claim");
    };
    assert_eq!(slow.ask(&later, T0 + 5_000).demand_mtps, 0);
    let Decision::Wait {
        claim: Some(claimed),
    } = slow.decide(&none, (T0 + 200) * MS, 1)
    else {
        panic!("the mark expired: a claim");
    };
    assert!(matches!(
        slow.decide(&claimed, (T0 + 201) * MS, 1),
        Decision::Refuse { .. }
    ));
    // Once a token can be back by the last answer (a second after it), the requests wait for
    // the answer on its way, as for a first lease: a client that came back when told is not
    // refused for the call's time.
    let Decision::Wait {
        claim: Some(claimed),
    } = slow.decide(&none, (T0 + 1_000) * MS, 1)
    else {
        panic!("a claim");
    };
    assert_eq!(
        slow.decide(&claimed, (T0 + 1_001) * MS, 1),
        Decision::Wait { claim: None }
    );
}

/// A proxy that sees a key rarely (issue 36: uniform keys over 100 proxies were refused falsely
/// 58% of the time): its lease of one token, spent by one request just after the grant, is no
/// evidence of a rate, so the refill that request claims asks for tokens only — not for the key's
/// whole rate, which the service would reserve to it for a lease term. A request that has to wait
/// is: two requests 8 ms apart.
#[test]
fn one_request_just_after_a_grant_asks_for_no_rate_and_one_that_waits_does() {
    // The last token claims the refill (running low).
    let eager = LeaseAllowance {
        lease_size: 1,
        low_water: 1,
        ..lease()
    };
    let one = eager.grant(&[0; STATE_BYTES], T0, &grant(1, 0, T0, 10_000));
    let spent = allowed(&eager, &one, T0 + 2);
    assert!(eager.claimed(&one, &spent));
    let ask = eager.ask(&spent, T0 + 3);
    assert_eq!((ask.wanted, ask.used, ask.demand_mtps), (1, 1, 0));
    // Topped up with a token, the next lease carries over no rate either.
    let again = eager.grant(&spent, T0 + 5, &grant(1, 0, T0 + 3, 10_000));
    assert_eq!(eager.ask(&again, T0 + 6).demand_mtps, 0);

    // The next request claims it (none claimed before): it waits, and counts.
    let lazy = LeaseAllowance {
        low_water: 0,
        ..eager
    };
    let spent = allowed(&lazy, &one, T0 + 2);
    assert!(!lazy.claimed(&one, &spent));
    let Decision::Wait {
        claim: Some(waiting),
    } = lazy.decide(&spent, (T0 + 10) * MS, 1)
    else {
        panic!("the second request claims a refill and waits for it");
    };
    let ask = lazy.ask(&waiting, T0 + 10);
    assert_eq!((ask.wanted, ask.used, ask.demand_mtps), (1, 1, 100_000));
}

#[test]
fn a_lease_that_did_not_run_dry_asks_for_what_it_spent_and_an_eighth_more() {
    let l = lease();
    let s = l.grant(&[0; STATE_BYTES], T0, &grant(10, 0, T0, 1_000));
    let mut s = allowed(&l, &s, T0 + 100);
    for t in [200, 300, 400, 500, 600, 700, 750] {
        s = allowed(&l, &s, T0 + t);
    }
    // 8 tokens in 760 ms, an eighth more: 11.8 per second.
    let ask = l.ask(&s, T0 + 760);
    assert_eq!((ask.wanted, ask.used, ask.demand_mtps), (8, 8, 11_842));
}

#[test]
fn exhausted_refuses_failed_falls_back_and_leases_expire() {
    let l = lease();
    let none = l.grant(&[0; STATE_BYTES], T0, &grant(0, 0, T0, 1_000));
    assert!(
        matches!(
            l.decide(&none, T0 * MS, 1),
            Decision::Refuse { retry_after_ns, .. } if retry_after_ns == 62 * MS
        ),
        "the service's hint (300 ms), within a sixteenth of a lease"
    );
    let failed = l.fail(&[0; STATE_BYTES], T0, 1_000);
    assert_eq!(
        l.decide(&failed, (T0 + 249) * MS, 1),
        Decision::Fallback { claim: None }
    );
    // After the mark (a quarter of `retry` after a first failure), a new claim; the failure
    // mode still decides until its answer.
    let Decision::Fallback {
        claim: Some(retrying),
    } = l.decide(&failed, (T0 + 1_000) * MS, 1)
    else {
        panic!("the retry is claimed");
    };
    assert!(l.claimed(&failed, &retrying));
    assert_eq!(
        l.decide(&retrying, (T0 + 1_001) * MS, 1),
        Decision::Fallback { claim: None }
    );
    // An answer ends it.
    let answered = l.grant(&retrying, T0 + 1_002, &grant(5, 0, T0 + 1_000, 1_000));
    assert!(matches!(
        l.decide(&answered, (T0 + 1_003) * MS, 1),
        Decision::Admit { .. }
    ));
    // Tokens held survive a failure until their lease ends, accrual included up to the
    // failure (here no claim was made).
    let held = l.fail(
        &l.grant(&[0; STATE_BYTES], T0, &grant(1, 10_000, T0, 500)),
        T0 + 200,
        1_000,
    );
    assert_eq!(l.allowance(&held, T0 + 200), 3);
    assert_eq!(l.allowance(&held, T0 + 400), 3, "no more accrual");
    // (Its next call still says the share it ran at, for a service that lost it.)
    let ask = l.ask(&held, T0 + 300);
    assert_eq!((ask.share_mtps, ask.share_ms), (10_000, 200));
    assert!(matches!(
        l.decide(&held, (T0 + 200) * MS, 1),
        Decision::Admit { .. }
    ));
    // Its lease over, and past the retry: the failure mode, and a new call.
    assert!(matches!(
        l.decide(&held, (T0 + 500) * MS, 1),
        Decision::Fallback { claim: Some(_) }
    ));
    // Idle once its lease ended and its retry passed.
    assert!(!LeaseAllowance::is_idle(&held, T0 + 499));
    assert!(LeaseAllowance::is_idle(&held, T0 + 500));
}

#[test]
fn a_capped_lease_whose_bucket_has_tokens_asks_again_instead_of_refusing() {
    let l = lease();
    // Asked for the whole rate (a burst from one client) and got it with 5 tokens; the
    // global bucket still holds 60.
    let mut g = grant(5, 100_000, T0, 10_000);
    g.asked.demand_mtps = 100_000;
    g.remaining = 60;
    let mut s = l.grant(&[0; STATE_BYTES], T0, &g);
    let mut claims = 0;
    for _ in 0..5 {
        let next = allowed(&l, &s, T0);
        claims += usize::from(l.claimed(&s, &next));
        s = next;
    }
    assert_eq!(claims, 1, "running low claims a refill once");
    // Dry with the refill out: the request waits for it, it is not refused.
    assert_eq!(l.decide(&s, T0 * MS, 1), Decision::Wait { claim: None });
    // The same lease with the global bucket empty: refused at once.
    g.remaining = 0;
    let mut s = l.grant(&[0; STATE_BYTES], T0, &g);
    for _ in 0..5 {
        s = allowed(&l, &s, T0);
    }
    assert!(matches!(l.decide(&s, T0 * MS, 1), Decision::Refuse { .. }));
}

#[test]
fn a_low_rate_renewed_every_eighth_of_its_term_accrues_whole_tokens() {
    let l = lease();
    // A share of 0.05 per second (one token per 20 s), capped by fairness: renewed every
    // eighth of a 10 s lease, 0.0625 tokens accrued each time. Over 60 s: 3 tokens.
    let rated = |at: u64| {
        let mut g = grant(0, 50, at, 10_000);
        g.asked.demand_mtps = 100;
        g
    };
    let mut s = l.grant(&[0; STATE_BYTES], T0, &rated(T0));
    let mut admitted = 0;
    let mut t = T0;
    while t < T0 + 60_000 {
        t += 250;
        if let Decision::Admit { state, .. } = l.decide(&s, t * MS, 1) {
            admitted += 1;
            s = state;
        }
        // Renewed (and answered at once) every 1.25 s.
        let p = parts(&s);
        if t >= p.base + 1_250 {
            s = l.grant(&s, t, &rated(t));
        }
    }
    assert_eq!(admitted, 3);
}

#[test]
fn a_failure_is_not_a_denial() {
    let l = lease();
    let denied = l.grant(&[0; STATE_BYTES], T0, &grant(0, 0, T0, 1_000));
    let failed = l.fail(&denied, T0 + 100, 200);
    // The first failure retries after a quarter of `retry` (50 ms).
    assert_eq!(
        l.decide(&failed, (T0 + 140) * MS, 1),
        Decision::Fallback { claim: None }
    );
    // The retry is out: still the failure mode, not the refusal of the earlier answer.
    let Decision::Fallback {
        claim: Some(retrying),
    } = l.decide(&failed, (T0 + 150) * MS, 1)
    else {
        panic!("a retry");
    };
    assert_eq!(
        l.decide(&retrying, (T0 + 151) * MS, 1),
        Decision::Fallback { claim: None }
    );
    // The retry failed too: from now on, a whole `retry` between calls.
    let again = l.fail(&retrying, T0 + 160, 200);
    assert_eq!(
        l.decide(&again, (T0 + 359) * MS, 1),
        Decision::Fallback { claim: None }
    );
    assert!(matches!(
        l.decide(&again, (T0 + 360) * MS, 1),
        Decision::Fallback { claim: Some(_) }
    ));
}

#[test]
fn calls_carry_what_the_proxy_last_heard_of_the_bucket_while_it_matters() {
    // Burst 100 at 1 per 36 s (100 per hour).
    let l = LeaseAllowance {
        global_burst: 100,
        global_interval_ns: 36_000 * MS,
        global_rate_mtps: 27,
        calendar: false,
        ..lease()
    };
    let fresh = [0; STATE_BYTES];
    assert_eq!(l.ask(&fresh, T0).known_ms, 0, "never answered: no evidence");
    let mut g = grant(10, 0, T0, 10_000);
    g.remaining = 90;
    let s = l.grant(&fresh, T0 + 5, &g);
    let ask = l.ask(&s, T0 + 1_005);
    // 1 s since the answer, plus the call's own time (claim_ms).
    assert_eq!((ask.known_ms, ask.known_remaining), (1_200, 90));
    // The lease ends after 10 s; the bucket is full again by 10 × 36 s after the answer.
    let later = T0 + 5 + 359_000;
    let Decision::Wait {
        claim: Some(claimed),
    } = l.decide(&s, later * MS, 1)
    else {
        panic!("a new claim");
    };
    let ask = l.ask(&claimed, later);
    assert_eq!((ask.known_ms, ask.known_remaining), (359_200, 90));
    assert_eq!(l.ask(&claimed, T0 + 5 + 360_000).known_ms, 0);
}

#[test]
fn refunds_give_back_what_was_spent() {
    let l = lease();
    let s = l.grant(&[0; STATE_BYTES], T0, &grant(3, 0, T0, 1_000));
    let spent = allowed(&l, &s, T0);
    assert_eq!(l.allowance(&LeaseAllowance::refund(&spent, 1), T0), 3);
    assert_eq!(l.allowance(&LeaseAllowance::refund(&s, 2), T0), 5);
}

#[test]
fn an_excess_settled_beyond_the_lease_is_owed_and_charged_to_the_global_bucket_at_once() {
    let l = lease();
    let s = l.grant(&[0; 32], T0, &grant(10, 0, T0, 10_000));
    // A request reserved 4 and used 20: 16 beyond, 10 of them past what the lease held.
    let s = match l.decide(&s, (T0 + 1) * MS, 4) {
        Decision::Admit { state, .. } => state,
        d => panic!("{d:?}"),
    };
    let settled = l.settle(&s, T0 + 1, 4, 20);
    assert_eq!(LeaseAllowance::debt(&settled, T0 + 1), 10);
    // The settlement claims a call at once (the next tick sends it), whatever the lease's term.
    assert!(l.claimed(&s, &settled));
    assert_eq!(l.allowance(&settled, T0 + 2), 0);
    assert_eq!(
        l.decide(&settled, (T0 + 2) * MS, 1),
        Decision::Wait { claim: None }
    );
    // The call says what is owed; the lease tops up as usual.
    let ask = l.ask(&settled, T0 + 3);
    assert_eq!((ask.owed, ask.held, ask.wanted), (10, 0, 10));
    // The service charged it (its bucket now owes 40, say): it is no longer owed here, and the
    // next requests are refused until the global bucket has their tokens again, by its rate
    // (one token per 10 ms here).
    let l = LeaseAllowance {
        global_burst: 100,
        global_interval_ns: 10 * MS,
        ..l
    };
    let mut g = grant(0, 0, T0 + 3, 10_000);
    g.asked = ask;
    g.debt = 40;
    let s = l.grant(&settled, T0 + 4, &g);
    assert_eq!(LeaseAllowance::debt(&s, T0 + 4), 0);
    match l.decide(&s, (T0 + 5) * MS, 2) {
        // 40 owed and 2 more: 420 ms after the answer.
        Decision::Refuse { retry_after_ns, .. } => assert_eq!(retry_after_ns, 419 * MS),
        d => panic!("{d:?}"),
    }
    // Its next call carries what it knows of that debt.
    let ask = l.ask(&s, T0 + 100);
    assert_eq!((ask.known_remaining, ask.known_debt), (0, 40));
    // A debt outlives its lease: an expired lease's tokens are lost, never what it owed, which
    // its next call reports.
    let s = l.grant(&[0; 32], T0, &grant(10, 0, T0, 1_000));
    let s = l.settle(&s, T0 + 7, 0, 25);
    let later = T0 + 20_000;
    let Decision::Wait { claim: Some(c) } = l.decide(&s, later * MS, 1) else {
        panic!("a claim");
    };
    assert_eq!(l.ask(&c, later).owed, 15);
    // A settlement while a call is out leaves it claimed: an answer that grants nothing claims
    // again for the rest (one that grants tokens pays for it with them).
    let out = l.settle(&c, later + 1, 0, 5);
    assert!(!l.claimed(&c, &out));
    let mut g = grant(0, 0, later, 10_000);
    g.asked = l.ask(&c, later);
    let answered = l.grant(&out, later + 2, &g);
    assert!(l.claimed(&out, &answered));
    assert_eq!(l.ask(&answered, later + 3).owed, 5);
    g.tokens = 10;
    assert_eq!(l.allowance(&l.grant(&out, later + 2, &g), later + 3), 5);
    // A refund goes back to the allowance.
    let s = l.grant(&[0; 32], T0, &grant(10, 0, T0, 10_000));
    let s = l.settle(&s, T0 + 1, 5, 1);
    assert_eq!(l.allowance(&s, T0 + 2), 14);
}

#[test]
fn any_charge_is_a_defined_debt_and_rate_leases_give_back_their_surplus() {
    let l = lease();
    let s = l.grant(&[0; 32], T0, &grant(10, 0, T0, 10_000));
    // Beyond what 48 bits of 64ths hold (2.2 × 10¹² tokens) the debt saturates: never wraps.
    for actual in [2_000_000_000, 5_000_000_000, 1u64 << 60, u64::MAX] {
        let owed = l.ask(&l.settle(&s, T0 + 1, 0, actual), T0 + 2).owed;
        assert_eq!(owed, (actual - 10).min((1 << 47) / 64), "{actual}");
    }
    // A rate lease that accrues beyond its lease size and a half renews, giving back the rest.
    let mut g = grant(0, 100_000, T0, 10_000);
    g.asked.demand_mtps = 100_000;
    let s = l.grant(&[0; STATE_BYTES], T0, &g);
    // 15 tokens accrued by 150 ms, then one spent: 14 left, not yet beyond 15.
    let s1 = allowed(&l, &s, T0 + 150);
    assert!(!l.claimed(&s, &s1));
    let s2 = allowed(&l, &s1, T0 + 180);
    assert!(l.claimed(&s1, &s2), "16 left");
    let ask = l.ask(&s2, T0 + 190);
    assert_eq!((ask.held, ask.returned), (17, 7));
    let mut g = grant(0, 100_000, T0 + 190, 10_000);
    g.asked = ask;
    g.returned = 7;
    let s3 = l.grant(&s2, T0 + 191, &g);
    assert_eq!(l.allowance(&s3, T0 + 191), 10);
    // A service that does not take them back (restarted, or a replica that never granted them):
    // let go all the same, so the next request finds no surplus and asks nothing.
    g.returned = 0;
    let s3 = l.grant(&s2, T0 + 191, &g);
    assert_eq!(l.allowance(&s3, T0 + 191), 10);
    let s4 = allowed(&l, &s3, T0 + 195);
    assert!(!l.claimed(&s3, &s4), "asked again for a surplus it let go");
}

#[test]
fn a_calendar_quota_says_its_periods_end_and_asks_again_within_a_second_when_exhausted() {
    let l = LeaseAllowance {
        calendar: true,
        global_rate_mtps: 0,
        global_burst: 10,
        global_interval_ns: 31 * 86_400_000 * MS / 10,
        ..lease()
    };
    // 3 days before the period ends: 4 tokens, 6 left in the bucket, the lease until its end.
    let left_ms = 3 * 86_400_000;
    let g = Grant {
        remaining: 6,
        ..grant(4, 0, T0, left_ms)
    };
    let s = l.grant(&[0; 32], T0, &g);
    match l.decide(&s, (T0 + 1_000) * MS, 1) {
        // The headers' reset: the period's end, not a refill of the 6 missing.
        Decision::Admit {
            remaining,
            reset_ns,
            ..
        } => {
            assert_eq!((remaining, reset_ns), (3 + 6, (left_ms - 1_000) * MS));
        }
        d => panic!("{d:?}"),
    }
    // The bucket had nothing more: refused until the period ends (not a token's refill
    // time), asking the service again a second later at most.
    let none = Grant {
        retry_ms: left_ms,
        asked: Ask {
            wanted: 10,
            ..Ask::default()
        },
        ..grant(0, 0, T0, left_ms)
    };
    let s = l.grant(&[0; 32], T0, &none);
    match l.decide(&s, (T0 + 10) * MS, 1) {
        Decision::Refuse {
            retry_after_ns,
            reset_ns,
            ..
        } => {
            assert_eq!(retry_after_ns, (left_ms - 10) * MS);
            assert_eq!(reset_ns, retry_after_ns);
        }
        d => panic!("{d:?}"),
    }
    // A second on, a request claims a refill: tokens may have been given back, or the bucket
    // reset by an operator.
    assert!(matches!(
        l.decide(&s, (T0 + 1_000) * MS, 1),
        Decision::Wait { claim: Some(_) }
    ));
}
