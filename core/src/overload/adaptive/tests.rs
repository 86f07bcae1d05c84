//! Estimates, probes, priorities, fairness and CPU reports over simulated upstreams.

use super::simulated::{every, jittered, over, poisson, Tick, Upstream, MS, TICK_NS};
use super::*;
use proptest::prelude::*;

fn latency() -> Adaptive {
    Adaptive::new(
        10,
        100 * MS,
        1_000 * MS,
        10_000 * MS,
        Signal {
            latency_factor: 2_000,
            cpu: None,
        },
    )
    .unwrap()
}

fn cpu() -> Adaptive {
    Adaptive::new(
        10,
        100 * MS,
        1_000 * MS,
        10_000 * MS,
        Signal {
            latency_factor: 2_000,
            cpu: Some(Cpu {
                threshold: 800,
                decay: 950,
            }),
        },
    )
    .unwrap()
}

fn admitted(a: &Adaptive, w: &Window, now: u64) -> Window {
    match a.admit(w, now, Seat::default(), MILLI) {
        Admission::Admit(w) => w,
        Admission::Refuse(_) => panic!("refused at {now}"),
    }
}

/// 100 requests per 100 ms bucket, each taking `rt_us`, for `ms` ms from `start`.
fn steady(
    a: &Adaptive,
    mut w: Window,
    start: u64,
    ms: u64,
    rt_us: u64,
    cpu: Option<u64>,
) -> Window {
    for t in (start..start + ms * MS).step_by(MS as usize) {
        w = admitted(a, &w, t);
        w = a.complete(&w, t + rt_us * 1_000, Seat::default(), rt_us, cpu);
    }
    w
}

#[test]
fn capacity_is_throughput_times_the_minimum_response_time() {
    let a = latency();
    // One request per ms (1000/s), 20 ms each: 20 in flight.
    let w = steady(&a, Window::default(), 0, 1_000, 20_000, None);
    assert_eq!(a.capacity(&w), Some((20, 20_000)));
}

#[test]
fn refuses_only_when_full_and_overloaded_and_stays_on_for_the_cool_down() {
    let a = latency();
    let mut w = steady(&a, Window::default(), 0, 1_000, 20_000, None);
    let now = 1_000 * MS;
    // Full (20 in flight) but the latency is not inflated: admitted.
    for _ in 0..20 {
        w = admitted(&a, &w, now);
    }
    assert!(!a.overloaded(&w, now));
    w = admitted(&a, &w, now);
    // The upstream slows to 5× its minimum: the window's mean passes twice the minimum.
    for _ in 0..400 {
        w = a.complete(&w, now, Seat::default(), 100_000, None);
    }
    assert_eq!(w.in_flight(), 0);
    // Capacity 20 (while the signal is on, no headroom).
    for _ in 0..20 {
        w = admitted(&a, &w, now);
    }
    assert!(a.overloaded(&w, now));
    let Admission::Refuse(w) = a.admit(&w, now, Seat::default(), MILLI) else {
        panic!("admitted")
    };
    // The cool-down keeps the signal on after the slow answers leave the window.
    let later = now + 1_200 * MS;
    let w2 = a.advance(&w, later);
    assert!(!a.overloaded(&w2, later), "window gone, cool-down over");
    assert!(a.overloaded(&w, now + 900 * MS));
}

/// Capacity 20, the latency signal on, nothing in flight, at 1 s.
fn overloaded_window(a: &Adaptive) -> Window {
    let mut w = steady(a, Window::default(), 0, 1_000, 20_000, None);
    for _ in 0..400 {
        w = a.complete(
            &a.advance(&w, 1_000 * MS),
            1_000 * MS,
            Seat::default(),
            100_000,
            None,
        );
    }
    w.in_flight = [0; LEVELS];
    assert!(a.overloaded(&w, 1_000 * MS));
    w
}

