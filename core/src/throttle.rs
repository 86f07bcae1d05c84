//! Success-rate throttle (Google SRE client-side throttling): refuse with probability
//! `max(0, (requests − k × accepts) / (requests + 1))` over a sliding window.
//!
//! State: window index + 1, then this window's and the previous window's requests and accepts.
//! Counts use the two-window estimate of [`crate::sliding_window`]: the previous window weighs
//! what is left of it. Every request counts, refused ones too (the SRE formula's `requests` are the
//! attempts): a backend that stops accepting is asked less and less, and still probed.

use crate::state::{read_u32, read_u64, saturating_u32, write_u32, write_u64, State, STATE_BYTES};

/// `k` is kept in thousandths.
pub const K_SCALE: u64 = 1_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SreThrottle {
    k_milli: u64,
    period_ns: u64,
}

/// The counts of a window as of a time: (window tag, requests, accepts) of the current and the
/// previous window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Counts {
    window: u64,
    requests: u64,
    accepts: u64,
    previous_requests: u64,
    previous_accepts: u64,
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

    fn counts(&self, state: &State, now_ns: u64) -> Counts {
        let window = now_ns / self.period_ns + 1;
        let stored = read_u64(state, 0);
        let current = (
            u64::from(read_u32(state, 8)),
            u64::from(read_u32(state, 12)),
        );
        let previous = (
            u64::from(read_u32(state, 16)),
            u64::from(read_u32(state, 20)),
        );
        let ((requests, accepts), (previous_requests, previous_accepts)) = if stored == window {
            (current, previous)
        } else if stored + 1 == window {
            ((0, 0), current)
        } else {
            ((0, 0), (0, 0))
        };
        Counts {
            window,
            requests,
            accepts,
            previous_requests,
            previous_accepts,
        }
    }

    fn encode(c: &Counts) -> State {
        let mut next = [0; STATE_BYTES];
        write_u64(&mut next, 0, c.window);
        write_u32(&mut next, 8, saturating_u32(c.requests));
        write_u32(&mut next, 12, saturating_u32(c.accepts));
        write_u32(&mut next, 16, saturating_u32(c.previous_requests));
        write_u32(&mut next, 20, saturating_u32(c.previous_accepts));
        next
    }

    /// The estimated requests and accepts over the last period, in units of 1/period_ns.
    fn weighted(&self, c: &Counts, now_ns: u64) -> (u128, u128) {
        let period = u128::from(self.period_ns);
        let left = period - u128::from(now_ns % self.period_ns);
        (
            u128::from(c.previous_requests) * left + u128::from(c.requests) * period,
            u128::from(c.previous_accepts) * left + u128::from(c.accepts) * period,
        )
    }

    /// The probability of refusing a request now, in parts of 2^32.
    pub fn refusal_p32(&self, state: &State, now_ns: u64) -> u64 {
        let c = self.counts(state, now_ns);
        let (requests, accepts) = self.weighted(&c, now_ns);
        let scaled_requests = requests * u128::from(K_SCALE);
        let scaled_accepts = accepts * u128::from(self.k_milli);
        if scaled_requests <= scaled_accepts {
            return 0;
        }
        // (R − k·A) / (R + 1), with R and A in units of 1/period and k in thousandths.
        let numerator = (scaled_requests - scaled_accepts) << 32;
        let denominator = (requests + u128::from(self.period_ns)) * u128::from(K_SCALE);
        u64::try_from(numerator / denominator).unwrap_or(u64::MAX)
    }

    /// Decide a request at `now_ns` with a uniform `draw` in `0..2^32`: it is counted either way;
    /// returns the state to write and whether it is refused.
    pub fn request(&self, state: &State, now_ns: u64, draw: u32) -> (State, bool) {
        let refused = u64::from(draw) < self.refusal_p32(state, now_ns);
        let mut c = self.counts(state, now_ns);
        c.requests = c.requests.saturating_add(1);
        (Self::encode(&c), refused)
    }

    /// Count `n` accepted answers (the upstream answered with a status that is not a failure).
    pub fn accepted(&self, state: &State, now_ns: u64, n: u64) -> State {
        let mut c = self.counts(state, now_ns);
        c.accepts = c.accepts.saturating_add(n);
        Self::encode(&c)
    }

    /// True if the state says nothing any more (no request in this or the previous window).
    pub fn is_idle(&self, state: &State, now_ns: u64) -> bool {
        let c = self.counts(state, now_ns);
        c.requests == 0 && c.previous_requests == 0
    }
}

/// A draw in `0..2^32` from a seed (SplitMix64): requests need no random source of the host's, a
/// counter or the time is seed enough for a refusal probability.
pub fn draw(seed: u64) -> u32 {
    let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((z ^ (z >> 31)) >> 32) as u32
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
    fn with(t: &SreThrottle, requests: u64, accepts: u64, now: u64) -> State {
        let mut s = [0; STATE_BYTES];
        for i in 0..requests {
            s = t.request(&s, now, u32::MAX - (i as u32 & 1)).0;
        }
        t.accepted(&s, now, accepts)
    }

    #[test]
    fn a_healthy_backend_is_never_throttled() {
        let t = throttle();
        let s = with(&t, 1_000, 1_000, SECOND);
        assert_eq!(t.refusal_p32(&s, SECOND), 0);
        // Half accepted with k = 2: still nothing refused.
        let s = with(&t, 1_000, 500, SECOND);
        assert_eq!(t.refusal_p32(&s, SECOND), 0);
    }

    #[test]
    fn the_refusal_probability_follows_the_formula() {
        let t = throttle();
        // (1000 − 2 × 200) / 1001 = 0.5994
        let s = with(&t, 1_000, 200, 0);
        let p = t.refusal_p32(&s, 0) as f64 / 2f64.powi(32);
        assert!((p - 600.0 / 1001.0).abs() < 1e-6, "{p}");
        // Nothing accepted: (R − 0) / (R + 1).
        let s = with(&t, 99, 0, 0);
        let p = t.refusal_p32(&s, 0) as f64 / 2f64.powi(32);
        assert!((p - 0.99).abs() < 1e-6, "{p}");
    }

    #[test]
    fn refused_requests_count_and_old_windows_fade() {
        let t = throttle();
        let s = with(&t, 100, 0, 0);
        let (after, refused) = t.request(&s, 0, 0);
        assert!(refused);
        assert!(t.refusal_p32(&after, 0) > t.refusal_p32(&s, 0));
        // Halfway through the next window the old counts weigh half; two windows on, nothing.
        let half = t.refusal_p32(&s, 15 * SECOND) as f64 / 2f64.powi(32);
        assert!((half - 50.0 / 51.0).abs() < 1e-6, "{half}");
        assert_eq!(t.refusal_p32(&s, 20 * SECOND), 0);
        assert!(t.is_idle(&s, 20 * SECOND));
        assert!(!t.is_idle(&s, 19 * SECOND));
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
            let p = t.refusal_p32(&s, at);
            prop_assert!(p < 1 << 32);
        }

        #[test]
        fn draws_are_spread_evenly(seed in any::<u64>()) {
            // Of 4096 consecutive seeds, about a quarter fall below 2^30.
            let below = (0..4096u64).filter(|i| draw(seed.wrapping_add(*i)) < 1 << 30).count();
            prop_assert!((850..1200).contains(&below), "{below}");
        }
    }
}
