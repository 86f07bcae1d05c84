//! All-or-nothing admission of one request against every rule that applies to it.
//!
//! Phase one reads each rule's slot and decides; if an enforced rule refuses, nothing is written
//! (a 429 storm costs reads only). Phase two writes each decision with CAS; a lost race re-reads and
//! re-decides, and a refusal found then gives back what earlier rules already took.

use crate::algorithm::{Limit, Standing};
use crate::slot::{update_slot, Group, Slot, SlotId, SlotTable, StoreKey, WAYS};
use crate::state::Decision;
use crate::store::{CasStore, StoreError, UpdateError};
use crate::token_bucket::TokenBucket;
use smallvec::SmallVec;

/// Rules a request can meet before its per-request vectors leave the stack for the heap.
pub const INLINE_RULES: usize = 4;

/// One outcome per check, in order.
pub type CheckOutcomes = SmallVec<[CheckOutcome; INLINE_RULES]>;

/// Writes tried per group before the request is treated as refused by contention.
pub const MAX_CAS_ATTEMPTS: u32 = 16;

/// Writes tried to release held quota: a release must not be lost, or the count would drift.
pub const MAX_RELEASE_ATTEMPTS: u32 = 1_000;

/// One rule's part in a request.
#[derive(Debug, Clone, Copy)]
pub struct Check<'a> {
    pub limit: &'a Limit,
    pub table: &'a SlotTable,
    pub slot: SlotId,
    pub cost: u64,
    /// False for dry-run rules: they count and report, never refuse.
    pub enforced: bool,
    /// Token buckets and leased allowances: up to this many tokens more may be taken for the
    /// worker's stash, when there are plenty (see [`crate::stash`]). 0 takes exactly `cost`.
    pub batch: u64,
    /// Token buckets: a refusal while tokens of the bucket sit in some worker's stash is
    /// `Waiting` instead (for at most [`crate::stash::STASH_RETURNED_NS`]): the caller decides
    /// again once they are back. For callers that can hold the request and ask again.
    pub wait_for_stashes: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Allowed {
        remaining: u64,
        reset_ns: u64,
        /// Hold the request this long before passing it on (leaky bucket).
        delay_ns: u64,
    },
    /// The rule refuses (or, for a dry-run rule, would refuse).
    Limited {
        retry_after_ns: u64,
        remaining: u64,
        reset_ns: u64,
    },
    /// Every CAS attempt lost a race: refused, never looser.
    Contended,
    /// The store failed: the rule does not apply to this request.
    Unavailable,
    /// Quota is on its way (global rules): try again shortly.
    Waiting,
    /// The source of quota failed (global rules): the rule's failure mode decides.
    Fallback,
    /// Not asked: the request was already refused by another rule (from a worker's stash).
    Skipped,
}

/// What the request found in its slot group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotEvent {
    /// A slot of its own, or a free one.
    Own,
    /// A slot whose key was idle (as good as fresh): it is this key's now, losing nothing.
    TakenOver,
    /// Every slot of the group held an active key: the one closest to fresh was evicted for this
    /// key (see [`choose`]).
    Evicted,
    /// Every slot's key is being limited (or, concurrency, has requests in flight): this key
    /// shares one of them (stricter for both, never looser).
    Shared,
}

/// Quota an admitted request holds until it ends (concurrency rules): give it back with [`release`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hold {
    pub group: u32,
    pub index: usize,
    pub cost: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckOutcome {
    pub verdict: Verdict,
    pub slot: SlotEvent,
    /// Set when the request was admitted and this rule's quota stays held until it ends.
    pub hold: Option<Hold>,
    /// This request claimed a refill of the rule's allowance for its key: the caller sends it.
    pub refill: bool,
    /// Tokens taken beyond the request's cost, for the worker's stash (admitted requests only).
    pub stashed: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// False with no `rejected_by` when an enforced check is `Waiting` or `Fallback`.
    pub admitted: bool,
    /// Index of the enforced check that refused the request (the longest wait if several did).
    pub rejected_by: Option<usize>,
    /// One per check, in order.
    pub checks: CheckOutcomes,
}

/// A decision made from one read, with what to write if the request goes ahead.
struct Plan {
    key: StoreKey,
    outcome: CheckOutcome,
    /// The slot used and the owner tag it carries after the write.
    index: usize,
    owner: u64,
    /// The slot's state as read.
    before: crate::state::State,
    write: Option<(Group, u32)>,
}

