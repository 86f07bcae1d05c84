//! Global concurrency: the slots of one key's limit, leased to proxy instances — the service's
//! side ([`Holdings`]) and a proxy's ([`SlotAllowance`]). Each instance holds some slots until its holding expires unless renewed; a proxy
//! that dies or is cut off loses its slots one lease term after its last renewal, and no one has
//! to decrement anything for it.
//!
//! A call says how many slots the instance wants to hold (`wanted`) and how many of those it
//! holds it keeps using whatever the answer (`keep`: its requests in flight, at least). The
//! instance then holds `max(keep, min(wanted, fair share, what others do not hold))`: never fewer
//! than it keeps (it may still be using them), never more than the limit in total. Fair shares are
//! max-min fair by `wanted` among the instances with live holdings; an instance above its share
//! is told its share and lets slots go as its requests end.
//!
//! Until the store has been up for a lease term (`settled`), a store that lost its holdings (a
//! restart) grants nothing new: instances renewing declare what they keep, and get that back.

use crate::fair_share::max_min_fair;
use crate::lease::{call_problem, names_problem, MAX_COUNT};
use crate::state::{
    read_u32, read_u64, saturating_u32, write_u32, write_u64, Decision, State, CLOCK_SKEW_MS,
};
use serde::{Deserialize, Serialize};

/// `POST /v1/slots`: one instance's holdings of some keys, renewed, grown or given back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotRequest {
    pub instance: String,
    pub items: Vec<SlotItem>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotItem {
    /// The rule's name (metrics and logs).
    pub rule: String,
    /// A fingerprint of the rule's limit: configurations that differ never share state.
    pub limit_id: String,
    /// The client key's hash (hex).
    pub key: String,
    /// The limit: requests in flight across all instances.
    pub concurrent: u64,
    /// Slots the instance wants to hold.
    pub wanted: u64,
    /// Slots it holds and keeps using until the answer comes.
    #[serde(default)]
    pub keep: u64,
    /// The instance's evidence: the slots the service last said it holds, while that lease
    /// lasts (0: none). A store that has no holding of the instance for the key lost it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub known_held: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotResponse {
    /// One per request item, in the same order.
    pub items: Vec<SlotAnswer>,
    /// Items the service refused (their answers are all zero): the caller treats each as a
    /// failed call for that key alone.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<crate::lease::ItemError>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SlotAnswer {
    /// Slots the instance holds now, for `ttl_ms` from its call.
    pub held: u64,
    /// Its max-min fair share of the limit: above it, let slots go as requests end.
    pub share: u64,
    /// Slots no instance holds.
    pub free: u64,
    pub ttl_ms: u64,
}

impl SlotItem {
    pub fn problem(&self) -> Option<String> {
        if let Some(p) = names_problem(&self.rule, &self.limit_id, &self.key) {
            return Some(p);
        }
        if self.concurrent == 0 || self.concurrent > MAX_COUNT {
            return Some(format!("concurrent must be 1 to {MAX_COUNT}"));
        }
        if self.wanted > MAX_COUNT || self.keep > MAX_COUNT || self.known_held > MAX_COUNT {
            return Some(format!(
                "wanted, keep and known_held must be at most {MAX_COUNT}"
            ));
        }
        None
    }

    pub fn ask(&self) -> SlotAsk {
        SlotAsk {
            limit: self.concurrent,
            wanted: self.wanted,
            keep: self.keep,
            known_held: self.known_held,
        }
    }
}

impl SlotRequest {
    /// What is wrong with the call as a whole (its instance, its size), if anything.
    pub fn problem(&self) -> Option<String> {
        call_problem(&self.instance, self.items.len())
    }

    /// What is wrong with each item (`None`: nothing): the service refuses those alone.
    pub fn item_problems(&self) -> Vec<Option<String>> {
        self.items.iter().map(SlotItem::problem).collect()
    }
}

