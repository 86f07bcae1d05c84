//! A fleet of proxies over the real lease code in virtual time: each proxy's leased allowance
//! (`LeaseAllowance`, one slot per proxy process) and the service's bucket (`GlobalBucket`),
//! calls sent on the proxies' ticks that take a round trip, a service that goes down or loses
//! what it knew, proxies that restart, and requests that reserve and settle. Every admission is
//! checked against what the service handed out (`Fleet::worst`).

use tollgate_core::global::lease::{
    newcomers_reserve, rate_mtps, ColdStart, GlobalBucket, LeaseGrant, LeaseItem,
};
use tollgate_core::{Ask, Decision, Grant, LeaseAllowance, State};

/// One global limit, its service and its proxies.
#[derive(Debug, Clone, Copy)]
pub struct Setup {
    pub requests: u64,
    pub per_ms: u64,
    pub burst: u64,
    pub ttl_ms: u64,
    /// `quota_service.lease_size`: by default `burst / (4 × instances_hint)` (1–1 000).
    pub lease_size: u64,
    /// `quota_service.timeout` and `retry`.
    pub timeout_ms: u64,
    pub retry_ms: u64,
    /// A proxy's tick: claims go out on it and waiting requests are decided again.
    pub tick_ms: u64,
    /// A call's round trip: the service serves it after `rtt_ms / 2`, the answer comes after
    /// `rtt_ms`; with `jitter_ms`, each call takes up to that much longer both ways.
    pub rtt_ms: u64,
    pub jitter_ms: u64,
    pub cold: ColdStart,
    pub seed: u64,
}

impl Setup {
    /// A limit with the filter's defaults for `proxies` proxies (`instances_hint`).
    pub fn new(requests: u64, per_ms: u64, burst: u64, proxies: u64) -> Self {
        Self {
            requests,
            per_ms,
            burst,
            ttl_ms: 10_000,
            lease_size: (burst / (4 * proxies)).clamp(1, 1_000),
            timeout_ms: 200,
            retry_ms: 500,
            tick_ms: 10,
            rtt_ms: 2,
            jitter_ms: 0,
            cold: ColdStart::Auto { epoch_ms: 0 },
            seed: 1,
        }
    }

    pub fn allowance(&self) -> LeaseAllowance {
        LeaseAllowance {
            lease_size: self.lease_size,
            low_water: self.lease_size.div_ceil(2),
            claim_ms: self.timeout_ms + 100,
            global_burst: self.burst,
            global_interval_ns: self.per_ms * 1_000_000 / self.requests,
            global_rate_mtps: rate_mtps(self.requests, self.per_ms),
            calendar: false,
        }
    }

    /// Tokens per ms.
    pub fn rate(&self) -> f64 {
        self.requests as f64 / self.per_ms as f64
    }

    /// `burst + rate × t`.
    pub fn bound(&self, t_ms: u64) -> f64 {
        self.burst as f64 + self.rate() * t_ms as f64
    }
}

/// Requests a proxy receives over a span at `per_s` on average (evenly spaced, or at random
/// with `poisson`), each reserving `cost` and turning out to cost `actual` (up to `actual_max`
/// when that is larger, at random), settled `duration_ms` after its admission.
#[derive(Debug, Clone, Copy)]
pub struct Load {
    pub proxy: usize,
    pub from_ms: u64,
    pub until_ms: u64,
    pub per_s: f64,
    pub poisson: bool,
    pub cost: u64,
    pub actual: u64,
    pub actual_max: u64,
    pub duration_ms: u64,
}

impl Load {
    pub fn steady(proxy: usize, per_s: f64, from_ms: u64, until_ms: u64) -> Self {
        Self {
            proxy,
            from_ms,
            until_ms,
            per_s,
            poisson: false,
            cost: 1,
            actual: 1,
            actual_max: 0,
            duration_ms: 0,
        }
    }

    pub fn poisson(self) -> Self {
        Self {
            poisson: true,
            ..self
        }
    }

    /// Each request reserves `cost`, costs `actual` to `actual_max`, settled after
    /// `duration_ms`.
    pub fn settling(self, cost: u64, actual: u64, actual_max: u64, duration_ms: u64) -> Self {
        Self {
            cost,
            actual,
            actual_max,
            duration_ms,
            ..self
        }
    }
}

/// What happened to one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    Admitted,
    /// Refused, with the wait it was told (ms).
    Refused {
        retry_after_ms: u64,
    },
    /// Decided by the failure mode.
    FellBack,
}

