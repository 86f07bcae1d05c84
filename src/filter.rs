//! The proxy-wasm adapter: the root context loads the configuration, the HTTP context gathers the
//! request's inputs, asks the core, and turns the outcome into a 429 or response headers.
//!
//! The SDK's trait helpers unwrap host statuses; this module calls `hostcalls` directly and
//! degrades instead, because a panic kills the VM.

use crate::config::{Config, Rule};
use crate::headers::{ceil_secs, quota_headers, retry_after_secs};
use crate::request::{Request, RequestView};
use log::{debug, error, info, warn};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType, Status};
use std::rc::Rc;
use std::time::UNIX_EPOCH;
use tollgate_core::limiter::EMPTY_SLOT;
use tollgate_core::{admit, CasStore, Check, SlotEvent, StoreError, Verdict};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(TollgateRoot::default()) });
}}

/// The host's shared data, seen through the core's store trait.
struct SharedData;

impl CasStore for SharedData {
    fn read(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        match hostcalls::get_shared_data(key) {
            Ok((Some(value), Some(cas))) => Ok(Some((value, cas))),
            Ok((Some(value), None)) => Ok(Some((value, 0))),
            Ok((None, _)) => Ok(None),
            Err(status) => Err(StoreError::Unavailable(format!("{status:?}"))),
        }
    }

    fn write(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
        let cas = (cas != 0).then_some(cas);
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(StoreError::CasMismatch),
            Err(status) => Err(StoreError::Unavailable(format!("{status:?}"))),
        }
    }
}

/// Envoy stat ids of one rule's counters (`tollgate.rule.<name>.<counter>`).
struct RuleMetrics {
    allowed: Option<u32>,
    limited: Option<u32>,
    dry_run_limited: Option<u32>,
    slot_taken_over: Option<u32>,
    slot_shared: Option<u32>,
    contended: Option<u32>,
    store_errors: Option<u32>,
}

impl RuleMetrics {
    fn define(rule: &str) -> Self {
        let counter = |name: &str| {
            let full = format!("tollgate.rule.{rule}.{name}");
            hostcalls::define_metric(MetricType::Counter, &full)
                .map_err(|s| warn!("cannot define metric {full}: {s:?}"))
                .ok()
        };
        Self {
            allowed: counter("allowed"),
            limited: counter("limited"),
            dry_run_limited: counter("dry_run_limited"),
            slot_taken_over: counter("slot_taken_over"),
            slot_shared: counter("slot_shared"),
            contended: counter("contended"),
            store_errors: counter("store_errors"),
        }
    }
}

fn bump(metric: Option<u32>) {
    if let Some(id) = metric {
        // A failed increment only loses a count; nothing to do about it here.
        let _ = hostcalls::increment_metric(id, 1);
    }
}

struct Loaded {
    config: Config,
    metrics: Vec<RuleMetrics>,
}

#[derive(Default)]
struct TollgateRoot {
    loaded: Option<Rc<Loaded>>,
}

impl Context for TollgateRoot {}

