//! tollgate: rate limiting at the proxy, as a proxy-wasm filter.
//!
//! Host-independent (and tested natively): `config`, `key`, `request`, `headers`, `header_map`,
//! `stats`, `queues` and `engine`, the per-request decision. The algorithms live in the
//! `tollgate-core` crate. Wasm only: `abi` (the proxy-wasm imports and exports), `host` (every
//! host call, safe), `plugin` (one configuration's state), `callbacks`, `quota_client`,
//! `respond` and `probe`.

pub mod config;
pub mod engine;
#[cfg(test)]
mod fuzz;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzz_harness;
pub mod header_map;
pub mod headers;
pub mod key;
pub mod network;
pub mod queues;
pub mod request;
pub mod stats;

#[cfg(target_arch = "wasm32")]
mod abi;
#[cfg(target_arch = "wasm32")]
mod callbacks;
#[cfg(target_arch = "wasm32")]
mod host;
#[cfg(target_arch = "wasm32")]
mod plugin;
#[cfg(all(target_arch = "wasm32", feature = "probe"))]
mod probe;
#[cfg(target_arch = "wasm32")]
mod quota_client;
#[cfg(target_arch = "wasm32")]
mod respond;