/// Which slot of the group a key uses, what that means, and the slot as the decision starts from.
///
/// Its own slot, else a free one, else an idle one (as good as fresh: nothing lost). With every
/// slot held by an active key, the slot whose reset gives back the least is evicted — never one
/// whose key is being limited; among equals the least recently admitted. A key that returns after
/// its eviction starts fresh: it can be admitted at most what it had spent more than it would have
/// been. When every key of the group is being limited, the new key shares the slot that frees
/// soonest (stricter for both, never looser). Concurrency slots with requests in flight are never
/// taken over: the new key shares the one with the fewest.
fn choose(limit: &Limit, group: &Group, tag: u64, now_ns: u64) -> (usize, SlotEvent, Slot) {
    let slots = &group.slots;
    if let Some(i) = slots.iter().position(|s| s.tag == tag) {
        return (i, SlotEvent::Own, slots[i]);
    }
    let fresh = Slot {
        tag,
        ..Slot::default()
    };
    if let Some(i) = slots.iter().position(|s| s.tag == 0) {
        return (i, SlotEvent::Own, fresh);
    }
    if let Some(i) = slots.iter().position(|s| limit.is_idle(&s.state, now_ns)) {
        return (i, SlotEvent::TakenOver, fresh);
    }
    let standing: [Standing; WAYS] =
        std::array::from_fn(|i| limit.standing(&slots[i].state, now_ns));
    if limit.is_held() {
        let least = (0..WAYS).min_by_key(|&i| standing[i].spent).unwrap_or(0);
        return (least, SlotEvent::Shared, slots[least]);
    }
    if standing.iter().all(|s| s.limited) {
        // Evicting a limited key would reset it: whoever can fill a group with limited keys could
        // reset their own again and again. The newcomer shares the slot that frees soonest.
        let soonest = (0..WAYS)
            .min_by_key(|&i| standing[i].retry_after_ns)
            .unwrap_or(0);
        return (soonest, SlotEvent::Shared, slots[soonest]);
    }
    let victim = (0..WAYS)
        .filter(|&i| !standing[i].limited)
        .min_by_key(|&i| {
            (
                standing[i].spent,
                standing[i].retry_after_ns,
                slots[i].last_ns,
            )
        })
        .unwrap_or(0);
    (victim, SlotEvent::Evicted, fresh)
}

fn plan<S: CasStore + ?Sized>(store: &S, check: &Check, key: StoreKey, now_ns: u64) -> Plan {
    let (group, cas) = match store.read(key.as_str()) {
        Ok(Some((bytes, cas))) => (Group::decode(&bytes), cas),
        Ok(None) => (Group::decode(&[]), 0),
        Err(_) => {
            return Plan {
                key,
                outcome: CheckOutcome {
                    verdict: Verdict::Unavailable,
                    slot: SlotEvent::Own,
                    hold: None,
                    refill: false,
                    stashed: 0,
                },
                index: 0,
                owner: 0,
                before: [0; crate::state::STATE_BYTES],
                write: None,
            }
        }
    };
    let (index, slot, current) = choose(check.limit, &group, check.slot.tag, now_ns);
    let owner = current.tag;
    let mut stashed = 0;
    let claim_write = |state| {
        let mut next = group;
        next.slots[index] = Slot {
            tag: owner,
            last_ns: current.last_ns,
            state,
        };
        (next, cas)
    };
    let (verdict, write) = match check.limit.decide(&current.state, now_ns, check.cost) {
        Decision::Allow {
            mut state,
            remaining,
            reset_ns,
            delay_ns,
        } => {
            if let Some((more, taken)) = stash_take(check, &current.state, remaining, now_ns) {
                (state, stashed) = (more, taken);
            }
            let mut next = group;
            // Only the owner's own admissions make its slot recently used.
            let last_ns = match slot {
                SlotEvent::Shared => current.last_ns,
                _ => now_ns,
            };
            next.slots[index] = Slot {
                tag: owner,
                last_ns,
                state,
            };
            (
                Verdict::Allowed {
                    remaining,
                    reset_ns,
                    delay_ns,
                },
                Some((next, cas)),
            )
        }
        Decision::Deny { .. } if stashes_may_return(check, &current.state, now_ns) => {
            (Verdict::Waiting, None)
        }
        Decision::Deny {
            retry_after_ns,
            remaining,
            reset_ns,
        } => (
            Verdict::Limited {
                retry_after_ns,
                remaining,
                reset_ns,
            },
            None,
        ),
        // A claim of a refill is written whatever the verdict: this request asks the service.
        Decision::Wait { claim } => (Verdict::Waiting, claim.map(claim_write)),
        Decision::Fallback { claim } => (Verdict::Fallback, claim.map(claim_write)),
    };
    Plan {
        key,
        outcome: CheckOutcome {
            verdict,
            slot,
            hold: None,
            refill: false,
            stashed,
        },
        index,
        owner,
        before: current.state,
        write,
    }
}

/// True if a refused token bucket has tokens out in worker stashes that may still come back, and
/// they could make the request fit: deciding now would refuse a request another worker's stash
/// holds tokens for (the end of a burst spread over workers).
fn stashes_may_return(check: &Check, state: &crate::state::State, now_ns: u64) -> bool {
    let Limit::TokenBucket(bucket) = check.limit else {
        return false;
    };
    check.wait_for_stashes
        && check.cost <= bucket.burst()
        && now_ns < TokenBucket::stash_out_until(state)
}