#[derive(Debug, Clone, Copy)]
pub struct Answered {
    pub proxy: usize,
    pub arrived_ms: u64,
    pub decided_ms: u64,
    pub fate: Fate,
}

/// An event of the run.
#[derive(Debug, Clone, Copy)]
pub enum Event {
    /// The service is down (calls fail at once) from `from_ms` until `until_ms`; with `lost`, it
    /// comes back without what it knew (a memory store restarted, a Redis emptied).
    Outage {
        from_ms: u64,
        until_ms: u64,
        lost: bool,
    },
    /// A proxy restarts at `at_ms`: its slot, its waiting requests and its calls are gone.
    Restart { proxy: usize, at_ms: u64 },
}

/// The service's side: its one bucket, and whether it is up.
struct Service {
    cold: ColdStart,
    bucket: Option<GlobalBucket>,
    up: bool,
    /// Proxies' evidence showed the store lost state.
    lost: bool,
}

impl Service {
    fn lease(&mut self, proxy: usize, item: &LeaseItem, now: u64, ttl: u64) -> LeaseGrant {
        let evidence = item.known_ms > 0;
        let checks = self.cold.checks_evidence();
        let bucket = match &mut self.bucket {
            Some(b) => b,
            None => {
                self.lost |= evidence && checks;
                let cold = self.cold.for_new(self.lost);
                self.bucket.insert(GlobalBucket::new(item, now, ttl, cold))
            }
        };
        if checks && bucket.reconcile(&format!("p{proxy}"), item, now, ttl) {
            self.lost = true;
        }
        bucket.lease(&format!("p{proxy}"), item, now, ttl)
    }
}

struct Call {
    proxy: usize,
    /// The proxy's life it belongs to (a restarted proxy ignores its calls of before).
    life: u32,
    sent_ms: u64,
    served_ms: u64,
    answered_ms: u64,
    ask: Ask,
    answer: Option<LeaseGrant>,
    served: bool,
}

struct Waiter {
    arrived_ms: u64,
    cost: u64,
    actual: u64,
    duration_ms: u64,
}

struct Proxy {
    state: State,
    waiting: Vec<Waiter>,
    claimed: bool,
    life: u32,
}

/// A small deterministic random source (xorshift64*).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

/// A run: its setup, loads and events, then `run` fills in what happened.
pub struct Fleet {
    pub setup: Setup,
    pub loads: Vec<Load>,
    pub events: Vec<Event>,
    pub answered: Vec<Answered>,
    /// Per ms: tokens settled plus tokens reserved in flight, across the fleet (admissions the
    /// failure mode made not included).
    pub used: Vec<u64>,
    /// Calls sent to the service.
    pub calls: usize,
    /// The largest excess of an admission over what the service handed out (see
    /// [`Fleet::run`]); at most 0 when every promise holds.
    pub worst: f64,
    /// Print every call and its answer.
    pub trace: bool,
}

impl Fleet {
    pub fn new(setup: Setup, loads: Vec<Load>) -> Self {
        Self {
            setup,
            loads,
            events: Vec::new(),
            answered: Vec::new(),
            used: Vec::new(),
            calls: 0,
            worst: f64::NEG_INFINITY,
            trace: false,
        }
    }

    pub fn with(mut self, event: Event) -> Self {
        self.events.push(event);
        self
    }

    fn item(&self, ask: &Ask) -> LeaseItem {
        let s = &self.setup;
        ask.item(
            "r".into(),
            "l".into(),
            "k".into(),
            (s.requests, s.per_ms, s.burst),
        )
    }

