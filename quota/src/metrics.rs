//! The service's Prometheus metrics (`/metrics`).

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Outcome {
    /// ok, unauthorized, bad_request, storage_error
    pub outcome: &'static str,
}

pub struct Metrics {
    registry: Registry,
    pub calls: Family<Outcome, Counter>,
    pub items: Counter,
    pub granted: Counter,
    pub reserved: Counter,
    pub denials: Counter,
    pub storage_errors: Counter,
    pub latency: Histogram,
    pub connections: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("tollgate_quota");
        let calls = Family::<Outcome, Counter>::default();
        let items = Counter::default();
        let granted = Counter::default();
        let reserved = Counter::default();
        let denials = Counter::default();
        let storage_errors = Counter::default();
        let latency = Histogram::new(exponential_buckets(0.0001, 2.0, 16));
        let connections = Gauge::default();
        registry.register("connections", "Connections open now", connections.clone());
        registry.register("lease_calls", "Lease calls by outcome", calls.clone());
        registry.register("lease_items", "Items in lease calls served", items.clone());
        registry.register("tokens_granted", "Tokens granted", granted.clone());
        registry.register(
            "tokens_reserved",
            "Refill reserved by rate leases, in tokens (rate × lease TTL; a renewal ends the \
             previous reservation early, so more than rate leases can admit)",
            reserved.clone(),
        );
        registry.register("denials", "Items granted nothing", denials.clone());
        registry.register(
            "storage_errors",
            "Lease calls the storage failed",
            storage_errors.clone(),
        );
        registry.register(
            "lease_duration_seconds",
            "Time to serve a lease call",
            latency.clone(),
        );
        Self {
            registry,
            calls,
            items,
            granted,
            reserved,
            denials,
            storage_errors,
            latency,
            connections,
        }
    }
}

impl Metrics {
    pub fn render(&self) -> String {
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}
