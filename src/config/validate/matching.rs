//! Which requests a rule applies to: paths, methods, hosts and headers.

use super::header_path;
use crate::config::json::RawMatch;
use crate::config::model::{Match, PathMatch};
use crate::config::syntax::is_token;
use crate::config::{err, ConfigError};

impl RawMatch {
    pub(super) fn validate(self, path: &str) -> Result<Match, ConfigError> {
        let path_match = match (self.path, self.path_prefix) {
            (Some(_), Some(_)) => {
                return Err(err(path, "give either path or path_prefix, not both"));
            }
            (Some(p), None) => Some(PathMatch::Exact(check_path(&format!("{path}.path"), p)?)),
            (None, Some(p)) => Some(PathMatch::Prefix(check_path(
                &format!("{path}.path_prefix"),
                p,
            )?)),
            (None, None) => None,
        };
        let list = |field: &str, values: Option<Vec<String>>, upper: bool| {
            let Some(values) = values else {
                return Ok(Vec::new());
            };
            if values.is_empty() {
                return Err(err(
                    format!("{path}.{field}"),
                    "must not be empty (leave it out to match any)",
                ));
            }
            values
                .into_iter()
                .enumerate()
                .map(|(j, v)| {
                    if v.is_empty() || v.contains(|c: char| c.is_whitespace() || c == ':') {
                        Err(err(
                            format!("{path}.{field}[{j}]"),
                            format!("invalid value {v:?}"),
                        ))
                    } else if upper {
                        Ok(v.to_ascii_uppercase())
                    } else {
                        Ok(v.to_ascii_lowercase())
                    }
                })
                .collect()
        };
        let methods = list("methods", self.methods, true)?;
        let hosts = list("hosts", self.hosts, false)?;
        let mut headers = Vec::with_capacity(self.headers.len());
        for (name, value) in self.headers {
            if !is_token(&name) {
                return Err(err(
                    header_path(&format!("{path}.headers"), &name),
                    "not a header name (letters, digits and !#$%&'*+-.^_`|~ only)",
                ));
            }
            headers.push((name.to_ascii_lowercase(), value));
        }
        Ok(Match {
            path: path_match,
            methods,
            hosts,
            headers,
        })
    }
}

pub(super) fn check_path(field: &str, p: String) -> Result<String, ConfigError> {
    if p.starts_with('/') {
        Ok(p)
    } else {
        Err(err(field, format!("{p:?} must start with \"/\"")))
    }
}
