//! The quota service's lease API (`POST /v1/lease`), shared by the filter and the service
//! (`api`), and the global bucket step both of the service's stores implement (`bucket`).
//!
//! See `docs/quota-api.md`.

mod api;
mod bucket;
#[cfg(test)]
mod tests;

pub use api::*;
pub use bucket::*;
