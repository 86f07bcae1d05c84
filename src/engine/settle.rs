//! Costs known only after the response: what a request reserved of the rules that settle, what
//! its response showed, and the reservations settled against the key's bucket.

use super::lease::Refill;
use super::{CheckInput, Engine, QuotaRef};
use crate::config::SettleFrom;
use crate::stats::{ProcessStat, RuleStat};
use crate::usage::Usage;
use smallvec::SmallVec;
use tollgate_core::{settle, CasStore, SlotId};

/// One rule's reservation by an admitted request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reservation {
    pub which: QuotaRef,
    pub slot: SlotId,
    /// The client key's hash (a global rule's settlement may call the quota service).
    pub key: u128,
    pub reserved: u64,
    /// The key's own `limit.requests` (`limit_from`).
    pub own_requests: Option<u64>,
}

/// A request's reservations: inline for one rule.
pub type Reservations = SmallVec<[Reservation; 1]>;

/// What a response body is read for: the most bytes kept, the usage, whole numbers at paths.
#[derive(Debug, Default)]
pub struct BodyReading {
    pub max_bytes: usize,
    pub usage: bool,
    pub fields: Vec<Vec<String>>,
}

/// What the response showed of its cost, as far as it came.
#[derive(Debug, Default, Clone)]
pub struct ResponseSeen {
    /// Its status, once its headers came (none: it never answered).
    pub status: Option<u32>,
    /// For each reservation, the whole number in the header its rule reads, if any.
    pub headers: SmallVec<[Option<u64>; 1]>,
    pub body_bytes: u64,
    /// The response body's end came (else the stream was cut short, by either side).
    pub body_ended: bool,
    pub usage: Usage,
    /// The whole numbers read at body fields, by path.
    pub fields: Vec<(Vec<String>, Option<u64>)>,
}

impl Engine {
    /// Note what an admitted request reserves of `input`'s rule, if that rule settles later.
    pub(super) fn reserve(&mut self, reservations: &mut Reservations, input: &CheckInput) {
        let settles = self
            .config
            .rules
            .get(input.which.rule())
            .is_some_and(|r| r.settle.is_some());
        if settles {
            self.stats.add(
                input.which.rule(),
                RuleStat::Reserved,
                super::saturating_i64(input.cost),
            );
            reservations.push(Reservation {
                which: input.which,
                slot: input.slot,
                key: input.key,
                reserved: input.cost,
                own_requests: input.own_requests,
            });
        }
    }

    /// The response header `reservation`'s rule reads its cost from, if it reads one.
    pub fn settle_header(&self, reservation: &Reservation) -> Option<&str> {
        match &self.settle_from(reservation)? {
            SettleFrom::Header(name) => Some(name),
            _ => None,
        }
    }

    /// What of the response body `reservations` need read (none: the body is not read; its
    /// bytes may still be counted).
    pub fn body_reading(&self, reservations: &Reservations) -> Option<BodyReading> {
        let mut reading: Option<BodyReading> = None;
        for r in reservations {
            let Some(settle) = self
                .config
                .rules
                .get(r.which.rule())
                .and_then(|rule| rule.settle.as_ref())
            else {
                continue;
            };
            let (usage, field) = match &settle.from {
                SettleFrom::Usage(_) => (true, None),
                SettleFrom::BodyField(path) => (false, Some(path)),
                _ => continue,
            };
            let read = reading.get_or_insert_with(BodyReading::default);
            read.max_bytes = read.max_bytes.max(settle.max_body_bytes);
            read.usage |= usage;
            if let Some(path) = field {
                if !read.fields.contains(path) {
                    read.fields.push(path.clone());
                }
            }
        }
        reading
    }

    fn settle_from(&self, reservation: &Reservation) -> Option<&SettleFrom> {
        let rule = self.config.rules.get(reservation.which.rule())?;
        Some(&rule.settle.as_ref()?.from)
    }

    /// Settle each reservation with the cost the response showed; with nothing shown (no
    /// answer), the reservation stands.
    pub fn settle_costs<S: CasStore + ?Sized>(
        &mut self,
        store: &S,
        reservations: Reservations,
        seen: &ResponseSeen,
        now: u64,
    ) {
        for (n, r) in reservations.iter().enumerate() {
            let Some(from) = self.settle_from(r) else {
                continue;
            };
            let actual = match (seen.status, from) {
                (None, _) => r.reserved,
                (Some(status), SettleFrom::Statuses(set)) => {
                    if set.contains(status) {
                        r.reserved
                    } else {
                        0
                    }
                }
                (Some(_), SettleFrom::Header(_)) => {
                    seen.headers.get(n).copied().flatten().unwrap_or(r.reserved)
                }
                (Some(_), SettleFrom::BodyBytes) => seen.body_bytes,
                (Some(_), SettleFrom::Usage(cost)) => {
                    at_least_reserved_unless(seen.usage.complete, cost.of(&seen.usage), r.reserved)
                }
                (Some(_), SettleFrom::BodyField(path)) => at_least_reserved_unless(
                    seen.body_ended,
                    seen.fields
                        .iter()
                        .find(|(p, _)| p == path)
                        .and_then(|(_, n)| *n),
                    r.reserved,
                ),
            };
            let Some(quota) = self.quota_of(r.which) else {
                continue;
            };
            let rule = r.which.rule();
            let result = settle(
                store,
                &quota.limit_for(r.own_requests),
                &quota.table,
                r.slot,
                (r.reserved, actual),
                now,
            );
            let debt = match result {
                // A leased allowance that owes now: the next tick charges it to the global
                // bucket, where every proxy sees it.
                Ok(settled) if settled.claimed => {
                    self.renew(Refill::claimed(rule, r.slot, r.key, now));
                    settled.debt
                }
                Ok(settled) => settled.debt,
                Err(e) => {
                    self.stats.add_process(ProcessStat::ReleaseErrors, 1);
                    log::warn!(
                        "rule {}: a cost not settled: {e:?}",
                        self.config.rules[rule].name
                    );
                    continue;
                }
            };
            if debt > 0 {
                self.stats
                    .add(rule, RuleStat::Debt, super::saturating_i64(debt));
            }
            self.stats
                .add(rule, RuleStat::Settled, super::saturating_i64(actual));
            if actual < r.reserved {
                self.stats.add(
                    rule,
                    RuleStat::Refunded,
                    super::saturating_i64(r.reserved - actual),
                );
            } else {
                self.stats.add(
                    rule,
                    RuleStat::Charged,
                    super::saturating_i64(actual - r.reserved),
                );
            }
        }
    }
}

/// What a response that `reported` a cost settles: that cost once the response told its last
/// (`whole`); before, what a stream reported is its start or a running count, below what it
/// delivered, so the reservation stands unless more was reported (a client that cuts the stream
/// pays at least that). Nothing reported: the reservation.
fn at_least_reserved_unless(whole: bool, reported: Option<u64>, reserved: u64) -> u64 {
    match reported {
        Some(n) if whole => n,
        n => n.map_or(reserved, |n| n.max(reserved)),
    }
}