    /// Run for `ms` milliseconds.
    ///
    /// At every admission the fleet's use (tokens settled plus reserved in flight) is checked
    /// against what the service handed out, by conservation: it never exceeds `burst + rate × t`
    /// less what the bucket still holds (plus its debt) less what proxies hold unspent, plus the
    /// excess not yet charged to the service (owed by proxies, or in calls on their way; lost
    /// with a proxy that restarted before its call). `worst` is the largest excess over that
    /// seen (the bound holds while it is at most 0). Across a loss of the service's state, a debt
    /// survives by the proxies' evidence less at most the reserve, a token and a call's time of
    /// refill, and a proxy that held a share and has not called since may accrue it while others
    /// renew with the rate held for it; a
    /// bucket made anew by a proxy without evidence can exceed it (the documented race): then no
    /// check.
    pub fn run(&mut self, ms: u64) -> &mut Self {
        let s = self.setup;
        let allowance = s.allowance();
        let mut rng = Rng::new(s.seed);
        let restarted = self.events.iter().filter_map(|e| match e {
            Event::Restart { proxy, .. } => Some(proxy + 1),
            Event::Outage { .. } => None,
        });
        let proxies = self
            .loads
            .iter()
            .map(|l| l.proxy + 1)
            .chain(restarted)
            .max()
            .unwrap_or(0);
        let mut ps: Vec<Proxy> = (0..proxies)
            .map(|_| Proxy {
                state: [0; 32],
                waiting: Vec::new(),
                claimed: false,
                life: 0,
            })
            .collect();
        let mut service = Service {
            cold: s.cold,
            bucket: None,
            up: true,
            lost: false,
        };
        // Each load's next arrival (ms, fractional).
        let mut next: Vec<f64> = self.loads.iter().map(|l| l.from_ms as f64).collect();
        let mut calls: Vec<Call> = Vec::new();
        // Settlements due: (at, proxy, life, reserved, actual).
        let mut settlements: Vec<(u64, usize, u32, u64, u64)> = Vec::new();
        let mut used: u64 = 0;
        let mut forgotten: u64 = 0;
        let mut losses: u64 = 0;
        // The bucket the service lost (until it makes it anew, its debt is still owed: the
        // proxies' evidence brings it back).
        let mut before_loss: Option<GlobalBucket> = None;
        let mut blind = false;
        // The shares of before each loss, per holder: (proxy, milli-tokens a second, from, until,
        // the send time of its first call after the loss). Renewing proxies take the rate held
        // for them; one that has not renewed accrues its old share meanwhile (the stated slack).
        let mut silent: Vec<(usize, u64, u64, u64, Option<u64>)> = Vec::new();
        let probe = self.item(&Ask::default());
        for now in 0..ms {
            for e in &self.events {
                match *e {
                    Event::Outage { from_ms, .. } if from_ms == now => service.up = false,
                    Event::Outage { until_ms, lost, .. } if until_ms == now => {
                        service.up = true;
                        if lost {
                            // A debt survives by the proxies' evidence, less at most a token and
                            // the refill of a call's time (the evidence's own slack).
                            losses += 1;
                            before_loss = service.bucket.take();
                            for h in before_loss.iter().flat_map(|b| &b.holders) {
                                if let Some(n) = h.instance.strip_prefix('p') {
                                    if h.share > 0 && h.until_ms > now {
                                        let proxy = n.parse().unwrap_or(usize::MAX);
                                        silent.push((proxy, h.share, now, h.until_ms, None));
                                    }
                                }
                            }
                            // A debt survives a loss as far as the evidence of the first proxy
                            // to call shows it (others' bring back the rest when they call):
                            // the bound is not checked after a loss in debt.
                            blind |= before_loss
                                .as_ref()
                                .is_some_and(|b| b.tokens_at(&probe, now) < 0.0);
                            service.lost = false;
                            service.cold = match service.cold {
                                ColdStart::Auto { .. } => ColdStart::Auto { epoch_ms: now },
                                ColdStart::Conservative { .. } => {
                                    ColdStart::Conservative { epoch_ms: now }
                                }
                                ColdStart::Full => ColdStart::Full,
                            };
                        }
                    }
                    Event::Restart { proxy, at_ms } if at_ms == now => {
                        let p = &mut ps[proxy];
                        // What it owed and had not reported yet is lost with it (the documented
                        // exception); its requests in flight are cut: their reservations stand.
                        // (And what its calls still on their way give back or may have taken
                        // back of tokens it has spent since: at most what they said it held.)
                        forgotten += LeaseAllowance::debt(&p.state, now)
                            + calls
                                .iter()
                                .filter(|c| c.proxy == proxy && c.life == p.life)
                                .map(|c| {
                                    let owed = if c.served { 0 } else { c.ask.owed };
                                    owed + c.ask.held
                                })
                                .sum::<u64>();
                        p.state = [0; 32];
                        p.waiting.clear();
                        p.claimed = false;
                        p.life += 1;
                    }
                    _ => {}
                }
            }
            for call in calls.iter_mut().filter(|c| c.served_ms == now) {
                if service.up {
                    let fresh = service.bucket.is_none();
                    let item = self.item(&call.ask);
                    call.answer = Some(service.lease(call.proxy, &item, now, s.ttl_ms));
                    for h in silent
                        .iter_mut()
                        .filter(|h| h.0 == call.proxy && h.4.is_none())
                    {
                        h.4 = Some(call.sent_ms.max(h.2));
                    }
                    blind |= fresh && item.known_ms == 0 && losses > 0;
                    call.served = true;
                    if self.trace {
                        eprintln!(
                            "{now} ms: p{} asks {:?}\n    answer {:?}",
                            call.proxy, call.ask, call.answer
                        );
                    }
                }
            }
            for call in calls.iter().filter(|c| c.answered_ms == now) {
                let p = &mut ps[call.proxy];
                if call.life != p.life {
                    continue;
                }
                p.claimed = false;
                let before = p.state;
                p.state = match call.answer {
                    Some(a) => allowance.grant(
                        &p.state,
                        now,
                        &Grant::answered(&a, call.ask, call.sent_ms, (s.requests, s.per_ms)),
                    ),
                    None => allowance.fail(&p.state, now, s.retry_ms),
                };
                p.claimed = allowance.claimed(&before, &p.state);
            }
            calls.retain(|c| c.answered_ms > now);
            settlements.retain(|&(at, proxy, life, reserved, actual)| {
                if at != now {
                    return true;
                }
                let p = &mut ps[proxy];
                if p.life != life {
                    // Cut by the restart: its reservation stands.
                    return false;
                }
                let before = p.state;
                p.state = allowance.settle(&before, now, reserved, actual);
                if self.trace {
                    eprintln!("{now} ms: p{proxy} settles {reserved} at {actual}");
                }
                p.claimed |= allowance.claimed(&before, &p.state);
                used = used - reserved + actual;
                false
            });
            for (n, p) in ps.iter_mut().enumerate() {
                if (now + n as u64 * 3) % s.tick_ms != 0 {
                    continue;
                }
                if p.claimed && !calls.iter().any(|c| c.proxy == n && c.life == p.life) {
                    let ask = allowance.ask(&p.state, now);
                    self.calls += 1;
                    if self.trace && !service.up {
                        eprintln!("{now} ms: p{n} calls a service that is down");
                    }
                    let there = s.rtt_ms / 2 + rng.range(0, s.jitter_ms);
                    let back = s.rtt_ms.div_ceil(2).max(1) + rng.range(0, s.jitter_ms);
                    calls.push(Call {
                        proxy: n,
                        life: p.life,
                        sent_ms: now,
                        served_ms: now + there,
                        answered_ms: now + there + back,
                        ask,
                        answer: None,
                        served: false,
                    });
                }
                let waiting = std::mem::take(&mut p.waiting);
                for w in waiting {
                    let timed_out = now >= w.arrived_ms + s.timeout_ms + 10;
                    let step = decide(&allowance, p, now, w.cost);
                    let fate = match step {
                        Step::Admit => Fate::Admitted,
                        Step::Refuse(retry_after_ms) => Fate::Refused { retry_after_ms },
                        Step::FallBack => Fate::FellBack,
                        Step::Wait if timed_out => Fate::Refused {
                            retry_after_ms: s.per_ms.div_ceil(s.requests),
                        },
                        Step::Wait => {
                            p.waiting.push(w);
                            continue;
                        }
                    };
                    if fate == Fate::Admitted {
                        used += w.cost;
                        if w.actual != w.cost {
                            settlements.push((now + w.duration_ms, n, p.life, w.cost, w.actual));
                        }
                    }
                    self.answered.push(answered(n, &w, now, fate));
                }
            }
            for (l, load) in self.loads.iter().enumerate() {
                while next[l] < (now + 1) as f64 && now < load.until_ms {
                    let gap = 1_000.0 / load.per_s;
                    next[l] += if load.poisson {
                        -gap * (1.0 - rng.unit()).ln()
                    } else {
                        gap
                    };
                    if now < load.from_ms {
                        continue;
                    }
                    let actual = if load.actual_max > load.actual {
                        rng.range(load.actual, load.actual_max)
                    } else {
                        load.actual
                    };
                    let w = Waiter {
                        arrived_ms: now,
                        cost: load.cost,
                        actual,
                        duration_ms: load.duration_ms,
                    };
                    let p = &mut ps[load.proxy];
                    let fate = match decide(&allowance, p, now, w.cost) {
                        Step::Admit => Fate::Admitted,
                        Step::Refuse(retry_after_ms) => Fate::Refused { retry_after_ms },
                        Step::FallBack => Fate::FellBack,
                        Step::Wait => {
                            p.waiting.push(w);
                            continue;
                        }
                    };
                    if fate == Fate::Admitted {
                        used += w.cost;
                        if w.actual != w.cost {
                            settlements.push((
                                now + w.duration_ms,
                                load.proxy,
                                p.life,
                                w.cost,
                                w.actual,
                            ));
                        }
                    }
                    self.answered.push(answered(load.proxy, &w, now, fate));
                }
            }
            let admitted_now = self
                .answered
                .iter()
                .rev()
                .take_while(|a| a.decided_ms == now)
                .any(|a| a.fate == Fate::Admitted);
            self.used.push(used);
            if admitted_now && !blind {
                // Conservation: what the fleet used is at most what the service handed out (the
                // bound, less what its bucket still holds) plus what is not charged yet, less
                // what proxies hold unspent.
                // (A store that lost the bucket will make it anew empty, by evidence, or full
                // without: then the run is not checked.)
                let tokens = match (&service.bucket, &before_loss) {
                    (Some(b), _) => b.tokens_at(&probe, now),
                    (None, Some(b)) => b.tokens_at(&probe, now).min(0.0),
                    (None, None) => s.burst as f64,
                };
                let owed: u64 = ps
                    .iter()
                    .map(|p| LeaseAllowance::debt(&p.state, now))
                    .sum::<u64>()
                    + calls
                        .iter()
                        .filter(|c| !c.served && c.life == ps[c.proxy].life)
                        .map(|c| c.ask.owed)
                        .sum::<u64>();
                // Answers on their way back: what they took back is the service's already, and
                // what they charged is no longer owed (the proxies learn it with the answer).
                let (mut taken, mut charged) = (0u64, 0u64);
                for c in calls.iter().filter(|c| c.life == ps[c.proxy].life) {
                    if let Some(a) = c.answer {
                        taken += a.returned + a.revoked;
                        charged += c.ask.owed;
                    }
                }
                let owed = owed as f64 - charged as f64;
                let unspent = ps
                    .iter()
                    .map(|p| allowance.allowance(&p.state, now))
                    .sum::<u64>() as f64
                    - taken as f64;
                let unrenewed: f64 = silent
                    .iter()
                    .map(|&(_, mtps, from, until, renewed)| {
                        let to = until.min(renewed.unwrap_or(now)).min(now);
                        mtps as f64 / 1e6 * to.saturating_sub(from) as f64
                    })
                    .sum();
                let allowed = s.bound(now) - tokens - unspent
                    + owed
                    + unrenewed
                    + forgotten as f64
                    + losses as f64
                        * (newcomers_reserve(s.burst) as f64
                            + 1.0
                            + s.rate() * allowance.claim_ms as f64)
                    + 1e-6;
                if self.trace && used as f64 > allowed {
                    eprintln!("{now} ms: used {used}, allowed {allowed:.1}: tokens {tokens:.1}, unspent {unspent}, owed {owed}");
                }
                self.worst = self.worst.max(used as f64 - allowed);
            }
        }
        self
    }

