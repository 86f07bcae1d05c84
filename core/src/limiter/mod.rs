//! All-or-nothing admission of one request against every rule that applies to it.
//!
//! Phase one reads each rule's slot and decides; if an enforced rule refuses, nothing is written
//! (a 429 storm costs reads only). Phase two writes each decision with CAS; a lost race re-reads and
//! re-decides, and a refusal found then gives back what earlier rules already took.

use crate::algorithm::Limit;
use crate::slot::{update_slot, Group, Slot, SlotId, SlotTable, StoreKey};
use crate::state::Decision;
use crate::store::{CasStore, StoreError, UpdateError};
use smallvec::SmallVec;

mod batch;
mod eviction;
#[cfg(test)]
mod tests;

use batch::{stash_take, stashes_may_return};
use eviction::choose;

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
    Admitted {
        remaining: u64,
        reset_ns: u64,
        /// Hold the request this long before passing it on (leaky bucket).
        delay_ns: u64,
    },
    /// The rule refuses (or, for a dry-run rule, would refuse).
    Refused {
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
    /// False with no `refused_by` when an enforced check is `Waiting` or `Fallback`.
    pub admitted: bool,
    /// Index of the enforced check that refused the request (the longest wait if several did).
    pub refused_by: Option<usize>,
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
    /// The result of `write`, where the read that planned it wrote it too ([`plan_and_write`]).
    written: Option<Result<(), StoreError>>,
}

fn plan<S: CasStore + ?Sized>(store: &S, check: &Check, key: StoreKey, now_ns: u64) -> Plan {
    // (Decoded in place: a group returned through the read's result is copied twice more.)
    let mut group = Group::decode(&[]);
    let read = store.read_with(key.as_str(), |found| {
        found.map_or(0, |(bytes, cas)| {
            group.decode_from(bytes);
            cas
        })
    });
    let mut p = unavailable(key);
    if let Ok(cas) = read {
        plan_group(check, &group, cas, now_ns, &mut p);
    }
    p
}

/// [`plan`] into `out` (made by [`unavailable`] with the check's key), with what it plans to
/// write written by the same store call: one attempt of the read-modify-write, as
/// [`commit_plans`] makes it of a request's only check.
fn plan_and_write<S: CasStore + ?Sized>(store: &S, check: &Check, out: &mut Plan, now_ns: u64) {
    // (The plan made where it stays and the bytes written from a buffer of the caller's: a plan
    // returned through the store's call is copied at every level.)
    let key = std::mem::take(&mut out.key);
    let mut bytes = crate::slot::EMPTY_GROUP;
    let buf = &mut bytes;
    let read = store.read_then_write(key.as_str(), |found| {
        let buf = buf;
        let mut group = Group::decode(&[]);
        let cas = found.map_or(0, |(bytes, cas)| {
            group.decode_from(bytes);
            cas
        });
        plan_group(check, &group, cas, now_ns, out);
        let write = out.write.as_ref().map(|(next, _)| {
            next.encode_into(buf);
            &buf[..]
        });
        (write, ())
    });
    match read {
        Ok(((), written)) => out.written = written,
        Err(_) => *out = unavailable(StoreKey::default()),
    }
    out.key = key;
}

/// The plan of a check whose read failed.
fn unavailable(key: StoreKey) -> Plan {
    Plan {
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
        written: None,
    }
}

