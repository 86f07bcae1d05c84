//! The proxy-wasm adapter: the root context loads the configuration and releases held requests on
//! its tick; the HTTP context gathers the request's inputs, asks the core, and turns the outcome
//! into a rejection, a hold, or response headers.
//!
//! The SDK's trait helpers unwrap host statuses; this module calls `hostcalls` directly and
//! degrades instead, because a panic kills the VM.

use crate::config::{
    Config, Cost, FailureMode, FirstLease, OverrideAction, Quota, QuotaService, Response, Rule,
};
use crate::headers::{ceil_secs, retry_after_secs, HeaderSet};
use crate::request::{Request, RequestView};
use log::{debug, error, info, warn};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType, Status};
use smallvec::SmallVec;
use std::cell::{Cell, RefCell};
use std::collections::{BTreeSet, HashMap};
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};
use tollgate_core::lease::{LeaseItem, LeaseRequest, LeaseResponse};
use tollgate_core::limiter::INLINE_RULES;
use tollgate_core::slot::{key_hash, Group};
use tollgate_core::{
    admit, release, return_stash, CasStore, Check, CheckOutcome, CheckOutcomes, Hold,
    LeaseAllowance, Limit, Lookup, Outcome, SlotEvent, SlotId, StashTable, StoreError, Verdict,
};

/// How often each worker looks for held requests that are due: the spacing's resolution.
const TICK: Duration = Duration::from_millis(5);
/// The tick otherwise: it returns unspent stashed tokens and hands the worker's stats to the host.
const STATS_TICK: Duration = Duration::from_millis(10);

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(TollgateRoot::default()) });
}}

thread_local! {
    /// Requests held by leaky buckets in this VM (one per worker): (due time ns, context id).
    static HELD: RefCell<BTreeSet<(u64, u32)>> = const { RefCell::new(BTreeSet::new()) };
    /// Requests waiting for a global rule's quota, retried on every tick.
    static WAITING: RefCell<Vec<Waiting>> = const { RefCell::new(Vec::new()) };
    /// Decisions made on the tick for paused requests, picked up by their HTTP contexts.
    static RESUMED: RefCell<HashMap<u32, Admitted>> = RefCell::new(HashMap::new());
    /// Refills claimed by this VM's requests, sent together on the next tick.
    static PENDING: RefCell<Vec<Refill>> = const { RefCell::new(Vec::new()) };
    /// Stat increments since the last tick, as (host metric id, pending increment): a request
    /// costs no host call for its stats.
    static COUNTS: RefCell<Vec<(u32, i64)>> = const { RefCell::new(Vec::new()) };
    /// Refills sent and not answered yet, by call token.
    static IN_FLIGHT: RefCell<HashMap<u32, Vec<Refill>>> = RefCell::new(HashMap::new());
    /// Headers being added to a response or a rejection (one at a time per worker).
    static HEADERS: RefCell<HeaderSet> = RefCell::new(HeaderSet::default());
}

/// Profiling builds (`--features probe`): nanoseconds spent and heap allocations made in each
/// callback, flushed to Envoy counters `tollgate.probe.<callback>.{ns,allocs,calls}` every 1000 calls.
#[cfg(feature = "probe")]
mod probe {
    use proxy_wasm::hostcalls;
    use proxy_wasm::types::MetricType;
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::RefCell;
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU64, Ordering};

    /// Heap allocations so far, the host's buffers for returned data included (the SDK allocates
    /// them through the same allocator).
    static ALLOCS: AtomicU64 = AtomicU64::new(0);

    struct Counting;

    // SAFETY: forwards to the system allocator unchanged; only counts calls.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
            // SAFETY: the caller's contract is passed on as is.
            unsafe { System.alloc(layout) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            // SAFETY: as above.
            unsafe { System.dealloc(ptr, layout) }
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            ALLOCS.fetch_add(1, Ordering::Relaxed);
            // SAFETY: as above.
            unsafe { System.realloc(ptr, layout, new_size) }
        }
    }

    #[global_allocator]
    static ALLOCATOR: Counting = Counting;

    /// Sums since the last flush and the metric ids: ns, allocations, calls.
    struct Sums {
        ns: u64,
        allocs: u64,
        calls: u64,
        ids: [u32; 3],
    }

    thread_local! {
        static SUMS: RefCell<HashMap<&'static str, Sums>> = RefCell::new(HashMap::new());
    }

    pub struct Timer(&'static str, u64, u64);

    pub fn start(name: &'static str) -> Timer {
        let allocs = ALLOCS.load(Ordering::Relaxed);
        Timer(name, super::now_ns().unwrap_or(0), allocs)
    }

    impl Drop for Timer {
        fn drop(&mut self) {
            let spent = super::now_ns().unwrap_or(0).saturating_sub(self.1);
            let allocs = ALLOCS.load(Ordering::Relaxed).saturating_sub(self.2);
            SUMS.with(|s| {
                let mut s = s.borrow_mut();
                let e = s.entry(self.0).or_insert_with(|| {
                    let id = |stat: &str| {
                        let name = format!("tollgate.probe.{}.{stat}", self.0);
                        hostcalls::define_metric(MetricType::Counter, &name).unwrap_or(0)
                    };
                    Sums {
                        ns: 0,
                        allocs: 0,
                        calls: 0,
                        ids: [id("ns"), id("allocs"), id("calls")],
                    }
                });
                e.ns += spent;
                e.allocs += allocs;
                e.calls += 1;
                if e.calls == 1000 {
                    for (id, n) in e.ids.into_iter().zip([e.ns, e.allocs, e.calls]) {
                        let _ = hostcalls::increment_metric(id, n as i64);
                    }
                    (e.ns, e.allocs, e.calls) = (0, 0, 0);
                }
            });
        }
    }
}

/// One rule's part in a request, kept so that a paused request can be decided again later.
#[derive(Clone, Copy)]
struct CheckInput {
    which: QuotaRef,
    /// The client key's hash: its slot in any table, and its name at the quota service.
    key: u128,
    slot: SlotId,
    cost: u64,
    enforced: bool,
}

