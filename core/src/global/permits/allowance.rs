//! A proxy's side: its lease of one key's permits, in the key's slot state, shared by its workers.

use super::{PermitAnswer, PermitAsk};
use crate::state::{
    read_u32, read_u64, saturating_u32, write_u32, write_u64, Decision, State, CLOCK_SKEW_MS,
};

/// In the packed word of the state: the last answer left room; the last call failed; requests
/// that waited (the rest of its low half).
const ROOM: u32 = 1 << 15;
const FAILING: u32 = 1 << 14;
const WAITED: u32 = FAILING - 1;
/// A lease is evidence of a holding while more than this is left of it.
const EVIDENCE_MARGIN_MS: u64 = 250;

/// The mark is a failed call's retry time.
const FAILED: u64 = 1 << 63;
/// The mark is when to ask for more again, after an answer that left no room.
const DENIED: u64 = 1 << 62;
/// Without flags, the mark is when a claimed call is given up.
const WHEN: u64 = DENIED - 1;

/// A proxy's lease of one key's permits, in the key's 32 bytes of slot state, shared by the
/// process's workers: permits held (as the service last answered), permits in use here, the fair
/// share (the most it uses; above it, permits go back as requests end), requests that waited for a
/// first lease, half the lease's term (units of 10 ms), the lease's end (ms), and a mark (a call
/// in flight, a failed one's retry time, or a denial's).
///
/// Requests are admitted while the permits in use stay below `min(held, share)` and the lease
/// lasts: no call per request. After a failed call the failure mode decides new requests until
/// the retry: the rest of the lease's term is the grace of the requests in flight. The process's tick renews a lease halfway through its term, asks
/// for more when it is full (at most once per `denied_ms` while the service has none), and gives
/// the key back once nothing is in use. A call says what the proxy keeps using until its answer
/// comes: until then it admits no more than that.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PermitAllowance {
    /// The limit: requests in flight across all proxies.
    pub concurrent: u64,
    /// Permits asked for beyond those in use.
    pub headroom: u64,
    /// A claimed call is given up (and may be claimed again) after this long.
    pub claim_ms: u64,
    /// After an answer that left no room, ask for more again after this long at the soonest.
    pub denied_ms: u64,
    /// After a failed call, the failure mode decides for this long (`quota_service.retry`).
    pub retry_ms: u64,
    /// A full lease whose last answer said more is free within this proxy's share makes its
    /// requests wait for more (as a first lease does) instead of refusing them. Off where a
    /// host cannot resume a waiting request (a stand-in would admit it instead).
    pub waits_for_more: bool,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Parts {
    held: u64,
    in_use: u64,
    share: u64,
    waited: u64,
    /// The last answer left room: permits were free and this proxy was under its share.
    room: bool,
    /// The last call failed: the failure mode decides until a call succeeds.
    failing: bool,
    half_term_ms: u64,
    lease_end_ms: u64,
    mark: u64,
}

impl Parts {
    pub(super) fn decode(s: &State) -> Self {
        let packed = read_u32(s, 12);
        Self {
            held: u64::from(read_u32(s, 0)),
            in_use: u64::from(read_u32(s, 4)),
            share: u64::from(read_u32(s, 8)),
            waited: u64::from(packed & WAITED),
            room: packed & ROOM != 0,
            failing: packed & FAILING != 0,
            half_term_ms: u64::from(packed >> 16) * 10,
            lease_end_ms: read_u64(s, 16),
            mark: read_u64(s, 24),
        }
    }

    fn encode(&self) -> State {
        let mut s = [0; crate::state::STATE_BYTES];
        write_u32(&mut s, 0, saturating_u32(self.held));
        write_u32(&mut s, 4, saturating_u32(self.in_use));
        write_u32(&mut s, 8, saturating_u32(self.share));
        let waited = self.waited.min(u64::from(WAITED)) as u32;
        let half_term = (self.half_term_ms / 10).min(0xffff) as u32;
        let room = if self.room { ROOM } else { 0 };
        let failing = if self.failing { FAILING } else { 0 };
        write_u32(&mut s, 12, waited | room | failing | half_term << 16);
        write_u64(&mut s, 16, self.lease_end_ms);
        write_u64(&mut s, 24, self.mark);
        s
    }

    pub(super) fn leased(&self, now_ms: u64) -> bool {
        now_ms < self.lease_end_ms
    }

    /// The most permits in use here now.
    fn cap(&self, now_ms: u64) -> u64 {
        if self.leased(now_ms) {
            self.held.min(self.share)
        } else {
            0
        }
    }

