//! Integration tests: the built `.wasm` in a real Envoy (`--concurrency 2`), real HTTP.
//! Run through `make test`, which builds the module and installs the pinned Envoy first.

// Test code: a failed expectation is meant to panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub(crate) mod harness;

mod algorithms;
mod answers;
mod bandwidth;
mod calendar;
mod cluster;
mod concurrency;
mod config;
mod examples;
mod fleet;
mod global;
mod global_concurrency;
mod headers;
mod hostile;
mod hot_path;
mod limits;
mod matching;
mod module;
pub(crate) mod monitoring;
mod native_module;
mod operations;
mod overload;
mod plugins;
mod quick_starts;
mod rlqs;
pub(crate) mod rls;
pub(crate) mod settle;
mod state;
