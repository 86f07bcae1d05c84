//! The global bucket's lease step: fair shares, rates, give-backs, refill and clock steps.

use super::*;

fn item(wanted: u64) -> LeaseItem {
    LeaseItem {
        rule: "r".into(),
        limit_id: "l".into(),
        key: "k".into(),
        requests: 120,
        per_ms: 60_000,
        burst: 120,
        wanted,
        used: 0,
        demand: 0.0,
        ..LeaseItem::default()
    }
}

fn rated(wanted: u64, demand: f64) -> LeaseItem {
    LeaseItem {
        demand,
        ..item(wanted)
    }
}

fn new_bucket() -> GlobalBucket {
    GlobalBucket::new(&item(0), 0, 10_000, ColdStart::Full)
}

#[test]
fn grants_are_fair_and_never_exceed_the_bucket() {
    let mut b = new_bucket();
    // Three instances report demand; the small ones are served in full, the big one its share.
    assert_eq!(b.lease("c", &item(10), 0, 10_000).granted, 10);
    assert_eq!(b.lease("b", &item(50), 0, 10_000).granted, 50);
    let a = b.lease("a", &item(1000), 0, 10_000);
    assert_eq!(a.granted, 60);
    assert_eq!(a.remaining, 0);
    assert_eq!(a.reset_ms, 60_000);
    assert_eq!(a.rate, 0.0);
    // Empty: nothing more until it refills (2 per second), and it says when to ask again.
    let none = b.lease("a", &item(1000), 0, 10_000);
    assert_eq!((none.granted, none.retry_ms), (0, 500));
    assert_eq!(b.lease("a", &item(1000), 1_000, 10_000).granted, 2);
}

#[test]
fn tokens_given_back_return_at_most_what_the_instance_took() {
    let back = |returned: u64| LeaseItem {
        returned,
        ..item(0)
    };
    let mut b = new_bucket();
    assert_eq!(b.lease("a", &item(100), 0, 10_000).remaining, 20);
    // b took nothing: it gives back nothing (before, anyone could fill a bucket).
    let g = b.lease("b", &back(50), 0, 10_000);
    assert_eq!((g.remaining, g.returned, g.retry_ms), (20, 0, 0));
    // a took 100 and gives back 30, then 80: only the 70 it still had out go back.
    let g = b.lease("a", &back(30), 0, 10_000);
    assert_eq!((g.remaining, g.returned), (50, 30));
    let g = b.lease("a", &back(80), 0, 10_000);
    assert_eq!((g.remaining, g.returned, g.retry_ms), (120, 70, 0));
    assert_eq!(b.lease("a", &back(1), 0, 10_000).remaining, 120);
    // Given back and asked for in one item: the tokens come back first.
    assert_eq!(b.lease("a", &item(120), 0, 10_000).granted, 120);
    let again = LeaseItem {
        returned: 20,
        ..item(20)
    };
    assert_eq!(b.lease("a", &again, 0, 10_000).granted, 20);
    // Never beyond the burst: a bucket full again by refill takes nothing more.
    let full = b.lease("a", &back(20), 60_000, 10_000);
    assert_eq!(full.remaining, 120);
}

#[test]
fn a_clock_stepped_back_refills_from_then_not_once_it_caught_up() {
    // 2 a second, emptied at 1 h; then the clock steps back 10 minutes.
    let hour = 3_600_000;
    let mut b = new_bucket();
    assert_eq!(b.lease("a", &item(1000), hour, 10_000).granted, 120);
    let back = hour - 600_000;
    assert_eq!(b.lease("a", &item(1000), back, 10_000).granted, 0);
    // One second later by the stepped clock: what one second brings (before: nothing for
    // ten minutes).
    assert_eq!(b.lease("a", &item(1000), back + 1_000, 10_000).granted, 2);
}

#[test]
fn old_demands_are_forgotten() {
    let mut b = new_bucket();
    b.lease("b", &item(1000), 0, 1_000);
    // b's demand has expired: a alone may take the whole capacity that is left.
    let g = b.lease("a", &item(1000), 60_000, 1_000);
    assert_eq!(g.granted, 120);
    assert!(!b.is_idle(60_000));
    assert!(!b.is_idle(119_999));
    assert!(b.is_idle(120_000));
}