/// A request's checks: on the stack for the usual few rules.
type Inputs = SmallVec<[CheckInput; INLINE_RULES]>;

/// Quota a request holds until it ends (concurrency rules), kept inline for one or two rules.
type Holds = SmallVec<[(QuotaRef, Hold); 2]>;

/// A key's allowance to refill from the quota service.
struct Refill {
    rule: usize,
    slot: SlotId,
    key: u128,
    used: u64,
}

struct Waiting {
    context_id: u32,
    deadline_ms: u64,
    inputs: Inputs,
}

/// The quota a response describes in its rate-limit headers (rendered only when they are added).
#[derive(Debug, Clone, Copy)]
struct QuotaReport {
    which: QuotaRef,
    remaining: u64,
    reset_secs: u64,
}

/// What an admitted request takes along.
#[derive(Default)]
struct Admitted {
    report: Option<QuotaReport>,
    holds: Holds,
    delay_ns: u64,
}

/// Why a request is refused, and what its 429 says.
struct Rejection {
    /// The refusing rule: its response and its `x-tollgate-rule`.
    rule: usize,
    quota: Option<QuotaReport>,
    retry_after_secs: Option<u64>,
}

impl Rejection {
    /// A global rule's refusal by failure mode `deny`: retry once the quota service may be back.
    fn failure_mode(rule: usize, service: Option<&QuotaService>) -> Self {
        let retry_ms = service.map_or(1_000, |q| q.retry_ms);
        Self {
            rule,
            quota: None,
            retry_after_secs: Some(retry_ms.div_ceil(1_000).max(1)),
        }
    }
}

/// The decision for a request.
enum Step {
    Admit(Admitted),
    Reject(Rejection),
    Wait,
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

/// A stat: its place in this worker's [`COUNTS`], or nothing if the host refused to define it
/// (the count is then lost).
#[derive(Clone, Copy)]
struct Metric(Option<usize>);

impl Metric {
    fn define(kind: MetricType, name: &str) -> Self {
        let Ok(id) = hostcalls::define_metric(kind, name)
            .map_err(|s| warn!("cannot define metric {name}: {s:?}"))
        else {
            return Self(None);
        };
        // A reload defines the same stats again: the host gives the same id, keep one entry.
        Self(Some(COUNTS.with(|c| {
            let mut c = c.borrow_mut();
            c.iter()
                .position(|(known, _)| *known == id)
                .unwrap_or_else(|| {
                    c.push((id, 0));
                    c.len() - 1
                })
        })))
    }

    fn add(self, n: i64) {
        if let Some(i) = self.0 {
            COUNTS.with(|c| {
                if let Some((_, pending)) = c.borrow_mut().get_mut(i) {
                    *pending = pending.saturating_add(n);
                }
            });
        }
    }

    fn bump(self) {
        self.add(1);
    }
}

/// Hand this worker's pending counts to the host (on every tick).
fn flush_metrics() {
    COUNTS.with(|c| {
        for (id, pending) in c.borrow_mut().iter_mut().filter(|(_, n)| *n != 0) {
            // A failed increment only loses a count; nothing to do about it here.
            let _ = hostcalls::increment_metric(*id, *pending);
            *pending = 0;
        }
    });
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
    /// Global rules: requests decided by the failure mode or provisional quota.
    fallback: Metric,
    /// Global rules: requests that waited for quota.
    waited: Metric,
    /// Concurrency rules only: requests in flight, weighted by cost.
    in_flight: Metric,
    /// Token buckets: stashed tokens a worker did not spend in time and gave back.
    stash_returned: Metric,
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
            fallback: counter("fallback"),
            waited: counter("waited"),
            stash_returned: counter("stash_returned"),
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
    /// This process's name at the quota service.
    instance: String,
    quota_calls: Metric,
    quota_failures: Metric,
    quota_granted: Metric,
    /// Requests currently waiting for global quota in this process.
    quota_waiting: Metric,
    /// This worker's token stashes (token buckets with `worker_batch`).
    stash: RefCell<StashTable>,
    /// Tokens in this process's stashes, as of the last tick (summed over workers).
    stash_held: Metric,
    /// What this worker last added to `stash_held`.
    stash_reported: Cell<i64>,
}

impl Drop for Loaded {
    fn drop(&mut self) {
        // A new configuration replaced this one: stashed tokens go back rather than being lost.
        return_stashes(self, u64::MAX);
    }
}

#[derive(Default)]
struct TollgateRoot {
    loaded: Option<Rc<Loaded>>,
}

impl Context for TollgateRoot {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let Some(refills) = IN_FLIGHT.with(|f| f.borrow_mut().remove(&token_id)) else {
            return;
        };
        let Some(loaded) = &self.loaded else {
            return;
        };
        let grants = read_lease_response(num_headers, body_size, refills.len());
        let now_ms = now_ns().unwrap_or(0) / 1_000_000;
        let Some(grants) = grants else {
            warn!("quota service call failed: global rules apply their failure mode");
            loaded.quota_failures.bump();
            fail_refills(loaded, &refills, now_ms);
            return;
        };
        for (refill, grant) in refills.iter().zip(&grants.items) {
            let Some(global) = loaded
                .config
                .rules
                .get(refill.rule)
                .and_then(|r| r.global.as_ref())
            else {
                continue;
            };
            loaded
                .quota_granted
                .add(i64::try_from(grant.granted).unwrap_or(i64::MAX));
            // Nothing granted: ask again once a token may have come back.
            let retry_ms = (global.per_ms / global.requests).clamp(1, grant.reset_ms.max(1));
            update_allowance(loaded, refill, |state| {
                LeaseAllowance::grant(state, now_ms, grant.granted, grant.ttl_ms, retry_ms)
            });
        }
    }
}

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
        for rule in &config.rules {
            if let Some(g) = &rule.global {
                if let Err(e) = g.fallback.table.initialize(&SharedData) {
                    error!("cannot create the slots of rule {}: {e:?}", rule.name);
                    return false;
                }
            }
        }
        let holds_requests = config
            .quotas()
            .any(|(_, q)| matches!(q.limit, Limit::LeakyBucket(_) | Limit::Lease(_)));
        let tick = if holds_requests { TICK } else { STATS_TICK };
        if let Err(s) = hostcalls::set_tick_period(tick) {
            error!("cannot set the tick period (held requests, stashes, stats): {s:?}");
            return false;
        }
        let metrics = config.rules.iter().map(RuleMetrics::define).collect();
        info!("configuration loaded: {}", config.summary());
        self.loaded = Some(Rc::new(Loaded {
            config,
            metrics,
            held: Metric::define(MetricType::Gauge, "tollgate.queue.held"),
            release_errors: Metric::define(MetricType::Counter, "tollgate.release_errors"),
            instance: instance_id(),
            quota_calls: Metric::define(MetricType::Counter, "tollgate.quota.calls"),
            quota_failures: Metric::define(MetricType::Counter, "tollgate.quota.failures"),
            quota_granted: Metric::define(MetricType::Counter, "tollgate.quota.granted"),
            quota_waiting: Metric::define(MetricType::Gauge, "tollgate.quota.waiting"),
            stash: RefCell::new(StashTable::default()),
            stash_held: Metric::define(MetricType::Gauge, "tollgate.stash.held"),
            stash_reported: Cell::new(0),
        }));
        true
    }

    fn on_tick(&mut self) {
        let Some(now) = now_ns() else {
            return;
        };
        if let Some(loaded) = self.loaded.clone() {
            return_stashes(&loaded, now);
            send_refills(&loaded);
            retry_waiting(&loaded, now);
        }
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
        flush_metrics();
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        #[cfg(feature = "probe")]
        let _t = probe::start("create");
        // Always a context (the SDK panics on None); without a configuration it passes requests.
        Some(Box::new(TollgateHttp {
            context_id,
            loaded: self.loaded.clone(),
            report: None,
            holds: Holds::new(),
            held_until: None,
            strict: None,
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
        #[cfg(feature = "probe")]
        let _t = probe::start("client_address");
        String::from_utf8(source_address()?).ok()
    }
}

// The ABI's property read, called directly for the client address: the SDK's `get_property`
// builds the path in two heap vectors on every call (and panics on a status it does not know),
// while this path is a constant.
#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_get_property(
        path_data: *const u8,
        path_size: usize,
        return_value_data: *mut *mut u8,
        return_value_size: *mut usize,
    ) -> u32;
}

