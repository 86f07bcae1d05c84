//! What a request costs: a cost from the request, one settled after the response, and each
//! key's own limit from the request.

use super::overload::status_set;
use crate::config::json::{RawCostFrom, RawLimitFrom, RawSettle, RawUsage, Scope, UsageCount};
use crate::config::model::{Cost, KeyPart, LimitFrom, Settle, SettleFrom, UsageCost};
use crate::config::syntax::{body_path, is_token};
use crate::config::{err, ConfigError};

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
pub(super) fn cost_from(c: RawCostFrom, path: &str) -> Result<Cost, ConfigError> {
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

/// Each key's own `limit.requests`, from the request.
pub(super) fn limit_from_of(
    raw: RawLimitFrom,
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

/// A cost settled after the response: token buckets only.
pub(super) fn settle_of(
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
