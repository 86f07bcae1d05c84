//! All-or-nothing admission of one request against every rule that applies to it.
//!
//! Phase one reads each rule's slot and decides; if an enforced rule refuses, nothing is written
//! (a 429 storm costs reads only). Phase two writes each decision with CAS; a lost race re-reads and
//! re-decides, and a refusal found then gives back what earlier rules already took.

use crate::slot::{SlotId, SlotTable};
use crate::store::{CasStore, StoreError};
use crate::token_bucket::{Decision, TokenBucket};

/// Writes tried per slot before the request is treated as refused by contention.
pub const MAX_CAS_ATTEMPTS: u32 = 16;

/// Bytes of a token-bucket slot: owner tag (u64 LE), then TAT (u128 LE).
pub const SLOT_BYTES: usize = 24;

/// The value every slot starts with: no owner, a full bucket.
pub const EMPTY_SLOT: [u8; SLOT_BYTES] = [0; SLOT_BYTES];

/// One rule's part in a request.
#[derive(Debug, Clone, Copy)]
pub struct Check<'a> {
    pub bucket: &'a TokenBucket,
    pub table: &'a SlotTable,
    pub slot: SlotId,
    pub cost: u64,
    /// False for dry-run rules: they count and report, never refuse.
    pub enforced: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Allowed {
        remaining: u64,
        reset_ns: u64,
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
}

/// What the request found in its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotEvent {
    /// The slot already held this key, or was never used.
    Own,
    /// The slot held another key whose bucket was full again: it is this key's now (lossless).
    TakenOver,
    /// The slot holds another key that is still active: both share one bucket (stricter).
    Shared,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckOutcome {
    pub verdict: Verdict,
    pub slot: SlotEvent,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub admitted: bool,
    /// Index of the enforced check that refused the request (the longest wait if several did).
    pub rejected_by: Option<usize>,
    /// One per check, in order.
    pub checks: Vec<CheckOutcome>,
}

#[derive(Debug, Clone, Copy)]
struct SlotState {
    tag: u64,
    tat: u128,
}

impl SlotState {
    fn decode(bytes: &[u8]) -> Self {
        // Anything that is not a slot of ours (absent, other layout) reads as an empty slot.
        let tag = bytes
            .get(0..8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes);
        let tat = bytes
            .get(8..24)
            .and_then(|b| b.try_into().ok())
            .map(u128::from_le_bytes);
        match (tag, tat) {
            (Some(tag), Some(tat)) if bytes.len() == SLOT_BYTES => Self { tag, tat },
            _ => Self { tag: 0, tat: 0 },
        }
    }

    fn encode(&self) -> [u8; SLOT_BYTES] {
        let mut out = [0; SLOT_BYTES];
        out[..8].copy_from_slice(&self.tag.to_le_bytes());
        out[8..].copy_from_slice(&self.tat.to_le_bytes());
        out
    }
}

/// A decision made from one read, with what to write if the request goes ahead.
struct Plan {
    key: String,
    outcome: CheckOutcome,
    write: Option<(SlotState, u32)>,
}

fn plan<S: CasStore + ?Sized>(store: &S, check: &Check, key: String, now_ns: u64) -> Plan {
    let (state, cas) = match store.read(&key) {
        Ok(Some((bytes, cas))) => (SlotState::decode(&bytes), cas),
        Ok(None) => (SlotState::decode(&[]), 0),
        Err(_) => {
            return Plan {
                key,
                outcome: CheckOutcome {
                    verdict: Verdict::Unavailable,
                    slot: SlotEvent::Own,
                },
                write: None,
            }
        }
    };
    let (slot, owner, tat) = if state.tag == check.slot.tag || state.tag == 0 {
        (SlotEvent::Own, check.slot.tag, state.tat)
    } else if check.bucket.is_full(state.tat, now_ns) {
        (SlotEvent::TakenOver, check.slot.tag, 0)
    } else {
        (SlotEvent::Shared, state.tag, state.tat)
    };
    let (verdict, write) = match check.bucket.decide(tat, now_ns, check.cost) {
        Decision::Allow {
            tat,
            remaining,
            reset_ns,
        } => (
            Verdict::Allowed {
                remaining,
                reset_ns,
            },
            Some((SlotState { tag: owner, tat }, cas)),
        ),
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
    };
    Plan {
        key,
        outcome: CheckOutcome { verdict, slot },
        write,
    }
}

