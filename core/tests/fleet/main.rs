//! Global limits across a fleet, simulated over the real lease code (`sim.rs`): every
//! admission within what the service handed out, a debt every proxy sees, a store loss under
//! load, newcomers beside a busy proxy. Virtual time: the whole file runs in seconds.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod sim;

use sim::{Event, Fate, Fleet, Load, Setup};

fn admitted(f: &Fate) -> bool {
    *f == Fate::Admitted
}

fn refused(f: &Fate) -> bool {
    matches!(f, Fate::Refused { .. })
}

/// Which proxy was refused when (ms), from `from_ms` on.
fn refused_from(fleet: &Fleet, from_ms: u64) -> Vec<(usize, u64)> {
    fleet
        .answered
        .iter()
        .filter(|a| refused(&a.fate) && a.decided_ms >= from_ms)
        .map(|a| (a.proxy, a.decided_ms))
        .collect()
}

/// A limit of 200/s (burst 200) shared by a proxy sent 1 200 requests a second and `light`
/// proxies sent `light_per_s` each, from `join_ms` on, over `ms`: the light proxies' refusals
/// after their first admission, and what the fleet admitted of the bound.
fn beside_a_busy_proxy(
    light: usize,
    light_per_s: f64,
    join_ms: u64,
    ms: u64,
    poisson: bool,
    seed: u64,
) -> (usize, f64) {
    let mut setup = Setup::new(200, 1_000, 200, 1 + light as u64);
    setup.seed = seed;
    setup.jitter_ms = 3;
    let shape = |l: Load| if poisson { l.poisson() } else { l };
    let mut loads = vec![shape(Load::steady(0, 1_200.0, 0, ms))];
    for p in 1..=light {
        loads.push(shape(Load::steady(p, light_per_s, join_ms, ms)));
    }
    let mut fleet = Fleet::new(setup, loads);
    fleet.run(ms);
    assert!(fleet.worst <= 0.0, "{} beyond the bound", fleet.worst);
    let mut refusals = 0;
    for p in 1..=light {
        let first = fleet
            .answered
            .iter()
            .find(|a| a.proxy == p && a.fate == Fate::Admitted)
            .map_or(0, |a| a.decided_ms);
        refusals += fleet.count(Some(p), first, ms, refused);
    }
    let total = fleet.count(None, 0, ms, admitted);
    (refusals, total as f64 / setup.bound(ms))
}

/// Issue 33, item 3, as measured there: three proxies start together on a fresh key, one sent
/// 1 200 requests a second and two 20 (their max-min share: all of it). The two are never
/// refused once their first lease arrived, and the fleet admits within 5.5% of the bound — with
/// evenly spaced requests, and over ten runs of random (Poisson) arrivals.
#[test]
fn newcomers_under_their_fair_share_are_never_refused_and_the_fleet_uses_the_limit() {
    let (refusals, used) = beside_a_busy_proxy(2, 20.0, 0, 8_000, false, 1);
    eprintln!(
        "evenly spaced: {refusals} refusals, {:.1}% of the bound",
        used * 100.0
    );
    assert_eq!(refusals, 0);
    // 94.8% (95.2% while a lease that ran dry read its last request as part of the rate: the
    // busy proxy then got 7 tokens more of the 1 800; the Poisson runs below did not move).
    assert!(used >= 0.945, "{used}");
    // With random arrivals, over 8 s and over 20 s: what is not admitted is what the proxies
    // hold unspent and the reserve kept for newcomers, a few leases' worth in all, so the longer
    // the run the closer to the bound.
    for (ms, least) in [(8_000, 0.94), (20_000, 0.96)] {
        let runs: Vec<(usize, f64)> = (1..=10)
            .map(|seed| beside_a_busy_proxy(2, 20.0, 0, ms, true, seed))
            .collect();
        let mean = runs.iter().map(|r| r.1).sum::<f64>() / runs.len() as f64;
        eprintln!(
            "Poisson, {ms} ms: {runs:?}, mean {:.1}% of the bound",
            mean * 100.0
        );
        assert!(runs.iter().all(|r| r.0 == 0), "{runs:?}");
        assert!(
            mean >= least && runs.iter().all(|r| r.1 >= 0.93),
            "{runs:?}"
        );
    }
}

/// Newcomers that join a key one proxy has had to itself for seconds, and more of them: served
/// from the reserve at once, and from their shares once the busy proxy renews.
#[test]
fn newcomers_joining_a_busy_key_later_are_never_refused() {
    for (light, per_s, join_ms) in [(2, 20.0, 4_000), (4, 10.0, 0), (4, 10.0, 3_000)] {
        for seed in 1..=5 {
            let (refusals, used) = beside_a_busy_proxy(light, per_s, join_ms, 10_000, true, seed);
            assert_eq!(
                refusals, 0,
                "{light} × {per_s}/s from {join_ms} ms, seed {seed}"
            );
            assert!(used >= 0.93, "{used}");
        }
    }
}

