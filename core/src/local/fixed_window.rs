//! Fixed window: `limit` per window of `period`, windows aligned to the clock (Unix epoch).
//!
//! State: window index + 1 (0 = never used), count. Known flaw, kept on purpose: up to 2× the limit
//! across a window edge (see the sliding window).

use crate::state::{div_u64, read_u64, write_u64, Decision, State, STATE_BYTES};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FixedWindow {
    limit: u64,
    period_ns: u64,
}

impl FixedWindow {
    /// `None` if a parameter is zero.
    pub fn new(limit: u64, period_ns: u64) -> Option<Self> {
        (limit > 0 && period_ns > 0).then_some(Self { limit, period_ns })
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    pub fn period_ns(&self) -> u64 {
        self.period_ns
    }

    /// The count of the current window (0 if the stored one has passed) and the window's tag.
    fn current(&self, state: &State, now_ns: u64) -> (u64, u64) {
        let window = now_ns / self.period_ns + 1;
        let count = if read_u64(state, 0) == window {
            read_u64(state, 8)
        } else {
            0
        };
        (window, count)
    }

    fn window_end(&self, window: u64) -> u64 {
        window.saturating_mul(self.period_ns)
    }

    pub fn decide(&self, state: &State, now_ns: u64, cost: u64) -> Decision {
        let (window, count) = self.current(state, now_ns);
        let reset_ns = self.window_end(window) - now_ns;
        let used = count.saturating_add(cost);
        if used <= self.limit {
            let mut next = [0; STATE_BYTES];
            write_u64(&mut next, 0, window);
            write_u64(&mut next, 8, used);
            Decision::Admit {
                state: next,
                remaining: self.limit - used,
                reset_ns,
                delay_ns: 0,
            }
        } else {
            Decision::Refuse {
                retry_after_ns: reset_ns,
                remaining: self.limit.saturating_sub(count),
                reset_ns,
            }
        }
    }

    pub fn is_idle(&self, state: &State, now_ns: u64) -> bool {
        self.current(state, now_ns).1 == 0
    }

    pub fn refund(&self, state: &State, now_ns: u64, cost: u64) -> State {
        let (window, count) = self.current(state, now_ns);
        let mut next = *state;
        if read_u64(state, 0) == window {
            write_u64(&mut next, 8, count.saturating_sub(cost));
        }
        next
    }
}

/// Shared by the window algorithms: whole requests in `num` scaled units of `unit`.
pub(crate) fn whole(num: u128, unit: u128) -> u64 {
    div_u64(num, unit)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000_000;

    fn run(w: &FixedWindow, state: &mut State, now: u64) -> bool {
        crate::state::apply(w.decide(state, now, 1), state)
    }

    #[test]
    fn counts_per_aligned_window_and_admits_twice_across_an_edge() {
        let w = FixedWindow::new(3, 10 * SEC).unwrap();
        let mut s = [0; STATE_BYTES];
        let edge = 1_000 * 10 * SEC;
        let before: usize = (0..5).filter(|_| run(&w, &mut s, edge - 1)).count();
        let after: usize = (0..5).filter(|_| run(&w, &mut s, edge)).count();
        assert_eq!((before, after), (3, 3));
        match w.decide(&s, edge + SEC, 1) {
            Decision::Refuse {
                retry_after_ns,
                remaining,
                ..
            } => {
                assert_eq!((retry_after_ns, remaining), (9 * SEC, 0));
            }
            d => panic!("{d:?}"),
        }
        assert!(!w.is_idle(&s, edge + SEC));
        assert!(w.is_idle(&s, edge + 10 * SEC));
        let refunded = w.refund(&s, edge + SEC, 1);
        assert_eq!(w.current(&refunded, edge + SEC).1, 2);
    }
}
