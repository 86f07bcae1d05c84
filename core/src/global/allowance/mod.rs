//! A global rule's local allowance: a lease from the quota service, spent here with CAS.
//!
//! A lease is tokens granted outright plus, for a rate lease, a share of the global refill rate
//! that accrues here from the grant until the lease ends. State (32 bytes): tokens granted, in
//! 64ths (carried over with what accrued of the lease before, to the 64th of a token: a low rate
//! renewed often loses nothing; and accrual frozen by a failure), tokens spent since the grant (with
//! two flags: the lease ran dry; its rate was capped by fairness), the global bucket's remaining
//! tokens as last reported, the rate (milli-tokens per second), the grant's time (`base`, ms),
//! the lease's end and a mark, both as ms after `base`. The mark is a refill in flight (claimed
//! by one worker, so one call per key per process), the service had nothing (`EXHAUSTED`), or
//! failed (`FAILED`). Refills themselves are the filter's business: this module decides, claims,
//! says what to ask for, and applies answers.
//!
//! A request is refused at once only when the service said there is nothing for it: its last
//! answer granted nothing, or this proxy's fair share of the rate is spent and the global bucket
//! had no tokens left. A lease that merely ran dry asks again and the request waits for the answer.
//! Each call also carries what this proxy last heard of the global bucket (its evidence), so that
//! a service that lost the bucket can tell, and start it conservatively.

use crate::state::{
    read_u32, read_u64, saturating_u32, write_u32, write_u64, Decision, State, CLOCK_SKEW_MS,
    STATE_BYTES,
};

const EXHAUSTED: u32 = 1 << 31;
const FAILED: u32 = 1 << 30;
/// Mark offsets are kept below this (12 days): a longer wait asks again sooner, never later.
const MARK_MAX: u64 = (1 << 30) - 1;
const RAN_DRY: u32 = 1 << 31;
const CAPPED: u32 = 1 << 30;
/// The last answer granted nothing.
const DENIED: u32 = 1 << 29;
/// The service answered for this key at `base` (with the bucket's `reported` tokens then).
const ANSWERED: u32 = 1 << 28;
/// The last call failed: the failure mode decides, also while the next call is out.
const FAILING: u32 = 1 << 27;
const FLAGS: u32 = RAN_DRY | CAPPED | DENIED | ANSWERED | FAILING;
const SPENT: u32 = FAILING - 1;
/// Granted tokens are kept in these parts of a token.
const UNIT: u64 = 64;

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
}

/// What a refill asks the service for, from the key's state when the call goes out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ask {
    /// Tokens outright: the lease size less what is still held.
    pub wanted: u64,
    /// Tokens spent since the last grant.
    pub used: u64,
    /// The refill rate wanted (milli-tokens per second): the spending rate since the last grant
    /// with a quarter more, the whole global rate if the lease ran dry, 0 with nothing measured.
    pub demand_mtps: u64,
    /// Evidence of the bucket: this proxy had an answer for it at most `known_ms` ago, saying
    /// the bucket held `known_remaining` tokens; 0: none (never answered, or the bucket is as
    /// good as full again by what that answer said).
    pub known_ms: u64,
    pub known_remaining: u64,
}

/// The service's answer for one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Grant {
    pub tokens: u64,
    pub rate_mtps: u64,
    pub ttl_ms: u64,
    /// When the refill was claimed: the lease ends `ttl_ms` after it (never after the service's
    /// own reservation ends).
    pub claimed_ms: u64,
    /// Granted nothing: ask again after this long.
    pub retry_ms: u64,
    /// The global bucket's remaining tokens.
    pub remaining: u64,
    pub asked: Ask,
}

#[derive(Debug, Clone, Copy, Default)]
struct Parts {
    /// In [`UNIT`]s of a token.
    granted: u64,
    spent: u64,
    flags: u32,
    reported: u64,
    rate: u64,
    base: u64,
    /// Absolute ms.
    until: u64,
    /// Absolute ms; 0: none.
    mark: u64,
    mark_flags: u32,
}

fn parts(state: &State) -> Parts {
    let spent = read_u32(state, 4);
    let base = read_u64(state, 16);
    let mark = read_u32(state, 28);
    let mark_at = u64::from(mark & !(EXHAUSTED | FAILED));
    Parts {
        granted: u64::from(read_u32(state, 0)),
        spent: u64::from(spent & SPENT),
        flags: spent & FLAGS,
        reported: u64::from(read_u32(state, 8)),
        rate: u64::from(read_u32(state, 12)),
        base,
        until: base + u64::from(read_u32(state, 24)),
        mark: if mark_at == 0 { 0 } else { base + mark_at },
        mark_flags: mark & (EXHAUSTED | FAILED),
    }
}

