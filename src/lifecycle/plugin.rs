//! One configuration's state in one worker — what a root context owns: its engine, its paused
//! requests, its stats' host ids and the buffers it reuses. Two configurations in one VM (two
//! filters sharing a `vm_id`, several `proxy_wasm` directives) never share any of it.

use super::host::{Host, MetricKind};
use super::queues::Queues;
use super::quota_call;
use super::respond::{self, Scratch};
use crate::config::{Config, HostCaps, LogLevel, PaceBody};
use crate::engine::{read_answer, read_permit_answer, Call, Engine, Refusal, Step};
use crate::stats::{ProcessStat, RuleStat, Stat};
use log::{debug, info, warn};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use tollgate_core::slot::KeyPlacement;
use tollgate_core::CasStore;

/// How often a worker looks for held requests that are due: the spacing's resolution.
const TICK_MS: u32 = 5;
/// The tick otherwise: it returns unspent stashed tokens and hands the worker's stats over.
const STATS_TICK_MS: u32 = 10;
/// How long a request paused for its body waits for the first body callback before this worker
/// concludes that Envoy holds bodies back from paused requests.
const BODY_WAIT_NS: u64 = 2_000_000_000;
/// How long a body may stop coming before its request is decided without it.
const BODY_STALL_NS: u64 = 500_000_000;

/// A request paused for its body: since when, and when its last chunk came.
#[derive(Debug)]
struct BodyWait {
    since: u64,
    last_chunk: Option<u64>,
}

/// A stat's place at the host.
#[derive(Clone)]
struct Metric {
    id: u32,
    /// Gauges: the shared-data key holding the process-wide value (hosts differ in how gauges
    /// change, so every host is given absolute values).
    total_key: Option<String>,
}

pub struct Plugin<H: Host> {
    pub host: H,
    pub engine: RefCell<Engine>,
    pub queues: RefCell<Queues>,
    pub caps: HostCaps,
    /// This process's name at the quota service.
    pub instance: String,
    scratch: RefCell<Scratch>,
    rule_metrics: Vec<Vec<Option<Metric>>>,
    process_metrics: Vec<Option<Metric>>,
    /// Requests paused for their body (Envoy), by context id: a chunk finds its own without
    /// a look at the others.
    body_waits: RefCell<HashMap<u32, BodyWait>>,
    /// The bytes the bodies of those requests keep, together (at most `max_waiting_body_bytes`).
    body_bytes_kept: Cell<usize>,
    /// The host delivered a request body to this worker: it lets a request paused on its
    /// headers read its body.
    body_seen: Cell<bool>,
    body_warned: Cell<bool>,
}

