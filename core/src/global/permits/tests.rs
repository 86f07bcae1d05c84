//! Holdings and allowances: fair shares, terms, restarts, failures and clock steps.

use super::allowance::Parts;
use super::*;
use crate::state::{Decision, State};
use proptest::prelude::*;

const TTL: u64 = 10_000;

fn ask(wanted: u64, keep: u64) -> PermitAsk {
    PermitAsk {
        limit: 10,
        wanted,
        keep,
        known_held: 0,
    }
}

#[test]
fn a_lone_instance_gets_what_it_wants_up_to_the_limit() {
    let mut h = Holdings::default();
    assert_eq!(h.grant("a", &ask(4, 0), 0, TTL, true).held, 4);
    assert_eq!(h.grant("a", &ask(30, 4), 100, TTL, true).held, 10);
    assert_eq!(h.total(), 10);
}

#[test]
fn a_newcomer_gets_what_is_free_and_the_holder_lets_go_to_its_share() {
    let mut h = Holdings::default();
    h.grant("a", &ask(10, 0), 0, TTL, true);
    // b wants 10 too: nothing is free; both are told their share of 5.
    let b = h.grant("b", &ask(10, 0), 10, TTL, true);
    assert_eq!((b.held, b.share, b.free), (0, 5, 0));
    // a still has 8 in flight: it keeps 8 (more than its share).
    let a = h.grant("a", &ask(10, 8), 20, TTL, true);
    assert_eq!((a.held, a.share), (8, 5));
    assert_eq!(h.grant("b", &ask(10, 0), 30, TTL, true).held, 2);
    // Its requests end: a keeps 5, and b gets the rest.
    assert_eq!(h.grant("a", &ask(10, 5), 40, TTL, true).held, 5);
    assert_eq!(h.grant("b", &ask(10, 2), 50, TTL, true).held, 5);
    assert_eq!(h.total(), 10);
}

#[test]
fn a_holding_that_is_not_renewed_ends_and_its_slots_go_to_others() {
    let mut h = Holdings::default();
    h.grant("dead", &ask(10, 0), 0, TTL, true);
    assert_eq!(h.grant("b", &ask(10, 0), TTL - 1, TTL, true).held, 0);
    assert_eq!(h.grant("b", &ask(10, 0), TTL, TTL, true).held, 10);
    assert_eq!(h.entries.len(), 1);
}

#[test]
fn giving_a_key_back_forgets_the_instance() {
    let mut h = Holdings::default();
    h.grant("a", &ask(3, 0), 0, TTL, true);
    assert_eq!(h.grant("a", &ask(0, 0), 10, TTL, true).held, 0);
    assert!(h.is_empty());
}

#[test]
fn after_a_loss_of_holdings_instances_get_back_what_they_keep_and_nothing_new() {
    let mut h = Holdings::default();
    assert_eq!(h.grant("a", &ask(10, 6), 0, TTL, false).held, 6);
    assert_eq!(h.grant("new", &ask(10, 0), 0, TTL, false).held, 0);
    // More than the limit declared: what fits.
    assert_eq!(h.grant("b", &ask(10, 7), 0, TTL, false).held, 4);
    // Settled: free slots are granted again.
    h.grant("a", &ask(6, 2), TTL, TTL, true);
    assert_eq!(h.grant("new", &ask(10, 0), TTL, TTL, true).held, 4);
}

#[test]
fn after_a_loss_renewing_holders_keep_their_holdings_not_only_what_is_in_flight() {
    let mut h = Holdings::default();
    // a held 6 before the loss (its evidence), 2 in flight: it holds 6 again, so it admits as
    // before; b held 3. A newcomer gets nothing until the store has settled.
    let evidence = |wanted, keep, known_held| PermitAsk {
        known_held,
        ..ask(wanted, keep)
    };
    assert_eq!(h.grant("a", &evidence(8, 2, 6), 0, TTL, false).held, 6);
    assert_eq!(h.grant("b", &evidence(3, 1, 3), 0, TTL, false).held, 3);
    assert_eq!(h.grant("new", &ask(10, 0), 0, TTL, false).held, 0);
    // Renewing before it settles, a keeps what it holds (as far as it wants it), no more.
    assert_eq!(h.grant("a", &ask(8, 1), 100, TTL, false).held, 6);
    assert_eq!(h.grant("a", &ask(4, 1), 200, TTL, false).held, 4);
    // Evidence beyond what fits the limit: what fits.
    assert_eq!(h.grant("c", &evidence(9, 0, 9), 200, TTL, false).held, 3);
    assert_eq!(h.total(), 10);
}

