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

/// An RLS descriptor's answer: its domain (`_unknown` for one not configured), its limit's place
/// in the configuration (with the value for a `detailed_metric` limit; empty for none) and
/// `ok`, `over_limit`, `shadow_over_limit`, `unlimited` or `no_limit`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RlsDescriptor {
    pub domain: String,
    pub descriptor: String,
    pub code: &'static str,
}

/// Most `rls_descriptors` series: `detailed_metric` labels come from callers; past this, a new
/// one counts under the descriptor `_other`.
pub const MAX_RLS_SERIES: usize = 1_024;

/// Most `slots_held` series: their labels come from callers, so a caller must not be able to grow
/// `/metrics` (and the service's memory) without bound.
pub const MAX_HELD_SERIES: usize = 1_024;

pub struct Metrics {
    registry: Registry,
    /// The `slots_held` series made so far (at most [`MAX_HELD_SERIES`]).
    held_series: std::sync::Mutex<std::collections::HashSet<Holder>>,
    pub calls: Family<Outcome, Counter>,
    /// RLS calls (`ShouldRateLimit`) by outcome, and their descriptors by answer.
    pub rls_calls: Family<Outcome, Counter>,
    /// RLQS streams opened (by outcome) and the assignments they were sent (by kind).
    pub rlqs_streams: Family<Outcome, Counter>,
    pub rlqs_assignments: Family<Outcome, Counter>,
    /// RLQS usage report messages received.
    pub rlqs_reports: Counter,
    rls_descriptors: Family<RlsDescriptor, Counter>,
    rls_series: std::sync::Mutex<std::collections::HashSet<RlsDescriptor>>,
    pub slot_calls: Family<Outcome, Counter>,
    /// Slots an instance held of a rule's keys, as its last slot call's answers said.
    pub slots_held: Family<Holder, Gauge>,
    pub items: Counter,
    pub granted: Counter,
    pub given_back: Counter,
    /// Tokens proxies' settlements charged beyond their grants (debts), and tokens taken back
    /// from what proxies held while a bucket was in debt.
    pub owed: Counter,
    pub revoked: Counter,
    pub reserved: Counter,
    pub denials: Counter,
    /// Items refused alone (a bad item, a new key of a full store), lease and slot calls alike.
    pub items_refused: Counter,
    pub storage_errors: Counter,
    pub latency: Histogram,
    /// The server's connections: open now, and closed to make room for new ones.
    pub server: crate::server::ServerMetrics,
    /// The busiest keys of each limit lately (the admin API's, not on `/metrics`).
    pub busiest: crate::busiest::Busiest,
}

impl Metrics {
    /// Set what `holder` holds, unless that would make a series past [`MAX_HELD_SERIES`]
    /// (then it is not shown; the call is served alike).
    /// Count an RLS descriptor's answer; a series past [`MAX_RLS_SERIES`] counts as `_other`.
    pub fn count_rls(&self, mut label: RlsDescriptor) {
        if let Ok(mut series) = self.rls_series.lock() {
            if !series.contains(&label) {
                if series.len() >= MAX_RLS_SERIES {
                    label.descriptor = "_other".into();
                } else {
                    series.insert(label.clone());
                }
            }
        }
        self.rls_descriptors.get_or_create(&label).inc();
    }

    pub fn set_held(&self, holder: Holder, n: i64) {
        let Ok(mut series) = self.held_series.lock() else {
            return;
        };
        if !series.contains(&holder) {
            if series.len() >= MAX_HELD_SERIES {
                return;
            }
            series.insert(holder.clone());
        }
        self.slots_held.get_or_create(&holder).set(n);
    }
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
        let given_back = Counter::default();
        let owed = Counter::default();
        let revoked = Counter::default();
        let reserved = Counter::default();
        let denials = Counter::default();
        let items_refused = Counter::default();
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
        let rls_calls = Family::<Outcome, Counter>::default();
        let rlqs_streams = Family::<Outcome, Counter>::default();
        let rlqs_assignments = Family::<Outcome, Counter>::default();
        let rlqs_reports = Counter::default();
        registry.register(
            "rlqs_reports",
            "RLQS usage report messages received",
            rlqs_reports.clone(),
        );
        registry.register(
            "rlqs_streams",
            "RLQS streams (envoy.service.rate_limit_quota.v3 StreamRateLimitQuotas) opened, by outcome",
            rlqs_streams.clone(),
        );
        registry.register(
            "rlqs_assignments",
            "RLQS bucket assignments of leased buckets sent, by kind (token_bucket, deny_all), and bucket ids \
             left unanswered as they are not UTF-8 (unanswered_not_utf8)",
            rlqs_assignments.clone(),
        );
        let rls_descriptors = Family::<RlsDescriptor, Counter>::default();
        registry.register(
            "rls_calls",
            "RLS calls (envoy.service.ratelimit.v3 ShouldRateLimit) by outcome",
            rls_calls.clone(),
        );
        registry.register(
            "rls_descriptors",
            "RLS descriptors answered, by domain, descriptor and code",
            rls_descriptors.clone(),
        );
        registry.register("lease_items", "Items in lease calls served", items.clone());
        registry.register("tokens_granted", "Tokens granted", granted.clone());
        registry.register(
            "tokens_given_back",
            "Tokens proxies gave back unspent that went back into buckets (at most what each had out)",
            given_back.clone(),
        );
        registry.register(
            "tokens_owed",
            "Tokens proxies' settlements charged beyond what they were granted: charged to the \
             buckets, below zero if need be (debts)",
            owed.clone(),
        );
        registry.register(
            "tokens_revoked",
            "Tokens taken back from what proxies held unspent while their bucket was in debt",
            revoked.clone(),
        );
        registry.register(
            "tokens_reserved",
            "Refill reserved by rate leases, in tokens (rate × lease TTL; a renewal ends the \
             previous reservation early, so more than rate leases can admit)",
            reserved.clone(),
        );
        registry.register("denials", "Items granted nothing", denials.clone());
        registry.register(
            "items_refused",
            "Items refused alone (a bad item, a new key of a full store); their call counts as ok",
            items_refused.clone(),
        );
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
            held_series: Default::default(),
            calls,
            rls_calls,
            rlqs_streams,
            rlqs_assignments,
            rlqs_reports,
            rls_descriptors,
            rls_series: Default::default(),
            slot_calls,
            slots_held,
            items,
            granted,
            given_back,
            owed,
            revoked,
            reserved,
            denials,
            items_refused,
            storage_errors,
            latency,
            server,
            busiest: Default::default(),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn callers_cannot_grow_the_held_series_without_bound() {
        let m = Metrics::default();
        for i in 0..5_000 {
            let holder = Holder {
                rule: format!("r{i}"),
                instance: format!("proxy-{i}"),
            };
            m.set_held(holder, 1);
        }
        let text = m.render();
        let series = text
            .lines()
            .filter(|l| l.starts_with("tollgate_quota_slots_held{"))
            .count();
        assert_eq!(series, MAX_HELD_SERIES);
        // A known series is still updated.
        m.set_held(
            Holder {
                rule: "r0".into(),
                instance: "proxy-0".into(),
            },
            7,
        );
        assert!(m
            .render()
            .contains(r#"tollgate_quota_slots_held{rule="r0",instance="proxy-0"} 7"#));
    }
}