/// Issue 33, item 2: the service loses its state (a memory store restarted) under load, for a
/// moment, for two seconds, and for longer than a lease. The proxies renewing their leases keep
/// their shares: from a second after the service answers again the fleet admits at least 90% of
/// the limit's rate, and never more than the bound.
#[test]
fn a_store_loss_under_load_refuses_nothing_the_limit_allows() {
    for outage_ms in [300, 2_000, 12_000] {
        for seed in 1..=3 {
            let mut setup = Setup::new(50, 1_000, 50, 2);
            setup.seed = seed;
            setup.jitter_ms = 3;
            let back = 3_000 + outage_ms;
            let ms = back + 4_000;
            let mut fleet = Fleet::new(
                setup,
                vec![
                    Load::steady(0, 50.0, 0, ms).poisson(),
                    Load::steady(1, 50.0, 0, ms).poisson(),
                ],
            )
            .with(Event::Outage {
                from_ms: 3_000,
                until_ms: back,
                lost: true,
            });
            fleet.run(ms);
            assert!(fleet.worst <= 0.0, "{} beyond the bound", fleet.worst);
            let per_100ms: Vec<usize> = (back..back + 3_000)
                .step_by(100)
                .map(|t| fleet.count(None, t, t + 100, admitted))
                .collect();
            let after = fleet.count(None, back + 1_000, back + 3_000, admitted);
            eprintln!("outage {outage_ms} ms, seed {seed}: admitted per 100 ms from the restart {per_100ms:?}");
            assert!(
                after as f64 >= 0.9 * 50.0 * 2.0,
                "{after} admitted in the 2 s from 1 s after"
            );
        }
    }
}

/// A store that loses its state before the proxies have measured their rates (they hold token
/// leases, not shares): traffic under the limit is still never refused once the service
/// answers again. The proxies renewing with evidence of the bucket take the rate it holds for
/// the holders of before (a replica failing over at a deployment's start, a restart within a
/// second of it).
#[test]
fn a_store_loss_while_proxies_hold_token_leases_refuses_nothing_under_the_limit() {
    for (at_ms, outage_ms) in [(300, 1), (300, 500), (700, 1)] {
        for seed in 1..=3 {
            let mut setup = Setup::new(50, 1_000, 50, 2);
            setup.seed = seed;
            setup.jitter_ms = 3;
            setup.lease_size = 6;
            let back = at_ms + outage_ms;
            let ms = back + 5_000;
            let mut fleet = Fleet::new(
                setup,
                vec![Load::steady(0, 20.0, 0, ms), Load::steady(1, 20.0, 0, ms)],
            )
            .with(Event::Outage {
                from_ms: at_ms,
                until_ms: back,
                lost: true,
            });
            fleet.run(ms);
            assert!(fleet.worst <= 0.0, "{} beyond the bound", fleet.worst);
            let refused = refused_from(&fleet, back);
            assert!(
                refused.is_empty(),
                "lost at {at_ms} ms, seed {seed}: {refused:?}"
            );
        }
    }
}

/// A loss while the proxies' demands are still being measured (half a second into the key's
/// traffic), three proxies at 90% of the limit between them, each with a share measured too low:
/// the first to renew asks for twice what it spent, but takes at most half as much again as its
/// share out of the rate held for the holders of before, so the last finds its part. Nobody is
/// refused (before: 9 to 13 requests of the last, for half a second).
#[test]
fn a_store_loss_during_the_first_second_refuses_nothing_under_the_limit() {
    for at_ms in [200, 350, 500, 650, 800, 1_000] {
        for seed in 1..=3 {
            let mut setup = Setup::new(60, 1_000, 60, 3);
            setup.seed = seed;
            setup.jitter_ms = 3;
            let back = at_ms + 100;
            let ms = back + 5_000;
            let mut fleet = Fleet::new(
                setup,
                (0..3).map(|p| Load::steady(p, 18.0, 0, ms)).collect(),
            )
            .with(Event::Outage {
                from_ms: at_ms,
                until_ms: back,
                lost: true,
            });
            fleet.run(ms);
            assert!(fleet.worst <= 0.0, "{} beyond the bound", fleet.worst);
            let refused = refused_from(&fleet, back);
            assert!(
                refused.is_empty(),
                "lost at {at_ms} ms, seed {seed}: {refused:?}"
            );
        }
    }
}

