//! Sliding window, the two-window estimate: count = current + previous × (1 − elapsed fraction).
//!
//! State: window index + 1, current count, previous count. O(1), and no 2× burst at window edges.

use crate::local::fixed_window::whole;
use crate::state::{div_ceil_u64, read_u64, write_u64, Decision, State, STATE_BYTES};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlidingWindow {
    limit: u64,
    period_ns: u64,
}

impl SlidingWindow {
    pub fn new(limit: u64, period_ns: u64) -> Option<Self> {
        (limit > 0 && period_ns > 0).then_some(Self { limit, period_ns })
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    pub fn period_ns(&self) -> u64 {
        self.period_ns
    }

    /// (window tag, current count, previous count) as of `now_ns`.
    fn counts(&self, state: &State, now_ns: u64) -> (u64, u64, u64) {
        let window = now_ns / self.period_ns + 1;
        let stored = read_u64(state, 0);
        let (current, previous) = if stored == window {
            (read_u64(state, 8), read_u64(state, 16))
        } else if stored + 1 == window {
            (0, read_u64(state, 8))
        } else {
            (0, 0)
        };
        (window, current, previous)
    }

    /// The estimate in units of 1/period requests, and the ns elapsed in the current window.
    fn estimate(&self, current: u64, previous: u64, now_ns: u64) -> (u128, u64) {
        let period = u128::from(self.period_ns);
        let elapsed = now_ns % self.period_ns;
        let weighted = u128::from(previous) * (period - u128::from(elapsed));
        (weighted + u128::from(current) * period, elapsed)
    }

    pub fn decide(&self, state: &State, now_ns: u64, cost: u64) -> Decision {
        let (window, current, previous) = self.counts(state, now_ns);
        let (estimate, elapsed) = self.estimate(current, previous, now_ns);
        let period = u128::from(self.period_ns);
        let capacity = u128::from(self.limit) * period;
        let wanted = estimate + u128::from(cost) * period;
        let reset_ns = self.period_ns - elapsed;
        if wanted <= capacity {
            let mut next = [0; STATE_BYTES];
            write_u64(&mut next, 0, window);
            write_u64(&mut next, 8, current.saturating_add(cost));
            write_u64(&mut next, 16, previous);
            return Decision::Admit {
                state: next,
                remaining: whole(capacity - wanted, period),
                reset_ns,
                delay_ns: 0,
            };
        }
        Decision::Refuse {
            retry_after_ns: self.retry_after(current, previous, elapsed, cost),
            remaining: whole(capacity.saturating_sub(estimate), period),
            reset_ns,
        }
    }

    /// When the previous window's weight will have decayed enough (if nothing else arrives).
    fn retry_after(&self, current: u64, previous: u64, elapsed: u64, cost: u64) -> u64 {
        let period = u128::from(self.period_ns);
        if cost > self.limit {
            return u64::MAX;
        }
        let room = self.limit - cost; // what the others may weigh
        if current <= room {
            // In this window: need previous × (period − e) ≤ (room − current) × period.
            let allowed = u128::from(room - current) * period / u128::from(previous.max(1));
            let e = period.saturating_sub(allowed);
            div_ceil_u64(e.saturating_sub(u128::from(elapsed)), 1).max(1)
        } else {
            // In the next window, where this one's count becomes the previous.
            let allowed = u128::from(room) * period / u128::from(current);
            let e = period.saturating_sub(allowed);
            (self.period_ns - elapsed).saturating_add(div_ceil_u64(e, 1))
        }
    }

    pub fn is_idle(&self, state: &State, now_ns: u64) -> bool {
        let (_, current, previous) = self.counts(state, now_ns);
        current == 0 && previous == 0
    }

    pub fn refund(&self, state: &State, now_ns: u64, cost: u64) -> State {
        let (window, current, _) = self.counts(state, now_ns);
        let mut next = *state;
        if read_u64(state, 0) == window {
            write_u64(&mut next, 8, current.saturating_sub(cost));
        }
        next
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SEC: u64 = 1_000_000_000;

    fn run(w: &SlidingWindow, state: &mut State, now: u64, cost: u64) -> bool {
        crate::state::apply(w.decide(state, now, cost), state)
    }

    #[test]
    fn no_double_burst_across_the_edge() {
        let w = SlidingWindow::new(10, 10 * SEC).unwrap();
        let mut s = [0; STATE_BYTES];
        let edge = 500 * 10 * SEC;
        let before = (0..20).filter(|_| run(&w, &mut s, edge - SEC, 1)).count();
        let after = (0..20).filter(|_| run(&w, &mut s, edge + SEC, 1)).count();
        // At 10% into the new window the previous one still weighs 90%: 9 of 10 are taken.
        assert_eq!((before, after), (10, 1));
        // Retry-After is when the estimate makes room: right after one more 10% has passed.
        match w.decide(&s, edge + SEC, 1) {
            Decision::Refuse { retry_after_ns, .. } => assert_eq!(retry_after_ns, SEC),
            d => panic!("{d:?}"),
        }
        assert!(run(&w, &mut s, edge + 2 * SEC, 1));
        assert!(!w.is_idle(&s, edge + 15 * SEC));
        assert!(w.is_idle(&s, edge + 20 * SEC));
    }

    proptest! {
        /// Within an aligned window at most `limit`; around an edge, in [edge − d, edge + d],
        /// at most `limit × (1 + d / period)` (+1 for rounding): a burst on both sides of an edge
        /// gets the limit once, not twice.
        #[test]
        fn edges_do_not_double_the_limit(
            limit in 1u64..50,
            gaps in prop::collection::vec(0u64..300_000_000, 1..300),
        ) {
            let w = SlidingWindow::new(limit, SEC).unwrap();
            let mut s = [0; STATE_BYTES];
            let mut now = 1_000 * SEC;
            let mut admitted: Vec<u64> = Vec::new();
            for gap in gaps {
                now += gap;
                if run(&w, &mut s, now, 1) {
                    admitted.push(now);
                }
                let edge = now / SEC * SEC;
                let d = now - edge;
                let in_window = admitted.iter().filter(|t| **t >= edge).count() as u64;
                prop_assert!(in_window <= limit);
                let around = admitted.iter().filter(|t| **t + d >= edge).count() as u64;
                let bound = limit + limit * d / SEC + 1;
                prop_assert!(around <= bound, "{} around the edge (d = {} ns), bound {}", around, d, bound);
            }
        }
    }
}
