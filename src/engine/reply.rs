//! What a decision tells the client: rate-limit headers on admitted responses, and the refusal
//! (status, body, headers) of a refused request.

use super::{Engine, QuotaRef, QuotaReport, Refusal};
use crate::config::Response;
use crate::headers::HeaderSet;

impl Engine {
    /// The rate-limit headers describing `report`'s quota, in the configured format.
    pub fn render_report(&self, out: &mut HeaderSet, report: QuotaReport) {
        let (Some(rule), Some(quota)) = (
            self.config.rules.get(report.which.rule()),
            self.quota_of(report.which),
        ) else {
            return;
        };
        let format = self.config.rate_limit_headers;
        let rendered = match (report.which, report.own_requests) {
            (QuotaRef::Rule(i), None) => self.policies.get(i).and_then(Option::as_ref),
            _ => None,
        };
        if let Some(policy) = rendered {
            let q = quota.policy.0;
            out.push_rendered(format, (q, policy), report.remaining, report.reset_secs);
            return;
        }
        let policy = match report.own_requests {
            Some(q) => (q, quota.policy.1),
            None => quota.policy,
        };
        out.push_quota(
            self.config.rate_limit_headers,
            &rule.name,
            policy,
            report.remaining,
            report.reset_secs,
        );
    }

    /// The refusal's response, its headers rendered into `out` after the response's own.
    pub fn render_refusal(&self, out: &mut HeaderSet, refusal: &Refusal) -> &Response {
        let response = self.config.response_of(refusal.rule);
        for (name, value) in &response.headers {
            out.push(name, &[value]);
        }
        if let Some(report) = refusal.quota {
            self.render_report(out, report);
        }
        if let Some(secs) = refusal.retry_after_secs {
            out.push_number("retry-after", secs);
        }
        if let Some(rule) = self.config.rules.get(refusal.rule) {
            out.push("x-tollgate-rule", &[&rule.name]);
        }
        response
    }
}
