//! tollgate as an Envoy dynamic module (`libtollgate.so`, filter `tollgate`): the filter crate's
//! engine, configuration and lifecycle, behind Envoy's C ABI instead of proxy-wasm's.
//!
//! `abi` (the callbacks it calls, the types), `hooks` (the functions Envoy calls: dispatch and
//! the panic guard only), `host` (the lifecycle's `Host` on the ABI, per worker), `links` (the paused streams the tick reaches), `worker` (each
//! worker's contexts behind a lock of its own), `filters` (a configuration made in every worker,
//! ticked and retired), `config` (one configuration at Envoy), `metronome` (the tick's thread),
//! `metrics` (stats at Envoy) and `log`. `abi::fake` is Envoy's side in Rust, for the tests and the
//! fuzz harness (`fuzz_harness`, feature `fake-envoy`). State shared by the workers is core's `AtomicStore`,
//! in the process's own memory.

mod abi;
mod config;
mod filters;
#[cfg(any(test, feature = "fake-envoy"))]
pub mod fuzz_harness;
mod hooks;
mod host;
mod links;
mod log;
mod metrics;
mod metronome;
#[cfg(feature = "probe")]
mod probe;
#[cfg(test)]
mod tests;
mod worker;