/// One instance's holding at one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holding {
    pub instance: String,
    pub held: u64,
    pub wanted: u64,
    /// When the holding ends unless renewed (ms since the Unix epoch).
    pub expires_ms: u64,
}

/// The holdings of one key, sorted by instance.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Holdings {
    pub entries: Vec<Holding>,
}

/// What an instance asks of one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotAsk {
    /// The limit: slots in flight across all instances.
    pub limit: u64,
    /// Slots the instance wants to hold (0 with `keep` 0: it gives the key back).
    pub wanted: u64,
    /// Slots it holds and keeps using until the answer comes.
    pub keep: u64,
    /// Slots the service last said it holds, while that lease lasts (0: none).
    pub known_held: u64,
}

/// The answer for one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SlotGrant {
    /// Slots the instance holds now, until `ttl_ms` from the call.
    pub held: u64,
    /// Its max-min fair share: above it, it should let slots go as its requests end.
    pub share: u64,
    /// Slots no instance holds.
    pub free: u64,
}

impl Holdings {
    /// True if `instance` says it holds `known_held` slots of the key (its lease still lasting)
    /// while the store has no holding of it: the store lost them.
    pub fn contradicts(
        holdings: Option<&Self>,
        instance: &str,
        known_held: u64,
        now_ms: u64,
    ) -> bool {
        known_held > 0
            && !holdings.is_some_and(|h| {
                h.entries
                    .iter()
                    .any(|e| e.instance == instance && e.expires_ms > now_ms)
            })
    }

    /// Forget holdings that ended.
    pub fn prune(&mut self, now_ms: u64) {
        self.entries.retain(|h| h.expires_ms > now_ms);
    }

    /// Slots held by all instances.
    pub fn total(&self) -> u64 {
        self.entries.iter().map(|h| h.held).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Serve one instance's call at `now_ms`: its holding afterwards lasts `ttl_ms`.
    pub fn grant(
        &mut self,
        instance: &str,
        ask: &SlotAsk,
        now_ms: u64,
        ttl_ms: u64,
        settled: bool,
    ) -> SlotGrant {
        // Expiring more than a term from now: the clock stepped back. A term from now at most
        // (else a stopped holder's slots stay held for the step's length).
        let latest = now_ms.saturating_add(ttl_ms);
        for h in &mut self.entries {
            h.expires_ms = h.expires_ms.min(latest);
        }
        self.prune(now_ms);
        let at = match self
            .entries
            .binary_search_by(|h| h.instance.as_str().cmp(instance))
        {
            Ok(i) => i,
            Err(i) => {
                self.entries.insert(
                    i,
                    Holding {
                        instance: instance.to_owned(),
                        held: 0,
                        wanted: 0,
                        expires_ms: 0,
                    },
                );
                i
            }
        };
        let known = self.entries[at].expires_ms != 0;
        let others: u64 = self
            .entries
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != at)
            .map(|(_, h)| h.held)
            .sum();
        let available = ask.limit.saturating_sub(others);
        // What it keeps: what it holds here; after a loss of holdings, what it says it holds.
        let keep = if known {
            ask.keep.min(self.entries[at].held)
        } else if settled {
            0
        } else {
            ask.keep
        }
        .min(available);
        self.entries[at].wanted = ask.wanted.max(keep);
        let demands: Vec<u64> = self.entries.iter().map(|h| h.wanted).collect();
        let share = max_min_fair(ask.limit, &demands)[at];
        let held = if settled {
            keep.max(ask.wanted.min(share).min(available))
        } else {
            keep
        };
        if held == 0 && ask.wanted == 0 {
            self.entries.remove(at);
        } else {
            let h = &mut self.entries[at];
            h.held = held;
            h.expires_ms = now_ms.saturating_add(ttl_ms).max(1);
        }
        SlotGrant {
            held,
            share,
            free: ask.limit.saturating_sub(others + held),
        }
    }
}

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

