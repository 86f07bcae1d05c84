//! The plugin configuration: parsed once, validated with errors that name the field and the reason.

use serde::de::{self, Deserializer};
use serde::Deserialize;
use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::num::{NonZeroU32, NonZeroU64};
use tollgate_core::{
    Concurrency, FixedWindow, LeakyBucket, LeaseAllowance, Limit, SlidingWindow, SlotTable,
    TokenBucket, WarmUp,
};

/// Slots per rule when `max_keys` is not given.
pub const DEFAULT_MAX_KEYS: u32 = 10_000;
/// Upper bound of `max_keys`: every slot is created when the configuration loads.
pub const MAX_MAX_KEYS: u32 = 1_000_000;
/// Tokens a worker may stash per key when `worker_batch` is not given (token buckets).
pub const DEFAULT_WORKER_BATCH: u64 = 8;
/// Upper bound of `worker_batch`: what may sit in stashes is part of the accuracy bound.
pub const MAX_WORKER_BATCH: u64 = 64;
/// How long a leaky bucket may hold a request when `max_delay` is not given.
pub const DEFAULT_MAX_DELAY_NS: u64 = 10_000_000_000;

/// A configuration error, shown as `path: reason` (e.g. `rules[1].limit.per: invalid duration "5x"`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError(pub String);

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

fn err(path: impl fmt::Display, reason: impl fmt::Display) -> ConfigError {
    ConfigError(format!("{path}: {reason}"))
}

/// The validated configuration the filter runs with.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub rules: Vec<Rule>,
    pub response: Response,
    pub rate_limit_headers: HeaderFormat,
    pub trusted_hops: u32,
    /// Required when a rule has `"scope": "global"`.
    pub quota_service: Option<QuotaService>,
}

/// Where global rules get their quota.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuotaService {
    /// An Envoy cluster name (on nginx-like hosts, `host:port`).
    pub upstream: String,
    pub authority: String,
    pub timeout_ms: u64,
    pub token: Option<String>,
    pub failure_mode: FailureMode,
    /// How many proxies share the global limits (for `failure_mode: local` and provisional quota).
    pub instances_hint: u64,
    /// A key with no quota yet: wait for its first lease, or spend a provisional local allowance.
    pub first_lease: FirstLease,
    /// After a failed call, how long keys apply the failure mode before asking again.
    pub retry_ms: u64,
    /// One call per request (the request waits for it) instead of leased allowances.
    pub strict: bool,
}

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureMode {
    /// Global rules do not apply while the service fails.
    #[default]
    Allow,
    /// Global rules refuse.
    Deny,
    /// Global rules are enforced locally at `limit / instances_hint`.
    Local,
}

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FirstLease {
    #[default]
    Wait,
    Provisional,
}

/// What a global rule sends the quota service, and its local stand-in.
#[derive(Debug, Clone, PartialEq)]
pub struct GlobalRule {
    pub requests: u64,
    pub per_ms: u64,
    pub burst: u64,
    /// Fingerprint of the limit: different configurations never share global state.
    pub limit_id: String,
    /// The rule at `limit / instances_hint`, used by `failure_mode: local` and provisional quota.
    pub fallback: Quota,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    pub name: String,
    pub matcher: Match,
    pub key: Vec<KeyPart>,
    pub missing_key: MissingKey,
    pub quota: Quota,
    pub cost: Cost,
    /// Specific keys (encoded like request keys) with their own treatment.
    pub overrides: Vec<Override>,
    /// The rule's own rejection response, else the top-level one.
    pub response: Option<Response>,
    /// The rule's own `dry_run` or the top-level one.
    pub dry_run: bool,
    /// Set for `"scope": "global"`: `quota.limit` is then the leased allowance.
    pub global: Option<GlobalRule>,
    /// Token buckets (and global rules' leased allowance): most tokens a worker stashes at once
    /// per key (0: none).
    pub worker_batch: u64,
}

