//! A rule's algorithm settings, applied to its own limit and its overrides' limits.

use crate::config::json::{Algorithm, Delay, RawLimit};
use crate::config::period::Per;
use crate::config::{err, ConfigError};
use tollgate_core::{
    Concurrency, FixedWindow, LeakyBucket, Limit, SlidingWindow, TokenBucket, WarmUp,
};

/// A rule's algorithm settings, applied to its own limit and to its overrides' limits.
pub(super) struct LimitParams {
    pub(super) algorithm: Algorithm,
    pub(super) delay: Option<Delay>,
    pub(super) max_delay_ns: u64,
    pub(super) warmup_ns: Option<u64>,
}

/// A limit's `per` (ns): a calendar period only with `calendar` beside it, `calendar` only with a
/// calendar period (the calendar's own rules are the global rule's: [`super::global`]).
fn per_ns(raw: &RawLimit, path: &str) -> Result<u64, ConfigError> {
    let per = raw
        .per
        .ok_or_else(|| err(format!("{path}.limit.per"), "required"))?;
    match (per, &raw.calendar) {
        (Per::Calendar(unit), None) => Err(err(
            format!("{path}.limit.per"),
            format!(
                "\"{}\" is a calendar period: give \"calendar\": {{\"time_zone\": \"UTC\"}} \
                 beside it (a global rule), or a duration such as \"1d\"",
                unit.as_str()
            ),
        )),
        (Per::Duration(_), Some(_)) => Err(err(
            format!("{path}.limit.calendar"),
            "needs per \"day\", \"week\" or \"month\"",
        )),
        _ => Ok(per.ns()),
    }
}

impl LimitParams {
    pub(super) fn limit(
        &self,
        raw: &RawLimit,
        burst: Option<u64>,
        path: &str,
    ) -> Result<Limit, ConfigError> {
        let field = |f: &str| format!("{path}.limit.{f}");
        if self.algorithm == Algorithm::Concurrency {
            return concurrency(raw, burst, path);
        }
        if raw.concurrent.is_some() {
            return Err(err(
                field("concurrent"),
                "only applies to algorithm \"concurrency\"",
            ));
        }
        if let Some(bytes) = raw.bytes {
            return self.bytes(raw, bytes.get(), burst, path);
        }
        let requests = raw
            .requests
            .ok_or_else(|| err(field("requests"), "required"))?
            .get();
        let per = per_ns(raw, path)?;
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

    /// A byte limit: a token bucket of `bytes` per `per`.
    fn bytes(
        &self,
        raw: &RawLimit,
        bytes: u64,
        burst: Option<u64>,
        path: &str,
    ) -> Result<Limit, ConfigError> {
        if raw.requests.is_some() {
            return Err(err(
                format!("{path}.limit"),
                "give requests or bytes, not both",
            ));
        }
        let (given, what) = if self.warmup_ns.is_some() {
            ("warmup", "a byte limit has no warmup")
        } else {
            (
                "algorithm",
                "a byte limit is a token bucket of bytes (\"token_bucket\")",
            )
        };
        if self.algorithm != Algorithm::TokenBucket || self.warmup_ns.is_some() {
            return Err(err(format!("{path}.{given}"), what));
        }
        let per = per_ns(raw, path)?;
        let burst = burst.unwrap_or(bytes);
        if burst == 0 {
            return Err(err(format!("{path}.burst"), "must be at least 1"));
        }
        TokenBucket::new(bytes, per, burst)
            .map(Limit::TokenBucket)
            .ok_or_else(|| err(format!("{path}.limit"), "must be positive"))
    }
}

/// A concurrency limit: `{"concurrent": N}`.
fn concurrency(raw: &RawLimit, burst: Option<u64>, path: &str) -> Result<Limit, ConfigError> {
    let field = |f: &str| format!("{path}.limit.{f}");
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
    Concurrency::new(n.get())
        .map(Limit::Concurrency)
        .ok_or_else(|| err(field("concurrent"), "must be at least 1"))
}
