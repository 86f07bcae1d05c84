//! Success-rate throttle (Google SRE client-side throttling): refuse with probability
//! `max(0, (requests − k × accepts) / (requests + 1))` over a sliding window.
//!
//! Counts use the two-window estimate of [`crate::local::sliding_window`]: the previous window weighs
//! what is left of it. Every request counts, refused ones too (the SRE formula's `requests` are the
//! attempts): a backend that stops accepting is asked less and less, and still probed. A request
//! that goes through counts when its answer comes (with its accept, if any): a decision to let one
//! through writes nothing.
//!
//! Priorities: requests are counted per level, and the formula's share of refusals falls on the
//! lowest level first: a level is refused only what the levels below it cannot make up.

use crate::overload::adaptive::LEVELS;

/// `k` is kept in thousandths.
pub const K_SCALE: u64 = 1_000;
/// Bytes of an encoded [`Counts`].
pub const COUNTS_BYTES: usize = 8 + 2 * (LEVELS + 1) * 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SreThrottle {
    k_milli: u64,
    period_ns: u64,
}

/// The process-wide counts of one throttled key: requests per priority level and accepts, of the
/// current and the previous window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counts {
    /// Index of the current window + 1; 0: never used.
    window: u64,
    requests: [u32; LEVELS],
    accepts: u32,
    previous_requests: [u32; LEVELS],
    previous_accepts: u32,
}

impl SreThrottle {
    /// `k_milli`: the multiplier of accepts in thousandths (2 000: refuse once fewer than half
    /// are accepted); at least 1 000 (below 1 the throttle refuses a healthy backend).
    pub fn new(k_milli: u64, period_ns: u64) -> Option<Self> {
        (k_milli >= K_SCALE && period_ns > 0).then_some(Self { k_milli, period_ns })
    }

    pub fn period_ns(&self) -> u64 {
        self.period_ns
    }

    pub fn k_milli(&self) -> u64 {
        self.k_milli
    }

    /// The counts as of `now_ns`: windows that ended are moved back or forgotten.
    fn advance(&self, c: &Counts, now_ns: u64) -> Counts {
        let window = now_ns / self.period_ns + 1;
        if c.window == window {
            *c
        } else if c.window + 1 == window {
            Counts {
                window,
                previous_requests: c.requests,
                previous_accepts: c.accepts,
                ..Counts::default()
            }
        } else {
            Counts {
                window,
                ..Counts::default()
            }
        }
    }

    /// The estimated requests of each level and accepts over the last period, in units of
    /// 1/period_ns.
    fn weighted(&self, c: &Counts, now_ns: u64) -> ([u128; LEVELS], u128) {
        let period = u128::from(self.period_ns);
        let left = period - u128::from(now_ns % self.period_ns);
        let blend = |previous: u32, current: u32| {
            u128::from(previous) * left + u128::from(current) * period
        };
        let mut requests = [0; LEVELS];
        for (l, r) in requests.iter_mut().enumerate() {
            *r = blend(c.previous_requests[l], c.requests[l]);
        }
        (requests, blend(c.previous_accepts, c.accepts))
    }

    /// The probability of refusing a request of `level` now, in parts of 2^32: the formula's
    /// refusals fall on the lowest levels first.
    pub fn refusal_p32(&self, c: &Counts, now_ns: u64, level: u8) -> u64 {
        let c = self.advance(c, now_ns);
        let (per_level, accepts) = self.weighted(&c, now_ns);
        let requests: u128 = per_level.iter().sum();
        let scaled_requests = requests * u128::from(K_SCALE);
        let scaled_accepts = accepts * u128::from(self.k_milli);
        if scaled_requests <= scaled_accepts {
            return 0;
        }
        // (R − k·A) / (R + 1), with R and A in units of 1/period and k in thousandths: the
        // share of all requests to refuse, as a number of requests (still in 1/period).
        let refuse = (scaled_requests - scaled_accepts) * requests
            / ((requests + u128::from(self.period_ns)) * u128::from(K_SCALE));
        let level = usize::from(level).min(LEVELS - 1);
        let below: u128 = per_level[..level].iter().sum();
        if refuse <= below {
            return 0;
        }
        let at = per_level[level].max(u128::from(self.period_ns));
        let p = ((refuse - below) << 32) / at;
        u64::try_from(p.min(1 << 32)).unwrap_or(u64::MAX)
    }

