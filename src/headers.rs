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

/// A rule's own quota headers, the parts that never change rendered when its configuration loads:
/// the `RateLimit-Policy` value and the start of the `RateLimit` value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderedQuota {
    /// `"rule";q=Q;w=W`
    pub policy: String,
    /// `"rule";r=`
    state_prefix: String,
}

impl RenderedQuota {
    pub fn new(rule: &str, policy: (u64, Option<u64>)) -> Self {
        let mut value = String::new();
        write_policy(&mut value, rule, policy);
        Self {
            policy: value,
            state_prefix: format!("\"{rule}\";r="),
        }
    }
}

/// [`RenderedQuota::policy`], written at the end of `out`.
fn write_policy(out: &mut String, rule: &str, (q, w): (u64, Option<u64>)) {
    for part in ["\"", rule, "\";q=", itoa::Buffer::new().format(q)] {
        out.push_str(part);
    }
    if let Some(w) = w {
        out.push_str(";w=");
        out.push_str(itoa::Buffer::new().format(w));
    }
}

/// Response headers rendered into one buffer, which a worker reuses from response to response:
/// adding rate-limit headers allocates nothing once the buffer has grown.
#[derive(Debug, Default)]
pub struct HeaderSet {
    text: String,
    /// End of each header's name and of its value in `text` (each starts where the previous ends).
    fields: Vec<(usize, usize)>,
}

impl HeaderSet {
    pub fn clear(&mut self) {
        self.text.clear();
        self.fields.clear();
    }

    /// A header whose value is the concatenation of `parts`.
    pub fn push(&mut self, name: &str, parts: &[&str]) {
        self.push_with(name, |text| {
            for part in parts {
                text.push_str(part);
            }
        });
    }

    /// A header whose value `write` appends to the text.
    fn push_with(&mut self, name: &str, write: impl FnOnce(&mut String)) {
        self.text.push_str(name);
        let name_end = self.text.len();
        write(&mut self.text);
        self.fields.push((name_end, self.text.len()));
    }

    pub fn push_number(&mut self, name: &str, n: u64) {
        self.push(name, &[itoa::Buffer::new().format(n)]);
    }

    /// Headers describing `rule`'s quota: policy `q` per `w` seconds, `remaining` requests,
    /// `reset_secs` until `t`/`Reset`.
    pub fn push_quota(
        &mut self,
        format: HeaderFormat,
        rule: &str,
        (q, w): (u64, Option<u64>),
        remaining: u64,
        reset_secs: u64,
    ) {
        if matches!(format, HeaderFormat::Draft | HeaderFormat::Both) {
            self.push_with("ratelimit-policy", |text| write_policy(text, rule, (q, w)));
        }
        self.push_state(format, rule, q, remaining, reset_secs);
    }

    /// [`HeaderSet::push_quota`] for a rule's own quota, rendered when its configuration loads.
    pub fn push_rendered(
        &mut self,
        format: HeaderFormat,
        (q, rendered): (u64, &RenderedQuota),
        remaining: u64,
        reset_secs: u64,
    ) {
        let (mut r_buf, mut t_buf) = (itoa::Buffer::new(), itoa::Buffer::new());
        let (r, t) = (r_buf.format(remaining), t_buf.format(reset_secs));
        if matches!(format, HeaderFormat::Draft | HeaderFormat::Both) {
            self.push("ratelimit-policy", &[&rendered.policy]);
            self.push("ratelimit", &[&rendered.state_prefix, r, ";t=", t]);
        }
        self.push_legacy(format, q, r, t);
    }

    /// The headers after the policy: `RateLimit`, and the legacy set.
    fn push_state(
        &mut self,
        format: HeaderFormat,
        rule: &str,
        q: u64,
        remaining: u64,
        reset_secs: u64,
    ) {
        let (mut r_buf, mut t_buf) = (itoa::Buffer::new(), itoa::Buffer::new());
        let (r, t) = (r_buf.format(remaining), t_buf.format(reset_secs));
        if matches!(format, HeaderFormat::Draft | HeaderFormat::Both) {
            self.push("ratelimit", &["\"", rule, "\";r=", r, ";t=", t]);
        }
        self.push_legacy(format, q, r, t);
    }

    /// The legacy `X-RateLimit-*` set, where the format has it.
    fn push_legacy(&mut self, format: HeaderFormat, q: u64, remaining: &str, reset: &str) {
        if matches!(format, HeaderFormat::Legacy | HeaderFormat::Both) {
            self.push_number("x-ratelimit-limit", q);
            self.push("x-ratelimit-remaining", &[remaining]);
            self.push("x-ratelimit-reset", &[reset]);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.fields.is_empty()
    }

    /// The headers as (name, value) pairs, in the order they were pushed.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> + Clone + '_ {
        let starts = std::iter::once(0).chain(self.fields.iter().map(|(_, end)| *end));
        self.fields
            .iter()
            .zip(starts)
            .map(|(&(name_end, end), start)| {
                (
                    self.text.get(start..name_end).unwrap_or_default(),
                    self.text.get(name_end..end).unwrap_or_default(),
                )
            })
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
    fn a_rendered_policy_gives_the_same_headers() {
        for (policy, format) in [
            ((100, Some(60)), HeaderFormat::Both),
            ((5, None), HeaderFormat::Draft),
        ] {
            let (mut parts, mut rendered) = (HeaderSet::default(), HeaderSet::default());
            parts.push_quota(format, "r", policy, 7, 3);
            rendered.push_rendered(format, (policy.0, &RenderedQuota::new("r", policy)), 7, 3);
            assert_eq!(
                parts.iter().collect::<Vec<_>>(),
                rendered.iter().collect::<Vec<_>>()
            );
        }
    }

    #[test]
    fn formats() {
        let mut set = HeaderSet::default();
        set.push_quota(HeaderFormat::Both, "per-ip", (100, Some(60)), 7, 3);
        assert_eq!(
            set.iter().collect::<Vec<_>>(),
            [
                ("ratelimit-policy", "\"per-ip\";q=100;w=60"),
                ("ratelimit", "\"per-ip\";r=7;t=3"),
                ("x-ratelimit-limit", "100"),
                ("x-ratelimit-remaining", "7"),
                ("x-ratelimit-reset", "3"),
            ]
        );
        set.clear();
        set.push_quota(HeaderFormat::None, "r", (100, Some(60)), 7, 3);
        assert!(set.is_empty());
        set.push_quota(HeaderFormat::Draft, "c", (5, None), 2, 0);
        set.push_number("retry-after", 12);
        set.push("x-tollgate-rule", &["c"]);
        assert_eq!(
            set.iter().collect::<Vec<_>>(),
            [
                ("ratelimit-policy", "\"c\";q=5"),
                ("ratelimit", "\"c\";r=2;t=0"),
                ("retry-after", "12"),
                ("x-tollgate-rule", "c"),
            ]
        );
    }
}
