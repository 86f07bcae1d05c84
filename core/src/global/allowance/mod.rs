//! A global rule's local allowance: a lease from the quota service, spent here with CAS.
//!
//! A lease is tokens granted outright plus, for a rate lease, a share of the global refill rate
//! that accrues here from the grant until the lease ends. State (32 bytes): the balance (tokens
//! granted and carried over, less those spent, in 64ths of a token, signed: below zero the key
//! owes what a settlement charged beyond it), the grant's time (`base`, ms), tokens spent since
//! the grant (what the next call reports as demand; with its flags), the global bucket's
//! remaining tokens as last reported (below zero: what it owed), the rate (milli-tokens per
//! second), the lease's end and a mark, both as ms after `base`. The mark is a refill in flight
//! (claimed by one worker, so one call per key per process), the service had nothing
//! (`EXHAUSTED`), or failed (`FAILED`). Refills themselves are the filter's business: this module
//! decides, claims, says what to ask for, and applies answers.
//!
//! A request is refused at once only when the service said there is nothing for it: its last
//! answer granted nothing, or this proxy's fair share of the rate is spent and the global bucket
//! had no tokens left. A lease that merely ran dry asks again and the request waits for the answer.
//! Each call also carries what this proxy last heard of the global bucket and of its own share
//! (its evidence), so that a service that lost the bucket can tell, start it conservatively, and
//! give renewing proxies their shares back; what a settlement charged beyond the allowance (its
//! debt), which the service charges to the global bucket; and the tokens it holds, which the
//! service takes back while that bucket is in debt.

use crate::state::{Decision, State};

mod ask;
mod parts;

pub use ask::{Ask, Grant};

use parts::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseAllowance {
    /// Tokens asked for outright with each refill (topping up what is held).
    pub lease_size: u64,
    /// A token lease (no rate), or a rate lease that was not capped, claims a refill once fewer
    /// than this many tokens are left. Otherwise leases are renewed in their last quarter, or
    /// every eighth of their term when capped.
    pub low_water: u64,
    /// A claimed refill is given up (and may be claimed again) after this long: longer than the
    /// call's timeout, so that a sent call's answer or failure always comes first.
    pub claim_ms: u64,
    /// The global bucket's capacity and the time one token takes to come back to it: what the
    /// rate-limit headers of an admitted request say (`r`, `t`), from the service's last report.
    pub global_burst: u64,
    pub global_interval_ns: u64,
    /// The global refill rate (milli-tokens per second): what a lease that ran dry asks for.
    pub global_rate_mtps: u64,
    /// A calendar quota: the service's leases last until the period ends (their `until`), which
    /// is when the global bucket is full again; no rate is leased.
    pub calendar: bool,
}

/// An exhausted calendar quota's key asks the service again this often at most while requests
/// come (its answer's retry is the period's end; tokens given back or an operator's reset come
/// sooner).
const CALENDAR_RECHECK_MS: u64 = 1_000;

impl LeaseAllowance {
    /// A token lease of `tokens` for `ttl_ms` from `now_ms`, as a grant applied to `state`.
    #[cfg(test)]
    pub(crate) fn with_tokens(
        &self,
        state: &State,
        now_ms: u64,
        tokens: u64,
        ttl_ms: u64,
    ) -> State {
        let asked = Ask {
            wanted: tokens,
            ..Ask::default()
        };
        let g = Grant {
            tokens,
            ttl_ms,
            sent_ms: now_ms,
            retry_ms: 1,
            asked,
            ..Grant::default()
        };
        self.grant(state, now_ms, &g)
    }