/// `source.address`, as the host writes it (`ip:port`).
fn source_address() -> Option<Vec<u8>> {
    // Path segments are separated by NUL bytes.
    const PATH: &[u8] = b"source\0address";
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: the path is valid for its length; the host writes the two out-pointers only.
    let status = unsafe { proxy_get_property(PATH.as_ptr(), PATH.len(), &mut data, &mut size) };
    if status != 0 || data.is_null() {
        return None;
    }
    // SAFETY: on success the host hands over `size` bytes it allocated through the SDK's
    // `proxy_on_memory_allocate` (a boxed `[u8]` of exactly that length): ours to own and free.
    Some(unsafe { Vec::from_raw_parts(data, size, size) })
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

/// Which quota a check runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum QuotaRef {
    /// The rule's own.
    Rule(usize),
    /// An override's own limit.
    Override(usize, usize),
    /// A global rule's local stand-in (failure mode `local`, provisional quota).
    Fallback(usize),
}

impl QuotaRef {
    fn rule(self) -> usize {
        match self {
            Self::Rule(i) | Self::Override(i, _) | Self::Fallback(i) => i,
        }
    }

    /// The quota's name in worker stashes (fallback quotas take no batches).
    fn stash_id(self) -> Option<u32> {
        let (rule, sub) = match self {
            Self::Rule(i) => (i, 0),
            Self::Override(i, j) => (i, j.checked_add(1)?),
            Self::Fallback(_) => return None,
        };
        let (rule, sub) = (u16::try_from(rule).ok()?, u16::try_from(sub).ok()?);
        Some(u32::from(rule) << 16 | u32::from(sub))
    }

    fn from_stash_id(id: u32) -> Self {
        let (rule, sub) = ((id >> 16) as usize, (id & 0xffff) as usize);
        match sub {
            0 => Self::Rule(rule),
            j => Self::Override(rule, j - 1),
        }
    }
}

/// Give back to their buckets the tokens this worker stashed and did not spend in time (all of
/// them with `u64::MAX`).
fn return_stashes(loaded: &Loaded, now: u64) {
    let (leftovers, held) = {
        let mut stash = loaded.stash.borrow_mut();
        let leftovers = stash.expired(now);
        (leftovers, i64::try_from(stash.held()).unwrap_or(i64::MAX))
    };
    let reported = loaded.stash_reported.replace(held);
    if held != reported {
        loaded.stash_held.add(held - reported);
    }
    for l in leftovers {
        return_leftover(
            loaded,
            QuotaRef::from_stash_id(l.quota),
            l.slot,
            l.tokens,
            now,
        );
    }
}

fn return_leftover(loaded: &Loaded, which: QuotaRef, slot: SlotId, tokens: u64, now: u64) {
    let Some(quota) = quota_of(&loaded.config, which) else {
        return;
    };
    match return_stash(&SharedData, &quota.limit, &quota.table, slot, tokens, now) {
        Ok(()) => loaded.metrics[which.rule()]
            .stash_returned
            .add(i64::try_from(tokens).unwrap_or(i64::MAX)),
        // Lost tokens only make the key stricter until its bucket refills.
        Err(e) => debug!("stashed tokens not returned: {e:?}"),
    }
}

fn quota_of(config: &Config, which: QuotaRef) -> Option<&Quota> {
    let rule = config.rules.get(which.rule())?;
    match which {
        QuotaRef::Rule(_) => Some(&rule.quota),
        QuotaRef::Override(_, j) => match &rule.overrides.get(j)?.action {
            OverrideAction::Limit(q) => Some(q),
            _ => None,
        },
        QuotaRef::Fallback(_) => rule.global.as_ref().map(|g| &g.fallback),
    }
}

