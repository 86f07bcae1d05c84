//! The JSON shape of costs: from the request, settled after the response, and limits from the
//! request.

use super::StatusPattern;
use serde::de::{self, Deserializer};
use serde::Deserialize;
use std::num::NonZeroU64;

/// Where a key's own `limit.requests` comes from: a request header or request metadata (Envoy)
/// that a filter before tollgate set, a whole number kept within 1 – `max`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[cfg_attr(not(target_arch = "wasm32"), schemars(rename = "LimitFrom"))]
pub(in crate::config) struct RawLimitFrom {
    /// A request header's whole number.
    pub header: Option<String>,
    /// A value of the request's metadata, `NAMESPACE/FIELD[/FIELD…]` (Envoy).
    pub metadata: Option<String>,
    /// The most a key may be given.
    pub max: u64,
}

/// Where a response's cost comes from: exactly one of `statuses`, `header`, `body_bytes`,
/// `usage`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[cfg_attr(not(target_arch = "wasm32"), schemars(rename = "Settle"))]
pub(in crate::config) struct RawSettle {
    /// The request costs its reservation if the response status is one of these (`401`,
    /// `"4xx"`), else nothing: "5 failed logins per 15 minutes".
    pub statuses: Option<Vec<StatusPattern>>,
    /// A response header holding the cost as a whole number (`x-usage-tokens`).
    pub header: Option<String>,
    /// The response body's bytes.
    #[serde(default)]
    pub body_bytes: bool,
    /// The token usage an LLM API reports in its JSON body or its event stream (OpenAI,
    /// Anthropic, Gemini): `"total"`, `"input"`, `"output"`, or `{"input": W, "output": W}`.
    pub usage: Option<RawUsage>,
    /// A whole number at this path (`FIELD[.FIELD…]`) of the JSON response body, or of the last
    /// event of a stream that has it.
    pub body_field: Option<String>,
    /// The most body bytes kept to read a JSON body's usage, or one event of a stream
    /// (default 1 MiB).
    pub max_body_bytes: Option<u64>,
}

/// Which usage counts.
// Parsed by hand: serde's untagged enums cost the module tens of kilobytes and say less.
#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[cfg_attr(not(target_arch = "wasm32"), schemars(untagged, rename = "Usage"))]
pub(in crate::config) enum RawUsage {
    Count(UsageCount),
    Weighted(RawWeights),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[cfg_attr(not(target_arch = "wasm32"), schemars(rename = "UsageWeights"))]
pub(in crate::config) struct RawWeights {
    pub input: f64,
    pub output: f64,
}

impl<'de> Deserialize<'de> for RawUsage {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> de::Visitor<'de> for V {
            type Value = RawUsage;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("\"total\", \"input\", \"output\" or {\"input\": W, \"output\": W}")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<RawUsage, E> {
                UsageCount::deserialize(de::value::StrDeserializer::new(s)).map(RawUsage::Count)
            }
            fn visit_map<M: de::MapAccess<'de>>(self, map: M) -> Result<RawUsage, M::Error> {
                RawWeights::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(RawUsage::Weighted)
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
pub enum UsageCount {
    Total,
    Input,
    Output,
}

/// Tokens a request takes: a whole number, from a request header, or from fields of its JSON
/// body.
// Parsed by hand so that an error names the subfield that is wrong (serde's untagged enums only
// say that nothing matched).
#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[cfg_attr(not(target_arch = "wasm32"), schemars(untagged, rename = "Cost"))]
pub(in crate::config) enum RawCost {
    Fixed(u64),
    From(RawCostFrom),
}

impl<'de> Deserialize<'de> for RawCost {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct CostVisitor;
        impl<'de> de::Visitor<'de> for CostVisitor {
            type Value = RawCost;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(
                    "a whole number of tokens, {\"header\": NAME, \"max\": N} or {\"body\": \
                     [FIELD, …], \"max\": N} (optional \"default\", \"min\")",
                )
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<RawCost, E> {
                Ok(RawCost::Fixed(n))
            }
            fn visit_map<M: de::MapAccess<'de>>(self, map: M) -> Result<RawCost, M::Error> {
                RawCostFrom::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(RawCost::From)
            }
        }
        d.deserialize_any(CostVisitor)
    }
}

/// A cost read from the request: one of `header` or `body`.
#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(not(target_arch = "wasm32"), schemars(rename = "CostFrom"))]
pub(in crate::config) struct RawCostFrom {
    /// A request header holding the cost as a whole number.
    pub header: Option<String>,
    /// Fields of the request's JSON body (`max_tokens`, `generationConfig.maxOutputTokens`):
    /// the largest whole number among them.
    pub body: Option<Vec<String>>,
    /// With `body`: adds the body's bytes divided by this (rounded up), an estimate of the
    /// input's tokens.
    pub input_bytes_per_token: Option<NonZeroU64>,
    /// When the header or fields are absent or not whole numbers (default 1 for `header`, `max`
    /// for `body`).
    pub default: Option<u64>,
    /// The least a request is charged whatever the request says (default 1; 0 lets clients send
    /// free requests).
    #[serde(default = "one")]
    pub min: u64,
    /// The most a request is charged whatever the request says.
    pub max: NonZeroU64,
}

fn one() -> u64 {
    1
}