/// A proxy's lease of one key's slots, in the key's 32 bytes of slot state, shared by the
/// process's workers: slots held (as the service last answered), slots in use here, the fair
/// share (the most it uses; above it, slots go back as requests end), requests that waited for a
/// first lease, half the lease's term (units of 10 ms), the lease's end (ms), and a mark (a call
/// in flight, a failed one's retry time, or a denial's).
///
/// Requests are admitted while the slots in use stay below `min(held, share)` and the lease
/// lasts: no call per request. After a failed call the failure mode decides new requests until
/// the retry: the rest of the lease's term is the grace of the requests in flight. The process's tick renews a lease halfway through its term, asks
/// for more when it is full (at most once per `denied_ms` while the service has none), and gives
/// the key back once nothing is in use. A call says what the proxy keeps using until its answer
/// comes: until then it admits no more than that.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotAllowance {
    /// The limit: requests in flight across all proxies.
    pub concurrent: u64,
    /// Slots asked for beyond those in use.
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
struct Parts {
    held: u64,
    in_use: u64,
    share: u64,
    waited: u64,
    /// The last answer left room: slots were free and this proxy was under its share.
    room: bool,
    /// The last call failed: the failure mode decides until a call succeeds.
    failing: bool,
    half_term_ms: u64,
    lease_end_ms: u64,
    mark: u64,
}