/// This process's name at the quota service: made once per process (shared by its workers).
fn instance_id() -> String {
    const KEY: &str = "tollgate.instance";
    if let Ok(Some((id, _))) = SharedData.read(KEY) {
        return String::from_utf8_lossy(&id).into_owned();
    }
    let id = format!("envoy-{:x}", now_ns().unwrap_or(0));
    // Whoever writes first wins; everyone then reads the winner's.
    let _ = SharedData.write(KEY, id.as_bytes(), 0);
    match SharedData.read(KEY) {
        Ok(Some((id, _))) => String::from_utf8_lossy(&id).into_owned(),
        _ => id,
    }
}

/// The answer to a lease call, if it is a well-formed one for `items` items.
fn read_lease_response(
    num_headers: usize,
    body_size: usize,
    items: usize,
) -> Option<LeaseResponse> {
    // A failed call (refused, reset, timed out) arrives with no headers at all, and asking the
    // host for one then is an error the SDK turns into a panic: look only if there are some.
    if num_headers == 0 {
        return None;
    }
    let status = hostcalls::get_map_value(MapType::HttpCallResponseHeaders, ":status")
        .ok()
        .flatten();
    if status.as_deref() != Some("200") {
        warn!(
            "quota service answered status {}",
            status.as_deref().unwrap_or("none")
        );
        return None;
    }
    let body = if body_size > 0 {
        hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
            .ok()
            .flatten()?
    } else {
        return None;
    };
    serde_json::from_slice::<LeaseResponse>(&body)
        .map_err(|e| warn!("malformed quota service answer: {e}"))
        .ok()
        .filter(|r| r.items.len() == items)
}

/// Start a lease call; the answer comes to the calling context's `on_http_call_response`.
fn call_quota_service(loaded: &Loaded, items: Vec<LeaseItem>) -> Option<u32> {
    let service = loaded.config.quota_service.as_ref()?;
    let body = serde_json::to_vec(&LeaseRequest {
        instance: loaded.instance.clone(),
        items,
    })
    .map_err(|e| error!("cannot encode a lease request: {e}"))
    .ok()?;
    let auth = service.token.as_ref().map(|t| format!("Bearer {t}"));
    let mut headers = vec![
        (":method", "POST"),
        (":path", "/v1/lease"),
        (":authority", service.authority.as_str()),
        ("content-type", "application/json"),
    ];
    if let Some(auth) = &auth {
        headers.push(("authorization", auth.as_str()));
    }
    let timeout = Duration::from_millis(service.timeout_ms);
    loaded.quota_calls.bump();
    match hostcalls::dispatch_http_call(&service.upstream, headers, Some(&body), vec![], timeout) {
        Ok(token) => Some(token),
        Err(s) => {
            warn!(
                "cannot call the quota service ({}): {s:?}",
                service.upstream
            );
            loaded.quota_failures.bump();
            None
        }
    }
}

/// The lease item asking a global rule's quota for `wanted` tokens of `key`.
fn lease_item(rule: &Rule, key: u128, wanted: u64, used: u64) -> Option<LeaseItem> {
    let global = rule.global.as_ref()?;
    Some(LeaseItem {
        rule: rule.name.clone(),
        limit_id: global.limit_id.clone(),
        key: format!("{key:032x}"),
        requests: global.requests,
        per_ms: global.per_ms,
        burst: global.burst,
        wanted,
        used,
    })
}

/// Send this VM's claimed refills in one call.
fn send_refills(loaded: &Loaded) {
    let refills = PENDING.with(|p| std::mem::take(&mut *p.borrow_mut()));
    if refills.is_empty() {
        return;
    }
    let items: Vec<LeaseItem> = refills
        .iter()
        .filter_map(|r| {
            let rule = loaded.config.rules.get(r.rule)?;
            let Limit::Lease(lease) = rule.quota.limit else {
                return None;
            };
            lease_item(rule, r.key, lease.lease_size, r.used)
        })
        .collect();
    match call_quota_service(loaded, items) {
        Some(token) => IN_FLIGHT.with(|f| {
            f.borrow_mut().insert(token, refills);
        }),
        None => fail_refills(loaded, &refills, now_ns().unwrap_or(0) / 1_000_000),
    }
}

fn fail_refills(loaded: &Loaded, refills: &[Refill], now_ms: u64) {
    let retry_ms = loaded
        .config
        .quota_service
        .as_ref()
        .map_or(1_000, |q| q.retry_ms);
    for refill in refills {
        update_allowance(loaded, refill, |state| {
            LeaseAllowance::fail(state, now_ms, retry_ms)
        });
    }
}

/// Rewrite the allowance of the refilled key's slot (if it still holds that key).
fn update_allowance(
    loaded: &Loaded,
    refill: &Refill,
    f: impl Fn(&tollgate_core::algorithm::State) -> tollgate_core::algorithm::State,
) {
    let Some(rule) = loaded.config.rules.get(refill.rule) else {
        return;
    };
    let key = rule.quota.table.store_key(refill.slot.group);
    for _ in 0..tollgate_core::limiter::MAX_RELEASE_ATTEMPTS {
        let Ok(Some((bytes, cas))) = SharedData.read(key.as_str()) else {
            return;
        };
        let mut group = Group::decode(&bytes);
        let Some(slot) = group.slots.iter_mut().find(|s| s.tag == refill.slot.tag) else {
            // The slot went to another key meanwhile: its grant is lost (stricter, never looser).
            debug!("rule {}: refilled key no longer has a slot", rule.name);
            return;
        };
        slot.state = f(&slot.state);
        if SharedData.write(key.as_str(), &group.encode(), cas) != Err(StoreError::CasMismatch) {
            return;
        }
    }
}

/// Decide again the requests waiting for global quota; past their deadline, the failure mode.
fn retry_waiting(loaded: &Loaded, now: u64) {
    let waiting = WAITING.with(|w| std::mem::take(&mut *w.borrow_mut()));
    if waiting.is_empty() {
        return;
    }
    let mut still = Vec::new();
    for mut w in waiting {
        let timed_out = now / 1_000_000 >= w.deadline_ms;
        match evaluate(loaded, &mut w.inputs, now, timed_out) {
            Step::Wait => still.push(w),
            step => {
                loaded.quota_waiting.add(-1);
                finish_paused(loaded, w.context_id, step, now);
            }
        }
    }
    WAITING.with(|w| w.borrow_mut().extend(still));
}