/// Decide one request against `checks` at `now_ns`, charging every rule or none.
pub fn admit<S: CasStore + ?Sized>(store: &S, checks: &[Check], now_ns: u64) -> Outcome {
    let mut plans: Vec<Plan> = checks
        .iter()
        .map(|c| plan(store, c, c.table.store_key(c.slot.index), now_ns))
        .collect();

    if let Some(i) = worst_refusal(checks, &plans) {
        return finish(false, Some(i), plans);
    }

    let mut committed: Vec<(usize, u64)> = Vec::with_capacity(checks.len());
    for i in 0..checks.len() {
        let check = &checks[i];
        let mut attempts = 0;
        while let Some((state, cas)) = plans[i].write {
            attempts += 1;
            match store.write(&plans[i].key, &state.encode(), cas) {
                Ok(()) => {
                    committed.push((i, state.tag));
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
        if refused && check.enforced {
            refund(store, checks, &plans, &committed);
            return finish(false, Some(i), plans);
        }
    }
    finish(true, None, plans)
}

/// The enforced refusal with the longest wait, if any.
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

/// Give back the tokens that committed checks took, unless their slot has changed hands since.
fn refund<S: CasStore + ?Sized>(
    store: &S,
    checks: &[Check],
    plans: &[Plan],
    committed: &[(usize, u64)],
) {
    for &(i, tag) in committed {
        for _ in 0..MAX_CAS_ATTEMPTS {
            let Ok(Some((bytes, cas))) = store.read(&plans[i].key) else {
                break;
            };
            let mut state = SlotState::decode(&bytes);
            if state.tag != tag {
                break;
            }
            state.tat = checks[i].bucket.refund(state.tat, checks[i].cost);
            if store.write(&plans[i].key, &state.encode(), cas) != Err(StoreError::CasMismatch) {
                break;
            }
        }
    }
}

fn finish(admitted: bool, rejected_by: Option<usize>, plans: Vec<Plan>) -> Outcome {
    Outcome {
        admitted,
        rejected_by,
        checks: plans.into_iter().map(|p| p.outcome).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    const SEC: u64 = 1_000_000_000;
    const NOW: u64 = 1_700_000_000 * SEC;

    struct Rule {
        bucket: TokenBucket,
        table: SlotTable,
    }

    fn rule(store: &MemoryStore, name: &str, requests: u64, burst: u64, slots: u32) -> Rule {
        let table = SlotTable::new(format!("{name}."), slots);
        table.initialize(store, &EMPTY_SLOT).unwrap();
        Rule {
            bucket: TokenBucket::new(requests, 60 * SEC, burst).unwrap(),
            table,
        }
    }

    fn check<'a>(r: &'a Rule, key: &str, enforced: bool) -> Check<'a> {
        Check {
            bucket: &r.bucket,
            table: &r.table,
            slot: r.table.locate(key.as_bytes()),
            cost: 1,
            enforced,
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
        // wide was charged exactly twice: 98 remain.
        match admit(&store, &[check(&wide, "k", true)], NOW).checks[0].verdict {
            Verdict::Allowed { remaining, .. } => assert_eq!(remaining, 97),
            v => panic!("{v:?}"),
        }
    }

    #[test]
    fn dry_run_rules_count_but_never_refuse() {
        let store = MemoryStore::new();
        let r = rule(&store, "dry", 1, 3, 16);
        let verdicts: Vec<_> = (0..5)
            .map(|_| admit(&store, &[check(&r, "k", false)], NOW))
            .collect();
        assert!(verdicts.iter().all(|o| o.admitted));
        let limited = verdicts
            .iter()
            .filter(|o| matches!(o.checks[0].verdict, Verdict::Limited { .. }))
            .count();
        assert_eq!(limited, 2);
    }

    #[test]
    fn keys_in_different_slots_are_isolated_and_a_full_slot_is_taken_over() {
        let store = MemoryStore::new();
        let r = rule(&store, "iso", 1, 1, 1); // one slot: every key lands on it
        assert!(admit(&store, &[check(&r, "a", true)], NOW).admitted);
        // "b" finds "a" active: they share (stricter), so "b" is refused.
        let out = admit(&store, &[check(&r, "b", true)], NOW);
        assert!(!out.admitted);
        assert_eq!(out.checks[0].slot, SlotEvent::Shared);
        // Once "a"'s bucket is full again, "b" takes the slot over with a fresh bucket.
        let later = NOW + 60 * SEC;
        let out = admit(&store, &[check(&r, "b", true)], later);
        assert!(out.admitted);
        assert_eq!(out.checks[0].slot, SlotEvent::TakenOver);
        assert_eq!(
            admit(&store, &[check(&r, "b", true)], later).checks[0].slot,
            SlotEvent::Own
        );
    }

    /// A store that makes the next `losses` writes to slots of one rule (`prefix`) lose a race to
    /// another writer who spends a token of that rule's `bucket` first.
    struct RacingStore {
        inner: MemoryStore,
        losses: AtomicU32,
        prefix: &'static str,
        bucket: TokenBucket,
    }

    impl CasStore for RacingStore {
        fn read(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
            self.inner.read(key)
        }
        fn write(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
            if key.starts_with(self.prefix) && self.losses.load(Ordering::SeqCst) > 0 {
                self.losses.fetch_sub(1, Ordering::SeqCst);
                let (bytes, c) = self.inner.read(key)?.unwrap_or_default();
                let mut s = SlotState::decode(&bytes);
                if let Decision::Allow { tat, .. } = self.bucket.decide(s.tat, NOW, 1) {
                    s.tat = tat;
                }
                self.inner.write(key, &s.encode(), c)?;
            }
            self.inner.write(key, value, cas)
        }
    }

    #[test]
    fn a_lost_race_is_retried_and_exhaustion_refuses_with_refund() {
        let inner = MemoryStore::new();
        let a = rule(&inner, "a", 1, 10, 4);
        let b = rule(&inner, "b", 1, 3, 4);
        let mut store = RacingStore {
            inner,
            losses: AtomicU32::new(2),
            prefix: "a.",
            bucket: a.bucket,
        };
        // Two lost races on "a", then success: admitted, and the racer's 2 tokens + ours are gone.
        let out = admit(&store, &[check(&a, "k", true)], NOW);
        assert!(out.admitted);
        match admit(&store, &[check(&a, "k", true)], NOW).checks[0].verdict {
            Verdict::Allowed { remaining, .. } => assert_eq!(remaining, 10 - 4),
            v => panic!("{v:?}"),
        }
        // "b" has 3 tokens; our write loses to racers until they are gone: re-decided as limited,
        // and "a", already committed, is refunded.
        store.prefix = "b.";
        store.bucket = b.bucket;
        store.losses.store(100, Ordering::SeqCst);
        let out = admit(&store, &[check(&a, "k", true), check(&b, "k", true)], NOW);
        assert!(!out.admitted);
        assert_eq!(out.rejected_by, Some(1));
        store.losses.store(0, Ordering::SeqCst);
        match admit(&store, &[check(&a, "k", true)], NOW).checks[0].verdict {
            Verdict::Allowed { remaining, .. } => assert_eq!(remaining, 10 - 5),
            v => panic!("{v:?}"),
        }
    }

    #[test]
    fn contention_exhaustion_refuses() {
        let inner = MemoryStore::new();
        let a = rule(&inner, "a", 1, 1_000, 4);
        let store = RacingStore {
            inner,
            losses: AtomicU32::new(1_000),
            prefix: "a.",
            bucket: a.bucket,
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
}
