//! Host-independent rate limiting: algorithms as pure functions over a compare-and-swap store.
//!
//! Nothing here knows about proxy-wasm. The filter adapts Envoy's shared data to [`CasStore`]
//! (the Envoy dynamic module keeps its state in an [`AtomicStore`]); tests and the quota service
//! use [`MemoryStore`].

pub mod algorithm;
#[cfg(feature = "arbitrary-json")]
pub mod arbitrary_json;
#[cfg(feature = "atomic-store")]
pub mod atomic_store;
pub mod bearer;
pub mod calendar;
pub mod global;
pub mod key_name;
pub mod limiter;
pub mod local;
pub mod overload;
pub mod slot;
pub mod stash;
pub mod state;
pub mod store;

pub use algorithm::{Limit, Standing};
#[cfg(feature = "atomic-store")]
pub use atomic_store::AtomicStore;
pub use global::allowance::{Ask, Grant, LeaseAllowance};
pub use global::permits::PermitAllowance;
pub use limiter::{
    admit, pace, release, return_stash, settle, Check, CheckOutcome, CheckOutcomes, Hold, Outcome,
    Settled, SlotEvent, Verdict,
};
pub use local::concurrency::Concurrency;
pub use local::fixed_window::FixedWindow;
pub use local::leaky_bucket::LeakyBucket;
pub use local::sliding_window::SlidingWindow;
pub use local::token_bucket::TokenBucket;
pub use local::warm_up::WarmUp;
pub use slot::{SlotId, SlotTable};
pub use stash::{Leftover, Lookup, StashTable};
pub use state::{Decision, State};
pub use store::{CasStore, MemoryStore, StoreError};