/// A limit with the slots that hold its state and how headers state it.
#[derive(Debug, Clone, PartialEq)]
pub struct Quota {
    pub limit: Limit,
    pub table: SlotTable,
    /// `RateLimit-Policy` quota `q` and window `w` seconds (none for concurrency).
    pub policy: (u64, Option<u64>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Override {
    pub key: Vec<u8>,
    pub action: OverrideAction,
}

#[derive(Debug, Clone, PartialEq)]
pub enum OverrideAction {
    /// This key gets its own limit (and its own slot: no sharing).
    Limit(Quota),
    /// The rule does not apply to this key.
    Unlimited,
    /// Every request of this key is refused by this rule.
    Block,
}

/// Tokens a request takes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cost {
    Fixed(u64),
    /// From a request header: absent or not a whole number → `default`; above `max` → `max`.
    Header {
        name: String,
        default: u64,
        max: u64,
    },
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Match {
    pub path: Option<PathMatch>,
    /// Upper-case.
    pub methods: Vec<String>,
    /// Lower-case, without port.
    pub hosts: Vec<String>,
    /// Lower-case names, exact values.
    pub headers: Vec<(String, String)>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PathMatch {
    Exact(String),
    Prefix(String),
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum KeyPart {
    ClientIp,
    Header(String),
    Query(String),
    Path,
    Method,
    Host,
}

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MissingKey {
    #[default]
    Skip,
    Limit,
}

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HeaderFormat {
    #[default]
    Draft,
    Legacy,
    Both,
    None,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u32,
    pub body: String,
    /// Lower-case names.
    pub headers: Vec<(String, String)>,
}

impl Config {
    /// Every quota with its rule: each rule's own, then its overrides' limits.
    pub fn quotas(&self) -> impl Iterator<Item = (&Rule, &Quota)> {
        self.rules.iter().flat_map(|rule| {
            std::iter::once(&rule.quota)
                .chain(rule.overrides.iter().filter_map(|o| match &o.action {
                    OverrideAction::Limit(q) => Some(q),
                    _ => None,
                }))
                .map(move |q| (rule, q))
        })
    }

    /// One line for the log: every rule and its limit.
    pub fn summary(&self) -> String {
        let rules: Vec<String> = self
            .rules
            .iter()
            .map(|r| {
                format!(
                    "{} ({}, {} slots{}{})",
                    r.name,
                    match (&r.global, &r.quota.limit) {
                        (Some(g), Limit::Lease(l)) => format!(
                            "global token_bucket {} per {}, burst {}, leases of {}",
                            g.requests,
                            duration(g.per_ms * 1_000_000),
                            g.burst,
                            l.lease_size
                        ),
                        _ => describe(&r.quota.limit),
                    },
                    r.quota.table.capacity(),
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

    /// Parse and validate the plugin configuration bytes.
    pub fn parse(bytes: &[u8]) -> Result<Self, ConfigError> {
        let mut de = serde_json::Deserializer::from_slice(bytes);
        let raw: RawConfig = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            if path == "." || path == "?" {
                ConfigError(format!("configuration: {inner}"))
            } else {
                err(path, inner)
            }
        })?;
        de.end().map_err(|e| err("configuration", e))?;
        raw.validate()
    }
}

// ---- the JSON shape ----

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(not(target_arch = "wasm32"), schemars(rename = "TollgateConfig"))]
struct RawConfig {
    /// Evaluated for every request; a request is refused if any matching rule refuses.
    rules: Vec<RawRule>,
    #[serde(default)]
    response: RawResponse,
    #[serde(default)]
    /// Quota headers on responses: draft (IETF RateLimit), legacy (X-RateLimit-*), both or none.
    rate_limit_headers: HeaderFormat,
    #[serde(default)]
    client_ip: RawClientIp,
    #[serde(default)]
    dry_run: bool,
    /// Where rules with "scope": "global" get their quota (tollgate-quota).
    quota_service: Option<RawQuotaService>,
}

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(not(target_arch = "wasm32"), schemars(rename = "QuotaService"))]
struct RawQuotaService {
    upstream: String,
    authority: Option<String>,
    timeout: Option<Period>,
    token: Option<String>,
    #[serde(default)]
    mode: QuotaMode,
    #[serde(default)]
    failure_mode: FailureMode,
    instances_hint: Option<NonZeroU64>,
    #[serde(default)]
    first_lease: FirstLease,
    retry: Option<Period>,
    lease_size: Option<NonZeroU64>,
}

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Deserialize, Default, PartialEq, Eq, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum QuotaMode {
    #[default]
    Lease,
    Strict,
}

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Deserialize, Default, PartialEq, Eq, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum Scope {
    #[default]
    Local,
    Global,
}

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(not(target_arch = "wasm32"), schemars(rename = "Rule"))]
struct RawRule {
    name: RuleName,
    /// Conditions that must all hold for the rule to apply; none = every request.
    #[serde(rename = "match", default)]
    matcher: RawMatch,
    #[serde(default)]
    /// Parts joined into the bucket key; none = one bucket for the whole rule.
    key: Vec<KeyPart>,
    /// requests per per, or {"concurrent": N} for the concurrency algorithm.
    limit: RawLimit,
    /// Token bucket: capacity (default limit.requests). Leaky bucket: excess accepted (default 0).
    burst: Option<u64>,
    #[serde(default)]
    algorithm: Algorithm,
    delay: Option<Delay>,
    max_delay: Option<Period>,
    warmup: Option<Period>,
    cost: Option<RawCost>,
    #[serde(default)]
    overrides: Vec<RawOverride>,
    response: Option<RawResponse>,
    #[serde(default)]
    missing_key: MissingKey,
    #[serde(default)]
    dry_run: bool,
    /// Slots in the rule's table (default 10000): memory is bounded by it, not by clients.
    max_keys: Option<NonZeroU32>,
    #[serde(default)]
    scope: Scope,
    /// Token buckets: tokens a worker may take at once from a busy key's shared bucket and spend
    /// without touching shared data (default 8; 0 turns batches off).
    worker_batch: Option<u64>,
}

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Deserialize)]
#[serde(untagged)]
#[cfg_attr(not(target_arch = "wasm32"), schemars(rename = "Cost"))]
enum RawCost {
    Fixed(u64),
    Header(RawHeaderCost),
}

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(not(target_arch = "wasm32"), schemars(rename = "HeaderCost"))]
struct RawHeaderCost {
    header: String,
    #[serde(default = "one")]
    default: u64,
    max: NonZeroU64,
}

fn one() -> u64 {
    1
}

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(not(target_arch = "wasm32"), schemars(rename = "Override"))]
struct RawOverride {
    values: Vec<String>,
    limit: Option<RawLimit>,
    burst: Option<u64>,
    #[serde(default)]
    unlimited: bool,
    #[serde(default)]
    block: bool,
}

/// nginx `delay=N` or `nodelay`.
#[derive(Clone, Copy)]
enum Delay {
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
struct RawMatch {
    path_prefix: Option<String>,
    path: Option<String>,
    methods: Option<Vec<String>>,
    hosts: Option<Vec<String>>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
}

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
#[cfg_attr(not(target_arch = "wasm32"), schemars(rename = "Limit"))]
struct RawLimit {
    requests: Option<NonZeroU64>,
    per: Option<Period>,
    concurrent: Option<NonZeroU64>,
}

#[cfg_attr(not(target_arch = "wasm32"), derive(schemars::JsonSchema))]
#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
#[cfg_attr(not(target_arch = "wasm32"), schemars(rename = "Response"))]
struct RawResponse {
    status: u32,
    body: String,
    headers: BTreeMap<String, String>,
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
struct RawClientIp {
    #[serde(default)]
    trusted_hops: u32,
}

/// `[a-z0-9_-]{1,64}`.
struct RuleName(String);

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
enum Algorithm {
    #[default]
    TokenBucket,
    FixedWindow,
    SlidingWindow,
    LeakyBucket,
    Concurrency,
}

impl<'de> Deserialize<'de> for KeyPart {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let named = |prefix: &str| {
            s.strip_prefix(prefix)
                .filter(|n| !n.is_empty())
                .map(str::to_ascii_lowercase)
        };
        match s.as_str() {
            "client_ip" => Ok(Self::ClientIp),
            "path" => Ok(Self::Path),
            "method" => Ok(Self::Method),
            "host" => Ok(Self::Host),
            _ => {
                if let Some(name) = named("header:") {
                    Ok(Self::Header(name))
                } else if let Some(name) = s.strip_prefix("query:").filter(|n| !n.is_empty()) {
                    Ok(Self::Query(name.to_owned()))
                } else {
                    Err(de::Error::custom(format!(
                        "unknown key part {s:?} (expected client_ip, path, method, host, \
                         header:NAME or query:NAME)"
                    )))
                }
            }
        }
    }
}

/// A duration written as `<number><unit>`, unit one of ms, s, m, h, d.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Period {
    pub ns: u64,
}

