//! The keys that asked the most of each limit lately, in bounded memory (a space-saving sketch
//! per limit over the last one to two minutes): the admin API's "who uses this limit now".

use serde::Serialize;
use std::collections::HashMap;
use std::sync::Mutex;
use tollgate_core::global::lease::{LeaseGrant, LeaseItem};

/// Limits followed at once; a new limit beyond takes the place of one not seen for two windows,
/// or is not followed.
pub const MAX_LIMITS: usize = 1024;
/// Keys counted per limit and window (the sketch's counters): a key that asks more than
/// 1/`KEYS_PER_LIMIT` of a window's tokens is always among them.
pub const KEYS_PER_LIMIT: usize = 32;
/// A window's length: the busiest are those of this window and the one before.
pub const WINDOW_MS: u64 = 60_000;

/// One key's counts in a window. `asked` is the sketch's count: at most `overcount` of it
/// may belong to keys it replaced.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct KeyCounts {
    pub key: String,
    /// Tokens asked for (the sketch ranks by this).
    pub asked: u64,
    pub granted: u64,
    /// Items granted nothing though they asked.
    pub denied: u64,
    pub overcount: u64,
}

#[derive(Debug, Default)]
struct Window {
    keys: Vec<KeyCounts>,
}

impl Window {
    fn add(&mut self, key: &str, asked: u64, granted: u64, denied: u64) {
        let at = match self.keys.iter().position(|k| k.key == key) {
            Some(at) => at,
            None if self.keys.len() < KEYS_PER_LIMIT => {
                self.keys.push(KeyCounts {
                    key: key.to_owned(),
                    ..KeyCounts::default()
                });
                self.keys.len() - 1
            }
            None => {
                // Space-saving: the least-asking key's place, its count carried as overcount.
                let Some((at, least)) = self.keys.iter().enumerate().min_by_key(|(_, k)| k.asked)
                else {
                    return;
                };
                let carried = least.asked;
                self.keys[at] = KeyCounts {
                    key: key.to_owned(),
                    asked: carried,
                    overcount: carried,
                    ..KeyCounts::default()
                };
                at
            }
        };
        let k = &mut self.keys[at];
        k.asked = k.asked.saturating_add(asked);
        k.granted = k.granted.saturating_add(granted);
        k.denied = k.denied.saturating_add(denied);
    }
}

#[derive(Debug, Default)]
struct LimitSeen {
    rule: String,
    requests: u64,
    per_ms: u64,
    burst: u64,
    /// A calendar quota's period (it does not refill within it).
    period: Option<(u64, u64)>,
    started_ms: u64,
    current: Window,
    previous: Window,
}

impl LimitSeen {
    /// Start a new window if this one is over (the one before goes; two over: both).
    fn roll(&mut self, now_ms: u64) {
        let age = now_ms.saturating_sub(self.started_ms);
        if age >= WINDOW_MS {
            self.previous = if age >= 2 * WINDOW_MS {
                Window::default()
            } else {
                std::mem::take(&mut self.current)
            };
            self.current = Window::default();
            self.started_ms = now_ms - age % WINDOW_MS;
        }
    }
}

/// A limit as this service last saw it, and its busiest keys, most asking first.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct LimitReport {
    pub limit_id: String,
    pub rule: String,
    pub requests: u64,
    pub per_ms: u64,
    pub burst: u64,
    pub keys: Vec<KeyCounts>,
}

/// The limits followed, and until when none of them can make room for another (all seen within
/// two windows then): a caller sending new limits without end costs one look at the table per
/// window, not a pass over it per item.
#[derive(Debug, Default)]
struct Limits {
    seen: HashMap<String, LimitSeen>,
    full_until_ms: u64,
}

/// The limits this service serves and their busiest keys.
#[derive(Debug, Default)]
pub struct Busiest {
    limits: Mutex<Limits>,
}

impl Busiest {
    fn lock(&self) -> std::sync::MutexGuard<'_, Limits> {
        self.limits.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Count a served call's items, under one lock: [`Recorder::add`] each.
    pub fn recorder(&self, now_ms: u64) -> Recorder<'_> {
        Recorder {
            limits: self.lock(),
            now_ms,
        }
    }

    /// Count a served call's items (`grants[i]` answers `items[i]`).
    #[cfg(test)]
    pub fn record(&self, items: &[LeaseItem], grants: &[LeaseGrant], now_ms: u64) {
        let mut recorder = self.recorder(now_ms);
        for (item, grant) in items.iter().zip(grants) {
            recorder.add(item, grant);
        }
    }

    /// The limit `limit_id` as last seen, as an item of it asking for nothing.
    pub fn limit(&self, limit_id: &str) -> Option<LeaseItem> {
        self.lock().seen.get(limit_id).map(|l| LeaseItem {
            requests: l.requests,
            per_ms: l.per_ms,
            burst: l.burst,
            period: l.period,
            ..LeaseItem::default()
        })
    }

    /// Every limit seen in the last two windows (or the one named), each with its `top` busiest
    /// keys of this window and the one before, summed; limits by name.
    pub fn report(&self, limit_id: Option<&str>, top: usize, now_ms: u64) -> Vec<LimitReport> {
        let mut limits = self.lock();
        let mut out = Vec::new();
        for (id, seen) in limits.seen.iter_mut() {
            if limit_id.is_some_and(|want| want != id) {
                continue;
            }
            seen.roll(now_ms);
            let mut keys: Vec<KeyCounts> = seen.previous.keys.clone();
            for k in &seen.current.keys {
                match keys.iter_mut().find(|p| p.key == k.key) {
                    Some(p) => {
                        p.asked += k.asked;
                        p.granted += k.granted;
                        p.denied += k.denied;
                        p.overcount += k.overcount;
                    }
                    None => keys.push(k.clone()),
                }
            }
            if keys.is_empty() {
                continue;
            }
            keys.sort_by(|a, b| b.asked.cmp(&a.asked).then_with(|| a.key.cmp(&b.key)));
            keys.truncate(top);
            out.push(LimitReport {
                limit_id: id.clone(),
                rule: seen.rule.clone(),
                requests: seen.requests,
                per_ms: seen.per_ms,
                burst: seen.burst,
                keys,
            });
        }
        out.sort_by(|a, b| {
            a.rule
                .cmp(&b.rule)
                .then_with(|| a.limit_id.cmp(&b.limit_id))
        });
        out
    }
}

