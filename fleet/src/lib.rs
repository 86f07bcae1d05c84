//! A fleet of proxies over many keys in virtual time, deciding with the filter's real lease code
//! (`LeaseAllowance`, one per proxy process and key) against the service's real buckets
//! (`GlobalBucket`, as the memory store keeps them): calls go out on the proxies' ticks with every
//! key that claims, take a round trip, may be lost; the service may lose what it knew, proxies may
//! crash, a part of the fleet may be cut off. Deterministic for a seed; no sleeping.

mod load;
mod scenario;

use load::{KeyPicker, Levels, Rng};
pub use scenario::{Event, Keys, Report, Scenario};
use std::collections::HashMap;
use tollgate_core::global::lease::{
    newcomers_reserve, ColdStart, GlobalBucket, LeaseGrant, LeaseItem,
};
use tollgate_core::{Ask, Decision, Grant, LeaseAllowance, State};

struct KeyState {
    state: State,
    claimed: bool,
    in_call: bool,
    waiting: Vec<u64>,
}

struct Proxy {
    keys: HashMap<u32, KeyState>,
    /// Per worker, keys that claim, to send with its next tick.
    to_send: Vec<Vec<u32>>,
    life: u32,
    next_arrival: f64,
}

struct Call {
    proxy: usize,
    life: u32,
    sent_ms: u64,
    items: Vec<(u32, Ask)>,
    answers: Option<Vec<LeaseGrant>>,
}

struct Service {
    buckets: HashMap<u32, GlobalBucket>,
    cold: ColdStart,
    lost: bool,
}

/// Per key: its first request and what the fleet admitted of it.
#[derive(Default, Clone, Copy)]
struct Admitted {
    first_ms: u64,
    count: u64,
}

fn item(s: &Scenario, key: u32, ask: &Ask) -> LeaseItem {
    ask.item(
        "r".into(),
        "l".into(),
        format!("k{key}"),
        (s.requests, s.per_ms, s.burst),
    )
}

impl Service {
    fn lease(
        &mut self,
        s: &Scenario,
        proxy: usize,
        key: u32,
        it: &LeaseItem,
        now: u64,
    ) -> LeaseGrant {
        let checks = self.cold.checks_evidence();
        let instance = format!("p{proxy}");
        let bucket = match self.buckets.entry(key) {
            std::collections::hash_map::Entry::Occupied(b) => b.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                self.lost |= it.known_ms > 0 && checks;
                let cold = self.cold.for_new(self.lost);
                v.insert(GlobalBucket::new(it, now, s.ttl_ms, cold))
            }
        };
        if checks && bucket.reconcile(&instance, it, now, s.ttl_ms) {
            self.lost = true;
        }
        bucket.lease(&instance, it, now, s.ttl_ms)
    }
}

enum Fate {
    Admitted,
    Refused,
    FellBack,
    Wait,
}

/// One request of `proxy` for `key`, as the filter decides it.
fn decide(a: &LeaseAllowance, p: &mut Proxy, worker: usize, key: u32, now: u64) -> Fate {
    let k = p.keys.entry(key).or_insert_with(|| KeyState {
        state: [0; 32],
        claimed: false,
        in_call: false,
        waiting: Vec::new(),
    });
    let before = k.state;
    let (fate, next) = match a.decide(&before, now * 1_000_000, 1) {
        Decision::Admit { state, .. } => (Fate::Admitted, Some(state)),
        Decision::Refuse { .. } => (Fate::Refused, None),
        Decision::Wait { claim } => (Fate::Wait, claim),
        Decision::Fallback { claim } => (Fate::FellBack, claim),
    };
    if let Some(next) = next {
        if a.claimed(&before, &next) && !k.claimed {
            k.claimed = true;
            if let Some(list) = p.to_send.get_mut(worker) {
                list.push(key);
            }
        }
        k.state = next;
    }
    fate
}