#[test]
fn a_rate_lease_reserves_refill_for_its_holder_and_is_shared_max_min() {
    let mut b = new_bucket();
    // a wants 1.5/s of the 2/s refill: reserved for it for 10 s (shares take three quarters of
    // the rate at most while the reserve for newcomers, 15 tokens, fills: 1.5/s).
    let g = b.lease("a", &rated(0, 1.5), 0, 10_000);
    assert_eq!((g.granted, g.rate), (0, 1.5));
    // b wants 2/s: nothing is left to reserve until a asks again; its first call takes tokens.
    let g = b.lease("b", &rated(120, 2.0), 0, 10_000);
    assert_eq!((g.granted, g.rate), (120, 0.0));
    // 4 s later the bucket has refilled 2 tokens (0.5/s), into the reserve: a newcomer's.
    assert_eq!(b.lease("c", &item(10), 4_000, 10_000).granted, 2);
    // a renews: a's old reservation is replaced by the fair split of 1.5/s between demands 1.5
    // and 2: 0.75/s each.
    let g = b.lease("a", &rated(0, 1.5), 5_000, 10_000);
    assert_eq!(g.rate, 0.75);
    let g = b.lease("b", &rated(0, 2.0), 5_000, 10_000);
    assert_eq!(g.rate, 0.75);
    // Once every reservation has ended, the bucket refills at the whole rate again: 0.5/s from
    // 5 s to 15 s, 2/s from then (the reserve first, to its 15).
    assert_eq!(b.lease("c", &item(100), 25_000, 10_000).granted, 25);
}

#[test]
fn the_reserve_is_for_those_within_their_fair_share() {
    let mut b = new_bucket();
    // A new bucket's burst goes to whoever asks first, all of it (a new deployment's limit at
    // once); the refill goes to the reserve first.
    let g = b.lease("a", &rated(120, 2.0), 0, 10_000);
    assert_eq!((g.granted, g.rate), (120, 1.5));
    // b wants 0.5/s (with a's 2/s, within its fair share of 0.75): at first nothing is left to
    // reserve for it, and it takes from the reserve (4 tokens in 8 s, a quarter of the rate).
    let g = b.lease("b", &rated(10, 0.5), 8_000, 10_000);
    assert_eq!((g.granted, g.rate), (4, 0.0));
    // a renews, wanting more than its share: it is told what is above the reserve (nothing),
    // and takes only that; its share is cut to 1/s, and b gets its 0.5.
    let g = b.lease("a", &rated(10, 2.0), 9_000, 10_000);
    assert_eq!((g.granted, g.remaining, g.rate), (0, 0, 1.0));
    let g = b.lease("b", &rated(10, 0.5), 9_000, 10_000);
    assert_eq!((g.granted, g.rate), (0, 0.5));
    // The refill left (0.5/s) goes to the reserve: b's, should it need more; not a's.
    assert_eq!(b.lease("a", &rated(10, 2.0), 13_000, 10_000).granted, 0);
    assert_eq!(b.lease("b", &rated(10, 0.5), 13_000, 10_000).granted, 2);
}

#[test]
fn a_cold_start_grants_nothing_for_one_lease_ttl_then_refills_from_empty() {
    let cold = ColdStart::Conservative { epoch_ms: 1_000 };
    let mut b = GlobalBucket::new(&item(10), 1_000, 10_000, cold);
    // Only the newcomers' reserve (an eighth of the burst: 15), for an instance within its fair
    // share; then nothing.
    let g = b.lease("a", &rated(10, 2.0), 1_000, 10_000);
    assert_eq!((g.granted, g.rate), (10, 0.0));
    let g = b.lease("a", &rated(10, 2.0), 1_000, 10_000);
    assert_eq!((g.granted, g.rate), (5, 0.0));
    let g = b.lease("a", &rated(10, 2.0), 1_000, 10_000);
    assert_eq!((g.granted, g.rate), (0, 0.0));
    assert_eq!(
        g.retry_ms, 10_000,
        "asks again when the old leases have ended"
    );
    // 5 s after the reservation of before the restart ended: 10 tokens, and the reserve's 15.
    let mut b = GlobalBucket::new(&item(100), 16_000, 10_000, cold);
    assert_eq!(b.lease("a", &item(100), 16_000, 10_000).granted, 25);
    // Long after the start, a new bucket is full.
    let mut b = GlobalBucket::new(&item(100), 100_000, 10_000, cold);
    assert_eq!(b.lease("a", &item(120), 100_000, 10_000).granted, 120);
}

