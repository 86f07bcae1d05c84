//! One configuration's state in one worker — what a root context owns: its engine, its paused
//! requests, its stats' host ids and the buffers it reuses. Two configurations in one VM (two
//! filters sharing a `vm_id`, several `proxy_wasm` directives) never share any of it.

mod bodies;
mod setup;
mod stats;

use super::host::{Action, Host};
use super::queues::Queues;
use super::quota_call;
use super::respond::{self, Scratch};
use crate::config::{Config, HostCaps, PaceBody};
use crate::engine::{read_answer, read_permit_answer, Admitted, Call, Engine, Refusal, Step};
use crate::stats::{ProcessStat, RuleStat};
use bodies::BodyWait;
use log::{debug, info};
use setup::{deployment_placement, instance_id, set_log_level};
use stats::{define, rule_has};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;

/// How often a worker looks for held requests that are due: the spacing's resolution.
const TICK_MS: u32 = 5;
/// The tick otherwise: it returns unspent stashed tokens and hands the worker's stats over.
const STATS_TICK_MS: u32 = 10;
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
                                s if rule.pace().is_some() => matches!(
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
    /// the timer only): what it admits is left for its context to take up.
    fn finish_paused(&self, context_id: u32, step: Step, now: u64) {
        if self.host.set_effective_context(context_id).is_err() {
            // The stream is gone; give back what the decision took.
            if let Step::Admit(a) = step {
                self.engine.borrow_mut().release(&self.host, a.holds, now);
            }
            return;
        }
        self.carry_out(context_id, step, now, true, |admitted, held_until| {
            self.queues
                .borrow_mut()
                .resumed(context_id, admitted, held_until)
        });
    }

    /// Carry out a decision for request `context_id`, the one place that does, for the stream's
    /// own decisions and the tick's for paused requests alike: admit it (`keep` takes what it
    /// holds, and when a leaky bucket holds it), refuse it, or let it pass; resume it if it was
    /// `paused` and may go on now.
    pub fn carry_out(
        &self,
        context_id: u32,
        step: Step,
        now: u64,
        paused: bool,
        keep: impl FnOnce(Admitted, Option<u64>),
    ) -> Action {
        match step {
            Step::Admit(a) => {
                // The configuration was checked against the host: only hosts that can resume
                // from the timer get delays.
                let held_until = (a.delay_ns > 0 && self.caps.resume_from_timer)
                    .then(|| now.saturating_add(a.delay_ns));
                if let Some(due) = held_until {
                    self.queues.borrow_mut().hold(due, context_id);
                }
                keep(a, held_until);
                if held_until.is_some() {
                    return Action::Pause;
                }
                self.go_on(context_id, paused)
            }
            Step::Refuse(r) => {
                self.refuse(&r);
                Action::Pause
            }
            Step::Pass => self.go_on(context_id, paused),
            // (Decided whole where they arise, never here: a request that waits stays paused.)
            Step::Wait | Step::Call(_) => Action::Pause,
        }
    }

    /// Let a request go on: resumed, if it was paused.
    fn go_on(&self, context_id: u32, paused: bool) -> Action {
        if paused {
            if let Err(s) = self.host.continue_request() {
                debug!("cannot resume request {context_id}: {s}");
            }
        }
        Action::Continue
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