/// Run `s` and report.
/// What a run counts as it goes: the report, each key's admissions against the bound, and the
/// false refusals per 100 ms.
struct Tally<'a> {
    pub(crate) s: &'a Scenario,
    pub(crate) picker: &'a KeyPicker,
    pub(crate) report: Report,
    pub(crate) admitted: HashMap<u32, Admitted>,
    pub(crate) bin_requests: Vec<u64>,
    pub(crate) bin_false: Vec<u64>,
    pub(crate) levels: Levels,
    pub(crate) level_of: HashMap<u32, f64>,
    /// Slack per store loss (the reserve, a token and a call's time of refill), and how many.
    pub(crate) loss_slack: f64,
    pub(crate) losses: u64,
}

impl Tally<'_> {
    pub(crate) fn arrived(&mut self, key: u32, now: u64) {
        self.report.requests += 1;
        self.bin_requests[(now / 100) as usize] += 1;
        self.admitted.entry(key).or_insert(Admitted {
            first_ms: now,
            count: 0,
        });
    }

    pub(crate) fn admit(&mut self, key: u32, now: u64) {
        self.report.admitted += 1;
        let a = self.admitted.entry(key).or_insert(Admitted {
            first_ms: now,
            count: 0,
        });
        a.count += 1;
        let allowed = self.s.burst as f64
            + self.s.key_rate() / 1_000.0 * (now - a.first_ms) as f64
            + self.losses as f64 * self.loss_slack;
        self.report.worst_excess = self.report.worst_excess.max(a.count as f64 - allowed);
    }

    /// A refusal of `proxy`'s request for `key`, whose demand is `rate` a second now.
    pub(crate) fn refuse(&mut self, rate: f64, key: u32, now: u64) {
        self.report.refused += 1;
        let chance = self.picker.chance(key);
        let (levels, s) = (&self.levels, self.s);
        let level = *self
            .level_of
            .entry(key)
            .or_insert_with(|| levels.level(s.key_rate() / chance));
        // Strictly under its share (a proxy at its share exactly is refused now and then as the
        // requests of a Poisson stream bunch up), and one more admission within the bound.
        let budget = self.admitted.get(&key).is_some_and(|a| {
            (a.count + 1) as f64
                <= s.burst as f64 + s.key_rate() / 1_000.0 * (now - a.first_ms) as f64
        });
        if rate < level * (1.0 - 1e-9) && budget {
            self.report.false_refusals += 1;
            self.bin_false[(now / 100) as usize] += 1;
        }
    }

    pub(crate) fn decided(&mut self, fate: Fate, rate: f64, key: u32, now: u64) {
        match fate {
            Fate::Admitted => self.admit(key, now),
            Fate::Refused => self.refuse(rate, key, now),
            Fate::FellBack => self.report.fell_back += 1,
            Fate::Wait => {}
        }
    }
}

