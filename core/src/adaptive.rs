//! Adaptive concurrency (BBR-style shedding, as in Kratos and go-zero): the capacity of an upstream
//! estimated from what it did lately, by Little's law (in flight = throughput × response time).
//!
//! A window of buckets (default 10 × 100 ms) records the requests that completed in each and their
//! minimum response time. Estimated capacity = the most completions of any full bucket, per second,
//! × the window's minimum response time. A request is refused when the in-flight count has reached
//! the capacity *and* the overload signal is on: the upstream's own CPU (an EWMA of what it reports)
//! above a threshold, or, without such reports, the window's mean response time inflated past a
//! factor of its minimum. After a refusal the signal stays on for a cool-down, so that the limit
//! does not flap around the threshold.
//!
//! Everything is a pure function of the encoded state and the time passed in.

/// Most buckets a window may have.
pub const MAX_BUCKETS: usize = 16;
/// Bytes of an encoded [`Window`].
pub const WINDOW_BYTES: usize = 32 + MAX_BUCKETS * 12;

/// Fixed-point scale of ratios (threshold, decay, factor, signal): thousandths.
pub const MILLI: u64 = 1_000;

/// Where the overload signal comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Signal {
    /// The upstream's CPU utilisation as it reports it, smoothed: overloaded above `threshold`
    /// (thousandths). `decay`: the weight of history in the moving average (thousandths).
    Cpu { threshold: u64, decay: u64 },
    /// Overloaded when the window's mean response time exceeds its minimum × `factor`
    /// (thousandths).
    Latency { factor: u64 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Adaptive {
    buckets: usize,
    bucket_ns: u64,
    cool_down_ns: u64,
    signal: Signal,
}

/// One bucket: completions, their summed and minimum response times.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Bucket {
    passed: u32,
    rt_sum_us: u32,
    min_rt_us: u32,
}

/// The process-wide state of one adaptive key.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Window {
    /// Index (time / bucket length) of the newest bucket + 1; 0: never used.
    newest: u64,
    in_flight: u32,
    /// The smoothed CPU signal, thousandths; `u32::MAX`: no report yet.
    cpu_milli: u32,
    /// When the last refusal was, ns; 0: none.
    refused_ns: u64,
    buckets: [Bucket; MAX_BUCKETS],
}

/// What [`Adaptive::admit`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Admitted: write the window (its in-flight count went up).
    Admit(Window),
    /// Refused: write the window (the refusal starts or extends the cool-down).
    Refuse(Window),
}

impl Adaptive {
    pub fn new(buckets: usize, bucket_ns: u64, cool_down_ns: u64, signal: Signal) -> Option<Self> {
        let signal_ok = match signal {
            Signal::Cpu { threshold, decay } => threshold > 0 && decay < MILLI,
            Signal::Latency { factor } => factor > MILLI,
        };
        ((2..=MAX_BUCKETS).contains(&buckets) && bucket_ns > 0 && signal_ok).then_some(Self {
            buckets,
            bucket_ns,
            cool_down_ns,
            signal,
        })
    }

    pub fn signal(&self) -> Signal {
        self.signal
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
        next
    }

    /// The estimated capacity (requests in flight the upstream serves without queueing), and the
    /// window's minimum response time; `None` until a full bucket has completions.
    pub fn capacity(&self, w: &Window) -> Option<(u64, u64)> {
        let current = (w.newest % self.buckets as u64) as usize;
        let mut max_passed = 0u64;
        let mut min_rt = u64::MAX;
        for (i, b) in w.buckets.iter().take(self.buckets).enumerate() {
            if b.passed == 0 {
                continue;
            }
            min_rt = min_rt.min(u64::from(b.min_rt_us));
            // The current bucket is still filling: its count would understate throughput.
            if i != current {
                max_passed = max_passed.max(u64::from(b.passed));
            }
        }
        if max_passed == 0 || min_rt == u64::MAX {
            return None;
        }
        // passed per bucket × buckets per second × min RT in seconds, rounded up.
        let per_s = u128::from(max_passed) * 1_000_000_000 / u128::from(self.bucket_ns);
        let capacity = (per_s * u128::from(min_rt.max(1))).div_ceil(1_000_000);
        Some((u64::try_from(capacity).unwrap_or(u64::MAX).max(1), min_rt))
    }