/// Carry out a decision for a paused request from the root context.
fn finish_paused(loaded: &Loaded, context_id: u32, step: Step, now: u64) {
    if hostcalls::set_effective_context(context_id).is_err() {
        // The stream is gone; give back what the decision took.
        if let Step::Admit(a) = step {
            release_holds(loaded, a.holds, now);
        }
        return;
    }
    match step {
        Step::Admit(a) => {
            let delay = a.delay_ns;
            RESUMED.with(|r| r.borrow_mut().insert(context_id, a));
            if delay > 0 {
                HELD.with(|held| {
                    held.borrow_mut()
                        .insert((now.saturating_add(delay), context_id))
                });
                loaded.held.bump();
            } else if let Err(s) = hostcalls::resume_http_request() {
                debug!("cannot resume request {context_id}: {s:?}");
            }
        }
        Step::Reject(r) => reject(&loaded.config, &r),
        Step::Wait => {}
    }
}

fn response_of(config: &Config, rule: usize) -> &Response {
    config
        .rules
        .get(rule)
        .and_then(|r| r.response.as_ref())
        .unwrap_or(&config.response)
}

fn release_holds(loaded: &Loaded, holds: Holds, now: u64) {
    for (which, hold) in holds {
        let Some(quota) = quota_of(&loaded.config, which) else {
            continue;
        };
        loaded.metrics[which.rule()]
            .in_flight
            .add(-i64::try_from(hold.cost).unwrap_or(i64::MAX));
        if let Err(e) = release(&SharedData, &quota.limit, &quota.table, &hold, now) {
            loaded.release_errors.bump();
            error!(
                "rule {}: in-flight count not released: {e:?}",
                loaded.config.rules[which.rule()].name
            );
        }
    }
}

/// Decide a request from its checks. Global rules without quota yet wait, or (when their source
/// failed, or after `timed_out`) follow the failure mode, which may rewrite `inputs`.
fn evaluate(loaded: &Loaded, inputs: &mut Inputs, now: u64, timed_out: bool) -> Step {
    let config = &loaded.config;
    loop {
        let Some(outcome) = decide(loaded, inputs, now) else {
            return Step::Admit(Admitted::default());
        };
        for (input, result) in inputs.iter().zip(&outcome.checks) {
            if result.refill {
                // Roughly what the key spent of its last lease: the service's demand signal.
                let used = match (
                    result.verdict,
                    quota_of(config, input.which).map(|q| q.limit),
                ) {
                    (Verdict::Allowed { remaining, .. }, Some(Limit::Lease(l))) => {
                        l.lease_size.saturating_sub(remaining)
                    }
                    _ => 0,
                };
                PENDING.with(|p| {
                    p.borrow_mut().push(Refill {
                        rule: input.which.rule(),
                        slot: input.slot,
                        key: input.key,
                        used,
                    })
                });
            }
        }
        if outcome.admitted || outcome.rejected_by.is_some() {
            return conclude(loaded, inputs, &outcome);
        }
        // Undecided: some enforced global rule has no quota (yet).
        let service = config.quota_service.as_ref();
        let failure = service.map_or(FailureMode::Allow, |q| q.failure_mode);
        let provisional = service.is_some_and(|q| q.first_lease == FirstLease::Provisional);
        let mut rewritten = false;
        let mut drop = Vec::new();
        for (n, result) in outcome.checks.iter().enumerate() {
            let input = &mut inputs[n];
            if !input.enforced {
                continue;
            }
            let fallback = match result.verdict {
                Verdict::Fallback => true,
                Verdict::Waiting => timed_out || provisional,
                _ => continue,
            };
            if !fallback {
                continue;
            }
            let rule = input.which.rule();
            loaded.metrics[rule].fallback.bump();
            let mode = if result.verdict == Verdict::Waiting && provisional && !timed_out {
                FailureMode::Local
            } else {
                failure
            };
            match mode {
                FailureMode::Allow => drop.push(n),
                FailureMode::Deny => {
                    loaded.metrics[rule].limited.bump();
                    return Step::Reject(Rejection::failure_mode(rule, service));
                }
                FailureMode::Local => {
                    if let Some(g) = &config.rules[rule].global {
                        input.which = QuotaRef::Fallback(rule);
                        input.slot = g.fallback.table.locate_hash(input.key);
                    }
                }
            }
            rewritten = true;
        }
        for n in drop.into_iter().rev() {
            inputs.remove(n);
        }
        if !rewritten {
            return Step::Wait;
        }
        if inputs.is_empty() {
            return Step::Admit(Admitted::default());
        }
    }
}

/// The stash name of an input's quota if this worker may stash for it: an enforced check of a
/// rule with `worker_batch`.
fn stashed_quota(config: &Config, input: &CheckInput) -> Option<u32> {
    let batches = config.rules[input.which.rule()].worker_batch > 0;
    input.which.stash_id().filter(|_| batches && input.enforced)
}

