//! Global rules: the quota service's settings, and a rule made global or a global concurrency rule.

use crate::config::json::{Algorithm, QuotaMode, RawQuotaService, RawRule, Scope};
use crate::config::model::{
    Calendar, FailureMode, FirstLease, GlobalRule, Quota, QuotaService, Rule, RuleKind,
    MAX_INSTANCES_HINT,
};
use crate::config::period::Per;
use crate::config::{err, ConfigError};
use std::num::NonZeroU64;
use tollgate_core::calendar::is_time_zone;
use tollgate_core::global::lease::{rate_mtps, MAX_COUNT, MAX_PER_MS};
use tollgate_core::{Concurrency, LeaseAllowance, Limit, PermitAllowance, TokenBucket};

/// A claimed refill is given up this long after its call's timeout.
const CLAIM_GRACE_MS: u64 = 100;
/// `quota_service.retry` by default: a key whose call failed asks again after a quarter of it,
/// then after all of it, so that a service back after a restart serves again well within a
/// second.
pub const DEFAULT_RETRY_MS: u64 = 500;

impl RawQuotaService {
    /// The service settings, and the lease size if one was given.
    pub(super) fn validate(self, path: &str) -> Result<(QuotaService, Option<u64>), ConfigError> {
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
            _ => tollgate_core::key_name::key_secret(
                self.key_secret.as_deref(),
                self.token.as_deref(),
            ),
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
            retry_ms: self.retry.map_or(DEFAULT_RETRY_MS, |p| p.ms()),
            strict: self.mode == QuotaMode::Strict,
        };
        let lease_size = self.lease_size.map(NonZeroU64::get);
        if lease_size.is_some_and(|n| n > MAX_COUNT) {
            // The service refuses any item asking for more: every call would fail.
            return Err(err(
                format!("{path}.lease_size"),
                format!(
                    "must be from 1 to {MAX_COUNT} (the most the quota service grants at once)"
                ),
            ));
        }
        Ok((service, lease_size))
    }
}

/// A calendar quota's period, if the rule's limit counts per calendar period: only a global
/// token bucket of requests (no warmup) may.
pub(super) fn calendar_of(raw: &RawRule, path: &str) -> Result<Option<Calendar>, ConfigError> {
    let Some(limit) = &raw.limit else {
        return Ok(None);
    };
    let Some(calendar) = &limit.calendar else {
        return Ok(None);
    };
    let field = format!("{path}.limit.calendar");
    if raw.scope != Scope::Global {
        return Err(err(
            field,
            "a calendar quota is counted by the quota service: the rule needs \"scope\": \
             \"global\"",
        ));
    }
    let requests = limit.requests.map(std::num::NonZeroU64::get);
    if raw.algorithm != Algorithm::TokenBucket
        || raw.warmup.is_some()
        || limit.bytes.is_some()
        || requests.is_none()
        || raw.limit_from.is_some()
    {
        return Err(err(
            field,
            "a calendar quota is requests per period — {\"requests\": N, \"per\": \"month\", \
             \"calendar\": {…}} — of algorithm \"token_bucket\" without warmup or limit_from",
        ));
    }
    let Some(Per::Calendar(unit)) = limit.per else {
        return Err(err(field, "needs per \"day\", \"week\" or \"month\""));
    };
    let time_zone = calendar.time_zone.clone().unwrap_or_else(|| "UTC".into());
    if !is_time_zone(&time_zone) {
        return Err(err(
            format!("{field}.time_zone"),
            format!(
                "{time_zone:?} is not an IANA time zone name (\"Europe/Berlin\", \
                 \"America/New_York\", \"UTC\", spelt exactly)"
            ),
        ));
    }
    if raw.burst.is_some() && raw.burst != requests {
        return Err(err(
            format!("{path}.burst"),
            "a calendar quota's bucket holds its requests for the period: leave burst out",
        ));
    }
    Ok(Some(Calendar { unit, time_zone }))
}

