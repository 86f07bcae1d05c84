//! What a decision tells the client: rate-limit headers on admitted responses, and the rejection
//! (status, body, headers) of a refused request.

use super::{Engine, QuotaReport, Rejection};
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
        out.push_quota(
            self.config.rate_limit_headers,
            &rule.name,
            quota.policy,
            report.remaining,
            report.reset_secs,
        );
    }

    /// The rejection's response, its headers rendered into `out` after the response's own.
    pub fn render_rejection(&self, out: &mut HeaderSet, rejection: &Rejection) -> &Response {
        let response = self.config.response_of(rejection.rule);
        for (name, value) in &response.headers {
            out.push(name, &[value]);
        }
        if let Some(report) = rejection.quota {
            self.render_report(out, report);
        }
        if let Some(secs) = rejection.retry_after_secs {
            out.push_number("retry-after", secs);
        }
        if let Some(rule) = self.config.rules.get(rejection.rule) {
            out.push("x-tollgate-rule", &[&rule.name]);
        }
        response
    }
}
