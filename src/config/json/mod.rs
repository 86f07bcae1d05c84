//! The configuration's JSON shape, as serde reads it (validated into the model by `validate`).

mod cost;
mod overload;

use super::period::{Per, Period};
use super::syntax::{FailureMode, FirstLease, HeaderFormat, KeyPart, LogLevel, MissingKey};
pub(in crate::config) use cost::*;
pub(in crate::config) use overload::*;
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

fn unreadable_default() -> MissingKey {
    MissingKey::Limit
}
