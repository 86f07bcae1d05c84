//! The quota service's answers: grants written into the keys' allowances, refused items and
//! failed calls marked, and the answers' bodies read (nothing malformed is acted on).

use super::Refill;
use crate::engine::{saturating_i64, Engine};
use crate::stats::ProcessStat;
use log::{debug, warn};
use smallvec::SmallVec;
use tollgate_core::global::lease::{ItemError, LeaseResponse};
use tollgate_core::global::permits::{PermitAnswer, PermitResponse};
use tollgate_core::limiter::MAX_RELEASE_ATTEMPTS;
use tollgate_core::slot::{update_slot, Group};
use tollgate_core::{CasStore, Grant, Limit, State};

impl Engine {
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
                self.config.rules.get(refill.rule).and_then(|r| r.global()),
                self.allowance_of(refill.rule).copied(),
            ) else {
                continue;
            };
            let grant = Grant::answered(
                answer,
                refill.ask,
                refill.sent_ms,
                (global.requests, global.per_ms),
            );
            self.stats
                .add_process(ProcessStat::QuotaGranted, saturating_i64(answer.granted));
            let claimed = self.update_allowance(store, refill, |state| {
                let next = allowance.grant(state, now_ms, &grant);
                (next, allowance.claimed(state, &next))
            });
            // Still owing (settled since the call went out): the next tick reports it.
            if claimed {
                self.renew(Refill::claimed(
                    refill.rule,
                    refill.slot,
                    refill.key,
                    now_ns,
                ));
            }
        }
    }

    /// Items the service refused one by one: each of their keys applies the failure mode, as if
    /// its own call had failed; the rest of the call is served. Their indexes.
    pub(in crate::engine) fn refused_items<S: CasStore + ?Sized>(
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
    pub(in crate::engine) fn fail_refills<S: CasStore + ?Sized>(
        &mut self,
        store: &S,
        refills: &[Refill],
        now_ms: u64,
    ) {
        warn!("quota service call failed: global rules apply their failure mode");
        self.stats.add_process(ProcessStat::QuotaFailures, 1);
        self.fail_keys(store, refills, now_ms);
    }

    /// The refilled keys apply the failure mode until `retry`.
    pub(in crate::engine) fn fail_keys<S: CasStore + ?Sized>(
        &self,
        store: &S,
        refills: &[Refill],
        now_ms: u64,
    ) {
        let retry_ms = self.retry_ms();
        for refill in refills {
            match self
                .config
                .rules
                .get(refill.rule)
                .and_then(|r| r.quota())
                .map(|q| q.limit)
            {
                Some(Limit::Lease(a)) => {
                    self.update_allowance(store, refill, |s| (a.fail(s, now_ms, retry_ms), false));
                }
                Some(Limit::PermitLease(a)) => {
                    self.update_allowance(store, refill, |s| (a.fail(s, now_ms, retry_ms), false));
                }
                _ => {}
            }
        }
    }

    /// After a failed call, how long keys apply the failure mode before asking again.
    pub(in crate::engine) fn retry_ms(&self) -> u64 {
        self.config
            .quota_service
            .as_ref()
            .map_or(1_000, |q| q.retry_ms)
    }

    /// The state of the refilled key's slot, if it still holds that key.
    pub(in crate::engine) fn state<S: CasStore + ?Sized>(
        &self,
        store: &S,
        refill: &Refill,
    ) -> Option<State> {
        let quota = self.config.rules.get(refill.rule)?.quota()?;
        let key = quota.table.store_key(refill.slot.group);
        let (bytes, _) = store.read(key.as_str()).ok()??;
        let group = Group::decode(&bytes);
        let slot = group.slots.iter().find(|s| s.tag == refill.slot.tag)?;
        Some(slot.state)
    }

    /// Rewrite the allowance of the refilled key's slot (if it still holds that key) with `f`,
    /// which also says whether the new state claims a call; true if the state written does.
    pub(in crate::engine) fn update_allowance<S: CasStore + ?Sized>(
        &self,
        store: &S,
        refill: &Refill,
        f: impl Fn(&State) -> (State, bool),
    ) -> bool {
        let Some(rule) = self.config.rules.get(refill.rule) else {
            return false;
        };
        let Some(quota) = rule.quota() else {
            return false;
        };
        let key = quota.table.store_key(refill.slot.group);
        let tag = refill.slot.tag;
        let written = update_slot(
            store,
            key.as_str(),
            MAX_RELEASE_ATTEMPTS,
            |group| group.slots.iter().position(|s| s.tag == tag),
            |slot| {
                let (next, claimed) = f(&slot.state);
                slot.state = next;
                (true, claimed)
            },
        );
        if written == Ok(None) {
            // The slot went to another key meanwhile: its grant is lost (stricter, never looser).
            debug!("rule {}: refilled key no longer has a slot", rule.name);
        }
        written == Ok(Some(true))
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
pub fn read_permit_answer(
    status: Option<&[u8]>,
    body: Option<&[u8]>,
    items: usize,
) -> Option<PermitResponse> {
    read_json::<PermitResponse>(status, body)
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
fn sane(a: &PermitAnswer) -> bool {
    a.share <= 1_000_000_000 && a.held <= 1_000_000_000 && a.ttl_ms > 0 && a.ttl_ms <= 86_400_000
}
