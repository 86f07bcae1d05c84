//! A rule: its fields checked and turned into the model (its limit, key, overrides, cost).

use super::clients::client_network;
use super::limit::LimitParams;
use super::overload::status_set;
use crate::config::json::{
    Algorithm, RawCost, RawCostFrom, RawResponse, RawRule, RawSettle, RawUsage, Scope, UsageCount,
};
use crate::config::model::{
    Cost, KeyPart, LimitFrom, Override, OverrideAction, Pace, PaceBody, Quota, Rule, RuleKind,
    Settle, SettleFrom, UsageCost, DEFAULT_MAX_DELAY_NS, DEFAULT_MAX_KEYS, DEFAULT_WORKER_BATCH,
    MAX_MAX_KEYS, MAX_WORKER_BATCH,
};
use crate::config::syntax::{body_path, is_token};
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
            kind: RuleKind::Local(quota),
            cost,
            overrides,
            response,
            dry_run: self.dry_run || dry_run_all,
            worker_batch,
            worker_batch_by_default: self.worker_batch.is_none() && worker_batch > 0,
            settle,
            limit_from,
            pace,
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
            pace: None,
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

impl RawSettle {
    fn validate(self, path: &str) -> Result<Settle, ConfigError> {
        const DEFAULT_MAX_BODY_BYTES: u64 = 1 << 20;
        const MOST_BODY_BYTES: u64 = 64 << 20;
        let max_body_bytes = self.max_body_bytes.unwrap_or(DEFAULT_MAX_BODY_BYTES);
        if !(1..=MOST_BODY_BYTES).contains(&max_body_bytes) {
            return Err(err(
                format!("{path}.max_body_bytes"),
                format!("from 1 to {MOST_BODY_BYTES}"),
            ));
        }
        let given = usize::from(self.statuses.is_some())
            + usize::from(self.header.is_some())
            + usize::from(self.body_bytes)
            + usize::from(self.usage.is_some())
            + usize::from(self.body_field.is_some());
        if given != 1 {
            return Err(err(
                path,
                "give exactly one of statuses, header, body_bytes, usage or body_field",
            ));
        }
        let from = if let Some(patterns) = self.statuses {
            if patterns.is_empty() {
                return Err(err(format!("{path}.statuses"), "must not be empty"));
            }
            SettleFrom::Statuses(status_set(&patterns))
        } else if let Some(header) = self.header {
            if !is_token(&header) {
                return Err(err(format!("{path}.header"), "not a header name"));
            }
            SettleFrom::Header(header.to_ascii_lowercase())
        } else if self.body_bytes {
            SettleFrom::BodyBytes
        } else if let Some(field) = self.body_field {
            SettleFrom::BodyField(body_path(&field).ok_or_else(|| {
                err(
                    format!("{path}.body_field"),
                    format!("{field:?} is not a field path (FIELD[.FIELD…])"),
                )
            })?)
        } else {
            let weight = |w: f64, field: &str| {
                if w.is_finite() && (0.0..=1_000_000.0).contains(&w) {
                    Ok((w * 1_000.0).round() as u64)
                } else {
                    Err(err(
                        format!("{path}.usage.{field}"),
                        "a weight from 0 to 1000000",
                    ))
                }
            };
            SettleFrom::Usage(match self.usage {
                Some(RawUsage::Count(UsageCount::Input)) => UsageCost::Weighted {
                    input_milli: 1_000,
                    output_milli: 0,
                },
                Some(RawUsage::Count(UsageCount::Output)) => UsageCost::Weighted {
                    input_milli: 0,
                    output_milli: 1_000,
                },
                Some(RawUsage::Weighted(w)) => UsageCost::Weighted {
                    input_milli: weight(w.input, "input")?,
                    output_milli: weight(w.output, "output")?,
                },
                Some(RawUsage::Count(UsageCount::Total)) | None => UsageCost::Total,
            })
        };
        Ok(Settle {
            from,
            max_body_bytes: usize::try_from(max_body_bytes).unwrap_or(usize::MAX),
        })
    }
}