    /// Requests of `proxy` (any: `None`) decided in `[from_ms, until_ms)` whose fate passes `f`.
    pub fn count(
        &self,
        proxy: Option<usize>,
        from_ms: u64,
        until_ms: u64,
        f: fn(&Fate) -> bool,
    ) -> usize {
        self.answered
            .iter()
            .filter(|a| proxy.is_none_or(|p| a.proxy == p))
            .filter(|a| a.decided_ms >= from_ms && a.decided_ms < until_ms)
            .filter(|a| f(&a.fate))
            .count()
    }
}

fn answered(proxy: usize, w: &Waiter, now: u64, fate: Fate) -> Answered {
    Answered {
        proxy,
        arrived_ms: w.arrived_ms,
        decided_ms: now,
        fate,
    }
}

enum Step {
    Admit,
    Refuse(u64),
    FallBack,
    Wait,
}

/// One request against a proxy's allowance, as the filter decides it (a claim goes out with the
/// proxy's next tick).
fn decide(allowance: &LeaseAllowance, p: &mut Proxy, now: u64, cost: u64) -> Step {
    let before = p.state;
    let (step, next) = match allowance.decide(&before, now * 1_000_000, cost) {
        Decision::Admit { state, .. } => (Step::Admit, Some(state)),
        Decision::Refuse { retry_after_ns, .. } => {
            (Step::Refuse(retry_after_ns.div_ceil(1_000_000)), None)
        }
        Decision::Wait { claim } => (Step::Wait, claim),
        Decision::Fallback { claim } => (Step::FallBack, claim),
    };
    if let Some(next) = next {
        p.claimed |= allowance.claimed(&before, &next);
        p.state = next;
    }
    step
}
