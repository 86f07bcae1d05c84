//! Leaky bucket with nginx `limit_req` semantics: `excess` drains at the rate; a request adds one;
//! beyond `burst` it is refused; admitted excess beyond `delay` is held for excess / rate.
//!
//! State: excess (u128, in units where one request is `period_ns`, draining `requests` per ns),
//! last update (ns). Exact integer arithmetic, like the token bucket.

use crate::local::fixed_window::whole;
use crate::state::{
    div_ceil_u64, read_u128, read_u64, write_u128, write_u64, Decision, State, CLOCK_SKEW_MS,
    STATE_BYTES,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeakyBucket {
    requests: u64,
    period_ns: u64,
    /// Excess requests accepted beyond the rate (nginx `burst`).
    burst: u64,
    /// Excess requests passed on without delay (nginx `delay`; `u64::MAX` = `nodelay`).
    delay: u64,
    /// A request that would be held longer is refused instead.
    max_delay_ns: u64,
}

impl LeakyBucket {
    pub fn new(
        requests: u64,
        period_ns: u64,
        burst: u64,
        delay: u64,
        max_delay_ns: u64,
    ) -> Option<Self> {
        (requests > 0 && period_ns > 0).then_some(Self {
            requests,
            period_ns,
            burst,
            delay,
            max_delay_ns,
        })
    }

    pub fn requests(&self) -> u64 {
        self.requests
    }

    pub fn period_ns(&self) -> u64 {
        self.period_ns
    }

    pub fn burst(&self) -> u64 {
        self.burst
    }

    /// Excess requests passed on undelayed (`u64::MAX` = never delay).
    pub fn delay(&self) -> u64 {
        self.delay
    }

    pub fn max_delay_ns(&self) -> u64 {
        self.max_delay_ns
    }

    fn unit(&self) -> u128 {
        u128::from(self.period_ns)
    }

    /// The state was last updated after `now_ns` by more than workers' clocks differ: the clock
    /// stepped back.
    fn stepped_back(&self, state: &State, now_ns: u64) -> bool {
        read_u64(state, 16) > now_ns.saturating_add(CLOCK_SKEW_MS * 1_000_000)
    }

    /// The excess a request of cost 1 arriving at `now_ns` would bring the key to.
    ///
    /// nginx: excess = max(0, excess − rate × elapsed + 1 request) — the first request after a
    /// full interval of quiet is "in rate" (excess 0), one half an interval later is half early.
    fn next_excess(&self, state: &State, now_ns: u64) -> u128 {
        if self.stepped_back(state, now_ns) {
            // A state from beyond the clock: read as a bucket with room for this request, so
            // that the key drains at its rate from now on (a refusal writes nothing: read as it
            // stands, the bucket would not drain until the clock caught up).
            let burst = u128::from(self.burst) * self.unit();
            return (read_u128(state, 0) + self.unit()).min(burst);
        }
        let elapsed = now_ns.saturating_sub(read_u64(state, 16));
        let drained = u128::from(self.requests) * u128::from(elapsed);
        (read_u128(state, 0) + self.unit()).saturating_sub(drained)
    }

    pub fn decide(&self, state: &State, now_ns: u64, cost: u64) -> Decision {
        let unit = self.unit();
        let rate = u128::from(self.requests);
        let first = self.next_excess(state, now_ns);
        // A request of cost n is n requests at once; cost 0 only lets the excess drain.
        let excess = match cost {
            0 => first.saturating_sub(unit),
            n => first + u128::from(n - 1) * unit,
        };
        let drained = first.saturating_sub(unit);
        let capacity = u128::from(self.burst) * unit;
        let reset_ns = div_ceil_u64(excess, rate);
        if excess > capacity {
            return Decision::Refuse {
                retry_after_ns: div_ceil_u64(excess - capacity, rate),
                remaining: 0,
                reset_ns: div_ceil_u64(drained, rate),
            };
        }
        let undelayed = u128::from(self.delay).saturating_mul(unit);
        let delay_ns = div_ceil_u64(excess.saturating_sub(undelayed), rate);
        if delay_ns > self.max_delay_ns {
            return Decision::Refuse {
                retry_after_ns: delay_ns - self.max_delay_ns,
                remaining: 0,
                reset_ns: div_ceil_u64(drained, rate),
            };
        }
        let mut next = [0; STATE_BYTES];
        write_u128(&mut next, 0, excess);
        // The later of the two (workers' clocks differ by microseconds), unless the clock stepped
        // back: then now.
        let last = if self.stepped_back(state, now_ns) {
            now_ns
        } else {
            now_ns.max(read_u64(state, 16))
        };
        write_u64(&mut next, 16, last);
        Decision::Admit {
            state: next,
            remaining: whole(capacity - excess, unit),
            reset_ns,
            delay_ns,
        }
    }

    pub fn is_idle(&self, state: &State, now_ns: u64) -> bool {
        self.next_excess(state, now_ns) == 0
    }

    pub fn refund(&self, state: &State, cost: u64) -> State {
        let mut next = *state;
        let excess = read_u128(state, 0).saturating_sub(u128::from(cost) * self.unit());
        write_u128(&mut next, 0, excess);
        next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000_000;
    const NOW: u64 = 1_000_000 * SEC;

    /// (admitted, delay) of `n` simultaneous requests.
    fn burst(b: &LeakyBucket, n: usize) -> Vec<Option<u64>> {
        let mut s = [0; STATE_BYTES];
        (0..n)
            .map(|_| match b.decide(&s, NOW, 1) {
                Decision::Admit {
                    state, delay_ns, ..
                } => {
                    s = state;
                    Some(delay_ns)
                }
                _ => None,
            })
            .collect()
    }

    #[test]
    fn like_nginx_without_nodelay_excess_is_spaced_at_the_rate() {
        // rate=10r/s burst=3: 1 in rate + 3 delayed by 100, 200, 300 ms; the 5th refused.
        let b = LeakyBucket::new(10, SEC, 3, 0, 60 * SEC).unwrap();
        let ms = 1_000_000;
        assert_eq!(
            burst(&b, 5),
            [
                Some(0),
                Some(100 * ms),
                Some(200 * ms),
                Some(300 * ms),
                None
            ]
        );
    }

    #[test]
    fn nodelay_and_delay_n() {
        let nodelay = LeakyBucket::new(10, SEC, 3, u64::MAX, 60 * SEC).unwrap();
        assert_eq!(
            burst(&nodelay, 5),
            [Some(0), Some(0), Some(0), Some(0), None]
        );
        let ms = 1_000_000;
        let delay1 = LeakyBucket::new(10, SEC, 3, 1, 60 * SEC).unwrap();
        assert_eq!(
            burst(&delay1, 5),
            [Some(0), Some(0), Some(100 * ms), Some(200 * ms), None]
        );
    }

    #[test]
    fn a_clock_stepped_back_never_refuses_longer_than_the_bucket_takes_to_drain() {
        // 1 a second, burst 2, nodelay: filled and refused; then the clock steps back one hour.
        let b = LeakyBucket::new(1, SEC, 2, u64::MAX, 60 * SEC).unwrap();
        let mut s = [0; STATE_BYTES];
        for _ in 0..3 {
            if let Decision::Admit { state, .. } = b.decide(&s, NOW, 1) {
                s = state;
            }
        }
        assert!(matches!(b.decide(&s, NOW, 1), Decision::Refuse { .. }));
        let back = NOW - 3_600 * SEC;
        // Before: refused for the hour. Now: room for one, then the rate from the new clock.
        let Decision::Admit { state, .. } = b.decide(&s, back, 1) else {
            panic!("refused after the step")
        };
        assert!(matches!(
            b.decide(&state, back + SEC / 2, 1),
            Decision::Refuse { .. }
        ));
        assert!(matches!(
            b.decide(&state, back + SEC, 1),
            Decision::Admit { .. }
        ));
    }

    #[test]
    fn max_delay_refuses_what_would_wait_too_long() {
        let b = LeakyBucket::new(1, SEC, 10, 0, 2 * SEC).unwrap();
        let admitted = burst(&b, 6).into_iter().flatten().count();
        assert_eq!(admitted, 3); // delays 0, 1 s, 2 s; 3 s is over max_delay
    }

    #[test]
    fn steady_client_at_the_rate_is_never_delayed_and_idle_after_draining() {
        let b = LeakyBucket::new(4, SEC, 0, 0, SEC).unwrap();
        let mut s = [0; STATE_BYTES];
        for i in 0..4_000u64 {
            let now = NOW + i * SEC / 4;
            match b.decide(&s, now, 1) {
                Decision::Admit {
                    state, delay_ns, ..
                } => {
                    assert_eq!(delay_ns, 0, "request {i}");
                    s = state;
                }
                d => panic!("request {i}: {d:?}"),
            }
        }
        assert!(b.is_idle(&s, NOW + 1_001 * SEC));
    }
}