    fn calling(&self, now_ms: u64) -> bool {
        self.mark & (FAILED | DENIED) == 0 && now_ms < self.mark & WHEN
    }

    fn failed(&self, now_ms: u64) -> bool {
        self.mark & FAILED != 0 && now_ms < self.mark & WHEN
    }

    fn denied(&self, now_ms: u64) -> bool {
        self.mark & DENIED != 0 && now_ms < self.mark & WHEN
    }
}

impl PermitAllowance {
    /// The state as read at `now_ms` after a backward step of the clock: a lease that ends
    /// further ahead than one term is not trusted (it ends now: new requests ask again, the tick
    /// declares what is in use, and the service, whose term is running by its own clock, renews
    /// it), and a claim, refusal or failure mark that ends further ahead than it lasts ends now
    /// (a failure's key then asks again at once, still decided by the failure mode meanwhile).
    fn unstep(&self, p: &mut Parts, now_ms: u64) {
        let term = p.half_term_ms.saturating_mul(2);
        if p.lease_end_ms > now_ms.saturating_add(term).saturating_add(CLOCK_SKEW_MS) {
            p.lease_end_ms = now_ms;
        }
        let lasts = if p.mark & DENIED != 0 {
            self.denied_ms
        } else if p.mark & FAILED != 0 {
            self.retry_ms
        } else {
            self.claim_ms
        };
        if p.mark & WHEN > now_ms.saturating_add(lasts).saturating_add(CLOCK_SKEW_MS) {
            p.mark = 0;
        }
    }

    pub fn decide(&self, state: &State, now_ns: u64, cost: u64) -> Decision {
        let now_ms = now_ns / 1_000_000;
        let mut p = Parts::decode(state);
        self.unstep(&mut p, now_ms);
        // A call failed: the failure mode decides until a call succeeds (this request asks again
        // once the retry is due). What the lease has left of its term is the grace of the
        // requests in flight, not room for more.
        if p.failing {
            if p.failed(now_ms) || p.calling(now_ms) {
                return Decision::Fallback { claim: None };
            }
            p.mark = now_ms.saturating_add(self.claim_ms).min(WHEN);
            return Decision::Fallback {
                claim: Some(p.encode()),
            };
        }
        let cap = p.cap(now_ms);
        if p.in_use.saturating_add(cost) <= cap {
            p.in_use += cost;
            return Decision::Admit {
                state: p.encode(),
                remaining: cap - p.in_use,
                reset_ns: 0,
                delay_ns: 0,
            };
        }
        // Full, but the service said more is free within this proxy's share: wait for more, as
        // a first lease does (the service, not this lease, says when the limit is reached).
        let grows = self.waits_for_more && p.room && p.leased(now_ms) && !p.denied(now_ms);
        // Full, or the service had none for this key lately: refused at once, as a local
        // concurrency rule would (the tick asks for more).
        if !grows && (p.leased(now_ms) || p.denied(now_ms)) {
            let wait_ms = if p.denied(now_ms) {
                (p.mark & WHEN).saturating_sub(now_ms)
            } else {
                0
            };
            return Decision::Refuse {
                retry_after_ns: wait_ms.max(1_000) * 1_000_000,
                remaining: 0,
                reset_ns: 0,
            };
        }
        p.waited = p.waited.saturating_add(cost);
        if !p.calling(now_ms) {
            p.mark = now_ms.saturating_add(self.claim_ms).min(WHEN);
        }
        Decision::Wait {
            claim: Some(p.encode()),
        }
    }

    /// True if writing `after` over `before` claimed a call the writer must send.
    pub fn claimed(&self, before: &State, after: &State) -> bool {
        let (b, a) = (Parts::decode(before), Parts::decode(after));
        a.mark != b.mark && a.mark & (FAILED | DENIED) == 0 && a.mark != 0
    }

