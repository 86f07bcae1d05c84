//! Leases from the quota service: the refills requests claim, the calls that ask for them, and the
//! answers written back into the keys' allowances.

use super::{saturating_i64, CheckInput, Engine};
use crate::stats::ProcessStat;
use log::{debug, warn};
use siphasher::sip128::{Hasher128, SipHasher24};
use smallvec::SmallVec;
use std::hash::Hasher;
use tollgate_core::lease::{ItemError, LeaseItem, LeaseRequest, LeaseResponse};
use tollgate_core::limiter::MAX_RELEASE_ATTEMPTS;
use tollgate_core::slot::{update_slot, Group};
use tollgate_core::slot_lease::{SlotAnswer, SlotAsk, SlotItem, SlotRequest, SlotResponse};
use tollgate_core::{
    Ask, CasStore, Grant, LeaseAllowance, Limit, Outcome, SlotAllowance, SlotId, State, Verdict,
};

/// How often a worker looks at the global concurrency keys it knows (renewals are due halfway
/// through a lease's term, seconds away).
const SLOT_SCAN_MS: u64 = 100;
/// Most global concurrency keys a worker keeps in view (those with its requests in flight).
const MAX_SLOT_KEYS: usize = 65_536;

/// Items in one call to the quota service (it takes at most [`tollgate_core::lease::MAX_ITEMS`]).
pub const ITEMS_PER_CALL: usize = 250;

/// Calls one tick (or one request) sends at most; further refills wait for the next.
pub const CALLS_PER_TICK: usize = 8;

/// Keys whose unspent strict grants a worker keeps to give back at once; beyond, the tokens
/// are lost (stricter, never looser).
const MAX_GIVE_BACKS: usize = ITEMS_PER_CALL;

/// A call to the quota service a tick sends: the refills it is for, and its body; or tokens
/// given back, whose answer changes nothing here.
pub enum Call {
    Lease(Vec<Refill>, LeaseRequest),
    Slots(Vec<Refill>, SlotRequest),
    GiveBack(LeaseRequest),
}

/// What the tick's look at a global concurrency key found.
enum Renewal {
    Claimed,
    Idle,
    NotDue,
}

/// A key's allowance to refill from the quota service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refill {
    pub rule: usize,
    pub slot: SlotId,
    pub key: u128,
    /// When a request claimed it (ms): the lease it brings ends `ttl_ms` after that.
    pub claimed_ms: u64,
    /// What the call asked for, from the key's state when it went out (slots: `wanted` only).
    pub ask: Ask,
}

impl Engine {
    /// Note the refills `outcome`'s writes claimed: they go out together on the next tick.
    pub(super) fn record_claims(&mut self, inputs: &[CheckInput], outcome: &Outcome, now: u64) {
        for (input, result) in inputs.iter().zip(&outcome.checks) {
            if result.refill {
                if self.slot_allowance_of(input.which.rule()).is_some() {
                    self.watch_slots(input.which.rule(), input.slot, input.key);
                }
                let refill = Refill {
                    rule: input.which.rule(),
                    slot: input.slot,
                    key: input.key,
                    claimed_ms: now / 1_000_000,
                    ask: Ask::default(),
                };
                // A request admitted from the lease it claims more for: a key already served.
                if matches!(result.verdict, Verdict::Allowed { .. }) {
                    self.renewals.push(refill);
                } else {
                    self.refills.push(refill);
                }
            }
        }
    }

