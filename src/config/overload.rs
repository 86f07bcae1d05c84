//! Overload protection in the configuration: adaptive and success-rate-throttle rules (their JSON
//! shape, model and validation) and the top-level priority classes.

use super::json::{RawMatch, RawRule};
use super::model::{KeyPart, Match};
use super::period::Period;
use super::validate::is_token;
use super::{err, ConfigError};
use serde::de::{self, Deserializer};
use serde::Deserialize;
use tollgate_core::adaptive::{Adaptive, Cpu, Signal, LEVELS, MILLI};
use tollgate_core::throttle::{SreThrottle, K_SCALE};
use tollgate_core::SlotTable;

/// Windows per adaptive or throttle rule when `max_keys` is not given.
pub const DEFAULT_GUARD_KEYS: u32 = 100;
/// Upper bound of `max_keys` for these rules (each key's window is a shared-data value).
pub const MAX_GUARD_KEYS: u32 = 10_000;
/// The level of requests no priority class matches.
pub const DEFAULT_LEVEL: u8 = 1;

/// An overload rule's settings: `"algorithm": "adaptive"` with an optional `"adaptive"` object.
#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
#[cfg_attr(not(target_arch = "wasm32"), schemars(rename = "Adaptive"))]
pub(super) struct RawAdaptive {
    /// The sliding window of completions (default 1s).
    pub window: Option<Period>,
    /// Buckets in the window (default 10, 2 to 16).
    pub buckets: Option<u32>,
    /// How long the signal stays on after a refusal (default 1s).
    pub cool_down: Option<Period>,
    /// How long the least response time is remembered (one to two of these; default 10s).
    pub min_rt_period: Option<Period>,
    /// Overloaded when the window's mean response time exceeds the least one × this (default 2).
    pub latency_factor: Option<f64>,
    /// The upstream's CPU as it reports it in a response header.
    pub cpu: Option<RawCpu>,
    /// Parts of a flow key: flows of one priority level get equal parts of its share.
    #[serde(default)]
    pub fair_key: Vec<KeyPart>,
}

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(not(target_arch = "wasm32"), schemars(rename = "CpuSignal"))]
pub(super) struct RawCpu {
    /// A response header: ORCA's `endpoint-load-metrics` (`TEXT cpu_utilization=0.83`), or any
    /// header holding a number.
    pub header: String,
    /// The number that means 100% (default 1; e.g. 100 for a percentage).
    pub scale: Option<f64>,
    /// Overloaded above this utilisation (default 0.8).
    pub threshold: Option<f64>,
    /// The weight of history in the moving average (default 0.95).
    pub decay: Option<f64>,
}

/// `"algorithm": "sre_throttle"` with an optional `"sre_throttle"` object.
#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
#[cfg_attr(not(target_arch = "wasm32"), schemars(rename = "SreThrottle"))]
pub(super) struct RawThrottle {
    /// Refusals start once fewer than 1/k of the requests are accepted (default 2, at least 1).
    pub k: Option<f64>,
    /// The sliding window the counts cover (default 10s).
    pub window: Option<Period>,
    /// Upstream statuses that are not accepts (default ["5xx", 429]).
    pub failure_statuses: Option<Vec<StatusPattern>>,
}

/// A status (`503`) or a class (`"5xx"`).
#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[cfg_attr(not(target_arch = "wasm32"), schemars(untagged))]
pub(super) enum StatusPattern {
    Code(u16),
    Class(String),
}

impl<'de> Deserialize<'de> for StatusPattern {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = StatusPattern;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an HTTP status (100 to 599) or a class such as \"5xx\"")
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<StatusPattern, E> {
                match u16::try_from(n) {
                    Ok(code) if (100..=599).contains(&code) => Ok(StatusPattern::Code(code)),
                    _ => Err(E::custom(format!("{n} is not an HTTP status (100 to 599)"))),
                }
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<StatusPattern, E> {
                let ok = s.len() == 3
                    && matches!(s.as_bytes()[0], b'1'..=b'5')
                    && s[1..].eq_ignore_ascii_case("xx");
                if ok {
                    Ok(StatusPattern::Class(s.to_ascii_lowercase()))
                } else {
                    Err(E::custom(format!(
                        "{s:?} is not a status class (\"1xx\" to \"5xx\")"
                    )))
                }
            }
        }
        d.deserialize_any(V)
    }
}