impl<H: Host> Plugin<H> {
    /// Parse, check and set up a configuration: its slots and its stats. The error is the line
    /// to log.
    pub fn load(bytes: &[u8], host: H) -> Result<Self, String> {
        let caps = host.caps();
        let mut config = Config::parse(bytes).map_err(|e| format!("invalid configuration: {e}"))?;
        config
            .check_host(&caps)
            .map_err(|e| format!("invalid configuration: {e}"))?;
        config.fit_host(&caps);
        set_log_level(config.log_level);
        let mut engine = Engine::new(config, deployment_placement(&host));
        engine.hold_for_stashes(caps.resume_from_timer);
        engine.initialize(&host)?;
        let config = engine.config();
        let rule_metrics = config
            .rules
            .iter()
            .map(|rule| {
                RuleStat::ALL
                    .iter()
                    .map(|&stat| {
                        let wanted = match rule.guard() {
                            None => match stat {
                                RuleStat::InFlight => rule.holds_requests_open(),
                                RuleStat::SlotsHeld => rule.quota().is_some_and(|q| {
                                    matches!(q.limit, tollgate_core::Limit::PermitLease(_))
                                }),
                                // A byte limit decides no requests: its bytes and holds only.
                                s if rule.pace.is_some() => matches!(
                                    s,
                                    RuleStat::PacedBytes
                                        | RuleStat::HeldMs
                                        | RuleStat::DryRunLimited
                                        | RuleStat::StoreErrors
                                ),
                                RuleStat::PacedBytes | RuleStat::HeldMs => false,
                                s if s.is_settle() => rule.settle.is_some(),
                                s => !s.is_overload(),
                            },
                            Some(g) => rule_has(g, stat),
                        };
                        let name = format!("tollgate.rule.{}.{}", rule.name, stat.name());
                        let kind = if stat.is_absolute() {
                            Kind::Absolute
                        } else if stat.is_gauge() {
                            Kind::Gauge
                        } else {
                            Kind::Counter
                        };
                        wanted.then(|| define(&host, &name, kind)).flatten()
                    })
                    .collect()
            })
            .collect();
        let process_metrics = ProcessStat::ALL
            .iter()
            .map(|&stat| {
                let kind = if stat.is_gauge() {
                    Kind::Gauge
                } else {
                    Kind::Counter
                };
                define(&host, stat.name(), kind)
            })
            .collect();
        info!(
            "configuration loaded on {}: {}",
            caps.name,
            config.summary()
        );
        for warning in config.warnings() {
            log::warn!("{warning}");
        }
        let instance = instance_id(&host);
        Ok(Self {
            host,
            engine: RefCell::new(engine),
            queues: RefCell::new(Queues::default()),
            caps,
            instance,
            scratch: RefCell::new(Scratch::default()),
            rule_metrics,
            process_metrics,
            body_waits: RefCell::default(),
            body_bytes_kept: Cell::new(0),
            body_seen: Cell::new(false),
            body_warned: Cell::new(false),
        })
    }

    /// Request `id` pauses on its headers for its body (Envoy).
    pub fn awaits_body(&self, id: u32, now: u64) {
        self.body_waits.borrow_mut().insert(
            id,
            BodyWait {
                since: now,
                last_chunk: None,
            },
        );
    }

    /// A chunk of the body request `id` waits for came.
    pub fn body_chunk(&self, id: u32, now: u64) {
        self.body_seen.set(true);
        if let Some(w) = self.body_waits.borrow_mut().get_mut(&id) {
            w.last_chunk = Some(now);
        }
    }

    /// Request `id` waits for its body no more (decided, or gone).
    pub fn body_done(&self, id: u32) {
        self.body_waits.borrow_mut().remove(&id);
    }

    /// Room for `n` more bytes of waiting bodies on this worker: taken if there is (true).
    pub fn keep_body_bytes(&self, n: usize) -> bool {
        let max = self.engine.borrow().config().max_waiting_body_bytes;
        let kept = self.body_bytes_kept.get().saturating_add(n);
        if kept > max {
            return false;
        }
        self.body_bytes_kept.set(kept);
        self.add(
            ProcessStat::BodyBytesKept,
            i64::try_from(n).unwrap_or(i64::MAX),
        );
        true
    }

    /// `n` bytes of a waiting body are kept no more.
    pub fn release_body_bytes(&self, n: usize) {
        if n == 0 {
            return;
        }
        self.body_bytes_kept
            .set(self.body_bytes_kept.get().saturating_sub(n));
        self.add(
            ProcessStat::BodyBytesKept,
            -i64::try_from(n).unwrap_or(i64::MAX),
        );
    }