proptest! {
    #[test]
    fn the_limit_is_never_exceeded_and_no_one_loses_what_it_keeps(
        calls in prop::collection::vec(
            (0usize..4, 0u64..15, 0u64..15, 0u64..3_000, any::<bool>(), 0u64..15), 1..200),
    ) {
        let mut h = Holdings::default();
        let names = ["a", "b", "c", "d"];
        let mut now = 0;
        for (who, wanted, keep, step, settled, known_held) in calls {
            now += step;
            let before = h
                .entries
                .iter()
                .find(|e| e.instance == names[who] && e.expires_ms > now)
                .map(|e| e.held);
            let asked = PermitAsk { known_held, ..ask(wanted, keep) };
            let g = h.grant(names[who], &asked, now, TTL, settled);
            prop_assert!(h.total() <= 10, "{h:?}");
            if let Some(held) = before {
                prop_assert!(g.held >= keep.min(held));
            }
            prop_assert!(g.held <= wanted.max(keep).max(known_held));
            prop_assert_eq!(g.free, 10 - h.total());
        }
    }

    #[test]
    fn holdings_are_idle_from_when_pruning_leaves_none(
        calls in prop::collection::vec((0usize..4, 0u64..5, 0u64..3_000), 1..50),
        later in 0u64..2 * TTL,
    ) {
        let mut h = Holdings::default();
        let names = ["a", "b", "c", "d"];
        let mut now = 0;
        for (who, wanted, step) in calls {
            now += step;
            h.grant(names[who], &ask(wanted, 0), now, TTL, true);
        }
        let at = now + later;
        let mut pruned = h.clone();
        pruned.prune(at);
        prop_assert_eq!(h.idle_at_ms() <= at, pruned.is_empty(), "{:?} at {}", h, at);
    }
}

const MS: u64 = 1_000_000;

fn wk(ask: PermitAsk) -> (u64, u64) {
    (ask.wanted, ask.keep)
}

fn allowance() -> PermitAllowance {
    PermitAllowance {
        concurrent: 10,
        headroom: 1,
        claim_ms: 300,
        denied_ms: 1_000,
        retry_ms: 1_000,
        waits_for_more: false,
    }
}

fn answer(held: u64, share: u64, free: u64) -> PermitAnswer {
    PermitAnswer {
        held,
        share,
        free,
        ttl_ms: TTL,
    }
}

fn admitted(a: &PermitAllowance, s: &mut State, now_ms: u64) -> bool {
    match a.decide(s, now_ms * MS, 1) {
        Decision::Admit { state, .. } => {
            *s = state;
            true
        }
        _ => false,
    }
}

#[test]
fn a_cold_key_waits_for_its_first_lease_then_admits_up_to_it_without_calls() {
    let a = allowance();
    let mut s = [0; 32];
    let Decision::Wait {
        claim: Some(claimed),
    } = a.decide(&s, 1_000 * MS, 1)
    else {
        panic!("no claim")
    };
    assert!(a.claimed(&s, &claimed));
    s = claimed;
    // A second request waits for the same call.
    let Decision::Wait { claim: Some(again) } = a.decide(&s, 1_001 * MS, 1) else {
        panic!()
    };
    assert!(!a.claimed(&s, &again));
    s = again;
    assert_eq!(wk(a.ask(&s, 1_002)), (3, 0), "2 waiting + headroom");
    s = a.grant(&s, 1_005, &answer(3, 10, 7), 1_000, 0);
    assert!((0..3).all(|_| admitted(&a, &mut s, 1_010)));
    // Full: refused at once; the tick asks for more.
    assert!(matches!(
        a.decide(&s, 1_011 * MS, 1),
        Decision::Refuse { .. }
    ));
    let claim = a.renewal(&s, 1_012).expect("full: ask for more");
    assert_eq!(wk(a.ask(&claim, 1_012)), (4, 3));
    s = a.grant(&claim, 1_013, &answer(4, 10, 6), 1_012, 0);
    assert!(admitted(&a, &mut s, 1_014));
}