    /// The calls for the refills claimed since the last ones: one for leased allowances, one for
    /// leased slots, each asking from its keys' states now (one read per key, off the request
    /// path). Answers go to [`Engine::apply_grants`] and [`Engine::apply_slots`] with the same
    /// refills.
    pub fn take_refills<S: CasStore + ?Sized>(
        &mut self,
        store: &S,
        instance: &str,
        now: u64,
    ) -> Vec<Call> {
        let mut calls = Vec::new();
        if self.refills.is_empty() && self.renewals.is_empty() && self.give_backs.is_empty() {
            return calls;
        }
        let now_ms = now / 1_000_000;
        // Past what a tick may send, refills wait for the next tick, renewals first: a flood of
        // new keys delays new keys, never the calls of keys already served.
        let cap = ITEMS_PER_CALL * CALLS_PER_TICK;
        let mut refills = std::mem::take(&mut self.renewals);
        if refills.len() > cap {
            self.renewals = refills.split_off(cap);
        }
        let room = cap - refills.len();
        let later = self.refills.split_off(self.refills.len().min(room));
        refills.append(&mut self.refills);
        self.refills = later;
        let (mut leases, mut slots) = (Vec::new(), Vec::new());
        let mut slot_items = Vec::new();
        for mut r in refills {
            let Some(state) = self.state(store, &r) else {
                continue;
            };
            if let Some(allowance) = self.allowance_of(r.rule) {
                r.ask = allowance.ask(&state, now_ms);
                leases.push(r);
            } else if let Some(slot) = self.slot_allowance_of(r.rule) {
                let ask = slot.ask(&state, now_ms);
                r.ask.wanted = ask.wanted;
                if let Some(item) = self.slot_item(r.rule, r.key, &ask) {
                    slot_items.push(item);
                    slots.push(r);
                }
            }
        }
        // Calls of at most ITEMS_PER_CALL items: a call that fails takes only its own keys to
        // the failure mode.
        while !leases.is_empty() {
            let rest = leases.split_off(leases.len().min(ITEMS_PER_CALL));
            let chunk = std::mem::replace(&mut leases, rest);
            let items = chunk
                .iter()
                .filter_map(|r| self.lease_item(r.rule, r.key, &r.ask))
                .collect();
            let request = LeaseRequest {
                instance: instance.to_owned(),
                items,
            };
            calls.push(Call::Lease(chunk, request));
        }
        if !self.give_backs.is_empty() {
            let items = std::mem::take(&mut self.give_backs)
                .into_iter()
                .filter_map(|((rule, key), tokens)| {
                    let item = self.lease_item(rule, key, &Ask::default())?;
                    Some(LeaseItem {
                        returned: tokens,
                        ..item
                    })
                })
                .collect();
            calls.push(Call::GiveBack(LeaseRequest {
                instance: instance.to_owned(),
                items,
            }));
        }
        while !slots.is_empty() {
            let rest = slots.split_off(slots.len().min(ITEMS_PER_CALL));
            let chunk = std::mem::replace(&mut slots, rest);
            let rest_items = slot_items.split_off(chunk.len());
            let request = SlotRequest {
                instance: instance.to_owned(),
                items: std::mem::replace(&mut slot_items, rest_items),
            };
            calls.push(Call::Slots(chunk, request));
        }
        calls
    }

    /// Give back `tokens` of `rule`'s key `key` with the next tick's calls.
    pub(super) fn give_back(&mut self, rule: usize, key: u128, tokens: u64) {
        if tokens == 0 {
            return;
        }
        let room = self.give_backs.len() < MAX_GIVE_BACKS;
        if let Some(n) = self.give_backs.get_mut(&(rule, key)) {
            *n = n.saturating_add(tokens);
        } else if room {
            self.give_backs.insert((rule, key), tokens);
        }
    }

    /// The slot allowance of a global concurrency rule.
    fn slot_allowance_of(&self, rule: usize) -> Option<&SlotAllowance> {
        match &self.config.rules.get(rule)?.quota.limit {
            Limit::SlotLease(l) => Some(l),
            _ => None,
        }
    }

    fn slot_item(&self, rule: usize, key: u128, ask: &SlotAsk) -> Option<SlotItem> {
        let r = self.config.rules.get(rule)?;
        let global = r.global.as_ref()?;
        Some(SlotItem {
            rule: r.name.clone(),
            limit_id: global.limit_id.clone(),
            key: format!("{:032x}", self.service_key(key)),
            concurrent: global.burst,
            wanted: ask.wanted,
            keep: ask.keep,
            known_held: ask.known_held,
        })
    }

