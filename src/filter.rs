//! The proxy-wasm adapter: the root context loads the configuration and releases held requests on
//! its tick; the HTTP context gathers the request's inputs, asks the core, and turns the outcome
//! into a rejection, a hold, or response headers.
//!
//! The SDK's trait helpers unwrap host statuses; this module calls `hostcalls` directly and
//! degrades instead, because a panic kills the VM.

use crate::config::{Config, Cost, OverrideAction, Quota, Response, Rule};
use crate::headers::{ceil_secs, quota_headers, retry_after_secs};
use crate::request::{Request, RequestView};
use log::{debug, error, info, warn};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType, Status};
use std::cell::RefCell;
use std::collections::BTreeSet;
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};
use tollgate_core::{admit, release, CasStore, Check, Hold, Limit, SlotEvent, StoreError, Verdict};

/// How often each worker looks for held requests that are due: the spacing's resolution.
const TICK: Duration = Duration::from_millis(5);

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(TollgateRoot::default()) });
}}

thread_local! {
    /// Requests held by leaky buckets in this VM (one per worker): (due time ns, context id).
    static HELD: RefCell<BTreeSet<(u64, u32)>> = const { RefCell::new(BTreeSet::new()) };
}

/// The host's shared data, seen through the core's store trait.
struct SharedData;