/// Tokens to take for the worker's stash beyond a request that `remaining` would be left after:
/// a quarter of what is left, at most `check.batch`, so that a bucket near empty is shared one
/// token at a time (exact) and only a bucket with plenty hands out batches. Returns the state
/// after taking them too.
fn stash_take(
    check: &Check,
    before: &crate::state::State,
    remaining: u64,
    now_ns: u64,
) -> Option<(crate::state::State, u64)> {
    if !matches!(check.limit, Limit::TokenBucket(_) | Limit::Lease(_)) {
        return None;
    }
    let extra = check.batch.min(remaining / 4);
    if extra == 0 {
        return None;
    }
    match check
        .limit
        .decide(before, now_ns, check.cost.saturating_add(extra))
    {
        Decision::Allow { state, .. } => {
            let state = match check.limit {
                Limit::TokenBucket(_) => TokenBucket::with_stash_out(
                    &state,
                    now_ns.saturating_add(crate::stash::STASH_RETURNED_NS),
                ),
                _ => state,
            };
            Some((state, extra))
        }
        _ => None,
    }
}

/// Decide one request against `checks` at `now_ns`, charging every rule or none.
pub fn admit<S: CasStore + ?Sized>(store: &S, checks: &[Check], now_ns: u64) -> Outcome {
    let mut plans: SmallVec<[Plan; INLINE_RULES]> = checks
        .iter()
        .map(|c| plan(store, c, c.table.store_key(c.slot.group), now_ns))
        .collect();

    if let Some(i) = worst_refusal(checks, &plans) {
        return finish(false, Some(i), plans);
    }
    // Claims of refills go out whatever happens to the request (one attempt: if it loses a race,
    // someone else changed the slot and a later request claims).
    for (check, p) in checks.iter().zip(plans.iter_mut()) {
        if matches!(p.outcome.verdict, Verdict::Waiting | Verdict::Fallback) {
            if let Some((group, cas)) = p.write.take() {
                p.outcome.refill = store.write(p.key.as_str(), &group.encode(), cas).is_ok()
                    && check
                        .limit
                        .claims_refill(&p.before, &group.slots[p.index].state);
            }
        }
    }
    let undecided = checks.iter().zip(&plans).any(|(c, p)| {
        c.enforced && matches!(p.outcome.verdict, Verdict::Waiting | Verdict::Fallback)
    });
    if undecided {
        return finish(false, None, plans);
    }

    let mut committed: SmallVec<[usize; INLINE_RULES]> = SmallVec::new();
    for i in 0..checks.len() {
        let check = &checks[i];
        let mut attempts = 0;
        while let (Verdict::Allowed { .. }, Some((group, cas))) =
            (plans[i].outcome.verdict, plans[i].write)
        {
            attempts += 1;
            match store.write(plans[i].key.as_str(), &group.encode(), cas) {
                Ok(()) => {
                    let p = &mut plans[i];
                    p.outcome.refill = check
                        .limit
                        .claims_refill(&p.before, &group.slots[p.index].state);
                    committed.push(i);
                    break;
                }
                Err(StoreError::Unavailable(_)) => {
                    plans[i].outcome.verdict = Verdict::Unavailable;
                    break;
                }
                Err(StoreError::CasMismatch) if attempts >= MAX_CAS_ATTEMPTS => {
                    plans[i].outcome.verdict = Verdict::Contended;
                    plans[i].write = None;
                }
                Err(StoreError::CasMismatch) => {
                    let key = std::mem::take(&mut plans[i].key);
                    plans[i] = plan(store, check, key, now_ns);
                }
            }
        }
        let refused = matches!(
            plans[i].outcome.verdict,
            Verdict::Limited { .. } | Verdict::Contended
        );
        // A lost race re-decided as "no quota yet" (another request spent a leased allowance's
        // last token meanwhile) leaves the request undecided, exactly as if it had been read so.
        let undecided = matches!(
            plans[i].outcome.verdict,
            Verdict::Waiting | Verdict::Fallback
        );
        if (refused || undecided) && check.enforced {
            for &j in &committed {
                let p = &plans[j];
                // A refund that keeps losing races leaves that rule stricter, never looser.
                let _ = give_back(
                    store,
                    checks[j].limit,
                    checks[j].cost.saturating_add(p.outcome.stashed),
                    p.key.as_str(),
                    Target::IndexOwnedBy(p.index, p.owner),
                    now_ns,
                    MAX_CAS_ATTEMPTS,
                );
                plans[j].outcome.stashed = 0;
            }
            if refused {
                return finish(false, Some(i), plans);
            }
            let p = &mut plans[i];
            if let Some((group, cas)) = p.write.take() {
                p.outcome.refill = store.write(p.key.as_str(), &group.encode(), cas).is_ok()
                    && check
                        .limit
                        .claims_refill(&p.before, &group.slots[p.index].state);
            }
            return finish(false, None, plans);
        }
    }
    for &i in &committed {
        if checks[i].limit.is_held() {
            plans[i].outcome.hold = Some(Hold {
                group: checks[i].slot.group,
                index: plans[i].index,
                cost: checks[i].cost,
            });
        }
    }
    finish(true, None, plans)
}

/// Give back what an admitted request held (the end of a request under a concurrency rule).
/// `Err` only if the store failed or every attempt lost a race: the count is then too high.
pub fn release<S: CasStore + ?Sized>(
    store: &S,
    limit: &Limit,
    table: &SlotTable,
    hold: &Hold,
    now_ns: u64,
) -> Result<(), StoreError> {
    give_back(
        store,
        limit,
        hold.cost,
        table.store_key(hold.group).as_str(),
        Target::Index(hold.index),
        now_ns,
        MAX_RELEASE_ATTEMPTS,
    )
}

