//! A configuration's stats at the host: defined once, counted per worker, handed over on the tick
//! (gauges as process-wide totals in shared data).

use super::{Kind, Metric, Plugin};
use crate::lifecycle::host::{Host, MetricKind};
use crate::stats::{ProcessStat, RuleStat, Stat};
use log::warn;
use tollgate_core::CasStore;

impl<H: Host> Plugin<H> {
    pub fn add(&self, stat: ProcessStat, n: i64) {
        self.engine.borrow_mut().stats_mut().add_process(stat, n);
    }

    /// Hand the worker's stat changes to the host.
    pub fn flush_stats(&self) {
        for (gauge, change) in self.queues.borrow_mut().gauge_changes() {
            self.add(gauge, change);
        }
        let mut changes: smallvec::SmallVec<[(Stat, i64); 16]> = smallvec::SmallVec::new();
        self.engine
            .borrow_mut()
            .stats_mut()
            .drain(|stat, delta| changes.push((stat, delta)));
        for (stat, delta) in changes {
            let metric = match stat {
                Stat::Rule(rule, s) => self.rule_metrics.get(rule).and_then(|m| m.get(s as usize)),
                Stat::Process(s) => self.process_metrics.get(s as usize),
            };
            let Some(Some(metric)) = metric else {
                continue;
            };
            // A failed update only loses a count; nothing to do about it here.
            let absolute = matches!(stat, Stat::Rule(_, s) if s.is_absolute());
            let _ = match &metric.total_key {
                None if absolute => self
                    .host
                    .record_metric(metric.id, u64::try_from(delta).unwrap_or(0)),
                None => self.host.increment_metric(metric.id, delta),
                Some(key) => match add_to_total(&self.host, key, delta) {
                    Some(total) => self.host.record_metric(metric.id, total),
                    None => Ok(()),
                },
            };
        }
    }
}

/// The stats an overload rule has.
pub(super) fn rule_has(guard: &crate::config::Guard, stat: RuleStat) -> bool {
    let adaptive = matches!(guard.kind, crate::config::GuardKind::Adaptive { .. });
    match stat {
        RuleStat::Allowed
        | RuleStat::Limited
        | RuleStat::DryRunLimited
        | RuleStat::StoreErrors
        | RuleStat::Contended => true,
        RuleStat::InFlight | RuleStat::Estimate | RuleStat::Signal => adaptive,
        s => s.is_overload(),
    }
}

/// Define a stat at the host; gauges get their process-wide total in shared data.
pub(super) fn define<H: Host>(host: &H, name: &str, kind: Kind) -> Option<Metric> {
    let host_kind = if kind == Kind::Counter {
        MetricKind::Counter
    } else {
        MetricKind::Gauge
    };
    let id = host
        .define_metric(host_kind, name)
        .map_err(|s| warn!("cannot define metric {name}: {s}"))
        .ok()?;
    let total_key = (kind == Kind::Gauge).then(|| {
        let key = format!("tollgate.gauge.{name}");
        if let Ok(None) = host.read(&key) {
            // Created before any request changes it: a lost race between workers loses nothing.
            let _ = host.write(&key, &0i64.to_le_bytes(), 0);
        }
        key
    });
    Some(Metric { id, total_key })
}

/// Add `delta` to a process-wide total in shared data; the new total (never below 0).
pub(super) fn add_to_total<S: CasStore>(store: &S, key: &str, delta: i64) -> Option<u64> {
    let attempts = tollgate_core::limiter::MAX_CAS_ATTEMPTS;
    // The total's key is made at load: without it there is nothing to add to.
    let added = tollgate_core::store::update(store, key, attempts, |bytes| {
        let Some(bytes) = bytes else {
            return (None, None);
        };
        let current = bytes
            .get(..8)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .map_or(0, i64::from_le_bytes);
        let next = current.saturating_add(delta);
        (Some(next.to_le_bytes()), Some(next))
    });
    added.ok().flatten().map(|n| u64::try_from(n).unwrap_or(0))
}
