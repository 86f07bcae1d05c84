//! Validation: the JSON shape into the model, with errors that name the field and the reason.

mod overload;

use super::json::{
    Algorithm, Delay, QuotaMode, RawClientIp, RawConfig, RawCost, RawLimit, RawMatch,
    RawQuotaService, RawResponse, RawRule, Scope,
};
use super::model::{
    Config, Cost, FirstLease, GlobalRule, KeyPart, Match, Override, OverrideAction, PathMatch,
    Quota, QuotaService, Response, Rule, DEFAULT_MAX_DELAY_NS, DEFAULT_MAX_KEYS,
    DEFAULT_WORKER_BATCH, MAX_INSTANCES_HINT, MAX_MAX_KEYS, MAX_WORKER_BATCH,
};
use super::syntax::is_token;
use super::{err, ConfigError};
use crate::network::{ClientIp, Network};
use std::collections::HashSet;
use std::num::{NonZeroU32, NonZeroU64};
use tollgate_core::lease::{rate_mtps, MAX_COUNT, MAX_PER_MS};
use tollgate_core::slot::KeyPlacement;
use tollgate_core::{
    Concurrency, FixedWindow, LeakyBucket, LeaseAllowance, Limit, SlidingWindow, SlotAllowance,
    TokenBucket, WarmUp,
};

/// A claimed refill is given up this long after its call's timeout.
const CLAIM_GRACE_MS: u64 = 100;

impl RawConfig {
    pub(super) fn validate(self) -> Result<Config, ConfigError> {
        if self.rules.is_empty() {
            return Err(err("rules", "at least one rule is required"));
        }
        let quota_service = self
            .quota_service
            .map(|q| q.validate("quota_service"))
            .transpose()?;
        let client_ip = self.client_ip.validate("client_ip")?;
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
            let mut rule = raw.validate(&path, self.dry_run, &client_ip)?;
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
        let priorities = overload::priorities(self.priorities)?;
        let placement = match self.placement_secret {
            Some(secret) if secret.len() < 16 => {
                return Err(err("placement_secret", "must be at least 16 bytes"));
            }
            Some(secret) => Some(KeyPlacement::from_secret(secret.as_bytes())),
            None => None,
        };
        Ok(Config {
            placement,
            priorities,
            rules,
            response,
            rate_limit_headers: self.rate_limit_headers,
            client_ip,
            quota_service: quota_service.map(|(q, _)| q),
            log_level: self.log_level,
        })
    }
}