/// Admit requests of `seat` until one is refused; how many were admitted.
fn fill(a: &Adaptive, w: &mut Window, now: u64, seat: Seat, share: u64) -> u64 {
    for n in 0..1_000 {
        match a.admit(w, now, seat, share) {
            Admission::Admit(next) => *w = next,
            Admission::Refuse(next) => {
                *w = next;
                return n;
            }
        }
    }
    panic!("never refused")
}

#[test]
fn the_cool_down_keeps_the_capacity_measured_while_overloaded() {
    let a = latency();
    let mut w = overloaded_window(&a);
    let now = 1_000 * MS;
    assert_eq!(fill(&a, &mut w, now, Seat::default(), MILLI), 20);
    assert_eq!((w.latched, w.refused_ns, w.hot), (20, now, stamp(now)));
    // The next second the upstream is quick again but passes half as many (lower levels
    // held back): its own estimate would be 10.
    let mut calm = a.advance(&w, now);
    calm.buckets = [Bucket::default(); MAX_BUCKETS];
    calm.in_flight = [0; LEVELS];
    for t in (now..now + 1_000 * MS).step_by(2 * MS as usize) {
        calm = a.complete(
            &admitted(&a, &calm, t),
            t + 20 * MS,
            Seat::default(),
            20_000,
            None,
        );
    }
    assert_eq!(a.capacity(&calm).map(|c| c.0), Some(10));
    assert!(!a.hot(&calm));
    let t = now + 900 * MS;
    calm.in_flight = [20, 0, 0, 0];
    assert!(matches!(
        a.admit(&calm, t, Seat::default(), MILLI),
        Admission::Admit(_)
    ));
    // In the cool-down: the latched 20 and a headroom of ⌈√20⌉ = 5.
    calm.in_flight = [25, 0, 0, 0];
    let Admission::Refuse(after) = a.admit(&calm, t, Seat::default(), MILLI) else {
        panic!("admitted past the latched capacity and its headroom in the cool-down")
    };
    assert_eq!((after.latched, after.refused_ns), (20, t));
    // With the latency signal a refusal extends the cool-down (shedding keeps the answers
    // quick); one cool-down after the last one, everything goes again.
    assert!(matches!(
        a.admit(&after, t + 900 * MS, Seat::default(), MILLI),
        Admission::Refuse(_)
    ));
    assert!(matches!(
        a.admit(&after, t + 1_001 * MS, Seat::default(), MILLI),
        Admission::Admit(_)
    ));
}

#[test]
fn with_the_cpu_signal_the_cool_down_ends_one_cool_down_after_the_signal_whatever_refuses() {
    let a = cpu();
    // 1 000/s at 20 ms: capacity 20; the upstream reports 95% CPU.
    let mut w = steady(&a, Window::default(), 0, 1_000, 20_000, Some(950));
    let now = 1_000 * MS;
    assert_eq!(fill(&a, &mut w, now, Seat::default(), MILLI), 20);
    // Then it scales out: it reports 40% (the average falls below the threshold within a
    // few answers), and requests keep coming faster than the estimate.
    for _ in 0..20 {
        w = a.complete(&w, now, Seat::default(), 20_000, Some(400));
    }
    assert!(!a.hot(&w));
    w.in_flight = [25, 0, 0, 0];
    // Within the cool-down of the signal: still refused, and the refusals do not extend it.
    let mut t = now + 100 * MS;
    while t < now + 990 * MS {
        w = match a.admit(&w, t, Seat::default(), MILLI) {
            Admission::Refuse(next) => next,
            Admission::Admit(_) => panic!("admitted within the cool-down at {t}"),
        };
        // Reports keep saying 40%.
        w = a.complete(
            &a.occupy(&w, t, Seat::default()),
            t,
            Seat::default(),
            20_000,
            Some(400),
        );
        t += 10 * MS;
    }
    // One cool-down after the signal was last on: admitted, however many were refused.
    assert!(matches!(
        a.admit(&w, now + 1_001 * MS, Seat::default(), MILLI),
        Admission::Admit(_)
    ));
}