/// A cost read from the request: a header's number, or fields of its JSON body.
fn cost_from(c: RawCostFrom, path: &str) -> Result<Cost, ConfigError> {
    let max = c.max.get();
    if c.min > max {
        return Err(err(
            format!("{path}.min"),
            format!("{} is more than max ({max})", c.min),
        ));
    }
    let (default, min) = (c.default, c.min);
    let within = |default: u64| {
        if (min..=max).contains(&default) {
            Ok(default)
        } else {
            Err(err(
                format!("{path}.default"),
                format!("{default} is not within min..=max ({min}..={max})"),
            ))
        }
    };
    match (c.header, c.body) {
        (Some(name), None) => {
            if !is_token(&name) {
                return Err(err(
                    format!("{path}.header"),
                    format!("{name:?} is not a header name"),
                ));
            }
            if c.input_bytes_per_token.is_some() {
                return Err(err(
                    format!("{path}.input_bytes_per_token"),
                    "only applies to a cost from the body",
                ));
            }
            Ok(Cost::Header {
                name: name.to_ascii_lowercase(),
                default: within(default.unwrap_or(1))?,
                min,
                max,
            })
        }
        (None, Some(fields)) => {
            if fields.is_empty() {
                return Err(err(
                    format!("{path}.body"),
                    "name at least one field (e.g. \"max_tokens\")",
                ));
            }
            let fields = fields
                .iter()
                .enumerate()
                .map(|(i, f)| {
                    body_path(f).ok_or_else(|| {
                        err(
                            format!("{path}.body[{i}]"),
                            format!("{f:?} is not a field path (FIELD[.FIELD…])"),
                        )
                    })
                })
                .collect::<Result<_, _>>()?;
            Ok(Cost::Body {
                fields,
                input_bytes_per_token: c.input_bytes_per_token.map(std::num::NonZeroU64::get),
                default: within(default.unwrap_or(max))?,
                min,
                max,
            })
        }
        (Some(_), Some(_)) => Err(err(
            path.to_owned(),
            "either \"header\" or \"body\", not both",
        )),
        (None, None) => Err(err(
            path.to_owned(),
            "needs \"header\": NAME or \"body\": [FIELD, …]",
        )),
    }
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

/// Each key's own `limit.requests`, from the request.
fn limit_from_of(
    raw: crate::config::json::RawLimitFrom,
    limit: &tollgate_core::Limit,
    scope: Scope,
    path: &str,
) -> Result<LimitFrom, ConfigError> {
    let at = format!("{path}.limit_from");
    if !matches!(limit, tollgate_core::Limit::TokenBucket(_)) {
        return Err(err(
            at,
            "only token_bucket rules (without warmup) take limits from the request",
        ));
    }
    if scope == Scope::Global {
        return Err(err(at, "not supported on global rules yet"));
    }
    if raw.max == 0 || raw.max > tollgate_core::global::lease::MAX_COUNT {
        return Err(err(
            format!("{at}.max"),
            format!("from 1 to {}", tollgate_core::global::lease::MAX_COUNT),
        ));
    }
    let source = match (raw.header, raw.metadata) {
        (Some(h), None) if is_token(&h) => KeyPart::Header(h.to_ascii_lowercase()),
        (Some(_), None) => {
            return Err(err(format!("{at}.header"), "not a header name"));
        }
        (None, Some(m)) => match crate::config::syntax::metadata_path(&m) {
            Some(p) => KeyPart::Metadata(p),
            None => {
                return Err(err(
                    format!("{at}.metadata"),
                    "expected NAMESPACE/FIELD[/FIELD…]",
                ))
            }
        },
        _ => return Err(err(at, "give exactly one of header or metadata")),
    };
    Ok(LimitFrom {
        source,
        max: raw.max,
    })
}

/// A rule's overrides: keys with their own limit, unlimited, or blocked.
fn overrides_of(
    raw: Vec<crate::config::json::RawOverride>,
    key: &[KeyPart],
    client_ip: &ClientIp,
    params: &LimitParams,
    name: &str,
    path: &str,
) -> Result<Vec<Override>, ConfigError> {
    let mut overrides = Vec::with_capacity(raw.len());
    let mut override_keys = HashSet::new();
    for (j, o) in raw.into_iter().enumerate() {
        let at = format!("{path}.overrides[{j}]");
        if o.values.len() != key.len() {
            return Err(err(
                format!("{at}.values"),
                format!(
                    "gives {} value(s) for a key of {} part(s)",
                    o.values.len(),
                    key.len()
                ),
            ));
        }
        let mut values = Vec::with_capacity(o.values.len());
        let mut networks = Vec::new();
        for (k, (v, part)) in o.values.iter().zip(key).enumerate() {
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
                if l.calendar.is_some() {
                    return Err(err(
                        format!("{at}.limit.calendar"),
                        "a calendar quota is a global rule's own limit (global rules have \
                             no overrides)",
                    ));
                }
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
    Ok(overrides)
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

/// A cost settled after the response: token buckets only.
fn settle_of(
    raw: RawSettle,
    limit: &tollgate_core::Limit,
    path: &str,
) -> Result<Settle, ConfigError> {
    if !matches!(limit, tollgate_core::Limit::TokenBucket(_)) {
        return Err(err(
            format!("{path}.settle"),
            "only token_bucket rules (without warmup) settle a cost after the response",
        ));
    }
    raw.validate(&format!("{path}.settle"))
}