    /// Keep a global concurrency key in view: its lease is renewed (or given back) on the tick.
    pub(super) fn watch_slots(&mut self, rule: usize, slot: SlotId, key: u128) {
        if self.slot_keys.len() < MAX_SLOT_KEYS || self.slot_keys.contains_key(&(rule, slot)) {
            self.slot_keys.insert((rule, slot), key);
        }
    }

    /// The tick's look at the global concurrency keys in view: claim the calls that are due
    /// (renewals, more slots for full leases, keys given back) and stop watching idle keys.
    pub fn renew_slots<S: CasStore + ?Sized>(&mut self, store: &S, now: u64) {
        let now_ms = now / 1_000_000;
        // A next scan further ahead than one period: the clock stepped back; scan now.
        let stepped = self.next_slot_scan_ms > now_ms.saturating_add(SLOT_SCAN_MS);
        if self.slot_keys.is_empty() || (now_ms < self.next_slot_scan_ms && !stepped) {
            return;
        }
        self.next_slot_scan_ms = now_ms + SLOT_SCAN_MS;
        let mut idle = Vec::new();
        let mut claimed = Vec::new();
        for (&(rule, slot), &key) in &self.slot_keys {
            let Some(allowance) = self.slot_allowance_of(rule).copied() else {
                idle.push((rule, slot));
                continue;
            };
            let table = &self.config.rules[rule].quota.table;
            let store_key = table.store_key(slot.group);
            // One attempt: a lost race leaves the claim to the next look.
            let looked = update_slot(
                store,
                store_key.as_str(),
                1,
                |group| group.slots.iter().position(|s| s.tag == slot.tag),
                |s| match allowance.renewal(&s.state, now_ms) {
                    Some(next) => {
                        s.state = next;
                        (true, Renewal::Claimed)
                    }
                    None if SlotAllowance::is_idle(&s.state, now_ms) => (false, Renewal::Idle),
                    None => (false, Renewal::NotDue),
                },
            );
            match looked {
                Ok(Some(Renewal::Claimed)) => claimed.push(Refill {
                    rule,
                    slot,
                    key,
                    claimed_ms: now_ms,
                    ask: Ask::default(),
                }),
                // Idle, or its slot went to another key.
                Ok(Some(Renewal::Idle) | None) => idle.push((rule, slot)),
                Ok(Some(Renewal::NotDue)) | Err(_) => {}
            }
        }
        for k in idle {
            self.slot_keys.remove(&k);
        }
        self.renewals.extend(claimed);
    }

    /// Write a slot call's answer (`None`: the call failed) into the keys' leases.
    pub fn apply_slots<S: CasStore + ?Sized>(
        &mut self,
        store: &S,
        refills: &[Refill],
        answer: Option<&SlotResponse>,
        now_ns: u64,
    ) {
        let now_ms = now_ns / 1_000_000;
        let Some(answer) = answer else {
            return self.fail_refills(store, refills, now_ms);
        };
        let refused = self.refused_items(store, refills, &answer.errors, now_ms);
        let mut held: Vec<(usize, u64)> = Vec::new();
        for (n, (refill, a)) in refills.iter().zip(&answer.items).enumerate() {
            if refused.contains(&n) {
                continue;
            }
            let Some(slots) = self.slot_allowance_of(refill.rule).copied() else {
                continue;
            };
            self.update_allowance(store, refill, |state| {
                slots.grant(state, now_ms, a, refill.claimed_ms, refill.ask.wanted)
            });
            match held.iter_mut().find(|(r, _)| *r == refill.rule) {
                Some((_, n)) => *n += a.held,
                None => held.push((refill.rule, a.held)),
            }
        }
        for (rule, n) in held {
            self.stats.set(rule, crate::stats::RuleStat::SlotsHeld, n);
        }
    }

    /// The allowance of a global rule in lease mode.
    fn allowance_of(&self, rule: usize) -> Option<&LeaseAllowance> {
        match &self.config.rules.get(rule)?.quota.limit {
            Limit::Lease(l) => Some(l),
            _ => None,
        }
    }