    /// Requests paused for their body that must be decided without it, taken: those whose body
    /// stopped coming (Envoy stops reading a client whose held body fills its buffer limit), and
    /// — while no body callback ever came to this worker — those that got none in 2 s: Envoy holds
    /// bodies back from a request paused on its headers unless the filter's
    /// `allow_on_headers_stop_iteration` is set (the first time, an error says so).
    pub fn stale_body_waits(&self, now: u64) -> Vec<u32> {
        let timeout = self.engine.borrow().config().request_body_timeout_ns;
        let mut waits = self.body_waits.borrow_mut();
        let seen = self.body_seen.get();
        let stale: Vec<u32> = waits
            .iter()
            .filter(|(_, w)| {
                // However it comes: a body dripped a byte at a time never stalls.
                now.saturating_sub(w.since) >= timeout
                    || match w.last_chunk {
                        Some(last) => now.saturating_sub(last) >= BODY_STALL_NS,
                        None => !seen && now.saturating_sub(w.since) >= BODY_WAIT_NS,
                    }
            })
            .map(|(&id, _)| id)
            .collect();
        if stale.is_empty() {
            return stale;
        }
        for id in &stale {
            waits.remove(id);
        }
        if !seen && !self.body_warned.replace(true) {
            log::error!(
                "a rule reads the request body, but Envoy delivered none to a request paused \
                 for it for {} s: set \"allow_on_headers_stop_iteration\": true in the wasm \
                 filter's config (Envoy 1.35 or later); until then such requests are decided \
                 without their body (a cost from the body is its max, body: key parts the \
                 \"unreadable\" value) after that wait",
                BODY_WAIT_NS.min(timeout) as f64 / 1e9
            );
        }
        stale
    }

    /// How often this configuration needs its tick, in milliseconds.
    pub fn tick_ms(&self) -> u32 {
        let engine = self.engine.borrow();
        let rules = &engine.config().rules;
        if rules.iter().any(|r| r.delays() || r.global().is_some()) {
            TICK_MS
        } else {
            STATS_TICK_MS
        }
    }

    /// The periodic work of one worker: return stashes, log dry runs, send claimed refills, decide waiting
    /// requests again, release held ones that are due, hand over stats.
    pub fn tick(&self) {
        let Some(now) = self.host.now_ns() else {
            return;
        };
        {
            let mut engine = self.engine.borrow_mut();
            engine.return_stashes(&self.host, now);
            engine.log_dry_runs(now);
            engine.merge_top(&self.host, now);
            if let Some(line) = engine.top_log_due(&self.host, now) {
                info!("{line}");
            }
        }
        self.send_refills(now);
        self.retry_waiting(now);
        let bodies = self.queues.borrow_mut().bodies_due(now);
        self.pass_on(bodies);
        let due = self.queues.borrow_mut().due(now);
        for id in due {
            // The stream may be gone already; then there is nothing to resume.
            if self.host.set_effective_context(id).is_ok() {
                if let Err(s) = self.host.continue_request() {
                    debug!("cannot resume held request {id}: {s}");
                }
            }
        }
        self.flush_stats();
    }

    /// Let held bodies go on (taken out of the queue already).
    fn pass_on(&self, bodies: Vec<(u32, PaceBody)>) {
        for (id, body) in bodies {
            if self.host.set_effective_context(id).is_ok() {
                let resumed = match body {
                    PaceBody::Response => self.host.continue_response(),
                    PaceBody::Request => self.host.continue_request(),
                };
                if let Err(s) = resumed {
                    debug!("cannot pass on the held body of {id}: {s}");
                }
            }
        }
    }

    /// Send the refills this worker's requests claimed, in one call from the root context (its
    /// answer is found by [`Self::sent`]).
    fn send_refills(&self, now: u64) {
        self.engine.borrow_mut().renew_permits(&self.host, now);
        let calls = self
            .engine
            .borrow_mut()
            .take_refills(&self.host, &self.instance, now);
        for call in calls {
            let (token, slots, refills) = match call {
                Call::Lease(refills, request) => (self.call(&request), false, refills),
                Call::Permits(refills, request) => (self.call_permits(&request), true, refills),
                // Its answer changes nothing here; if it fails, the tokens are lost (stricter).
                Call::GiveBack(request) => {
                    self.call(&request);
                    continue;
                }
            };
            let mut engine = self.engine.borrow_mut();
            match (token, slots) {
                (Some(token), _) => self.queues.borrow_mut().call_sent(token, slots, refills),
                (None, false) => engine.apply_grants(&self.host, &refills, None, now),
                (None, true) => engine.apply_permits(&self.host, &refills, None, now),
            }
        }
    }