impl Period {
    pub fn parse(s: &str) -> Option<Self> {
        let split = s.find(|c: char| !c.is_ascii_digit())?;
        let (digits, unit) = s.split_at(split);
        let n: u64 = digits.parse().ok()?;
        let unit_ns: u64 = match unit {
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            "d" => 86_400_000_000_000,
            _ => return None,
        };
        let ns = n.checked_mul(unit_ns)?;
        (ns > 0 && ns <= 366 * 86_400_000_000_000).then_some(Self { ns })
    }
}

impl<'de> Deserialize<'de> for Period {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::parse(&s).ok_or_else(|| {
            de::Error::custom(format!(
                "invalid duration {s:?} (expected a positive whole number and a unit: ms, s, m, h \
                 or d, at most 366d, e.g. \"250ms\", \"1m\")"
            ))
        })
    }
}

// ---- validation ----

impl RawConfig {
    fn validate(self) -> Result<Config, ConfigError> {
        if self.rules.is_empty() {
            return Err(err("rules", "at least one rule is required"));
        }
        let quota_service = self
            .quota_service
            .map(|q| q.validate("quota_service"))
            .transpose()?;
        let mut seen = HashSet::new();
        let mut rules = Vec::with_capacity(self.rules.len());
        for (i, raw) in self.rules.into_iter().enumerate() {
            let path = format!("rules[{i}]");
            if !seen.insert(raw.name.0.clone()) {
                return Err(err(
                    format!("{path}.name"),
                    format!("duplicate rule name {:?}", raw.name.0),
                ));
            }
            let global = raw.scope == Scope::Global;
            let mut rule = raw.validate(&path, self.dry_run)?;
            if global {
                let Some((qs, lease_size)) = &quota_service else {
                    return Err(err(
                        format!("{path}.scope"),
                        "\"global\" needs a top-level quota_service",
                    ));
                };
                rule.make_global(&path, qs, *lease_size)?;
            }
            rules.push(rule);
        }
        let response = self.response.validate("response")?;
        Ok(Config {
            rules,
            response,
            rate_limit_headers: self.rate_limit_headers,
            trusted_hops: self.client_ip.trusted_hops,
            quota_service: quota_service.map(|(q, _)| q),
        })
    }
}

impl RawRule {
    fn validate(self, path: &str, dry_run_all: bool) -> Result<Rule, ConfigError> {
        let matcher = self.matcher.validate(&format!("{path}.match"))?;
        let max_keys = self.max_keys.map_or(DEFAULT_MAX_KEYS, NonZeroU32::get);
        if max_keys > MAX_MAX_KEYS {
            return Err(err(
                format!("{path}.max_keys"),
                format!("{max_keys} is more than the maximum of {MAX_MAX_KEYS}"),
            ));
        }
        let only = |given: bool, field: &str, algorithms: &str| {
            if given {
                Err(err(
                    format!("{path}.{field}"),
                    format!("only applies to {algorithms}"),
                ))
            } else {
                Ok(())
            }
        };
        let algorithm = self.algorithm;
        only(
            self.delay.is_some() && algorithm != Algorithm::LeakyBucket,
            "delay",
            "algorithm \"leaky_bucket\"",
        )?;
        only(
            self.max_delay.is_some() && algorithm != Algorithm::LeakyBucket,
            "max_delay",
            "algorithm \"leaky_bucket\"",
        )?;
        only(
            self.warmup.is_some() && algorithm != Algorithm::TokenBucket,
            "warmup",
            "algorithm \"token_bucket\"",
        )?;
        only(
            self.worker_batch.is_some()
                && (algorithm != Algorithm::TokenBucket || self.warmup.is_some()),
            "worker_batch",
            "algorithm \"token_bucket\" (no warmup)",
        )?;
        let worker_batch = match self.worker_batch {
            Some(n) if n > MAX_WORKER_BATCH => {
                return Err(err(
                    format!("{path}.worker_batch"),
                    format!("{n} is more than the maximum of {MAX_WORKER_BATCH}"),
                ))
            }
            Some(n) => n,
            None if algorithm == Algorithm::TokenBucket && self.warmup.is_none() => {
                DEFAULT_WORKER_BATCH
            }
            None => 0,
        };
        if self.warmup.is_some() && self.burst.is_some() {
            return Err(err(
                format!("{path}.burst"),
                "cannot be combined with warmup (a warming bucket admits one request at a time)",
            ));
        }
        let params = LimitParams {
            algorithm,
            delay: self.delay,
            max_delay_ns: self.max_delay.map_or(DEFAULT_MAX_DELAY_NS, |p| p.ns),
            warmup_ns: self.warmup.map(|p| p.ns),
        };
        let name = self.name.0;
        let limit = params.limit(&self.limit, self.burst, path)?;
        let quota = Quota::new(limit, &name, max_keys);

        let mut seen = HashSet::new();
        for (j, part) in self.key.iter().enumerate() {
            if !seen.insert(part) {
                return Err(err(format!("{path}.key[{j}]"), "repeated key part"));
            }
        }
        let cost = match self.cost {
            None => Cost::Fixed(1),
            Some(RawCost::Fixed(n)) => Cost::Fixed(n),
            Some(RawCost::Header(h)) => {
                if h.header.is_empty() {
                    return Err(err(format!("{path}.cost.header"), "empty header name"));
                }
                Cost::Header {
                    name: h.header.to_ascii_lowercase(),
                    default: h.default.min(h.max.get()),
                    max: h.max.get(),
                }
            }
        };
        if algorithm == Algorithm::LeakyBucket && !matches!(cost, Cost::Fixed(1)) {
            // A held request's delay is decided for the whole cost at once; keep nginx's model.
            return Err(err(format!("{path}.cost"), "leaky_bucket requests cost 1"));
        }

        let mut overrides = Vec::with_capacity(self.overrides.len());
        let mut override_keys = HashSet::new();
        for (j, o) in self.overrides.into_iter().enumerate() {
            let at = format!("{path}.overrides[{j}]");
            if o.values.len() != self.key.len() {
                return Err(err(
                    format!("{at}.values"),
                    format!(
                        "gives {} value(s) for a key of {} part(s)",
                        o.values.len(),
                        self.key.len()
                    ),
                ));
            }
            let mut values = Vec::with_capacity(o.values.len());
            for (k, (v, part)) in o.values.iter().zip(&self.key).enumerate() {
                values.push(match part {
                    KeyPart::ClientIp => v
                        .parse::<std::net::IpAddr>()
                        .map(|ip| ip.to_string())
                        .map_err(|_| {
                            err(
                                format!("{at}.values[{k}]"),
                                format!("{v:?} is not an IP address"),
                            )
                        })?,
                    KeyPart::Host => v.to_ascii_lowercase(),
                    _ => v.clone(),
                });
            }
            let key = crate::request::encode_key(values.iter().map(|v| Some(v.as_str())));
            if !override_keys.insert(key.clone()) {
                return Err(err(
                    format!("{at}.values"),
                    "another override has the same values",
                ));
            }
            let action = match (o.limit, o.unlimited, o.block) {
                (Some(l), false, false) => {
                    let limit = params.limit(&l, o.burst, &at)?;
                    OverrideAction::Limit(Quota::new(limit, &format!("{name}.o{j}"), 1))
                }
                (None, true, false) if o.burst.is_none() => OverrideAction::Unlimited,
                (None, false, true) if o.burst.is_none() => OverrideAction::Block,
                _ => {
                    return Err(err(
                        at,
                        "give exactly one of limit (with optional burst), unlimited or block",
                    ))
                }
            };
            overrides.push(Override { key, action });
        }
        let response = self
            .response
            .map(|r| r.validate(&format!("{path}.response")))
            .transpose()?;
        Ok(Rule {
            name,
            matcher,
            key: self.key,
            missing_key: self.missing_key,
            quota,
            cost,
            overrides,
            response,
            dry_run: self.dry_run || dry_run_all,
            global: None,
            worker_batch,
        })
    }
}

