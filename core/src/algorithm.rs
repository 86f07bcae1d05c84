//! The algorithms behind one interface: a decision is a pure function of a slot's state bytes, the
//! time and the request's cost, returning the state to write.

use crate::allowance::LeaseAllowance;
use crate::concurrency::Concurrency;
use crate::fixed_window::FixedWindow;
use crate::leaky_bucket::LeakyBucket;
use crate::sliding_window::SlidingWindow;
use crate::token_bucket::TokenBucket;
use crate::warm_up::WarmUp;

/// Bytes of algorithm state in a slot. All zeros is a fresh key.
pub const STATE_BYTES: usize = 24;

/// One slot's algorithm state.
pub type State = [u8; STATE_BYTES];

/// What an algorithm decided for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Allow {
        state: State,
        /// Requests of cost 1 that would still be admitted right now.
        remaining: u64,
        /// Nanoseconds until the quota is fully back.
        reset_ns: u64,
        /// Nanoseconds to hold the request before passing it on (leaky bucket only).
        delay_ns: u64,
    },
    Deny {
        /// Nanoseconds until this request would be admitted (`u64::MAX`: only by a release).
        retry_after_ns: u64,
        remaining: u64,
        reset_ns: u64,
    },
    /// No decision possible yet: quota is on its way (global rules). With `claim`, write it: this
    /// request asks for the refill.
    Wait { claim: Option<State> },
    /// The source of quota failed (global rules): the rule's failure mode decides.
    Fallback,
}

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

pub(crate) fn read_u64(s: &State, at: usize) -> u64 {
    let mut b = [0; 8];
    b.copy_from_slice(&s[at..at + 8]);
    u64::from_le_bytes(b)
}

pub(crate) fn write_u64(s: &mut State, at: usize, v: u64) {
    s[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

pub(crate) fn read_u128(s: &State, at: usize) -> u128 {
    let mut b = [0; 16];
    b.copy_from_slice(&s[at..at + 16]);
    u128::from_le_bytes(b)
}

pub(crate) fn write_u128(s: &mut State, at: usize, v: u128) {
    s[at..at + 16].copy_from_slice(&v.to_le_bytes());
}

/// `num / den` rounded up, saturated to u64.
pub(crate) fn div_ceil_u64(num: u128, den: u128) -> u64 {
    u64::try_from(num.div_ceil(den.max(1))).unwrap_or(u64::MAX)
}

/// `num / den` rounded down, saturated to u64.
pub(crate) fn div_u64(num: u128, den: u128) -> u64 {
    u64::try_from(num / den.max(1)).unwrap_or(u64::MAX)
}

/// Tests: decide one request and keep the new state if admitted.
#[cfg(test)]
pub(crate) fn apply(limit: Limit, state: &mut State, now_ns: u64, cost: u64) -> bool {
    match limit.decide(state, now_ns, cost) {
        Decision::Allow { state: next, .. } => {
            *state = next;
            true
        }
        _ => false,
    }
}
