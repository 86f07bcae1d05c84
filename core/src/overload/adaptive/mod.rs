//! Adaptive concurrency (BBR-style shedding, as in Kratos and go-zero): the capacity of an upstream
//! estimated from what it did lately, by Little's law (in flight = throughput × response time).
//!
//! A window of buckets (default 10 × 100 ms) records the requests that completed in each and their
//! minimum response time. Estimated capacity = the most completions of any full bucket (of any run
//! of full buckets as long as the minimum, if it is longer than one), per second, × the minimum
//! response time. A request is refused when the in-flight count has reached the
//! capacity (with a headroom of its square root, so that an estimate held low by the limit itself
//! can grow) *and* the limit is engaged: the overload signal is on — the upstream's own CPU (an EWMA
//! of what it reports) above a threshold, or, without such reports, the window's mean response
//! time inflated past a factor of the minimum — or was within a cool-down. The cool-down runs from
//! the last time the signal was on; with the latency signal also from the last refusal (shedding
//! keeps response times normal, so the latency alone would let go and refill the queue).
//!
//! The minimum response time is remembered longer than the window (a sliding minimum over one to
//! two `min_rt_period`s): a queue that stands at the upstream inflates every response time of a
//! window alike, and a window's own minimum would take the queue for the service time. When no
//! answer has come close to that minimum for a window while the signal is on, the minimum is
//! *probed*: for twice the window's mean response time (and on until one of its requests is
//! answered) the limit admits half the estimate, so that no queue can stand, and the least response
//! time of the requests it admitted replaces the minimum — the upstream's new service time if it
//! got slower, the old one if a queue had stood. An answer more than an eighth under the minimum
//! lowers it at once: the upstream got faster.
//!
//! When the minimum moves with the service time, the window's throughput is of the service time
//! before: buckets from before the move no longer count, and the estimate does not fall below the
//! capacity *carried* over — the one measured when an answer last confirmed the minimum, which an
//! upstream of workers still holds at its new service time. (Without it, a slower upstream's lower
//! throughput × the old minimum shrank the estimate, which shrank the throughput: a spiral down to
//! an estimate of 1 or 2 before the probe, and a probe at half of that measured little.) What is
//! carried holds until a window has been measured at the new minimum; a probe that finds the old
//! minimum (a queue had stood, or the upstream lost workers) drops it.
//! The capacity measured while the signal itself was on is kept through the cool-down, so that
//! refusals that hold the in-flight count below it (lower priorities) do not shrink the estimate.
//!
//! Priorities: each request has a level (higher is more important) and its level a share of the
//! capacity; while the signal is on, a request is admitted if the in-flight count of its level and
//! above is below that share. Optionally each request belongs to a flow (a tenant), and a flow may
//! hold at most an equal part of what its level may use (its share less what higher levels hold)
//! among the flows of its level with requests in flight.
//!
//! Everything is a pure function of the encoded state and the time passed in.

#[cfg(test)]
mod simulated;
#[cfg(test)]
mod tests;
mod window;

use crate::state::saturating_u32;

/// Most buckets a window may have.
pub const MAX_BUCKETS: usize = 16;
/// Priority levels (0 the lowest).
pub const LEVELS: usize = 4;
/// Flows counted for fairness: flow keys hash into this many counters.
pub const FLOWS: usize = 16;
const HEADER_BYTES: usize = 128;
// The in-flight counts fit in their places, and the flows' levels in two bits each of a u32.
const _: () = assert!(40 + FLOWS * 2 <= 72 && 24 + LEVELS * 4 <= 40 && LEVELS <= 4 && FLOWS <= 16);
/// Bytes of an encoded [`Window`].
pub const WINDOW_BYTES: usize = HEADER_BYTES + MAX_BUCKETS * 8;
/// The encoding of a [`Window`]: one more each time it changes (a window is named with it).
pub const WINDOW_LAYOUT: u32 = 2;

/// Fixed-point scale of ratios (threshold, decay, factor, share, signal): thousandths.
pub const MILLI: u64 = 1_000;