    /// The lease item asking global rule `rule` for `key` what `ask` says.
    pub(super) fn lease_item(&self, rule: usize, key: u128, ask: &Ask) -> Option<LeaseItem> {
        let rule = self.config.rules.get(rule)?;
        let global = rule.global.as_ref()?;
        Some(LeaseItem {
            rule: rule.name.clone(),
            limit_id: global.limit_id.clone(),
            key: format!("{:032x}", self.service_key(key)),
            requests: global.requests,
            per_ms: global.per_ms,
            burst: global.burst,
            wanted: ask.wanted,
            used: ask.used,
            demand: ask.demand_mtps as f64 / 1_000.0,
            known_ms: ask.known_ms,
            known_remaining: ask.known_remaining,
            returned: 0,
        })
    }

    /// The name of a client key at the quota service: its hash, keyed by the deployment's
    /// `key_secret` (SipHash-2-4) when there is one.
    fn service_key(&self, key: u128) -> u128 {
        let secret = self
            .config
            .quota_service
            .as_ref()
            .and_then(|q| q.key_secret);
        match secret {
            Some(secret) => {
                let mut h = SipHasher24::new_with_key(&secret);
                h.write(&key.to_le_bytes());
                h.finish128().as_u128()
            }
            None => key,
        }
    }

    /// Write a lease call's answer (`None`: the call failed) into the refilled keys' allowances.
    pub fn apply_grants<S: CasStore + ?Sized>(
        &mut self,
        store: &S,
        refills: &[Refill],
        answer: Option<&LeaseResponse>,
        now_ns: u64,
    ) {
        let now_ms = now_ns / 1_000_000;
        let Some(answer) = answer else {
            return self.fail_refills(store, refills, now_ms);
        };
        let refused = self.refused_items(store, refills, &answer.errors, now_ms);
        for (n, (refill, answer)) in refills.iter().zip(&answer.items).enumerate() {
            if refused.contains(&n) {
                continue;
            }
            let (Some(global), Some(allowance)) = (
                self.config
                    .rules
                    .get(refill.rule)
                    .and_then(|r| r.global.as_ref()),
                self.allowance_of(refill.rule).copied(),
            ) else {
                continue;
            };
            // Nothing granted and no hint: ask again once a token may have come back.
            let retry_ms = if answer.retry_ms > 0 {
                answer.retry_ms
            } else {
                (global.per_ms / global.requests).clamp(1, answer.reset_ms.max(1))
            };
            let grant = Grant {
                tokens: answer.granted,
                rate_mtps: mtps(answer.rate),
                ttl_ms: answer.ttl_ms,
                claimed_ms: refill.claimed_ms,
                retry_ms,
                remaining: answer.remaining,
                asked: refill.ask,
            };
            self.stats
                .add_process(ProcessStat::QuotaGranted, saturating_i64(answer.granted));
            self.update_allowance(store, refill, |state| {
                allowance.grant(state, now_ms, &grant)
            });
        }
    }

    /// Items the service refused one by one: each of their keys applies the failure mode, as if
    /// its own call had failed; the rest of the call is served. Their indexes.
    fn refused_items<S: CasStore + ?Sized>(
        &self,
        store: &S,
        refills: &[Refill],
        errors: &[ItemError],
        now_ms: u64,
    ) -> SmallVec<[usize; 4]> {
        let mut refused = SmallVec::new();
        for e in errors {
            let Some(refill) = refills.get(e.item) else {
                continue;
            };
            if refused.is_empty() {
                warn!("quota service refused an item: {}", e.error);
            }
            refused.push(e.item);
            self.fail_keys(store, std::slice::from_ref(refill), now_ms);
        }
        refused
    }

    /// A call failed: its keys (leased allowances or slots) apply the failure mode until `retry`.
    fn fail_refills<S: CasStore + ?Sized>(&mut self, store: &S, refills: &[Refill], now_ms: u64) {
        warn!("quota service call failed: global rules apply their failure mode");
        self.stats.add_process(ProcessStat::QuotaFailures, 1);
        self.fail_keys(store, refills, now_ms);
    }