/// Issue 33, item 1: a settlement's debt reaches the service's bucket within a tick, so another
/// proxy that asks for the key afterwards is refused, with the true wait.
#[test]
fn a_debt_is_seen_by_every_proxy() {
    let mut setup = Setup::new(10_000, 60_000, 10_000, 2);
    setup.lease_size = 2_500;
    let streams = Load::steady(1, 5.0, 0, 2_000).settling(300, 2_000, 0, 2_000);
    let later = Load::steady(0, 5.0, 5_000, 7_000).settling(300, 300, 0, 1);
    let mut fleet = Fleet::new(setup, vec![streams, later]);
    fleet.run(8_000);
    assert!(fleet.worst <= 0.0, "{} beyond the bound", fleet.worst);
    let used = *fleet.used.last().unwrap();
    let told: Vec<u64> = fleet
        .answered
        .iter()
        .filter_map(|a| match a.fate {
            Fate::Refused { retry_after_ms } if a.proxy == 0 => Some(retry_after_ms),
            _ => None,
        })
        .collect();
    eprintln!(
        "streams used {used} tokens (bound by 8 s {}); then the other proxy was told to wait \
         {told:?} ms",
        setup.bound(8_000)
    );
    assert_eq!(fleet.count(Some(0), 0, 8_000, admitted), 0);
    // The bucket owes about 9 300 tokens at 5 s: about 56 s at 10 000 a minute, and the
    // request's own 300 (1.8 s); less as the streams' proxy gives back what it held.
    assert_eq!(told.len(), 10);
    assert!(
        told.iter().all(|&t| (50_000..60_000).contains(&t)),
        "{told:?}"
    );
}

/// One proxy alone: a request reserving 300 turns out to cost 20 000 of a 10 000-a-minute
/// budget. The key is refused until the debt and the next request's reservation have refilled
/// (61.8 s after the settlement), past the end of every lease (4 s here), and with the true
/// `Retry-After` counting down.
#[test]
fn a_debt_outlives_its_lease_and_is_repaid_before_anyone_is_admitted() {
    let mut setup = Setup::new(10_000, 60_000, 10_000, 1);
    setup.ttl_ms = 4_000;
    let one = Load::steady(0, 1.0, 0, 1).settling(300, 20_000, 0, 100);
    let then = Load::steady(0, 1.0, 1_000, 70_000).settling(300, 300, 0, 1);
    let mut fleet = Fleet::new(setup, vec![one, then]);
    fleet.run(70_000);
    assert!(fleet.worst <= 0.0, "{} beyond the bound", fleet.worst);
    let next = fleet
        .answered
        .iter()
        .filter(|a| a.arrived_ms > 0 && a.fate == Fate::Admitted)
        .map(|a| a.decided_ms)
        .next()
        .unwrap();
    eprintln!("admitted again at {next} ms");
    // (Requests come once a second.)
    assert!((61_800..=63_000).contains(&next), "{next}");
    for a in fleet
        .answered
        .iter()
        .filter(|a| a.decided_ms < next && a.arrived_ms > 0)
    {
        let Fate::Refused { retry_after_ms } = a.fate else {
            panic!("{a:?}");
        };
        // Never told to come back before the debt is repaid.
        assert!(a.decided_ms + retry_after_ms >= 61_800, "{a:?}");
    }
}

/// The owing proxy restarts after its call charged the debt: the debt stays, at the service.
#[test]
fn a_debt_survives_the_owing_proxys_restart() {
    let mut setup = Setup::new(10_000, 60_000, 10_000, 2);
    setup.lease_size = 2_500;
    let one = Load::steady(1, 1.0, 0, 1).settling(300, 20_000, 0, 100);
    let then = Load::steady(1, 2.0, 2_000, 10_000).settling(300, 300, 0, 1);
    let other = Load::steady(0, 2.0, 2_000, 10_000).settling(300, 300, 0, 1);
    let mut fleet = Fleet::new(setup, vec![one, then, other]).with(Event::Restart {
        proxy: 1,
        at_ms: 1_000,
    });
    fleet.run(10_000);
    assert!(fleet.worst <= 0.0, "{} beyond the bound", fleet.worst);
    assert_eq!(fleet.count(None, 500, 10_000, admitted), 0);
}

mod bound {
    use super::sim::{Event, Fleet, Load, Setup};
    use proptest::prelude::*;
    use tollgate_core::global::lease::ColdStart;

    fn load(proxies: usize) -> impl Strategy<Value = Load> {
        (
            0..proxies,
            0u64..3_000,
            1u64..3_000,
            1.0f64..120.0,
            any::<bool>(),
            (1u64..20, 0u64..3, 0u64..40, 0u64..800),
        )
            .prop_map(
                |(proxy, from, len, per_s, poisson, (cost, lo, spread, dur))| {
                    let l = Load::steady(proxy, per_s, from, from + len);
                    let l = if poisson { l.poisson() } else { l };
                    // Reserve `cost`, turn out to cost from a fraction of it to several times it.
                    let actual = cost * lo / 2;
                    l.settling(cost, actual, actual + spread, dur)
                },
            )
    }

