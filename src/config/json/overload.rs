//! The JSON shape of overload rules and priority classes.

use super::super::period::Period;
use super::super::syntax::KeyPart;
use super::RawMatch;
use serde::de::{self, Deserializer};
use serde::Deserialize;

/// An overload rule's settings: `"algorithm": "adaptive"` with an optional `"adaptive"` object.
#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
#[cfg_attr(not(target_arch = "wasm32"), schemars(rename = "Adaptive"))]
pub(in crate::config) struct RawAdaptive {
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
pub(in crate::config) struct RawCpu {
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
pub(in crate::config) struct RawThrottle {
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
pub(in crate::config) enum StatusPattern {
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
pub(in crate::config) struct RawPriority {
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
