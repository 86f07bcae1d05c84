//! Adaptive concurrency (BBR-style shedding, as in Kratos and go-zero): the capacity of an upstream
//! estimated from what it did lately, by Little's law (in flight = throughput × response time).
//!
//! A window of buckets (default 10 × 100 ms) records the requests that completed in each and their
//! minimum response time. Estimated capacity = the most completions of any full bucket, per second,
//! × the minimum response time. A request is refused when the in-flight count has reached the
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
//! *probed*: for twice the window's mean response time the limit admits half the estimate, so that
//! no queue can stand, and the least response time of that probe replaces the minimum — the
//! upstream's new service time if it changed (slower or faster), the old one if a queue had stood.
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

use crate::state::saturating_u32;

/// Most buckets a window may have.
pub const MAX_BUCKETS: usize = 16;
/// Priority levels (0 the lowest).
pub const LEVELS: usize = 4;
/// Flows counted for fairness: flow keys hash into this many counters.
pub const FLOWS: usize = 16;
const HEADER_BYTES: usize = 96 + FLOWS + 16;
const _: () = assert!(40 + FLOWS * 2 <= 72 && 24 + LEVELS * 4 <= 40);
/// Bytes of an encoded [`Window`].
pub const WINDOW_BYTES: usize = HEADER_BYTES + MAX_BUCKETS * 8;

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
    /// When the signal itself was last seen on ([`stamp`]; 0: never).
    hot: u32,
    /// When an answer last came within a quarter of the minimum response time ([`stamp`]).
    confirmed: u32,
    /// While a probe of the minimum runs: when it ends ([`stamp`]; 0: none), and the least
    /// response time it saw, µs (0: none yet).
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
            next.floors = [0, w.floors[0]];
        } else if period > w.floor_period {
            next.floors = [0, 0];
        }
        next.floor_period = next.floor_period.max(period);
        // A probe that ended: its least response time is the minimum from now on.
        if next.probe_until != 0 && !Self::probing(&next, now_ns) {
            if next.probe_floor > 0 {
                next.floors = [next.probe_floor, 0];
            }
            next.probe_until = 0;
            next.probe_floor = 0;
            next.confirmed = stamp(now_ns);
        }
        next
    }

    fn probing(w: &Window, now_ns: u64) -> bool {
        w.probe_until != 0 && ms_until(now_ns, w.probe_until) > 0
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

    /// The estimated capacity (requests in flight the upstream serves without queueing), and the
    /// minimum response time; `None` until a full bucket has completions.
    pub fn capacity(&self, w: &Window) -> Option<(u64, u64)> {
        let current = (w.newest % self.buckets as u64) as usize;
        let mut max_passed = 0u64;
        for (i, b) in w.buckets.iter().take(self.buckets).enumerate() {
            // The current bucket is still filling: its count would understate throughput.
            if i != current {
                max_passed = max_passed.max(u64::from(b.passed));
            }
        }
        let min_rt = Self::min_rt(w)?;
        if max_passed == 0 {
            return None;
        }
        // passed per bucket × buckets per second × min RT in seconds, rounded up.
        let per_s = u128::from(max_passed) * 1_000_000_000 / u128::from(self.bucket_ns);
        let capacity = (per_s * u128::from(min_rt.max(1))).div_ceil(1_000_000);
        Some((u64::try_from(capacity).unwrap_or(u64::MAX).max(1), min_rt))
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
            if !Self::probing(&next, now_ns) && self.stale(&next, now_ns) {
                next.probe_until = stamp(now_ns.saturating_add(self.probe_ns(&next)));
                next.probe_floor = 0;
            }
        }
        if hot || self.cooling(&next, now_ns) {
            let measured = self.capacity(&next).map(|(c, _)| c);
            let estimate = if hot {
                measured
            } else {
                measured.max(Some(u64::from(next.latched)).filter(|&c| c > 0))
            };
            // A probe admits half the estimate: no queue can stand while it measures. While the
            // signal is on, the estimate; in the cool-down, with a headroom of its square root,
            // so that an estimate the limit held low can grow (an upstream with room answers
            // the more without a queue, and the estimate follows).
            let cap = estimate.map(|c| {
                if Self::probing(&next, now_ns) {
                    (c / 2).max(1)
                } else if hot {
                    c
                } else {
                    c.saturating_add(ceil_sqrt(c))
                }
            });
            if cap.is_some_and(|c| next.full_for(seat, c, share_milli)) {
                if hot {
                    next.latched = saturating_u32(measured.unwrap_or(0));
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
        let floor = &mut next.floors[0];
        *floor = if *floor == 0 { rt } else { (*floor).min(rt) };
        if Self::probing(&next, now_ns) {
            let p = &mut next.probe_floor;
            *p = if *p == 0 { rt } else { (*p).min(rt) };
        }
        // Within a quarter of the minimum: the minimum is still the service time.
        if Self::min_rt(&next).is_some_and(|min| u64::from(rt) * 4 <= min * 5) {
            next.confirmed = stamp(now_ns);
        }
        let b = &mut next.buckets[(next.newest % self.buckets as u64) as usize];
        b.passed = b.passed.saturating_add(1);
        b.rt_sum_us = b.rt_sum_us.saturating_add(rt);
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
            capacity: self.capacity(&w).map_or(0, |(c, _)| c),
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

impl Window {
    pub fn in_flight(&self) -> u64 {
        self.in_flight.iter().map(|&n| u64::from(n)).sum()
    }

    /// Requests in flight of `level` and above.
    pub fn in_flight_from(&self, level: u8) -> u64 {
        let from = usize::from(level).min(LEVELS - 1);
        self.in_flight[from..].iter().map(|&n| u64::from(n)).sum()
    }

    /// The smoothed CPU signal in thousandths, if the upstream reported any.
    pub fn cpu_milli(&self) -> Option<u64> {
        (self.cpu_milli != u32::MAX && self.newest != 0).then_some(u64::from(self.cpu_milli))
    }

    /// True if `seat` may not take another request with `capacity` estimated.
    fn full_for(&self, seat: Seat, capacity: u64, share_milli: u64) -> bool {
        let allowance = (u128::from(capacity) * u128::from(share_milli))
            .div_ceil(u128::from(MILLI))
            .max(1);
        let allowance = u64::try_from(allowance).unwrap_or(u64::MAX);
        let from_level = self.in_flight_from(seat.level);
        if from_level >= allowance {
            return true;
        }
        let Some(f) = seat.flow() else {
            return false;
        };
        let level = seat.level();
        let above = from_level - u64::from(self.in_flight[level]);
        let mine = u64::from(self.flows[f]);
        let others = (0..FLOWS)
            .filter(|&i| i != f && self.flows[i] > 0 && usize::from(self.flow_levels[i]) == level)
            .count() as u64;
        mine >= (allowance - above).div_ceil(others + 1)
    }

    pub fn encode(&self) -> [u8; WINDOW_BYTES] {
        let mut out = [0; WINDOW_BYTES];
        out[0..8].copy_from_slice(&self.newest.to_le_bytes());
        out[8..12].copy_from_slice(&self.cpu_milli.to_le_bytes());
        out[12..16].copy_from_slice(&self.latched.to_le_bytes());
        out[16..24].copy_from_slice(&self.refused_ns.to_le_bytes());
        out[72..80].copy_from_slice(&self.floor_period.to_le_bytes());
        out[80..84].copy_from_slice(&self.floors[0].to_le_bytes());
        out[84..88].copy_from_slice(&self.floors[1].to_le_bytes());
        out[88..96].copy_from_slice(&self.cpu_ns.to_le_bytes());
        out[96..96 + FLOWS].copy_from_slice(&self.flow_levels);
        let at = 96 + FLOWS;
        out[at..at + 4].copy_from_slice(&self.hot.to_le_bytes());
        out[at + 4..at + 8].copy_from_slice(&self.confirmed.to_le_bytes());
        out[at + 8..at + 12].copy_from_slice(&self.probe_until.to_le_bytes());
        out[at + 12..at + 16].copy_from_slice(&self.probe_floor.to_le_bytes());
        for (i, n) in self.in_flight.iter().enumerate() {
            out[24 + i * 4..28 + i * 4].copy_from_slice(&n.to_le_bytes());
        }
        for (i, n) in self.flows.iter().enumerate() {
            out[40 + i * 2..42 + i * 2].copy_from_slice(&n.to_le_bytes());
        }
        for (i, b) in self.buckets.iter().enumerate() {
            let at = HEADER_BYTES + i * 8;
            out[at..at + 4].copy_from_slice(&b.passed.to_le_bytes());
            out[at + 4..at + 8].copy_from_slice(&b.rt_sum_us.to_le_bytes());
        }
        out
    }

    /// The window in `bytes`; anything shorter or longer is a fresh window.
    pub fn decode(bytes: &[u8]) -> Self {
        let Ok(bytes) = <&[u8; WINDOW_BYTES]>::try_from(bytes) else {
            return Self::default();
        };
        let u32_at = |at: usize| {
            u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
        };
        let u64_at = |at: usize| u64::from(u32_at(at)) | u64::from(u32_at(at + 4)) << 32;
        let mut w = Self {
            newest: u64_at(0),
            cpu_milli: u32_at(8),
            latched: u32_at(12),
            refused_ns: u64_at(16),
            floor_period: u64_at(72),
            floors: [u32_at(80), u32_at(84)],
            cpu_ns: u64_at(88),
            hot: u32_at(96 + FLOWS),
            confirmed: u32_at(96 + FLOWS + 4),
            probe_until: u32_at(96 + FLOWS + 8),
            probe_floor: u32_at(96 + FLOWS + 12),
            flow_levels: {
                let mut levels = [0; FLOWS];
                levels.copy_from_slice(&bytes[96..96 + FLOWS]);
                levels
            },
            ..Self::default()
        };
        for (i, n) in w.in_flight.iter_mut().enumerate() {
            *n = u32_at(24 + i * 4);
        }
        for (i, n) in w.flows.iter_mut().enumerate() {
            *n = u16::from_le_bytes([bytes[40 + i * 2], bytes[41 + i * 2]]);
        }
        for (i, b) in w.buckets.iter_mut().enumerate() {
            let at = HEADER_BYTES + i * 8;
            *b = Bucket {
                passed: u32_at(at),
                rt_sum_us: u32_at(at + 4),
            };
        }
        w
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MS: u64 = 1_000_000;

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

    /// An upstream serving `slots` requests at once, each for the service time the run gives it
    /// at its start; more wait in line. One request arrives every `gap` ns from `from` to `to`;
    /// the limiter decides each. Per 100 ms: requests answered and their slowest response time
    /// (µs), the estimate, the minimum response time.
    struct Upstream {
        slots: Vec<u64>,
        /// (answered at, response time µs) of requests in flight.
        pending: Vec<(u64, u64)>,
    }

    #[derive(Debug, Default, Clone, Copy)]
    struct Tick {
        answered: u64,
        slowest_us: u64,
        estimate: u64,
        min_rt_us: u64,
    }

    impl Upstream {
        fn new(slots: usize) -> Self {
            Self {
                slots: vec![0; slots],
                pending: Vec::new(),
            }
        }

        fn run(
            &mut self,
            a: &Adaptive,
            mut w: Window,
            (from, to, gap): (u64, u64, u64),
            service_ns: impl Fn(u64) -> u64,
        ) -> (Window, Vec<Tick>) {
            let mut ticks = vec![Tick::default(); ((to - from) / (100 * MS)) as usize + 1];
            let mut t = from;
            while t < to {
                self.pending.sort_unstable();
                while let Some(&(at, rt_us)) = self.pending.first().filter(|p| p.0 <= t) {
                    self.pending.remove(0);
                    w = a.complete(&w, at, Seat::default(), rt_us, None);
                    let tick = &mut ticks[((at - from) / (100 * MS)) as usize];
                    tick.answered += 1;
                    tick.slowest_us = tick.slowest_us.max(rt_us);
                }
                if let Admission::Admit(next) = a.admit(&w, t, Seat::default(), MILLI) {
                    w = next;
                    let slot = (0..self.slots.len())
                        .min_by_key(|&i| self.slots[i])
                        .unwrap();
                    let start = self.slots[slot].max(t);
                    let done = start + service_ns(start);
                    self.slots[slot] = done;
                    self.pending.push((done, (done - t) / 1_000));
                } else if let Admission::Refuse(next) = a.admit(&w, t, Seat::default(), MILLI) {
                    w = next;
                }
                let tick = &mut ticks[((t - from) / (100 * MS)) as usize];
                tick.estimate = a.capacity(&w).map_or(0, |c| c.0);
                tick.min_rt_us = a.capacity(&w).map_or(0, |c| c.1);
                t += gap;
            }
            (w, ticks)
        }
    }

    /// Answered per second and the slowest response time (ms) over `ticks[from..to]`.
    fn over(ticks: &[Tick], from: usize, to: usize) -> (f64, u64) {
        let span = &ticks[from..to];
        let answered: u64 = span.iter().map(|t| t.answered).sum();
        let slowest = span.iter().map(|t| t.slowest_us).max().unwrap_or(0);
        (answered as f64 * 10.0 / span.len() as f64, slowest / 1_000)
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
        let (_, ticks) = up.run(&a, Window::default(), (0, 25_000 * MS, 3_333_333), service);
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

    #[test]
    fn a_standing_queue_does_not_pass_for_the_service_time() {
        let a = latency();
        // 10 at once, 50 ms each (200/s): warm at 100/s, then 400/s for 20 s. The queue that
        // forms before the signal comes on is drained and the minimum stays the service time.
        let mut up = Upstream::new(10);
        let (w, _) = up.run(&a, Window::default(), (0, 2_000 * MS, 10 * MS), |_| 50 * MS);
        let (_, ticks) = up.run(&a, w, (2_000 * MS, 22_000 * MS, 2_500_000), |_| 50 * MS);
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
        // minimum, 200 ms in, finds these answers are the service time now).
        let w = steady(&a, w, 2_700 * MS, 150, 100_000, None);
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
}