impl RootContext for TollgateRoot {
    fn on_configure(&mut self, _size: usize) -> bool {
        // Follow the host's log level so that disabled debug lines cost nothing.
        if let Ok(level) = hostcalls::get_log_level() {
            proxy_wasm::set_log_level(level);
        }
        let bytes = match hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX) {
            Ok(Some(bytes)) => bytes,
            Ok(None) => Vec::new(),
            Err(status) => {
                error!("cannot read the plugin configuration: {status:?}");
                return false;
            }
        };
        let config = match Config::parse(&bytes) {
            Ok(config) => config,
            Err(e) => {
                error!("invalid configuration: {e}");
                return false;
            }
        };
        for rule in &config.rules {
            if let Err(e) = rule.table.initialize(&SharedData, &EMPTY_SLOT) {
                error!("cannot create the slots of rule {}: {e:?}", rule.name);
                return false;
            }
        }
        let metrics = config
            .rules
            .iter()
            .map(|r| RuleMetrics::define(&r.name))
            .collect();
        info!("configuration loaded: {}", summary(&config));
        self.loaded = Some(Rc::new(Loaded { config, metrics }));
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Always a context (the SDK panics on None); without a configuration it passes requests.
        Some(Box::new(TollgateHttp {
            loaded: self.loaded.clone(),
            response_headers: Vec::new(),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

fn summary(config: &Config) -> String {
    let rules: Vec<String> = config
        .rules
        .iter()
        .map(|r| {
            format!(
                "{} ({} per {}ms, burst {}, {} slots{})",
                r.name,
                r.bucket.requests(),
                r.bucket.period_ns() / 1_000_000,
                r.bucket.burst(),
                r.table.len(),
                if r.dry_run { ", dry run" } else { "" }
            )
        })
        .collect();
    format!("{} rule(s): {}", rules.len(), rules.join("; "))
}

/// The request as the host shows it.
struct HostRequest;

impl RequestView for HostRequest {
    fn header(&self, name: &str) -> Option<String> {
        hostcalls::get_map_value(MapType::HttpRequestHeaders, name)
            .ok()
            .flatten()
    }

    fn source_address(&self) -> Option<String> {
        let bytes = hostcalls::get_property(vec!["source", "address"]).ok()??;
        String::from_utf8(bytes).ok()
    }
}

struct TollgateHttp {
    loaded: Option<Rc<Loaded>>,
    /// Quota headers to add to the upstream's response.
    response_headers: Vec<(&'static str, String)>,
}

impl Context for TollgateHttp {}

impl HttpContext for TollgateHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let Some(loaded) = self.loaded.clone() else {
            return Action::Continue;
        };
        let config = &loaded.config;
        let request = Request::new(&HostRequest, config.trusted_hops);
        let mut applying: Vec<(usize, Check)> = Vec::new();
        for (i, rule) in config.rules.iter().enumerate() {
            if !request.matches(&rule.matcher) {
                continue;
            }
            if let Some(key) = request.key(&rule.key, rule.missing_key) {
                applying.push((i, check_for(rule, &key)));
            }
        }
        if applying.is_empty() {
            return Action::Continue;
        }
        let now_ns = match hostcalls::get_current_time()
            .ok()
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        {
            Some(d) => u64::try_from(d.as_nanos()).unwrap_or(u64::MAX),
            None => {
                warn!("the host gave no usable time; request not limited");
                return Action::Continue;
            }
        };
        let checks: Vec<Check> = applying.iter().map(|(_, c)| *c).collect();
        let outcome = admit(&SharedData, &checks, now_ns);

        // The quota to report: the refusing rule, else the one with the least left.
        let mut report: Option<(usize, u64, u64)> = None;
        for (n, result) in outcome.checks.iter().enumerate() {
            let (i, check) = &applying[n];
            let (rule, metrics) = (&config.rules[*i], &loaded.metrics[*i]);
            match result.slot {
                SlotEvent::Own => {}
                SlotEvent::TakenOver => bump(metrics.slot_taken_over),
                SlotEvent::Shared => bump(metrics.slot_shared),
            }
            let (remaining, reset_secs) = match result.verdict {
                Verdict::Allowed {
                    remaining,
                    reset_ns,
                } => {
                    if outcome.admitted {
                        bump(metrics.allowed);
                    }
                    (remaining, ceil_secs(reset_ns))
                }
                Verdict::Limited {
                    retry_after_ns,
                    remaining,
                    ..
                } => {
                    if check.enforced {
                        bump(metrics.limited);
                    } else {
                        bump(metrics.dry_run_limited);
                        info!(
                            "dry run: rule {} would reject (key {:016x})",
                            rule.name, check.slot.tag
                        );
                    }
                    (remaining, retry_after_secs(retry_after_ns))
                }
                Verdict::Contended => {
                    bump(metrics.contended);
                    if check.enforced {
                        bump(metrics.limited);
                    }
                    (0, 1)
                }
                Verdict::Unavailable => {
                    bump(metrics.store_errors);
                    continue;
                }
            };
            debug!(
                "rule {} key {:016x} slot {} {:?} {:?}",
                rule.name, check.slot.tag, check.slot.index, result.verdict, result.slot
            );
            let refusing = outcome.rejected_by == Some(n);
            let tighter =
                report.is_none_or(|(_, r, t)| remaining < r || (remaining == r && reset_secs > t));
            if refusing || (outcome.admitted && tighter) {
                report = Some((*i, remaining, reset_secs));
            }
        }

        let format = config.rate_limit_headers;
        let mut headers = Vec::new();
        if let Some((i, remaining, reset_secs)) = report {
            let rule = &config.rules[i];
            quota_headers(
                format,
                &rule.name,
                &rule.bucket,
                remaining,
                reset_secs,
                &mut headers,
            );
            if !outcome.admitted {
                headers.push(("retry-after", reset_secs.to_string()));
                headers.push(("x-tollgate-rule", rule.name.clone()));
            }
        }
        if outcome.admitted {
            self.response_headers = headers;
            return Action::Continue;
        }
        reject(config, &headers);
        Action::Pause
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        for (name, value) in self.response_headers.drain(..) {
            if let Err(s) = hostcalls::add_map_value(MapType::HttpResponseHeaders, name, &value) {
                debug!("cannot add response header {name}: {s:?}");
            }
        }
        Action::Continue
    }
}

fn check_for<'a>(rule: &'a Rule, key: &[u8]) -> Check<'a> {
    Check {
        bucket: &rule.bucket,
        table: &rule.table,
        slot: rule.table.locate(key),
        cost: 1,
        enforced: !rule.dry_run,
    }
}

fn reject(config: &Config, quota: &[(&'static str, String)]) {
    let response = &config.response;
    let mut headers: Vec<(&str, &str)> = response
        .headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    headers.extend(quota.iter().map(|(n, v)| (*n, v.as_str())));
    if let Err(s) =
        hostcalls::send_http_response(response.status, headers, Some(response.body.as_bytes()))
    {
        error!("cannot send the rejection: {s:?}");
    }
}