    fn event(proxies: usize) -> impl Strategy<Value = Event> {
        prop_oneof![
            (0u64..4_000, 1u64..2_500, any::<bool>()).prop_map(|(from, len, lost)| {
                Event::Outage {
                    from_ms: from,
                    until_ms: from + len,
                    lost,
                }
            }),
            (0..proxies, 0u64..4_000).prop_map(|(proxy, at)| Event::Restart { proxy, at_ms: at }),
        ]
    }

    proptest! {
        // 256 cases in `make test`; `make fuzz` runs FUZZ_CASES (PROPTEST_CASES).
        #![proptest_config(ProptestConfig {
            cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256),
            ..ProptestConfig::default()
        })]

        /// Across several proxies, at every admission: what the fleet settled plus what it has
        /// reserved in flight is within what the service handed out (`burst + rate × t`), plus
        /// the excess not yet charged to the service, plus the bucket's debt beyond what proxies
        /// still hold — through settlements of any size, service outages and losses of its
        /// state, proxy restarts and slow calls.
        #[test]
        fn the_fleet_stays_within_what_the_service_handed_out(
            loads in prop::collection::vec(load(3), 1..6),
            events in prop::collection::vec(event(3), 0..3),
            (requests, burst) in (1u64..200, 1u64..200),
            ttl_ms in 400u64..4_000,
            rtt_ms in 1u64..30,
            jitter_ms in 0u64..20,
            conservative in any::<bool>(),
            seed in any::<u64>(),
        ) {
            let mut setup = Setup::new(requests, 1_000, burst, 3);
            setup.ttl_ms = ttl_ms;
            setup.rtt_ms = rtt_ms;
            setup.jitter_ms = jitter_ms;
            setup.seed = seed;
            if conservative {
                setup.cold = ColdStart::Conservative { epoch_ms: 0 };
            }
            let mut fleet = Fleet::new(setup, loads);
            for e in events {
                fleet = fleet.with(e);
            }
            fleet.run(6_000);
            prop_assert!(fleet.worst <= 0.0, "{} tokens beyond the bound", fleet.worst);
        }
    }
}

/// A new deployment under `ColdStart::Auto` admits its burst at once, from one proxy or several
/// (less, for several that each want more than their share of a rate, the reserve they leave
/// for newcomers: an eighth of the burst).
#[test]
fn a_new_deployment_admits_its_burst_at_once() {
    for proxies in [1, 3] {
        // 50/s, burst 20; every proxy is sent a request every ms for 50 ms.
        let setup = Setup::new(50, 1_000, 20, proxies as u64);
        let loads = (0..proxies)
            .map(|p| Load::steady(p, 1_000.0, 0, 50))
            .collect();
        let mut fleet = Fleet::new(setup, loads);
        fleet.run(150);
        // The first lease takes a tick and a call; then the burst is spent as fast as leases
        // come (one lease size a tick per proxy), waiting only for refills, within the bound.
        let admitted = fleet.count(None, 0, 150, admitted);
        let reserve = if proxies > 1 { 20 / 8 } else { 0 };
        assert!(
            (20 - reserve..=27).contains(&admitted),
            "{proxies} proxies: {admitted}"
        );
        assert!(fleet.worst <= 0.0);
    }
}

/// Three proxies far over a limit (6 000 requests a second against 50) share it with few calls:
/// each renews its capped lease every sixteenth of a term, and asks in between only when the
/// bucket has tokens for it.
#[test]
fn proxies_over_the_limit_use_it_with_few_calls() {
    let mut setup = Setup::new(50, 1_000, 50, 3);
    setup.ttl_ms = 4_000;
    let loads = (0..3).map(|p| Load::steady(p, 2_000.0, 0, 8_000)).collect();
    let mut fleet = Fleet::new(setup, loads);
    fleet.run(8_000);
    let admitted = fleet.count(None, 0, 8_000, admitted);
    eprintln!(
        "{admitted} admitted of {}, {} calls",
        setup.bound(8_000),
        fleet.calls
    );
    assert!(fleet.worst <= 0.0);
    assert!(admitted as f64 >= 0.95 * setup.bound(8_000), "{admitted}");
    // 8 s of renewals every 250 ms by three proxies: 96, and a few to find their shares.
    assert!(fleet.calls <= 3 * (32 + 10), "{} calls", fleet.calls);
}