/// Give back `tokens` a worker stashed for the key tagged `slot.tag` and did not spend, unless
/// its slot has changed hands since. `Err` only if the store failed or every attempt lost a race.
pub fn return_stash<S: CasStore + ?Sized>(
    store: &S,
    limit: &Limit,
    table: &SlotTable,
    slot: SlotId,
    tokens: u64,
    now_ns: u64,
) -> Result<(), StoreError> {
    give_back(
        store,
        limit,
        tokens,
        table.store_key(slot.group).as_str(),
        Target::OwnedBy(slot.tag),
        now_ns,
        MAX_CAS_ATTEMPTS,
    )
}

/// The enforced refusal with the longest wait, if any.
/// What [`admit`] would decide from one read of each check, writing nothing (no claims either):
/// a refusal here is one `admit` would make now.
pub fn preview<S: CasStore + ?Sized>(store: &S, checks: &[Check], now_ns: u64) -> Outcome {
    let plans: SmallVec<[Plan; INLINE_RULES]> = checks
        .iter()
        .map(|c| plan(store, c, c.table.store_key(c.slot.group), now_ns))
        .collect();
    let refused = worst_refusal(checks, &plans);
    finish(refused.is_none(), refused, plans)
}

fn worst_refusal(checks: &[Check], plans: &[Plan]) -> Option<usize> {
    plans
        .iter()
        .enumerate()
        .filter(|(i, _)| checks[*i].enforced)
        .filter_map(|(i, p)| match p.outcome.verdict {
            Verdict::Limited { retry_after_ns, .. } => Some((i, retry_after_ns)),
            _ => None,
        })
        .max_by_key(|(_, wait)| *wait)
        .map(|(i, _)| i)
}

/// The slot of a group that tokens go back to.
#[derive(Clone, Copy)]
enum Target {
    /// This slot, whoever holds it now (a concurrency hold: the count is the slot's, not a key's).
    Index(usize),
    /// This slot, unless it has changed hands since.
    IndexOwnedBy(usize, u64),
    /// The slot this owner tag holds, wherever it is in the group, if any.
    OwnedBy(u64),
}

/// Return `cost` tokens of `limit` to the `target` slot of the group at `key`; nothing if the
/// slot is no longer the owner's.
fn give_back<S: CasStore + ?Sized>(
    store: &S,
    limit: &Limit,
    cost: u64,
    key: &str,
    target: Target,
    now_ns: u64,
    attempts: u32,
) -> Result<(), StoreError> {
    let find = |group: &Group| match target {
        Target::Index(i) => Some(i),
        Target::IndexOwnedBy(i, owner) => (group.slots[i].tag == owner).then_some(i),
        Target::OwnedBy(owner) => group.slots.iter().position(|s| s.tag == owner),
    };
    let refunded = update_slot(store, key, attempts, find, |slot| {
        slot.state = limit.refund(&slot.state, now_ns, cost);
        (true, ())
    });
    match refunded {
        Ok(_) => Ok(()),
        Err(UpdateError::Contended) => Err(StoreError::CasMismatch),
        Err(UpdateError::Unavailable(e)) => Err(StoreError::Unavailable(e)),
    }
}

