//! Validation: the JSON shape into the model, with errors that name the field and the reason.

mod clients;
mod cost;
mod global;
mod limit;
mod matching;
mod overload;
mod overrides;
mod response;
mod rule;
mod status;

use super::json::{RawConfig, Scope};
use super::model::Config;
use super::syntax::is_token;
use super::{err, ConfigError};
use std::collections::HashSet;
use tollgate_core::slot::KeyPlacement;

impl RawConfig {
    pub(super) fn validate(self) -> Result<Config, ConfigError> {
        if self.rules.is_empty() {
            return Err(err("rules", "at least one rule is required"));
        }
        let quota_service = self
            .quota_service
            .map(|q| q.validate("quota_service"))
            .transpose()?;
        let client_ip = self.client_ip.validate("client_ip")?;
        let mut seen = HashSet::new();
        let mut rules = Vec::with_capacity(self.rules.len());
        for (i, raw) in self.rules.into_iter().enumerate() {
            let path = format!("rules[{i}]");
            if !seen.insert(raw.name.0.clone()) {
                return Err(err(
                    format!("{path}.name"),
                    format!("duplicate rule name {:?}", raw.name.0),
                ));
            }
            let global = raw.scope == Scope::Global;
            let calendar = global::calendar_of(&raw, &path)?;
            let mut rule = raw.validate(&path, self.dry_run, &client_ip)?;
            if global {
                let Some((qs, lease_size)) = &quota_service else {
                    return Err(err(
                        format!("{path}.scope"),
                        "\"global\" needs a top-level quota_service",
                    ));
                };
                rule.make_global(&path, qs, *lease_size, calendar)?;
            }
            rules.push(rule);
        }
        let response = self.response.validate("response")?;
        let priorities = overload::priorities(self.priorities)?;
        let placement = match self.placement_secret {
            Some(secret) if secret.len() < 16 => {
                return Err(err("placement_secret", "must be at least 16 bytes"));
            }
            Some(secret) => Some(KeyPlacement::from_secret(secret.as_bytes())),
            None => None,
        };
        const MOST_REQUEST_BODY_BYTES: u64 = 64 << 20;
        const MOST_WAITING_BODY_BYTES: u64 = 1 << 30;
        const MOST_BODY_WAIT_MS: u64 = 300_000;
        let max_request_body_bytes = self.max_request_body_bytes.unwrap_or(256 << 10);
        if !(1..=MOST_REQUEST_BODY_BYTES).contains(&max_request_body_bytes) {
            return Err(err(
                "max_request_body_bytes",
                format!("{max_request_body_bytes} is not within 1..={MOST_REQUEST_BODY_BYTES}"),
            ));
        }
        let request_body_timeout_ms = self.request_body_timeout.map_or(5_000, |p| p.ms());
        if !(1..=MOST_BODY_WAIT_MS).contains(&request_body_timeout_ms) {
            return Err(err(
                "request_body_timeout",
                format!("must be from 1ms to {} s", MOST_BODY_WAIT_MS / 1_000),
            ));
        }
        // (At least one body of the most a request keeps.)
        let max_waiting_body_bytes = self
            .max_waiting_body_bytes
            .unwrap_or((8 << 20).max(max_request_body_bytes));
        if !(max_request_body_bytes..=MOST_WAITING_BODY_BYTES).contains(&max_waiting_body_bytes) {
            return Err(err(
                "max_waiting_body_bytes",
                format!(
                    "{max_waiting_body_bytes} is not within max_request_body_bytes \
                     ({max_request_body_bytes}) ..= {MOST_WAITING_BODY_BYTES}"
                ),
            ));
        }
        let reads_request_body = rules.iter().any(crate::config::Rule::reads_request_body);
        let status = self.status.map(status::validate).transpose()?;
        Ok(Config {
            status,
            max_request_body_bytes: usize::try_from(max_request_body_bytes).unwrap_or(usize::MAX),
            request_body_timeout_ns: request_body_timeout_ms.saturating_mul(1_000_000),
            max_waiting_body_bytes: usize::try_from(max_waiting_body_bytes).unwrap_or(usize::MAX),
            reads_request_body,
            placement,
            priorities,
            rules,
            response,
            rate_limit_headers: self.rate_limit_headers,
            client_ip,
            quota_service: quota_service.map(|(q, _)| q),
            log_level: self.log_level,
        })
    }
}

/// A header's place in the configuration: `PATH.NAME`, or `PATH["NAME"]` when the name is not one.
fn header_path(path: &str, name: &str) -> String {
    if is_token(name) {
        format!("{path}.{name}")
    } else {
        format!("{path}[{name:?}]")
    }
}