    pub fn decide(&self, state: &State, now_ns: u64, cost: u64) -> Decision {
        let now_ms = now_ns / 1_000_000;
        let p = parts(state).unstepped(now_ms);
        let available = p.available(now_ms, self.claim_ms);
        let marked = p.mark > now_ms;
        if available >= cost {
            let left = available - cost;
            // Renew in the lease's last quarter; a capped lease (others may be waiting for a
            // share) every eighth of it, so that shares follow demand within that time.
            let term = p.until - p.base;
            let renewal_due = if p.flags & CAPPED != 0 {
                now_ms >= p.base + term / 16
            } else {
                now_ms >= p.until - term / 4
            };
            // A token lease asks again when running low; a rate lease only if the global bucket
            // still has tokens for it (its rate is asked again at its renewal, or when it runs
            // dry).
            let running_low = left < self.low_water && (!p.accruing() || p.reported > 0);
            let mut next = Parts {
                balance: p.balance.saturating_sub(units(cost)),
                spent: p.spent.saturating_add(cost),
                flags: if left == 0 {
                    p.flags | RAN_DRY
                } else {
                    p.flags
                },
                ..p
            };
            // A rate lease that accrues beyond twice its lease size spends less than it holds:
            // it renews, asking for what it spends and giving back the surplus.
            let surplus = p.accruing() && left > self.lease_size.saturating_add(self.low_water);
            if !marked && (renewal_due || running_low || surplus) {
                next = next.claimed(now_ms, self.claim_ms);
            }
            let reported = u64::try_from(p.reported.max(0)).unwrap_or(0);
            return Decision::Admit {
                state: encode(&next),
                // What the key has globally, as of the service's last report: the bucket's
                // remaining tokens plus what this proxy still holds of them; and the time the
                // global bucket takes to be full from there.
                remaining: left.saturating_add(reported),
                reset_ns: self.full_in_ns(&p, now_ms, reported),
                delay_ns: 0,
            };
        }
        // What a settlement charged beyond the allowance goes to the service first (the claim
        // was made when it was charged): the request waits for the answer, which says what the
        // global bucket has left once it is paid.
        let owes = p.owed(p.accrual_end(now_ms, self.claim_ms)) > 0;
        if !owes
            && p.live(now_ms)
            && p.accruing()
            && p.flags & CAPPED != 0
            && p.reported < cost as i64
        {
            // Out of this proxy's fair share of the rate, and the global bucket had no tokens
            // left: refused now, not held. Enough accrues after `wait` (unless the lease ends
            // first, or a renewal changes the rate). A lease that was not capped, or whose bucket
            // still has tokens, asks for more instead (below).
            let needed = units(cost).saturating_sub(p.balance).max(0).unsigned_abs();
            let after_base =
                (u128::from(needed) * 1_000_000).div_ceil(u128::from(p.rate) * u128::from(UNIT));
            let at = u64::try_from(after_base).map_or(u64::MAX, |ms| p.base.saturating_add(ms));
            let wait_ns = at
                .saturating_sub(now_ms)
                .min(p.until - now_ms)
                .max(1)
                .saturating_mul(1_000_000);
            return Decision::Refuse {
                retry_after_ns: wait_ns,
                remaining: available,
                reset_ns: wait_ns,
            };
        }
        // The last call failed: the failure mode decides until its retry, and while the call
        // that retries is out (this request sends it when the retry is due).
        if marked && (p.mark_flags & FAILED != 0 || p.flags & FAILING != 0) {
            return Decision::Fallback { claim: None };
        }
        if p.flags & FAILING != 0 {
            return Decision::Fallback {
                claim: Some(encode(&p.claimed(now_ms, self.claim_ms))),
            };
        }
        // When the global bucket can have this request's tokens at the earliest, by the last
        // answer: its debt repaid and `cost` tokens back at the full rate.
        let missing = (cost as i64)
            .saturating_sub(p.reported)
            .max(1)
            .unsigned_abs();
        let token_back_ms = if self.calendar {
            // Its tokens come back with the next period, when its last lease ends.
            p.until.saturating_sub(now_ms)
        } else {
            let refilled_ms = u64::try_from(
                (u128::from(missing) * u128::from(self.global_interval_ns)).div_ceil(1_000_000),
            )
            .unwrap_or(u64::MAX);
            p.base.saturating_add(refilled_ms).saturating_sub(now_ms)
        };
        // Exhausted until the mark; or the last answer had nothing for this key, the next is on
        // its way, and by the last the tokens cannot be back yet: refuse rather than hold
        // requests for what is most likely nothing again. (Once they can be, the requests wait
        // for the answer, as for a first lease: a client that came back when told is not
        // refused for the call's time.)
        let nothing_yet = p.flags & DENIED != 0 && token_back_ms > 0;
        if !owes && marked && (p.mark_flags & EXHAUSTED != 0 || nothing_yet) {
            // This proxy asks again at the mark (a share may free up sooner); the client is told
            // when the global bucket can have this request's tokens at the earliest.
            let wait = (p.mark - now_ms)
                .max(token_back_ms)
                .saturating_mul(1_000_000);
            return Decision::Refuse {
                retry_after_ns: wait,
                remaining: available,
                reset_ns: wait,
            };
        }
        if marked {
            return Decision::Wait { claim: None };
        }
        // A live lease without enough for this request ran dry (the call asks for a whole lease
        // more).
        let mut claim = p.claimed(now_ms, self.claim_ms);
        if p.live(now_ms) {
            claim.flags |= RAN_DRY | WAITING;
        }
        Decision::Wait {
            claim: Some(encode(&claim)),
        }
    }