    /// True if the overload signal is on at `now_ns`.
    pub fn overloaded(&self, w: &Window, now_ns: u64) -> bool {
        if w.refused_ns != 0 && now_ns.saturating_sub(w.refused_ns) < self.cool_down_ns {
            return true;
        }
        match self.signal {
            Signal::Cpu { threshold, .. } => {
                w.cpu_milli != u32::MAX && u64::from(w.cpu_milli) > threshold
            }
            Signal::Latency { factor } => {
                let (mut passed, mut sum, mut min_rt) = (0u64, 0u64, u64::MAX);
                for b in w.buckets.iter().take(self.buckets).filter(|b| b.passed > 0) {
                    passed += u64::from(b.passed);
                    sum += u64::from(b.rt_sum_us);
                    min_rt = min_rt.min(u64::from(b.min_rt_us));
                }
                passed > 0 && sum * MILLI > passed * min_rt.max(1) * factor
            }
        }
    }

    /// Decide a request at `now_ns`.
    pub fn admit(&self, w: &Window, now_ns: u64) -> Admission {
        let mut next = self.advance(w, now_ns);
        let full = self
            .capacity(&next)
            .is_some_and(|(capacity, _)| u64::from(next.in_flight) >= capacity);
        if full && self.overloaded(&next, now_ns) {
            next.refused_ns = now_ns.max(1);
            return Admission::Refuse(next);
        }
        next.in_flight = next.in_flight.saturating_add(1);
        Admission::Admit(next)
    }

    /// A request admitted earlier completed after `rt_us`; `cpu_milli` is the utilisation the
    /// upstream reported with it, if any.
    pub fn complete(&self, w: &Window, now_ns: u64, rt_us: u64, cpu_milli: Option<u64>) -> Window {
        let mut next = self.advance(w, now_ns);
        next.in_flight = next.in_flight.saturating_sub(1);
        let b = &mut next.buckets[(next.newest % self.buckets as u64) as usize];
        let rt = crate::state::saturating_u32(rt_us);
        b.min_rt_us = if b.passed == 0 {
            rt
        } else {
            b.min_rt_us.min(rt)
        };
        b.passed = b.passed.saturating_add(1);
        b.rt_sum_us = b.rt_sum_us.saturating_add(rt);
        if let (Some(cpu), Signal::Cpu { decay, .. }) = (cpu_milli, self.signal) {
            let cpu = cpu.min(u64::from(u32::MAX - 1));
            next.cpu_milli = if next.cpu_milli == u32::MAX {
                cpu as u32
            } else {
                ((u64::from(next.cpu_milli) * decay + cpu * (MILLI - decay)) / MILLI) as u32
            };
        }
        next
    }

    /// A request admitted earlier ended without an answer worth measuring (client gone).
    pub fn abandon(&self, w: &Window, now_ns: u64) -> Window {
        let mut next = self.advance(w, now_ns);
        next.in_flight = next.in_flight.saturating_sub(1);
        next
    }
}

impl Window {
    pub fn in_flight(&self) -> u64 {
        u64::from(self.in_flight)
    }

    /// The smoothed CPU signal in thousandths, if the upstream reported any.
    pub fn cpu_milli(&self) -> Option<u64> {
        (self.cpu_milli != u32::MAX && self.newest != 0).then_some(u64::from(self.cpu_milli))
    }