/// Decide `inputs` as one all-or-nothing outcome aligned with them: from this worker's stashes
/// where they can (no shared data), from the shared slots otherwise. `None` if a quota is gone.
fn decide(loaded: &Loaded, inputs: &[CheckInput], now: u64) -> Option<Outcome> {
    let config = &loaded.config;
    let mut stash = loaded.stash.borrow_mut();
    let mut results = CheckOutcomes::new();
    let mut checks: SmallVec<[Check; INLINE_RULES]> = SmallVec::new();
    let mut asked: SmallVec<[usize; INLINE_RULES]> = SmallVec::new();
    let mut refused = None;
    // Dry-run rules count would-be refusals of every request: a remembered refusal would hide them.
    let any_dry_run = inputs.iter().any(|i| !i.enforced);
    for (n, input) in inputs.iter().enumerate() {
        let quota = quota_of(config, input.which)?;
        let max_batch = config.rules[input.which.rule()].worker_batch;
        let lookup = match stashed_quota(config, input) {
            Some(id) => stash.lookup(id, input.slot, input.cost, max_batch, now),
            None => Lookup::Ask { batch: 0 },
        };
        let lookup = match lookup {
            Lookup::Refused { .. } if any_dry_run => Lookup::Ask { batch: 0 },
            other => other,
        };
        let verdict = match lookup {
            Lookup::Spent {
                remaining,
                reset_ns,
            } => Verdict::Allowed {
                remaining,
                reset_ns,
                delay_ns: 0,
            },
            Lookup::Refused {
                retry_after_ns,
                reset_ns,
            } => {
                refused.get_or_insert(n);
                Verdict::Limited {
                    retry_after_ns,
                    remaining: 0,
                    reset_ns,
                }
            }
            Lookup::Ask { batch } => {
                asked.push(n);
                checks.push(Check {
                    limit: &quota.limit,
                    table: &quota.table,
                    slot: input.slot,
                    cost: input.cost,
                    enforced: input.enforced,
                    batch,
                });
                Verdict::Skipped
            }
        };
        results.push(CheckOutcome {
            verdict,
            slot: SlotEvent::Own,
            hold: None,
            refill: false,
            stashed: 0,
        });
    }
    let mut outcome = Outcome {
        admitted: refused.is_none(),
        rejected_by: refused,
        checks: results,
    };
    if refused.is_none() && !checks.is_empty() {
        let shared = admit(&SharedData, &checks, now);
        outcome.admitted = shared.admitted;
        outcome.rejected_by = shared.rejected_by.map(|i| asked[i]);
        for (&n, result) in asked.iter().zip(shared.checks) {
            outcome.checks[n] = result;
        }
    }
    for (n, (input, result)) in inputs.iter().zip(&outcome.checks).enumerate() {
        let Some(id) = stashed_quota(config, input) else {
            continue;
        };
        let was_asked = asked.contains(&n);
        match result.verdict {
            Verdict::Allowed {
                remaining,
                reset_ns,
                ..
            } if outcome.admitted && was_asked => {
                let kept = stash.stash(id, input.slot, result.stashed, remaining, reset_ns, now);
                if !kept && result.stashed > 0 {
                    return_leftover(loaded, input.which, input.slot, result.stashed, now);
                }
            }
            // Spent from the stash, but the request goes no further: back into the stash.
            Verdict::Allowed { .. } if !outcome.admitted && !was_asked => {
                stash.put_back(id, input.slot, input.cost)
            }
            Verdict::Limited {
                retry_after_ns,
                reset_ns,
                ..
            } if was_asked => {
                stash.refused(id, input.slot, input.cost, retry_after_ns, reset_ns, now)
            }
            _ => {}
        }
    }
    Some(outcome)
}

/// Metrics, logs and headers of a decided request.
fn conclude(loaded: &Loaded, inputs: &[CheckInput], outcome: &Outcome) -> Step {
    let config = &loaded.config;
    // The quota to report: the refusing rule, else the one with the least left.
    let mut report: Option<(QuotaRef, u64, u64)> = None;
    let mut admitted = Admitted::default();
    for (n, result) in outcome.checks.iter().enumerate() {
        let (input, which) = (&inputs[n], inputs[n].which);
        let (rule, metrics) = (&config.rules[which.rule()], &loaded.metrics[which.rule()]);
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
                    if d > 0 && input.enforced {
                        metrics.delayed.bump();
                        admitted.delay_ns = admitted.delay_ns.max(d);
                    }
                }
                (remaining, ceil_secs(reset_ns))
            }
            Verdict::Limited {
                retry_after_ns,
                remaining,
                ..
            } => {
                if input.enforced {
                    metrics.limited.bump();
                } else {
                    metrics.dry_run_limited.bump();
                    info!(
                        "dry run: rule {} would reject (key {:016x})",
                        rule.name, input.slot.tag
                    );
                }
                (remaining, retry_after_secs(retry_after_ns))
            }
            Verdict::Contended => {
                metrics.contended.bump();
                if input.enforced {
                    metrics.limited.bump();
                }
                (0, 1)
            }
            Verdict::Unavailable => {
                metrics.store_errors.bump();
                continue;
            }
            // Dry-run global rules without quota yet: no opinion; or not asked.
            Verdict::Waiting | Verdict::Fallback | Verdict::Skipped => continue,
        };
        debug!(
            "rule {} key {:016x} group {} {:?} {:?}",
            rule.name, input.slot.tag, input.slot.group, result.verdict, result.slot
        );
        if let Some(hold) = result.hold {
            metrics
                .in_flight
                .add(i64::try_from(hold.cost).unwrap_or(i64::MAX));
            admitted.holds.push((which, hold));
        }
        let refusing = outcome.rejected_by == Some(n);
        let tighter =
            report.is_none_or(|(_, r, t)| remaining < r || (remaining == r && reset_secs > t));
        if refusing || (outcome.admitted && tighter) {
            report = Some((which, remaining, reset_secs));
        }
    }
    let report = report.map(|(which, remaining, reset_secs)| QuotaReport {
        which,
        remaining,
        reset_secs,
    });
    if let (false, Some(r)) = (outcome.admitted, report) {
        return Step::Reject(Rejection {
            rule: r.which.rule(),
            quota: Some(r),
            retry_after_secs: Some(r.reset_secs),
        });
    }
    admitted.report = report;
    Step::Admit(admitted)
}

struct TollgateHttp {
    context_id: u32,
    loaded: Option<Rc<Loaded>>,
    /// The quota to describe in the upstream's response headers.
    report: Option<QuotaReport>,
    /// Quota held until the stream ends (concurrency rules).
    holds: Holds,
    /// Set while the request is held by a leaky bucket.
    held_until: Option<u64>,
    /// Strict mode: the checks waiting for this request's own call to the quota service.
    strict: Option<Strict>,
}

/// A request whose global rules are asked one call per request (strict mode).
struct Strict {
    token: Option<u32>,
    /// Local rules, decided once the global ones have granted.
    locals: Inputs,
    globals: Inputs,
}