/// The decision on `check` from its slot `group` as read at version `cas`, into `out` (whose key
/// stays).
fn plan_group(check: &Check, group: &Group, cas: u32, now_ns: u64, out: &mut Plan) {
    let (index, slot, current) = choose(check.limit, group, check.slot.tag, now_ns);
    let owner = current.tag;
    let mut stashed = 0;
    let claim_write = |state| {
        let mut next = *group;
        next.slots[index] = Slot {
            tag: owner,
            last_ns: current.last_ns,
            state,
        };
        (next, cas)
    };
    let (verdict, write) = match check.limit.decide(&current.state, now_ns, check.cost) {
        Decision::Admit {
            mut state,
            remaining,
            reset_ns,
            delay_ns,
        } => {
            if let Some((more, taken)) = stash_take(check, &current.state, remaining, now_ns) {
                (state, stashed) = (more, taken);
            }
            let mut next = *group;
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
                Verdict::Admitted {
                    remaining,
                    reset_ns,
                    delay_ns,
                },
                Some((next, cas)),
            )
        }
        Decision::Refuse { .. } if stashes_may_return(check, &current.state, now_ns) => {
            (Verdict::Waiting, None)
        }
        Decision::Refuse {
            retry_after_ns,
            remaining,
            reset_ns,
        } => (
            Verdict::Refused {
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
    out.outcome = CheckOutcome {
        verdict,
        slot,
        hold: None,
        refill: false,
        stashed,
    };
    (out.index, out.owner, out.before) = (index, owner, current.state);
    out.write = write;
    out.written = None;
}

/// A plan for each check, from one read each, pushed into the caller's `plans` (returned, the
/// inline vector of plans — over a KiB — would be moved).
fn plan_each<S: CasStore + ?Sized>(
    store: &S,
    checks: &[Check],
    now_ns: u64,
    plans: &mut SmallVec<[Plan; INLINE_RULES]>,
) {
    for c in checks {
        plans.push(plan(store, c, c.table.store_key(c.slot.group), now_ns));
    }
}

/// Decide one request against `checks` at `now_ns`, charging every rule or none.
pub fn admit<S: CasStore + ?Sized>(store: &S, checks: &[Check], now_ns: u64) -> Outcome {
    // (One check, the usual request: its plan in place, not moved into a vector of them.)
    if let [c] = checks {
        let mut plans = [unavailable(c.table.store_key(c.slot.group))];
        plan_and_write(store, c, &mut plans[0], now_ns);
        return commit_plans(store, checks, now_ns, &mut plans);
    }
    let mut plans = SmallVec::new();
    plan_each(store, checks, now_ns, &mut plans);
    commit_plans(store, checks, now_ns, &mut plans)
}

/// [`admit`] from a plan for each check: refuse, wait or write them all.
fn commit_plans<S: CasStore + ?Sized>(
    store: &S,
    checks: &[Check],
    now_ns: u64,
    plans: &mut [Plan],
) -> Outcome {
    if let Some(i) = worst_refusal(checks, plans) {
        return finish(false, Some(i), plans);
    }
    // Claims of refills go out whatever happens to the request (one attempt: if it loses a race,
    // someone else changed the slot and a later request claims).
    for (check, p) in checks.iter().zip(plans.iter_mut()) {
        if matches!(p.outcome.verdict, Verdict::Waiting | Verdict::Fallback) {
            if let Some((group, cas)) = p.write.take() {
                p.outcome.refill = write_planned(store, &p.key, &mut p.written, &group, cas)
                    .is_ok()
                    && check
                        .limit
                        .claims_refill(&p.before, &group.slots[p.index].state);
            }
        }
    }
    let undecided = checks.iter().zip(plans.iter()).any(|(c, p)| {
        c.enforced && matches!(p.outcome.verdict, Verdict::Waiting | Verdict::Fallback)
    });
    if undecided {
        return finish(false, None, plans);
    }

    let mut committed: SmallVec<[usize; INLINE_RULES]> = SmallVec::new();
    for i in 0..checks.len() {
        let check = &checks[i];
        let mut attempts = 0;
        loop {
            let p = &mut plans[i];
            // (The plan's group by reference: a copy of it each time round costs more than the loop.)
            let (Verdict::Admitted { .. }, Some((group, cas))) = (p.outcome.verdict, &p.write)
            else {
                break;
            };
            attempts += 1;
            match write_planned(store, &p.key, &mut p.written, group, *cas) {
                Ok(()) => {
                    p.outcome.refill = check
                        .limit
                        .claims_refill(&p.before, &group.slots[p.index].state);
                    committed.push(i);
                    break;
                }
                Err(StoreError::Unavailable(_)) => {
                    p.outcome.verdict = Verdict::Unavailable;
                    break;
                }
                Err(StoreError::CasMismatch) if attempts >= MAX_CAS_ATTEMPTS => {
                    p.outcome.verdict = Verdict::Contended;
                    p.write = None;
                }
                Err(StoreError::CasMismatch) => {
                    let key = std::mem::take(&mut p.key);
                    *p = plan(store, check, key, now_ns);
                }
            }
        }
        let refused = matches!(
            plans[i].outcome.verdict,
            Verdict::Refused { .. } | Verdict::Contended
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
                p.outcome.refill = write_planned(store, &p.key, &mut p.written, &group, cas)
                    .is_ok()
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

/// Write a plan's `group` to `key` at version `cas`, unless the read that planned it did already
/// (`written`, its result, taken).
fn write_planned<S: CasStore + ?Sized>(
    store: &S,
    key: &StoreKey,
    written: &mut Option<Result<(), StoreError>>,
    group: &Group,
    cas: u32,
) -> Result<(), StoreError> {
    match written.take() {
        Some(written) => written,
        None => store.write(key.as_str(), &group.encode(), cas),
    }
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

/// What a settlement did to its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Settled {
    /// Tokens it put the key into debt by.
    pub debt: u64,
    /// It claimed a call (a leased allowance that owes: the writer sends it with its next tick).
    pub claimed: bool,
}

/// Settle a request that reserved `reserved` of `limit` in the key tagged `slot.tag` and turned
/// out to cost `actual` ([`Limit::settle`]); nothing if the slot has changed hands since.
/// `Err` only if the store failed or every attempt lost a race.
pub fn settle<S: CasStore + ?Sized>(
    store: &S,
    limit: &Limit,
    table: &SlotTable,
    slot: SlotId,
    (reserved, actual): (u64, u64),
    now_ns: u64,
) -> Result<Settled, StoreError> {
    let key = table.store_key(slot.group);
    let find = |group: &Group| group.slots.iter().position(|s| s.tag == slot.tag);
    let settled = update_slot(store, key.as_str(), MAX_RELEASE_ATTEMPTS, find, |s| {
        let before = s.state;
        s.state = limit.settle(&before, now_ns, reserved, actual);
        let debt = limit
            .debt(&s.state, now_ns)
            .saturating_sub(limit.debt(&before, now_ns));
        let claimed = limit.claims_refill(&before, &s.state);
        (true, Settled { debt, claimed })
    });
    match settled {
        Ok(found) => Ok(found.unwrap_or_default()),
        Err(UpdateError::Contended) => Err(StoreError::CasMismatch),
        Err(UpdateError::Unavailable(e)) => Err(StoreError::Unavailable(e)),
    }
}

/// Charge `bytes` a stream of the key tagged `slot.tag` is about to pass on to the key's byte
/// bucket (`limit`, a token bucket of bytes), taking the key a slot of its group as a request
/// would; returns how long (ns) to hold them first ([`TokenBucket::pace`]). `Err` only if the
/// store failed or every attempt lost a race.
///
/// [`TokenBucket::pace`]: crate::local::token_bucket::TokenBucket::pace
pub fn pace<S: CasStore + ?Sized>(
    store: &S,
    limit: &Limit,
    table: &SlotTable,
    slot: SlotId,
    bytes: u64,
    now_ns: u64,
) -> Result<u64, StoreError> {
    let Limit::TokenBucket(bucket) = limit else {
        return Ok(0);
    };
    let key = table.store_key(slot.group);
    let paced = crate::store::update(store, key.as_str(), MAX_CAS_ATTEMPTS, |bytes_read| {
        let group = Group::decode(bytes_read.unwrap_or_default());
        let (index, _, current) = choose(limit, &group, slot.tag, now_ns);
        let (state, wait) = bucket.pace(&current.state, now_ns, bytes);
        let mut next = group;
        next.slots[index] = Slot {
            tag: current.tag,
            last_ns: now_ns,
            state,
        };
        (Some(next.encode()), wait)
    });
    match paced {
        Ok(wait) => Ok(wait),
        Err(UpdateError::Contended) => Err(StoreError::CasMismatch),
        Err(UpdateError::Unavailable(e)) => Err(StoreError::Unavailable(e)),
    }
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
    let mut plans = SmallVec::new();
    plan_each(store, checks, now_ns, &mut plans);
    let refused = worst_refusal(checks, &plans);
    finish(refused.is_none(), refused, &plans)
}

fn worst_refusal(checks: &[Check], plans: &[Plan]) -> Option<usize> {
    plans
        .iter()
        .enumerate()
        .filter(|(i, _)| checks[*i].enforced)
        .filter_map(|(i, p)| match p.outcome.verdict {
            Verdict::Refused { retry_after_ns, .. } => Some((i, retry_after_ns)),
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

fn finish(admitted: bool, refused_by: Option<usize>, plans: &[Plan]) -> Outcome {
    Outcome {
        admitted,
        refused_by,
        checks: plans.iter().map(|p| p.outcome).collect(),
    }
}