#[test]
fn a_slower_and_then_faster_upstream_is_followed_within_seconds() {
    let a = latency();
    // 10 at once, 50 ms each (200/s), offered 300/s; at 5 s the service time doubles
    // (100/s), at 15 s it is back to 50 ms.
    let mut up = Upstream::new(10);
    let service = |t: u64| {
        if (5_000..15_000).contains(&(t / MS)) {
            100 * MS
        } else {
            50 * MS
        }
    };
    let (_, ticks) = up.run(
        &a,
        Window::default(),
        0,
        every(0, 25_000 * MS, 3_333_333),
        service,
    );
    let (before, _) = over(&ticks, 30, 50);
    assert!(before >= 190.0, "{before}/s before: {:?}", &ticks[30..50]);
    // From 3 s after each change: goodput within 20% of the new capacity, and no queue
    // (the slowest answer within twice the new service time).
    let (slow, slowest) = over(&ticks, 80, 150);
    assert!(slow >= 80.0, "{slow}/s while slow: {:?}", &ticks[50..90]);
    assert!(
        slowest <= 200,
        "{slowest} ms while slow: {:?}",
        &ticks[50..90]
    );
    let (fast, slowest) = over(&ticks, 180, 250);
    assert!(
        fast >= 160.0,
        "{fast}/s when fast again: {:?}",
        &ticks[150..190]
    );
    assert!(
        slowest <= 100,
        "{slowest} ms when fast again: {:?}",
        &ticks[150..190]
    );
    // The minimum follows the service time.
    assert_eq!(ticks[140].min_rt_us / 1_000, 100, "{:?}", &ticks[50..150]);
    assert_eq!(ticks[240].min_rt_us / 1_000, 50);
}

/// What one change of the service time did to goodput: the service times before and after
/// (ms), and the least goodput of any half-second and of any second from it until the next
/// change, over the new capacity.
#[derive(Debug, Clone, Copy)]
struct Change {
    from_ms: u64,
    to_ms: u64,
    half: f64,
    second: f64,
}

/// The least goodput (requests admitted by when they were due, as the load generator counts
/// them) per `ticks_per` ticks over `ticks`, over `capacity` a second.
fn least_goodput(ticks: &[Tick], ticks_per: usize, capacity: f64) -> f64 {
    let per_s = (1_000 * MS / TICK_NS) as f64 / ticks_per as f64;
    ticks
        .chunks_exact(ticks_per)
        .map(|span| span.iter().map(|t| t.admitted).sum::<u64>() as f64 * per_s / capacity)
        .fold(f64::INFINITY, f64::min)
}

/// An upstream of 10 workers under Poisson arrivals at 300/s drawn from `seed`, its service
/// time (jittered by up to 5%) 50 ms for 5 s and then each of `service_ms` for 10 s in turn
/// (the minimum response time is remembered for 10 to 20 s: every slowdown finds the old
/// one).
fn changes(a: &Adaptive, seed: u64, service_ms: &[u64]) -> Vec<Change> {
    const WORKERS: u64 = 10;
    const SEGMENT_NS: u64 = 10_000 * MS;
    let mut up = Upstream::new(WORKERS as usize);
    let warm = 5_000 * MS;
    let (mut w, _) = up.run(
        a,
        Window::default(),
        0,
        poisson(0, warm, 300.0, seed << 8),
        jittered(50, seed << 8),
    );
    let mut out = Vec::new();
    let mut before = 50;
    for (i, &ms) in service_ms.iter().enumerate() {
        let from = warm + i as u64 * SEGMENT_NS;
        let stream = (seed << 8) + i as u64 + 1;
        let (next, mut ticks) = up.run(
            a,
            w,
            from,
            poisson(from, from + SEGMENT_NS, 300.0, stream),
            jittered(ms, stream),
        );
        w = next;
        ticks.truncate((SEGMENT_NS / TICK_NS) as usize);
        let capacity = (WORKERS * 1_000 / ms) as f64;
        out.push(Change {
            from_ms: before,
            to_ms: ms,
            half: least_goodput(&ticks, 5, capacity),
            second: least_goodput(&ticks, 10, capacity),
        });
        before = ms;
    }
    out
}