    /// Start a lease call from the current context; `None` if it could not be made.
    pub fn call(&self, request: &tollgate_core::global::lease::LeaseRequest) -> Option<u32> {
        self.add(ProcessStat::QuotaCalls, 1);
        let engine = self.engine.borrow();
        quota_call::call(
            &self.host,
            engine.config().quota_service.as_ref()?,
            "/v1/lease",
            request,
        )
    }

    /// Start a slot call from the root context; `None` if it could not be made.
    fn call_permits(&self, request: &tollgate_core::global::permits::PermitRequest) -> Option<u32> {
        self.add(ProcessStat::QuotaCalls, 1);
        let engine = self.engine.borrow();
        quota_call::call(
            &self.host,
            engine.config().quota_service.as_ref()?,
            "/v1/slots",
            request,
        )
    }

    /// True if this configuration's root context sent the call `token`.
    pub fn sent(&self, token: u32) -> bool {
        self.queues.borrow().is_sent(token)
    }

    /// The answer to a refill call this configuration's root context sent.
    pub fn refills_answered(&self, token: u32, num_headers: usize, body_size: usize) {
        let Some((slots, refills)) = self.queues.borrow_mut().call_answered(token) else {
            return;
        };
        let now = self.host.now_ns().unwrap_or(0);
        let (status, body) = quota_call::answer_parts(&self.host, num_headers, body_size);
        let mut engine = self.engine.borrow_mut();
        if slots {
            let answer = read_permit_answer(status.as_deref(), body.as_deref(), refills.len());
            engine.apply_permits(&self.host, &refills, answer.as_ref(), now);
        } else {
            let answer = read_answer(status.as_deref(), body.as_deref(), refills.len());
            engine.apply_grants(&self.host, &refills, answer.as_ref(), now);
        }
    }

    /// Refuse the current request.
    pub fn refuse(&self, refusal: &Refusal) {
        let engine = self.engine.borrow();
        respond::refuse(
            &self.host,
            &engine,
            &mut self.scratch.borrow_mut(),
            &self.caps,
            refusal,
        );
    }

    /// Add the rate-limit headers of `report` to the current response.
    pub fn add_quota_headers(&self, report: crate::engine::QuotaReport) {
        let engine = self.engine.borrow();
        respond::add_quota_headers(&self.host, &engine, &mut self.scratch.borrow_mut(), report);
    }

    /// Decide again the requests waiting for global quota; past their deadline, the failure mode.
    fn retry_waiting(&self, now: u64) {
        let waiting = self.queues.borrow_mut().take_waiting();
        for mut w in waiting {
            let timed_out = now / 1_000_000 >= w.deadline_ms;
            let step = self
                .engine
                .borrow_mut()
                .evaluate(&self.host, &mut w.inputs, now, timed_out);
            match step {
                Step::Wait => self.queues.borrow_mut().wait(w),
                step => self.finish_paused(w.context_id, step, now),
            }
        }
    }

    /// Carry out, from the timer, a decision for a paused request (hosts that can resume from
    /// the timer only).
    fn finish_paused(&self, context_id: u32, step: Step, now: u64) {
        if self.host.set_effective_context(context_id).is_err() {
            // The stream is gone; give back what the decision took.
            if let Step::Admit(a) = step {
                self.engine.borrow_mut().release(&self.host, a.holds, now);
            }
            return;
        }
        match step {
            Step::Admit(a) => {
                let delay = a.delay_ns;
                self.queues.borrow_mut().resumed(context_id, a);
                if delay > 0 {
                    self.queues
                        .borrow_mut()
                        .hold(now.saturating_add(delay), context_id);
                } else if let Err(s) = self.host.continue_request() {
                    debug!("cannot resume request {context_id}: {s}");
                }
            }
            Step::Refuse(r) => self.refuse(&r),
            Step::Pass => {
                if let Err(s) = self.host.continue_request() {
                    debug!("cannot resume request {context_id}: {s}");
                }
            }
            // (Deciding a paused request again never makes a call of its own.)
            Step::Wait | Step::Call(_) => {}
        }
    }

