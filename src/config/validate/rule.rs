//! A rule: its fields checked and turned into the model (its limit and key; `cost.rs` its
//! costs, `overrides.rs` its overrides).

use super::cost::{cost_from, limit_from_of, settle_of};
use super::limit::LimitParams;
use super::overrides::overrides_of;
use crate::config::json::{Algorithm, RawCost, RawResponse, RawRule, Scope};
use crate::config::model::{
    Cost, KeyPart, Pace, PaceBody, Quota, Rule, RuleKind, DEFAULT_MAX_DELAY_NS, DEFAULT_MAX_KEYS,
    DEFAULT_WORKER_BATCH, MAX_MAX_KEYS, MAX_WORKER_BATCH,
};
use crate::config::{err, ConfigError};
use crate::network::ClientIp;
use std::collections::HashSet;
use std::num::NonZeroU32;

impl RawRule {
    pub(super) fn validate(
        mut self,
        path: &str,
        dry_run_all: bool,
        client_ip: &ClientIp,
    ) -> Result<Rule, ConfigError> {
        if matches!(self.algorithm, Algorithm::Adaptive | Algorithm::SreThrottle) {
            return self.validate_guard(path, dry_run_all);
        }
        only(
            self.adaptive.is_some(),
            path,
            "adaptive",
            "algorithm \"adaptive\"",
        )?;
        only(
            self.sre_throttle.is_some(),
            path,
            "sre_throttle",
            "algorithm \"sre_throttle\"",
        )?;
        let Some(raw_limit) = self.limit.take() else {
            return Err(err(
                format!("{path}.limit"),
                "required: {\"requests\": N, \"per\": DURATION}, or {\"concurrent\": N}",
            ));
        };
        let matcher = std::mem::take(&mut self.matcher).validate(&format!("{path}.match"))?;
        let max_keys = self.max_keys_of(path)?;
        self.check_algorithm_options(path)?;
        let worker_batch = self.worker_batch_of(raw_limit.bytes.is_some(), path)?;
        let algorithm = self.algorithm;
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
        let name = std::mem::take(&mut self.name.0);
        let limit = params.limit(&raw_limit, self.burst, path)?;
        let pace = self.pace_of(raw_limit.bytes.is_some(), path)?;
        let quota = Quota::new(limit, &name, max_keys);
        check_key(&self.key, path)?;
        let cost = match self.cost.take() {
            None => Cost::Fixed(1),
            Some(RawCost::Fixed(n)) => Cost::Fixed(n),
            Some(RawCost::From(c)) => cost_from(c, &format!("{path}.cost"))?,
        };
        let limit_from = self
            .limit_from
            .map(|raw| limit_from_of(raw, &limit, self.scope, path))
            .transpose()?;
        let settle = self
            .settle
            .map(|raw| settle_of(raw, &limit, path))
            .transpose()?;
        if algorithm == Algorithm::LeakyBucket && !matches!(cost, Cost::Fixed(1)) {
            // A held request's delay is decided for the whole cost at once; keep nginx's model.
            return Err(err(format!("{path}.cost"), "leaky_bucket requests cost 1"));
        }

        let overrides = overrides_of(self.overrides, &self.key, client_ip, &params, &name, path)?;
        let response = self
            .response
            .map(|r| r.validate(&format!("{path}.response")))
            .transpose()?;
        Ok(Rule {
            name,
            matcher,
            key: self.key,
            missing_key: self.missing_key,
            unreadable_body: self.unreadable_body,
            kind: match pace {
                Some(p) => RuleKind::Bytes(quota, p),
                None => RuleKind::Local(quota),
            },
            cost,
            overrides,
            response,
            dry_run: self.dry_run || dry_run_all,
            worker_batch,
            worker_batch_by_default: self.worker_batch.is_none() && worker_batch > 0,
            settle,
            limit_from,
        })
    }

    /// An adaptive or sre_throttle rule.
    pub(super) fn validate_guard(self, path: &str, dry_run_all: bool) -> Result<Rule, ConfigError> {
        for (given, field) in [
            (self.settle.is_some(), "settle"),
            (self.limit_from.is_some(), "limit_from"),
        ] {
            if given {
                return Err(err(
                    format!("{path}.{field}"),
                    "only applies to token_bucket rules, not to overload rules",
                ));
            }
        }
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
        Ok(Rule {
            name,
            matcher,
            key: self.key,
            missing_key: self.missing_key,
            unreadable_body: self.unreadable_body,
            kind: RuleKind::Overload(Box::new(guard)),
            cost: Cost::Fixed(1),
            overrides: Vec::new(),
            response,
            dry_run: self.dry_run || dry_run_all,
            worker_batch: 0,
            worker_batch_by_default: false,
            settle: None,
            limit_from: None,
        })
    }
}

