//! What `tollgate check` (and the log, when a configuration loads) says of a configuration: a
//! summary of its rules, and warnings.

use super::{overload, Config, Cost, Pace, PaceBody, RuleKind, SettleFrom};
use crate::config::period::format_duration;
use tollgate_core::Limit;

impl Config {
    /// What the configuration asks for that cannot take effect, or weakens what it sets up: one
    /// line each, logged when it loads and printed by `tollgate check`.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self
            .quota_service
            .as_ref()
            .is_some_and(|q| q.key_secret.is_none())
        {
            out.push(
                "quota_service.key_secret is not set, nor a token: the key hashes sent to the \
                 quota service are the same in every deployment (set one secret on all proxies)"
                    .to_owned(),
            );
        }
        for (i, rule) in self.rules.iter().enumerate() {
            let cpu = rule.guard().and_then(|g| match &g.kind {
                overload::GuardKind::Adaptive { estimator, .. } => estimator.signal().cpu,
                _ => None,
            });
            if let Some(cpu) =
                cpu.filter(|c| c.threshold >= tollgate_core::overload::adaptive::MILLI)
            {
                out.push(format!(
                    "rules[{i}].adaptive.cpu.threshold is {}: the CPU signal comes on only if \
                     the upstream reports more than that (utilisation is at most 1 in ORCA's \
                     reports)",
                    cpu.threshold as f64 / 1_000.0
                ));
            }
        }
        for (i, rule) in self.rules.iter().enumerate() {
            if let Cost::Body { default, max, .. } = rule.cost {
                if default < max {
                    out.push(format!(
                        "rules[{i}].cost.default is {default}, less than its max {max}: a JSON \
                         body without the named fields reserves {default}, though the upstream may \
                         give it its own default (often the model's most); give every field the \
                         API reads a maximum from, or leave default at max"
                    ));
                }
            }
        }
        for (i, rule) in self.rules.iter().enumerate() {
            // With plans from the request, the largest plan's bucket.
            let capacity = rule.quota().and_then(|q| {
                let most = rule.limit_from.as_ref().map(|f| f.max);
                q.limit_for(most).capacity()
            });
            if let (Some(_), Cost::Header { .. } | Cost::Body { .. }, Some(c)) =
                (&rule.settle, &rule.cost, capacity)
            {
                let max = rule.cost.most();
                if max > c {
                    out.push(format!(
                        "rules[{i}].cost.max is {max}, more than the bucket holds ({c}): a \
                         reservation above {c} is refused outright, whatever the response would \
                         have cost"
                    ));
                }
            }
        }
        if !self.priorities.classes.is_empty() && !self.rules.iter().any(|r| r.guard().is_some()) {
            out.push(
                "priorities are set but no rule is an overload rule (\"adaptive\" or \
                 \"sre_throttle\"): they have no effect"
                    .to_owned(),
            );
        }
        out
    }

    /// One line for the log: every rule and its limit.
    pub fn summary(&self) -> String {
        let rules: Vec<String> = self
            .rules
            .iter()
            .map(|r| {
                let quota = match &r.kind {
                    RuleKind::Local(q) | RuleKind::Bytes(q, _) | RuleKind::Global(q, _) => q,
                    RuleKind::Overload(g) => {
                        return format!(
                            "{} ({}, {} keys{})",
                            r.name,
                            g.describe(),
                            g.table.groups(),
                            if r.dry_run { ", dry run" } else { "" }
                        )
                    }
                };
                let settles = match r.settle.as_ref().map(|s| &s.from) {
                    None => "",
                    Some(SettleFrom::Statuses(_)) => ", settles by status",
                    Some(SettleFrom::Header(_)) => ", settles from a response header",
                    Some(SettleFrom::BodyBytes) => ", settles by body bytes",
                    Some(SettleFrom::Usage(_)) => ", settles by reported usage",
                    Some(SettleFrom::BodyField(_)) => ", settles from a response body field",
                };
                let plans = if r.limit_from.is_some() {
                    ", limits from the request"
                } else {
                    ""
                };
                let body = if r.reads_request_body() {
                    ", reads the request body"
                } else {
                    ""
                };
                format!(
                    "{} ({}, {} slots{}{settles}{plans}{body}{})",
                    r.name,
                    match (r.global(), &quota.limit) {
                        (Some(g), Limit::Lease(l)) => match &g.calendar {
                            Some(c) => format!(
                                "global calendar quota {} per {} ({}), leases of {}",
                                g.requests,
                                c.unit.as_str(),
                                c.time_zone,
                                l.lease_size
                            ),
                            None => format!(
                                "global token_bucket {} per {}, burst {}, leases of {}",
                                g.requests,
                                format_duration(g.per_ms * 1_000_000),
                                g.burst,
                                l.lease_size
                            ),
                        },
                        (None, Limit::TokenBucket(tb)) => match r.pace() {
                            Some(p) => p.describe(tb),
                            None => describe(&quota.limit),
                        },
                        _ => describe(&quota.limit),
                    },
                    quota.table.capacity(),
                    match r.overrides.len() {
                        0 => String::new(),
                        n => format!(", {n} override(s)"),
                    },
                    if r.dry_run { ", dry run" } else { "" }
                )
            })
            .collect();
        format!("{} rule(s): {}", rules.len(), rules.join("; "))
    }
}

impl Pace {
    /// For the log: "paces response bodies: N bytes per 1s, burst B".
    fn describe(&self, bucket: &tollgate_core::TokenBucket) -> String {
        let body = match self.body {
            PaceBody::Response => "response",
            PaceBody::Request => "request",
        };
        let after = match self.after {
            0 => String::new(),
            n => format!(", after {n} bytes"),
        };
        format!(
            "paces {body} bodies: {} bytes per {}, burst {}{after}",
            bucket.requests(),
            format_duration(bucket.period_ns()),
            bucket.burst()
        )
    }
}

/// A limit as the configuration would write it.
pub fn describe(limit: &Limit) -> String {
    match limit {
        Limit::TokenBucket(a) => format!(
            "token_bucket {} per {}, burst {}",
            a.requests(),
            format_duration(a.period_ns()),
            a.burst()
        ),
        Limit::WarmUp(a) => format!(
            "token_bucket {} per {}, warmup {}",
            a.requests(),
            format_duration(a.period_ns()),
            format_duration(a.warmup_ns())
        ),
        Limit::FixedWindow(a) => format!(
            "fixed_window {} per {}",
            a.limit(),
            format_duration(a.period_ns())
        ),
        Limit::SlidingWindow(a) => format!(
            "sliding_window {} per {}",
            a.limit(),
            format_duration(a.period_ns())
        ),
        Limit::LeakyBucket(a) => format!(
            "leaky_bucket {} per {}, burst {}, delay {}, max_delay {}",
            a.requests(),
            format_duration(a.period_ns()),
            a.burst(),
            if a.delay() == u64::MAX {
                "nodelay".to_string()
            } else {
                a.delay().to_string()
            },
            format_duration(a.max_delay_ns())
        ),
        Limit::Concurrency(a) => format!("concurrency {} in flight", a.limit()),
        Limit::Lease(a) => format!("global, leases of {}", a.lease_size),
        Limit::PermitLease(a) => format!("global concurrency {} in flight", a.concurrent),
    }
}