/// Where the overload signal comes from: the upstream's CPU while it reports it (a report within
/// the window), else latency inflation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Signal {
    /// Overloaded when the window's mean response time exceeds the minimum × `latency_factor`
    /// (thousandths).
    pub latency_factor: u64,
    pub cpu: Option<Cpu>,
}

/// The upstream's CPU utilisation as it reports it, smoothed: overloaded above `threshold`
/// (thousandths). `decay`: the weight of history in the moving average (thousandths).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Cpu {
    pub threshold: u64,
    pub decay: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Adaptive {
    buckets: usize,
    bucket_ns: u64,
    cool_down_ns: u64,
    min_rt_period_ns: u64,
    signal: Signal,
}

/// Where a request sits while in flight: its priority level and its flow's counter, if the rule
/// is fair per flow.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Seat {
    /// `0..LEVELS`, higher is more important (larger values count as the highest).
    pub level: u8,
    /// `0..FLOWS` (larger values wrap).
    pub flow: Option<u8>,
}

impl Seat {
    fn level(self) -> usize {
        usize::from(self.level).min(LEVELS - 1)
    }

    fn flow(self) -> Option<usize> {
        self.flow.map(|f| usize::from(f) % FLOWS)
    }
}

/// One bucket: completions and their summed response times.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Bucket {
    passed: u32,
    rt_sum_us: u32,
}

/// The process-wide state of one adaptive key.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Window {
    /// Index (time / bucket length) of the newest bucket + 1; 0: never used.
    newest: u64,
    /// The smoothed CPU signal, thousandths; `u32::MAX`: no report yet.
    cpu_milli: u32,
    /// When the CPU was last reported, ns; 0: never.
    cpu_ns: u64,
    /// The capacity estimated at the last refusal made while the signal itself was on.
    latched: u32,
    /// When the last refusal was, ns; 0: none.
    refused_ns: u64,
    /// The capacity carried over a change of the service time, which the estimate does not fall
    /// below (0: none): the one measured when an answer last confirmed the minimum, or the
    /// estimate when the minimum last moved.
    carried: u32,
    /// When the minimum last moved with the service time ([`stamp`]; 0: never): a probe found it
    /// higher, or an answer came more than an eighth under it. Buckets from before do not count.
    moved: u32,
    /// When the signal itself was last seen on ([`stamp`]; 0: never).
    hot: u32,
    /// When an answer last came within a quarter of the minimum response time ([`stamp`]).
    confirmed: u32,
    /// While a probe of the minimum runs: when it started and when it ends ([`stamp`]s; 0:
    /// none), and the least response time of the requests it admitted, µs (0: none yet).
    probe_from: u32,
    probe_until: u32,
    probe_floor: u32,
    /// Index (time / min_rt_period) of the newest minimum response time + 1.
    floor_period: u64,
    /// The least response time of this period and of the one before, µs (0: none).
    floors: [u32; 2],
    /// Requests in flight per level.
    in_flight: [u32; LEVELS],
    /// Requests in flight per flow counter.
    flows: [u16; FLOWS],
    /// The level of each flow counter's requests (its last request's).
    flow_levels: [u8; FLOWS],
    buckets: [Bucket; MAX_BUCKETS],
}

/// What [`Adaptive::admit`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Admitted: write the window (its in-flight count went up).
    Admit(Window),
    /// Refused: write the window (the refusal may start the cool-down).
    Refuse(Window),
}

/// What a window says at a time, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Status {
    /// The estimated capacity (0: not known yet).
    pub capacity: u64,
    pub in_flight: u64,
    /// The signal's value in thousandths: the smoothed CPU, or the mean response time over the
    /// minimum.
    pub signal_milli: u64,
    pub overloaded: bool,
}

impl Adaptive {
    pub fn new(
        buckets: usize,
        bucket_ns: u64,
        cool_down_ns: u64,
        min_rt_period_ns: u64,
        signal: Signal,
    ) -> Option<Self> {
        let signal_ok = signal.latency_factor > MILLI
            && signal
                .cpu
                .is_none_or(|c| c.threshold > 0 && c.decay < MILLI);
        let ok = (2..=MAX_BUCKETS).contains(&buckets)
            && bucket_ns > 0
            && min_rt_period_ns > 0
            && signal_ok;
        ok.then_some(Self {
            buckets,
            bucket_ns,
            cool_down_ns,
            min_rt_period_ns,
            signal,
        })
    }

