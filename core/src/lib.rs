//! Host-independent rate limiting: algorithms as pure functions over a compare-and-swap store.
//!
//! Nothing here knows about proxy-wasm. The filter adapts Envoy's shared data to [`CasStore`];
//! tests and the quota service use [`MemoryStore`].

pub mod adaptive;
pub mod algorithm;
pub mod allowance;
#[cfg(feature = "arbitrary-json")]
pub mod arbitrary_json;
pub mod concurrency;
pub mod fair_share;
pub mod fixed_window;
pub mod leaky_bucket;
pub mod lease;
pub mod limiter;
pub mod permits;
pub mod settle;
pub mod sliding_window;
pub mod slot;
pub mod stash;
pub mod state;
pub mod store;
pub mod throttle;
pub mod token_bucket;
pub mod warm_up;

pub use algorithm::{Limit, Standing};
pub use allowance::{Ask, Grant, LeaseAllowance};
pub use concurrency::Concurrency;
pub use fixed_window::FixedWindow;
pub use leaky_bucket::LeakyBucket;
pub use limiter::{
    admit, release, return_stash, Check, CheckOutcome, CheckOutcomes, Hold, Outcome, SlotEvent,
    Verdict,
};
pub use permits::PermitAllowance;
pub use sliding_window::SlidingWindow;
pub use slot::{SlotId, SlotTable};
pub use stash::{Leftover, Lookup, StashTable};
pub use state::{Decision, State};
pub use store::{CasStore, MemoryStore, StoreError};
pub use token_bucket::TokenBucket;
pub use warm_up::WarmUp;
