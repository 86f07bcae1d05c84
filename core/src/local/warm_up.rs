//! Token bucket with warm-up (Guava SmoothWarmingUp / Sentinel warm-up): after idleness the rate
//! starts at a third of the limit and ramps to the full limit over the warm-up period of use.
//!
//! State: stored permits (f64 bits), the next free time (ns), an "in use" marker. A fresh key is
//! cold (all permits stored), as after a long idle time. Requests are never queued: one is admitted
//! when the next free time has come, and pays for its permits forward.

use crate::state::{read_u64, write_u64, Decision, State, STATE_BYTES};

const COLD_FACTOR: f64 = 3.0;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WarmUp {
    requests: u64,
    period_ns: u64,
    warmup_ns: u64,
    stable_ns: f64,
    cold_ns: f64,
    threshold: f64,
    max_permits: f64,
    slope: f64,
}

impl WarmUp {
    pub fn new(requests: u64, period_ns: u64, warmup_ns: u64) -> Option<Self> {
        if requests == 0 || period_ns == 0 || warmup_ns == 0 {
            return None;
        }
        let stable_ns = period_ns as f64 / requests as f64;
        let cold_ns = stable_ns * COLD_FACTOR;
        let warmup = warmup_ns as f64;
        let threshold = 0.5 * warmup / stable_ns;
        let max_permits = threshold + 2.0 * warmup / (stable_ns + cold_ns);
        let slope = (cold_ns - stable_ns) / (max_permits - threshold);
        Some(Self {
            requests,
            period_ns,
            warmup_ns,
            stable_ns,
            cold_ns,
            threshold,
            max_permits,
            slope,
        })
    }

    pub fn requests(&self) -> u64 {
        self.requests
    }

    pub fn period_ns(&self) -> u64 {
        self.period_ns
    }

    pub fn warmup_ns(&self) -> u64 {
        self.warmup_ns
    }

    /// (stored permits, next free ns) brought up to `now_ns`: idle time refills stored permits
    /// at the rate that takes the whole warm-up period to fill them.
    fn resync(&self, state: &State, now_ns: u64) -> (f64, u64) {
        if state[16] == 0 {
            return (self.max_permits, now_ns);
        }
        let stored = f64::from_bits(read_u64(state, 0));
        let next_free = read_u64(state, 8);
        if now_ns <= next_free {
            return (stored, next_free);
        }
        let cool_down_ns = self.warmup_ns as f64 / self.max_permits;
        let refilled = (now_ns - next_free) as f64 / cool_down_ns;
        ((stored + refilled).min(self.max_permits), now_ns)
    }

    /// ns that taking `take` of `stored` permits costs (the area under the warm-up ramp).
    fn stored_cost(&self, stored: f64, take: f64) -> f64 {
        let above = (stored - self.threshold).max(0.0);
        let from_above = take.min(above);
        let interval_at = |p: f64| self.stable_ns + p * self.slope;
        let ramp = from_above * (interval_at(above) + interval_at(above - from_above)) / 2.0;
        ramp + (take - from_above) * self.stable_ns
    }

    pub fn decide(&self, state: &State, now_ns: u64, cost: u64) -> Decision {
        let (stored, next_free) = self.resync(state, now_ns);
        if next_free > now_ns {
            return Decision::Refuse {
                retry_after_ns: next_free - now_ns,
                remaining: 0,
                reset_ns: next_free - now_ns,
            };
        }
        let take = (cost as f64).min(stored);
        let fresh = cost as f64 - take;
        let wait = self.stored_cost(stored, take) + fresh * self.stable_ns;
        let next_free = now_ns.saturating_add(wait.ceil() as u64);
        let mut next = [0; STATE_BYTES];
        write_u64(&mut next, 0, (stored - take).to_bits());
        write_u64(&mut next, 8, next_free);
        next[16] = 1;
        Decision::Admit {
            state: next,
            remaining: u64::from(next_free <= now_ns),
            reset_ns: next_free - now_ns,
            delay_ns: 0,
        }
    }

    pub fn is_idle(&self, state: &State, now_ns: u64) -> bool {
        let (stored, next_free) = self.resync(state, now_ns);
        next_free <= now_ns && stored >= self.max_permits
    }

    /// Approximate: gives back `cost` stable intervals of the next free time.
    pub fn refund(&self, state: &State, cost: u64) -> State {
        let mut next = *state;
        let back = (cost as f64 * self.stable_ns) as u64;
        write_u64(&mut next, 8, read_u64(state, 8).saturating_sub(back));
        next
    }

    /// The interval between admissions when fully cold.
    pub fn cold_interval_ns(&self) -> f64 {
        self.cold_ns
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000_000;

    /// Admissions per second of a client that tries every millisecond.
    fn per_second(w: &WarmUp, seconds: u64) -> Vec<u64> {
        let mut s = [0; STATE_BYTES];
        let start = 1_000 * SEC;
        let mut counts = vec![0; seconds as usize];
        for ms in 0..seconds * 1_000 {
            let now = start + ms * 1_000_000;
            if let Decision::Admit { state, .. } = w.decide(&s, now, 1) {
                s = state;
                counts[(ms / 1_000) as usize] += 1;
            }
        }
        counts
    }

    #[test]
    fn ramps_from_a_third_to_the_full_rate_over_the_warm_up_period() {
        let w = WarmUp::new(30, SEC, 4 * SEC).unwrap();
        let counts = per_second(&w, 8);
        assert!((10..=13).contains(&counts[0]), "{counts:?}");
        assert!(counts[0] < counts[1] && counts[1] < counts[2], "{counts:?}");
        for c in &counts[5..] {
            assert!((29..=31).contains(c), "{counts:?}");
        }
    }

    #[test]
    fn idleness_cools_it_down_again() {
        let w = WarmUp::new(30, SEC, 2 * SEC).unwrap();
        let mut s = [0; STATE_BYTES];
        let t0 = 1_000 * SEC;
        for ms in 0..5_000 {
            if let Decision::Admit { state, .. } = w.decide(&s, t0 + ms * 1_000_000, 1) {
                s = state;
            }
        }
        assert!(!w.is_idle(&s, t0 + 5 * SEC));
        assert!(w.is_idle(&s, t0 + 10 * SEC));
    }
}
