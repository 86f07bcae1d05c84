//! Host-independent rate limiting: algorithms as pure functions over a compare-and-swap store.
//!
//! Nothing here knows about proxy-wasm. The filter adapts Envoy's shared data to [`CasStore`];
//! tests and the quota service use [`MemoryStore`].

pub mod limiter;
pub mod slot;
pub mod store;
pub mod token_bucket;

pub use limiter::{admit, Check, CheckOutcome, Outcome, SlotEvent, Verdict, MAX_CAS_ATTEMPTS};
pub use slot::{SlotId, SlotTable};
pub use store::{CasStore, MemoryStore, StoreError};
pub use token_bucket::{Decision, TokenBucket};
