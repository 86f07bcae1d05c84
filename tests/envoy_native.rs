//! The Envoy integration tests of tests/envoy/, compiled again as a binary that runs them against
//! the Envoy dynamic module (`testkit::build` knows it by its name).

#[path = "envoy/main.rs"]
mod suite;

// The suite's modules name each other from the crate's root.
use suite::{harness, monitoring, rls, settle};
