//! The algorithms behind one interface: a decision is a pure function of a slot's state bytes, the
//! time and the request's cost, returning the state to write.

use crate::allowance::LeaseAllowance;
use crate::concurrency::Concurrency;
use crate::fixed_window::FixedWindow;
use crate::leaky_bucket::LeakyBucket;
use crate::sliding_window::SlidingWindow;
use crate::state::{read_u128, write_u128, Decision, State};
use crate::token_bucket::TokenBucket;
use crate::warm_up::WarmUp;

/// A rule's limit: which algorithm, with its parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Limit {
    TokenBucket(TokenBucket),
    WarmUp(WarmUp),
    FixedWindow(FixedWindow),
    SlidingWindow(SlidingWindow),
    LeakyBucket(LeakyBucket),
    Concurrency(Concurrency),
    /// A global rule's allowance leased from the quota service.
    Lease(LeaseAllowance),
}

impl Limit {
    pub fn decide(&self, state: &State, now_ns: u64, cost: u64) -> Decision {
        match self {
            Self::TokenBucket(a) => a.decide_state(state, now_ns, cost),
            Self::WarmUp(a) => a.decide(state, now_ns, cost),
            Self::FixedWindow(a) => a.decide(state, now_ns, cost),
            Self::SlidingWindow(a) => a.decide(state, now_ns, cost),
            Self::LeakyBucket(a) => a.decide(state, now_ns, cost),
            Self::Concurrency(a) => a.decide(state, cost),
            Self::Lease(a) => a.decide(state, now_ns, cost),
        }
    }

    /// True if writing `after` over `before` claims a refill that the writer must send.
    pub fn claims_refill(&self, before: &State, after: &State) -> bool {
        match self {
            Self::Lease(a) => a.claimed(before, after),
            _ => false,
        }
    }

    /// True if the state is as good as fresh: its slot can go to another key without loss.
    pub fn is_idle(&self, state: &State, now_ns: u64) -> bool {
        match self {
            Self::TokenBucket(a) => a.is_full(read_u128(state, 0), now_ns),
            Self::WarmUp(a) => a.is_idle(state, now_ns),
            Self::FixedWindow(a) => a.is_idle(state, now_ns),
            Self::SlidingWindow(a) => a.is_idle(state, now_ns),
            Self::LeakyBucket(a) => a.is_idle(state, now_ns),
            Self::Concurrency(_) => Concurrency::is_idle(state),
            Self::Lease(_) => LeaseAllowance::is_idle(state, now_ns / 1_000_000),
        }
    }

    /// The state after giving back `cost` taken by an earlier `Allow` (all-or-nothing accounting,
    /// and the end of a request for `Concurrency`).
    pub fn refund(&self, state: &State, now_ns: u64, cost: u64) -> State {
        match self {
            Self::TokenBucket(a) => {
                let mut s = *state;
                write_u128(&mut s, 0, a.refund(read_u128(state, 0), cost));
                s
            }
            Self::WarmUp(a) => a.refund(state, cost),
            Self::FixedWindow(a) => a.refund(state, now_ns, cost),
            Self::SlidingWindow(a) => a.refund(state, now_ns, cost),
            Self::LeakyBucket(a) => a.refund(state, cost),
            Self::Concurrency(_) => Concurrency::release(state, cost),
            Self::Lease(_) => LeaseAllowance::refund(state, cost),
        }
    }

    /// True if an admitted request holds its quota until it ends (`Concurrency`).
    pub fn is_held(&self) -> bool {
        matches!(self, Self::Concurrency(_))
    }
}