fn finish(
    admitted: bool,
    rejected_by: Option<usize>,
    plans: SmallVec<[Plan; INLINE_RULES]>,
) -> Outcome {
    Outcome {
        admitted,
        rejected_by,
        checks: plans.into_iter().map(|p| p.outcome).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::concurrency::Concurrency;
    use crate::store::MemoryStore;
    use crate::token_bucket::TokenBucket;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    const SEC: u64 = 1_000_000_000;
    const MS: u64 = 1_000_000;
    const NOW: u64 = 1_700_000_000 * SEC;

    #[derive(Clone)]
    struct Rule {
        limit: Limit,
        table: SlotTable,
    }

    fn rule_with(store: &MemoryStore, name: &str, limit: Limit, slots: u32) -> Rule {
        let table = SlotTable::new(format!("{name}."), slots);
        table.initialize(store).unwrap();
        Rule { limit, table }
    }

    fn rule(store: &MemoryStore, name: &str, requests: u64, burst: u64, slots: u32) -> Rule {
        let tb = TokenBucket::new(requests, 60 * SEC, burst).unwrap();
        rule_with(store, name, Limit::TokenBucket(tb), slots)
    }

    fn check<'a>(r: &'a Rule, key: &str, enforced: bool) -> Check<'a> {
        Check {
            limit: &r.limit,
            table: &r.table,
            slot: r.table.locate(key.as_bytes()),
            cost: 1,
            enforced,
            batch: 0,
            wait_for_stashes: false,
        }
    }

    fn remaining(out: &Outcome) -> u64 {
        match out.checks[0].verdict {
            Verdict::Allowed { remaining, .. } => remaining,
            v => panic!("{v:?}"),
        }
    }

    #[test]
    fn a_refusal_by_one_rule_charges_no_other() {
        let store = MemoryStore::new();
        let wide = rule(&store, "wide", 100, 100, 16);
        let narrow = rule(&store, "narrow", 1, 2, 16);
        let mut admitted = 0;
        for _ in 0..10 {
            let out = admit(
                &store,
                &[check(&wide, "k", true), check(&narrow, "k", true)],
                NOW,
            );
            admitted += u32::from(out.admitted);
            if !out.admitted {
                assert_eq!(out.rejected_by, Some(1));
            }
        }
        assert_eq!(admitted, 2);
        // wide was charged exactly twice: 98 remain, 97 after this one.
        assert_eq!(
            remaining(&admit(&store, &[check(&wide, "k", true)], NOW)),
            97
        );
    }

    #[test]
    fn dry_run_rules_count_but_never_refuse() {
        let store = MemoryStore::new();
        let r = rule(&store, "dry", 1, 3, 16);
        let outcomes: Vec<_> = (0..5)
            .map(|_| admit(&store, &[check(&r, "k", false)], NOW))
            .collect();
        assert!(outcomes.iter().all(|o| o.admitted));
        let limited = outcomes
            .iter()
            .filter(|o| matches!(o.checks[0].verdict, Verdict::Limited { .. }))
            .count();
        assert_eq!(limited, 2);
    }

    #[test]
    fn a_group_holds_four_keys_then_idle_slots_are_taken_over_then_the_freshest_is_evicted() {
        let store = MemoryStore::new();
        let r = rule(&store, "iso", 1, 2, 1); // one group: every key lands in it
        for (n, key) in ["a", "b", "c", "d"].into_iter().enumerate() {
            let out = admit(&store, &[check(&r, key, true)], NOW + n as u64);
            assert!(out.admitted);
            assert_eq!(out.checks[0].slot, SlotEvent::Own);
        }
        // "a" spends its second token: it is being limited now.
        assert!(admit(&store, &[check(&r, "a", true)], NOW + 10).admitted);
        // "e" finds no free or idle slot: it evicts the least recently used of b/c/d (one token
        // spent each), never a, which is being limited.
        let out = admit(&store, &[check(&r, "e", true)], NOW + 20);
        assert_eq!(out.checks[0].slot, SlotEvent::Evicted);
        assert_eq!(remaining(&out), 1, "a fresh bucket");
        assert!(
            !admit(&store, &[check(&r, "a", true)], NOW + 30).admitted,
            "a is still limited"
        );
        // b comes back with a fresh bucket: one more than it would have had (what it spent).
        let out = admit(&store, &[check(&r, "b", true)], NOW + 40);
        assert_eq!(out.checks[0].slot, SlotEvent::Evicted);
        assert_eq!(remaining(&out), 1);
        // Once every bucket is full again, a new key takes a slot over with a fresh bucket.
        let later = NOW + 120 * SEC;
        let out = admit(&store, &[check(&r, "f", true)], later);
        assert_eq!(out.checks[0].slot, SlotEvent::TakenOver);
        assert_eq!(remaining(&out), 1);
        assert_eq!(
            admit(&store, &[check(&r, "f", true)], later).checks[0].slot,
            SlotEvent::Own
        );
    }

    #[test]
    fn limited_keys_are_never_evicted_a_newcomer_shares_the_slot_that_frees_soonest() {
        let store = MemoryStore::new();
        let r = rule(&store, "lim", 1, 1, 1);
        // Four keys, each limited (burst 1 spent, a token a minute), at different times: "a"
        // refills first.
        for (n, key) in ["a", "b", "c", "d"].into_iter().enumerate() {
            assert!(admit(&store, &[check(&r, key, true)], NOW + n as u64 * SEC).admitted);
        }
        let out = admit(&store, &[check(&r, "e", true)], NOW + 5 * SEC);
        assert_eq!(out.checks[0].slot, SlotEvent::Shared);
        assert!(!out.admitted, "the newcomer is held to a's refusal");
        let Verdict::Limited { retry_after_ns, .. } = out.checks[0].verdict else {
            panic!("{out:?}")
        };
        assert_eq!(retry_after_ns, 55 * SEC, "a's token is due at +60 s");
        for key in ["a", "b", "c", "d"] {
            assert!(
                !admit(&store, &[check(&r, key, true)], NOW + 6 * SEC).admitted,
                "{key} kept its state"
            );
        }
        // Once a's token is due, one of a and e gets it: one admission between them, not two.
        let later = NOW + 60 * SEC;
        let both = ["e", "a"]
            .into_iter()
            .filter(|k| admit(&store, &[check(&r, k, true)], later).admitted)
            .count();
        assert_eq!(both, 1);
    }

    #[test]
    fn an_attacker_cannot_reset_their_own_limited_key_by_filling_its_group() {
        // The attack a public hash allowed: three junk keys and the attacker's own, all limited,
        // then a fifth key to force an eviction, again and again. Over 10 minutes on 5 per
        // minute (burst 5) the attacker's key gets at most 5 + 50.
        let store = MemoryStore::new();
        let tb = TokenBucket::new(5, 60 * SEC, 5).unwrap();
        let r = rule_with(&store, "atk", Limit::TokenBucket(tb), 1);
        let mut admitted = 0;
        let mut now = NOW;
        let mut n = 0u64;
        while now < NOW + 600 * SEC {
            // The attacker spends its key until it is refused, the junk keys take every token
            // they get just after (so the attacker's refusal ends soonest), then a fresh key.
            for _ in 0..10 {
                admitted += u64::from(admit(&store, &[check(&r, "attacker", true)], now).admitted);
            }
            for junk in ["j1", "j2", "j3"] {
                for _ in 0..10 {
                    admit(&store, &[check(&r, junk, true)], now + MS);
                }
            }
            n += 1;
            admit(
                &store,
                &[check(&r, &format!("fresh{n}"), true)],
                now + 2 * MS,
            );
            now += SEC / 10;
        }
        assert!(admitted <= 55, "admitted {admitted}");
    }

    #[test]
    fn concurrency_slots_in_flight_are_shared_never_taken_over() {
        let store = MemoryStore::new();
        let limit = Limit::Concurrency(Concurrency::new(2).unwrap());
        let r = rule_with(&store, "cc", limit, 1);
        for key in ["a", "b", "c", "d"] {
            assert!(admit(&store, &[check(&r, key, true)], NOW).admitted);
        }
        let out = admit(&store, &[check(&r, "e", true)], NOW);
        assert_eq!(out.checks[0].slot, SlotEvent::Shared);
        assert!(out.admitted);
        // The shared slot counts both: its key has one slot left no more.
        let full = ["a", "b", "c", "d"]
            .into_iter()
            .filter(|k| !admit(&store, &[check(&r, k, true)], NOW).admitted)
            .count();
        assert_eq!(full, 1);
    }

    /// Admissions a key could have had: `burst` at once, the rate since its first request, and
    /// what it had spent each time its slot was evicted.
    struct KeyLedger {
        first_ns: u64,
        admitted: u64,
        bonus: u64,
    }

    proptest::proptest! {
        #[test]
        fn evictions_give_a_key_at_most_what_it_had_spent(
            steps in proptest::collection::vec((0u8..8, 0u64..3_000_000_000), 1..200),
            burst in 1u64..6,
            requests in 1u64..4,
        ) {
            let store = MemoryStore::new();
            let tb = TokenBucket::new(requests, 10 * SEC, burst).unwrap();
            let r = rule_with(&store, "p", Limit::TokenBucket(tb), 1);
            let key = r.table.store_key(0);
            let mut ledger: std::collections::HashMap<u8, KeyLedger> = Default::default();
            let mut now = NOW;
            for (k, gap) in steps {
                now += gap;
                let name = format!("k{k}");
                let c = check(&r, &name, true);
                let before = Group::decode(&store.read(key.as_str()).unwrap().unwrap().0);
                let out = admit(&store, &[c], now);
                let entry = ledger.entry(k).or_insert(KeyLedger { first_ns: now, admitted: 0, bonus: 0 });
                entry.admitted += u64::from(out.admitted);
                if out.checks[0].slot == SlotEvent::Evicted {
                    let after = Group::decode(&store.read(key.as_str()).unwrap().unwrap().0);
                    let i = (0..WAYS).find(|&i| after.slots[i].tag == c.slot.tag).unwrap();
                    let victim = before.slots[i];
                    let standings: Vec<Standing> =
                        before.slots.iter().map(|s| r.limit.standing(&s.state, now)).collect();
                    let v = standings[i];
                    // Never a limited key while another is not; never one further from fresh.
                    proptest::prop_assert!(!v.limited || standings.iter().all(|s| s.limited));
                    for s in &standings {
                        if s.limited == v.limited {
                            proptest::prop_assert!(v.spent <= s.spent);
                        }
                    }
                    let victim_key = (0u8..8).find(|k| check(&r, &format!("k{k}"), true).slot.tag == victim.tag);
                    if let Some(vk) = victim_key {
                        ledger.entry(vk).or_insert(KeyLedger { first_ns: now, admitted: 0, bonus: 0 }).bonus += v.spent;
                    }
                }
                for l in ledger.values() {
                    let rate = u128::from(now - l.first_ns) * u128::from(requests) / u128::from(10 * SEC);
                    proptest::prop_assert!(
                        u128::from(l.admitted) <= u128::from(burst + l.bonus) + rate,
                        "admitted {} > burst {burst} + bonus {} + rate {rate}", l.admitted, l.bonus
                    );
                }
            }
        }
    }

    /// A store in which the next `losses` writes to one rule's groups lose a race to another
    /// request of key "k" that spends its quota first.
    struct RacingStore {
        inner: MemoryStore,
        losses: AtomicU32,
        racer: std::sync::Mutex<Rule>,
    }

    impl CasStore for RacingStore {
        fn read(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
            self.inner.read(key)
        }
        fn write(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
            let racer = self.racer.lock().unwrap().clone();
            if key.starts_with(racer.table.prefix()) && self.losses.load(Ordering::SeqCst) > 0 {
                self.losses.fetch_sub(1, Ordering::SeqCst);
                let (bytes, c) = self.inner.read(key)?.unwrap_or_default();
                let mut group = Group::decode(&bytes);
                let tag = check(&racer, "k", true).slot.tag;
                let (i, _, slot) = choose(&racer.limit, &group, tag, NOW);
                if let Decision::Allow { state, .. } = racer.limit.decide(&slot.state, NOW, 1) {
                    group.slots[i] = Slot { state, ..slot };
                }
                self.inner.write(key, &group.encode(), c)?;
            }
            self.inner.write(key, value, cas)
        }
    }

    #[test]
    fn a_lost_race_is_retried_and_a_refusal_found_then_refunds_the_others() {
        let inner = MemoryStore::new();
        let a = rule(&inner, "a", 1, 10, 4);
        let b = rule(&inner, "b", 1, 3, 4);
        let store = RacingStore {
            inner,
            losses: AtomicU32::new(2),
            racer: std::sync::Mutex::new(a.clone()),
        };
        // Two lost races on "a", then success: the racers' 2 tokens and ours are gone.
        assert!(admit(&store, &[check(&a, "k", true)], NOW).admitted);
        assert_eq!(
            remaining(&admit(&store, &[check(&a, "k", true)], NOW)),
            10 - 4
        );
        // "b" has 3 tokens; our write loses to racers until they are gone: re-decided as limited,
        // and "a", already charged, is refunded.
        *store.racer.lock().unwrap() = b.clone();
        store.losses.store(100, Ordering::SeqCst);
        let out = admit(&store, &[check(&a, "k", true), check(&b, "k", true)], NOW);
        assert!(!out.admitted);
        assert_eq!(out.rejected_by, Some(1));
        store.losses.store(0, Ordering::SeqCst);
        assert_eq!(
            remaining(&admit(&store, &[check(&a, "k", true)], NOW)),
            10 - 5
        );
    }

    #[test]
    fn a_race_lost_to_the_last_leased_token_leaves_the_request_undecided() {
        use crate::allowance::LeaseAllowance;
        let inner = MemoryStore::new();
        let a = rule(&inner, "a", 1, 10, 4);
        let lease = LeaseAllowance {
            lease_size: 10,
            low_water: 5,
            claim_ms: 200,
            global_burst: 0,
            global_interval_ns: 0,
            global_rate_mtps: 0,
        };
        let g = rule_with(&inner, "g", Limit::Lease(lease), 4);
        // Key "k" holds one leased token.
        let slot = check(&g, "k", true).slot;
        let key = g.table.store_key(slot.group);
        let (bytes, cas) = inner.read(key.as_str()).unwrap().unwrap();
        let mut group = Group::decode(&bytes);
        group.slots[0] = Slot {
            tag: slot.tag,
            last_ns: 0,
            state: lease.with_tokens(&[0; crate::state::STATE_BYTES], NOW / 1_000_000, 1, 10_000),
        };
        inner.write(key.as_str(), &group.encode(), cas).unwrap();
        // Our write of "g" loses to another request that spends that last token.
        let store = RacingStore {
            inner,
            losses: AtomicU32::new(1),
            racer: std::sync::Mutex::new(g.clone()),
        };
        let out = admit(&store, &[check(&a, "k", true), check(&g, "k", true)], NOW);
        assert!(!out.admitted, "no token left: not admitted");
        assert_eq!(
            out.rejected_by, None,
            "undecided: the caller waits for quota"
        );
        assert_eq!(out.checks[1].verdict, Verdict::Waiting);
        // "a", charged before the race was lost, was given back.
        store.losses.store(0, Ordering::SeqCst);
        assert_eq!(remaining(&admit(&store, &[check(&a, "k", true)], NOW)), 9);
    }

    #[test]
    fn contention_exhaustion_refuses() {
        let inner = MemoryStore::new();
        let a = rule(&inner, "a", 1, 1_000, 4);
        let store = RacingStore {
            inner,
            losses: AtomicU32::new(1_000),
            racer: std::sync::Mutex::new(a.clone()),
        };
        let out = admit(&store, &[check(&a, "k", true)], NOW);
        assert!(!out.admitted);
        assert_eq!(out.checks[0].verdict, Verdict::Contended);
    }

    #[test]
    fn threads_sharing_one_store_admit_exactly_the_burst() {
        let store = Arc::new(MemoryStore::new());
        let r = Arc::new(rule(&store, "t", 1, 100, 8));
        let admitted = Arc::new(AtomicU32::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (store, r, admitted) = (store.clone(), r.clone(), admitted.clone());
                std::thread::spawn(move || {
                    for _ in 0..50 {
                        if admit(&*store, &[check(&r, "hot", true)], NOW).admitted {
                            admitted.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(admitted.load(Ordering::SeqCst), 100);
    }

    #[test]
    fn concurrency_holds_until_released_and_counts_return_to_zero_under_contention() {
        let store = Arc::new(MemoryStore::new());
        let c = Limit::Concurrency(Concurrency::new(3).unwrap());
        let r = Arc::new(rule_with(&store, "c", c, 4));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (store, r) = (store.clone(), r.clone());
                std::thread::spawn(move || {
                    let mut admitted = 0;
                    for _ in 0..200 {
                        let out = admit(&*store, &[check(&r, "k", true)], NOW);
                        if out.admitted {
                            admitted += 1;
                            let hold = out.checks[0].hold.expect("held");
                            release(&*store, &r.limit, &r.table, &hold, NOW).unwrap();
                        }
                    }
                    admitted
                })
            })
            .collect();
        let admitted: u32 = threads.into_iter().map(|t| t.join().unwrap()).sum();
        assert!(admitted > 0);
        let group = Group::decode(&store.read("c.0").unwrap().unwrap().0);
        assert!(group
            .slots
            .iter()
            .all(|s| Concurrency::in_flight(&s.state) == 0));
        // And while held, the limit is exact.
        let holds: Vec<_> = (0..5)
            .filter_map(|_| admit(&*store, &[check(&r, "k", true)], NOW).checks[0].hold)
            .collect();
        assert_eq!(holds.len(), 3);
    }

    #[test]
    fn a_key_waiting_for_its_first_lease_is_evicted_last() {
        use crate::allowance::LeaseAllowance;
        let store = MemoryStore::new();
        let lease = LeaseAllowance {
            lease_size: 2,
            low_water: 0,
            claim_ms: 1_000,
            global_burst: 0,
            global_interval_ns: 0,
            global_rate_mtps: 0,
        };
        let r = rule_with(&store, "g", Limit::Lease(lease), 1); // one group of four
        let key = r.table.store_key(0);
        let now_ms = NOW / MS;
        // Three keys served (a token left each), then "new" claims its first lease and waits.
        for (n, k) in ["a", "b", "c"].into_iter().enumerate() {
            assert_eq!(
                admit(&store, &[check(&r, k, true)], NOW).checks[0].verdict,
                Verdict::Waiting
            );
            let (bytes, cas) = store.read(key.as_str()).unwrap().unwrap();
            let mut group = Group::decode(&bytes);
            group.slots[n].state = lease.with_tokens(&group.slots[n].state, now_ms, 2, 60_000);
            store.write(key.as_str(), &group.encode(), cas).unwrap();
            assert!(admit(&store, &[check(&r, k, true)], NOW + MS).admitted);
        }
        let waiting = admit(&store, &[check(&r, "new", true)], NOW + 2 * MS);
        assert!(waiting.checks[0].refill);
        // Another new key evicts a served key, not the one whose first lease is on its way:
        // evicting it would lose the call's grant, and its request would wait again.
        for (n, k) in ["x", "y"].into_iter().enumerate() {
            let out = admit(&store, &[check(&r, k, true)], NOW + (3 + n as u64) * MS);
            assert_eq!(out.checks[0].slot, SlotEvent::Evicted);
            let (bytes, _) = store.read(key.as_str()).unwrap().unwrap();
            let tag = r.table.locate(b"new").tag;
            assert!(
                Group::decode(&bytes).slots.iter().any(|s| s.tag == tag),
                "{k}"
            );
        }
    }

    #[test]
    fn global_rules_wait_for_a_claimed_refill_without_charging_the_others() {
        use crate::allowance::LeaseAllowance;
        let store = MemoryStore::new();
        let local = rule(&store, "local", 1, 100, 4);
        let lease = LeaseAllowance {
            lease_size: 4,
            low_water: 2,
            claim_ms: 1_000,
            global_burst: 0,
            global_interval_ns: 0,
            global_rate_mtps: 0,
        };
        let global = rule_with(&store, "global", Limit::Lease(lease), 4);
        let both = |store: &MemoryStore| {
            admit(
                store,
                &[check(&local, "k", true), check(&global, "k", true)],
                NOW,
            )
        };
        let first = both(&store);
        assert!(!first.admitted && first.rejected_by.is_none());
        assert_eq!(first.checks[1].verdict, Verdict::Waiting);
        assert!(
            first.checks[1].refill,
            "the first request claims the refill"
        );
        let second = both(&store);
        assert_eq!(second.checks[1].verdict, Verdict::Waiting);
        assert!(!second.checks[1].refill, "one refill in flight per key");
        // The grant arrives (as the filter applies it).
        let key = global.table.store_key(check(&global, "k", true).slot.group);
        let (bytes, cas) = store.read(key.as_str()).unwrap().unwrap();
        let mut group = Group::decode(&bytes);
        for slot in group.slots.iter_mut().filter(|s| s.tag != 0) {
            slot.state = lease.with_tokens(&slot.state, NOW / 1_000_000, 4, 60_000);
        }
        store.write(key.as_str(), &group.encode(), cas).unwrap();
        let refills: Vec<bool> = (0..4)
            .map(|_| {
                let out = both(&store);
                assert!(out.admitted);
                out.checks[1].refill
            })
            .collect();
        // 4 tokens: below the low-water mark of 2 after the third, which claims the next refill.
        assert_eq!(refills, [false, false, true, false]);
        assert_eq!(both(&store).checks[1].verdict, Verdict::Waiting);
        // The local rule was charged for the 4 admitted requests only.
        assert_eq!(
            remaining(&admit(&store, &[check(&local, "k", true)], NOW)),
            95
        );
    }
}