#[test]
fn renewals_come_halfway_and_an_idle_key_is_given_back() {
    let a = allowance();
    let mut s = a.grant(&[0; 32], 0, &answer(2, 10, 8), 0, 0);
    assert!(admitted(&a, &mut s, 10));
    assert_eq!(a.renewal(&s, 100), None, "not full, not due");
    let claim = a.renewal(&s, TTL / 2).expect("halfway");
    assert_eq!(a.renewal(&claim, TTL / 2 + 1), None, "one call at a time");
    s = a.grant(&claim, TTL / 2 + 2, &answer(2, 10, 8), TTL / 2, 0);
    s = PermitAllowance::release(&s, 1);
    let claim = a.renewal(&s, TTL).expect("halfway again");
    assert_eq!(wk(a.ask(&claim, TTL)), (0, 0), "nothing in use: given back");
    // While the call is out, it admits no more than it said it keeps.
    assert!(!admitted(&a, &mut claim.clone(), TTL + 1));
    s = a.grant(&claim, TTL + 2, &answer(0, 0, 10), TTL, 0);
    assert!(PermitAllowance::is_idle(&s, TTL + 3));
    assert!(matches!(
        a.decide(&s, (TTL + 3) * MS, 1),
        Decision::Wait { .. }
    ));
}

#[test]
fn a_clock_stepped_back_renews_at_once_instead_of_keeping_slots_past_their_term() {
    let a = allowance();
    let hour = 3_600_000;
    let mut s = a.grant(&[0; 32], hour, &answer(3, 10, 7), hour, 0);
    assert!(admitted(&a, &mut s, hour + 10));
    // A renewal is out when the clock steps back an hour.
    let claim = a.renewal(&s, hour + TTL / 2).expect("halfway");
    let back = TTL / 2 + 100;
    // Before: the lease (ending an hour ahead) admitted for the hour and the claim blocked
    // every renewal, while the service gave the slots away after its term. Now: the lease
    // ends, the claim mark too; the tick declares what is in use at once.
    let renewal = a.renewal(&claim, back).expect("renewed at once");
    assert_eq!(
        wk(a.ask(&renewal, back)),
        (2, 1),
        "keeps the one in use, asks headroom"
    );
    assert!(matches!(
        a.decide(&claim, back * MS, 1),
        Decision::Wait { .. }
    ));
    // Its answer is a lease from the new clock on.
    s = a.grant(&renewal, back + 2, &answer(3, 10, 7), back, 0);
    assert!(admitted(&a, &mut s, back + 3));
    assert_eq!(a.renewal(&s, back + 4), None, "not due");
    // A failed call's retry time from beyond the clock ends now too: the key asks again at
    // once (the failure mode still decides until an answer), not an hour later.
    let failed = a.fail(&claim, hour + TTL / 2 + 300, a.retry_ms);
    assert!(matches!(
        a.decide(&failed, back * MS, 1),
        Decision::Fallback { claim: Some(_) }
    ));
}

