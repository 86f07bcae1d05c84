//! Rate-limit response headers: IETF draft-ietf-httpapi-ratelimit-headers-10 and the legacy X- set.

use crate::config::HeaderFormat;
use tollgate_core::TokenBucket;

const NS_PER_SEC: u64 = 1_000_000_000;

/// Whole seconds, rounded up: a rounded-down wait sends obedient clients back too early.
pub fn ceil_secs(ns: u64) -> u64 {
    ns.div_ceil(NS_PER_SEC)
}

/// `Retry-After` for a refusal: at least 1 second.
pub fn retry_after_secs(retry_after_ns: u64) -> u64 {
    ceil_secs(retry_after_ns).max(1)
}

/// The policy as quota `q` per window `w` seconds. A period that is not whole seconds is stated
/// per second, rounded down (never promising more than the rule gives).
pub fn policy(bucket: &TokenBucket) -> (u64, u64) {
    let (requests, period_ns) = (bucket.requests(), bucket.period_ns());
    if period_ns % NS_PER_SEC == 0 {
        (requests, period_ns / NS_PER_SEC)
    } else {
        let per_sec = u128::from(requests) * u128::from(NS_PER_SEC) / u128::from(period_ns);
        (u64::try_from(per_sec).unwrap_or(u64::MAX), 1)
    }
}

/// Headers describing `rule`'s quota: `remaining` requests, `reset_secs` until `t`/`Reset`.
pub fn quota_headers(
    format: HeaderFormat,
    rule: &str,
    bucket: &TokenBucket,
    remaining: u64,
    reset_secs: u64,
    out: &mut Vec<(&'static str, String)>,
) {
    let (q, w) = policy(bucket);
    if matches!(format, HeaderFormat::Draft | HeaderFormat::Both) {
        out.push(("ratelimit-policy", format!("\"{rule}\";q={q};w={w}")));
        out.push((
            "ratelimit",
            format!("\"{rule}\";r={remaining};t={reset_secs}"),
        ));
    }
    if matches!(format, HeaderFormat::Legacy | HeaderFormat::Both) {
        out.push(("x-ratelimit-limit", q.to_string()));
        out.push(("x-ratelimit-remaining", remaining.to_string()));
        out.push(("x-ratelimit-reset", reset_secs.to_string()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_is_up() {
        assert_eq!(retry_after_secs(1), 1);
        assert_eq!(retry_after_secs(NS_PER_SEC), 1);
        assert_eq!(retry_after_secs(NS_PER_SEC + 1), 2);
        assert_eq!(retry_after_secs(0), 1);
        assert_eq!(ceil_secs(0), 0);
    }

    #[test]
    fn formats() {
        let b = TokenBucket::new(100, 60 * NS_PER_SEC, 20).unwrap();
        let mut out = Vec::new();
        quota_headers(HeaderFormat::Both, "per-ip", &b, 7, 3, &mut out);
        assert_eq!(
            out,
            [
                ("ratelimit-policy", "\"per-ip\";q=100;w=60".to_string()),
                ("ratelimit", "\"per-ip\";r=7;t=3".to_string()),
                ("x-ratelimit-limit", "100".to_string()),
                ("x-ratelimit-remaining", "7".to_string()),
                ("x-ratelimit-reset", "3".to_string()),
            ]
        );
        out.clear();
        quota_headers(HeaderFormat::None, "r", &b, 7, 3, &mut out);
        assert!(out.is_empty());
        let fast = TokenBucket::new(10, 250_000_000, 10).unwrap();
        assert_eq!(policy(&fast), (40, 1));
    }
}
