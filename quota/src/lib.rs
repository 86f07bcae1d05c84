//! tollgate-quota: the quota service that leases global limits to proxies in batches.
//!
//! `store` keeps the global buckets (in memory, or in Redis for several replicas), `service` is the
//! HTTP API, `server` serves it within limits, `metrics` its Prometheus counters, `credentials` who may call it as which proxy, `busiest` the keys that ask most of each limit, `calendar` the periods calendar quotas are served in, `admin` the operators' API, `rls` and `rlqs` Envoy's rate limit service and rate limit quota service over the same buckets and `grpc` their server, `fuzz_harness` what its fuzz targets run.

pub mod admin;
pub mod busiest;
pub mod calendar;
pub mod credentials;
pub mod fuzz_harness;
pub mod grpc;
pub mod metrics;
pub mod rlqs;
pub mod rls;
pub mod server;
pub mod service;
pub mod store;