impl Rule {
    /// Turn a validated local token-bucket rule into a global one (`calendar`: counting per
    /// calendar period).
    pub(super) fn make_global(
        &mut self,
        path: &str,
        qs: &QuotaService,
        lease_size: Option<u64>,
        calendar: Option<Calendar>,
    ) -> Result<(), ConfigError> {
        let Some(local) = self.quota().map(|q| q.limit) else {
            return Err(err(
                format!("{path}.scope"),
                "overload rules are never global",
            ));
        };
        if let Limit::Concurrency(c) = local {
            return self.make_global_concurrency(path, qs, c.limit());
        }
        let Limit::TokenBucket(tb) = local else {
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
        if self.settle.is_some() && qs.strict {
            return Err(err(
                format!("{path}.settle"),
                "not supported with quota_service.mode \"strict\" yet (lease mode settles)",
            ));
        }
        if tb.period_ns() % 1_000_000 != 0 {
            return Err(err(
                format!("{path}.limit.per"),
                "global limits need whole milliseconds",
            ));
        }
        let (requests, per_ms, burst) = (tb.requests(), tb.period_ns() / 1_000_000, tb.burst());
        if calendar.is_some() {
            no_stand_in(qs, path)?;
        }
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
        let lease = lease_allowance(qs, lease_size, tb, calendar.is_some());
        let share = |n: u64| (n / qs.instances_hint).max(1);
        let fallback_limit = TokenBucket::new(share(requests), tb.period_ns(), share(burst))
            .map(Limit::TokenBucket)
            .ok_or_else(|| err(format!("{path}.limit"), "must be positive"))?;
        let limit = match &calendar {
            Some(c) => format!("{requests}/{}@{}", c.unit.as_str(), c.time_zone),
            None => format!("{requests}/{per_ms}/{burst}"),
        };
        self.go_global(
            (requests, per_ms, burst),
            &limit,
            fallback_limit,
            (Limit::Lease(lease), "lease"),
        );
        if let RuleKind::Global(_, global) = &mut self.kind {
            global.calendar = calendar;
        }
        Ok(())
    }

    /// Make the rule global: what it sends the service, its stand-in and its leased quota
    /// (`leased`, and the suffix naming its slots). `limit` (in the fingerprint) tells limits
    /// apart: different configurations never share global state.
    pub(super) fn go_global(
        &mut self,
        (requests, per_ms, burst): (u64, u64, u64),
        limit: &str,
        stand_in: Limit,
        (leased, suffix): (Limit, &str),
    ) {
        let RuleKind::Local(local) = &self.kind else {
            return;
        };
        let max_keys = u32::try_from(local.table.capacity()).unwrap_or(u32::MAX);
        let fingerprint =
            tollgate_core::slot::fingerprint(format!("{}/{limit}", self.name).as_bytes());
        let global = GlobalRule {
            requests,
            per_ms,
            burst,
            limit_id: format!("{fingerprint:016x}"),
            calendar: None,
            fallback: Quota::new(stand_in, &format!("{}.local", self.name), max_keys),
        };
        let mut quota = Quota::new(leased, &format!("{}.{suffix}", self.name), max_keys);
        quota.policy = local.policy;
        self.kind = RuleKind::Global(quota, Box::new(global));
    }

    /// Turn a validated local concurrency rule into a global one: slots leased from the service.
    pub(super) fn make_global_concurrency(
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
        let slots = PermitAllowance {
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
            (Limit::PermitLease(slots), "slots"),
        );
        Ok(())
    }
}

/// A calendar quota's failure mode and first lease: nothing local can count a calendar period (a
/// stand-in would start each proxy's own quota afresh).
fn no_stand_in(qs: &QuotaService, path: &str) -> Result<(), ConfigError> {
    let stand_in = if qs.failure_mode == FailureMode::Local {
        Some("quota_service.failure_mode \"local\"")
    } else if qs.first_lease == FirstLease::Provisional {
        Some("quota_service.first_lease \"provisional\"")
    } else {
        None
    };
    if let Some(setting) = stand_in {
        return Err(err(
            format!("{path}.limit.calendar"),
            format!(
                "a calendar quota has no local stand-in: {setting} would count each proxy's \
                 own period; use failure_mode \"allow\" or \"deny\" and first_lease \"wait\""
            ),
        ));
    }
    Ok(())
}

/// A global token bucket's leased allowance in a proxy (`calendar`: a calendar quota's, which
/// leases no rate).
fn lease_allowance(
    qs: &QuotaService,
    lease_size: Option<u64>,
    tb: TokenBucket,
    calendar: bool,
) -> LeaseAllowance {
    let (requests, per_ms, burst) = (tb.requests(), tb.period_ns() / 1_000_000, tb.burst());
    // A refill covers a slice of the burst each proxy may hold: small enough to share, large
    // enough that calls stay rare. A calendar quota's a smaller one: a proxy holds it until
    // the period ends (none else may spend it; a restart loses it).
    let slices = if calendar { 32 } else { 4 };
    let lease_size =
        lease_size.unwrap_or_else(|| (burst / (slices * qs.instances_hint)).clamp(1, 1_000));
    LeaseAllowance {
        lease_size,
        low_water: lease_size.div_ceil(2),
        // Past the call's timeout, so that its answer or failure always comes first.
        claim_ms: qs.timeout_ms + CLAIM_GRACE_MS,
        global_burst: burst,
        global_interval_ns: tb.period_ns() / requests,
        // A calendar quota leases no rate: nothing refills it within its period.
        global_rate_mtps: if calendar {
            0
        } else {
            rate_mtps(requests, per_ms)
        },
        calendar,
    }
}