fn encode(p: &Parts) -> State {
    let mut s = [0; STATE_BYTES];
    write_u32(&mut s, 0, saturating_u32(p.granted));
    write_u32(
        &mut s,
        4,
        saturating_u32(p.spent.min(u64::from(SPENT))) | p.flags,
    );
    write_u32(&mut s, 8, saturating_u32(p.reported));
    write_u32(&mut s, 12, saturating_u32(p.rate));
    write_u64(&mut s, 16, p.base);
    write_u32(&mut s, 24, saturating_u32(p.until.saturating_sub(p.base)));
    let mark = if p.mark == 0 {
        0
    } else {
        p.mark.saturating_sub(p.base).clamp(1, MARK_MAX) as u32 | p.mark_flags
    };
    write_u32(&mut s, 28, mark);
    s
}

impl Parts {
    /// The state as read at `now_ms`: answered further ahead than clocks differ, the clock stepped
    /// back. Then the lease is not trusted (it ends now, its unspent tokens are given up:
    /// stricter, never looser) and no mark holds: the next request claims a refill at once,
    /// instead of every request waiting (or applying a failure mode) until the clock catches up.
    fn unstepped(mut self, now_ms: u64) -> Self {
        if self.base > now_ms.saturating_add(CLOCK_SKEW_MS) {
            self.base = now_ms;
            self.until = now_ms;
            self.mark = 0;
            self.mark_flags = 0;
        }
        self
    }

    fn live(&self, now_ms: u64) -> bool {
        now_ms < self.until
    }

    /// A refill is claimed (whether or not its claim has expired): accrual stops at the claim,
    /// since the service replaces this lease's reservation when the call arrives.
    fn claim_at(&self, claim_ms: u64) -> Option<u64> {
        (self.mark != 0 && self.mark_flags == 0).then(|| self.mark.saturating_sub(claim_ms))
    }

    /// What accrued from the rate until `end` (never past the lease's end), in [`UNIT`]s.
    fn accrued(&self, end_ms: u64) -> u64 {
        let ms = end_ms.min(self.until).saturating_sub(self.base);
        let units = u128::from(self.rate) * u128::from(ms) * u128::from(UNIT) / 1_000_000;
        u64::try_from(units).unwrap_or(u64::MAX)
    }

    /// Granted and accrued until `end`, less what was spent, in [`UNIT`]s: below 0 when a
    /// settlement charged more than the lease held (debt, repaid from the next grants).
    fn balance_units(&self, end_ms: u64) -> i128 {
        i128::from(self.granted) + i128::from(self.accrued(end_ms))
            - i128::from(self.spent) * i128::from(UNIT)
    }

    /// Whole tokens owed: spent beyond what the lease held until `end`.
    fn owed(&self, end_ms: u64) -> u64 {
        let units = u128::try_from(-self.balance_units(end_ms)).unwrap_or(0);
        u64::try_from(units.div_ceil(u128::from(UNIT))).unwrap_or(u64::MAX)
    }

    /// Granted and accrued until `end`, less what was spent, in [`UNIT`]s.
    fn held_units(&self, end_ms: u64) -> u64 {
        u64::try_from(self.balance_units(end_ms).max(0)).unwrap_or(u64::MAX)
    }

    /// Whole tokens that may be spent now.
    fn available(&self, now_ms: u64, claim_ms: u64) -> u64 {
        if !self.live(now_ms) {
            return 0;
        }
        let end = self.claim_at(claim_ms).map_or(now_ms, |c| c.min(now_ms));
        self.held_units(end) / UNIT
    }

