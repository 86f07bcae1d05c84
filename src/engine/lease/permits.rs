//! Global concurrency: the keys a worker keeps in view, their permits renewed (or given back) on
//! the tick, and the service's answers written into their leases.

use super::Refill;
use crate::engine::Engine;
use tollgate_core::global::permits::{PermitAsk, PermitItem, PermitResponse};
use tollgate_core::slot::update_slot;
use tollgate_core::{CasStore, Limit, PermitAllowance, SlotId};

/// How often a worker looks at the global concurrency keys it knows (renewals are due halfway
/// through a lease's term, seconds away).
const PERMIT_SCAN_MS: u64 = 100;
/// Most global concurrency keys a worker keeps in view (those with its requests in flight).
const MAX_PERMIT_KEYS: usize = 65_536;

/// What the tick's look at a global concurrency key found.
enum Renewal {
    Claimed,
    Idle,
    NotDue,
}

impl Engine {
    /// The slot allowance of a global concurrency rule.
    pub(in crate::engine) fn permit_allowance_of(&self, rule: usize) -> Option<&PermitAllowance> {
        match &self.config.rules.get(rule)?.quota()?.limit {
            Limit::PermitLease(l) => Some(l),
            _ => None,
        }
    }

    pub(in crate::engine) fn permit_item(
        &self,
        rule: usize,
        key: u128,
        ask: &PermitAsk,
    ) -> Option<PermitItem> {
        let r = self.config.rules.get(rule)?;
        let global = r.global()?;
        Some(PermitItem {
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
    pub(in crate::engine) fn watch_permits(&mut self, rule: usize, slot: SlotId, key: u128) {
        if self.leases.permit_keys.len() < MAX_PERMIT_KEYS
            || self.leases.permit_keys.contains_key(&(rule, slot))
        {
            self.leases.permit_keys.insert((rule, slot), key);
        }
    }

    /// The tick's look at the global concurrency keys in view: claim the calls that are due
    /// (renewals, more slots for full leases, keys given back) and stop watching idle keys.
    pub fn renew_permits<S: CasStore + ?Sized>(&mut self, store: &S, now: u64) {
        let now_ms = now / 1_000_000;
        // A next scan further ahead than one period: the clock stepped back; scan now.
        let stepped = self.leases.next_slot_scan_ms > now_ms.saturating_add(PERMIT_SCAN_MS);
        if self.leases.permit_keys.is_empty()
            || (now_ms < self.leases.next_slot_scan_ms && !stepped)
        {
            return;
        }
        self.leases.next_slot_scan_ms = now_ms + PERMIT_SCAN_MS;
        let mut idle = Vec::new();
        let mut claimed = Vec::new();
        for (&(rule, slot), &key) in &self.leases.permit_keys {
            let quota = self.config.rules.get(rule).and_then(|r| r.quota());
            let (Some(allowance), Some(quota)) = (self.permit_allowance_of(rule).copied(), quota)
            else {
                idle.push((rule, slot));
                continue;
            };
            let table = &quota.table;
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
                    None if PermitAllowance::is_idle(&s.state, now_ms) => (false, Renewal::Idle),
                    None => (false, Renewal::NotDue),
                },
            );
            match looked {
                Ok(Some(Renewal::Claimed)) => claimed.push(Refill::claimed(rule, slot, key, now)),
                // Idle, or its slot went to another key.
                Ok(Some(Renewal::Idle) | None) => idle.push((rule, slot)),
                Ok(Some(Renewal::NotDue)) | Err(_) => {}
            }
        }
        for k in idle {
            self.leases.permit_keys.remove(&k);
        }
        self.leases.renewals.extend(claimed);
    }

    /// Write a slot call's answer (`None`: the call failed) into the keys' leases.
    pub fn apply_permits<S: CasStore + ?Sized>(
        &mut self,
        store: &S,
        refills: &[Refill],
        answer: Option<&PermitResponse>,
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
            let Some(slots) = self.permit_allowance_of(refill.rule).copied() else {
                continue;
            };
            self.update_allowance(store, refill, |state| {
                let next = slots.grant(state, now_ms, a, refill.claimed_ms, refill.ask.wanted);
                (next, false)
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
}