#[test]
fn after_a_change_of_service_time_goodput_stays_above_half_the_new_capacity() {
    // 20 seeds × 20 changes: 50 → 100 → 50 → 200 → 50 ms, five times. Goodput from the change
    // on, by when requests were due: per half-second between 50 and 100 ms; per second when
    // 200 ms is on either side (a probe at half the estimate lasts two service times and more,
    // and requests admitted at 200 ms hold the upstream for a while after it got faster).
    let a = latency();
    let schedule: Vec<u64> = [100, 50, 200, 50].repeat(5);
    let mut all: Vec<(u64, Change)> = Vec::new();
    for seed in 0..20 {
        all.extend(changes(&a, seed, &schedule).into_iter().map(|c| (seed, c)));
    }
    for (from, to) in [(50, 100), (100, 50), (50, 200), (200, 50)] {
        let of: Vec<&Change> = all
            .iter()
            .map(|(_, c)| c)
            .filter(|c| (c.from_ms, c.to_ms) == (from, to))
            .collect();
        let least = |f: fn(&Change) -> f64| of.iter().map(|&c| f(c)).fold(f64::INFINITY, f64::min);
        let below = |f: fn(&Change) -> f64| of.iter().filter(|&&c| f(c) < 0.5).count();
        eprintln!(
            "{from} -> {to} ms, {} changes: least goodput per half-second {:.0}% of the new \
             capacity ({} below 50%), per second {:.0}% ({} below 50%)",
            of.len(),
            least(|c| c.half) * 100.0,
            below(|c| c.half),
            least(|c| c.second) * 100.0,
            below(|c| c.second),
        );
    }
    let low: Vec<_> = all
        .iter()
        .filter(|(_, c)| {
            let measure = if c.from_ms.max(c.to_ms) <= 100 {
                c.half
            } else {
                c.second
            };
            measure < 0.5
        })
        .collect();
    assert!(
        low.is_empty(),
        "{} of {} changes (seed, change) fell below half the new capacity: {low:?}",
        low.len(),
        all.len()
    );
}

#[test]
fn an_upstream_that_lost_workers_is_still_shed() {
    // 10 workers at 50 ms under Poisson arrivals at 300/s; at 5 s half the workers go (100/s),
    // at 15 s the service time doubles as well (50/s). The capacity carried over a change of
    // the service time must not hold the limit at what the upstream could do before: from 2 s
    // after each change, goodput at its new capacity and no queue past what the latency signal
    // lets stand (twice the service time).
    let a = latency();
    for seed in 0..5 {
        let mut up = Upstream::new(10);
        let arrivals = |from: u64, stream: u64| poisson(from, from + 10_000 * MS, 300.0, stream);
        let warm = poisson(0, 5_000 * MS, 300.0, seed);
        let (w, _) = up.run(&a, Window::default(), 0, warm, jittered(50, seed));
        up.set_workers(5);
        let fewer = arrivals(5_000 * MS, seed + 100);
        let (w, fewer) = up.run(&a, w, 5_000 * MS, fewer, jittered(50, seed + 100));
        let slower = arrivals(15_000 * MS, seed + 200);
        let (_, slower) = up.run(&a, w, 15_000 * MS, slower, jittered(100, seed + 200));
        for (ticks, capacity, service_ms) in [(fewer, 100.0, 50), (slower, 50.0, 100)] {
            let (goodput, slowest) = over(&ticks, 20, 100);
            assert!(
                goodput >= capacity * 0.9 && slowest * 2 <= service_ms * 5,
                "seed {seed}, {service_ms} ms: {goodput}/s, slowest {slowest} ms"
            );
        }
    }
}