    pub fn encode(&self) -> [u8; WINDOW_BYTES] {
        let mut out = [0; WINDOW_BYTES];
        out[0..8].copy_from_slice(&self.newest.to_le_bytes());
        out[8..12].copy_from_slice(&self.in_flight.to_le_bytes());
        out[12..16].copy_from_slice(&self.cpu_milli.to_le_bytes());
        out[16..24].copy_from_slice(&self.refused_ns.to_le_bytes());
        for (i, b) in self.buckets.iter().enumerate() {
            let at = 32 + i * 12;
            out[at..at + 4].copy_from_slice(&b.passed.to_le_bytes());
            out[at + 4..at + 8].copy_from_slice(&b.rt_sum_us.to_le_bytes());
            out[at + 8..at + 12].copy_from_slice(&b.min_rt_us.to_le_bytes());
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
            in_flight: u32_at(8),
            cpu_milli: u32_at(12),
            refused_ns: u64_at(16),
            buckets: [Bucket::default(); MAX_BUCKETS],
        };
        for (i, b) in w.buckets.iter_mut().enumerate() {
            let at = 32 + i * 12;
            *b = Bucket {
                passed: u32_at(at),
                rt_sum_us: u32_at(at + 4),
                min_rt_us: u32_at(at + 8),
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
        Adaptive::new(10, 100 * MS, 1_000 * MS, Signal::Latency { factor: 2_000 }).unwrap()
    }

    fn cpu() -> Adaptive {
        Adaptive::new(
            10,
            100 * MS,
            1_000 * MS,
            Signal::Cpu {
                threshold: 800,
                decay: 950,
            },
        )
        .unwrap()
    }

    fn admitted(a: &Adaptive, w: &Window, now: u64) -> Window {
        match a.admit(w, now) {
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
            w = a.complete(&w, t + rt_us * 1_000, rt_us, cpu);
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
            w = a.complete(&w, now, 100_000, None);
        }
        assert_eq!(w.in_flight(), 0);
        for _ in 0..20 {
            w = admitted(&a, &w, now);
        }
        assert!(a.overloaded(&w, now));
        let Admission::Refuse(w) = a.admit(&w, now) else {
            panic!("admitted")
        };
        // The cool-down keeps the signal on after the slow answers leave the window.
        let later = now + 1_200 * MS;
        let w2 = a.advance(&w, later);
        assert!(!a.overloaded(&w2, later), "window gone, cool-down over");
        assert!(a.overloaded(&w, now + 900 * MS));
    }

    #[test]
    fn the_cpu_signal_is_a_moving_average_against_the_threshold() {
        let a = cpu();
        let mut w = steady(&a, Window::default(), 0, 200, 1_000, Some(500));
        assert_eq!(w.cpu_milli(), Some(500));
        assert!(!a.overloaded(&w, 200 * MS));
        // One report of 100% moves the average by 5% of the gap only.
        w = a.complete(&admitted(&a, &w, 200 * MS), 201 * MS, 1_000, Some(1_000));
        assert_eq!(w.cpu_milli(), Some(525));
        w = steady(&a, w, 202 * MS, 200, 1_000, Some(1_000));
        assert!(a.overloaded(&w, 402 * MS), "{:?}", w.cpu_milli());
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
        assert!(Adaptive::new(1, MS, 0, Signal::Latency { factor: 2_000 }).is_none());
        assert!(Adaptive::new(17, MS, 0, Signal::Latency { factor: 2_000 }).is_none());
        assert!(Adaptive::new(10, 0, 0, Signal::Latency { factor: 2_000 }).is_none());
        assert!(Adaptive::new(10, MS, 0, Signal::Latency { factor: 1_000 }).is_none());
        assert!(Adaptive::new(
            10,
            MS,
            0,
            Signal::Cpu {
                threshold: 800,
                decay: 1_000
            }
        )
        .is_none());
    }

    proptest! {
        #[test]
        fn encoding_round_trips_and_in_flight_never_underflows(
            events in prop::collection::vec((0u64..3, 0u64..50, 0u64..200_000), 0..300),
        ) {
            let a = cpu();
            let mut w = Window::default();
            let mut now = 0;
            for (kind, step_ms, rt) in events {
                now += step_ms * MS;
                w = match kind {
                    0 => match a.admit(&w, now) {
                        Admission::Admit(w) | Admission::Refuse(w) => w,
                    },
                    1 => a.complete(&w, now, rt, Some(rt % 1_200)),
                    _ => a.abandon(&w, now),
                };
                prop_assert_eq!(Window::decode(&w.encode()), w);
                prop_assert!(w.in_flight() < 1_000);
            }
        }
    }
}