    /// True if `before → after` is the claim of a refill (the writer must send it).
    pub fn claimed(&self, before: &State, after: &State) -> bool {
        let (b, a) = (parts(before), parts(after));
        a.mark != 0 && a.mark_flags == 0 && (a.mark != b.mark || b.mark_flags != 0)
    }

    /// What to ask for when the refill claimed in `state` goes out at `now_ms` (the lease it
    /// brings accrues its old rate until then: the service replaces it when the call arrives).
    pub fn ask(&self, state: &State, now_ms: u64) -> Ask {
        let p = parts(state);
        let held = if p.live(now_ms) {
            p.balance_units(now_ms).max(0).unsigned_abs() / UNIT
        } else {
            0
        };
        // What it spent per second since its lease began (and the second carried over before),
        // `parts / of` of it, over at least `floor_ms`.
        let window_ms = p.measured_ms(now_ms);
        let per_s_mtps = |tokens: u64, parts: u128, of: u128, floor_ms: u64| {
            let ms = u128::from(window_ms.max(floor_ms));
            let per_s = u128::from(tokens) * 1_000_000 * parts / of / ms;
            u64::try_from(per_s).unwrap_or(u64::MAX)
        };
        let spent_mtps = |parts, of, floor_ms| per_s_mtps(p.spent, parts, of, floor_ms);
        let demand_mtps = if !p.live(now_ms) || p.spent == 0 {
            if p.flags & DENIED != 0 && p.live(now_ms) {
                // It asked and got nothing, with nothing spent to measure: all it can get. (Not
                // once that answer's lease has ended: an old denial says nothing of now. Asking
                // for the whole rate on it made every proxy that sees a key rarely reserve that
                // rate in turn, and false refusals grew with time — uniform keys over 100
                // proxies, 1% in the first 10 s, 7% over 40 s, 20% a minute on.)
                self.global_rate_mtps
            } else if p.accruing() {
                // Nothing spent since its grant: the share it has stands.
                p.rate
            } else {
                // Nothing measured (a key's first call): tokens only.
                0
            }
        } else if p.flags & CAPPED != 0
            && p.flags & (RAN_DRY | DENIED) != 0
            && p.requests_before_last() > 0
        {
            // Held back by fairness and out of what it got (more than one request's worth):
            // it still wants all it can get.
            self.global_rate_mtps
        } else if p.flags & (RAN_DRY | DENIED) != 0 {
            // It ran out, or got nothing more: twice the rate it spent at, so that a demand that
            // grew is found in a few rounds, while one that only had a burst does not ask for
            // the whole rate.
            per_s_mtps(p.requests_before_last(), 2, 1, 1)
        } else if p.accruing() && p.flags & CAPPED != 0 {
            // Renewing early while held back by fairness: at least what it has (it wants more).
            spent_mtps(9, 8, MEASURE_FLOOR_MS).max(p.rate)
        } else {
            // What it spends, with an eighth more (over at least a quarter of a second: a few
            // requests soon after a grant say little about a rate).
            spent_mtps(9, 8, MEASURE_FLOOR_MS)
        };
        let (known_ms, known_remaining, known_debt) = self.evidence(&p, now_ms);
        // (Also after a failed call, which froze its accrual: the service may never have had it.)
        let (share_mtps, share_ms) = if p.live(now_ms) && p.rate > 0 {
            (p.rate, p.until - now_ms)
        } else {
            (0, 0)
        };
        let returned = if held > self.lease_size.saturating_add(self.low_water) {
            held - self.lease_size
        } else {
            0
        };
        // Topping up to the lease size; a whole lease more when a request did not fit in what
        // is held (it may cost more than the lease size: it waits for several).
        let wanted = if p.flags & RAN_DRY != 0 {
            self.lease_size
        } else {
            self.lease_size.saturating_sub(held)
        };
        Ask {
            wanted,
            used: p.spent,
            demand_mtps: demand_mtps.min(self.global_rate_mtps),
            known_ms,
            known_remaining,
            known_debt,
            owed: p.owed(now_ms),
            held,
            returned,
            share_mtps,
            share_ms,
        }
    }