pub(super) fn check_key(key: &[KeyPart], path: &str) -> Result<(), ConfigError> {
    let mut seen = HashSet::new();
    for (j, part) in key.iter().enumerate() {
        if !seen.insert(part) {
            return Err(err(format!("{path}.key[{j}]"), "repeated key part"));
        }
    }
    Ok(())
}

/// What a byte limit (`limit.bytes`) paces; `pace` and `after` belong to byte limits only, which
/// take none of `refused` (request costs, plans, overrides, stashes; they stay local).
fn pace_of(
    bytes: bool,
    (pace, after): (Option<PaceBody>, Option<u64>),
    refused: [(bool, &str); 6],
    path: &str,
) -> Result<Option<Pace>, ConfigError> {
    if !bytes {
        for (given, field) in [(pace.is_some(), "pace"), (after.is_some(), "after")] {
            if given {
                return Err(err(
                    format!("{path}.{field}"),
                    "only applies to a byte limit (limit.bytes)",
                ));
            }
        }
        return Ok(None);
    }
    if let Some((_, field)) = refused.iter().find(|(given, _)| *given) {
        return Err(err(
            format!("{path}.{field}"),
            "does not apply to a byte limit (limit.bytes), which paces bodies per key in this \
             proxy",
        ));
    }
    Ok(Some(Pace {
        body: pace.unwrap_or_default(),
        after: after.unwrap_or(0),
    }))
}

impl RawRule {
    /// Options given to a rule whose algorithm has no use for them.
    fn check_algorithm_options(&self, path: &str) -> Result<(), ConfigError> {
        let only =
            |given: bool, field: &str, algorithms: &str| only(given, path, field, algorithms);
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
        let own_buckets = self.settle.is_some() || self.limit_from.is_some();
        if own_buckets && self.worker_batch.is_some_and(|n| n > 0) {
            return Err(err(
                format!("{path}.worker_batch"),
                "a rule that settles after the response or takes limits from the request uses \
                 its shared bucket for every request: worker_batch must be 0",
            ));
        }
        Ok(())
    }

    /// A byte limit's pacing, if the rule's limit is of bytes (the options it cannot take
    /// refused).
    fn pace_of(&self, byte_limit: bool, path: &str) -> Result<Option<Pace>, ConfigError> {
        pace_of(
            byte_limit,
            (self.pace, self.after),
            [
                (self.cost.is_some(), "cost"),
                (self.settle.is_some(), "settle"),
                (self.limit_from.is_some(), "limit_from"),
                (!self.overrides.is_empty(), "overrides"),
                (self.worker_batch.is_some_and(|n| n > 0), "worker_batch"),
                (self.scope == Scope::Global, "scope"),
            ],
            path,
        )
    }

    /// Slots in the rule's table.
    fn max_keys_of(&self, path: &str) -> Result<u32, ConfigError> {
        let max_keys = self.max_keys.map_or(DEFAULT_MAX_KEYS, NonZeroU32::get);
        if max_keys > MAX_MAX_KEYS {
            return Err(err(
                format!("{path}.max_keys"),
                format!("{max_keys} is more than the maximum of {MAX_MAX_KEYS}"),
            ));
        }
        Ok(max_keys)
    }

    /// The most tokens a worker stashes per key: given, or by the rule's kind.
    fn worker_batch_of(&self, byte_limit: bool, path: &str) -> Result<u64, ConfigError> {
        let algorithm = self.algorithm;
        let own_buckets = self.settle.is_some() || self.limit_from.is_some();
        Ok(match self.worker_batch {
            // Reservations, settlements and each key's own limit live in the shared bucket.
            None if own_buckets => 0,
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
            // A byte limit charges every chunk to the key's shared bucket.
            None if byte_limit => 0,
            None if algorithm == Algorithm::TokenBucket && self.warmup.is_none() => {
                DEFAULT_WORKER_BATCH
            }
            None => 0,
        })
    }
}

/// `field` was given (`given`) to a rule whose algorithm has no use for it.
fn only(given: bool, path: &str, field: &str, algorithms: &str) -> Result<(), ConfigError> {
    if given {
        Err(err(
            format!("{path}.{field}"),
            format!("only applies to {algorithms}"),
        ))
    } else {
        Ok(())
    }
}