    /// The tick's look at a key: the state that claims a call, if one is due — a lease halfway
    /// through its term (renewed, or given back if nothing is in use), a full one that may get
    /// more, one that ended with requests still in flight. While the call is out, the key admits
    /// no more than the call says it keeps.
    pub fn renewal(&self, state: &State, now_ms: u64) -> Option<State> {
        let mut p = Parts::decode(state);
        self.unstep(&mut p, now_ms);
        if p.calling(now_ms) || p.failed(now_ms) {
            return None;
        }
        // After a failure, ask again as soon as the retry is due.
        let due = if p.failing {
            true
        } else if p.leased(now_ms) {
            let renew = now_ms >= p.lease_end_ms.saturating_sub(p.half_term_ms);
            let full = p.in_use >= p.cap(now_ms) && p.held < self.concurrent;
            renew || (full && !p.denied(now_ms))
        } else {
            p.in_use > 0 || p.held > 0
        };
        if !due {
            return None;
        }
        if p.leased(now_ms) {
            let (wanted, _) = self.wanted_and_keep(&p, now_ms);
            let keep = p.in_use.max(p.cap(now_ms).min(wanted));
            p.share = p.share.min(keep);
        } else {
            p.held = 0;
        }
        p.mark = now_ms.saturating_add(self.claim_ms).min(WHEN);
        Some(p.encode())
    }

    fn wanted_and_keep(&self, p: &Parts, now_ms: u64) -> (u64, u64) {
        let busy = p.in_use.saturating_add(p.waited);
        let wanted = if busy == 0 {
            0
        } else {
            busy.saturating_add(self.headroom).min(self.concurrent)
        };
        let keep = if p.leased(now_ms) {
            p.in_use.max(p.cap(now_ms))
        } else {
            p.in_use
        };
        (wanted, keep)
    }

    /// What a call asks for the key, from its state when the call goes out.
    pub fn ask(&self, state: &State, now_ms: u64) -> PermitAsk {
        let p = Parts::decode(state);
        let (wanted, keep) = self.wanted_and_keep(&p, now_ms);
        // Evidence only while the lease surely lasts at the service too (it began there after
        // it began here).
        let lasting = p.lease_end_ms.saturating_sub(now_ms) > EVIDENCE_MARGIN_MS;
        PermitAsk {
            limit: self.concurrent,
            wanted,
            keep,
            known_held: if lasting { p.held } else { 0 },
        }
    }

    /// Write the service's answer to a call claimed at `claimed_ms` that asked for `wanted`.
    pub fn grant(
        &self,
        state: &State,
        now_ms: u64,
        answer: &PermitAnswer,
        claimed_ms: u64,
        wanted: u64,
    ) -> State {
        let mut p = Parts::decode(state);
        p.failing = false;
        let wants = p.in_use.saturating_add(p.waited) > 0;
        // Asking again may get more: permits are free, and this answer gave all that was asked
        // without putting the proxy above its share.
        p.room = answer.free > 0
            && answer.held < self.concurrent
            && answer.held >= wanted
            && answer.share >= answer.held;
        p.held = answer.held;
        p.share = answer.share.max(answer.held.min(p.in_use));
        p.waited = 0;
        p.half_term_ms = answer.ttl_ms / 2;
        p.lease_end_ms = if answer.held == 0 {
            0
        } else {
            claimed_ms.saturating_add(answer.ttl_ms)
        };
        // Nothing more for a key that wants more, and no point asking again soon (nothing free,
        // or its fair share reached): ask again after `denied_ms`, refusing meanwhile.
        let room = p.held.min(p.share) > p.in_use;
        let futile = answer.free == 0 || answer.share <= answer.held;
        p.mark = if wants && !room && futile && p.held < self.concurrent {
            DENIED | now_ms.saturating_add(self.denied_ms).min(WHEN)
        } else {
            0
        };
        p.encode()
    }

    /// A call failed: the failure mode decides new requests until a call succeeds (the next one
    /// after a quarter of `retry_ms` the first time, as for leases, then after `retry_ms`); the
    /// rest of the lease's term is grace for the requests in flight.
    pub fn fail(&self, state: &State, now_ms: u64, retry_ms: u64) -> State {
        let mut p = Parts::decode(state);
        let wait = if p.failing { retry_ms } else { retry_ms / 4 };
        p.mark = FAILED | now_ms.saturating_add(wait.max(1)).min(WHEN);
        p.failing = true;
        p.encode()
    }

    /// The end of a request that held `cost` permits.
    pub fn release(state: &State, cost: u64) -> State {
        let mut p = Parts::decode(state);
        p.in_use = p.in_use.saturating_sub(cost);
        p.encode()
    }

    /// True if the key holds nothing here: nothing in use, no lease, no call out.
    pub fn is_idle(state: &State, now_ms: u64) -> bool {
        let p = Parts::decode(state);
        p.in_use == 0 && (p.held == 0 || !p.leased(now_ms)) && !p.calling(now_ms)
    }

    /// Permits in use here.
    pub fn in_use(state: &State) -> u64 {
        Parts::decode(state).in_use
    }
}