impl RawRule {
    fn validate(
        self,
        path: &str,
        dry_run_all: bool,
        client_ip: &ClientIp,
    ) -> Result<Rule, ConfigError> {
        if matches!(self.algorithm, Algorithm::Adaptive | Algorithm::SreThrottle) {
            return self.validate_guard(path, dry_run_all);
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
        only(
            self.adaptive.is_some(),
            "adaptive",
            "algorithm \"adaptive\"",
        )?;
        only(
            self.sre_throttle.is_some(),
            "sre_throttle",
            "algorithm \"sre_throttle\"",
        )?;
        let Some(raw_limit) = &self.limit else {
            return Err(err(
                format!("{path}.limit"),
                "required: {\"requests\": N, \"per\": DURATION}, or {\"concurrent\": N}",
            ));
        };
        let matcher = self.matcher.validate(&format!("{path}.match"))?;
        let max_keys = self.max_keys.map_or(DEFAULT_MAX_KEYS, NonZeroU32::get);
        if max_keys > MAX_MAX_KEYS {
            return Err(err(
                format!("{path}.max_keys"),
                format!("{max_keys} is more than the maximum of {MAX_MAX_KEYS}"),
            ));
        }
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
            // A global rule's allowance is this proxy's part of the limit: a token stashed by one
            // worker would be missing to another's request at the end of a burst, and the service
            // would say there is no more (a refusal with budget left).
            None if self.scope == Scope::Global => 0,
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
        let limit = params.limit(raw_limit, self.burst, path)?;
        let quota = Quota::new(limit, &name, max_keys);
        check_key(&self.key, path)?;
        let cost = match self.cost {
            None => Cost::Fixed(1),
            Some(RawCost::Fixed(n)) => Cost::Fixed(n),
            Some(RawCost::Header(h)) => {
                if !is_token(&h.header) {
                    return Err(err(
                        format!("{path}.cost.header"),
                        format!("{:?} is not a header name", h.header),
                    ));
                }
                let max = h.max.get();
                if h.min > max {
                    return Err(err(
                        format!("{path}.cost.min"),
                        format!("{} is more than max ({max})", h.min),
                    ));
                }
                if !(h.min..=max).contains(&h.default) {
                    return Err(err(
                        format!("{path}.cost.default"),
                        format!("{} is not within min..=max ({}..={max})", h.default, h.min),
                    ));
                }
                Cost::Header {
                    name: h.header.to_ascii_lowercase(),
                    default: h.default,
                    min: h.min,
                    max,
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
            let mut networks = Vec::new();
            for (k, (v, part)) in o.values.iter().zip(&self.key).enumerate() {
                values.push(match part {
                    KeyPart::ClientIp => {
                        let at = format!("{at}.values[{k}]");
                        let network = client_network(v, client_ip, &at)?;
                        let keyed = if network.is_ipv4() {
                            client_ip.ipv4_prefix
                        } else {
                            client_ip.ipv6_prefix
                        };
                        // A range of exactly the keys' length is one key: matched as bytes.
                        if network.prefix() < keyed {
                            networks.push((k, network));
                        }
                        network.text()
                    }
                    KeyPart::Host => v.to_ascii_lowercase(),
                    _ => v.clone(),
                });
            }
            let key = crate::key::encode_key(values.iter().map(|v| Some(v.as_bytes())));
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
            overrides.push(Override {
                key,
                networks,
                action,
            });
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
            worker_batch_by_default: self.worker_batch.is_none() && worker_batch > 0,
            guard: None,
        })
    }

    /// An adaptive or sre_throttle rule.
    fn validate_guard(self, path: &str, dry_run_all: bool) -> Result<Rule, ConfigError> {
        let guard = self.guard(path, self.algorithm == Algorithm::Adaptive)?;
        let matcher = self.matcher.validate(&format!("{path}.match"))?;
        check_key(&self.key, path)?;
        // Overload is not the client's doing: 503 unless the rule says otherwise.
        let response = self
            .response
            .unwrap_or_else(|| RawResponse {
                status: 503,
                body: "overloaded\n".into(),
                ..RawResponse::default()
            })
            .validate(&format!("{path}.response"))?;
        let response = Some(response);
        let name = self.name.0;
        // Never used: the rule keeps windows, not slots.
        let unused = Concurrency::new(1).map(Limit::Concurrency);
        let quota = Quota::new(unused.ok_or_else(|| err(path, "internal"))?, &name, 1);
        Ok(Rule {
            name,
            matcher,
            key: self.key,
            missing_key: self.missing_key,
            quota,
            cost: Cost::Fixed(1),
            overrides: Vec::new(),
            response,
            dry_run: self.dry_run || dry_run_all,
            global: None,
            worker_batch: 0,
            worker_batch_by_default: false,
            guard: Some(guard),
        })
    }
}

fn check_key(key: &[KeyPart], path: &str) -> Result<(), ConfigError> {
    let mut seen = HashSet::new();
    for (j, part) in key.iter().enumerate() {
        if !seen.insert(part) {
            return Err(err(format!("{path}.key[{j}]"), "repeated key part"));
        }
    }
    Ok(())
}

impl RawQuotaService {
    /// The service settings, and the lease size if one was given.
    fn validate(self, path: &str) -> Result<(QuotaService, Option<u64>), ConfigError> {
        if self.upstream.is_empty() {
            return Err(err(format!("{path}.upstream"), "must not be empty"));
        }
        if let Some(n) = self.instances_hint.filter(|n| n.get() > MAX_INSTANCES_HINT) {
            return Err(err(
                format!("{path}.instances_hint"),
                format!("{n} is more than the maximum of {MAX_INSTANCES_HINT}"),
            ));
        }
        let key_secret = match &self.key_secret {
            Some(secret) if secret.len() < 16 => {
                return Err(err(
                    format!("{path}.key_secret"),
                    "must be at least 16 bytes (the same on every proxy)",
                ));
            }
            Some(secret) => Some(tollgate_core::slot::key_hash(secret.as_bytes()).to_le_bytes()),
            // Every proxy of a deployment holds the token: a secret they all share, which no
            // client knows.
            None => self.token.as_ref().map(|token| {
                let mut bytes = b"tollgate key names\0".to_vec();
                bytes.extend_from_slice(token.as_bytes());
                tollgate_core::slot::key_hash(&bytes).to_le_bytes()
            }),
        };
        let service = QuotaService {
            key_secret,
            authority: self.authority.unwrap_or_else(|| self.upstream.clone()),
            upstream: self.upstream,
            timeout_ms: self.timeout.map_or(200, |p| p.ms()),
            token: self.token,
            failure_mode: self.failure_mode,
            instances_hint: self.instances_hint.map_or(1, NonZeroU64::get),
            first_lease: self.first_lease,
            retry_ms: self.retry.map_or(1_000, |p| p.ms()),
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
        if let Limit::Concurrency(c) = self.quota.limit {
            return self.make_global_concurrency(path, qs, c.limit());
        }
        let Limit::TokenBucket(tb) = self.quota.limit else {
            return Err(err(
                format!("{path}.scope"),
                "\"global\" rules use the token_bucket algorithm (without warmup) or concurrency",
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
        if requests > MAX_COUNT || burst > MAX_COUNT {
            return Err(err(
                format!("{path}.limit"),
                format!("global limits take at most {MAX_COUNT} requests and burst"),
            ));
        }
        if per_ms > MAX_PER_MS {
            return Err(err(
                format!("{path}.limit.per"),
                "global limits take periods of at most 366 days",
            ));
        }
        // A refill covers a slice of the burst each proxy may hold: small enough to share, large
        // enough that calls stay rare.
        let lease_size =
            lease_size.unwrap_or_else(|| (burst / (4 * qs.instances_hint)).clamp(1, 1_000));
        let lease = LeaseAllowance {
            lease_size,
            low_water: lease_size.div_ceil(2),
            // Past the call's timeout, so that its answer or failure always comes first.
            claim_ms: qs.timeout_ms + CLAIM_GRACE_MS,
            global_burst: burst,
            global_interval_ns: tb.period_ns() / requests,
            global_rate_mtps: rate_mtps(requests, per_ms),
        };
        let share = |n: u64| (n / qs.instances_hint).max(1);
        let fallback_limit = TokenBucket::new(share(requests), tb.period_ns(), share(burst))
            .map(Limit::TokenBucket)
            .ok_or_else(|| err(format!("{path}.limit"), "must be positive"))?;
        self.go_global(
            (requests, per_ms, burst),
            &format!("{requests}/{per_ms}/{burst}"),
            fallback_limit,
            (Limit::Lease(lease), "lease"),
        );
        Ok(())
    }

    /// Make the rule global: what it sends the service, its stand-in and its leased quota
    /// (`leased`, and the suffix naming its slots). `limit` (in the fingerprint) tells limits
    /// apart: different configurations never share global state.
    fn go_global(
        &mut self,
        (requests, per_ms, burst): (u64, u64, u64),
        limit: &str,
        stand_in: Limit,
        (leased, suffix): (Limit, &str),
    ) {
        let max_keys = u32::try_from(self.quota.table.capacity()).unwrap_or(u32::MAX);
        let fingerprint =
            tollgate_core::slot::fingerprint(format!("{}/{limit}", self.name).as_bytes());
        self.global = Some(GlobalRule {
            requests,
            per_ms,
            burst,
            limit_id: format!("{fingerprint:016x}"),
            fallback: Quota::new(stand_in, &format!("{}.local", self.name), max_keys),
        });
        let mut quota = Quota::new(leased, &format!("{}.{suffix}", self.name), max_keys);
        quota.policy = self.quota.policy;
        self.quota = quota;
    }

    /// Turn a validated local concurrency rule into a global one: slots leased from the service.
    fn make_global_concurrency(
        &mut self,
        path: &str,
        qs: &QuotaService,
        concurrent: u64,
    ) -> Result<(), ConfigError> {
        if !self.overrides.is_empty() {
            return Err(err(
                format!("{path}.overrides"),
                "not supported on global rules yet",
            ));
        }
        if qs.strict {
            return Err(err(
                format!("{path}.scope"),
                "global concurrency rules lease slots: quota_service.mode \"strict\" is for \
                 token buckets",
            ));
        }
        if concurrent > MAX_COUNT {
            return Err(err(
                format!("{path}.limit.concurrent"),
                format!("global limits take at most {MAX_COUNT}"),
            ));
        }
        let slots = SlotAllowance {
            concurrent,
            headroom: (concurrent / (4 * qs.instances_hint)).max(1),
            // Past the call's timeout, so that its answer or failure always comes first.
            claim_ms: qs.timeout_ms + CLAIM_GRACE_MS,
            denied_ms: 1_000,
            retry_ms: qs.retry_ms,
            // With a provisional first lease the stand-in would admit a waiting request.
            waits_for_more: qs.first_lease == FirstLease::Wait,
        };
        let stand_in = Concurrency::new((concurrent / qs.instances_hint).max(1))
            .map(Limit::Concurrency)
            .ok_or_else(|| err(format!("{path}.limit"), "must be positive"))?;
        self.go_global(
            (concurrent, 0, concurrent),
            &format!("concurrent/{concurrent}"),
            stand_in,
            (Limit::SlotLease(slots), "slots"),
        );
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
            // Overload rules have no limit (refused before this).
            Algorithm::Concurrency | Algorithm::Adaptive | Algorithm::SreThrottle => {
                Err(positive())
            }
        }
    }
}

impl RawMatch {
    pub(super) fn validate(self, path: &str) -> Result<Match, ConfigError> {
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
            if !is_token(&name) {
                return Err(err(
                    header_path(&format!("{path}.headers"), &name),
                    "not a header name (letters, digits and !#$%&'*+-.^_`|~ only)",
                ));
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
            let field = header_path(&format!("{path}.headers"), &name);
            let lower = name.to_ascii_lowercase();
            if lower.starts_with(':') || lower == "content-length" {
                return Err(err(field, "this header cannot be set"));
            }
            if !is_token(&name) {
                return Err(err(
                    field,
                    "not a header name (letters, digits and !#$%&'*+-.^_`|~ only)",
                ));
            }
            if let Some(c) = value
                .chars()
                .find(|&c| (c.is_ascii_control() && c != '\t') || c == '\u{7f}')
            {
                return Err(err(
                    field,
                    format!("the value contains {c:?}: a header value cannot hold control characters (CR, LF, NUL …)"),
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

/// A header's place in the configuration: `PATH.NAME`, or `PATH["NAME"]` when the name is not one.
fn header_path(path: &str, name: &str) -> String {
    if is_token(name) {
        format!("{path}.{name}")
    } else {
        format!("{path}[{name:?}]")
    }
}

/// An override's `client_ip` value: an address (its network under the keys' prefix length, as
/// clients are keyed) or a CIDR range at least as wide as the keys' networks.
fn client_network(value: &str, client_ip: &ClientIp, at: &str) -> Result<Network, ConfigError> {
    let network = Network::parse(value).ok_or_else(|| {
        err(
            at,
            format!("{value:?} is not an IP address or a CIDR range (10.0.0.0/8, 2001:db8::/32)"),
        )
    })?;
    let (keyed, field) = if network.is_ipv4() {
        (client_ip.ipv4_prefix, "ipv4_prefix")
    } else {
        (client_ip.ipv6_prefix, "ipv6_prefix")
    };
    if !value.contains('/') {
        return Ok(network.widen(keyed));
    }
    if network.prefix() > keyed {
        return Err(err(
            at,
            format!(
                "{value:?} is narrower than the networks clients are keyed by \
                 (client_ip.{field} {keyed}): it would never match"
            ),
        ));
    }
    Ok(network)
}

impl RawClientIp {
    fn validate(self, path: &str) -> Result<ClientIp, ConfigError> {
        let ipv4_prefix = self.ipv4_prefix.unwrap_or(32);
        let ipv6_prefix = self.ipv6_prefix.unwrap_or(64);
        if !(1..=32).contains(&ipv4_prefix) {
            return Err(err(format!("{path}.ipv4_prefix"), "must be 1 to 32"));
        }
        if !(1..=128).contains(&ipv6_prefix) {
            return Err(err(format!("{path}.ipv6_prefix"), "must be 1 to 128"));
        }
        Ok(ClientIp {
            trusted_hops: self.trusted_hops,
            ipv4_prefix,
            ipv6_prefix,
        })
    }
}