impl RawQuotaService {
    /// The service settings, and the lease size if one was given.
    fn validate(self, path: &str) -> Result<(QuotaService, Option<u64>), ConfigError> {
        if self.upstream.is_empty() {
            return Err(err(format!("{path}.upstream"), "must not be empty"));
        }
        let service = QuotaService {
            authority: self.authority.unwrap_or_else(|| self.upstream.clone()),
            upstream: self.upstream,
            timeout_ms: self.timeout.map_or(200, |p| (p.ns / 1_000_000).max(1)),
            token: self.token,
            failure_mode: self.failure_mode,
            instances_hint: self.instances_hint.map_or(1, NonZeroU64::get),
            first_lease: self.first_lease,
            retry_ms: self.retry.map_or(1_000, |p| (p.ns / 1_000_000).max(1)),
            strict: self.mode == QuotaMode::Strict,
        };
        Ok((service, self.lease_size.map(NonZeroU64::get)))
    }
}

impl Rule {
    /// Turn a validated local token-bucket rule into a global one.
    fn make_global(
        &mut self,
        path: &str,
        qs: &QuotaService,
        lease_size: Option<u64>,
    ) -> Result<(), ConfigError> {
        let Limit::TokenBucket(tb) = self.quota.limit else {
            return Err(err(
                format!("{path}.scope"),
                "\"global\" rules use the token_bucket algorithm, without warmup",
            ));
        };
        if !self.overrides.is_empty() {
            return Err(err(
                format!("{path}.overrides"),
                "not supported on global rules yet",
            ));
        }
        if tb.period_ns() % 1_000_000 != 0 {
            return Err(err(
                format!("{path}.limit.per"),
                "global limits need whole milliseconds",
            ));
        }
        let (requests, per_ms, burst) = (tb.requests(), tb.period_ns() / 1_000_000, tb.burst());
        // A refill covers a slice of the burst each proxy may hold: small enough to share, large
        // enough that calls stay rare.
        let lease_size =
            lease_size.unwrap_or_else(|| (burst / (4 * qs.instances_hint)).clamp(1, 1_000));
        let lease = LeaseAllowance {
            lease_size,
            low_water: lease_size.div_ceil(2),
            claim_ms: qs.timeout_ms,
        };
        let share = |n: u64| (n / qs.instances_hint).max(1);
        let fallback_limit = TokenBucket::new(share(requests), tb.period_ns(), share(burst))
            .map(Limit::TokenBucket)
            .ok_or_else(|| err(format!("{path}.limit"), "must be positive"))?;
        let max_keys = u32::try_from(self.quota.table.capacity()).unwrap_or(u32::MAX);
        let limit_id = format!(
            "{:016x}",
            tollgate_core::slot::fingerprint(
                format!("{}/{requests}/{per_ms}/{burst}", self.name).as_bytes()
            )
        );
        self.global = Some(GlobalRule {
            requests,
            per_ms,
            burst,
            limit_id,
            fallback: Quota::new(fallback_limit, &format!("{}.local", self.name), max_keys),
        });
        let mut quota = Quota::new(
            Limit::Lease(lease),
            &format!("{}.lease", self.name),
            max_keys,
        );
        quota.policy = self.quota.policy;
        self.quota = quota;
        Ok(())
    }
}

/// A rule's algorithm settings, applied to its own limit and to its overrides' limits.
struct LimitParams {
    algorithm: Algorithm,
    delay: Option<Delay>,
    max_delay_ns: u64,
    warmup_ns: Option<u64>,
}

impl LimitParams {
    fn limit(&self, raw: &RawLimit, burst: Option<u64>, path: &str) -> Result<Limit, ConfigError> {
        let field = |f: &str| format!("{path}.limit.{f}");
        if self.algorithm == Algorithm::Concurrency {
            if raw.requests.is_some() || raw.per.is_some() {
                return Err(err(
                    format!("{path}.limit"),
                    "a concurrency limit is {\"concurrent\": N}, without requests or per",
                ));
            }
            if burst.is_some() {
                return Err(err(
                    format!("{path}.burst"),
                    "does not apply to concurrency",
                ));
            }
            let n = raw.concurrent.ok_or_else(|| {
                err(
                    field("concurrent"),
                    "required for algorithm \"concurrency\"",
                )
            })?;
            return Concurrency::new(n.get())
                .map(Limit::Concurrency)
                .ok_or_else(|| err(field("concurrent"), "must be at least 1"));
        }
        if raw.concurrent.is_some() {
            return Err(err(
                field("concurrent"),
                "only applies to algorithm \"concurrency\"",
            ));
        }
        let requests = raw
            .requests
            .ok_or_else(|| err(field("requests"), "required"))?
            .get();
        let per = raw.per.ok_or_else(|| err(field("per"), "required"))?.ns;
        let positive = || err(format!("{path}.limit"), "must be positive");
        let zero_burst = || err(format!("{path}.burst"), "must be at least 1");
        match self.algorithm {
            Algorithm::TokenBucket => match self.warmup_ns {
                Some(w) => WarmUp::new(requests, per, w)
                    .map(Limit::WarmUp)
                    .ok_or_else(positive),
                None => {
                    let burst = burst.unwrap_or(requests);
                    if burst == 0 {
                        return Err(zero_burst());
                    }
                    TokenBucket::new(requests, per, burst)
                        .map(Limit::TokenBucket)
                        .ok_or_else(positive)
                }
            },
            Algorithm::FixedWindow | Algorithm::SlidingWindow => {
                if burst.is_some() {
                    return Err(err(
                        format!("{path}.burst"),
                        "does not apply to window algorithms (the limit is the window's quota)",
                    ));
                }
                if self.algorithm == Algorithm::FixedWindow {
                    FixedWindow::new(requests, per).map(Limit::FixedWindow)
                } else {
                    SlidingWindow::new(requests, per).map(Limit::SlidingWindow)
                }
                .ok_or_else(positive)
            }
            Algorithm::LeakyBucket => {
                let delay = match self.delay {
                    None => 0,
                    Some(Delay::Requests(n)) => n,
                    Some(Delay::Never) => u64::MAX,
                };
                LeakyBucket::new(requests, per, burst.unwrap_or(0), delay, self.max_delay_ns)
                    .map(Limit::LeakyBucket)
                    .ok_or_else(positive)
            }
            Algorithm::Concurrency => Err(positive()),
        }
    }
}