impl CasStore for SharedData {
    fn read(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        match hostcalls::get_shared_data(key) {
            Ok((Some(value), cas)) => Ok(Some((value, cas.unwrap_or(0)))),
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

fn now_ns() -> Option<u64> {
    let since = hostcalls::get_current_time()
        .ok()?
        .duration_since(UNIX_EPOCH)
        .ok()?;
    Some(u64::try_from(since.as_nanos()).unwrap_or(u64::MAX))
}

/// An Envoy stat id, or nothing if the host refused to define it (the count is then lost).
#[derive(Clone, Copy)]
struct Metric(Option<u32>);

impl Metric {
    fn define(kind: MetricType, name: &str) -> Self {
        Self(
            hostcalls::define_metric(kind, name)
                .map_err(|s| warn!("cannot define metric {name}: {s:?}"))
                .ok(),
        )
    }

    fn add(self, n: i64) {
        if let Some(id) = self.0 {
            // A failed increment only loses a count; nothing to do about it here.
            let _ = hostcalls::increment_metric(id, n);
        }
    }

    fn bump(self) {
        self.add(1);
    }
}

/// One rule's stats (`tollgate.rule.<name>.<stat>`).
struct RuleMetrics {
    allowed: Metric,
    limited: Metric,
    delayed: Metric,
    dry_run_limited: Metric,
    blocked: Metric,
    slot_taken_over: Metric,
    slot_shared: Metric,
    contended: Metric,
    store_errors: Metric,
    /// Concurrency rules only: requests in flight, weighted by cost.
    in_flight: Metric,
}

impl RuleMetrics {
    fn define(rule: &Rule) -> Self {
        let counter = |stat: &str| {
            Metric::define(
                MetricType::Counter,
                &format!("tollgate.rule.{}.{stat}", rule.name),
            )
        };
        let holds = std::iter::once(&rule.quota)
            .chain(rule.overrides.iter().filter_map(|o| match &o.action {
                OverrideAction::Limit(q) => Some(q),
                _ => None,
            }))
            .any(|q| q.limit.is_held());
        Self {
            allowed: counter("allowed"),
            limited: counter("limited"),
            delayed: counter("delayed"),
            dry_run_limited: counter("dry_run_limited"),
            blocked: counter("blocked"),
            slot_taken_over: counter("slot_taken_over"),
            slot_shared: counter("slot_shared"),
            contended: counter("contended"),
            store_errors: counter("store_errors"),
            in_flight: if holds {
                Metric::define(
                    MetricType::Gauge,
                    &format!("tollgate.rule.{}.in_flight", rule.name),
                )
            } else {
                Metric(None)
            },
        }
    }
}

struct Loaded {
    config: Config,
    metrics: Vec<RuleMetrics>,
    /// Requests currently held by leaky buckets in this process.
    held: Metric,
    release_errors: Metric,
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
        for (rule, quota) in config.quotas() {
            if let Err(e) = quota.table.initialize(&SharedData) {
                error!("cannot create the slots of rule {}: {e:?}", rule.name);
                return false;
            }
        }
        let holds_requests = config
            .quotas()
            .any(|(_, q)| matches!(q.limit, Limit::LeakyBucket(_)));
        if holds_requests {
            if let Err(s) = hostcalls::set_tick_period(TICK) {
                error!("cannot set the tick period that releases held requests: {s:?}");
                return false;
            }
        }
        let metrics = config.rules.iter().map(RuleMetrics::define).collect();
        info!("configuration loaded: {}", config.summary());
        self.loaded = Some(Rc::new(Loaded {
            config,
            metrics,
            held: Metric::define(MetricType::Gauge, "tollgate.queue.held"),
            release_errors: Metric::define(MetricType::Counter, "tollgate.release_errors"),
        }));
        true
    }

    fn on_tick(&mut self) {
        let Some(now) = now_ns() else {
            return;
        };
        let due: Vec<u32> = HELD.with(|held| {
            let mut held = held.borrow_mut();
            let mut due = Vec::new();
            while let Some(&(at, id)) = held.first() {
                if at > now {
                    break;
                }
                held.pop_first();
                due.push(id);
            }
            due
        });
        for id in due {
            if let Some(loaded) = &self.loaded {
                loaded.held.add(-1);
            }
            // The stream may be gone already; then there is nothing to resume.
            if hostcalls::set_effective_context(id).is_ok() {
                if let Err(s) = hostcalls::resume_http_request() {
                    debug!("cannot resume held request {id}: {s:?}");
                }
            }
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Always a context (the SDK panics on None); without a configuration it passes requests.
        Some(Box::new(TollgateHttp {
            context_id,
            loaded: self.loaded.clone(),
            response_headers: Vec::new(),
            holds: Vec::new(),
            held_until: None,
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
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

fn cost_of(cost: &Cost, view: &impl RequestView) -> u64 {
    match cost {
        Cost::Fixed(n) => *n,
        Cost::Header { name, default, max } => view
            .header(name)
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map_or(*default, |n| n.min(*max)),
    }
}

/// Which quota of rule `rule` applies: its own (`None`) or an override's.
type QuotaRef = (usize, Option<usize>);

fn quota_of(config: &Config, (rule, o): QuotaRef) -> Option<&Quota> {
    let rule = config.rules.get(rule)?;
    match o {
        None => Some(&rule.quota),
        Some(j) => match &rule.overrides.get(j)?.action {
            OverrideAction::Limit(q) => Some(q),
            _ => None,
        },
    }
}

struct TollgateHttp {
    context_id: u32,
    loaded: Option<Rc<Loaded>>,
    /// Quota headers to add to the upstream's response.
    response_headers: Vec<(&'static str, String)>,
    /// Quota held until the stream ends (concurrency rules).
    holds: Vec<(QuotaRef, Hold)>,
    /// Set while the request is held by a leaky bucket.
    held_until: Option<u64>,
}

impl Context for TollgateHttp {}

impl HttpContext for TollgateHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let Some(loaded) = self.loaded.clone() else {
            return Action::Continue;
        };
        let config = &loaded.config;
        let request = Request::new(&HostRequest, config.trusted_hops);
        let mut applying: Vec<QuotaRef> = Vec::new();
        let mut checks: Vec<Check> = Vec::new();
        for (i, rule) in config.rules.iter().enumerate() {
            if !request.matches(&rule.matcher) {
                continue;
            }
            let Some(key) = request.key(&rule.key, rule.missing_key) else {
                continue;
            };
            let overridden = rule.overrides.iter().position(|o| o.key == key);
            let (which, quota) = match overridden.map(|j| (j, &rule.overrides[j].action)) {
                None => ((i, None), &rule.quota),
                Some((_, OverrideAction::Unlimited)) => continue,
                Some((_, OverrideAction::Block)) => {
                    if rule.dry_run {
                        loaded.metrics[i].dry_run_limited.bump();
                        info!("dry run: rule {} would block its key", rule.name);
                        continue;
                    }
                    loaded.metrics[i].blocked.bump();
                    let headers = vec![("x-tollgate-rule", rule.name.clone())];
                    reject(rule.response.as_ref().unwrap_or(&config.response), &headers);
                    return Action::Pause;
                }
                Some((j, OverrideAction::Limit(q))) => ((i, Some(j)), q),
            };
            applying.push(which);
            checks.push(Check {
                limit: &quota.limit,
                table: &quota.table,
                slot: quota.table.locate(&key),
                cost: cost_of(&rule.cost, &HostRequest),
                enforced: !rule.dry_run,
            });
        }
        if checks.is_empty() {
            return Action::Continue;
        }
        let Some(now) = now_ns() else {
            warn!("the host gave no usable time; request not limited");
            return Action::Continue;
        };
        let outcome = admit(&SharedData, &checks, now);

        // The quota to report: the refusing rule, else the one with the least left.
        let mut report: Option<(QuotaRef, u64, u64)> = None;
        let mut delay_ns = 0;
        for (n, result) in outcome.checks.iter().enumerate() {
            let (which, check) = (applying[n], &checks[n]);
            let (rule, metrics) = (&config.rules[which.0], &loaded.metrics[which.0]);
            match result.slot {
                SlotEvent::Own => {}
                SlotEvent::TakenOver => metrics.slot_taken_over.bump(),
                SlotEvent::Shared => metrics.slot_shared.bump(),
            }
            let (remaining, reset_secs) = match result.verdict {
                Verdict::Allowed {
                    remaining,
                    reset_ns,
                    delay_ns: d,
                } => {
                    if outcome.admitted {
                        metrics.allowed.bump();
                        if d > 0 && check.enforced {
                            metrics.delayed.bump();
                            delay_ns = delay_ns.max(d);
                        }
                    }
                    (remaining, ceil_secs(reset_ns))
                }
                Verdict::Limited {
                    retry_after_ns,
                    remaining,
                    ..
                } => {
                    if check.enforced {
                        metrics.limited.bump();
                    } else {
                        metrics.dry_run_limited.bump();
                        info!(
                            "dry run: rule {} would reject (key {:016x})",
                            rule.name, check.slot.tag
                        );
                    }
                    (remaining, retry_after_secs(retry_after_ns))
                }
                Verdict::Contended => {
                    metrics.contended.bump();
                    if check.enforced {
                        metrics.limited.bump();
                    }
                    (0, 1)
                }
                Verdict::Unavailable => {
                    metrics.store_errors.bump();
                    continue;
                }
            };
            debug!(
                "rule {} key {:016x} group {} {:?} {:?}",
                rule.name, check.slot.tag, check.slot.group, result.verdict, result.slot
            );
            if let Some(hold) = result.hold {
                metrics
                    .in_flight
                    .add(i64::try_from(hold.cost).unwrap_or(i64::MAX));
                self.holds.push((which, hold));
            }
            let refusing = outcome.rejected_by == Some(n);
            let tighter =
                report.is_none_or(|(_, r, t)| remaining < r || (remaining == r && reset_secs > t));
            if refusing || (outcome.admitted && tighter) {
                report = Some((which, remaining, reset_secs));
            }
        }

        let mut headers = Vec::new();
        let mut response = &config.response;
        if let Some((which, remaining, reset_secs)) = report {
            let rule = &config.rules[which.0];
            if let Some(quota) = quota_of(config, which) {
                quota_headers(
                    config.rate_limit_headers,
                    &rule.name,
                    quota.policy,
                    remaining,
                    reset_secs,
                    &mut headers,
                );
            }
            if !outcome.admitted {
                headers.push(("retry-after", reset_secs.to_string()));
                headers.push(("x-tollgate-rule", rule.name.clone()));
                response = rule.response.as_ref().unwrap_or(response);
            }
        }
        if !outcome.admitted {
            reject(response, &headers);
            return Action::Pause;
        }
        self.response_headers = headers;
        if delay_ns > 0 {
            let due = now.saturating_add(delay_ns);
            HELD.with(|held| held.borrow_mut().insert((due, self.context_id)));
            self.held_until = Some(due);
            loaded.held.bump();
            return Action::Pause;
        }
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        for (name, value) in self.response_headers.drain(..) {
            if let Err(s) = hostcalls::add_map_value(MapType::HttpResponseHeaders, name, &value) {
                debug!("cannot add response header {name}: {s:?}");
            }
        }
        Action::Continue
    }

    fn on_log(&mut self) {
        self.end_of_stream();
    }
}

impl TollgateHttp {
    /// Give back held quota and leave the hold queue: however the stream ended, exactly once.
    fn end_of_stream(&mut self) {
        let Some(loaded) = &self.loaded else {
            return;
        };
        if let Some(due) = self.held_until.take() {
            // Still queued means the client went away while held.
            if HELD.with(|held| held.borrow_mut().remove(&(due, self.context_id))) {
                loaded.held.add(-1);
            }
        }
        if self.holds.is_empty() {
            return;
        }
        let now = now_ns().unwrap_or(0);
        for (which, hold) in self.holds.drain(..) {
            let Some(quota) = quota_of(&loaded.config, which) else {
                continue;
            };
            loaded.metrics[which.0]
                .in_flight
                .add(-i64::try_from(hold.cost).unwrap_or(i64::MAX));
            if let Err(e) = release(&SharedData, &quota.limit, &quota.table, &hold, now) {
                loaded.release_errors.bump();
                error!(
                    "rule {}: in-flight count not released: {e:?}",
                    loaded.config.rules[which.0].name
                );
            }
        }
    }
}

impl Drop for TollgateHttp {
    fn drop(&mut self) {
        // Hosts that end a stream without the log callback still release what it held.
        self.end_of_stream();
    }
}

fn reject(response: &Response, extra: &[(&'static str, String)]) {
    let mut headers: Vec<(&str, &str)> = response
        .headers
        .iter()
        .map(|(n, v)| (n.as_str(), v.as_str()))
        .collect();
    headers.extend(extra.iter().map(|(n, v)| (*n, v.as_str())));
    if let Err(s) =
        hostcalls::send_http_response(response.status, headers, Some(response.body.as_bytes()))
    {
        error!("cannot send the rejection: {s:?}");
    }
}