    /// What this proxy last heard of the global bucket, while it can still matter: an upper
    /// bound on how long ago the service wrote that answer (`claim_ms` covers the call's own
    /// time), and the tokens the bucket had left then (or owed). None (0) once the bucket is
    /// full again by that answer's own account and the lease is over: a service that does not
    /// know the bucket then may start it full.
    fn evidence(&self, p: &Parts, now_ms: u64) -> (u64, u64, u64) {
        if p.flags & ANSWERED == 0 {
            return (0, 0, 0);
        }
        let missing = i128::from(self.global_burst) - i128::from(p.reported);
        let refill_ns = u128::try_from(missing.max(0))
            .unwrap_or(0)
            .saturating_mul(u128::from(self.global_interval_ns));
        let full_at = p
            .base
            .saturating_add(u64::try_from(refill_ns.div_ceil(1_000_000)).unwrap_or(u64::MAX));
        if now_ms >= full_at.max(p.until) {
            return (0, 0, 0);
        }
        let known_ms = now_ms
            .saturating_sub(p.base)
            .saturating_add(self.claim_ms)
            .max(1);
        let remaining = u64::try_from(p.reported.max(0)).unwrap_or(0);
        (known_ms, remaining, p.reported.min(0).unsigned_abs())
    }

    /// Nanoseconds until the global bucket is full again, by the last answer (`reported`
    /// tokens left then): at the refill rate; a calendar quota's when its period ends.
    fn full_in_ns(&self, p: &Parts, now_ms: u64, reported: u64) -> u64 {
        if self.calendar {
            return p.until.saturating_sub(now_ms).saturating_mul(1_000_000);
        }
        self.global_burst
            .saturating_sub(reported)
            .saturating_mul(self.global_interval_ns)
    }

    /// The tokens held now (accrual included).
    pub fn allowance(&self, state: &State, now_ms: u64) -> u64 {
        parts(state).available(now_ms, self.claim_ms)
    }

    /// Apply the service's answer at `now_ms`: a new lease from now on, carrying over what the
    /// old one still held (its accrual up to the claim), less what the call gave back; what
    /// the call said was owed is the service's now. Nothing granted and nothing wanted marks the
    /// key exhausted until `retry_ms`. Still owing (a settlement since the call went out): a new
    /// claim, so that the service has it by the next tick.
    pub fn grant(&self, state: &State, now_ms: u64, g: &Grant) -> State {
        let p = parts(state);
        // What the old lease still held carries over while it lives; what it owed beyond what
        // the call reported (charged since it went out) always does. What the call gave back is
        // let go even where the service did not take it back (it takes back only what it knows
        // it gave: a restarted or failed-over one knows nothing): kept, it would be a surplus
        // again at the next request, whose call would give it back again and measure the demand
        // over a few ms — a lease spending 20 a second renewed at 4.5 and was refused (a rolling
        // restart of two replicas, `tests/envoy/fleet.rs`). Letting go is the stricter error.
        let given_back = g.returned.max(g.asked.returned);
        let balance = p
            .balance_units(g.sent_ms.min(now_ms))
            .saturating_add(units(g.asked.owed))
            .saturating_sub(units(g.revoked))
            .saturating_sub(units(given_back));
        let carried = if p.live(now_ms) {
            balance
        } else {
            balance.min(0)
        };
        let balance = carried.saturating_add(units(g.tokens));
        let nothing = g.tokens == 0 && g.rate_mtps == 0 && g.asked.wanted > 0;
        // Asking again cannot get more: fairness gave less than asked, or it asked for all.
        let capped = g.asked.demand_mtps > 0
            && (g.rate_mtps < g.asked.demand_mtps || g.asked.demand_mtps >= self.global_rate_mtps);
        let until = g.sent_ms.saturating_add(g.ttl_ms);
        let reported = i64::try_from(g.remaining)
            .unwrap_or(i64::MAX)
            .saturating_sub(i64::try_from(g.debt).unwrap_or(i64::MAX));
        // A token lease topped up with tokens again keeps measuring its demand from where it
        // began: a few requests between two top-ups say little about a rate.
        let rate = if until > now_ms { g.rate_mtps } else { 0 };
        // A token lease topped up again carries over what it measured of its demand, as a
        // second's worth of it (a few requests between two top-ups say little about a rate).
        let spent = if p.live(now_ms) && p.rate == 0 && rate == 0 && p.spent > 0 {
            let window = p.measured_ms(now_ms);
            p.requests_before_last().saturating_mul(MEASURE_MEMORY_MS) / window
        } else {
            0
        };
        let next = Parts {
            balance,
            spent,
            flags: ANSWERED
                | if spent > 0 { CARRIED } else { 0 }
                | if nothing { RAN_DRY | DENIED } else { 0 }
                | if capped { CAPPED } else { 0 },
            reported,
            rate,
            base: now_ms,
            until: until.max(now_ms),
            // Within a sixteenth of a lease: a share may free up at others' renewals (every
            // eighth of theirs), and this key's demand is known there now.
            mark: if nothing {
                let recheck_ms = if self.calendar {
                    CALENDAR_RECHECK_MS
                } else {
                    g.ttl_ms / 16
                };
                now_ms + g.retry_ms.min(recheck_ms).max(1)
            } else {
                0
            },
            mark_flags: if nothing { EXHAUSTED } else { 0 },
        };
        if next.owed(now_ms) > 0 {
            return encode(&next.claimed(now_ms, self.claim_ms));
        }
        encode(&next)
    }

