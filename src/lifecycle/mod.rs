//! Requests' lifecycles, host-independent: the contexts a host enters, each request from its headers
//! to its log (decide, hold, wait, call, resume, release), the tick and the lease calls — all
//! through the [`Host`] trait, so native tests run it on a mock host.

mod calls;
mod contexts;
mod holdings;
mod host;
mod plugin;
mod queues;
mod quota_call;
mod respond;
mod root;
mod status;
mod stream;
#[cfg(test)]
mod tests;

pub use contexts::Contexts;

pub use host::{Action, Host, HostRequest, MetricKind, Status};