    /// The configuration goes away: requests it holds go on now, waiting ones are decided by
    /// the failure mode, and stats are handed over.
    pub fn retire(&self) {
        let now = self.host.now_ns().unwrap_or(0);
        let bodies = self.queues.borrow_mut().drain_bodies();
        self.pass_on(bodies);
        let (held, waiting) = self.queues.borrow_mut().drain();
        for id in held {
            if self.host.set_effective_context(id).is_ok() {
                let _ = self.host.continue_request();
            }
        }
        for mut w in waiting {
            let step =
                self.engine
                    .borrow_mut()
                    .evaluate_at_once(&self.host, &mut w.inputs, now, true);
            self.finish_paused(w.context_id, step, now);
        }
        self.flush_stats();
    }

    pub fn add(&self, stat: ProcessStat, n: i64) {
        self.engine.borrow_mut().stats_mut().add_process(stat, n);
    }

    /// Hand the worker's stat changes to the host.
    pub fn flush_stats(&self) {
        for (gauge, change) in self.queues.borrow_mut().gauge_changes() {
            self.add(gauge, change);
        }
        let mut changes: smallvec::SmallVec<[(Stat, i64); 16]> = smallvec::SmallVec::new();
        self.engine
            .borrow_mut()
            .stats_mut()
            .drain(|stat, delta| changes.push((stat, delta)));
        for (stat, delta) in changes {
            let metric = match stat {
                Stat::Rule(rule, s) => self.rule_metrics.get(rule).and_then(|m| m.get(s as usize)),
                Stat::Process(s) => self.process_metrics.get(s as usize),
            };
            let Some(Some(metric)) = metric else {
                continue;
            };
            // A failed update only loses a count; nothing to do about it here.
            let absolute = matches!(stat, Stat::Rule(_, s) if s.is_absolute());
            let _ = match &metric.total_key {
                None if absolute => self
                    .host
                    .record_metric(metric.id, u64::try_from(delta).unwrap_or(0)),
                None => self.host.increment_metric(metric.id, delta),
                Some(key) => match add_to_total(&self.host, key, delta) {
                    Some(total) => self.host.record_metric(metric.id, total),
                    None => Ok(()),
                },
            };
        }
    }
}

impl<H: Host> Drop for Plugin<H> {
    fn drop(&mut self) {
        // Stashed tokens go back rather than being lost.
        self.engine.get_mut().return_stashes(&self.host, u64::MAX);
    }
}

/// How a stat is handed to the host.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Counter,
    /// Changed by deltas from every worker: a process-wide total kept in shared data.
    Gauge,
    /// Set to values that are process-wide already.
    Absolute,
}

/// The stats an overload rule has.
fn rule_has(guard: &crate::config::Guard, stat: RuleStat) -> bool {
    let adaptive = matches!(guard.kind, crate::config::GuardKind::Adaptive { .. });
    match stat {
        RuleStat::Allowed
        | RuleStat::Limited
        | RuleStat::DryRunLimited
        | RuleStat::StoreErrors
        | RuleStat::Contended => true,
        RuleStat::InFlight | RuleStat::Estimate | RuleStat::Signal => adaptive,
        s => s.is_overload(),
    }
}

/// Define a stat at the host; gauges get their process-wide total in shared data.
fn define<H: Host>(host: &H, name: &str, kind: Kind) -> Option<Metric> {
    let host_kind = if kind == Kind::Counter {
        MetricKind::Counter
    } else {
        MetricKind::Gauge
    };
    let id = host
        .define_metric(host_kind, name)
        .map_err(|s| warn!("cannot define metric {name}: {s}"))
        .ok()?;
    let total_key = (kind == Kind::Gauge).then(|| {
        let key = format!("tollgate.gauge.{name}");
        if let Ok(None) = host.read(&key) {
            // Created before any request changes it: a lost race between workers loses nothing.
            let _ = host.write(&key, &0i64.to_le_bytes(), 0);
        }
        key
    });
    Some(Metric { id, total_key })
}

