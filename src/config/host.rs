//! What a proxy-wasm host can do, and the options that need what it cannot.

use super::model::Config;
use super::{err, ConfigError};

/// The capabilities tollgate relies on that differ between hosts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostCaps {
    /// How messages name the host.
    pub name: &'static str,
    /// A paused request can be resumed from the plugin's timer (`set_effective_context` +
    /// `resume_http_request` in `on_tick`). Without it a request can only be resumed from its own
    /// callbacks, such as the answer to a call it made.
    pub resume_from_timer: bool,
    /// `:authority` is the request's host (Envoy); elsewhere it may be the server's own name, and
    /// the request's host is the `host` header (nginx).
    pub authority_is_request_host: bool,
    /// The host appends a newline to a non-empty local response body (nginx).
    pub appends_newline_to_body: bool,
}

impl HostCaps {
    pub const ENVOY: Self = Self {
        name: "Envoy",
        resume_from_timer: true,
        authority_is_request_host: true,
        appends_newline_to_body: false,
    };
    pub const NGINX: Self = Self {
        name: "nginx (ngx_wasm_module)",
        resume_from_timer: false,
        authority_is_request_host: false,
        appends_newline_to_body: true,
    };
}

impl Config {
    /// Refuse options `host` cannot carry out, with the field named as a parse error names it.
    pub fn check_host(&self, host: &HostCaps) -> Result<(), ConfigError> {
        if host.resume_from_timer {
            return Ok(());
        }
        match self.rules.iter().position(|r| r.delays()) {
            Some(i) => Err(err(
                format!("rules[{i}].delay"),
                format!(
                    "{} cannot resume a held request from a timer, so a leaky bucket cannot \
                     delay requests there: set \"delay\": \"nodelay\" (requests beyond the burst \
                     are then refused, not delayed)",
                    host.name
                ),
            )),
            None => Ok(()),
        }
    }
}
