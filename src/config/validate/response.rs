//! The answer a rule gives when it refuses: status, body and headers.

use super::header_path;
use crate::config::json::RawResponse;
use crate::config::model::Response;
use crate::config::syntax::is_token;
use crate::config::{err, ConfigError};

impl RawResponse {
    pub(super) fn validate(self, path: &str) -> Result<Response, ConfigError> {
        if !(200..=599).contains(&self.status) {
            return Err(err(
                format!("{path}.status"),
                format!("{} is not an HTTP status between 200 and 599", self.status),
            ));
        }
        let mut headers = Vec::with_capacity(self.headers.len());
        for (name, value) in self.headers {
            let field = header_path(&format!("{path}.headers"), &name);
            let lower = name.to_ascii_lowercase();
            if lower.starts_with(':') || lower == "content-length" {
                return Err(err(field, "this header cannot be set"));
            }
            if !is_token(&name) {
                return Err(err(
                    field,
                    "not a header name (letters, digits and !#$%&'*+-.^_`|~ only)",
                ));
            }
            if let Some(c) = value
                .chars()
                .find(|&c| (c.is_ascii_control() && c != '\t') || c == '\u{7f}')
            {
                return Err(err(
                    field,
                    format!("the value contains {c:?}: a header value cannot hold control characters (CR, LF, NUL …)"),
                ));
            }
            headers.push((lower, value));
        }
        Ok(Response {
            status: self.status,
            body: self.body,
            headers,
        })
    }
}