    /// Decide a request of `level` at `now_ns` with a uniform `draw` in `0..2^32`: the counts to
    /// write if it is refused (a refusal counts as a request), `None` if it may go (it counts
    /// once its answer comes, see [`Self::answered`]).
    pub fn refuse(&self, c: &Counts, now_ns: u64, level: u8, draw: u32) -> Option<Counts> {
        if u64::from(draw) >= self.refusal_p32(c, now_ns, level) {
            return None;
        }
        let mut next = self.advance(c, now_ns);
        let r = &mut next.requests[usize::from(level).min(LEVELS - 1)];
        *r = r.saturating_add(1);
        Some(next)
    }

    /// Count a request of `level` that was let through and answered, `accepted` if its status is
    /// not a failure.
    pub fn answered(&self, c: &Counts, now_ns: u64, level: u8, accepted: bool) -> Counts {
        let mut next = self.advance(c, now_ns);
        let r = &mut next.requests[usize::from(level).min(LEVELS - 1)];
        *r = r.saturating_add(1);
        next.accepts = next.accepts.saturating_add(u32::from(accepted));
        next
    }

    /// True if the counts say nothing any more (no request in this or the previous window).
    pub fn is_idle(&self, c: &Counts, now_ns: u64) -> bool {
        let c = self.advance(c, now_ns);
        c.requests
            .iter()
            .chain(&c.previous_requests)
            .all(|&n| n == 0)
    }
}

impl Counts {
    pub fn encode(&self) -> [u8; COUNTS_BYTES] {
        let mut out = [0; COUNTS_BYTES];
        out[0..8].copy_from_slice(&self.window.to_le_bytes());
        let numbers = self
            .requests
            .iter()
            .chain([&self.accepts])
            .chain(&self.previous_requests)
            .chain([&self.previous_accepts]);
        for (i, n) in numbers.enumerate() {
            out[8 + i * 4..12 + i * 4].copy_from_slice(&n.to_le_bytes());
        }
        out
    }