    pub fn signal(&self) -> Signal {
        self.signal
    }

    pub fn cool_down_ns(&self) -> u64 {
        self.cool_down_ns
    }

    pub fn buckets(&self) -> usize {
        self.buckets
    }

    pub fn window_ns(&self) -> u64 {
        self.bucket_ns * self.buckets as u64
    }

    /// The window as of `now_ns`: buckets that fell out of it are emptied.
    pub fn advance(&self, w: &Window, now_ns: u64) -> Window {
        let newest = now_ns / self.bucket_ns + 1;
        let mut next = *w;
        if w.newest == 0 {
            next.cpu_milli = u32::MAX;
        }
        // A probe that ended: its least response time is the minimum from now on. (Checked at
        // every call: a probe ends between buckets, and a decision that found it over and the
        // minimum still stale would start the next one, losing what this one measured.)
        if next.probe_until != 0 && !self.probing(&next, now_ns) {
            if next.probe_floor > 0 {
                let old = Self::min_rt(&next);
                if old.is_some_and(|min| u64::from(next.probe_floor) * 4 > min * 5) {
                    // Slower: an upstream of workers holds as many at once at its new service
                    // time as at its old, and its throughput fell with the old minimum still
                    // in the estimate — the carried capacity holds while the window refills.
                    next.moved = stamp(now_ns);
                } else {
                    // The minimum was right and a queue had stood: the capacity carried from
                    // before is not what the upstream holds now.
                    next.carried = 0;
                }
                next.floors = [next.probe_floor, 0];
            }
            next.probe_from = 0;
            next.probe_until = 0;
            next.probe_floor = 0;
            next.confirmed = stamp(now_ns);
        }
        if newest <= w.newest {
            return next;
        }
        let gone = newest - w.newest.max(1).min(newest);
        for step in 0..gone.min(self.buckets as u64) {
            let index = ((w.newest + 1 + step) % self.buckets as u64) as usize;
            next.buckets[index] = Bucket::default();
        }
        next.newest = newest;
        let period = now_ns / self.min_rt_period_ns + 1;
        if period == w.floor_period + 1 {
            next.floors = [0, next.floors[0]];
        } else if period > w.floor_period {
            next.floors = [0, 0];
        }
        next.floor_period = next.floor_period.max(period);
        next
    }

    /// True while a probe runs: until its end, and past it (up to a window from its start)
    /// until an answer to a request it admitted has come — while a queue from before drains,
    /// the answers that come are not the service time.
    fn probing(&self, w: &Window, now_ns: u64) -> bool {
        let waiting = w.probe_floor == 0
            && ms_since(now_ns, w.probe_from).is_some_and(|ms| ms * 1_000_000 < self.window_ns());
        w.probe_until != 0 && (ms_until(now_ns, w.probe_until) > 0 || waiting)
    }

    /// True if no answer came near the minimum for a window: it may be the service time of
    /// before (the upstream got slower) or a queue's (one stood all the while).
    fn stale(&self, w: &Window, now_ns: u64) -> bool {
        Self::min_rt(w).is_some()
            && ms_since(now_ns, w.confirmed).is_none_or(|ms| ms * 1_000_000 >= self.window_ns())
    }

    /// How long a probe lasts: twice the window's mean response time (so that what it admits
    /// is answered within it), at least a bucket, at most the window.
    fn probe_ns(&self, w: &Window) -> u64 {
        let (mut passed, mut sum_us) = (0u64, 0u64);
        for b in w.buckets.iter().take(self.buckets) {
            passed += u64::from(b.passed);
            sum_us += u64::from(b.rt_sum_us);
        }
        let mean_ns = sum_us.saturating_mul(1_000) / passed.max(1);
        (2 * mean_ns).clamp(self.bucket_ns, self.window_ns())
    }

