//! Validation of overload protection: adaptive and success-rate-throttle rules, and the
//! top-level priority classes.

use crate::config::json::{RawAdaptive, RawPriority, RawRule, RawThrottle, Scope, StatusPattern};
use crate::config::model::overload::{
    CpuHeader, Guard, GuardKind, Priorities, PriorityClass, StatusSet, DEFAULT_GUARD_KEYS,
    DEFAULT_LEVEL, MAX_GUARD_KEYS,
};
use crate::config::model::KeyPart;
use crate::config::syntax::is_token;
use crate::config::{err, ConfigError};
use tollgate_core::overload::adaptive::{Adaptive, Cpu, Signal, LEVELS, MILLI, WINDOW_LAYOUT};
use tollgate_core::overload::throttle::{SreThrottle, K_SCALE};
use tollgate_core::SlotTable;
/// A fraction in thousandths, checked to lie in `range` (inclusive).
fn milli(
    value: Option<f64>,
    default: f64,
    path: String,
    range: (f64, f64),
    what: &str,
) -> Result<u64, ConfigError> {
    let v = value.unwrap_or(default);
    if !(v.is_finite() && v >= range.0 && v <= range.1) {
        return Err(err(path, format!("{v} is not {what}")));
    }
    Ok((v * MILLI as f64).round() as u64)
}

impl RawRule {
    /// An adaptive or throttle rule's own settings; the options of limiting rules are refused.
    pub(super) fn guard(&self, path: &str, adaptive: bool) -> Result<Guard, ConfigError> {
        let algorithm = if adaptive { "adaptive" } else { "sre_throttle" };
        let given = [
            ("limit", self.limit.is_some()),
            ("burst", self.burst.is_some()),
            ("delay", self.delay.is_some()),
            ("max_delay", self.max_delay.is_some()),
            ("warmup", self.warmup.is_some()),
            ("cost", self.cost.is_some()),
            ("overrides", !self.overrides.is_empty()),
            ("scope", self.scope != Scope::Local),
            ("worker_batch", self.worker_batch.is_some()),
            ("adaptive", self.adaptive.is_some() && !adaptive),
            ("sre_throttle", self.sre_throttle.is_some() && adaptive),
        ];
        if let Some((field, _)) = given.iter().find(|(_, g)| *g) {
            return Err(err(
                format!("{path}.{field}"),
                format!("does not apply to algorithm \"{algorithm}\""),
            ));
        }
        let max_keys = self.max_keys.map_or(DEFAULT_GUARD_KEYS, |n| n.get());
        if max_keys > MAX_GUARD_KEYS {
            return Err(err(
                format!("{path}.max_keys"),
                format!(
                    "{max_keys} is more than the maximum of {MAX_GUARD_KEYS} for \
                     algorithm \"{algorithm}\""
                ),
            ));
        }
        let (kind, fair_key) = if adaptive {
            let raw = self.adaptive.as_ref();
            let (kind, fair) = adaptive_kind(raw.unwrap_or(&RawAdaptive::default()), path)?;
            (kind, fair)
        } else {
            let raw = self.sre_throttle.as_ref();
            (
                throttle_kind(raw.unwrap_or(&RawThrottle::default()), path)?,
                Vec::new(),
            )
        };
        // The windows' layout is in their name: a module that stores them otherwise starts
        // afresh instead of misreading what an older one left in shared data.
        let fingerprint = tollgate_core::slot::fingerprint(
            format!("{kind:?}/{max_keys}/{WINDOW_LAYOUT}").as_bytes(),
        );
        // Windows are named like slot groups: one "group" of the table per key.
        let table = SlotTable::new(
            format!("tollgate.{}.{fingerprint:016x}.w", self.name.0),
            max_keys.saturating_mul(tollgate_core::slot::WAYS as u32),
        );
        Ok(Guard {
            kind,
            table,
            fair_key,
        })
    }
}