    /// Write a mark at `mark` (absolute ms); a key without a live lease starts afresh, keeping
    /// the time of its last answer as `base` while offsets from it stay small.
    fn marked(mut self, now_ms: u64, mark: u64, flags: u32) -> Self {
        if !self.live(now_ms) {
            let recent =
                self.flags & ANSWERED != 0 && now_ms.saturating_sub(self.base) < MARK_MAX / 2;
            let kept = if recent { ANSWERED } else { 0 };
            self = Parts {
                reported: self.reported,
                flags: self.flags & (RAN_DRY | DENIED | FAILING) | kept,
                base: if recent { self.base } else { now_ms },
                until: now_ms,
                ..Parts::default()
            };
        }
        self.mark = mark.max(self.base + 1);
        self.mark_flags = flags;
        self
    }
}

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
            claimed_ms: now_ms,
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
                now_ms >= p.base + term / 8
            } else {
                now_ms >= p.until - term / 4
            };
            // A token lease asks again when running low; a rate lease only if asking can get
            // more: it was not capped by fairness, or the global bucket still has tokens.
            let running_low =
                left < self.low_water && (p.rate == 0 || p.flags & CAPPED == 0 || p.reported > 0);
            let mut next = Parts {
                spent: p.spent.saturating_add(cost),
                flags: if left == 0 {
                    p.flags | RAN_DRY
                } else {
                    p.flags
                },
                ..p
            };
            if !marked && (renewal_due || running_low) {
                next.mark = now_ms + self.claim_ms;
                next.mark_flags = 0;
            }
            return Decision::Admit {
                state: encode(&next),
                // What the key has globally, as of the service's last report: the bucket's
                // remaining tokens plus what this proxy still holds of them; and the time the
                // global bucket takes to be full from there.
                remaining: left.saturating_add(p.reported),
                reset_ns: self
                    .global_burst
                    .saturating_sub(p.reported)
                    .saturating_mul(self.global_interval_ns),
                delay_ns: 0,
            };
        }
        if p.live(now_ms) && p.rate > 0 && p.flags & CAPPED != 0 && p.reported < cost {
            // Out of this proxy's fair share of the rate, and the global bucket had no tokens
            // left: refused now, not held. Enough accrues after `wait` (unless the lease ends
            // first, or a renewal changes the rate). A lease that was not capped, or whose bucket
            // still has tokens, asks for more instead (below).
            let needed = (p.spent + cost)
                .saturating_mul(UNIT)
                .saturating_sub(p.granted);
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
                claim: Some(encode(&p.marked(now_ms, now_ms + self.claim_ms, 0))),
            };
        }
        // Exhausted until the mark; or the last answer had nothing for this key and the next is
        // on its way: refuse rather than hold requests for what is most likely nothing again.
        if marked && (p.mark_flags & EXHAUSTED != 0 || p.flags & DENIED != 0) {
            // This proxy asks again at the mark (a share may free up sooner); the client is told
            // when a token can be back in the global bucket at the earliest, by the answer.
            let token_back_ms = p
                .base
                .saturating_add(self.global_interval_ns.div_ceil(1_000_000))
                .saturating_sub(now_ms);
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
        Decision::Wait {
            claim: Some(encode(&p.marked(now_ms, now_ms + self.claim_ms, 0))),
        }
    }

    /// True if `before → after` is the claim of a refill (the writer must send it).
    pub fn claimed(&self, before: &State, after: &State) -> bool {
        let (b, a) = (parts(before), parts(after));
        a.mark != 0 && a.mark_flags == 0 && (a.mark != b.mark || b.mark_flags != 0)
    }

    /// What to ask for when the refill claimed in `state` goes out at `now_ms`.
    pub fn ask(&self, state: &State, now_ms: u64) -> Ask {
        let p = parts(state);
        let held = p.available(now_ms, self.claim_ms);
        let window_ms = now_ms.saturating_sub(p.base);
        let demand_mtps = if p.flags & RAN_DRY != 0 {
            // It ran out, or got nothing: it wants all it can get.
            self.global_rate_mtps
        } else if !p.live(now_ms) || p.spent == 0 {
            0
        } else {
            let per_s = u128::from(p.spent) * 1_000_000 * 5 / 4 / u128::from(window_ms.max(1));
            u64::try_from(per_s).unwrap_or(u64::MAX)
        };
        let (known_ms, known_remaining) = self.evidence(&p, now_ms);
        // What is owed comes out of the next grant first: ask for it on top.
        let owed = p.owed(p.claim_at(self.claim_ms).map_or(now_ms, |c| c.min(now_ms)));
        Ask {
            wanted: self.lease_size.saturating_sub(held).saturating_add(owed),
            used: p.spent,
            demand_mtps: demand_mtps.min(self.global_rate_mtps),
            known_ms,
            known_remaining,
        }
    }

    /// What this proxy last heard of the global bucket, while it can still matter: an upper
    /// bound on how long ago the service wrote that answer (`claim_ms` covers the call's own
    /// time), and the tokens the bucket had left then. None (0) once the bucket is full again by
    /// that answer's own account and the lease is over: a service that does not know the bucket
    /// then may start it full.
    fn evidence(&self, p: &Parts, now_ms: u64) -> (u64, u64) {
        if p.flags & ANSWERED == 0 {
            return (0, 0);
        }
        let refill_ns = self
            .global_burst
            .saturating_sub(p.reported)
            .saturating_mul(self.global_interval_ns);
        let full_at = p.base.saturating_add(refill_ns.div_ceil(1_000_000));
        if now_ms >= full_at.max(p.until) {
            return (0, 0);
        }
        let known_ms = now_ms
            .saturating_sub(p.base)
            .saturating_add(self.claim_ms)
            .max(1);
        (known_ms, p.reported)
    }

    /// The tokens held now (accrual included).
    pub fn allowance(&self, state: &State, now_ms: u64) -> u64 {
        parts(state).available(now_ms, self.claim_ms)
    }

    /// Apply the service's answer at `now_ms`: a new lease from now on, carrying over what the
    /// old one still held (its accrual up to the claim). Nothing granted and nothing wanted
    /// marks the key exhausted until `retry_ms`.
    pub fn grant(&self, state: &State, now_ms: u64, g: &Grant) -> State {
        let p = parts(state);
        // What the old lease still held carries over while it lives; what it owed (a settlement
        // charged beyond it) always does, and is repaid from this grant first.
        let balance = p.balance_units(g.claimed_ms.min(now_ms));
        let carried = if p.live(now_ms) {
            balance
        } else {
            balance.min(0)
        };
        let total = carried + i128::from(g.tokens.saturating_mul(UNIT));
        let (granted, owed) = if total >= 0 {
            (u64::try_from(total).unwrap_or(u64::MAX), 0)
        } else {
            let tokens = u128::try_from(-total)
                .unwrap_or(0)
                .div_ceil(u128::from(UNIT));
            (0, u64::try_from(tokens).unwrap_or(u64::MAX))
        };
        let nothing = g.tokens == 0 && g.rate_mtps == 0 && g.asked.wanted > 0;
        // Asking again cannot get more: fairness gave less than asked, or it asked for all.
        let capped = g.asked.demand_mtps > 0
            && (g.rate_mtps < g.asked.demand_mtps || g.asked.demand_mtps >= self.global_rate_mtps);
        let until = g.claimed_ms.saturating_add(g.ttl_ms);
        encode(&Parts {
            granted,
            spent: owed,
            flags: ANSWERED
                | if nothing { RAN_DRY | DENIED } else { 0 }
                | if capped { CAPPED } else { 0 },
            reported: g.remaining,
            rate: if until > now_ms { g.rate_mtps } else { 0 },
            base: now_ms,
            until: until.max(now_ms),
            // Within a sixteenth of a lease: a share may free up at others' renewals (every
            // eighth of theirs), and this key's demand is known there now.
            mark: if nothing {
                now_ms + g.retry_ms.min(g.ttl_ms / 16).max(1)
            } else {
                0
            },
            mark_flags: if nothing { EXHAUSTED } else { 0 },
        })
    }

    /// The refill failed: apply the failure mode for `retry_ms`, and while the call that retries
    /// is out. Tokens held stay valid until the lease ends; the rate stops accruing (the service
    /// may have replaced it already). A failure is not a denial: what the last answer said no
    /// longer refuses requests.
    pub fn fail(&self, state: &State, now_ms: u64, retry_ms: u64) -> State {
        let mut p = parts(state);
        if p.live(now_ms) {
            let end = p.claim_at(self.claim_ms).unwrap_or(now_ms).min(now_ms);
            p.granted = p.granted.saturating_add(p.accrued(end));
            p.rate = 0;
        }
        p.flags = (p.flags & !DENIED) | FAILING;
        encode(&p.marked(now_ms, now_ms + retry_ms.max(1), FAILED))
    }

    pub fn is_idle(state: &State, now_ms: u64) -> bool {
        let p = parts(state).unstepped(now_ms);
        !p.live(now_ms) && p.mark <= now_ms
    }

    /// Whole tokens the allowance owes at `now_ms`: spent beyond what it held.
    pub fn debt(state: &State, now_ms: u64) -> u64 {
        parts(state).owed(now_ms)
    }

    /// A request that spent `reserved` turned out to cost `actual`: the difference goes back to
    /// the allowance, or is spent beyond it (owed, and repaid from the next grants).
    pub fn settle(state: &State, reserved: u64, actual: u64) -> State {
        if actual <= reserved {
            return Self::refund(state, reserved - actual);
        }
        let mut p = parts(state);
        p.spent = p.spent.saturating_add(actual - reserved);
        encode(&p)
    }

    pub fn refund(state: &State, cost: u64) -> State {
        let mut p = parts(state);
        if p.spent >= cost {
            p.spent -= cost;
        } else {
            p.granted = p
                .granted
                .saturating_add((cost - p.spent).saturating_mul(UNIT));
            p.spent = 0;
        }
        encode(&p)
    }
}

#[cfg(test)]
mod tests;