impl Quota {
    /// `owner` names the slots (a rule, or a rule's override); the name carries the limit's
    /// parameters: a reload that keeps them keeps the state, one that changes them starts fresh.
    fn new(limit: Limit, owner: &str, max_keys: u32) -> Self {
        let fingerprint =
            tollgate_core::slot::fingerprint(format!("{limit:?}/{max_keys}").as_bytes());
        let table = SlotTable::new(format!("tollgate.{owner}.{fingerprint:016x}."), max_keys);
        Self {
            policy: policy(&limit),
            limit,
            table,
        }
    }
}

/// A limit as the configuration would write it.
pub fn describe(limit: &Limit) -> String {
    match limit {
        Limit::TokenBucket(a) => format!(
            "token_bucket {} per {}, burst {}",
            a.requests(),
            duration(a.period_ns()),
            a.burst()
        ),
        Limit::WarmUp(a) => format!(
            "token_bucket {} per {}, warmup {}",
            a.requests(),
            duration(a.period_ns()),
            duration(a.warmup_ns())
        ),
        Limit::FixedWindow(a) => {
            format!("fixed_window {} per {}", a.limit(), duration(a.period_ns()))
        }
        Limit::SlidingWindow(a) => {
            format!(
                "sliding_window {} per {}",
                a.limit(),
                duration(a.period_ns())
            )
        }
        Limit::LeakyBucket(a) => format!(
            "leaky_bucket {} per {}, burst {}, delay {}, max_delay {}",
            a.requests(),
            duration(a.period_ns()),
            a.burst(),
            if a.delay() == u64::MAX {
                "nodelay".to_string()
            } else {
                a.delay().to_string()
            },
            duration(a.max_delay_ns())
        ),
        Limit::Concurrency(a) => format!("concurrency {} in flight", a.limit()),
        Limit::Lease(a) => format!("global, leases of {}", a.lease_size),
    }
}

/// Nanoseconds in the largest unit that divides them: "250ms", "1m".
fn duration(ns: u64) -> String {
    const UNITS: [(u64, &str); 5] = [
        (86_400_000_000_000, "d"),
        (3_600_000_000_000, "h"),
        (60_000_000_000, "m"),
        (1_000_000_000, "s"),
        (1_000_000, "ms"),
    ];
    for (unit, name) in UNITS {
        if ns % unit == 0 && ns >= unit {
            return format!("{}{name}", ns / unit);
        }
    }
    format!("{ns}ns")
}

/// The policy as quota `q` per window `w` seconds. A period that is not whole seconds is stated
/// per second, rounded down (never promising more than the rule gives).
fn policy(limit: &Limit) -> (u64, Option<u64>) {
    const NS_PER_SEC: u64 = 1_000_000_000;
    let (requests, period_ns) = match limit {
        Limit::TokenBucket(a) => (a.requests(), a.period_ns()),
        Limit::WarmUp(a) => (a.requests(), a.period_ns()),
        Limit::FixedWindow(a) => (a.limit(), a.period_ns()),
        Limit::SlidingWindow(a) => (a.limit(), a.period_ns()),
        Limit::LeakyBucket(a) => (a.requests(), a.period_ns()),
        Limit::Concurrency(a) => return (a.limit(), None),
        Limit::Lease(a) => return (a.lease_size, None),
    };
    if period_ns % NS_PER_SEC == 0 {
        (requests, Some(period_ns / NS_PER_SEC))
    } else {
        let per_sec = u128::from(requests) * u128::from(NS_PER_SEC) / u128::from(period_ns);
        (u64::try_from(per_sec).unwrap_or(u64::MAX), Some(1))
    }
}

impl RawMatch {
    fn validate(self, path: &str) -> Result<Match, ConfigError> {
        let path_match = match (self.path, self.path_prefix) {
            (Some(_), Some(_)) => {
                return Err(err(path, "give either path or path_prefix, not both"));
            }
            (Some(p), None) => Some(PathMatch::Exact(check_path(&format!("{path}.path"), p)?)),
            (None, Some(p)) => Some(PathMatch::Prefix(check_path(
                &format!("{path}.path_prefix"),
                p,
            )?)),
            (None, None) => None,
        };
        let list = |field: &str, values: Option<Vec<String>>, upper: bool| {
            let Some(values) = values else {
                return Ok(Vec::new());
            };
            if values.is_empty() {
                return Err(err(
                    format!("{path}.{field}"),
                    "must not be empty (leave it out to match any)",
                ));
            }
            values
                .into_iter()
                .enumerate()
                .map(|(j, v)| {
                    if v.is_empty() || v.contains(|c: char| c.is_whitespace() || c == ':') {
                        Err(err(
                            format!("{path}.{field}[{j}]"),
                            format!("invalid value {v:?}"),
                        ))
                    } else if upper {
                        Ok(v.to_ascii_uppercase())
                    } else {
                        Ok(v.to_ascii_lowercase())
                    }
                })
                .collect()
        };
        let methods = list("methods", self.methods, true)?;
        let hosts = list("hosts", self.hosts, false)?;
        let mut headers = Vec::with_capacity(self.headers.len());
        for (name, value) in self.headers {
            if name.is_empty() {
                return Err(err(format!("{path}.headers"), "empty header name"));
            }
            headers.push((name.to_ascii_lowercase(), value));
        }
        Ok(Match {
            path: path_match,
            methods,
            hosts,
            headers,
        })
    }
}