    /// The refilled keys apply the failure mode until `retry`.
    fn fail_keys<S: CasStore + ?Sized>(&self, store: &S, refills: &[Refill], now_ms: u64) {
        let retry_ms = self.retry_ms();
        for refill in refills {
            match self.config.rules.get(refill.rule).map(|r| r.quota.limit) {
                Some(Limit::Lease(a)) => {
                    self.update_allowance(store, refill, |s| a.fail(s, now_ms, retry_ms))
                }
                Some(Limit::SlotLease(a)) => {
                    self.update_allowance(store, refill, |s| a.fail(s, now_ms, retry_ms))
                }
                _ => {}
            }
        }
    }

    /// After a failed call, how long keys apply the failure mode before asking again.
    fn retry_ms(&self) -> u64 {
        self.config
            .quota_service
            .as_ref()
            .map_or(1_000, |q| q.retry_ms)
    }

    /// The state of the refilled key's slot, if it still holds that key.
    fn state<S: CasStore + ?Sized>(&self, store: &S, refill: &Refill) -> Option<State> {
        let rule = self.config.rules.get(refill.rule)?;
        let key = rule.quota.table.store_key(refill.slot.group);
        let (bytes, _) = store.read(key.as_str()).ok()??;
        let group = Group::decode(&bytes);
        let slot = group.slots.iter().find(|s| s.tag == refill.slot.tag)?;
        Some(slot.state)
    }

    /// Rewrite the allowance of the refilled key's slot (if it still holds that key).
    fn update_allowance<S: CasStore + ?Sized>(
        &self,
        store: &S,
        refill: &Refill,
        f: impl Fn(&State) -> State,
    ) {
        let Some(rule) = self.config.rules.get(refill.rule) else {
            return;
        };
        let key = rule.quota.table.store_key(refill.slot.group);
        let tag = refill.slot.tag;
        let written = update_slot(
            store,
            key.as_str(),
            MAX_RELEASE_ATTEMPTS,
            |group| group.slots.iter().position(|s| s.tag == tag),
            |slot| {
                slot.state = f(&slot.state);
                (true, ())
            },
        );
        if written == Ok(None) {
            // The slot went to another key meanwhile: its grant is lost (stricter, never looser).
            debug!("rule {}: refilled key no longer has a slot", rule.name);
        }
    }
}

/// A granted rate in milli-tokens per second; a rate that is no number of tokens is none.
fn mtps(rate: f64) -> u64 {
    if rate.is_finite() && rate > 0.0 {
        (rate * 1_000.0) as u64
    } else {
        0
    }
}

/// The answer to a lease call, if it is a well-formed one for `items` items: `status` is the
/// `:status` the host gave (none for a failed call), `body` the answer's body.
pub fn read_answer(
    status: Option<&[u8]>,
    body: Option<&[u8]>,
    items: usize,
) -> Option<LeaseResponse> {
    read_json::<LeaseResponse>(status, body).filter(|r| r.items.len() == items)
}

/// The answer to a slot call, if it is a well-formed one for `items` items.
pub fn read_slot_answer(
    status: Option<&[u8]>,
    body: Option<&[u8]>,
    items: usize,
) -> Option<SlotResponse> {
    read_json::<SlotResponse>(status, body)
        .filter(|r| r.items.len() == items)
        .filter(|r| {
            // Refused items answer all zeros: only the others must be sane.
            r.items
                .iter()
                .enumerate()
                .all(|(n, a)| sane(a) || r.errors.iter().any(|e| e.item == n))
        })
}

/// A `200` answer's JSON body, if it reads as a `T`.
fn read_json<T: serde::de::DeserializeOwned>(
    status: Option<&[u8]>,
    body: Option<&[u8]>,
) -> Option<T> {
    if status != Some(b"200") {
        warn!(
            "quota service answered status {}",
            status.map_or("none".into(), String::from_utf8_lossy)
        );
        return None;
    }
    serde_json::from_slice::<T>(body?)
        .map_err(|e| warn!("malformed quota service answer: {e}"))
        .ok()
}

/// An answer no proxy could act on safely is refused whole.
fn sane(a: &SlotAnswer) -> bool {
    a.share <= 1_000_000_000 && a.held <= 1_000_000_000 && a.ttl_ms > 0 && a.ttl_ms <= 86_400_000
}