#[test]
fn a_failed_renewal_applies_the_failure_mode_at_once_and_the_lease_is_grace_for_what_runs() {
    let a = PermitAllowance {
        retry_ms: TTL,
        ..allowance()
    };
    let mut s = a.grant(&[0; 32], 0, &answer(2, 10, 8), 0, 0);
    assert!(admitted(&a, &mut s, 10));
    s = a.fail(&a.renewal(&s, TTL / 2).expect("due"), TTL / 2 + 300, TTL);
    assert!(matches!(
        a.decide(&s, (TTL / 2 + 400) * MS, 1),
        Decision::Fallback { claim: None }
    ));
    assert!(matches!(
        a.decide(&s, TTL * MS, 1),
        Decision::Fallback { .. }
    ));
    // A first failure retries after a quarter of `retry`.
    let retry = TTL / 2 + 300 + TTL / 4;
    assert_eq!(a.renewal(&s, retry - 1), None, "not before the retry time");
    // Past the retry time, the lease still lasting: a call declares what it holds and keeps.
    let claim = a.renewal(&s, retry).expect("declare what is in use");
    assert_eq!(wk(a.ask(&claim, retry)), (2, 2));
    // Failing again: a whole `retry` to the next; the lease over by then, it keeps what is in
    // use.
    let s = a.fail(&claim, retry + 10, TTL);
    assert_eq!(a.renewal(&s, retry + 10 + TTL - 1), None);
    let later = retry + 10 + TTL;
    let claim = a.renewal(&s, later).expect("declare what is in use");
    assert_eq!(wk(a.ask(&claim, later)), (2, 1));
}

#[test]
fn after_a_failed_call_nothing_new_is_admitted_until_a_call_succeeds() {
    let a = allowance();
    let mut s = a.grant(&[0; 32], 0, &answer(5, 10, 5), 0, 0);
    assert!(admitted(&a, &mut s, 10));
    // A renewal that fails 300 ms before the lease is half over; retry after 1 s.
    s = a.fail(&a.renewal(&s, TTL / 2).expect("due"), TTL / 2, 1_000);
    // The retry is due while the lease still stands: the failure mode still decides, and
    // this request asks again.
    let at = TTL / 2 + 1_000;
    let Decision::Fallback {
        claim: Some(asking),
    } = a.decide(&s, at * MS, 1)
    else {
        panic!("asks again, failure mode meanwhile");
    };
    assert!(a.claimed(&s, &asking));
    assert!(matches!(
        a.decide(&asking, (at + 1) * MS, 1),
        Decision::Fallback { claim: None }
    ));
    // It fails again: the failure mode, for as long as the service cannot be reached.
    s = a.fail(&asking, at + 200, 1_000);
    assert!(matches!(
        a.decide(&s, (at + 900) * MS, 1),
        Decision::Fallback { claim: None }
    ));
    // The tick asks once the retry is due, and an answer ends it.
    let claim = a.renewal(&s, at + 1_200).expect("the retry");
    s = a.grant(&claim, at + 1_210, &answer(5, 10, 5), at + 1_200, 2);
    assert!(admitted(&a, &mut s, at + 1_220));
}

#[test]
fn a_key_that_got_nothing_refuses_at_once_until_it_may_ask_again() {
    let a = allowance();
    let Decision::Wait { claim: Some(s) } = a.decide(&[0; 32], 0, 1) else {
        panic!()
    };
    let s = a.grant(&s, 5, &answer(0, 5, 0), 0, 0);
    let Decision::Refuse { retry_after_ns, .. } = a.decide(&s, 10 * MS, 1) else {
        panic!("held")
    };
    assert_eq!(retry_after_ns, 1_000 * MS);
    assert!(matches!(a.decide(&s, 1_006 * MS, 1), Decision::Wait { .. }));
}

#[test]
fn an_answer_without_room_is_not_asked_again_before_the_denial_ends() {
    let a = allowance();
    let mut s = a.grant(&[0; 32], 0, &answer(2, 5, 0), 0, 0);
    assert!(admitted(&a, &mut s, 1) && admitted(&a, &mut s, 1));
    let claim = a.renewal(&s, 2).expect("full");
    s = a.grant(&claim, 3, &answer(2, 2, 0), 2, 0);
    assert_eq!(a.renewal(&s, 500), None, "denied for a second");
    assert!(a.renewal(&s, 1_004).is_some());
}