pub fn run(s: &Scenario) -> Report {
    let allowance = s.allowance();
    let picker = KeyPicker::new(s.keys);
    let mut rng = Rng::new(s.seed);
    let end_ms = s.seconds * 1_000;
    let mut proxies: Vec<Proxy> = (0..s.proxies)
        .map(|_| Proxy {
            keys: HashMap::new(),
            to_send: vec![Vec::new(); s.workers.max(1) as usize],
            life: 0,
            next_arrival: 0.0,
        })
        .collect();
    let mut service = Service {
        buckets: HashMap::new(),
        cold: ColdStart::Auto { epoch_ms: 0 },
        lost: false,
    };
    // Calls by the ms they are served and answered (a calendar: every call takes at most the
    // timeout), and the calls themselves.
    let horizon = (s.timeout_ms + s.rtt_ms + s.rtt_jitter_ms + 2) as usize;
    let mut served_at: Vec<Vec<usize>> = vec![Vec::new(); horizon];
    let mut answered_at: Vec<Vec<usize>> = vec![Vec::new(); horizon];
    let mut calls: Vec<Option<Call>> = Vec::new();
    let mut free_calls: Vec<usize> = Vec::new();
    let bins = (end_ms / 100 + 1) as usize;
    let mut t = Tally {
        s,
        picker: &picker,
        report: Report {
            worst_excess: f64::NEG_INFINITY,
            ..Report::default()
        },
        admitted: HashMap::new(),
        bin_requests: vec![0; bins],
        bin_false: vec![0; bins],
        levels: Levels::new(&[]),
        level_of: HashMap::new(),
        loss_slack: newcomers_reserve(s.burst) as f64
            + 1.0
            + s.key_rate() / 1_000.0 * allowance.claim_ms as f64,
        losses: 0,
    };
    // Each proxy's requests a second, and the phase of demand they are for.
    let mut rates: Vec<f64> = Vec::new();
    let mut levels_phase = u64::MAX;
    let workers = s.workers.max(1) as usize;
    for now in 0..end_ms {
        for e in &s.events {
            match *e {
                Event::Crash { at_ms, share } if at_ms == now => {
                    let n = (s.proxies as f64 * share).round() as usize;
                    for p in proxies.iter_mut().take(n) {
                        p.keys.clear();
                        p.to_send.iter_mut().for_each(Vec::clear);
                        p.life += 1;
                    }
                }
                Event::StoreLoss { at_ms } if at_ms == now => {
                    service.buckets.clear();
                    service.lost = false;
                    service.cold = ColdStart::Auto { epoch_ms: now };
                    t.losses += 1;
                }
                _ => {}
            }
        }
        let cut = |proxy: usize| {
            s.events.iter().any(|e| match *e {
                Event::Partition {
                    from_ms,
                    until_ms,
                    share,
                } => {
                    now >= from_ms
                        && now < until_ms
                        && proxy >= s.proxies - (s.proxies as f64 * share).round() as usize
                }
                _ => false,
            })
        };
        let slot = (now as usize) % horizon;
        for id in std::mem::take(&mut served_at[slot]) {
            let Some(call) = calls[id].as_mut() else {
                continue;
            };
            let answers = call
                .items
                .iter()
                .map(|(key, ask)| {
                    let it = item(s, *key, ask);
                    service.lease(s, call.proxy, *key, &it, now)
                })
                .collect();
            call.answers = Some(answers);
        }
        for id in std::mem::take(&mut answered_at[slot]) {
            let Some(call) = calls[id].take() else {
                continue;
            };
            free_calls.push(id);
            let p = &mut proxies[call.proxy];
            if p.life != call.life {
                continue;
            }
            for (n, (key, ask)) in call.items.iter().enumerate() {
                let Some(k) = p.keys.get_mut(key) else {
                    continue;
                };
                k.in_call = false;
                let before = k.state;
                k.state = match call.answers.as_ref().and_then(|a| a.get(n)) {
                    Some(a) => allowance.grant(
                        &k.state,
                        now,
                        &Grant::answered(a, *ask, call.sent_ms, (s.requests, s.per_ms)),
                    ),
                    None => allowance.fail(&k.state, now, s.retry_ms),
                };
                // A renewal the answer asks for goes out with the next tick of any worker.
                if allowance.claimed(&before, &k.state) && !k.claimed {
                    k.claimed = true;
                    let worker = (*key as usize) % p.to_send.len();
                    p.to_send[worker].push(*key);
                }
            }
        }
        // Demand now, and each key's water level (anew when demand shifts).
        let phase = now.checked_div(s.shift_ms).unwrap_or(0) * 2 + u64::from(s.bursting(now));
        if phase != levels_phase {
            let total_weight: f64 = (0..s.proxies).map(|p| s.weight(p, now)).sum();
            let fleet_rate = s.fleet_rate_at(now);
            rates = (0..s.proxies)
                .map(|p| fleet_rate * s.weight(p, now) / total_weight)
                .collect();
            t.levels = Levels::new(&rates);
            t.level_of.clear();
            levels_phase = phase;
        }
        for (n, p) in proxies.iter_mut().enumerate() {
            let rate = rates[n];
            // Each worker's tick (at its own offset): waiting requests are decided again, and
            // the claims its requests made go out in one call.
            for w in 0..workers {
                let offset = n as u64 * 3 + w as u64 * s.tick_ms / workers as u64;
                if (now + offset) % s.tick_ms != 0 {
                    continue;
                }
                let mut waiting: Vec<(u32, u64)> = Vec::new();
                for (key, k) in p.keys.iter_mut() {
                    waiting.extend(k.waiting.drain(..).map(|at| (*key, at)));
                }
                waiting.sort_unstable();
                for (key, arrived) in waiting {
                    match decide(&allowance, p, w, key, now) {
                        Fate::Wait if now < arrived + s.timeout_ms + 10 => {
                            if let Some(k) = p.keys.get_mut(&key) {
                                k.waiting.push(arrived);
                            }
                        }
                        Fate::Wait => {
                            t.report.timed_out += 1;
                            t.refuse(rate, key, now)
                        }
                        fate => t.decided(fate, rate, key, now),
                    }
                }
                let mut items = Vec::new();
                for key in std::mem::take(&mut p.to_send[w]) {
                    let Some(k) = p.keys.get_mut(&key) else {
                        continue;
                    };
                    if k.in_call {
                        p.to_send[w].push(key);
                        continue;
                    }
                    k.claimed = false;
                    k.in_call = true;
                    items.push((key, allowance.ask(&k.state, now)));
                }
                if !items.is_empty() {
                    t.report.calls += 1;
                    t.report.items += items.len() as u64;
                    let lost = cut(n) || (s.call_loss > 0.0 && rng.unit() < s.call_loss);
                    let id = free_calls.pop().unwrap_or_else(|| {
                        calls.push(None);
                        calls.len() - 1
                    });
                    calls[id] = Some(Call {
                        proxy: n,
                        life: p.life,
                        sent_ms: now,
                        items,
                        answers: None,
                    });
                    if lost {
                        answered_at[((now + s.timeout_ms) as usize) % horizon].push(id);
                    } else {
                        // (Only a run with jitter draws from the generator for it: the runs without
                        // keep their figures.)
                        let rtt = if s.rtt_jitter_ms > 0 {
                            let extra = (rng.unit() * (s.rtt_jitter_ms + 1) as f64) as u64;
                            (s.rtt_ms + extra.min(s.rtt_jitter_ms)).min(s.timeout_ms)
                        } else {
                            s.rtt_ms
                        };
                        served_at[((now + rtt / 2) as usize) % horizon].push(id);
                        answered_at[((now + rtt.max(1)) as usize) % horizon].push(id);
                    }
                }
            }
            // Arrivals this ms (Poisson).
            let per_ms = rate / 1_000.0;
            if p.next_arrival == 0.0 {
                p.next_arrival = -(1.0 - rng.unit()).ln() / per_ms;
            }
            while p.next_arrival < (now + 1) as f64 {
                p.next_arrival += -(1.0 - rng.unit()).ln() / per_ms;
                let key = picker.pick(&mut rng);
                let worker = (rng.next() % workers as u64) as usize;
                t.arrived(key, now);
                match decide(&allowance, p, worker, key, now) {
                    Fate::Wait => {
                        if let Some(k) = p.keys.get_mut(&key) {
                            k.waiting.push(now);
                        }
                    }
                    fate => t.decided(fate, rate, key, now),
                }
            }
        }
    }
    let mut report = t.report;
    report.bins = t
        .bin_requests
        .iter()
        .copied()
        .zip(t.bin_false.iter().copied())
        .collect();
    let secs = s.seconds as f64;
    report.keys_seen = t.admitted.len();
    report.calls_per_s = report.calls as f64 / secs;
    report.items_per_s = report.items as f64 / secs;
    report.items_per_call = report.items as f64 / (report.calls.max(1)) as f64;
    if s.shift_ms > 0 {
        report.follow_ms = Some(follow_ms(&report.bins, (s.shift_ms / 100) as usize));
    }
    report
}

/// See [`Report::follow_ms`]: `bins` per 100 ms, a shift every `per_phase` bins.
fn follow_ms(bins: &[(u64, u64)], per_phase: usize) -> u64 {
    let per_phase = per_phase.max(2);
    let mut slowest = 0;
    let mut start = per_phase;
    while start + per_phase <= bins.len() {
        let mut before: Vec<u64> = bins[start - per_phase / 2..start]
            .iter()
            .map(|b| b.1)
            .collect();
        before.sort_unstable();
        let baseline = before[before.len() / 2];
        let end = start + per_phase;
        let calm = |b: usize| {
            let (requests, false_refusals) = bins[b];
            false_refusals <= (2 * baseline).max(requests / 50)
        };
        let settled = (start..end)
            .find(|&b| (b..(b + 5).min(end)).all(calm))
            .unwrap_or(end);
        slowest = slowest.max((settled - start) as u64 * 100);
        start = end;
    }
    slowest
}