#[test]
fn auto_starts_full_unless_the_store_lost_state_and_evidence_reconciles() {
    let auto = ColdStart::Auto { epoch_ms: 1_000 };
    assert_eq!(auto.for_new(false), ColdStart::Full);
    assert_eq!(
        auto.for_new(true),
        ColdStart::Conservative { epoch_ms: 1_000 }
    );
    // Full, 20 granted (100 left of 120); then a proxy says that 10 s ago 30 were left: at
    // most 30 + 1 + 2/s × 10 s = 51 can be there now.
    let mut b = GlobalBucket::new(&item(0), 0, 10_000, ColdStart::Full);
    assert_eq!(b.lease("a", &item(20), 0, 10_000).remaining, 100);
    let evidence = LeaseItem {
        known_ms: 10_000,
        known_remaining: 30,
        ..item(10)
    };
    assert!(b.reconcile("b", &evidence, 0, 10_000));
    // Emptied but for the newcomers' reserve (15), the whole rate held for a TTL: the reserve,
    // then nothing for 10 s, then the refill.
    assert_eq!(b.lease("a", &evidence, 0, 10_000).granted, 10);
    assert_eq!(b.lease("a", &item(10), 1, 10_000).granted, 5);
    assert_eq!(b.lease("a", &item(10), 9_999, 10_000).granted, 0);
    assert_eq!(b.lease("a", &item(10), 12_000, 10_000).granted, 4);
    // Evidence that agrees changes nothing (evidence older than the store keeps its holders:
    // it may not remember the instance).
    let mut b = GlobalBucket::new(&item(0), 0, 10_000, ColdStart::Full);
    b.lease("a", &item(20), 0, 10_000);
    let agrees = LeaseItem {
        known_ms: 9_800,
        known_remaining: 100,
        ..item(10)
    };
    assert!(!b.reconcile("b", &agrees, 1, 10_000));
    // Recent evidence of an instance the store does not remember: the store lost the bucket
    // since, even if it holds no more than the evidence allows (made anew full by a caller
    // without evidence, who took 4 of 120): emptied but for the reserve.
    let mut b = GlobalBucket::new(&item(0), 0, 10_000, ColdStart::Full);
    assert_eq!(b.lease("new", &item(4), 0, 10_000).granted, 4);
    let old = LeaseItem {
        known_ms: 900,
        known_remaining: 100,
        ..item(10)
    };
    assert!(b.reconcile("old", &old, 0, 10_000));
    assert_eq!(b.tokens_at(&item(0), 0), 15.0);
    // Evidence of an instance the store has served since the answer it is of: nothing was lost
    // (others may have given back or repaid more than the evidence shows).
    let mut b = GlobalBucket::new(&item(0), 0, 10_000, ColdStart::Full);
    b.lease("a", &item(20), 5_000, 10_000);
    assert!(!b.reconcile("a", &evidence, 10_000, 10_000));
    assert!(b.reconcile("c", &evidence, 10_000, 10_000));
}

/// Everything instances may admit by `now`: the tokens granted, and each rate lease's refill
/// from its grant until it ended or was replaced.
fn admissible(events: &[(usize, u64, u64, f64)], ttl: u64, cold: ColdStart) -> Vec<(u64, f64)> {
    let it = |wanted, demand| LeaseItem {
        requests: 7,
        per_ms: 3_000,
        burst: 20,
        ..rated(wanted, demand)
    };
    let mut bucket = GlobalBucket::new(&it(0, 0.0), 0, ttl, cold);
    let mut leases: Vec<Option<(u64, f64, u64)>> = vec![None; 3];
    let (mut granted, mut accrued, mut now) = (0u64, 0.0, 0u64);
    let mut totals = Vec::new();
    for &(who, dt, wanted, demand) in events {
        now += dt;
        if let Some((from, rate, until)) = leases[who].take() {
            accrued += rate / 1_000.0 * (until.min(now) - from) as f64;
        }
        let g = bucket.lease(&format!("i{who}"), &it(wanted, demand), now, ttl);
        granted += g.granted;
        leases[who] = Some((now, g.rate, now + g.ttl_ms));
        let open: f64 = leases
            .iter()
            .flatten()
            .map(|&(from, rate, until)| rate / 1_000.0 * (until.min(now) - from) as f64)
            .sum();
        totals.push((now, granted as f64 + accrued + open));
    }
    totals
}

