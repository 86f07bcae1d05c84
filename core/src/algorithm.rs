//! The algorithms behind one interface: a decision is a pure function of a slot's state bytes, the
//! time and the request's cost, returning the state to write.

use crate::global::allowance::LeaseAllowance;
use crate::global::permits::PermitAllowance;
use crate::local::concurrency::Concurrency;
use crate::local::fixed_window::FixedWindow;
use crate::local::leaky_bucket::LeakyBucket;
use crate::local::sliding_window::SlidingWindow;
use crate::local::token_bucket::TokenBucket;
use crate::local::warm_up::WarmUp;
use crate::state::{read_u128, write_u128, Decision, State};

/// How far a key's state is from fresh ([`Limit::standing`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Standing {
    pub limited: bool,
    pub spent: u64,
    pub retry_after_ns: u64,
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
    /// A global concurrency rule's slots leased from the quota service.
    PermitLease(PermitAllowance),
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
            Self::PermitLease(a) => a.decide(state, now_ns, cost),
        }
    }

    /// True if writing `after` over `before` claims a refill that the writer must send.
    pub fn claims_refill(&self, before: &State, after: &State) -> bool {
        match self {
            Self::Lease(a) => a.claimed(before, after),
            Self::PermitLease(a) => a.claimed(before, after),
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
            Self::PermitLease(_) => PermitAllowance::is_idle(state, now_ns / 1_000_000),
        }
    }

    /// How far a key's state is from fresh, for choosing a slot to evict: the key is being
    /// limited now (a request of cost 1 would be refused), how many requests of cost 1 a reset
    /// would give back, and how long until it could be admitted again.
    pub fn standing(&self, state: &State, now_ns: u64) -> Standing {
        let capacity = match self.decide(&[0; crate::state::STATE_BYTES], now_ns, 1) {
            Decision::Admit { remaining, .. } => remaining.saturating_add(1),
            _ => 0,
        };
        match self.decide(state, now_ns, 1) {
            Decision::Admit { remaining, .. } => Standing {
                limited: false,
                spent: capacity.saturating_sub(remaining.saturating_add(1)),
                retry_after_ns: 0,
            },
            Decision::Refuse { retry_after_ns, .. } => Standing {
                limited: true,
                spent: capacity,
                retry_after_ns,
            },
            // Quota on its way (claimed): evicting the key would lose the call's grant and send its
            // waiting requests back to wait again (a flood of new keys in one group would evict
            // each other's first leases until their requests timed out). Evicted last.
            Decision::Wait { claim: None } => Standing {
                limited: false,
                spent: u64::MAX,
                retry_after_ns: 0,
            },
            // No tokens and no call out, or a failed source: nothing a reset would give back.
            Decision::Wait { .. } | Decision::Fallback { .. } => Standing::default(),
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
            Self::PermitLease(_) => PermitAllowance::release(state, cost),
        }
    }

    /// The state after a request that took `reserved` turned out to cost `actual`: a token
    /// bucket refunds the difference or charges the excess as debt ([`crate::local::settle`]);
    /// other limits take refunds only (an excess cannot be charged to them).
    pub fn settle(&self, state: &State, now_ns: u64, reserved: u64, actual: u64) -> State {
        match self {
            Self::TokenBucket(a) => a.settle_state(state, now_ns, reserved, actual),
            Self::Lease(a) => a.settle(state, now_ns / 1_000_000, reserved, actual),
            _ if actual < reserved => self.refund(state, now_ns, reserved - actual),
            _ => *state,
        }
    }

    /// Tokens `state` owes at `now_ns`: charged by settlements past what it held (token buckets
    /// and leased allowances; 0 for the others).
    pub fn debt(&self, state: &State, now_ns: u64) -> u64 {
        match self {
            Self::TokenBucket(a) => a.debt(state, now_ns),
            Self::Lease(_) => LeaseAllowance::debt(state, now_ns / 1_000_000),
            _ => 0,
        }
    }

    /// The largest cost a request can ever be admitted with, where there is one: a request that
    /// costs more is refused however long it waits. (Leaky buckets take cost 1, a warming bucket
    /// admits any cost once it may admit at all, a leased allowance is bounded by its global rule.)
    pub fn capacity(&self) -> Option<u64> {
        match self {
            Self::TokenBucket(a) => Some(a.burst()),
            Self::FixedWindow(a) => Some(a.limit()),
            Self::SlidingWindow(a) => Some(a.limit()),
            Self::Concurrency(a) => Some(a.limit()),
            Self::PermitLease(a) => Some(a.concurrent),
            Self::WarmUp(_) | Self::LeakyBucket(_) | Self::Lease(_) => None,
        }
    }

    /// True if an admitted request holds its quota until it ends (`Concurrency`, `PermitLease`).
    pub fn is_held(&self) -> bool {
        matches!(self, Self::Concurrency(_) | Self::PermitLease(_))
    }
}
