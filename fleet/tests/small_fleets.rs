//! Small fleets for `make test` (seconds): the bound holds for every workload, across a crash, a
//! store loss and a partition, and false refusals stay under the ceilings docs/scale.md states.

use tollgate_fleet::{run, Event, Keys, Report, Scenario};

const HOT: (u64, u64, u64) = (1_000, 1_000, 1_000);

fn hot(proxies: usize) -> Scenario {
    // 2 000 requests a second over the fleet for a key of 1 000 a second: 2× over.
    let mut s = Scenario::new("hot", proxies, Keys::Hot, HOT, 2_000.0);
    s.seconds = 6;
    s
}

fn zipf(name: &str) -> Scenario {
    // 10 proxies, 2 000 requests a second over Zipf(1.1) of 10 000 keys of 100 a second each.
    let mut s = Scenario::new(
        name,
        10,
        Keys::Zipf { n: 10_000, s: 1.1 },
        (100, 1_000, 100),
        2_000.0,
    );
    s.seconds = 5;
    s
}

fn false_share(r: &Report) -> f64 {
    r.false_refusals as f64 / r.requests.max(1) as f64
}

fn check(s: &Scenario, ceiling: f64) -> Report {
    let r = run(s);
    assert!(
        r.worst_excess <= 0.0,
        "{}: {} over the bound: {r:?}",
        s.name,
        r.worst_excess
    );
    assert!(r.admitted > 0 && r.requests > 0, "{}: {r:?}", s.name);
    assert!(
        false_share(&r) <= ceiling,
        "{} × {}: {:.2}% false refusals",
        s.name,
        s.proxies,
        false_share(&r) * 100.0
    );
    r
}

#[test]
fn a_hot_key_over_its_limit_admits_its_rate_and_no_more() {
    for proxies in [10, 50] {
        let r = check(&hot(proxies), 0.02);
        // 2× over: about half admitted (the burst on top at the start).
        let share = r.admitted as f64 / r.requests as f64;
        assert!((0.45..0.65).contains(&share), "{proxies}: {share}");
    }
}

#[test]
fn shares_follow_demand_that_moves_between_proxies() {
    let mut s = hot(50);
    s.shift_ms = 2_000;
    let r = check(&s, 0.03);
    assert!(r.follow_ms.is_some_and(|f| f <= 1_500), "{:?}", r.follow_ms);
}

#[test]
fn the_bound_holds_across_a_crash_a_store_loss_and_a_partition() {
    let mut crash = hot(20);
    crash.events.push(Event::Crash {
        at_ms: 3_000,
        share: 0.1,
    });
    check(&crash, 0.02);
    let mut loss = hot(20);
    loss.events.push(Event::StoreLoss { at_ms: 3_000 });
    check(&loss, 0.02);
    let mut cut = hot(20);
    cut.events.push(Event::Partition {
        from_ms: 2_000,
        until_ms: 4_000,
        share: 0.1,
    });
    let r = check(&cut, 0.02);
    // The cut-off proxies decided by the failure mode meanwhile.
    assert!(r.fell_back > 0, "{r:?}");
}

#[test]
fn many_keys_keep_the_bound_and_batch_their_items() {
    let r = check(&zipf("zipf"), 0.05);
    assert!(r.keys_seen > 1_000, "{r:?}");
}

#[test]
fn a_slow_lossy_network_keeps_the_bound() {
    // Round trips of 10 to 50 ms, 5% of the calls lost (each fails after the 200 ms timeout:
    // the proxy falls back, then asks again).
    let mut s = zipf("lossy");
    s.rtt_ms = 10;
    s.rtt_jitter_ms = 40;
    s.call_loss = 0.05;
    let r = check(&s, 0.05);
    assert!(r.fell_back > 0, "{r:?}");
}

#[test]
fn a_run_is_the_same_for_the_same_seed() {
    let a = run(&hot(10));
    let b = run(&hot(10));
    assert_eq!(
        (a.admitted, a.refused, a.calls),
        (b.admitted, b.refused, b.calls)
    );
}

#[test]
fn bursts_of_four_times_the_rate_keep_the_bound() {
    let mut s = hot(20);
    s.bursts_ms = 2_000;
    let r = check(&s, 0.02);
    // The bursts came (more requests than the steady rate sends) and were limited.
    assert!(r.requests > 2_000 * 6 * 5 / 4, "{r:?}");
    assert!(r.refused > 0, "{r:?}");
}

/// Keys each proxy sees rarely, under their limit (2 a second of 5, over 50 proxies: a proxy sees
/// a key every 25 s), for 20 s. A lease that one request spent just after its grant used to ask
/// for the key's whole rate, which the service reserved to it for a lease term: 30% refused
/// falsely in the first 5 s (60% at 1 000 proxies); and a proxy whose last answer, long ended, had
/// granted nothing asked for the whole rate again, so that false refusals grew with time (2.4%
/// over these 20 s with the first fixed alone). Now 0.5%.
#[test]
fn keys_each_proxy_sees_rarely_are_not_refused_under_their_limit() {
    let mut s = Scenario::new("uniform", 50, Keys::Uniform(1_000), (5, 1_000, 10), 2_000.0);
    s.seconds = 20;
    check(&s, 0.012);
}
