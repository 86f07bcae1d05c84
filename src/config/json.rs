//! The configuration's JSON shape, as serde reads it (validated into the model by `validate`).

use super::period::{Per, Period};
use super::syntax::{FailureMode, FirstLease, HeaderFormat, KeyPart, LogLevel, MissingKey};
use serde::de::{self, Deserializer};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::num::{NonZeroU32, NonZeroU64};

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(not(target_arch = "wasm32"), schemars(rename = "TollgateConfig"))]
pub(super) struct RawConfig {
    /// Evaluated for every request; a request is refused if any matching rule refuses.
    pub rules: Vec<RawRule>,
    #[serde(default)]
    pub response: RawResponse,
    #[serde(default)]
    /// Quota headers on responses: draft (IETF RateLimit), legacy (X-RateLimit-*), both or none.
    pub rate_limit_headers: HeaderFormat,
    #[serde(default)]
    pub client_ip: RawClientIp,
    #[serde(default)]
    pub dry_run: bool,
    /// Where rules with "scope": "global" get their quota (tollgate-quota).
    pub quota_service: Option<RawQuotaService>,
    /// The filter's own log level (default info); debug adds one line per decision.
    #[serde(default)]
    pub log_level: LogLevel,
    /// Priority classes for overload rules (adaptive, sre_throttle): first match wins.
    #[serde(default)]
    pub priorities: Vec<RawPriority>,
    /// At least 16 bytes: keys the hash that places client keys in slot groups. Without it each
    /// proxy process makes a random one at start (shared by its workers and reloads).
    pub placement_secret: Option<String>,
    /// The most request-body bytes buffered for rules that read the body (a cost from its
    /// fields, a `body:` key part): default 256 KiB.
    pub max_request_body_bytes: Option<u64>,
    /// The longest a request waits for its whole body to come before it is decided without
    /// reading it: default 5 s.
    pub request_body_timeout: Option<Period>,
    /// The most request-body bytes all requests waiting for their bodies keep, per worker:
    /// default 8 MiB.
    pub max_waiting_body_bytes: Option<u64>,
    /// A status path the filter answers itself: the keys each rule sees most. Off without it.
    pub status: Option<RawStatus>,
}

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(not(target_arch = "wasm32"), schemars(rename = "Status"))]
pub(super) struct RawStatus {
    /// The path (exact, without a query) the filter answers with the status: `GET` only.
    pub path: String,
    /// Client networks (CIDR or addresses) allowed to read it: default 127.0.0.1 and ::1.
    pub allow: Option<Vec<String>>,
    /// At least 16 bytes: then a request must also carry `authorization: Bearer <token>`.
    pub token: Option<String>,
    /// How keys are shown: "full" (their values, default) or "hashed" (a keyed hash).
    #[serde(default)]
    pub keys: KeyDisplay,
    /// The most bytes of a key shown (1–128, default 64).
    pub max_key_bytes: Option<u64>,
    /// Log the keys each rule refused most, once per process every `log_every` (default true).
    pub log: Option<bool>,
    /// How often that line is logged: default 60s, at least 1s.
    pub log_every: Option<Period>,
}

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Deserialize, Default, PartialEq, Eq, Clone, Copy, Debug)]
#[serde(rename_all = "snake_case")]
pub enum KeyDisplay {
    #[default]
    Full,
    Hashed,
}

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(not(target_arch = "wasm32"), schemars(rename = "QuotaService"))]
pub(super) struct RawQuotaService {
    /// Envoy: a cluster name. nginx: host:port (or a name its resolver knows).
    pub upstream: String,
    pub authority: Option<String>,
    pub timeout: Option<Period>,
    pub token: Option<String>,
    #[serde(default)]
    pub mode: QuotaMode,
    #[serde(default)]
    pub failure_mode: FailureMode,
    pub instances_hint: Option<NonZeroU64>,
    #[serde(default)]
    pub first_lease: FirstLease,
    pub retry: Option<Period>,
    pub lease_size: Option<NonZeroU64>,
    /// At least 16 bytes, the same on every proxy of a deployment: key hashes sent to the service
    /// are keyed by it, so they say nothing outside this deployment. Default: derived from
    /// `token`.
    pub key_secret: Option<String>,
}

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Deserialize, Default, PartialEq, Eq, Clone, Copy)]
#[serde(rename_all = "snake_case")]
pub(super) enum QuotaMode {
    #[default]
    Lease,
    Strict,
}

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Deserialize, Default, PartialEq, Eq, Clone, Copy)]
#[serde(rename_all = "snake_case")]
pub(super) enum Scope {
    #[default]
    Local,
    Global,
}

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(not(target_arch = "wasm32"), schemars(rename = "Rule"))]
pub(super) struct RawRule {
    pub name: RuleName,
    /// Conditions that must all hold for the rule to apply; none = every request.
    #[serde(rename = "match", default)]
    pub matcher: RawMatch,
    #[serde(default)]
    /// Parts joined into the bucket key; none = one bucket for the whole rule.
    pub key: Vec<KeyPart>,
    /// requests per per, or {"concurrent": N} for the concurrency algorithm (none for adaptive
    /// and sre_throttle).
    pub limit: Option<RawLimit>,
    /// Token bucket: capacity (default limit.requests). Leaky bucket: excess accepted (default 0).
    pub burst: Option<u64>,
    #[serde(default)]
    pub algorithm: Algorithm,
    pub delay: Option<Delay>,
    pub max_delay: Option<Period>,
    pub warmup: Option<Period>,
    pub cost: Option<RawCost>,
    #[serde(default)]
    pub overrides: Vec<RawOverride>,
    pub response: Option<RawResponse>,
    #[serde(default)]
    pub missing_key: MissingKey,
    /// A `body:` key part of a body that came but cannot be read (not strict JSON, cut, too
    /// slow): `limit` (default) keys it as one "unreadable" value; `skip` as absent.
    #[serde(default = "unreadable_default")]
    pub unreadable_body: MissingKey,
    #[serde(default)]
    pub dry_run: bool,
    /// Slots in the rule's table (default 10000): memory is bounded by it, not by clients.
    pub max_keys: Option<NonZeroU32>,
    #[serde(default)]
    pub scope: Scope,
    /// Token buckets: tokens a worker may take at once from a busy key's shared bucket and spend
    /// without touching shared data (default 8 in Envoy; 0 in nginx and for global rules; 0 turns
    /// batches off).
    pub worker_batch: Option<u64>,
    /// Settings of algorithm "adaptive".
    pub adaptive: Option<RawAdaptive>,
    /// Settings of algorithm "sre_throttle".
    pub sre_throttle: Option<RawThrottle>,
    /// The cost known only after the response: `cost` is then what the request reserves, and
    /// the difference is settled when the response has told its cost (token buckets).
    pub settle: Option<RawSettle>,
    /// Each key's own limit, from what a trusted filter before tollgate set (a tenant's plan).
    pub limit_from: Option<RawLimitFrom>,
    /// A byte limit (`limit.bytes`): which body it paces, `"response"` (the default) or
    /// `"request"` (uploads).
    pub pace: Option<PaceBody>,
    /// A byte limit: bytes of each body passed on before pacing starts (nginx's
    /// `limit_rate_after`); default 0.
    pub after: Option<u64>,
}

