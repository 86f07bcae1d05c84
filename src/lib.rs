//! tollgate: rate limiting at the proxy, as a proxy-wasm filter.
//!
//! `config`, `request` and `headers` are host-independent (tested natively); `filter` is the thin
//! proxy-wasm adapter, compiled for Wasm only. The algorithms live in the `tollgate-core` crate.

pub mod config;
pub mod headers;
pub mod request;

#[cfg(target_arch = "wasm32")]
mod filter;
