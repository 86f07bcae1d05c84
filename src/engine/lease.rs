//! Leases from the quota service: the refills requests claim, the calls that ask for them, and the
//! answers written back into the keys' allowances.

use super::{saturating_i64, CheckInput, Engine};
use crate::stats::ProcessStat;
use log::{debug, warn};
use siphasher::sip128::{Hasher128, SipHasher24};
use std::hash::Hasher;
use tollgate_core::lease::{LeaseItem, LeaseRequest, LeaseResponse};
use tollgate_core::limiter::MAX_RELEASE_ATTEMPTS;
use tollgate_core::slot::Group;
use tollgate_core::{
    Ask, CasStore, Grant, LeaseAllowance, Limit, Outcome, SlotId, State, StoreError,
};

/// A key's allowance to refill from the quota service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refill {
    pub rule: usize,
    pub slot: SlotId,
    pub key: u128,
    /// When a request claimed it (ms): the lease it brings ends `ttl_ms` after that.
    pub claimed_ms: u64,
    /// What the call asked for, from the key's state when it went out.
    pub ask: Ask,
}

impl Engine {
    /// Note the refills `outcome`'s writes claimed: they go out together on the next tick.
    pub(super) fn record_claims(&mut self, inputs: &[CheckInput], outcome: &Outcome, now: u64) {
        for (input, result) in inputs.iter().zip(&outcome.checks) {
            if result.refill {
                self.refills.push(Refill {
                    rule: input.which.rule(),
                    slot: input.slot,
                    key: input.key,
                    claimed_ms: now / 1_000_000,
                    ask: Ask::default(),
                });
            }
        }
    }

    /// The refills claimed since the last call, with the request asking for them (`None` if there
    /// are none): each asks from its key's state now (one read per key, off the request path).
    /// The answer goes to [`Engine::apply_grants`] with the same refills.
    pub fn take_refills<S: CasStore + ?Sized>(
        &mut self,
        store: &S,
        instance: &str,
        now: u64,
    ) -> Option<(Vec<Refill>, LeaseRequest)> {
        if self.refills.is_empty() {
            return None;
        }
        let now_ms = now / 1_000_000;
        let mut refills = std::mem::take(&mut self.refills);
        refills.retain_mut(|r| {
            let (Some(allowance), Some(state)) = (self.allowance_of(r.rule), self.state(store, r))
            else {
                return false;
            };
            r.ask = allowance.ask(&state, now_ms);
            true
        });
        if refills.is_empty() {
            return None;
        }
        let items = refills
            .iter()
            .filter_map(|r| self.lease_item(r.rule, r.key, &r.ask))
            .collect();
        let request = LeaseRequest {
            instance: instance.to_owned(),
            items,
        };
        Some((refills, request))
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
            warn!("quota service call failed: global rules apply their failure mode");
            self.stats.add_process(ProcessStat::QuotaFailures, 1);
            let retry_ms = self.retry_ms();
            for refill in refills {
                if let Some(allowance) = self.allowance_of(refill.rule).copied() {
                    self.update_allowance(store, refill, |state| {
                        allowance.fail(state, now_ms, retry_ms)
                    });
                }
            }
            return;
        };
        for (refill, answer) in refills.iter().zip(&answer.items) {
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
        for _ in 0..MAX_RELEASE_ATTEMPTS {
            let Ok(Some((bytes, cas))) = store.read(key.as_str()) else {
                return;
            };
            let mut group = Group::decode(&bytes);
            let Some(slot) = group.slots.iter_mut().find(|s| s.tag == refill.slot.tag) else {
                // The slot went to another key meanwhile: its grant is lost (stricter, never
                // looser).
                debug!("rule {}: refilled key no longer has a slot", rule.name);
                return;
            };
            slot.state = f(&slot.state);
            if store.write(key.as_str(), &group.encode(), cas) != Err(StoreError::CasMismatch) {
                return;
            }
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
    if status != Some(b"200") {
        warn!(
            "quota service answered status {}",
            status.map_or("none".into(), String::from_utf8_lossy)
        );
        return None;
    }
    serde_json::from_slice::<LeaseResponse>(body?)
        .map_err(|e| warn!("malformed quota service answer: {e}"))
        .ok()
        .filter(|r| r.items.len() == items)
}