/// Counts a call's items into [`Busiest`], holding its lock.
pub struct Recorder<'a> {
    limits: std::sync::MutexGuard<'a, Limits>,
    now_ms: u64,
}

impl Recorder<'_> {
    /// Count one served item and its answer.
    pub fn add(&mut self, item: &LeaseItem, grant: &LeaseGrant) {
        let now_ms = self.now_ms;
        let limits = &mut *self.limits;
        let seen = match limits.seen.get_mut(item.limit_id.as_str()) {
            Some(seen) => seen,
            None => {
                if limits.seen.len() >= MAX_LIMITS {
                    if now_ms < limits.full_until_ms {
                        return;
                    }
                    let stale = limits
                        .seen
                        .iter()
                        .find(|(_, l)| now_ms.saturating_sub(l.started_ms) >= 2 * WINDOW_MS)
                        .map(|(id, _)| id.clone());
                    match stale {
                        Some(id) => limits.seen.remove(&id),
                        None => {
                            let earliest = limits.seen.values().map(|l| l.started_ms).min();
                            limits.full_until_ms = earliest.unwrap_or(now_ms) + 2 * WINDOW_MS;
                            return;
                        }
                    };
                }
                limits
                    .seen
                    .entry(item.limit_id.clone())
                    .or_insert(LimitSeen {
                        started_ms: now_ms,
                        ..LimitSeen::default()
                    })
            }
        };
        seen.roll(now_ms);
        if seen.rule != item.rule {
            seen.rule.clone_from(&item.rule);
        }
        (seen.requests, seen.per_ms, seen.burst) = (item.requests, item.per_ms, item.burst);
        seen.period = item.period;
        // As the service's `denials`: asked (tokens or a rate) and got neither.
        let asked = item.wanted > 0 || item.demand_mtps() > 0;
        let denied = u64::from(asked && grant.granted == 0 && grant.rate == 0.0);
        seen.current
            .add(&item.key, item.wanted, grant.granted, denied);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(limit: &str, key: &str, wanted: u64) -> LeaseItem {
        LeaseItem {
            rule: format!("rule-{limit}"),
            limit_id: limit.into(),
            key: key.into(),
            requests: 10,
            per_ms: 1000,
            burst: 10,
            wanted,
            ..LeaseItem::default()
        }
    }

    #[test]
    fn three_heavy_keys_among_ten_thousand_light_ones_come_first() {
        let busiest = Busiest::default();
        let grant = |granted| LeaseGrant {
            granted,
            ..LeaseGrant::default()
        };
        for round in 0..10_000u64 {
            let light = item("l", &format!("light-{round}"), 1);
            busiest.record(&[light], &[grant(1)], round);
            if round % 10 == 0 {
                for heavy in ["a", "b", "c"] {
                    busiest.record(&[item("l", heavy, 50)], &[grant(0)], round);
                }
            }
        }
        let report = busiest.report(None, 5, 10_000);
        assert_eq!(report.len(), 1);
        let top: Vec<&str> = report[0]
            .keys
            .iter()
            .take(3)
            .map(|k| k.key.as_str())
            .collect();
        let mut sorted = top.clone();
        sorted.sort();
        assert_eq!(sorted, ["a", "b", "c"], "{report:#?}");
        assert!(report[0].keys[..3]
            .iter()
            .all(|k| k.denied == 1000 && k.granted == 0));
        assert_eq!(report[0].rule, "rule-l");
        // Windows: two minutes later, nothing is left to report.
        assert!(busiest.report(None, 5, 10_000 + 2 * WINDOW_MS).is_empty());
    }

    #[test]
    fn memory_is_bounded_by_limits_and_keys() {
        let busiest = Busiest::default();
        for i in 0..(MAX_LIMITS as u64 + 10) {
            for k in 0..100 {
                busiest.record(
                    &[item(&format!("limit-{i}"), &format!("k{k}"), 1)],
                    &[LeaseGrant::default()],
                    0,
                );
            }
        }
        let report = busiest.report(None, usize::MAX, 0);
        assert_eq!(report.len(), MAX_LIMITS);
        assert!(report.iter().all(|l| l.keys.len() == KEYS_PER_LIMIT));
        // A new limit takes the place of one not seen for two windows.
        busiest.record(
            &[item("new", "k", 1)],
            &[LeaseGrant::default()],
            2 * WINDOW_MS,
        );
        assert!(busiest.limit("new").is_some());
    }
}
