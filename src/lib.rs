//! tollgate: rate limiting at the proxy, as a proxy-wasm filter.
//!
//! Host-independent (and tested natively): `config`, `key`, `number`, `request`, `request_body`, `headers`, `header_map`,
//! `stats`, `engine` (the per-request decision) and `lifecycle` (every callback's work, from a
//! request's headers to its log, through a `Host` trait). The algorithms live in the
//! `tollgate-core` crate. Wasm only: `abi` (the proxy-wasm imports and exports), `host` (the
//! `Host` trait on the ABI, safe), `callbacks` (the exports, dispatch only) and `probe`.

pub mod config;
pub mod engine;
#[cfg(test)]
mod fuzz;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzz_harness;
pub mod header_map;
pub mod headers;
pub mod key;
pub mod lifecycle;
pub mod network;
pub mod number;
pub mod request;
pub mod request_body;
pub mod stats;
pub mod usage;

#[cfg(target_arch = "wasm32")]
mod abi;
#[cfg(target_arch = "wasm32")]
mod callbacks;
#[cfg(target_arch = "wasm32")]
mod host;
#[cfg(all(target_arch = "wasm32", feature = "probe"))]
mod probe;