fn check_path(field: &str, p: String) -> Result<String, ConfigError> {
    if p.starts_with('/') {
        Ok(p)
    } else {
        Err(err(field, format!("{p:?} must start with \"/\"")))
    }
}

impl RawResponse {
    fn validate(self, path: &str) -> Result<Response, ConfigError> {
        if !(200..=599).contains(&self.status) {
            return Err(err(
                format!("{path}.status"),
                format!("{} is not an HTTP status between 200 and 599", self.status),
            ));
        }
        let mut headers = Vec::with_capacity(self.headers.len());
        for (name, value) in self.headers {
            let lower = name.to_ascii_lowercase();
            if lower.is_empty() || lower.starts_with(':') || lower == "content-length" {
                return Err(err(
                    format!("{path}.headers.{name}"),
                    "this header cannot be set",
                ));
            }
            headers.push((lower, value));
        }
        Ok(Response {
            status: self.status,
            body: self.body,
            headers,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Config, String> {
        Config::parse(s.as_bytes()).map_err(|e| e.0)
    }

    const MIN: &str = r#"{"rules":[{"name":"r","limit":{"requests":10,"per":"1s"}}]}"#;

    #[test]
    fn the_documented_example_parses() {
        let c = parse(
            r#"{
              "rules": [{
                "name": "per-ip",
                "match": { "path_prefix": "/api/", "methods": ["GET", "post"],
                           "hosts": ["API.example.com"], "headers": { "X-Tier": "free" } },
                "key": ["client_ip", "header:X-User", "query:page"],
                "limit": { "requests": 100, "per": "1m" },
                "burst": 20,
                "algorithm": "token_bucket",
                "missing_key": "limit",
                "dry_run": false
              }],
              "response": { "status": 429, "body": "rate limited\n",
                            "headers": { "content-type": "text/plain" } },
              "rate_limit_headers": "both",
              "client_ip": { "trusted_hops": 1 },
              "dry_run": true
            }"#,
        )
        .unwrap();
        let r = &c.rules[0];
        assert_eq!(
            r.quota.limit,
            Limit::TokenBucket(TokenBucket::new(100, 60_000_000_000, 20).unwrap())
        );
        assert_eq!(r.matcher.methods, ["GET", "POST"]);
        assert_eq!(r.matcher.hosts, ["api.example.com"]);
        assert_eq!(
            r.matcher.headers,
            [("x-tier".to_string(), "free".to_string())]
        );
        assert_eq!(
            r.key,
            [
                KeyPart::ClientIp,
                KeyPart::Header("x-user".into()),
                KeyPart::Query("page".into())
            ]
        );
        assert!(r.dry_run);
        assert_eq!(r.missing_key, MissingKey::Limit);
        assert_eq!(c.trusted_hops, 1);
        assert_eq!(c.rate_limit_headers, HeaderFormat::Both);
        assert!(!r.quota.table.prefix().contains('/'));
    }

    #[test]
    fn defaults() {
        let c = parse(MIN).unwrap();
        let r = &c.rules[0];
        assert_eq!(describe(&r.quota.limit), "token_bucket 10 per 1s, burst 10");
        assert_eq!(r.quota.table.capacity(), u64::from(DEFAULT_MAX_KEYS));
        assert_eq!(r.quota.policy, (10, Some(1)));
        assert_eq!(r.cost, Cost::Fixed(1));
        assert_eq!(r.missing_key, MissingKey::Skip);
        assert_eq!(c.response.status, 429);
        assert_eq!(c.rate_limit_headers, HeaderFormat::Draft);
        assert_eq!(c.trusted_hops, 0);
        assert!(!r.dry_run);
    }

    #[test]
    fn changed_parameters_change_the_slot_names() {
        let a = parse(MIN).unwrap();
        let b = parse(&MIN.replace("10", "11")).unwrap();
        assert_ne!(a.rules[0].quota.table, b.rules[0].quota.table);
        assert_eq!(
            a.rules[0].quota.table,
            parse(MIN).unwrap().rules[0].quota.table
        );
    }

    #[test]
    fn every_algorithm_and_option() {
        let c = parse(
            r#"{"rules":[
              {"name":"fw","algorithm":"fixed_window","limit":{"requests":100,"per":"1m"}},
              {"name":"sw","algorithm":"sliding_window","limit":{"requests":100,"per":"1m"}},
              {"name":"lb","algorithm":"leaky_bucket","limit":{"requests":10,"per":"1s"},"burst":5,"delay":2,"max_delay":"3s"},
              {"name":"nd","algorithm":"leaky_bucket","limit":{"requests":10,"per":"1s"},"delay":"nodelay"},
              {"name":"cc","algorithm":"concurrency","limit":{"concurrent":8},"key":["client_ip"],
               "overrides":[{"values":["10.0.0.1"],"limit":{"concurrent":50}},
                            {"values":["::0001"],"unlimited":true},
                            {"values":["192.0.2.7"],"block":true}]},
              {"name":"wu","limit":{"requests":30,"per":"1s"},"warmup":"10s",
               "cost":{"header":"X-Cost","max":10},"response":{"status":503}}
            ]}"#,
        )
        .unwrap();
        let d: Vec<String> = c.rules.iter().map(|r| describe(&r.quota.limit)).collect();
        assert_eq!(
            d,
            [
                "fixed_window 100 per 1m",
                "sliding_window 100 per 1m",
                "leaky_bucket 10 per 1s, burst 5, delay 2, max_delay 3s",
                "leaky_bucket 10 per 1s, burst 0, delay nodelay, max_delay 10s",
                "concurrency 8 in flight",
                "token_bucket 30 per 1s, warmup 10s",
            ]
        );
        let cc = &c.rules[4];
        assert_eq!(cc.quota.policy, (8, None));
        assert_eq!(cc.overrides.len(), 3);
        assert_eq!(
            cc.overrides[1].key,
            crate::request::encode_key([Some("::1")].into_iter())
        );
        assert!(matches!(cc.overrides[2].action, OverrideAction::Block));
        assert_eq!(c.quotas().count(), 7);
        let wu = &c.rules[5];
        assert_eq!(
            wu.cost,
            Cost::Header {
                name: "x-cost".into(),
                default: 1,
                max: 10
            }
        );
        assert_eq!(wu.response.as_ref().map(|r| r.status), Some(503));
        assert!(c
            .summary()
            .starts_with("6 rule(s): fw (fixed_window 100 per 1m, 10000 slots)"));
    }