/// One top-level priority class: requests it matches get its level.
#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(not(target_arch = "wasm32"), schemars(rename = "PriorityClass"))]
pub(super) struct RawPriority {
    pub name: String,
    /// Conditions that must all hold; none = every request.
    #[serde(rename = "match", default)]
    pub matcher: RawMatch,
    /// 0 (lowest) to 3 (highest); requests no class matches are level 1.
    pub level: u8,
    /// The part of an overload rule's capacity that requests of this level and above may fill
    /// while it refuses (default: 1 for the highest level, 0.1 less per level below it).
    pub share: Option<f64>,
}

/// An overload rule: what it estimates, the windows of its keys, and its flow key.
#[derive(Debug, Clone, PartialEq)]
pub struct Guard {
    pub kind: GuardKind,
    /// Names the windows in shared data: one per key (keys beyond `max_keys` share by hash).
    pub table: SlotTable,
    /// Empty: no fairness between flows.
    pub fair_key: Vec<KeyPart>,
}

impl Guard {
    /// The rule as the configuration would write it.
    pub fn describe(&self) -> String {
        let ms = |ns: u64| super::period::format_duration(ns);
        match &self.kind {
            GuardKind::Adaptive { estimator, cpu } => {
                let signal = estimator.signal();
                let mut text = format!(
                    "adaptive, window {} in {} buckets, latency factor {}, cool-down {}",
                    ms(estimator.window_ns()),
                    estimator.buckets(),
                    signal.latency_factor as f64 / MILLI as f64,
                    ms(estimator.cool_down_ns())
                );
                if let (Some(h), Some(c)) = (cpu, signal.cpu) {
                    text += &format!(
                        ", cpu from {} above {}",
                        h.name,
                        c.threshold as f64 / MILLI as f64
                    );
                }
                if !self.fair_key.is_empty() {
                    text += ", fair per flow";
                }
                text
            }
            GuardKind::Throttle { throttle, .. } => format!(
                "sre_throttle, k {}, window {}",
                throttle.k_milli() as f64 / K_SCALE as f64,
                ms(throttle.period_ns())
            ),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum GuardKind {
    Adaptive {
        estimator: Adaptive,
        cpu: Option<CpuHeader>,
    },
    Throttle {
        throttle: SreThrottle,
        failures: StatusSet,
    },
}

/// Where an upstream reports its CPU.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuHeader {
    /// Lower-case.
    pub name: String,
    /// The reported number that means 100%.
    pub scale: f64,
}

/// A set of HTTP statuses (100 to 599).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatusSet([u64; 10]);

impl StatusSet {
    pub fn contains(&self, status: u32) -> bool {
        let Ok(i) = usize::try_from(status) else {
            return false;
        };
        i < 640 && self.0[i / 64] & (1 << (i % 64)) != 0
    }

    fn insert(&mut self, status: usize) {
        if status < 640 {
            self.0[status / 64] |= 1 << (status % 64);
        }
    }
}

/// The priority classes and each level's share of an overload rule's capacity.
#[derive(Debug, Clone, PartialEq)]
pub struct Priorities {
    pub classes: Vec<PriorityClass>,
    /// Thousandths, by level.
    pub shares: [u64; LEVELS],
}

impl Default for Priorities {
    fn default() -> Self {
        Self {
            classes: Vec::new(),
            shares: [MILLI; LEVELS],
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct PriorityClass {
    pub name: String,
    pub matcher: Match,
    pub level: u8,
}

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
            ("scope", self.scope != super::json::Scope::Local),
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
        let fingerprint =
            tollgate_core::slot::fingerprint(format!("{kind:?}/{max_keys}").as_bytes());
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
    let mut failures = StatusSet([0; 10]);
    let default = [StatusPattern::Class("5xx".into()), StatusPattern::Code(429)];
    for p in raw.failure_statuses.as_deref().unwrap_or(&default) {
        match p {
            StatusPattern::Code(c) => failures.insert(usize::from(*c)),
            StatusPattern::Class(c) => {
                let base = usize::from(c.as_bytes()[0] - b'0') * 100;
                (base..base + 100).for_each(|s| failures.insert(s));
            }
        }
    }
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