/// Which body a byte limit paces.
#[derive(Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[serde(rename_all = "snake_case")]
#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
pub enum PaceBody {
    #[default]
    Response,
    Request,
}

/// Where a key's own `limit.requests` comes from: a request header or request metadata (Envoy)
/// that a filter before tollgate set, a whole number kept within 1 – `max`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[cfg_attr(not(target_arch = "wasm32"), schemars(rename = "LimitFrom"))]
pub(super) struct RawLimitFrom {
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
pub(super) struct RawSettle {
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
pub(super) enum RawUsage {
    Count(UsageCount),
    Weighted(RawWeights),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[cfg_attr(not(target_arch = "wasm32"), schemars(rename = "UsageWeights"))]
pub(super) struct RawWeights {
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
pub(super) enum RawCost {
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
pub(super) struct RawCostFrom {
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

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(not(target_arch = "wasm32"), schemars(rename = "Override"))]
pub(super) struct RawOverride {
    pub values: Vec<String>,
    pub limit: Option<RawLimit>,
    pub burst: Option<u64>,
    #[serde(default)]
    pub unlimited: bool,
    #[serde(default)]
    pub block: bool,
}

/// nginx `delay=N` or `nodelay`.
#[derive(Clone, Copy)]
pub(super) enum Delay {
    Requests(u64),
    Never,
}

impl<'de> Deserialize<'de> for Delay {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => Ok(Self::Requests(n)),
            Raw::S(s) if s == "nodelay" => Ok(Self::Never),
            Raw::S(s) => Err(de::Error::custom(format!(
                "invalid delay {s:?} (expected a whole number of requests or \"nodelay\")"
            ))),
        }
    }
}

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
#[cfg_attr(not(target_arch = "wasm32"), schemars(rename = "Match"))]
pub(super) struct RawMatch {
    pub path_prefix: Option<String>,
    pub path: Option<String>,
    pub methods: Option<Vec<String>>,
    pub hosts: Option<Vec<String>>,
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
}

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(not(target_arch = "wasm32"), schemars(rename = "Limit"))]
pub(super) struct RawLimit {
    pub requests: Option<NonZeroU64>,
    /// Bytes per `per` (a byte limit: paces bodies, never refuses a request).
    pub bytes: Option<NonZeroU64>,
    /// A duration, or a calendar period (`"day"`, `"week"`, `"month"`) with `calendar`.
    pub per: Option<Per>,
    pub concurrent: Option<NonZeroU64>,
    /// A calendar quota (global rules): `requests` per calendar `per` in this time zone, full
    /// again when the next period begins.
    pub calendar: Option<RawCalendar>,
}

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(not(target_arch = "wasm32"), schemars(rename = "Calendar"))]
pub(super) struct RawCalendar {
    /// An IANA time zone name (`Europe/Berlin`, `America/New_York`); `UTC` by default.
    pub time_zone: Option<String>,
}

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
#[cfg_attr(not(target_arch = "wasm32"), schemars(rename = "Response"))]
pub(super) struct RawResponse {
    pub status: u32,
    pub body: String,
    pub headers: BTreeMap<String, String>,
}

impl Default for RawResponse {
    fn default() -> Self {
        Self {
            status: 429,
            body: "rate limited\n".into(),
            headers: BTreeMap::from([("content-type".into(), "text/plain".into())]),
        }
    }
}

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
#[cfg_attr(not(target_arch = "wasm32"), schemars(rename = "ClientIp"))]
pub(super) struct RawClientIp {
    #[serde(default)]
    pub trusted_hops: u32,
    /// IPv4 clients are keyed by their network of this length (default 32: the address).
    pub ipv4_prefix: Option<u8>,
    /// IPv6 clients are keyed by their network of this length (default 64: one subscriber).
    pub ipv6_prefix: Option<u8>,
}

/// `[a-z0-9_-]{1,64}`.
pub(super) struct RuleName(pub String);

impl<'de> Deserialize<'de> for RuleName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let ok = !s.is_empty()
            && s.len() <= 64
            && s.bytes()
                .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-'));
        if ok {
            Ok(Self(s))
        } else {
            Err(de::Error::custom(format!(
                "invalid rule name {s:?}: use 1 to 64 of a-z, 0-9, _ and -"
            )))
        }
    }
}

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Default, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum Algorithm {
    #[default]
    TokenBucket,
    FixedWindow,
    SlidingWindow,
    LeakyBucket,
    Concurrency,
    Adaptive,
    SreThrottle,
}

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

fn unreadable_default() -> MissingKey {
    MissingKey::Limit
}