    /// The refill failed: apply the failure mode until the retry, and while the call that
    /// retries is out — a quarter of `retry_ms` after the first failure (a service that restarts
    /// is back soon), `retry_ms` after each one that follows. Tokens held stay valid until the
    /// lease ends; the rate stops accruing (the service may have replaced it already), though the
    /// next call still says what it was. A failure is not a denial: what the last answer said no
    /// longer refuses requests. What is owed stays owed, for the next call to report.
    pub fn fail(&self, state: &State, now_ms: u64, retry_ms: u64) -> State {
        let mut p = parts(state);
        if p.live(now_ms) {
            p.balance = p.balance_units(p.accrual_end(now_ms, self.claim_ms));
            p.flags |= FROZEN;
        }
        let wait = if p.flags & FAILING == 0 {
            retry_ms / 4
        } else {
            retry_ms
        };
        p.flags = (p.flags & !DENIED) | FAILING;
        encode(&p.marked(now_ms, now_ms + wait.max(1), FAILED))
    }

    pub fn is_idle(state: &State, now_ms: u64) -> bool {
        let p = parts(state).unstepped(now_ms);
        !p.live(now_ms) && p.mark <= now_ms && p.balance >= 0
    }

    /// Whole tokens the allowance owes at `now_ms`: spent beyond what it held, not yet charged
    /// to the global bucket.
    pub fn debt(state: &State, now_ms: u64) -> u64 {
        parts(state).owed(now_ms)
    }

    /// A request that spent `reserved` turned out to cost `actual`, settled at `now_ms`: the
    /// difference goes back to the allowance, or is spent beyond it — owed, and claimed at once
    /// so that the next tick's call charges it to the global bucket, where every proxy sees it.
    pub fn settle(&self, state: &State, now_ms: u64, reserved: u64, actual: u64) -> State {
        if actual <= reserved {
            return Self::refund(state, reserved - actual);
        }
        let mut p = parts(state);
        let excess = actual - reserved;
        p.balance = p.balance.saturating_sub(units(excess));
        p.spent = p.spent.saturating_add(excess);
        let claim_out = p.mark > now_ms && p.mark_flags & EXHAUSTED == 0;
        if p.owed(p.accrual_end(now_ms, self.claim_ms)) > 0 && !claim_out {
            // A call already out reports what was owed when it went out; its answer claims
            // again for the rest. A failed service: the retry's call reports it.
            return encode(&p.claimed(now_ms, self.claim_ms));
        }
        encode(&p)
    }

    pub fn refund(state: &State, cost: u64) -> State {
        let mut p = parts(state);
        p.balance = p.balance.saturating_add(units(cost));
        p.spent = p.spent.saturating_sub(cost);
        encode(&p)
    }
}

#[cfg(test)]
mod tests;
