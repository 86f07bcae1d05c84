//! Leases from the quota service: the refills requests claim and the calls that ask for them;
//! `permits` keeps global concurrency keys' permits renewed, `answers` writes what the service
//! answered into the keys' allowances.

mod answers;
mod permits;

pub use answers::{read_answer, read_permit_answer};

use super::{CheckInput, Engine};
use tollgate_core::global::lease::{LeaseItem, LeaseRequest};
use tollgate_core::global::permits::PermitRequest;
use tollgate_core::{Ask, CasStore, LeaseAllowance, Limit, Outcome, SlotId, Verdict};

/// Items in one call to the quota service (it takes at most [`tollgate_core::global::lease::MAX_ITEMS`]).
pub const ITEMS_PER_CALL: usize = 250;

/// Calls one tick (or one request) sends at most; further refills wait for the next.
pub const CALLS_PER_TICK: usize = 8;

/// Keys whose unspent strict grants a worker keeps to give back at once; beyond, the tokens
/// are lost (stricter, never looser).
const MAX_GIVE_BACKS: usize = ITEMS_PER_CALL;

/// What the engine keeps of leases between requests: the refills they claimed, the tokens strict
/// requests give back, and the global concurrency keys to renew.
#[derive(Debug, Default)]
pub struct Leases {
    /// Refills of keys already served (their lease runs low or ends): sent before `refills`.
    pub(in crate::engine::lease) renewals: Vec<Refill>,
    /// Refills of keys with nothing in hand (new keys, leases that ran dry).
    pub(in crate::engine::lease) refills: Vec<Refill>,
    /// Tokens strict requests were granted and will not spend, by rule and key: given back on
    /// the next tick.
    pub(in crate::engine::lease) give_backs: rustc_hash::FxHashMap<(usize, u128), u64>,
    /// Global concurrency keys this worker has had requests of (renewed on the tick).
    pub(in crate::engine::lease) permit_keys: rustc_hash::FxHashMap<(usize, SlotId), u128>,
    /// When the tick looks at them next (ms).
    pub(in crate::engine::lease) next_slot_scan_ms: u64,
}

/// A call to the quota service a tick sends: the refills it is for, and its body; or tokens
/// given back, whose answer changes nothing here.
pub enum Call {
    Lease(Vec<Refill>, LeaseRequest),
    Permits(Vec<Refill>, PermitRequest),
    GiveBack(LeaseRequest),
}

impl Refill {
    /// A refill of `rule`'s `key` in `slot` claimed at `now` (ns).
    pub fn claimed(rule: usize, slot: SlotId, key: u128, now: u64) -> Self {
        let now_ms = now / 1_000_000;
        Self {
            rule,
            slot,
            key,
            claimed_ms: now_ms,
            sent_ms: now_ms,
            ask: Ask::default(),
        }
    }
}

/// A key's allowance to refill from the quota service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refill {
    pub rule: usize,
    pub slot: SlotId,
    pub key: u128,
    /// When a request claimed it (ms).
    pub claimed_ms: u64,
    /// When its call went out (ms; the claim's time until then): the old lease accrued until
    /// then, and the one it brings ends `ttl_ms` after it.
    pub sent_ms: u64,
    /// What the call asked for, from the key's state when it went out (slots: `wanted` only).
    pub ask: Ask,
}

impl Engine {
    /// Note the refills `outcome`'s writes claimed: they go out together on the next tick.
    pub(super) fn record_claims(&mut self, inputs: &[CheckInput], outcome: &Outcome, now: u64) {
        for (input, result) in inputs.iter().zip(&outcome.checks) {
            if result.refill {
                if self.permit_allowance_of(input.which.rule()).is_some() {
                    self.watch_permits(input.which.rule(), input.slot, input.key);
                }
                let refill = Refill::claimed(input.which.rule(), input.slot, input.key, now);
                // A request admitted from the lease it claims more for: a key already served.
                if matches!(result.verdict, Verdict::Admitted { .. }) {
                    self.leases.renewals.push(refill);
                } else {
                    self.leases.refills.push(refill);
                }
            }
        }
    }

