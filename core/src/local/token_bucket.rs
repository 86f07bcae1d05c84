//! GCRA, the token bucket kept as one timestamp: the decision as a pure function of state and time.
//!
//! Time is scaled by `requests` so that the emission interval `period / requests` is an exact
//! integer (`period_ns` in scaled units): no rounding drift, whatever the rate.

use crate::state::{read_u128, read_u64, write_u128, write_u64, Decision, State};

/// Where a bucket's state keeps until when tokens it handed to worker stashes may come back.
const STASH_OUT_AT: usize = 16;
/// Where it keeps the latest `tat` a settlement charged beyond the bucket (ns): up to it, a `tat`
/// past the horizon is debt, not a clock that stepped back ([`crate::local::settle`]).
pub(crate) const OWED_UNTIL_AT: usize = 24;

/// A token bucket of capacity `burst`, refilled with `requests` tokens per `period_ns`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TokenBucket {
    requests: u64,
    period_ns: u64,
    burst: u64,
}

impl TokenBucket {
    /// `None` if any parameter is zero.
    pub fn new(requests: u64, period_ns: u64, burst: u64) -> Option<Self> {
        (requests > 0 && period_ns > 0 && burst > 0).then_some(Self {
            requests,
            period_ns,
            burst,
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

    pub(crate) fn scaled(&self, ns: u64) -> u128 {
        u128::from(ns) * u128::from(self.requests)
    }

    pub(crate) fn unscale_up(&self, scaled: u128) -> u64 {
        let r = u128::from(self.requests);
        u64::try_from(scaled.div_ceil(r)).unwrap_or(u64::MAX)
    }

    /// Capacity of the bucket in scaled time: `burst` emission intervals.
    fn capacity(&self) -> u128 {
        u128::from(self.period_ns) * u128::from(self.burst)
    }

    /// True if a bucket with this `tat` is full at `now_ns`: it is then the same as a fresh one.
    pub fn is_full(&self, tat: u128, now_ns: u64) -> bool {
        tat <= self.scaled(now_ns)
    }

    /// Decide a request of `cost` tokens at `now_ns` against stored `tat` (0 for a fresh
    /// bucket): [`Self::decide_state`] over a state that holds only `tat`.
    pub fn decide(&self, tat: u128, now_ns: u64, cost: u64) -> Decision {
        let mut state = [0; crate::state::STATE_BYTES];
        write_u128(&mut state, 0, tat);
        self.decide_state(&state, now_ns, cost)
    }

    /// The GCRA decision over a slot's state (the TAT in its first 16 bytes; a settlement may
    /// have put the bucket in debt until the time it notes).
    pub fn decide_state(&self, state: &State, now_ns: u64, cost: u64) -> Decision {
        let tat = read_u128(state, 0);
        let now = self.scaled(now_ns);
        let horizon = now.saturating_add(self.capacity());
        let period = u128::from(self.period_ns);
        // A `tat` beyond the horizon (and beyond any debt) is no bucket's: the clock stepped
        // back. Read it as a bucket with one token left, so the key is admitted at its rate from
        // now on, never refused for the length of the step (a refusal writes nothing, so reading
        // it as empty would refuse until the clock caught up).
        let owed = self.scaled(read_u64(state, OWED_UNTIL_AT));
        let base = if tat > horizon && tat > owed {
            horizon.saturating_sub(period)
        } else {
            tat
        }
        .max(now);
        let new_tat = base.saturating_add(period.saturating_mul(u128::from(cost)));
        if new_tat <= horizon {
            let mut next = *state;
            write_u128(&mut next, 0, new_tat);
            Decision::Admit {
                state: next,
                remaining: tokens(horizon - new_tat, period),
                reset_ns: self.unscale_up(new_tat - now),
                delay_ns: 0,
            }
        } else {
            Decision::Refuse {
                retry_after_ns: self.unscale_up(new_tat - horizon),
                remaining: tokens(horizon.saturating_sub(base), period),
                reset_ns: self.unscale_up(base - now),
            }
        }
    }

    /// Until when (ns) tokens this bucket handed to worker stashes may still come back to it.
    pub fn stash_out_until(state: &State) -> u64 {
        read_u64(state, STASH_OUT_AT)
    }

    /// The state noting that stashed tokens may come back until `until_ns` (the later of two).
    pub fn with_stash_out(state: &State, until_ns: u64) -> State {
        let mut next = *state;
        write_u64(
            &mut next,
            STASH_OUT_AT,
            until_ns.max(Self::stash_out_until(state)),
        );
        next
    }

    /// The `tat` after giving back `cost` tokens taken by an earlier `Allow` (for all-or-nothing).
    pub fn refund(&self, tat: u128, cost: u64) -> u128 {
        tat.saturating_sub(u128::from(self.period_ns).saturating_mul(u128::from(cost)))
    }
}

fn tokens(span: u128, period: u128) -> u64 {
    u64::try_from(span / period).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SEC: u64 = 1_000_000_000;

    fn allowed(d: Decision) -> Option<u128> {
        match d {
            Decision::Admit { state, .. } => Some(read_u128(&state, 0)),
            _ => None,
        }
    }

    #[test]
    fn a_clock_stepped_back_never_refuses_longer_than_the_limit_allows() {
        // 100 per hour, 1 spent; then the clock steps back one hour.
        let tb = TokenBucket::new(100, 3_600 * SEC, 100).unwrap();
        let now = 10_000 * SEC;
        let tat = allowed(tb.decide(0, now, 1)).unwrap();
        let back = now - 3_600 * SEC;
        // Before: refused for ~59 minutes. Now: read as one token left, then the rate.
        let tat = allowed(tb.decide(tat, back, 1)).expect("one token left");
        assert_eq!(allowed(tb.decide(tat, back + SEC, 1)), None);
        assert!(allowed(tb.decide(tat, back + 36 * SEC, 1)).is_some());
    }

    #[test]
    fn fresh_bucket_admits_burst_then_denies_with_retry_after_one_interval() {
        let tb = TokenBucket::new(10, SEC, 5).unwrap();
        let now = 1_000 * SEC;
        let mut tat = 0;
        for i in 0..5 {
            match tb.decide(tat, now, 1) {
                Decision::Admit {
                    state,
                    remaining,
                    reset_ns,
                    ..
                } => {
                    let t = read_u128(&state, 0);
                    assert_eq!(remaining, 4 - i);
                    assert_eq!(reset_ns, (i + 1) * SEC / 10);
                    tat = t;
                }
                d => panic!("request {i} denied: {d:?}"),
            }
        }
        assert_eq!(
            tb.decide(tat, now, 1),
            Decision::Refuse {
                retry_after_ns: SEC / 10,
                remaining: 0,
                reset_ns: SEC / 2
            }
        );
        assert!(allowed(tb.decide(tat, now + SEC / 10, 1)).is_some());
        assert!(tb.is_full(tat, now + SEC / 2));
        assert!(!tb.is_full(tat, now + SEC / 2 - 1));
    }

    #[test]
    fn non_integer_interval_has_no_drift() {
        // 3 per 2 ns: the interval is 2/3 ns, which no integer nanosecond interval can express.
        // A client taking exactly 3 every 2 ns must be served forever, and never a 4th.
        let tb = TokenBucket::new(3, 2, 3).unwrap();
        let mut tat = 0;
        for tick in 0..10_000u64 {
            let now = SEC + 2 * tick;
            for n in 0..3 {
                tat = allowed(tb.decide(tat, now, 1))
                    .unwrap_or_else(|| panic!("refused at tick {tick}, request {n}"));
            }
            assert!(
                allowed(tb.decide(tat, now, 1)).is_none(),
                "4th admitted at {tick}"
            );
        }
    }

    #[test]
    fn cost_larger_than_burst_is_denied() {
        let tb = TokenBucket::new(1, SEC, 3).unwrap();
        assert!(allowed(tb.decide(0, SEC, 4)).is_none());
        assert!(allowed(tb.decide(0, SEC, 3)).is_some());
    }

    #[test]
    fn refund_restores_the_state() {
        let tb = TokenBucket::new(7, SEC, 3).unwrap();
        let tat = allowed(tb.decide(0, SEC, 1)).unwrap();
        let tat2 = allowed(tb.decide(tat, SEC, 2)).unwrap();
        assert_eq!(tb.refund(tat2, 2), tat);
    }

    #[test]
    fn zero_parameters_are_rejected() {
        assert!(TokenBucket::new(0, SEC, 1).is_none());
        assert!(TokenBucket::new(1, 0, 1).is_none());
        assert!(TokenBucket::new(1, SEC, 0).is_none());
    }

    proptest! {
        #[test]
        fn admitted_never_exceeds_burst_plus_rate_times_elapsed_plus_one(
            requests in 1u64..1000,
            period_ms in 1u64..100_000,
            burst in 1u64..500,
            gaps in prop::collection::vec(0u64..5_000_000_000, 1..400),
        ) {
            let period_ns = period_ms * 1_000_000;
            let tb = TokenBucket::new(requests, period_ns, burst).unwrap();
            let start = 1_000_000 * SEC;
            let mut now = start;
            let mut tat = 0;
            let mut admitted = 0u128;
            for gap in gaps {
                now += gap;
                if let Some(t) = allowed(tb.decide(tat, now, 1)) {
                    tat = t;
                    admitted += 1;
                }
                let elapsed = u128::from(now - start);
                let bound = u128::from(burst)
                    + elapsed * u128::from(requests) / u128::from(period_ns) + 1;
                prop_assert!(admitted <= bound, "admitted {} > bound {}", admitted, bound);
            }
        }

        #[test]
        fn steady_client_at_or_below_the_rate_is_never_refused(
            requests in 1u64..1000,
            period_ms in 1u64..100_000,
            burst in 1u64..50,
            slack_ns in prop::collection::vec(0u64..1_000_000, 1..300),
        ) {
            let period_ns = period_ms * 1_000_000;
            let tb = TokenBucket::new(requests, period_ns, burst).unwrap();
            // Each of the client's requests comes no earlier than an interval after the one
            // before (in whole ns: the interval rounded up).
            let interval = period_ns.div_ceil(requests);
            let mut now = 1_000_000 * SEC;
            let mut tat = 0;
            for (n, slack) in slack_ns.into_iter().enumerate() {
                if n > 0 {
                    now += interval + slack;
                }
                let t = allowed(tb.decide(tat, now, 1));
                prop_assert!(t.is_some(), "request {} refused", n);
                tat = t.unwrap();
            }
        }
    }
}