impl Parts {
    fn decode(s: &State) -> Self {
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

    fn leased(&self, now_ms: u64) -> bool {
        now_ms < self.lease_end_ms
    }

    /// The most slots in use here now.
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

impl SlotAllowance {
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
            return Decision::Allow {
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
            return Decision::Deny {
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
    pub fn ask(&self, state: &State, now_ms: u64) -> SlotAsk {
        let p = Parts::decode(state);
        let (wanted, keep) = self.wanted_and_keep(&p, now_ms);
        // Evidence only while the lease surely lasts at the service too (it began there after
        // it began here).
        let lasting = p.lease_end_ms.saturating_sub(now_ms) > EVIDENCE_MARGIN_MS;
        SlotAsk {
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
        answer: &SlotAnswer,
        claimed_ms: u64,
        wanted: u64,
    ) -> State {
        let mut p = Parts::decode(state);
        p.failing = false;
        let wants = p.in_use.saturating_add(p.waited) > 0;
        // Asking again may get more: slots are free, and this answer gave all that was asked
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
    /// after `retry_ms`); the rest of the lease's term is grace for the requests in flight.
    pub fn fail(&self, state: &State, now_ms: u64, retry_ms: u64) -> State {
        let mut p = Parts::decode(state);
        p.mark = FAILED | now_ms.saturating_add(retry_ms).min(WHEN);
        p.failing = true;
        p.encode()
    }

    /// The end of a request that held `cost` slots.
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

    /// Slots in use here.
    pub fn in_use(state: &State) -> u64 {
        Parts::decode(state).in_use
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const TTL: u64 = 10_000;

    fn ask(wanted: u64, keep: u64) -> SlotAsk {
        SlotAsk {
            limit: 10,
            wanted,
            keep,
            known_held: 0,
        }
    }

    #[test]
    fn a_lone_instance_gets_what_it_wants_up_to_the_limit() {
        let mut h = Holdings::default();
        assert_eq!(h.grant("a", &ask(4, 0), 0, TTL, true).held, 4);
        assert_eq!(h.grant("a", &ask(30, 4), 100, TTL, true).held, 10);
        assert_eq!(h.total(), 10);
    }

    #[test]
    fn a_newcomer_gets_what_is_free_and_the_holder_lets_go_to_its_share() {
        let mut h = Holdings::default();
        h.grant("a", &ask(10, 0), 0, TTL, true);
        // b wants 10 too: nothing is free; both are told their share of 5.
        let b = h.grant("b", &ask(10, 0), 10, TTL, true);
        assert_eq!((b.held, b.share, b.free), (0, 5, 0));
        // a still has 8 in flight: it keeps 8 (more than its share).
        let a = h.grant("a", &ask(10, 8), 20, TTL, true);
        assert_eq!((a.held, a.share), (8, 5));
        assert_eq!(h.grant("b", &ask(10, 0), 30, TTL, true).held, 2);
        // Its requests end: a keeps 5, and b gets the rest.
        assert_eq!(h.grant("a", &ask(10, 5), 40, TTL, true).held, 5);
        assert_eq!(h.grant("b", &ask(10, 2), 50, TTL, true).held, 5);
        assert_eq!(h.total(), 10);
    }

    #[test]
    fn a_holding_that_is_not_renewed_ends_and_its_slots_go_to_others() {
        let mut h = Holdings::default();
        h.grant("dead", &ask(10, 0), 0, TTL, true);
        assert_eq!(h.grant("b", &ask(10, 0), TTL - 1, TTL, true).held, 0);
        assert_eq!(h.grant("b", &ask(10, 0), TTL, TTL, true).held, 10);
        assert_eq!(h.entries.len(), 1);
    }

    #[test]
    fn giving_a_key_back_forgets_the_instance() {
        let mut h = Holdings::default();
        h.grant("a", &ask(3, 0), 0, TTL, true);
        assert_eq!(h.grant("a", &ask(0, 0), 10, TTL, true).held, 0);
        assert!(h.is_empty());
    }

    #[test]
    fn after_a_loss_of_holdings_instances_get_back_what_they_keep_and_nothing_new() {
        let mut h = Holdings::default();
        assert_eq!(h.grant("a", &ask(10, 6), 0, TTL, false).held, 6);
        assert_eq!(h.grant("new", &ask(10, 0), 0, TTL, false).held, 0);
        // More than the limit declared: what fits.
        assert_eq!(h.grant("b", &ask(10, 7), 0, TTL, false).held, 4);
        // Settled: free slots are granted again.
        h.grant("a", &ask(6, 2), TTL, TTL, true);
        assert_eq!(h.grant("new", &ask(10, 0), TTL, TTL, true).held, 4);
    }

    proptest! {
        #[test]
        fn the_limit_is_never_exceeded_and_no_one_loses_what_it_keeps(
            calls in prop::collection::vec(
                (0usize..4, 0u64..15, 0u64..15, 0u64..3_000, any::<bool>()), 1..200),
        ) {
            let mut h = Holdings::default();
            let names = ["a", "b", "c", "d"];
            let mut now = 0;
            for (who, wanted, keep, step, settled) in calls {
                now += step;
                let before = h
                    .entries
                    .iter()
                    .find(|e| e.instance == names[who] && e.expires_ms > now)
                    .map(|e| e.held);
                let g = h.grant(names[who], &ask(wanted, keep), now, TTL, settled);
                prop_assert!(h.total() <= 10, "{h:?}");
                if let Some(held) = before {
                    prop_assert!(g.held >= keep.min(held));
                }
                prop_assert!(g.held <= wanted.max(keep));
                prop_assert_eq!(g.free, 10 - h.total());
            }
        }
    }

    const MS: u64 = 1_000_000;

    fn wk(ask: SlotAsk) -> (u64, u64) {
        (ask.wanted, ask.keep)
    }

    fn allowance() -> SlotAllowance {
        SlotAllowance {
            concurrent: 10,
            headroom: 1,
            claim_ms: 300,
            denied_ms: 1_000,
            retry_ms: 1_000,
            waits_for_more: false,
        }
    }

    fn answer(held: u64, share: u64, free: u64) -> SlotAnswer {
        SlotAnswer {
            held,
            share,
            free,
            ttl_ms: TTL,
        }
    }

    fn admitted(a: &SlotAllowance, s: &mut State, now_ms: u64) -> bool {
        match a.decide(s, now_ms * MS, 1) {
            Decision::Allow { state, .. } => {
                *s = state;
                true
            }
            _ => false,
        }
    }

    #[test]
    fn a_cold_key_waits_for_its_first_lease_then_admits_up_to_it_without_calls() {
        let a = allowance();
        let mut s = [0; 32];
        let Decision::Wait {
            claim: Some(claimed),
        } = a.decide(&s, 1_000 * MS, 1)
        else {
            panic!("no claim")
        };
        assert!(a.claimed(&s, &claimed));
        s = claimed;
        // A second request waits for the same call.
        let Decision::Wait { claim: Some(again) } = a.decide(&s, 1_001 * MS, 1) else {
            panic!()
        };
        assert!(!a.claimed(&s, &again));
        s = again;
        assert_eq!(wk(a.ask(&s, 1_002)), (3, 0), "2 waiting + headroom");
        s = a.grant(&s, 1_005, &answer(3, 10, 7), 1_000, 0);
        assert!((0..3).all(|_| admitted(&a, &mut s, 1_010)));
        // Full: refused at once; the tick asks for more.
        assert!(matches!(a.decide(&s, 1_011 * MS, 1), Decision::Deny { .. }));
        let claim = a.renewal(&s, 1_012).expect("full: ask for more");
        assert_eq!(wk(a.ask(&claim, 1_012)), (4, 3));
        s = a.grant(&claim, 1_013, &answer(4, 10, 6), 1_012, 0);
        assert!(admitted(&a, &mut s, 1_014));
    }

    #[test]
    fn renewals_come_halfway_and_an_idle_key_is_given_back() {
        let a = allowance();
        let mut s = a.grant(&[0; 32], 0, &answer(2, 10, 8), 0, 0);
        assert!(admitted(&a, &mut s, 10));
        assert_eq!(a.renewal(&s, 100), None, "not full, not due");
        let claim = a.renewal(&s, TTL / 2).expect("halfway");
        assert_eq!(a.renewal(&claim, TTL / 2 + 1), None, "one call at a time");
        s = a.grant(&claim, TTL / 2 + 2, &answer(2, 10, 8), TTL / 2, 0);
        s = SlotAllowance::release(&s, 1);
        let claim = a.renewal(&s, TTL).expect("halfway again");
        assert_eq!(wk(a.ask(&claim, TTL)), (0, 0), "nothing in use: given back");
        // While the call is out, it admits no more than it said it keeps.
        assert!(!admitted(&a, &mut claim.clone(), TTL + 1));
        s = a.grant(&claim, TTL + 2, &answer(0, 0, 10), TTL, 0);
        assert!(SlotAllowance::is_idle(&s, TTL + 3));
        assert!(matches!(
            a.decide(&s, (TTL + 3) * MS, 1),
            Decision::Wait { .. }
        ));
    }

    #[test]
    fn a_clock_stepped_back_renews_at_once_instead_of_keeping_slots_past_their_term() {
        let a = allowance();
        let hour = 3_600_000;
        let mut s = a.grant(&[0; 32], hour, &answer(3, 10, 7), hour, 0);
        assert!(admitted(&a, &mut s, hour + 10));
        // A renewal is out when the clock steps back an hour.
        let claim = a.renewal(&s, hour + TTL / 2).expect("halfway");
        let back = TTL / 2 + 100;
        // Before: the lease (ending an hour ahead) admitted for the hour and the claim blocked
        // every renewal, while the service gave the slots away after its term. Now: the lease
        // ends, the claim mark too; the tick declares what is in use at once.
        let renewal = a.renewal(&claim, back).expect("renewed at once");
        assert_eq!(
            wk(a.ask(&renewal, back)),
            (2, 1),
            "keeps the one in use, asks headroom"
        );
        assert!(matches!(
            a.decide(&claim, back * MS, 1),
            Decision::Wait { .. }
        ));
        // Its answer is a lease from the new clock on.
        s = a.grant(&renewal, back + 2, &answer(3, 10, 7), back, 0);
        assert!(admitted(&a, &mut s, back + 3));
        assert_eq!(a.renewal(&s, back + 4), None, "not due");
        // A failed call's retry time from beyond the clock ends now too: the key asks again at
        // once (the failure mode still decides until an answer), not an hour later.
        let failed = a.fail(&claim, hour + TTL / 2 + 300, a.retry_ms);
        assert!(matches!(
            a.decide(&failed, back * MS, 1),
            Decision::Fallback { claim: Some(_) }
        ));
    }

    #[test]
    fn a_failed_renewal_applies_the_failure_mode_at_once_and_the_lease_is_grace_for_what_runs() {
        let a = SlotAllowance {
            retry_ms: TTL,
            ..allowance()
        };
        let mut s = a.grant(&[0; 32], 0, &answer(2, 10, 8), 0, 0);
        assert!(admitted(&a, &mut s, 10));
        s = a.fail(&a.renewal(&s, TTL / 2).expect("due"), TTL / 2 + 300, TTL);
        assert!(matches!(
            a.decide(&s, (TTL / 2 + 400) * MS, 1),
            Decision::Fallback { claim: None }
        ));
        assert!(matches!(
            a.decide(&s, TTL * MS, 1),
            Decision::Fallback { .. }
        ));
        assert_eq!(a.renewal(&s, TTL), None, "not before the retry time");
        // Past the retry time, with requests in flight: a call declares them.
        let later = TTL / 2 + 300 + TTL;
        let claim = a.renewal(&s, later).expect("declare what is in use");
        assert_eq!(wk(a.ask(&claim, later)), (2, 1));
    }

    #[test]
    fn after_a_failed_call_nothing_new_is_admitted_until_a_call_succeeds() {
        let a = allowance();
        let mut s = a.grant(&[0; 32], 0, &answer(5, 10, 5), 0, 0);
        assert!(admitted(&a, &mut s, 10));
        // A renewal that fails 300 ms before the lease is half over; retry after 1 s.
        s = a.fail(&a.renewal(&s, TTL / 2).expect("due"), TTL / 2, 1_000);
        // The retry is due while the lease still stands: the failure mode still decides, and
        // this request asks again.
        let at = TTL / 2 + 1_000;
        let Decision::Fallback {
            claim: Some(asking),
        } = a.decide(&s, at * MS, 1)
        else {
            panic!("asks again, failure mode meanwhile");
        };
        assert!(a.claimed(&s, &asking));
        assert!(matches!(
            a.decide(&asking, (at + 1) * MS, 1),
            Decision::Fallback { claim: None }
        ));
        // It fails again: the failure mode, for as long as the service cannot be reached.
        s = a.fail(&asking, at + 200, 1_000);
        assert!(matches!(
            a.decide(&s, (at + 900) * MS, 1),
            Decision::Fallback { claim: None }
        ));
        // The tick asks once the retry is due, and an answer ends it.
        let claim = a.renewal(&s, at + 1_200).expect("the retry");
        s = a.grant(&claim, at + 1_210, &answer(5, 10, 5), at + 1_200, 2);
        assert!(admitted(&a, &mut s, at + 1_220));
    }

    #[test]
    fn a_key_that_got_nothing_refuses_at_once_until_it_may_ask_again() {
        let a = allowance();
        let Decision::Wait { claim: Some(s) } = a.decide(&[0; 32], 0, 1) else {
            panic!()
        };
        let s = a.grant(&s, 5, &answer(0, 5, 0), 0, 0);
        let Decision::Deny { retry_after_ns, .. } = a.decide(&s, 10 * MS, 1) else {
            panic!("held")
        };
        assert_eq!(retry_after_ns, 1_000 * MS);
        assert!(matches!(a.decide(&s, 1_006 * MS, 1), Decision::Wait { .. }));
    }

    #[test]
    fn an_answer_without_room_is_not_asked_again_before_the_denial_ends() {
        let a = allowance();
        let mut s = a.grant(&[0; 32], 0, &answer(2, 5, 0), 0, 0);
        assert!(admitted(&a, &mut s, 1) && admitted(&a, &mut s, 1));
        let claim = a.renewal(&s, 2).expect("full");
        s = a.grant(&claim, 3, &answer(2, 2, 0), 2, 0);
        assert_eq!(a.renewal(&s, 500), None, "denied for a second");
        assert!(a.renewal(&s, 1_004).is_some());
    }

    #[test]
    fn a_full_lease_with_room_waits_for_more_where_the_host_can_resume() {
        let answer = |held, share, free| SlotAnswer {
            held,
            share,
            free,
            ttl_ms: TTL,
        };
        for waits in [true, false] {
            let a = SlotAllowance {
                waits_for_more: waits,
                ..allowance()
            };
            // 3 held, the service has 7 free and this proxy's share is the whole limit.
            let mut s = a.grant(&[0; 32], 1_000, &answer(3, 10, 7), 1_000, 3);
            for _ in 0..3 {
                let Decision::Allow { state, .. } = a.decide(&s, 1_001 * MS, 1) else {
                    panic!("within the lease");
                };
                s = state;
            }
            match a.decide(&s, 1_001 * MS, 1) {
                Decision::Wait { claim: Some(c) } if waits => {
                    assert!(a.claimed(&s, &c), "asks for more");
                    assert_eq!(
                        a.ask(&c, 1_001).wanted,
                        3 + 1 + 1,
                        "in use, waiting, headroom"
                    );
                    // No room left by the answer: refused at once.
                    let full = a.grant(&c, 1_002, &answer(3, 10, 0), 1_001, 5);
                    assert!(matches!(
                        a.decide(&full, 1_003 * MS, 1),
                        Decision::Deny { .. }
                    ));
                }
                Decision::Deny { .. } if !waits => {}
                d => panic!("waits_for_more {waits}: {d:?}"),
            }
        }
    }

    proptest! {
        /// Several proxies and the service, with calls, answers, failures and time in any order:
        /// requests in flight across the proxies never exceed the limit while every proxy's
        /// lease stands.
        #[test]
        fn proxies_never_admit_past_the_limit_together(
            events in prop::collection::vec((0usize..3, 0u8..5, 0u64..400), 1..400),
            waits_for_more in any::<bool>(),
        ) {
            let a = SlotAllowance {
                waits_for_more,
                ..allowance()
            };
            let mut service = Holdings::default();
            let mut states = [[0u8; 32]; 3];
            let mut calls: [Option<(u64, SlotAsk)>; 3] = [None; 3];
            let mut now = 1_000;
            for (who, what, step) in events {
                now += step;
                let s = &mut states[who];
                match what {
                    0 => {
                        if let Decision::Allow { state, .. } | Decision::Wait { claim: Some(state) } =
                            a.decide(s, now * MS, 1)
                        {
                            if a.claimed(s, &state) {
                                calls[who] = Some((now, a.ask(&state, now)));
                            }
                            *s = state;
                        }
                    }
                    1 => *s = SlotAllowance::release(s, 1.min(SlotAllowance::in_use(s))),
                    2 => {
                        if let Some(claimed) = a.renewal(s, now) {
                            *s = claimed;
                            calls[who] = Some((now, a.ask(s, now)));
                        }
                    }
                    3 => {
                        if let Some((at, ask)) = calls[who].take() {
                            let g = service.grant(&who.to_string(), &ask, now, TTL, true);
                            let answer = SlotAnswer { held: g.held, share: g.share, free: g.free, ttl_ms: TTL };
                            *s = a.grant(s, now, &answer, at, ask.wanted);
                        }
                    }
                    _ => {
                        if calls[who].take().is_some() {
                            *s = a.fail(s, now, 1_000);
                        }
                    }
                }
                // Slots in use by proxies whose lease stands, against the limit.
                let in_use: u64 = states
                    .iter()
                    .map(SlotAllowance::in_use)
                    .sum();
                let lapsed = states.iter().any(|s| !Parts::decode(s).leased(now) && SlotAllowance::in_use(s) > 0);
                if !lapsed {
                    prop_assert!(in_use <= 10, "{in_use} in use: {states:?} {service:?}");
                }
            }
        }
    }
}
