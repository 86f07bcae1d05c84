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

/// A global concurrency rule's holder.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Holder {
    pub rule: String,
    pub instance: String,
}

pub struct Metrics {
    registry: Registry,
    pub calls: Family<Outcome, Counter>,
    pub slot_calls: Family<Outcome, Counter>,
    /// Slots an instance held of a rule's keys, as its last slot call's answers said.
    pub slots_held: Family<Holder, Gauge>,
    pub items: Counter,
    pub granted: Counter,
    pub reserved: Counter,
    pub denials: Counter,
    pub storage_errors: Counter,
    pub latency: Histogram,
    /// The server's connections: open now, and closed to make room for new ones.
    pub server: crate::server::ServerMetrics,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("tollgate_quota");
        let calls = Family::<Outcome, Counter>::default();
        let slot_calls = Family::<Outcome, Counter>::default();
        let slots_held = Family::<Holder, Gauge>::default();
        registry.register("slot_calls", "Slot calls by outcome", slot_calls.clone());
        registry.register(
            "slots_held",
            "Slots of a global concurrency rule an instance holds: the sum over the keys of its \
             last slot call",
            slots_held.clone(),
        );
        let items = Counter::default();
        let granted = Counter::default();
        let reserved = Counter::default();
        let denials = Counter::default();
        let storage_errors = Counter::default();
        let latency = Histogram::new(exponential_buckets(0.0001, 2.0, 16));
        let server = crate::server::ServerMetrics::default();
        registry.register("connections", "Connections open now", server.open.clone());
        registry.register(
            "connections_evicted",
            "Connections not yet proven by a call, closed to make room for a new one",
            server.evicted.clone(),
        );
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
            slot_calls,
            slots_held,
            items,
            granted,
            reserved,
            denials,
            storage_errors,
            latency,
            server,
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
