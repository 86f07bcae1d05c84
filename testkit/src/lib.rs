//! The test kit every suite uses (Envoy's, nginx's, the quota service's): built artifacts, child
//! processes that die with the test, free ports, the quota service, Redis (single, Sentinel,
//! Cluster) and the testbed, an HTTP client, hostile requests, and [`eventually`].

// Test code: a helper that fails fails its test, with the reason.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod hostile;
mod http;
mod paths;
mod process;
mod quota;
mod redis;
mod testbed;

pub use hostile::*;
pub use http::*;
pub use paths::*;
pub use process::*;
pub use quota::*;
pub use redis::*;
pub use testbed::*;