    /// The least response time remembered, µs.
    fn min_rt(w: &Window) -> Option<u64> {
        w.floors
            .iter()
            .filter(|&&f| f > 0)
            .min()
            .map(|&f| u64::from(f))
    }

    /// The capacity measured (requests in flight the upstream serves without queueing), and the
    /// minimum response time; `None` until a full bucket since the minimum last moved has
    /// completions.
    pub fn capacity(&self, w: &Window) -> Option<(u64, u64)> {
        let min_rt = Self::min_rt(w)?;
        let n = self.buckets as u64;
        // Completions of the `ago`-th bucket before the current one, which is still filling (its
        // count would understate throughput); none if it began before the minimum last moved
        // (its throughput is of the service time before: times the new minimum, too little if
        // the upstream got faster, too much if slower).
        let passed = |ago: u64| {
            let began_ns = w.newest.saturating_sub(1 + ago) * self.bucket_ns;
            let since_moved = w.moved == 0 || ms_until(began_ns, w.moved) <= 0;
            let b = &w.buckets[((w.newest + n - ago) % n) as usize];
            if since_moved {
                u64::from(b.passed)
            } else {
                0
            }
        };
        // Throughput over as many consecutive buckets as the minimum spans: requests admitted
        // together come back together, and in buckets shorter than their response time one
        // bucket would hold a burst and the next none.
        let span = (min_rt * 1_000).div_ceil(self.bucket_ns).clamp(1, n - 1);
        let mut sum: u64 = (1..=span).map(passed).sum();
        let mut most = sum;
        for ago in span + 1..n {
            sum = sum + passed(ago) - passed(ago - span);
            most = most.max(sum);
        }
        if most == 0 {
            return None;
        }
        // passed per bucket × buckets per second × min RT in seconds, rounded up.
        let per_s = u128::from(most) * 1_000_000_000 / u128::from(span * self.bucket_ns);
        let capacity = (per_s * u128::from(min_rt.max(1))).div_ceil(1_000_000);
        Some((u64::try_from(capacity).unwrap_or(u64::MAX).max(1), min_rt))
    }

    /// The capacity the limit holds to: the one measured or, if more, the one carried over a
    /// change of the service time; `None` until one of them is known.
    fn estimate(&self, w: &Window) -> Option<u64> {
        let carried = Some(u64::from(w.carried)).filter(|&c| c > 0);
        self.capacity(w).map(|(c, _)| c).max(carried)
    }

    /// True within a window of the minimum's moving: the window has not been measured at the
    /// new minimum yet.
    fn settling(&self, w: &Window, now_ns: u64) -> bool {
        ms_since(now_ns, w.moved).is_some_and(|ms| ms * 1_000_000 < self.window_ns())
    }

    /// The signal's value in thousandths, if there is one yet.
    fn signal_milli(&self, w: &Window) -> Option<u64> {
        if let Some(cpu) = self.reported_cpu(w) {
            return Some(cpu);
        }
        let (mut passed, mut sum) = (0u64, 0u64);
        for b in w.buckets.iter().take(self.buckets) {
            passed += u64::from(b.passed);
            sum += u64::from(b.rt_sum_us);
        }
        let min_rt = Self::min_rt(w)?;
        (passed > 0).then(|| sum * MILLI / (passed * min_rt))
    }

    /// The smoothed CPU, if the signal is the CPU and it was reported within the window.
    fn reported_cpu(&self, w: &Window) -> Option<u64> {
        self.signal.cpu?;
        let span = self.bucket_ns * self.buckets as u64;
        let recent = w.cpu_ns != 0 && w.cpu_ns + span >= (w.newest - 1) * self.bucket_ns;
        recent.then(|| w.cpu_milli()).flatten()
    }

    /// True if the signal itself (without the cool-down) is on.
    fn hot(&self, w: &Window) -> bool {
        let limit = match (self.signal.cpu, self.reported_cpu(w)) {
            (Some(cpu), Some(_)) => cpu.threshold,
            _ => self.signal.latency_factor,
        };
        self.signal_milli(w).is_some_and(|v| v > limit)
    }

