//! Overload rules in a request: adaptive concurrency and the success-rate throttle decide it
//! before the limits (a request they refuse is charged nothing else), keep a seat while it is
//! in flight, and learn from its answer: response time, status, the CPU the upstream reports.

use super::{Engine, Refusal};
use crate::config::{CpuHeader, GuardKind, MissingKey, Rule, DEFAULT_LEVEL};
use crate::request::{Request, RequestView};
use crate::stats::RuleStat;
use log::debug;
use smallvec::SmallVec;
use tollgate_core::limiter::MAX_CAS_ATTEMPTS;
use tollgate_core::overload::adaptive::{self, Adaptive, Admission, Window, FLOWS, MILLI};
use tollgate_core::overload::throttle::{Counts, SreThrottle};
use tollgate_core::state::draw;
use tollgate_core::store::UpdateError;
use tollgate_core::CasStore;

/// What a request holds of one overload rule while it is in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seat {
    rule: u16,
    /// The key's window (a group index of the rule's table).
    window: u32,
    seat: adaptive::Seat,
    since_ns: u64,
}

/// A request's seats: inline for the usual one overload rule.
pub type Seats = SmallVec<[Seat; 1]>;

/// One overload rule's question for a request.
struct Ask<'a> {
    /// The key's window in the store.
    key: &'a str,
    dry_run: bool,
    seat: Seat,
    now: u64,
}

/// An overload rule's decision for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Passage {
    /// The request goes on; `seated` if the rule counts it in its window until its answer.
    Admit {
        seated: bool,
    },
    Shed,
}

/// How a read-modify-write of a window ended.
enum Written<T> {
    Done(T),
    /// The store failed, or other workers kept winning the race.
    Failed(RuleStat),
}

/// [`tollgate_core::store::update`] of a window, its failure as the stat it counts in.
fn update<S, T, const N: usize>(
    store: &S,
    key: &str,
    next: impl FnMut(Option<&[u8]>) -> (Option<[u8; N]>, T),
) -> Written<T>
where
    S: CasStore + ?Sized,
{
    match tollgate_core::store::update(store, key, MAX_CAS_ATTEMPTS, next) {
        Ok(result) => Written::Done(result),
        Err(UpdateError::Contended) => Written::Failed(RuleStat::Contended),
        Err(UpdateError::Unavailable(_)) => Written::Failed(RuleStat::StoreErrors),
    }
}

/// The utilisation in a CPU report, in thousandths: ORCA's text or JSON form
/// (`cpu_utilization=0.83`, `"cpu_utilization": 0.83`), or a number over `scale`.
pub fn reported_cpu(value: &[u8], header: &CpuHeader) -> Option<u64> {
    const FIELD: &[u8] = b"cpu_utilization";
    let (number, scale) = match value.windows(FIELD.len()).position(|w| w == FIELD) {
        Some(at) => {
            let rest = &value[at + FIELD.len()..];
            let start = rest
                .iter()
                .position(|b| !matches!(b, b' ' | b'"' | b'=' | b':'))?;
            (&rest[start..], 1.0)
        }
        None => (value, header.scale),
    };
    let end = number
        .iter()
        .position(|b| !matches!(b, b'0'..=b'9' | b'.' | b' ' | b'\t'))
        .unwrap_or(number.len());
    let text = std::str::from_utf8(&number[..end]).ok()?.trim();
    let v: f64 = text.parse().ok()?;
    let milli = v / scale * MILLI as f64;
    (milli.is_finite() && milli >= 0.0).then(|| milli.min(u32::MAX as f64 / 2.0) as u64)
}

/// What the engine keeps of overload rules between requests.
#[derive(Debug)]
pub struct Guards {
    /// Counts the throttle's draws (with the time, their seed).
    draws: u64,
    /// Some rule is an overload rule.
    guarded: bool,
}

impl Guards {
    /// For a configuration in which some rule is an overload rule (`guarded`) or none is.
    pub(super) fn new(guarded: bool) -> Self {
        Self { draws: 0, guarded }
    }
}

impl Engine {
    /// True if some rule is an overload rule.
    pub fn has_guards(&self) -> bool {
        self.guards.guarded
    }

    /// The priority level of a request: its first matching class's, else the default.
    fn level_of<V: RequestView>(&self, request: &Request<V>) -> u8 {
        let classes = &self.config.priorities.classes;
        classes
            .iter()
            .find(|c| request.matches(&c.matcher))
            .map_or(DEFAULT_LEVEL, |c| c.level)
    }