/// Add `delta` to a process-wide total in shared data; the new total (never below 0).
fn add_to_total<S: CasStore>(store: &S, key: &str, delta: i64) -> Option<u64> {
    let attempts = tollgate_core::limiter::MAX_CAS_ATTEMPTS;
    // The total's key is made at load: without it there is nothing to add to.
    let added = tollgate_core::store::update(store, key, attempts, |bytes| {
        let Some(bytes) = bytes else {
            return (None, None);
        };
        let current = bytes
            .get(..8)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .map_or(0, i64::from_le_bytes);
        let next = current.saturating_add(delta);
        (Some(next.to_le_bytes()), Some(next))
    });
    added.ok().flatten().map(|n| u64::try_from(n).unwrap_or(0))
}

/// This process's name at the quota service: made once per process (shared by its workers).
/// The process's random placement secret: made by whichever configuration loads first and kept in
/// shared data, so every worker and every later configuration places keys alike. Envoy configures
/// its main thread before any worker; nginx refuses a second create (a write with CAS 0 to a key
/// that exists), and whoever loses the race reads the winner's.
fn deployment_placement<H: Host>(host: &H) -> KeyPlacement {
    const KEY: &str = "tollgate.placement";
    if let Ok(Some((secret, _))) = host.read(KEY) {
        if let Ok(secret) = <[u8; 16]>::try_from(&secret[..]) {
            return KeyPlacement::new(secret);
        }
    }
    let secret = random_secret(host);
    let _ = host.write(KEY, &secret, 0);
    match host.read(KEY) {
        Ok(Some((stored, _))) => match <[u8; 16]>::try_from(&stored[..]) {
            Ok(stored) => KeyPlacement::new(stored),
            Err(_) => KeyPlacement::new(secret),
        },
        _ => KeyPlacement::new(secret),
    }
}

/// 16 bytes from the host's random source (WASI `random_get`, through std's hash keys), mixed
/// with the time in nanoseconds: nginx's source is `random()` seeded from its pid and the time.
fn random_secret<H: Host>(host: &H) -> [u8; 16] {
    use std::hash::{BuildHasher, Hasher};
    let now = host.now_ns().unwrap_or(0);
    let mut halves = [0u64; 2];
    for (i, half) in halves.iter_mut().enumerate() {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(now);
        h.write_usize(i);
        *half = h.finish();
    }
    let mut secret = [0; 16];
    secret[..8].copy_from_slice(&halves[0].to_le_bytes());
    secret[8..].copy_from_slice(&halves[1].to_le_bytes());
    secret
}

fn instance_id<H: Host>(host: &H) -> String {
    const KEY: &str = "tollgate.instance";
    if let Ok(Some((id, _))) = host.read(KEY) {
        return String::from_utf8_lossy(&id).into_owned();
    }
    let id = format!("proxy-{:x}", host.now_ns().unwrap_or(0));
    // Whoever writes first wins; everyone then reads the winner's.
    let _ = host.write(KEY, id.as_bytes(), 0);
    match host.read(KEY) {
        Ok(Some((id, _))) => String::from_utf8_lossy(&id).into_owned(),
        _ => id,
    }
}

/// The filter's own level: messages below it are never formatted. One per VM: the last
/// configuration loaded sets it.
fn set_log_level(level: LogLevel) {
    log::set_max_level(match level {
        LogLevel::Error => log::LevelFilter::Error,
        LogLevel::Warn => log::LevelFilter::Warn,
        LogLevel::Info => log::LevelFilter::Info,
        LogLevel::Debug => log::LevelFilter::Debug,
    });
}