    /// True if the overload signal is on at `now_ns` (the cool-down included).
    pub fn overloaded(&self, w: &Window, now_ns: u64) -> bool {
        self.cooling(w, now_ns) || self.hot(w)
    }

    /// True within a cool-down of the signal's last being on; with the latency signal, also of
    /// the last refusal (shedding itself keeps response times normal). With the CPU signal the
    /// upstream says when it has room, and the limit lets go one cool-down after.
    fn cooling(&self, w: &Window, now_ns: u64) -> bool {
        let hot = ms_since(now_ns, w.hot).is_some_and(|ms| ms * 1_000_000 < self.cool_down_ns);
        let refused = w.refused_ns != 0 && now_ns.saturating_sub(w.refused_ns) < self.cool_down_ns;
        hot || (self.reported_cpu(w).is_none() && refused)
    }

    /// Decide a request of `seat` at `now_ns`; its level may fill `share_milli` thousandths of
    /// the capacity (with the requests of higher levels).
    pub fn admit(&self, w: &Window, now_ns: u64, seat: Seat, share_milli: u64) -> Admission {
        let mut next = self.advance(w, now_ns);
        let hot = self.hot(&next);
        if hot {
            next.hot = stamp(now_ns);
            if !self.probing(&next, now_ns) && self.stale(&next, now_ns) {
                next.probe_from = stamp(now_ns);
                next.probe_until = stamp(now_ns.saturating_add(self.probe_ns(&next)));
                next.probe_floor = 0;
            }
        }
        if hot || self.cooling(&next, now_ns) {
            let from_window = self.estimate(&next);
            let estimate = if hot {
                from_window
            } else {
                from_window.max(Some(u64::from(next.latched)).filter(|&c| c > 0))
            };
            // A probe admits half the estimate: no queue can stand while it measures. While the
            // signal is on, the estimate; in the cool-down, with a headroom of its square root,
            // so that an estimate the limit held low can grow (an upstream with room answers
            // the more without a queue, and the estimate follows).
            let cap = estimate.map(|c| {
                if self.probing(&next, now_ns) {
                    (c / 2).max(1)
                } else if hot {
                    c
                } else {
                    c.saturating_add(ceil_sqrt(c))
                }
            });
            if cap.is_some_and(|c| next.full_for(seat, c, share_milli)) {
                if hot {
                    next.latched = saturating_u32(from_window.unwrap_or(0));
                }
                next.refused_ns = now_ns.max(1);
                return Admission::Refuse(next);
            }
        }
        Admission::Admit(self.occupy(&next, now_ns, seat))
    }

    /// Count a request of `seat` in flight without deciding it (a dry run's would-be refusal).
    pub fn occupy(&self, w: &Window, now_ns: u64, seat: Seat) -> Window {
        let mut next = self.advance(w, now_ns);
        let level = &mut next.in_flight[seat.level()];
        *level = level.saturating_add(1);
        if let Some(f) = seat.flow() {
            next.flows[f] = next.flows[f].saturating_add(1);
            next.flow_levels[f] = seat.level() as u8;
        }
        next
    }