proptest::proptest! {
    /// Whatever instances ask and whenever: what they may admit stays within
    /// `burst + rate × elapsed` (here 20 + 7 per 3 s), and after a conservative cold start
    /// within `burst / 8 + rate × (elapsed − ttl)`.
    #[test]
    fn rate_leases_never_exceed_the_global_bound(
        events in proptest::collection::vec(
            (0usize..3, 0u64..4_000, 0u64..40, 0.0f64..8.0), 1..60),
        ttl in 500u64..12_000,
        conservative in proptest::bool::ANY,
    ) {
        let cold = if conservative {
            ColdStart::Conservative { epoch_ms: 0 }
        } else {
            ColdStart::Full
        };
        for (now, total) in admissible(&events, ttl, cold) {
            let bound = if conservative {
                // The newcomers' reserve (an eighth of the burst), then the refill.
                2.0 + 7.0 / 3_000.0 * now.saturating_sub(ttl) as f64
            } else {
                20.0 + 7.0 / 3_000.0 * now as f64
            };
            proptest::prop_assert!(total <= bound + 1e-6, "{} > {} at {}", total, bound, now);
        }
    }

    /// Whatever a broken or hostile service sends, parsing answers with an error, never a
    /// panic (the filter then applies its failure mode).
    #[test]
    fn any_answer_parses_or_fails_cleanly(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..300)) {
        let _ = serde_json::from_slice::<LeaseResponse>(&bytes);
    }

    #[test]
    fn json_shaped_answers_parse_or_fail_cleanly(
        granted in proptest::num::i128::ANY,
        extra in "[a-z_]{0,8}",
        items in 0usize..4,
    ) {
        let item = format!(r#"{{"granted":{granted},"ttl_ms":1,"remaining":0,"reset_ms":0{}}}"#,
            if extra.is_empty() { String::new() } else { format!(r#","{extra}":1"#) });
        let body = format!(r#"{{"items":[{}]}}"#, vec![item; items].join(","));
        let parsed = serde_json::from_slice::<LeaseResponse>(body.as_bytes());
        if let Ok(r) = parsed {
            proptest::prop_assert_eq!(r.items.len(), items);
        }
    }
}

#[test]
fn wire_format() {
    let req: LeaseRequest = serde_json::from_str(
        r#"{"instance":"i","items":[{"rule":"r","limit_id":"l","key":"k","requests":1,
            "per_ms":1000,"burst":1,"wanted":5,"used":0,"demand":2.5}]}"#,
    )
    .unwrap();
    assert_eq!(req.problem(), None);
    // A bad item is the item's problem, not the call's.
    let mut bad = req.clone();
    bad.items[0].burst = 0;
    assert_eq!(bad.problem(), None);
    assert_eq!(
        bad.item_problems(),
        [Some(
            "requests, per_ms and burst must be positive".to_owned()
        )]
    );
    let (answers, errors) =
        merge_refused(&bad.item_problems(), &[], LeaseGrant::default()).unwrap();
    assert_eq!(answers, [LeaseGrant::default()]);
    assert_eq!(
        errors[0].error,
        "items[0]: requests, per_ms and burst must be positive"
    );
    let json = serde_json::to_string(&LeaseResponse {
        items: answers,
        errors,
    })
    .unwrap();
    assert!(
        json.contains(r#""errors":[{"item":0,"error":"items[0]: requests"#),
        "{json}"
    );
    // An answer without errors says nothing of them (older filters read it as before).
    let plain = serde_json::to_string(&LeaseResponse {
        items: vec![],
        errors: vec![],
    })
    .unwrap();
    assert_eq!(plain, r#"{"items":[]}"#);
    assert!(serde_json::from_str::<LeaseResponse>(r#"{"items":[{"granted":1}]}"#).is_err());
}

#[test]
fn a_reset_bucket_is_full_at_its_next_call_its_debt_forgiven_its_holders_kept() {
    let mut b = new_bucket();
    assert_eq!(b.lease("a", &item(120), 0, 10_000).granted, 120);
    let owes = LeaseItem {
        owed: 50,
        ..item(0)
    };
    b.lease("a", &owes, 1_000, 10_000);
    assert_eq!(b.debt(), 48);
    b.reset();
    assert!(b.is_reset_pending());
    assert_eq!(b.debt(), 0);
    // The holder's evidence (empty, in debt, a second ago) is not taken for a lost bucket: the
    // store served it since.
    let evidence = LeaseItem {
        known_ms: 1_000,
        known_remaining: 0,
        known_debt: 48,
        ..item(200)
    };
    assert!(!b.reconcile("a", &evidence, 2_000, 10_000));
    assert!(!b.is_reset_pending());
    let g = b.lease("a", &evidence, 2_000, 10_000);
    assert_eq!((g.granted, g.remaining, b.debt()), (120, 0, 0));
    // Reset again, then a newcomer: the burst, shared fairly with the holder's recent demand.
    b.reset();
    assert_eq!(b.tokens_at(&item(0), 2_000), 120.0);
    assert_eq!(b.holders.len(), 1);
}

/// A calendar quota of 10 per month, in a period that ends at `END`.
const END: u64 = 2_000_000;

fn monthly(wanted: u64) -> LeaseItem {
    LeaseItem {
        requests: 10,
        per_ms: 31 * 86_400_000,
        burst: 10,
        calendar: Some("month".into()),
        period: Some((0, END)),
        ..item(wanted)
    }
}

#[test]
fn a_calendar_quota_never_refills_within_its_period_and_leases_until_its_end() {
    // Started full, whatever the cold-start mode says: nothing would refill it.
    let epoch = ColdStart::Conservative { epoch_ms: 500_000 };
    let mut b = GlobalBucket::new(&monthly(0), 500_000, 10_000, epoch);
    let g = b.lease("a", &monthly(4), 500_000, 10_000);
    // Its tokens are the instance's until the period ends, when the bucket is full again.
    assert_eq!(
        (g.granted, g.remaining, g.ttl_ms, g.reset_ms),
        (4, 6, 1_500_000, 1_500_000)
    );
    // No rate, whatever is asked: the bucket has none.
    let g = b.lease(
        "b",
        &LeaseItem {
            demand: 1_000.0,
            ..monthly(10)
        },
        600_000,
        10_000,
    );
    assert_eq!((g.granted, g.rate, g.remaining), (6, 0.0, 0));
    // Later, still empty: told to ask again when the period ends.
    let g = b.lease("a", &monthly(1), 1_900_000, 10_000);
    assert_eq!((g.granted, g.retry_ms, g.reset_ms), (0, 100_000, 100_000));
}

#[test]
fn a_calendar_bucket_a_store_lost_holds_what_the_evidence_says_was_left() {
    // A store that does not know the bucket starts it full; a caller that was told 3 were left
    // (and not served since) brings it down to 3 — not to nothing, as a refilling bucket.
    let seen = LeaseItem {
        known_ms: 2_000,
        known_remaining: 3,
        ..monthly(5)
    };
    let mut b = GlobalBucket::new(&seen, 100_000, 10_000, ColdStart::Full);
    assert!(b.reconcile("a", &seen, 100_000, 10_000));
    let g = b.lease("a", &seen, 100_000, 10_000);
    assert_eq!((g.granted, g.remaining), (3, 0));
    // A debt the evidence shows is owed again.
    let owing = LeaseItem {
        known_ms: 2_000,
        known_debt: 7,
        ..monthly(1)
    };
    let mut b = GlobalBucket::new(&owing, 100_000, 10_000, ColdStart::Full);
    assert!(b.reconcile("b", &owing, 100_000, 10_000));
    assert_eq!(b.lease("b", &owing, 100_000, 10_000).debt, 7);
    // Evidence of as many as it holds, or of an instance it served since, changes nothing.
    let mut b = GlobalBucket::new(&seen, 100_000, 10_000, ColdStart::Full);
    b.lease("a", &monthly(7), 100_000, 10_000);
    assert!(!b.reconcile("c", &seen, 100_000, 10_000));
    let fresh = LeaseItem {
        known_ms: 1,
        known_remaining: 0,
        ..monthly(1)
    };
    assert!(!b.reconcile("a", &fresh, 100_001, 10_000));
}