    #[test]
    fn global_rules() {
        let c = parse(
            r#"{"rules":[{"name":"g","scope":"global","key":["client_ip"],
                          "limit":{"requests":100,"per":"1m"},"burst":80}],
                "quota_service":{"upstream":"quota","timeout":"50ms","token":"t",
                                 "failure_mode":"local","instances_hint":4}}"#,
        )
        .unwrap();
        let qs = c.quota_service.clone().unwrap();
        assert_eq!(
            (qs.authority.as_str(), qs.timeout_ms, qs.strict),
            ("quota", 50, false)
        );
        let g = &c.rules[0];
        let global = g.global.as_ref().unwrap();
        assert_eq!(
            (global.requests, global.per_ms, global.burst),
            (100, 60_000, 80)
        );
        assert_eq!(
            describe(&global.fallback.limit),
            "token_bucket 25 per 1m, burst 20"
        );
        assert_eq!(describe(&g.quota.limit), "global, leases of 5");
        assert_eq!(g.quota.policy, (100, Some(60)));
        assert!(c
            .summary()
            .contains("global token_bucket 100 per 1m, burst 80, leases of 5"));
    }

    /// The committed JSON Schema (schema/tollgate.schema.json) is what the config types say.
    /// `make schema` rewrites it.
    #[test]
    fn the_committed_schema_is_current() {
        let schema = schemars::schema_for!(RawConfig);
        let text = serde_json::to_string_pretty(&schema).unwrap() + "\n";
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/schema/tollgate.schema.json");
        if std::env::var_os("UPDATE_SCHEMA").is_some() {
            std::fs::create_dir_all(concat!(env!("CARGO_MANIFEST_DIR"), "/schema")).unwrap();
            std::fs::write(path, &text).unwrap();
        }
        let committed = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            committed == text,
            "schema/tollgate.schema.json is stale: run `make schema`"
        );
    }

    /// Every JSON example in the README and the configuration reference is a valid configuration.
    #[test]
    fn documented_examples_parse() {
        let mut seen = 0;
        for doc in ["README.md", "docs/configuration.md"] {
            let path = format!("{}/{doc}", env!("CARGO_MANIFEST_DIR"));
            let text = std::fs::read_to_string(&path).unwrap();
            for block in text.split("```json").skip(1) {
                let json = block.split("```").next().unwrap();
                if let Err(e) = Config::parse(json.as_bytes()) {
                    panic!("{doc}: {e} in\n{json}");
                }
                seen += 1;
            }
        }
        assert!(seen >= 10, "{seen} examples");
    }

    #[test]
    fn durations() {
        assert_eq!(Period::parse("250ms"), Some(Period { ns: 250_000_000 }));
        assert_eq!(
            Period::parse("1d"),
            Some(Period {
                ns: 86_400_000_000_000
            })
        );
        for bad in [
            "",
            "5",
            "5x",
            "0s",
            "-1s",
            "1.5s",
            " 1s",
            "1S",
            "367d",
            "99999999999999999999d",
        ] {
            assert_eq!(Period::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn errors_name_the_field_and_the_reason() {
        let cases: &[(&str, &str)] = &[
            ("{", "configuration: EOF"),
            ("{}", "configuration: missing field `rules`"),
            (r#"{"rules":[]}"#, "rules: at least one rule is required"),
            (
                r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1s"}}],"x":1}"#,
                "x: unknown field `x`",
            ),
            (
                r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1s"}},{"name":"s","limit":{"requests":1,"per":"5x"}}]}"#,
                r#"rules[1].limit.per: invalid duration "5x""#,
            ),
            (
                r#"{"rules":[{"name":"r","limit":{"requests":0,"per":"1s"}}]}"#,
                "rules[0].limit.requests: invalid value: integer `0`",
            ),
            (
                r#"{"rules":[{"name":"r","limit":{"requests":-3,"per":"1s"}}]}"#,
                "rules[0].limit.requests: invalid value: integer `-3`",
            ),
            (
                r#"{"rules":[{"name":"r","limit":{"requests":"5","per":"1s"}}]}"#,
                "rules[0].limit.requests: invalid type: string",
            ),
            (
                r#"{"rules":[{"name":"r","burst":0,"limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].burst: must be at least 1",
            ),
            (
                r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1s"}},{"name":"r","limit":{"requests":1,"per":"1s"}}]}"#,
                r#"rules[1].name: duplicate rule name "r""#,
            ),
            (
                r#"{"rules":[{"name":"Bad/Name","limit":{"requests":1,"per":"1s"}}]}"#,
                r#"rules[0].name: invalid rule name "Bad/Name""#,
            ),
            (
                r#"{"rules":[{"name":"r","algorithm":"gcra2","limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].algorithm: unknown variant `gcra2`, expected one of `token_bucket`, `fixed_window`, `sliding_window`, `leaky_bucket`, `concurrency`",
            ),
            (
                r#"{"rules":[{"name":"r","key":["cookie"],"limit":{"requests":1,"per":"1s"}}]}"#,
                r#"rules[0].key[0]: unknown key part "cookie""#,
            ),
            (
                r#"{"rules":[{"name":"r","key":["header:"],"limit":{"requests":1,"per":"1s"}}]}"#,
                r#"rules[0].key[0]: unknown key part "header:""#,
            ),
            (
                r#"{"rules":[{"name":"r","key":["path","path"],"limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].key[1]: repeated key part",
            ),
            (
                r#"{"rules":[{"name":"r","match":{"path":"/a","path_prefix":"/b"},"limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].match: give either path or path_prefix",
            ),
            (
                r#"{"rules":[{"name":"r","match":{"path_prefix":"api"},"limit":{"requests":1,"per":"1s"}}]}"#,
                r#"rules[0].match.path_prefix: "api" must start with "/""#,
            ),
            (
                r#"{"rules":[{"name":"r","match":{"methods":[]},"limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].match.methods: must not be empty",
            ),
            (
                r#"{"rules":[{"name":"r","match":{"method":["GET"]},"limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].match.method: unknown field `method`",
            ),
            (
                r#"{"rules":[{"name":"r","missing_key":"maybe","limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].missing_key: unknown variant `maybe`",
            ),
            (
                r#"{"rules":[{"name":"r","max_keys":2000000,"limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].max_keys: 2000000 is more than the maximum",
            ),
            (
                r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1s"}}],"response":{"status":99}}"#,
                "response.status: 99 is not an HTTP status",
            ),
            (
                r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1s"}}],"rate_limit_headers":"ietf"}"#,
                "rate_limit_headers: unknown variant `ietf`",
            ),
            (
                r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1s"}}],"client_ip":{"trusted_hops":-1}}"#,
                "client_ip.trusted_hops: invalid value: integer `-1`",
            ),
            (
                r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1s"}}],"dry_run":"yes"}"#,
                "dry_run: invalid type: string",
            ),
            (
                r#"{"rules":[{"name":"r","algorithm":"fixed_window","burst":5,"limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].burst: does not apply to window algorithms",
            ),
            (
                r#"{"rules":[{"name":"r","delay":2,"limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].delay: only applies to algorithm \"leaky_bucket\"",
            ),
            (
                r#"{"rules":[{"name":"r","algorithm":"leaky_bucket","delay":"later","limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].delay: invalid delay \"later\"",
            ),
            (
                r#"{"rules":[{"name":"r","algorithm":"leaky_bucket","max_delay":"1x","limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].max_delay: invalid duration \"1x\"",
            ),
            (
                r#"{"rules":[{"name":"r","warmup":"10s","burst":3,"limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].burst: cannot be combined with warmup",
            ),
            (
                r#"{"rules":[{"name":"r","algorithm":"concurrency","limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].limit: a concurrency limit is",
            ),
            (
                r#"{"rules":[{"name":"r","algorithm":"concurrency","limit":{}}]}"#,
                "rules[0].limit.concurrent: required",
            ),
            (
                r#"{"rules":[{"name":"r","limit":{"concurrent":3}}]}"#,
                "rules[0].limit.concurrent: only applies to algorithm \"concurrency\"",
            ),
            (
                r#"{"rules":[{"name":"r","limit":{"per":"1s"}}]}"#,
                "rules[0].limit.requests: required",
            ),
            (
                r#"{"rules":[{"name":"r","cost":{"header":"x-cost"},"limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].cost: data did not match any variant",
            ),
            (
                r#"{"rules":[{"name":"r","algorithm":"leaky_bucket","cost":2,"limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].cost: leaky_bucket requests cost 1",
            ),
            (
                r#"{"rules":[{"name":"r","key":["client_ip"],"overrides":[{"values":["a","b"],"unlimited":true}],"limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].overrides[0].values: gives 2 value(s) for a key of 1 part(s)",
            ),
            (
                r#"{"rules":[{"name":"r","key":["client_ip"],"overrides":[{"values":["nope"],"block":true}],"limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].overrides[0].values[0]: \"nope\" is not an IP address",
            ),
            (
                r#"{"rules":[{"name":"r","key":["client_ip"],"overrides":[{"values":["::1"],"block":true,"unlimited":true}],"limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].overrides[0]: give exactly one of",
            ),
            (
                r#"{"rules":[{"name":"r","key":["client_ip"],"overrides":[{"values":["::1"],"block":true},{"values":["0::1"],"unlimited":true}],"limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].overrides[1].values: another override has the same values",
            ),
            (
                r#"{"rules":[{"name":"r","key":["client_ip"],"overrides":[{"values":["::1"],"limit":{"requests":0,"per":"1s"}}],"limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].overrides[0].limit.requests: invalid value: integer `0`",
            ),
            (
                r#"{"rules":[{"name":"r","scope":"global","limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].scope: \"global\" needs a top-level quota_service",
            ),
            (
                r#"{"rules":[{"name":"r","scope":"global","algorithm":"fixed_window","limit":{"requests":1,"per":"1s"}}],"quota_service":{"upstream":"q"}}"#,
                "rules[0].scope: \"global\" rules use the token_bucket algorithm",
            ),
            (
                r#"{"rules":[{"name":"r","scope":"everywhere","limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].scope: unknown variant `everywhere`",
            ),
            (
                r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1s"}}],"quota_service":{"upstream":"q","failure_mode":"panic"}}"#,
                "quota_service.failure_mode: unknown variant `panic`",
            ),
            (
                r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1s"}}],"quota_service":{"upstream":"q","timeout":"soon"}}"#,
                "quota_service.timeout: invalid duration \"soon\"",
            ),
            (
                r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"1s"}}],"quota_service":{"upstream":""}}"#,
                "quota_service.upstream: must not be empty",
            ),
            (
                r#"{"rules":[{"name":"r","response":{"status":42},"limit":{"requests":1,"per":"1s"}}]}"#,
                "rules[0].response.status: 42 is not an HTTP status",
            ),
        ];
        for (input, want) in cases {
            let got = parse(input).expect_err(input);
            assert!(
                got.starts_with(want),
                "for {input}\n got: {got}\nwant: {want}…"
            );
        }
    }
}