#[test]
fn a_full_lease_with_room_waits_for_more_where_the_host_can_resume() {
    let answer = |held, share, free| PermitAnswer {
        held,
        share,
        free,
        ttl_ms: TTL,
    };
    for waits in [true, false] {
        let a = PermitAllowance {
            waits_for_more: waits,
            ..allowance()
        };
        // 3 held, the service has 7 free and this proxy's share is the whole limit.
        let mut s = a.grant(&[0; 32], 1_000, &answer(3, 10, 7), 1_000, 3);
        for _ in 0..3 {
            let Decision::Admit { state, .. } = a.decide(&s, 1_001 * MS, 1) else {
                panic!("within the lease");
            };
            s = state;
        }
        match a.decide(&s, 1_001 * MS, 1) {
            Decision::Wait { claim: Some(c) } if waits => {
                assert!(a.claimed(&s, &c), "asks for more");
                assert_eq!(
                    a.ask(&c, 1_001).wanted,
                    3 + 1 + 1,
                    "in use, waiting, headroom"
                );
                // No room left by the answer: refused at once.
                let full = a.grant(&c, 1_002, &answer(3, 10, 0), 1_001, 5);
                assert!(matches!(
                    a.decide(&full, 1_003 * MS, 1),
                    Decision::Refuse { .. }
                ));
            }
            Decision::Refuse { .. } if !waits => {}
            d => panic!("waits_for_more {waits}: {d:?}"),
        }
    }
}

proptest! {
    /// Several proxies and the service, with calls, answers, failures and time in any order:
    /// requests in flight across the proxies never exceed the limit while every proxy's
    /// lease stands.
    #[test]
    fn proxies_never_admit_past_the_limit_together(
        events in prop::collection::vec((0usize..3, 0u8..5, 0u64..400), 1..400),
        waits_for_more in any::<bool>(),
    ) {
        let a = PermitAllowance {
            waits_for_more,
            ..allowance()
        };
        let mut service = Holdings::default();
        let mut states = [[0u8; 32]; 3];
        let mut calls: [Option<(u64, PermitAsk)>; 3] = [None; 3];
        let mut now = 1_000;
        for (who, what, step) in events {
            now += step;
            let s = &mut states[who];
            match what {
                0 => {
                    if let Decision::Admit { state, .. } | Decision::Wait { claim: Some(state) } =
                        a.decide(s, now * MS, 1)
                    {
                        if a.claimed(s, &state) {
                            calls[who] = Some((now, a.ask(&state, now)));
                        }
                        *s = state;
                    }
                }
                1 => *s = PermitAllowance::release(s, 1.min(PermitAllowance::in_use(s))),
                2 => {
                    if let Some(claimed) = a.renewal(s, now) {
                        *s = claimed;
                        calls[who] = Some((now, a.ask(s, now)));
                    }
                }
                // An answer comes within the call's timeout (shorter than the claim), or the
                // call failed.
                3 => match calls[who].take() {
                    Some((at, ask)) if now - at < a.claim_ms => {
                        let g = service.grant(&who.to_string(), &ask, now, TTL, true);
                        let answer = PermitAnswer { held: g.held, share: g.share, free: g.free, ttl_ms: TTL };
                        *s = a.grant(s, now, &answer, at, ask.wanted);
                    }
                    Some(_) => *s = a.fail(s, now, 1_000),
                    None => {}
                },
                _ => {
                    if calls[who].take().is_some() {
                        *s = a.fail(s, now, 1_000);
                    }
                }
            }
            // Slots in use by proxies whose lease stands, against the limit.
            let in_use: u64 = states
                .iter()
                .map(PermitAllowance::in_use)
                .sum();
            let lapsed = states.iter().any(|s| !Parts::decode(s).leased(now) && PermitAllowance::in_use(s) > 0);
            if !lapsed {
                prop_assert!(in_use <= 10, "{in_use} in use: {states:?} {service:?}");
            }
        }
    }
}