#[test]
fn a_standing_queue_does_not_pass_for_the_service_time() {
    let a = latency();
    // 10 at once, 50 ms each (200/s): warm at 100/s, then 400/s for 20 s. The queue that
    // forms before the signal comes on is drained and the minimum stays the service time.
    let mut up = Upstream::new(10);
    let (w, _) = up.run(
        &a,
        Window::default(),
        0,
        every(0, 2_000 * MS, 10 * MS),
        |_| 50 * MS,
    );
    let (_, ticks) = up.run(
        &a,
        w,
        2_000 * MS,
        every(2_000 * MS, 22_000 * MS, 2_500_000),
        |_| 50 * MS,
    );
    assert!(
        ticks
            .iter()
            .all(|t| t.min_rt_us == 0 || t.min_rt_us <= 60_000),
        "{ticks:?}"
    );
    let (goodput, slowest) = over(&ticks, 50, 200);
    assert!(goodput >= 180.0, "{goodput}/s");
    assert!(slowest <= 150, "{slowest} ms");
}

#[test]
fn lower_levels_are_refused_first_and_the_highest_may_use_everything() {
    let a = latency();
    let mut w = overloaded_window(&a);
    let now = 1_000 * MS;
    let low = Seat {
        level: 0,
        flow: None,
    };
    let high = Seat {
        level: 3,
        flow: None,
    };
    assert_eq!(fill(&a, &mut w, now, low, 600), 12);
    // The highest level counts only itself: it may use the whole capacity (the low
    // requests in flight end and are not replaced).
    assert_eq!(fill(&a, &mut w, now, high, MILLI), 20);
    w = a.abandon(&w, now, high);
    for _ in 0..10 {
        w = a.abandon(&w, now, low);
    }
    // 2 low and 19 high in flight: room for a high request, not for a low one.
    assert!(matches!(a.admit(&w, now, low, 600), Admission::Refuse(_)));
    assert!(matches!(a.admit(&w, now, high, MILLI), Admission::Admit(_)));
}

#[test]
fn flows_of_a_level_share_it_equally() {
    let a = latency();
    let mut w = overloaded_window(&a);
    let now = 1_000 * MS;
    let seat = |f| Seat {
        level: 0,
        flow: Some(f),
    };
    // Alone, a flow may use the whole allowance.
    assert_eq!(fill(&a, &mut w, now, seat(1), MILLI), 20);
    for _ in 0..12 {
        w = a.abandon(&w, now, seat(1));
    }
    // With a second flow in flight, each may hold half.
    assert_eq!(fill(&a, &mut w, now, seat(2), MILLI), 10);
    assert!(matches!(
        a.admit(&w, now, seat(1), MILLI),
        Admission::Admit(_)
    ));
    assert_eq!(fill(&a, &mut w, now, seat(1), MILLI), 2);
    assert_eq!(w.flows[1], 10);
}

#[test]
fn flows_share_what_their_level_may_use_among_the_flows_of_that_level() {
    let a = latency();
    let mut w = overloaded_window(&a);
    let now = 1_000 * MS;
    // 6 of the 20 held by a flow of a higher level: the default level's two flows share 14
    // (its share, 1.0 here, less what is above it).
    let high = Seat {
        level: 3,
        flow: Some(5),
    };
    for _ in 0..6 {
        w = a.occupy(&w, now, high);
    }
    let low = |f| Seat {
        level: 1,
        flow: Some(f),
    };
    w = a.occupy(&w, now, low(2));
    assert_eq!(fill(&a, &mut w, now, low(1), MILLI), 7);
    assert_eq!(fill(&a, &mut w, now, low(2), MILLI), 6);
}