impl Context for TollgateHttp {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let ours = self
            .strict
            .as_ref()
            .is_some_and(|s| s.token == Some(token_id));
        if !ours {
            return;
        }
        let items = self.strict.as_ref().map_or(0, |s| s.globals.len());
        let grants = read_lease_response(num_headers, body_size, items);
        self.finish_strict(grants, true);
    }
}

impl HttpContext for TollgateHttp {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        #[cfg(feature = "probe")]
        let _t = probe::start("request");
        // What a timer adds of its own: subtracted by the benchmark report.
        #[cfg(feature = "probe")]
        drop(probe::start("timer"));
        let Some(loaded) = self.loaded.clone() else {
            return Action::Continue;
        };
        let config = &loaded.config;
        let request = Request::new(&HostRequest, config.trusted_hops);
        let mut inputs = Inputs::new();
        for (i, rule) in config.rules.iter().enumerate() {
            if !request.matches(&rule.matcher) {
                continue;
            }
            let Some(key) = request.key(&rule.key, rule.missing_key) else {
                continue;
            };
            let overridden = rule.overrides.iter().position(|o| o.key[..] == key[..]);
            let (which, quota) = match overridden.map(|j| (j, &rule.overrides[j].action)) {
                None => (QuotaRef::Rule(i), &rule.quota),
                Some((_, OverrideAction::Unlimited)) => continue,
                Some((_, OverrideAction::Block)) => {
                    if rule.dry_run {
                        loaded.metrics[i].dry_run_limited.bump();
                        info!("dry run: rule {} would block its key", rule.name);
                        continue;
                    }
                    loaded.metrics[i].blocked.bump();
                    let block = Rejection {
                        rule: i,
                        quota: None,
                        retry_after_secs: None,
                    };
                    reject(config, &block);
                    return Action::Pause;
                }
                Some((j, OverrideAction::Limit(q))) => (QuotaRef::Override(i, j), q),
            };
            let key = key_hash(&key);
            inputs.push(CheckInput {
                which,
                slot: quota.table.locate_hash(key),
                key,
                cost: cost_of(&rule.cost, &HostRequest),
                enforced: !rule.dry_run,
            });
        }
        if inputs.is_empty() {
            return Action::Continue;
        }
        let Some(now) = now_ns() else {
            warn!("the host gave no usable time; request not limited");
            return Action::Continue;
        };
        let strict = config.quota_service.as_ref().is_some_and(|q| q.strict);
        let has_global = inputs
            .iter()
            .any(|i| i.enforced && config.rules[i.which.rule()].global.is_some());
        if strict && has_global {
            let (globals, locals): (Inputs, Inputs) = inputs
                .into_iter()
                .partition(|i| config.rules[i.which.rule()].global.is_some());
            let items = globals
                .iter()
                .filter_map(|g| lease_item(&config.rules[g.which.rule()], g.key, g.cost, g.cost))
                .collect();
            let token = call_quota_service(&loaded, items);
            self.strict = Some(Strict {
                token,
                locals,
                globals,
            });
            if token.is_none() {
                return self.finish_strict(None, false);
            }
            return Action::Pause;
        }
        #[cfg(feature = "probe")]
        let evaluating = probe::start("evaluate");
        let step = evaluate(&loaded, &mut inputs, now, false);
        #[cfg(feature = "probe")]
        drop(evaluating);
        if let Step::Wait = step {
            for input in &inputs {
                loaded.metrics[input.which.rule()].waited.bump();
            }
            let timeout = config.quota_service.as_ref().map_or(200, |q| q.timeout_ms);
            WAITING.with(|w| {
                w.borrow_mut().push(Waiting {
                    context_id: self.context_id,
                    deadline_ms: now / 1_000_000 + timeout,
                    inputs,
                })
            });
            loaded.quota_waiting.bump();
            return Action::Pause;
        }
        self.carry_out(&loaded, step, now, false)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        #[cfg(feature = "probe")]
        let _t = probe::start("response");
        self.take_resumed();
        let (Some(report), Some(loaded)) = (self.report.take(), &self.loaded) else {
            return Action::Continue;
        };
        HEADERS.with(|h| {
            let mut h = h.borrow_mut();
            h.clear();
            push_quota(&mut h, &loaded.config, report);
            for (name, value) in h.iter() {
                if let Err(s) = hostcalls::add_map_value(MapType::HttpResponseHeaders, name, value)
                {
                    debug!("cannot add response header {name}: {s:?}");
                }
            }
        });
        Action::Continue
    }

    fn on_log(&mut self) {
        #[cfg(feature = "probe")]
        let _t = probe::start("log");
        self.end_of_stream();
    }
}