    /// The calls for the refills claimed since the last ones: one for leased allowances, one for
    /// leased slots, each asking from its keys' states now (one read per key, off the request
    /// path). Answers go to [`Engine::apply_grants`] and [`Engine::apply_permits`] with the same
    /// refills.
    pub fn take_refills<S: CasStore + ?Sized>(
        &mut self,
        store: &S,
        instance: &str,
        now: u64,
    ) -> Vec<Call> {
        let mut calls = Vec::new();
        if self.leases.refills.is_empty()
            && self.leases.renewals.is_empty()
            && self.leases.give_backs.is_empty()
        {
            return calls;
        }
        let now_ms = now / 1_000_000;
        // Past what a tick may send, refills wait for the next tick, renewals first: a flood of
        // new keys delays new keys, never the calls of keys already served.
        let cap = ITEMS_PER_CALL * CALLS_PER_TICK;
        let mut refills = std::mem::take(&mut self.leases.renewals);
        if refills.len() > cap {
            self.leases.renewals = refills.split_off(cap);
        }
        let room = cap - refills.len();
        let later = self
            .leases
            .refills
            .split_off(self.leases.refills.len().min(room));
        refills.append(&mut self.leases.refills);
        self.leases.refills = later;
        let (mut leases, mut slots) = (Vec::new(), Vec::new());
        let mut slot_items = Vec::new();
        for mut r in refills {
            let Some(state) = self.state(store, &r) else {
                continue;
            };
            if let Some(allowance) = self.allowance_of(r.rule) {
                r.ask = allowance.ask(&state, now_ms);
                r.sent_ms = now_ms;
                leases.push(r);
            } else if let Some(slot) = self.permit_allowance_of(r.rule) {
                let ask = slot.ask(&state, now_ms);
                r.ask.wanted = ask.wanted;
                if let Some(item) = self.permit_item(r.rule, r.key, &ask) {
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
        if !self.leases.give_backs.is_empty() {
            let items = std::mem::take(&mut self.leases.give_backs)
                .into_iter()
                .filter_map(|((rule, key), tokens)| {
                    let ask = Ask {
                        returned: tokens,
                        ..Ask::default()
                    };
                    self.lease_item(rule, key, &ask)
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
            let request = PermitRequest {
                instance: instance.to_owned(),
                items: std::mem::replace(&mut slot_items, rest_items),
            };
            calls.push(Call::Permits(chunk, request));
        }
        calls
    }

    /// Note a refill claimed outside a request's decision (a settlement that left the key owing,
    /// an answer that still leaves it owing): it goes out with the next tick, before new keys.
    pub(in crate::engine) fn renew(&mut self, refill: Refill) {
        self.leases.renewals.push(refill);
    }

    /// Give back `tokens` of `rule`'s key `key` with the next tick's calls.
    pub(super) fn give_back(&mut self, rule: usize, key: u128, tokens: u64) {
        if tokens == 0 {
            return;
        }
        let room = self.leases.give_backs.len() < MAX_GIVE_BACKS;
        if let Some(n) = self.leases.give_backs.get_mut(&(rule, key)) {
            *n = n.saturating_add(tokens);
        } else if room {
            self.leases.give_backs.insert((rule, key), tokens);
        }
    }

    /// The allowance of a global rule in lease mode.
    pub(in crate::engine) fn allowance_of(&self, rule: usize) -> Option<&LeaseAllowance> {
        match &self.config.rules.get(rule)?.quota()?.limit {
            Limit::Lease(l) => Some(l),
            _ => None,
        }
    }

    /// The lease item asking global rule `rule` for `key` what `ask` says.
    pub(in crate::engine) fn lease_item(
        &self,
        rule: usize,
        key: u128,
        ask: &Ask,
    ) -> Option<LeaseItem> {
        let rule = self.config.rules.get(rule)?;
        let global = rule.global()?;
        let mut item = ask.item(
            rule.name.clone(),
            global.limit_id.clone(),
            format!("{:032x}", self.service_key(key)),
            (global.requests, global.per_ms, global.burst),
        );
        if let Some(c) = &global.calendar {
            item.calendar = Some(c.unit.as_str().to_owned());
            item.time_zone = Some(c.time_zone.clone());
        }
        Some(item)
    }

    /// The name of a client key at the quota service: its hash, keyed by the deployment's
    /// `key_secret` (SipHash-2-4) when there is one.
    pub(in crate::engine) fn service_key(&self, key: u128) -> u128 {
        let secret = self
            .config
            .quota_service
            .as_ref()
            .and_then(|q| q.key_secret);
        crate::key::service_key(secret, key)
    }
}