#[test]
fn the_cpu_signal_is_a_moving_average_against_the_threshold() {
    let a = cpu();
    let mut w = steady(&a, Window::default(), 0, 200, 1_000, Some(500));
    assert_eq!(w.cpu_milli(), Some(500));
    assert!(!a.overloaded(&w, 200 * MS));
    // One report of 100% moves the average by 5% of the gap only.
    w = a.complete(
        &admitted(&a, &w, 200 * MS),
        201 * MS,
        Seat::default(),
        1_000,
        Some(1_000),
    );
    assert_eq!(w.cpu_milli(), Some(525));
    w = steady(&a, w, 202 * MS, 200, 1_000, Some(1_000));
    assert!(a.overloaded(&w, 402 * MS), "{:?}", w.cpu_milli());
}

#[test]
fn without_recent_cpu_reports_the_signal_is_latency() {
    let a = cpu();
    // No report at all: slow answers are the signal.
    let w = steady(&a, Window::default(), 0, 1_000, 20_000, None);
    let w = steady(&a, w, 1_000 * MS, 300, 100_000, None);
    assert!(a.hot(&w));
    // Reports of a calm CPU: not overloaded, however slow.
    let w = steady(&a, w, 1_300 * MS, 300, 100_000, Some(300));
    assert!(!a.hot(&w));
    // The reports stop for longer than the window: latency again (until a probe of the
    // minimum, from the first of these answers for 200 ms, finds they are the service time now).
    let w = steady(&a, w, 2_700 * MS, 100, 100_000, None);
    assert!(a.hot(&w));
}

#[test]
fn buckets_that_leave_the_window_are_forgotten() {
    let a = latency();
    let w = steady(&a, Window::default(), 0, 500, 20_000, None);
    assert!(a.capacity(&w).is_some());
    let w = a.advance(&w, 2_000 * MS);
    assert_eq!(a.capacity(&w), None);
}

#[test]
fn bad_parameters_are_refused() {
    let latency = Signal {
        latency_factor: 2_000,
        cpu: None,
    };
    assert!(Adaptive::new(1, MS, 0, MS, latency).is_none());
    assert!(Adaptive::new(17, MS, 0, MS, latency).is_none());
    assert!(Adaptive::new(10, 0, 0, MS, latency).is_none());
    assert!(Adaptive::new(10, MS, 0, 0, latency).is_none());
    let flat = Signal {
        latency_factor: 1_000,
        cpu: None,
    };
    assert!(Adaptive::new(10, MS, 0, MS, flat).is_none());
    assert!(Adaptive::new(
        10,
        MS,
        0,
        MS,
        Signal {
            latency_factor: 2_000,
            cpu: Some(Cpu {
                threshold: 800,
                decay: 1_000
            })
        }
    )
    .is_none());
}

proptest! {
    #[test]
    fn encoding_round_trips_and_in_flight_never_underflows(
        events in prop::collection::vec(
            (0u64..3, 0u64..50, 0u64..200_000, 0u8..6, prop::option::of(0u8..20)),
            0..300,
        ),
    ) {
        let a = cpu();
        let mut w = Window::default();
        let mut now = 0;
        let mut held = Vec::new();
        for (kind, step_ms, rt, level, flow) in events {
            now += step_ms * MS;
            let seat = Seat { level, flow };
            w = match kind {
                0 => match a.admit(&w, now, seat, rt % 1_200) {
                    Admission::Admit(w) => {
                        held.push(seat);
                        w
                    }
                    Admission::Refuse(w) => w,
                },
                1 => match held.pop() {
                    Some(seat) => a.complete(&w, now, seat, rt, Some(rt % 1_200)),
                    None => w,
                },
                _ => match held.pop() {
                    Some(seat) => a.abandon(&w, now, seat),
                    None => w,
                },
            };
            prop_assert_eq!(w.in_flight(), held.len() as u64);
            prop_assert_eq!(
                w.flows.iter().map(|&n| u64::from(n)).sum::<u64>(),
                held.iter().filter(|s| s.flow.is_some()).count() as u64
            );
            prop_assert_eq!(Window::decode(&w.encode()), w);
            prop_assert!(w.in_flight() < 1_000);
        }
    }
}
