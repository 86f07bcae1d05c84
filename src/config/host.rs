//! What a proxy-wasm host can do, and the options that need what it cannot.

use super::model::{Config, FailureMode, FirstLease, KeyPart};
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
    /// A request whose own call failed (timeout, reset) can still be refused from that call's
    /// callback. ngx_wasm_module drops the connection instead; it can only let the request go on.
    pub refuses_after_failed_call: bool,
    /// Requests carry dynamic metadata other filters set, readable as the `metadata` property.
    pub request_metadata: bool,
    /// The request-headers callback says whether a body follows, and a request paused there
    /// waits for its body (Envoy). ngx_wasm_module always says one may follow, and reads the
    /// body, if any, before its content handler forwards the request.
    pub request_end_known: bool,
    /// A metadata value can be read at any depth (`NAMESPACE/FIELD/FIELD…`, the Wasm ABI's
    /// property path). The dynamic module ABI reads a namespace's own fields only.
    pub nested_metadata: bool,
    /// Token buckets stash tokens per worker unless `worker_batch` says otherwise: where a
    /// shared-data call costs a host call (Envoy's Wasm), not where the state is the process's
    /// own memory (the dynamic module) or a request cannot wait for stashed tokens (nginx).
    pub stash_by_default: bool,
}

impl HostCaps {
    pub const ENVOY: Self = Self {
        name: "Envoy",
        resume_from_timer: true,
        authority_is_request_host: true,
        appends_newline_to_body: false,
        refuses_after_failed_call: true,
        request_metadata: true,
        request_end_known: true,
        nested_metadata: true,
        stash_by_default: true,
    };
    /// Envoy running the native build (a dynamic module): the same as the Wasm build in Envoy,
    /// but for metadata below a namespace's own fields.
    pub const ENVOY_MODULE: Self = Self {
        name: "Envoy (dynamic module)",
        nested_metadata: false,
        stash_by_default: false,
        ..Self::ENVOY
    };
    pub const NGINX: Self = Self {
        name: "nginx (ngx_wasm_module)",
        resume_from_timer: false,
        authority_is_request_host: false,
        appends_newline_to_body: true,
        refuses_after_failed_call: false,
        request_metadata: false,
        request_end_known: false,
        nested_metadata: false,
        stash_by_default: false,
    };
}

impl Config {
    /// Settings whose default depends on the host: where a request cannot be held and decided
    /// again from the timer, token buckets stash nothing unless `worker_batch` is given — a
    /// request refused while another worker's stash holds tokens could not wait for them, and
    /// the end of a burst spread over workers would be refused with tokens left; nor where the
    /// shared state is the process's own memory, whose compare-and-swap costs what a stash saves.
    pub fn fit_host(&mut self, host: &HostCaps) {
        if host.stash_by_default {
            return;
        }
        for rule in self.rules.iter_mut().filter(|r| r.worker_batch_by_default) {
            rule.worker_batch = 0;
        }
    }

