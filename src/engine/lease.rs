//! Leases from the quota service: the refills requests claim, the calls that ask for them, and the
//! answers written back into the keys' allowances.

use super::{saturating_i64, CheckInput, Engine};
use crate::stats::ProcessStat;
use log::{debug, warn};
use tollgate_core::lease::{LeaseItem, LeaseRequest, LeaseResponse};
use tollgate_core::limiter::MAX_RELEASE_ATTEMPTS;
use tollgate_core::slot::Group;
use tollgate_core::{CasStore, LeaseAllowance, Limit, Outcome, SlotId, State, StoreError, Verdict};

/// A key's allowance to refill from the quota service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refill {
    pub rule: usize,
    pub slot: SlotId,
    pub key: u128,
    /// Roughly what the key spent of its last lease: the service's demand signal.
    pub used: u64,
}

impl Engine {
    /// Note the refills `outcome`'s writes claimed: they go out together on the next tick.
    pub(super) fn record_claims(&mut self, inputs: &[CheckInput], outcome: &Outcome) {
        for (input, result) in inputs.iter().zip(&outcome.checks) {
            if !result.refill {
                continue;
            }
            let used = match (result.verdict, self.quota_of(input.which).map(|q| q.limit)) {
                (Verdict::Allowed { remaining, .. }, Some(Limit::Lease(l))) => {
                    l.lease_size.saturating_sub(remaining)
                }
                _ => 0,
            };
            self.refills.push(Refill {
                rule: input.which.rule(),
                slot: input.slot,
                key: input.key,
                used,
            });
        }
    }

    /// The refills claimed since the last call, with the request asking for them (`None` if there
    /// are none). The answer goes to [`Engine::apply_grants`] with the same refills.
    pub fn take_refills(&mut self, instance: &str) -> Option<(Vec<Refill>, LeaseRequest)> {
        if self.refills.is_empty() {
            return None;
        }
        let mut refills = std::mem::take(&mut self.refills);
        refills.retain(|r| self.lease_size(r.rule).is_some());
        let items = refills
            .iter()
            .filter_map(|r| self.lease_item(r.rule, r.key, self.lease_size(r.rule)?, r.used))
            .collect();
        let request = LeaseRequest {
            instance: instance.to_owned(),
            items,
        };
        Some((refills, request))
    }

    /// The lease size of a global rule in lease mode.
    fn lease_size(&self, rule: usize) -> Option<u64> {
        match self.config.rules.get(rule)?.quota.limit {
            Limit::Lease(l) => Some(l.lease_size),
            _ => None,
        }
    }

    /// The lease item asking global rule `rule` for `wanted` tokens of `key`.
    pub(super) fn lease_item(
        &self,
        rule: usize,
        key: u128,
        wanted: u64,
        used: u64,
    ) -> Option<LeaseItem> {
        let rule = self.config.rules.get(rule)?;
        let global = rule.global.as_ref()?;
        Some(LeaseItem {
            rule: rule.name.clone(),
            limit_id: global.limit_id.clone(),
            key: format!("{key:032x}"),
            requests: global.requests,
            per_ms: global.per_ms,
            burst: global.burst,
            wanted,
            used,
        })
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
                self.update_allowance(store, refill, |state| {
                    LeaseAllowance::fail(state, now_ms, retry_ms)
                });
            }
            return;
        };
        for (refill, grant) in refills.iter().zip(&answer.items) {
            let Some(global) = self
                .config
                .rules
                .get(refill.rule)
                .and_then(|r| r.global.as_ref())
            else {
                continue;
            };
            // Nothing granted: ask again once a token may have come back.
            let retry_ms = (global.per_ms / global.requests).clamp(1, grant.reset_ms.max(1));
            self.stats
                .add_process(ProcessStat::QuotaGranted, saturating_i64(grant.granted));
            self.update_allowance(store, refill, |state| {
                let granted =
                    LeaseAllowance::grant(state, now_ms, grant.granted, grant.ttl_ms, retry_ms);
                LeaseAllowance::reported(&granted, grant.remaining)
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