impl TollgateHttp {
    /// Strict mode: decide the request once its call answered (`None`: it failed), and carry the
    /// decision out: resume the request if it was `paused`, else return the action for it.
    fn finish_strict(&mut self, grants: Option<LeaseResponse>, paused: bool) -> Action {
        let (Some(loaded), Some(strict)) = (self.loaded.clone(), self.strict.take()) else {
            return Action::Continue;
        };
        let config = &loaded.config;
        let now = now_ns().unwrap_or(0);
        let mut inputs = strict.locals;
        let step = match grants {
            Some(answer) => {
                let short = strict
                    .globals
                    .iter()
                    .zip(&answer.items)
                    .find(|(g, grant)| grant.granted < g.cost);
                match short {
                    Some((g, grant)) => {
                        let rule = &config.rules[g.which.rule()];
                        loaded.metrics[g.which.rule()].limited.bump();
                        let global = rule.global.as_ref();
                        // The time `cost` tokens take to come back.
                        let wait_ms = global.map_or(1_000, |gl| {
                            g.cost.max(1).saturating_mul(gl.per_ms) / gl.requests
                        });
                        Step::Reject(Rejection {
                            rule: g.which.rule(),
                            quota: Some(QuotaReport {
                                which: QuotaRef::Rule(g.which.rule()),
                                remaining: grant.remaining,
                                reset_secs: ceil_secs(grant.reset_ms.saturating_mul(1_000_000)),
                            }),
                            retry_after_secs: Some(retry_after_secs(
                                wait_ms.saturating_mul(1_000_000),
                            )),
                        })
                    }
                    None => {
                        for g in &strict.globals {
                            loaded.metrics[g.which.rule()].allowed.bump();
                        }
                        evaluate(&loaded, &mut inputs, now, false)
                    }
                }
            }
            None => {
                loaded.quota_failures.bump();
                let service = config.quota_service.as_ref();
                let failure = service.map_or(FailureMode::Allow, |q| q.failure_mode);
                for g in &strict.globals {
                    loaded.metrics[g.which.rule()].fallback.bump();
                }
                match failure {
                    FailureMode::Allow => evaluate(&loaded, &mut inputs, now, false),
                    FailureMode::Deny => {
                        let rule = strict.globals.first().map_or(0, |g| g.which.rule());
                        Step::Reject(Rejection::failure_mode(rule, service))
                    }
                    FailureMode::Local => {
                        for g in strict.globals {
                            let rule = g.which.rule();
                            if let Some(gl) = &config.rules[rule].global {
                                inputs.push(CheckInput {
                                    which: QuotaRef::Fallback(rule),
                                    slot: gl.fallback.table.locate_hash(g.key),
                                    ..g
                                });
                            }
                        }
                        evaluate(&loaded, &mut inputs, now, false)
                    }
                }
            }
        };
        if let Step::Wait = step {
            // Strict inputs never wait (they hold no leased allowance): nothing to decide.
            if paused {
                let _ = hostcalls::resume_http_request();
            }
            return Action::Continue;
        }
        self.carry_out(&loaded, step, now, paused)
    }

    /// Admit (with its headers, holds and any leaky-bucket hold) or reject the request; resume it
    /// if it was `paused` and may go on. `Step::Wait` is the callers' business.
    fn carry_out(&mut self, loaded: &Loaded, step: Step, now: u64, paused: bool) -> Action {
        match step {
            Step::Admit(a) => {
                self.report = a.report;
                self.holds.extend(a.holds);
                if a.delay_ns > 0 {
                    let due = now.saturating_add(a.delay_ns);
                    HELD.with(|held| held.borrow_mut().insert((due, self.context_id)));
                    self.held_until = Some(due);
                    loaded.held.bump();
                    return Action::Pause;
                }
                if paused {
                    if let Err(s) = hostcalls::resume_http_request() {
                        debug!("cannot resume request {}: {s:?}", self.context_id);
                    }
                }
                Action::Continue
            }
            Step::Reject(r) => {
                reject(&loaded.config, &r);
                Action::Pause
            }
            Step::Wait => Action::Pause,
        }
    }

    /// Take over what a decision made on the tick left for this request.
    fn take_resumed(&mut self) {
        // Most requests were never paused: skip hashing their id into an empty map.
        let resumed = RESUMED.with(|r| {
            let mut r = r.borrow_mut();
            (!r.is_empty())
                .then(|| r.remove(&self.context_id))
                .flatten()
        });
        if let Some(a) = resumed {
            self.report = a.report;
            self.holds.extend(a.holds);
            if a.delay_ns > 0 {
                // Its hold was queued by the tick; the queue entry is found by due time.
                self.held_until = HELD.with(|held| {
                    held.borrow()
                        .iter()
                        .find(|(_, id)| *id == self.context_id)
                        .map(|(due, _)| *due)
                });
            }
        }
    }

    /// Give back held quota and leave the queues: however the stream ended, exactly once.
    fn end_of_stream(&mut self) {
        let Some(loaded) = self.loaded.clone() else {
            return;
        };
        self.take_resumed();
        if let Some(due) = self.held_until.take() {
            // Still queued means the client went away while held.
            if HELD.with(|held| held.borrow_mut().remove(&(due, self.context_id))) {
                loaded.held.add(-1);
            }
        }
        let id = self.context_id;
        let left = WAITING.with(|w| {
            let mut w = w.borrow_mut();
            let before = w.len();
            w.retain(|x| x.context_id != id);
            before != w.len()
        });
        if left {
            loaded.quota_waiting.add(-1);
        }
        if !self.holds.is_empty() {
            let now = now_ns().unwrap_or(0);
            release_holds(&loaded, std::mem::take(&mut self.holds), now);
        }
    }
}

impl Drop for TollgateHttp {
    fn drop(&mut self) {
        // Hosts that end a stream without the log callback still release what it held.
        self.end_of_stream();
    }
}

/// Refuse the request with its rule's response and headers saying why.
fn reject(config: &Config, rejection: &Rejection) {
    let response = response_of(config, rejection.rule);
    HEADERS.with(|h| {
        let mut h = h.borrow_mut();
        h.clear();
        if let Some(report) = rejection.quota {
            push_quota(&mut h, config, report);
        }
        if let Some(secs) = rejection.retry_after_secs {
            h.push_number("retry-after", secs);
        }
        if let Some(rule) = config.rules.get(rejection.rule) {
            h.push("x-tollgate-rule", &[&rule.name]);
        }
        let mut headers: Vec<(&str, &str)> = Vec::with_capacity(response.headers.len() + 8);
        headers.extend(
            response
                .headers
                .iter()
                .map(|(n, v)| (n.as_str(), v.as_str())),
        );
        for (name, value) in h.iter() {
            headers.push((name, value));
        }
        if let Err(s) =
            hostcalls::send_http_response(response.status, headers, Some(response.body.as_bytes()))
        {
            error!("cannot send the rejection: {s:?}");
        }
    });
}

/// The rate-limit headers describing `report`'s quota, in the configured format.
fn push_quota(headers: &mut HeaderSet, config: &Config, report: QuotaReport) {
    let (Some(rule), Some(quota)) = (
        config.rules.get(report.which.rule()),
        quota_of(config, report.which),
    ) else {
        return;
    };
    headers.push_quota(
        config.rate_limit_headers,
        &rule.name,
        quota.policy,
        report.remaining,
        report.reset_secs,
    );
}