    /// Refuse request metadata (a plan, a fair key's part, a key part) on a host without it.
    fn check_no_metadata(&self, host: &HostCaps) -> Result<(), ConfigError> {
        let is_metadata = |p: &KeyPart| matches!(p, KeyPart::Metadata(_));
        for (i, rule) in self.rules.iter().enumerate() {
            let fair = rule.guard().map_or(&[][..], |g| &g.fair_key[..]);
            let found = if rule
                .limit_from
                .as_ref()
                .is_some_and(|f| is_metadata(&f.source))
            {
                Some((
                    format!("rules[{i}].limit_from.metadata"),
                    "take the limit from",
                ))
            } else if let Some(j) = fair.iter().position(is_metadata) {
                Some((format!("rules[{i}].adaptive.fair_key[{j}]"), "key on"))
            } else {
                let j = rule.key.iter().position(is_metadata);
                j.map(|j| (format!("rules[{i}].key[{j}]"), "key on"))
            };
            if let Some((field, instead)) = found {
                return Err(err(
                    field,
                    format!(
                        "{} gives a filter no request metadata: {instead} a header that a filter \
                         before tollgate sets instead",
                        host.name
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Refuse metadata paths below a namespace's own fields on a host that reads no deeper.
    fn check_metadata_depth(&self, host: &HostCaps) -> Result<(), ConfigError> {
        // `metadata\0filter_metadata\0NAMESPACE\0FIELD`: four segments at most.
        let deep = |p: &KeyPart| matches!(p, KeyPart::Metadata(path) if path.split(|&b| b == 0).count() > 4);
        for (i, rule) in self.rules.iter().enumerate() {
            let fair = rule.guard().map_or(&[][..], |g| &g.fair_key[..]);
            let field = if rule.limit_from.as_ref().is_some_and(|f| deep(&f.source)) {
                Some(format!("rules[{i}].limit_from.metadata"))
            } else if let Some(j) = fair.iter().position(deep) {
                Some(format!("rules[{i}].adaptive.fair_key[{j}]"))
            } else {
                rule.key
                    .iter()
                    .position(deep)
                    .map(|j| format!("rules[{i}].key[{j}]"))
            };
            if let Some(field) = field {
                return Err(err(
                    field,
                    format!(
                        "{} reads a metadata namespace's own fields only (NAMESPACE/FIELD): copy \
                         the nested value into a field of its own, or into a header, with a \
                         filter before tollgate, or use the Wasm build",
                        host.name
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Refuse options `host` cannot carry out, with the field named as a parse error names it.
    pub fn check_host(&self, host: &HostCaps) -> Result<(), ConfigError> {
        if !host.request_metadata {
            self.check_no_metadata(host)?;
        } else if !host.nested_metadata {
            self.check_metadata_depth(host)?;
        }
        if !host.resume_from_timer {
            if let Some(i) = self.rules.iter().position(|r| r.pace().is_some()) {
                return Err(err(
                    format!("rules[{i}].limit.bytes"),
                    format!(
                        "{} cannot resume a paused body from a timer, so it cannot pace a key's \
                         bytes: use nginx's own limit_rate (per request) there",
                        host.name
                    ),
                ));
            }
            if let Some(i) = self.rules.iter().position(|r| r.delays()) {
                return Err(err(
                    format!("rules[{i}].delay"),
                    format!(
                        "{} cannot resume a held request from a timer, so a leaky bucket cannot \
                         delay requests there: set \"delay\": \"nodelay\" (requests beyond the \
                         burst are then refused, not delayed)",
                        host.name
                    ),
                ));
            }
        }
        if let (false, Some(qs)) = (host.resume_from_timer, &self.quota_service) {
            let slots = self.rules.iter().position(|r| {
                r.quota()
                    .is_some_and(|q| matches!(q.limit, tollgate_core::Limit::PermitLease(_)))
            });
            if let (Some(i), FirstLease::Wait) = (slots, qs.first_lease) {
                return Err(err(
                    format!("rules[{i}].scope"),
                    format!(
                        "{} cannot resume a request from a timer, so a request cannot wait for                          a global concurrency rule's first slots there: set                          \"quota_service.first_lease\": \"provisional\" (a new key admits up to                          its local stand-in while its first slots are fetched)",
                        host.name
                    ),
                ));
            }
        }
        if let (false, Some(qs)) = (host.refuses_after_failed_call, &self.quota_service) {
            // Requests call the service themselves in strict mode, and (where the host cannot
            // resume them from a timer) when they would wait for a key's quota.
            let own_calls =
                qs.strict || (!host.resume_from_timer && qs.first_lease == FirstLease::Wait);
            let global = self.rules.iter().any(|r| r.global().is_some());
            if global && own_calls && qs.failure_mode != FailureMode::Allow {
                return Err(err(
                    "quota_service.failure_mode",
                    format!(
                        "{} drops the connection of a request whose own call to the quota \
                         service fails (timeout, reset) instead of letting the filter refuse it, \
                         so such a request can only go on: with {} use \"failure_mode\": \
                         \"allow\"{}",
                        host.name,
                        if qs.strict {
                            "\"mode\": \"strict\""
                        } else {
                            "\"first_lease\": \"wait\""
                        },
                        if qs.strict {
                            ""
                        } else {
                            ", or \"first_lease\": \"provisional\" (a new key spends its local \
                             stand-in while its first lease is fetched, and requests never call \
                             the service themselves)"
                        }
                    ),
                ));
            }
        }
        Ok(())
    }
}
