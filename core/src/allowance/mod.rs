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

    /// Granted and accrued until `end`, less what was spent, in [`UNIT`]s.
    fn held_units(&self, end_ms: u64) -> u64 {
        self.granted
            .saturating_add(self.accrued(end_ms))
            .saturating_sub(self.spent.saturating_mul(UNIT))
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
            return Decision::Allow {
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
            return Decision::Deny {
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
            return Decision::Deny {
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
        Ask {
            wanted: self.lease_size.saturating_sub(held),
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
        let carried = if p.live(now_ms) {
            p.held_units(g.claimed_ms.min(now_ms))
        } else {
            0
        };
        let nothing = g.tokens == 0 && g.rate_mtps == 0 && g.asked.wanted > 0;
        // Asking again cannot get more: fairness gave less than asked, or it asked for all.
        let capped = g.asked.demand_mtps > 0
            && (g.rate_mtps < g.asked.demand_mtps || g.asked.demand_mtps >= self.global_rate_mtps);
        let until = g.claimed_ms.saturating_add(g.ttl_ms);
        encode(&Parts {
            granted: carried.saturating_add(g.tokens.saturating_mul(UNIT)),
            spent: 0,
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
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;
    const T0: u64 = 1_700_000_000_000; // ms

    fn lease() -> LeaseAllowance {
        LeaseAllowance {
            lease_size: 10,
            low_water: 5,
            claim_ms: 200,
            global_burst: 0,
            global_interval_ns: 0,
            global_rate_mtps: 100_000,
        }
    }

    fn grant(tokens: u64, rate_mtps: u64, at: u64, ttl_ms: u64) -> Grant {
        Grant {
            tokens,
            rate_mtps,
            ttl_ms,
            claimed_ms: at,
            retry_ms: 300,
            asked: Ask {
                wanted: 10,
                ..Ask::default()
            },
            ..Grant::default()
        }
    }

    fn allowed(l: &LeaseAllowance, s: &State, at_ms: u64) -> State {
        match l.decide(s, at_ms * MS, 1) {
            Decision::Allow { state, .. } => state,
            d => panic!("at {at_ms}: {d:?}"),
        }
    }

    #[test]
    fn a_clock_stepped_back_claims_a_refill_at_once_instead_of_waiting_for_the_clock() {
        let l = lease();
        let mut s = l.grant(&[0; 32], T0, &grant(2, 0, T0, 10_000));
        s = allowed(&l, &s, T0 + 1);
        s = allowed(&l, &s, T0 + 2);
        // Below the low-water mark the first spend claimed the refill (its mark: T0 + 201);
        // empty, a request waits for it...
        assert_eq!(
            l.decide(&s, (T0 + 3) * MS, 1),
            Decision::Wait { claim: None }
        );
        let claimed = s;
        // ... and the clock steps back an hour before the answer comes (the call failed).
        let back = T0 - 3_600_000;
        match l.decide(&claimed, back * MS, 1) {
            // Before: Wait { claim: None } for an hour, every request timing out.
            Decision::Wait { claim: Some(again) } => {
                assert!(l.claimed(&claimed, &again));
                assert_eq!(parts(&again).base, back);
            }
            d => panic!("{d:?}"),
        }
    }

    #[test]
    fn a_new_key_claims_a_refill_then_waits_then_spends_its_grant() {
        let l = lease();
        let fresh = [0; STATE_BYTES];
        let Decision::Wait {
            claim: Some(claimed),
        } = l.decide(&fresh, T0 * MS, 1)
        else {
            panic!("a new key waits and claims");
        };
        assert!(l.claimed(&fresh, &claimed));
        // Others wait without claiming again.
        assert_eq!(
            l.decide(&claimed, T0 * MS, 1),
            Decision::Wait { claim: None }
        );
        assert_eq!(l.ask(&claimed, T0).wanted, 10);
        let granted = l.grant(&claimed, T0, &grant(10, 0, T0, 1_000));
        let mut s = granted;
        for i in 0..10u64 {
            match l.decide(&s, (T0 + 1) * MS, 1) {
                Decision::Allow {
                    state, remaining, ..
                } => {
                    assert_eq!(remaining, 9 - i);
                    // Below the low-water mark (5 left) the spender claims the next refill, once.
                    assert_eq!(l.claimed(&s, &state), i == 5, "at {i}");
                    s = state;
                }
                d => panic!("{d:?}"),
            }
        }
        // Empty with a refill in flight: wait.
        assert_eq!(
            l.decide(&s, (T0 + 1) * MS, 1),
            Decision::Wait { claim: None }
        );
        // It ran dry: the refill asks for the whole rate.
        let ask = l.ask(&s, T0 + 2);
        assert_eq!((ask.wanted, ask.used, ask.demand_mtps), (10, 10, 100_000));
    }

    #[test]
    fn a_rate_lease_accrues_and_refuses_at_once_when_spent() {
        let l = lease();
        // 2 tokens outright and 10 per second (10 000 mtps) for 1 s from T0, capped by fairness
        // (it asked for 30).
        let mut g = grant(2, 10_000, T0, 1_000);
        g.asked.demand_mtps = 30_000;
        let mut s = l.grant(&[0; STATE_BYTES], T0, &g);
        s = allowed(&l, &s, T0);
        s = allowed(&l, &s, T0);
        // Spent: refused at once, told when the next token has accrued (at 100 ms).
        assert_eq!(
            l.decide(&s, (T0 + 50) * MS, 1),
            Decision::Deny {
                retry_after_ns: 50 * MS,
                remaining: 0,
                reset_ns: 50 * MS
            }
        );
        s = allowed(&l, &s, T0 + 100);
        assert!(matches!(
            l.decide(&s, (T0 + 150) * MS, 1),
            Decision::Deny { .. }
        ));
    }

    #[test]
    fn leases_renew_in_their_last_quarter_or_every_eighth_when_capped() {
        let l = lease();
        // As asked, with 10 tokens in hand, spending what accrues: no claim before 750 ms.
        let mut g = grant(10, 10_000, T0, 1_000);
        g.asked.demand_mtps = 10_000;
        let mut s = l.grant(&[0; STATE_BYTES], T0, &g);
        for t in (100..=700).step_by(100) {
            let next = allowed(&l, &s, T0 + t);
            assert!(!l.claimed(&s, &next), "at {t}");
            s = next;
        }
        let renewed = allowed(&l, &s, T0 + 750);
        assert!(l.claimed(&s, &renewed));
        // The accrual stops at the claim: what is held at 750 is all there is until the answer.
        assert_eq!(l.allowance(&renewed, T0 + 750), 9);
        assert_eq!(l.allowance(&renewed, T0 + 900), 9);
        // The new lease (20 per second) accrues from the answer; the old one ends.
        let next = l.grant(&renewed, T0 + 760, &grant(0, 20_000, T0 + 750, 1_000));
        assert_eq!(l.allowance(&next, T0 + 760), 9);
        assert_eq!(l.allowance(&next, T0 + 810), 10);
        assert!(!LeaseAllowance::is_idle(&next, T0 + 1_749));
        assert!(LeaseAllowance::is_idle(&next, T0 + 1_750));

        // Capped by fairness: renewed every eighth of the lease (125 ms).
        let mut g = grant(10, 10_000, T0, 1_000);
        g.asked.demand_mtps = 30_000;
        let s = l.grant(&[0; STATE_BYTES], T0, &g);
        let next = allowed(&l, &s, T0 + 100);
        assert!(!l.claimed(&s, &next));
        assert!(l.claimed(&next, &allowed(&l, &next, T0 + 125)));
    }

    #[test]
    fn running_low_asks_again_only_when_asking_can_get_more() {
        let l = lease();
        // Capped (asked 50, got 10 per second): running low is no reason to ask before the
        // eighth.
        let mut g = grant(0, 10_000, T0, 1_000);
        g.asked.demand_mtps = 50_000;
        let s = l.grant(&[0; STATE_BYTES], T0, &g);
        let next = allowed(&l, &s, T0 + 100);
        assert!(!l.claimed(&s, &next));
        // Not capped: running low claims at once, and with nothing left it asks for more
        // rather than refuse (the service may well have it).
        let mut g = grant(0, 10_000, T0, 1_000);
        g.asked.demand_mtps = 10_000;
        let s = l.grant(&[0; STATE_BYTES], T0, &g);
        let next = allowed(&l, &s, T0 + 100);
        assert!(l.claimed(&s, &next));
        assert_eq!(
            l.decide(&next, (T0 + 150) * MS, 1),
            Decision::Wait { claim: None }
        );
        // Refused for want of quota: the next ask wants the whole rate, and while it is on its
        // way, requests are refused rather than held (only the claimant waits).
        let none = l.grant(&[0; STATE_BYTES], T0, &grant(0, 0, T0, 1_000));
        assert_eq!(l.ask(&none, T0 + 200).demand_mtps, 100_000);
        let Decision::Wait {
            claim: Some(claimed),
        } = l.decide(&none, (T0 + 200) * MS, 1)
        else {
            panic!("the mark expired: a claim");
        };
        assert!(matches!(
            l.decide(&claimed, (T0 + 201) * MS, 1),
            Decision::Deny { .. }
        ));
    }

    #[test]
    fn a_lease_that_did_not_run_dry_asks_for_what_it_spent_and_a_quarter_more() {
        let l = lease();
        let s = l.grant(&[0; STATE_BYTES], T0, &grant(10, 0, T0, 1_000));
        let mut s = allowed(&l, &s, T0 + 100);
        for t in [200, 300, 400, 500, 600, 700, 750] {
            s = allowed(&l, &s, T0 + t);
        }
        // 8 tokens in 760 ms, a quarter more: 13.2 per second.
        let ask = l.ask(&s, T0 + 760);
        assert_eq!((ask.wanted, ask.used, ask.demand_mtps), (8, 8, 13_157));
    }

    #[test]
    fn exhausted_refuses_failed_falls_back_and_leases_expire() {
        let l = lease();
        let none = l.grant(&[0; STATE_BYTES], T0, &grant(0, 0, T0, 1_000));
        assert!(
            matches!(
                l.decide(&none, T0 * MS, 1),
                Decision::Deny { retry_after_ns, .. } if retry_after_ns == 62 * MS
            ),
            "the service's hint (300 ms), within a sixteenth of a lease"
        );
        let failed = l.fail(&[0; STATE_BYTES], T0, 1_000);
        assert_eq!(
            l.decide(&failed, T0 * MS, 1),
            Decision::Fallback { claim: None }
        );
        // After the mark, a new claim; the failure mode still decides until its answer.
        let Decision::Fallback {
            claim: Some(retrying),
        } = l.decide(&failed, (T0 + 1_000) * MS, 1)
        else {
            panic!("the retry is claimed");
        };
        assert!(l.claimed(&failed, &retrying));
        assert_eq!(
            l.decide(&retrying, (T0 + 1_001) * MS, 1),
            Decision::Fallback { claim: None }
        );
        // An answer ends it.
        let answered = l.grant(&retrying, T0 + 1_002, &grant(5, 0, T0 + 1_000, 1_000));
        assert!(matches!(
            l.decide(&answered, (T0 + 1_003) * MS, 1),
            Decision::Allow { .. }
        ));
        // Tokens held survive a failure until their lease ends, accrual included up to the
        // failure (here no claim was made).
        let held = l.fail(
            &l.grant(&[0; STATE_BYTES], T0, &grant(1, 10_000, T0, 500)),
            T0 + 200,
            1_000,
        );
        assert_eq!(l.allowance(&held, T0 + 200), 3);
        assert_eq!(l.allowance(&held, T0 + 400), 3, "no more accrual");
        assert!(matches!(
            l.decide(&held, (T0 + 200) * MS, 1),
            Decision::Allow { .. }
        ));
        assert_eq!(
            l.decide(&held, (T0 + 500) * MS, 1),
            Decision::Fallback { claim: None }
        );
        assert!(!LeaseAllowance::is_idle(&held, T0 + 1_199));
        assert!(LeaseAllowance::is_idle(&held, T0 + 1_200));
    }

    #[test]
    fn a_capped_lease_whose_bucket_has_tokens_asks_again_instead_of_refusing() {
        let l = lease();
        // Asked for the whole rate (a burst from one client) and got it with 5 tokens; the
        // global bucket still holds 60.
        let mut g = grant(5, 100_000, T0, 10_000);
        g.asked.demand_mtps = 100_000;
        g.remaining = 60;
        let mut s = l.grant(&[0; STATE_BYTES], T0, &g);
        let mut claims = 0;
        for _ in 0..5 {
            let next = allowed(&l, &s, T0);
            claims += usize::from(l.claimed(&s, &next));
            s = next;
        }
        assert_eq!(claims, 1, "running low claims a refill once");
        // Dry with the refill out: the request waits for it, it is not refused.
        assert_eq!(l.decide(&s, T0 * MS, 1), Decision::Wait { claim: None });
        // The same lease with the global bucket empty: refused at once.
        g.remaining = 0;
        let mut s = l.grant(&[0; STATE_BYTES], T0, &g);
        for _ in 0..5 {
            s = allowed(&l, &s, T0);
        }
        assert!(matches!(l.decide(&s, T0 * MS, 1), Decision::Deny { .. }));
    }

    #[test]
    fn a_low_rate_renewed_every_eighth_of_its_term_accrues_whole_tokens() {
        let l = lease();
        // A share of 0.05 per second (one token per 20 s), capped by fairness: renewed every
        // eighth of a 10 s lease, 0.0625 tokens accrued each time. Over 60 s: 3 tokens.
        let rated = |at: u64| {
            let mut g = grant(0, 50, at, 10_000);
            g.asked.demand_mtps = 100;
            g
        };
        let mut s = l.grant(&[0; STATE_BYTES], T0, &rated(T0));
        let mut admitted = 0;
        let mut t = T0;
        while t < T0 + 60_000 {
            t += 250;
            if let Decision::Allow { state, .. } = l.decide(&s, t * MS, 1) {
                admitted += 1;
                s = state;
            }
            // Renewed (and answered at once) every 1.25 s.
            let p = parts(&s);
            if t >= p.base + 1_250 {
                s = l.grant(&s, t, &rated(t));
            }
        }
        assert_eq!(admitted, 3);
    }

    #[test]
    fn a_failure_is_not_a_denial() {
        let l = lease();
        let denied = l.grant(&[0; STATE_BYTES], T0, &grant(0, 0, T0, 1_000));
        let failed = l.fail(&denied, T0 + 100, 200);
        assert_eq!(
            l.decide(&failed, (T0 + 150) * MS, 1),
            Decision::Fallback { claim: None }
        );
        // The retry is out: still the failure mode, not the refusal of the earlier answer.
        let Decision::Fallback {
            claim: Some(retrying),
        } = l.decide(&failed, (T0 + 300) * MS, 1)
        else {
            panic!("a retry");
        };
        assert_eq!(
            l.decide(&retrying, (T0 + 301) * MS, 1),
            Decision::Fallback { claim: None }
        );
    }

    #[test]
    fn calls_carry_what_the_proxy_last_heard_of_the_bucket_while_it_matters() {
        // Burst 100 at 1 per 36 s (100 per hour).
        let l = LeaseAllowance {
            global_burst: 100,
            global_interval_ns: 36_000 * MS,
            global_rate_mtps: 27,
            ..lease()
        };
        let fresh = [0; STATE_BYTES];
        assert_eq!(l.ask(&fresh, T0).known_ms, 0, "never answered: no evidence");
        let mut g = grant(10, 0, T0, 10_000);
        g.remaining = 90;
        let s = l.grant(&fresh, T0 + 5, &g);
        let ask = l.ask(&s, T0 + 1_005);
        // 1 s since the answer, plus the call's own time (claim_ms).
        assert_eq!((ask.known_ms, ask.known_remaining), (1_200, 90));
        // The lease ends after 10 s; the bucket is full again by 10 × 36 s after the answer.
        let later = T0 + 5 + 359_000;
        let Decision::Wait {
            claim: Some(claimed),
        } = l.decide(&s, later * MS, 1)
        else {
            panic!("a new claim");
        };
        let ask = l.ask(&claimed, later);
        assert_eq!((ask.known_ms, ask.known_remaining), (359_200, 90));
        assert_eq!(l.ask(&claimed, T0 + 5 + 360_000).known_ms, 0);
    }

    #[test]
    fn refunds_give_back_what_was_spent() {
        let l = lease();
        let s = l.grant(&[0; STATE_BYTES], T0, &grant(3, 0, T0, 1_000));
        let spent = allowed(&l, &s, T0);
        assert_eq!(l.allowance(&LeaseAllowance::refund(&spent, 1), T0), 3);
        assert_eq!(l.allowance(&LeaseAllowance::refund(&s, 2), T0), 5);
    }
}
