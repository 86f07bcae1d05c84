//! Rate-limit response headers: IETF draft-ietf-httpapi-ratelimit-headers-10 and the legacy X- set.

use crate::config::HeaderFormat;

const NS_PER_SEC: u64 = 1_000_000_000;

/// Whole seconds, rounded up: a rounded-down wait sends obedient clients back too early.
pub fn ceil_secs(ns: u64) -> u64 {
    ns.div_ceil(NS_PER_SEC)
}

/// `Retry-After` for a refusal: at least 1 second.
pub fn retry_after_secs(retry_after_ns: u64) -> u64 {
    ceil_secs(retry_after_ns).max(1)
}

/// Headers describing `rule`'s quota: policy `q` per `w` seconds, `remaining` requests,
/// `reset_secs` until `t`/`Reset`.
pub fn quota_headers(
    format: HeaderFormat,
    rule: &str,
    (q, w): (u64, Option<u64>),
    remaining: u64,
    reset_secs: u64,
    out: &mut Vec<(&'static str, String)>,
) {
    // Built piece by piece: on the hot path `format!` costs several times more.
    if matches!(format, HeaderFormat::Draft | HeaderFormat::Both) {
        let mut policy = String::with_capacity(rule.len() + 32);
        for part in ["\"", rule, "\";q=", itoa::Buffer::new().format(q)] {
            policy.push_str(part);
        }
        if let Some(w) = w {
            policy.push_str(";w=");
            policy.push_str(itoa::Buffer::new().format(w));
        }
        out.push(("ratelimit-policy", policy));
        let mut state = String::with_capacity(rule.len() + 32);
        for part in [
            "\"",
            rule,
            "\";r=",
            itoa::Buffer::new().format(remaining),
            ";t=",
            itoa::Buffer::new().format(reset_secs),
        ] {
            state.push_str(part);
        }
        out.push(("ratelimit", state));
    }
    if matches!(format, HeaderFormat::Legacy | HeaderFormat::Both) {
        out.push(("x-ratelimit-limit", number(q)));
        out.push(("x-ratelimit-remaining", number(remaining)));
        out.push(("x-ratelimit-reset", number(reset_secs)));
    }
}

/// A number as a header value.
pub fn number(n: u64) -> String {
    itoa::Buffer::new().format(n).to_owned()
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
        let mut out = Vec::new();
        quota_headers(
            HeaderFormat::Both,
            "per-ip",
            (100, Some(60)),
            7,
            3,
            &mut out,
        );
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
        quota_headers(HeaderFormat::None, "r", (100, Some(60)), 7, 3, &mut out);
        assert!(out.is_empty());
        quota_headers(HeaderFormat::Draft, "c", (5, None), 2, 0, &mut out);
        assert_eq!(out[0].1, "\"c\";q=5");
    }
}