/// JSON Schema of the forms the configuration's custom-parsed strings take.
#[cfg(not(target_arch = "wasm32"))]
mod schema {
    use super::{Delay, KeyPart, Period, RuleName};
    use schemars::{json_schema, JsonSchema, Schema, SchemaGenerator};
    use std::borrow::Cow;

    impl JsonSchema for RuleName {
        fn schema_name() -> Cow<'static, str> {
            "RuleName".into()
        }
        fn json_schema(_: &mut SchemaGenerator) -> Schema {
            json_schema!({
                "type": "string",
                "pattern": "^[a-z0-9_-]{1,64}$",
                "description": "Unique rule name: names metrics and the x-tollgate-rule header."
            })
        }
    }

    impl JsonSchema for Period {
        fn schema_name() -> Cow<'static, str> {
            "Duration".into()
        }
        fn json_schema(_: &mut SchemaGenerator) -> Schema {
            json_schema!({
                "type": "string",
                "pattern": "^[0-9]+(ms|s|m|h|d)$",
                "description": "A positive whole number and a unit (ms, s, m, h, d), at most 366d: \"250ms\", \"1m\".",
                "examples": ["250ms", "1s", "1m", "1h", "1d"]
            })
        }
    }

    impl JsonSchema for KeyPart {
        fn schema_name() -> Cow<'static, str> {
            "KeyPart".into()
        }
        fn json_schema(_: &mut SchemaGenerator) -> Schema {
            json_schema!({
                "type": "string",
                "pattern": "^(client_ip|path|method|host|header:.+|query:.+)$",
                "description": "A part of the bucket key: client_ip, path, method, host, header:NAME or query:NAME."
            })
        }
    }

    impl JsonSchema for Delay {
        fn schema_name() -> Cow<'static, str> {
            "Delay".into()
        }
        fn json_schema(_: &mut SchemaGenerator) -> Schema {
            json_schema!({
                "description": "Leaky bucket: excess requests passed on undelayed (nginx delay=N), or \"nodelay\".",
                "oneOf": [
                    {"type": "integer", "minimum": 0},
                    {"const": "nodelay"}
                ]
            })
        }
    }
}