    /// A request admitted earlier in `seat` completed after `rt_us`; `cpu_milli` is the
    /// utilisation the upstream reported with it, if any.
    pub fn complete(
        &self,
        w: &Window,
        now_ns: u64,
        seat: Seat,
        rt_us: u64,
        cpu_milli: Option<u64>,
    ) -> Window {
        let mut next = self.abandon(w, now_ns, seat);
        let rt = saturating_u32(rt_us).max(1);
        let min_before = Self::min_rt(&next);
        let estimate_before = self.estimate(&next);
        let floor = &mut next.floors[0];
        *floor = if *floor == 0 { rt } else { (*floor).min(rt) };
        // An answer to a request the probe admitted (not one that waited in a queue from before).
        // (Stamps are whole milliseconds: one less, so that no request admitted just before the
        // probe counts.)
        let of_probe = ms_since(now_ns, next.probe_from)
            .is_some_and(|ms| u64::from(rt) <= ms.saturating_sub(1) * 1_000);
        if of_probe && self.probing(&next, now_ns) {
            let p = &mut next.probe_floor;
            *p = if *p == 0 { rt } else { (*p).min(rt) };
        }
        // Within a quarter of the minimum: the minimum is still the service time.
        let confirms = Self::min_rt(&next).is_some_and(|min| u64::from(rt) * 4 <= min * 5);
        if confirms {
            next.confirmed = stamp(now_ns);
        }
        let b = &mut next.buckets[(next.newest % self.buckets as u64) as usize];
        b.passed = b.passed.saturating_add(1);
        b.rt_sum_us = b.rt_sum_us.saturating_add(rt);
        let faster = min_before.is_some_and(|min| u64::from(rt) * 8 < min * 7);
        if faster && !self.probing(&next, now_ns) {
            // More than an eighth under the minimum, and not in a probe draining a queue: the
            // upstream got faster. It holds as many at once as before (a pool of workers does);
            // its throughput of before times the new minimum would be a fraction of that.
            next.carried = saturating_u32(estimate_before.unwrap_or(0));
            next.moved = stamp(now_ns);
        } else if confirms && !self.settling(&next, now_ns) {
            // What the estimate may not fall below if the minimum goes into doubt: the capacity
            // measured while it is the service time.
            next.carried = saturating_u32(self.capacity(&next).map_or(0, |c| c.0));
        }
        if let (Some(cpu), Some(Cpu { decay, .. })) = (cpu_milli, self.signal.cpu) {
            next.cpu_ns = now_ns.max(1);
            let cpu = cpu.min(u64::from(u32::MAX - 1));
            next.cpu_milli = if next.cpu_milli == u32::MAX {
                cpu as u32
            } else {
                ((u64::from(next.cpu_milli) * decay + cpu * (MILLI - decay)) / MILLI) as u32
            };
        }
        next
    }

    /// A request admitted earlier in `seat` ended without an answer worth measuring (client
    /// gone, or no response from the upstream).
    pub fn abandon(&self, w: &Window, now_ns: u64, seat: Seat) -> Window {
        let mut next = self.advance(w, now_ns);
        let level = &mut next.in_flight[seat.level()];
        *level = level.saturating_sub(1);
        if let Some(f) = seat.flow() {
            next.flows[f] = next.flows[f].saturating_sub(1);
        }
        next
    }

    /// What the window says at `now_ns`.
    pub fn status(&self, w: &Window, now_ns: u64) -> Status {
        let w = self.advance(w, now_ns);
        Status {
            capacity: self.estimate(&w).unwrap_or(0),
            in_flight: w.in_flight(),
            signal_milli: self.signal_milli(&w).unwrap_or(0),
            overloaded: self.overloaded(&w, now_ns),
        }
    }

    /// True if the window holds nothing worth keeping at `now_ns`: nothing in flight, no
    /// completion in the window, no cool-down running.
    pub fn is_idle(&self, w: &Window, now_ns: u64) -> bool {
        let w = self.advance(w, now_ns);
        w.in_flight() == 0
            && !self.cooling(&w, now_ns)
            && w.buckets.iter().take(self.buckets).all(|b| b.passed == 0)
    }
}

/// A time in a window's 32-bit fields: milliseconds, wrapping every 49 days (only differences
/// of seconds are ever taken); never 0, which means "none".
fn stamp(now_ns: u64) -> u32 {
    ((now_ns / 1_000_000) as u32).max(1)
}

/// Milliseconds since `t` (a [`stamp`]; 0 if `t` is later: workers read the clock at slightly
/// different moments); `None` for none.
fn ms_since(now_ns: u64, t: u32) -> Option<u64> {
    (t != 0).then(|| match stamp(now_ns).wrapping_sub(t) {
        d if d >= 1 << 31 => 0,
        d => u64::from(d),
    })
}

/// Milliseconds until `t` (a [`stamp`]), negative once it passed.
fn ms_until(now_ns: u64, t: u32) -> i64 {
    i64::from(t.wrapping_sub(stamp(now_ns)) as i32)
}

/// ⌈√n⌉.
fn ceil_sqrt(n: u64) -> u64 {
    let r = n.isqrt();
    if r * r < n {
        r + 1
    } else {
        r
    }
}