fn adaptive_kind(raw: &RawAdaptive, path: &str) -> Result<(GuardKind, Vec<KeyPart>), ConfigError> {
    let at = format!("{path}.adaptive");
    let buckets = raw.buckets.unwrap_or(10);
    if !(2..=16).contains(&buckets) {
        return Err(err(
            format!("{at}.buckets"),
            format!("{buckets} is not between 2 and 16"),
        ));
    }
    let window_ns = raw.window.map_or(1_000_000_000, |p| p.ns);
    let bucket_ns = window_ns / u64::from(buckets);
    if bucket_ns < 1_000_000 {
        return Err(err(
            format!("{at}.window"),
            "is too short: each bucket must be at least 1ms",
        ));
    }
    let latency_factor = milli(
        raw.latency_factor,
        2.0,
        format!("{at}.latency_factor"),
        (1.001, 1_000.0),
        "a factor above 1",
    )?;
    let (cpu, cpu_header) = match &raw.cpu {
        None => (None, None),
        Some(c) => {
            let cat = format!("{at}.cpu");
            if !is_token(&c.header) {
                return Err(err(
                    format!("{cat}.header"),
                    format!("{:?} is not a header name", c.header),
                ));
            }
            let scale = c.scale.unwrap_or(1.0);
            if !(scale.is_finite() && scale > 0.0) {
                return Err(err(
                    format!("{cat}.scale"),
                    format!("{scale} is not above 0"),
                ));
            }
            let threshold = milli(
                c.threshold,
                0.8,
                format!("{cat}.threshold"),
                (0.001, 100.0),
                "a utilisation above 0",
            )?;
            let decay = milli(
                c.decay,
                0.95,
                format!("{cat}.decay"),
                (0.0, 0.999),
                "a weight from 0 to 0.999",
            )?;
            (
                Some(Cpu { threshold, decay }),
                Some(CpuHeader {
                    name: c.header.to_ascii_lowercase(),
                    scale,
                }),
            )
        }
    };
    let estimator = Adaptive::new(
        buckets as usize,
        bucket_ns,
        raw.cool_down.map_or(1_000_000_000, |p| p.ns),
        raw.min_rt_period.map_or(10_000_000_000, |p| p.ns),
        Signal {
            latency_factor,
            cpu,
        },
    )
    .ok_or_else(|| err(&at, "invalid settings"))?;
    let mut seen = std::collections::HashSet::new();
    for (j, part) in raw.fair_key.iter().enumerate() {
        if !seen.insert(part) {
            return Err(err(format!("{at}.fair_key[{j}]"), "repeated key part"));
        }
    }
    Ok((
        GuardKind::Adaptive {
            estimator,
            cpu: cpu_header,
        },
        raw.fair_key.clone(),
    ))
}

fn throttle_kind(raw: &RawThrottle, path: &str) -> Result<GuardKind, ConfigError> {
    let at = format!("{path}.sre_throttle");
    let k = milli(
        raw.k,
        2.0,
        format!("{at}.k"),
        (1.0, 1_000.0),
        "a multiplier of at least 1",
    )?;
    let window_ns = raw.window.map_or(10_000_000_000, |p| p.ns);
    let throttle =
        SreThrottle::new(k * K_SCALE / MILLI, window_ns).ok_or_else(|| err(&at, "invalid"))?;
    let default = [StatusPattern::Class("5xx".into()), StatusPattern::Code(429)];
    let failures = status_set(raw.failure_statuses.as_deref().unwrap_or(&default));
    Ok(GuardKind::Throttle { throttle, failures })
}

/// The priority classes, and each level's share: given on a class, else 1 for the highest level
/// in use and 0.1 less for each level in use below it (never below 0.5).
pub(super) fn priorities(raw: Vec<RawPriority>) -> Result<Priorities, ConfigError> {
    let mut shares: [Option<u64>; LEVELS] = [None; LEVELS];
    let mut used = [false; LEVELS];
    used[usize::from(DEFAULT_LEVEL)] = true;
    let mut classes = Vec::with_capacity(raw.len());
    for (i, p) in raw.into_iter().enumerate() {
        let at = format!("priorities[{i}]");
        if p.name.is_empty() {
            return Err(err(format!("{at}.name"), "must not be empty"));
        }
        let level = usize::from(p.level);
        if level >= LEVELS {
            return Err(err(
                format!("{at}.level"),
                format!("{} is not a level (0 to {})", p.level, LEVELS - 1),
            ));
        }
        used[level] = true;
        if let Some(s) = p.share {
            let share = milli(
                Some(s),
                1.0,
                format!("{at}.share"),
                (0.001, 1.0),
                "a share above 0 and at most 1",
            )?;
            match shares[level] {
                Some(other) if other != share => {
                    return Err(err(
                        format!("{at}.share"),
                        format!("another class of level {level} gives another share"),
                    ))
                }
                _ => shares[level] = Some(share),
            }
        }
        classes.push(PriorityClass {
            name: p.name,
            matcher: p.matcher.validate(&format!("{at}.match"))?,
            level: p.level,
        });
    }
    let mut result = [MILLI; LEVELS];
    let mut above = 0u64;
    for level in (0..LEVELS).rev() {
        result[level] = shares[level].unwrap_or(MILLI.saturating_sub(100 * above).max(500));
        if used[level] {
            above += 1;
        }
    }
    Ok(Priorities {
        classes,
        shares: result,
    })
}

/// The statuses `patterns` name (codes, and classes such as `"5xx"`).
pub(super) fn status_set(patterns: &[StatusPattern]) -> StatusSet {
    let mut set = StatusSet::EMPTY;
    for p in patterns {
        match p {
            StatusPattern::Code(c) => set.insert(usize::from(*c)),
            StatusPattern::Class(c) => {
                let base = usize::from(c.as_bytes()[0] - b'0') * 100;
                (base..base + 100).for_each(|s| set.insert(s));
            }
        }
    }
    set
}