    /// The counts in `bytes`; anything shorter or longer is fresh counts.
    pub fn decode(bytes: &[u8]) -> Self {
        let Ok(bytes) = <&[u8; COUNTS_BYTES]>::try_from(bytes) else {
            return Self::default();
        };
        let u32_at = |i: usize| {
            let at = 8 + i * 4;
            u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
        };
        let mut window = [0; 8];
        window.copy_from_slice(&bytes[0..8]);
        let mut c = Self {
            window: u64::from_le_bytes(window),
            accepts: u32_at(LEVELS),
            previous_accepts: u32_at(2 * LEVELS + 1),
            ..Self::default()
        };
        for l in 0..LEVELS {
            c.requests[l] = u32_at(l);
            c.previous_requests[l] = u32_at(LEVELS + 1 + l);
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SECOND: u64 = 1_000_000_000;

    fn throttle() -> SreThrottle {
        SreThrottle::new(2_000, 10 * SECOND).unwrap()
    }

    /// `requests` requests and `accepts` accepts, all at `now`.
    fn with(t: &SreThrottle, requests: u64, accepts: u64, now: u64) -> Counts {
        with_level(t, Counts::default(), 0, requests, accepts, now)
    }

    fn with_level(
        t: &SreThrottle,
        mut s: Counts,
        level: u8,
        requests: u64,
        accepts: u64,
        now: u64,
    ) -> Counts {
        for i in 0..requests {
            s = t.answered(&s, now, level, i < accepts);
        }
        s
    }

    fn p(t: &SreThrottle, s: &Counts, now: u64, level: u8) -> f64 {
        t.refusal_p32(s, now, level) as f64 / 2f64.powi(32)
    }

    #[test]
    fn a_healthy_backend_is_never_throttled() {
        let t = throttle();
        let s = with(&t, 1_000, 1_000, SECOND);
        assert_eq!(t.refusal_p32(&s, SECOND, 0), 0);
        // Half accepted with k = 2: still nothing refused.
        let s = with(&t, 1_000, 500, SECOND);
        assert_eq!(t.refusal_p32(&s, SECOND, 0), 0);
    }

    #[test]
    fn the_refusal_probability_follows_the_formula() {
        let t = throttle();
        // (1000 − 2 × 200) / 1001 = 0.5994
        let s = with(&t, 1_000, 200, 0);
        let got = p(&t, &s, 0, 0);
        assert!((got - 600.0 / 1001.0).abs() < 1e-6, "{got}");
        // Nothing accepted: (R − 0) / (R + 1).
        let s = with(&t, 99, 0, 0);
        let got = p(&t, &s, 0, 0);
        assert!((got - 0.99).abs() < 1e-6, "{got}");
    }

    #[test]
    fn refused_requests_count_and_old_windows_fade() {
        let t = throttle();
        let s = with(&t, 100, 0, 0);
        let after = t.refuse(&s, 0, 0, 0).expect("refused");
        assert!(t.refuse(&s, 0, 0, u32::MAX).is_none());
        assert!(t.refusal_p32(&after, 0, 0) > t.refusal_p32(&s, 0, 0));
        // Halfway through the next window the old counts weigh half; two windows on, nothing.
        let half = p(&t, &s, 15 * SECOND, 0);
        assert!((half - 50.0 / 51.0).abs() < 1e-6, "{half}");
        assert_eq!(t.refusal_p32(&s, 20 * SECOND, 0), 0);
        assert!(t.is_idle(&s, 20 * SECOND));
        assert!(!t.is_idle(&s, 19 * SECOND));
    }

    #[test]
    fn refusals_fall_on_the_lowest_level_first() {
        let t = throttle();
        // 800 low and 200 high requests, 200 accepted: (1000 − 400) / 1001 ≈ 600 to refuse, all
        // of them low (600 of 800).
        let s = with_level(&t, Counts::default(), 0, 800, 0, 0);
        let s = with_level(&t, s, 3, 200, 200, 0);
        assert!((p(&t, &s, 0, 0) - 0.75 * 1000.0 / 1001.0).abs() < 1e-3);
        assert_eq!(t.refusal_p32(&s, 0, 3), 0);
        // Nothing accepted: every low one and most high ones.
        let s = with_level(&t, Counts::default(), 0, 800, 0, 0);
        let s = with_level(&t, s, 3, 200, 0, 0);
        assert_eq!(t.refusal_p32(&s, 0, 0), 1 << 32);
        assert!((p(&t, &s, 0, 3) - (1000.0 * 1000.0 / 1001.0 - 800.0) / 200.0).abs() < 1e-3);
    }

    #[test]
    fn k_below_one_is_refused() {
        assert!(SreThrottle::new(999, SECOND).is_none());
        assert!(SreThrottle::new(1_000, 0).is_none());
    }

    proptest! {
        #[test]
        fn the_probability_is_a_probability(
            requests in 0u64..5_000, accepts in 0u64..5_000, at in 0u64..30 * SECOND,
            k in 1_000u64..10_000,
        ) {
            let t = SreThrottle::new(k, 10 * SECOND).unwrap();
            let s = with(&t, requests.min(200), accepts, 0);
            for level in 0..6 {
                prop_assert!(t.refusal_p32(&s, at, level) <= 1 << 32);
            }
            prop_assert_eq!(Counts::decode(&s.encode()), s);
        }
    }
}
