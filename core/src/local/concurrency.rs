//! Concurrency: at most `limit` requests in flight per key; a request holds its share until it ends.
//!
//! State: the in-flight count. Releases go through the same CAS as admissions, so the count never
//! drifts under contention.

use crate::state::{read_u64, write_u64, Decision, State};

/// What a refused request is told to wait: the time a release takes is unknowable.
pub const RETRY_AFTER_NS: u64 = 1_000_000_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Concurrency {
    limit: u64,
}

impl Concurrency {
    pub fn new(limit: u64) -> Option<Self> {
        (limit > 0).then_some(Self { limit })
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    pub fn decide(&self, state: &State, cost: u64) -> Decision {
        let in_flight = read_u64(state, 0);
        let wanted = in_flight.saturating_add(cost);
        if wanted <= self.limit {
            let mut next = *state;
            write_u64(&mut next, 0, wanted);
            Decision::Admit {
                state: next,
                remaining: self.limit - wanted,
                reset_ns: 0,
                delay_ns: 0,
            }
        } else {
            Decision::Refuse {
                retry_after_ns: RETRY_AFTER_NS,
                remaining: self.limit.saturating_sub(in_flight),
                reset_ns: RETRY_AFTER_NS,
            }
        }
    }

    pub fn in_flight(state: &State) -> u64 {
        read_u64(state, 0)
    }

    pub fn is_idle(state: &State) -> bool {
        read_u64(state, 0) == 0
    }

    pub fn release(state: &State, cost: u64) -> State {
        let mut next = *state;
        write_u64(&mut next, 0, read_u64(state, 0).saturating_sub(cost));
        next
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::STATE_BYTES;

    #[test]
    fn admits_up_to_the_limit_and_releases() {
        let c = Concurrency::new(2).unwrap();
        let mut s = [0; STATE_BYTES];
        for _ in 0..2 {
            match c.decide(&s, 1) {
                Decision::Admit { state, .. } => s = state,
                d => panic!("{d:?}"),
            }
        }
        assert!(matches!(c.decide(&s, 1), Decision::Refuse { .. }));
        s = Concurrency::release(&s, 1);
        assert!(matches!(c.decide(&s, 1), Decision::Admit { .. }));
        s = Concurrency::release(&Concurrency::release(&s, 1), 5);
        assert!(Concurrency::is_idle(&s));
    }
}