    /// Decide the overload rules that apply to `request`: the seats it takes, or the refusal
    /// (then it holds no seat).
    pub fn guard<S: CasStore + ?Sized, V: RequestView>(
        &mut self,
        store: &S,
        request: &Request<V>,
        now: u64,
        seats: &mut Seats,
    ) -> Option<Refusal> {
        let mut level = None;
        for i in 0..self.config.rules.len() {
            let rule = &self.config.rules[i];
            let Some(g) = rule.guard() else {
                continue;
            };
            if !request.matches(&rule.matcher) {
                continue;
            }
            let Some(key) = request.key(&rule.key, rule.missing_key, rule.unreadable_body) else {
                continue;
            };
            let window = g.table.locate_hash(self.placement.hash(&key)).group;
            let flow = if g.fair_key.is_empty() {
                None
            } else {
                // Requests without a flow key are not held to a flow's part.
                request
                    .key(&g.fair_key, MissingKey::Skip, MissingKey::Limit)
                    .map(|k| (self.placement.hash(&k) % FLOWS as u128) as u8)
            };
            let level = *level.get_or_insert_with(|| self.level_of(request));
            let seat = Seat {
                rule: u16::try_from(i).unwrap_or(u16::MAX),
                window,
                seat: adaptive::Seat { level, flow },
                since_ns: now,
            };
            let key = g.table.store_key(window);
            let ask = Ask {
                key: key.as_str(),
                dry_run: rule.dry_run,
                seat,
                now,
            };
            let verdict = match g.kind {
                GuardKind::Adaptive { estimator, .. } => {
                    let share = self.config.priorities.shares[usize::from(level).min(3)];
                    self.admit_adaptive(store, i, estimator, share, ask)
                }
                GuardKind::Throttle { throttle, .. } => {
                    self.guards.draws = self.guards.draws.wrapping_add(1);
                    let d = draw(now ^ self.guards.draws.rotate_left(32));
                    self.admit_throttled(store, i, throttle, d, ask)
                }
            };
            self.stats
                .bump(i, RuleStat::of_level(level, verdict == Passage::Shed));
            self.log_dry_runs(now);
            match verdict {
                Passage::Shed => {}
                Passage::Admit { seated } => {
                    self.stats.bump(i, RuleStat::Allowed);
                    if seated {
                        seats.push(seat);
                    }
                    continue;
                }
            }
            self.stats.bump(i, RuleStat::Limited);
            self.abandon(store, std::mem::take(seats), now);
            return Some(Refusal {
                rule: i,
                quota: None,
                retry_after_secs: Some(retry_after_secs(&self.config.rules[i])),
            });
        }
        None
    }

    /// An adaptive rule's decision (a dry run's requests go on).
    fn admit_adaptive<S: CasStore + ?Sized>(
        &mut self,
        store: &S,
        i: usize,
        estimator: Adaptive,
        share: u64,
        ask: Ask,
    ) -> Passage {
        let (seat, now, dry_run) = (ask.seat.seat, ask.now, ask.dry_run);
        let result = update(store, ask.key, |bytes| {
            let w = Window::decode(bytes.unwrap_or_default());
            match estimator.admit(&w, now, seat, share) {
                Admission::Admit(next) => (Some(next.encode()), (true, next)),
                Admission::Refuse(next) if dry_run => {
                    let next = estimator.occupy(&next, now, seat);
                    (Some(next.encode()), (false, next))
                }
                Admission::Refuse(next) => (Some(next.encode()), (false, next)),
            }
        });
        let result = match result {
            Written::Done((admitted, w)) => {
                self.note_window(i, &estimator, &w, now);
                if admitted || dry_run {
                    self.stats.add(i, RuleStat::InFlight, 1);
                }
                Written::Done(admitted)
            }
            Written::Failed(stat) => Written::Failed(stat),
        };
        self.settle(i, result, dry_run)
    }

    /// A throttle's decision (a dry run's requests go on).
    fn admit_throttled<S: CasStore + ?Sized>(
        &mut self,
        store: &S,
        i: usize,
        throttle: SreThrottle,
        d: u32,
        ask: Ask,
    ) -> Passage {
        let (level, now, dry_run) = (ask.seat.seat.level, ask.now, ask.dry_run);
        let result = update(store, ask.key, |bytes| {
            let c = Counts::decode(bytes.unwrap_or_default());
            match throttle.refuse(&c, now, level, d) {
                None => (None, true),
                // A dry run's request goes on and counts with its answer.
                Some(_) if dry_run => (None, false),
                Some(next) => (Some(next.encode()), false),
            }
        });
        self.settle(i, result, dry_run)
    }

    /// What a decision written to a rule's window means for the request. Without its window the
    /// rule cannot judge: the request goes on, holding no seat.
    fn settle(&mut self, i: usize, result: Written<bool>, dry_run: bool) -> Passage {
        match result {
            Written::Done(true) => Passage::Admit { seated: true },
            Written::Done(false) if dry_run => {
                self.would_refuse(i);
                Passage::Admit { seated: true }
            }
            Written::Done(false) => {
                debug!("rule {}: request refused (overload)", self.rule_name(i));
                Passage::Shed
            }
            Written::Failed(stat) => {
                self.stats.bump(i, stat);
                Passage::Admit { seated: false }
            }
        }
    }

    /// The request's answer came: `status`, and `header` reads the response's headers.
    pub fn answered<'h, S: CasStore + ?Sized>(
        &mut self,
        store: &S,
        seats: Seats,
        now: u64,
        status: Option<u32>,
        header: impl Fn(&str) -> Option<crate::request::Value<'h>>,
    ) {
        for seat in seats {
            let i = usize::from(seat.rule);
            let Some(g) = self.config.rules.get(i).and_then(|r| r.guard()) else {
                continue;
            };
            let key = g.table.store_key(seat.window);
            match &g.kind {
                // A failure is not the service time: a fast 5xx (a refused connection, a
                // reset) would pass for the least response time and shrink the capacity.
                GuardKind::Adaptive { .. } if status.is_none_or(|s| s >= 500) => {
                    self.abandon(store, Seats::from_elem(seat, 1), now);
                }
                GuardKind::Adaptive { estimator, cpu } => {
                    let estimator = *estimator;
                    let cpu = cpu
                        .as_ref()
                        .and_then(|c| reported_cpu(&header(&c.name)?, c));
                    let rt_us = now.saturating_sub(seat.since_ns) / 1_000;
                    let result = update(store, key.as_str(), |bytes| {
                        let w = Window::decode(bytes.unwrap_or_default());
                        let next = estimator.complete(&w, now, seat.seat, rt_us, cpu);
                        (Some(next.encode()), next)
                    });
                    self.stats.add(i, RuleStat::InFlight, -1);
                    match result {
                        Written::Done(w) => self.note_window(i, &estimator, &w, now),
                        Written::Failed(stat) => self.stats.bump(i, stat),
                    }
                }
                GuardKind::Throttle { throttle, failures } => {
                    let throttle = *throttle;
                    let accepted = status.is_some_and(|s| !failures.contains(s));
                    let result = update(store, key.as_str(), |bytes| {
                        let c = Counts::decode(bytes.unwrap_or_default());
                        let next = throttle.answered(&c, now, seat.seat.level, accepted);
                        (Some(next.encode()), ())
                    });
                    if let Written::Failed(stat) = result {
                        self.stats.bump(i, stat);
                    }
                }
            }
        }
    }

    /// The request ended without an answer to learn from (refused by a later rule, client gone):
    /// its seats are given up.
    pub fn abandon<S: CasStore + ?Sized>(&mut self, store: &S, seats: Seats, now: u64) {
        for seat in seats {
            let i = usize::from(seat.rule);
            let Some(g) = self.config.rules.get(i).and_then(|r| r.guard()) else {
                continue;
            };
            let GuardKind::Adaptive { estimator, .. } = &g.kind else {
                continue;
            };
            let estimator = *estimator;
            let key = g.table.store_key(seat.window);
            let result = update(store, key.as_str(), |bytes| {
                let w = Window::decode(bytes.unwrap_or_default());
                (Some(estimator.abandon(&w, now, seat.seat).encode()), ())
            });
            self.stats.add(i, RuleStat::InFlight, -1);
            if let Written::Failed(stat) = result {
                self.stats.bump(i, stat);
            }
        }
    }

    fn rule_name(&self, i: usize) -> &str {
        self.config.rules.get(i).map_or("?", |r| r.name.as_str())
    }

    /// Keep what a window says for the rule's gauges.
    fn note_window(&mut self, i: usize, estimator: &Adaptive, w: &Window, now: u64) {
        let status = estimator.status(w, now);
        self.stats.set(i, RuleStat::Estimate, status.capacity);
        self.stats.set(i, RuleStat::Signal, status.signal_milli);
    }
}

/// What a refusal's Retry-After says: the cool-down (adaptive), or one second.
fn retry_after_secs(rule: &Rule) -> u64 {
    match rule.guard().map(|g| &g.kind) {
        Some(GuardKind::Adaptive { estimator, .. }) => {
            estimator.cool_down_ns().div_ceil(1_000_000_000).max(1)
        }
        _ => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_reports_are_read_in_every_form() {
        let orca = CpuHeader {
            name: "endpoint-load-metrics".into(),
            scale: 1.0,
        };
        let percent = CpuHeader {
            name: "x-cpu".into(),
            scale: 100.0,
        };
        assert_eq!(
            reported_cpu(b"TEXT cpu_utilization=0.83, mem_utilization=0.1", &orca),
            Some(830)
        );
        assert_eq!(
            reported_cpu(b"JSON {\"cpu_utilization\": 0.5}", &orca),
            Some(500)
        );
        assert_eq!(reported_cpu(b"83", &percent), Some(830));
        assert_eq!(reported_cpu(b" 41.5 ", &percent), Some(415));
        assert_eq!(
            reported_cpu(b"1e999", &percent),
            Some(10),
            "the number before the e"
        );
        for bad in [&b"caf\xe9"[..], b"", b"-3", b"NaN", b"cpu_utilization="] {
            assert_eq!(reported_cpu(bad, &percent), None, "{bad:?}");
        }
    }
}
