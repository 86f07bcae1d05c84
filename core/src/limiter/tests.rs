//! Admission, eviction, contention and leases against the in-memory store.

use super::*;
use crate::algorithm::Standing;
use crate::local::concurrency::Concurrency;
use crate::local::token_bucket::TokenBucket;
use crate::slot::WAYS;
use crate::store::MemoryStore;
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

fn rule_with<S: CasStore + ?Sized>(store: &S, name: &str, limit: Limit, slots: u32) -> Rule {
    let table = SlotTable::new(format!("{name}."), slots);
    table.initialize(store).unwrap();
    Rule { limit, table }
}

fn rule<S: CasStore + ?Sized>(
    store: &S,
    name: &str,
    requests: u64,
    burst: u64,
    slots: u32,
) -> Rule {
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
        Verdict::Admitted { remaining, .. } => remaining,
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
            assert_eq!(out.refused_by, Some(1));
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
        .filter(|o| matches!(o.checks[0].verdict, Verdict::Refused { .. }))
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
    let Verdict::Refused { retry_after_ns, .. } = out.checks[0].verdict else {
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
            if let Decision::Admit { state, .. } = racer.limit.decide(&slot.state, NOW, 1) {
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
    assert_eq!(out.refused_by, Some(1));
    store.losses.store(0, Ordering::SeqCst);
    assert_eq!(
        remaining(&admit(&store, &[check(&a, "k", true)], NOW)),
        10 - 5
    );
}

#[test]
fn a_race_lost_to_the_last_leased_token_leaves_the_request_undecided() {
    use crate::global::allowance::LeaseAllowance;
    let inner = MemoryStore::new();
    let a = rule(&inner, "a", 1, 10, 4);
    let lease = LeaseAllowance {
        lease_size: 10,
        low_water: 5,
        claim_ms: 200,
        global_burst: 0,
        global_interval_ns: 0,
        global_rate_mtps: 0,
        calendar: false,
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
        out.refused_by, None,
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
    threads_admit_exactly_the_burst(MemoryStore::new());
}

/// The process-memory store, whose read and write of a request's one check are one call.
#[cfg(feature = "atomic-store")]
#[test]
fn threads_sharing_one_atomic_store_admit_exactly_the_burst() {
    threads_admit_exactly_the_burst(crate::AtomicStore::new());
}

fn threads_admit_exactly_the_burst<S: CasStore + Send + Sync + 'static>(store: S) {
    let store = Arc::new(store);
    let r = Arc::new(rule(&*store, "t", 1, 100, 8));
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
    let r = Arc::new(rule_with(&*store, "c", c, 4));
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
    use crate::global::allowance::LeaseAllowance;
    let store = MemoryStore::new();
    let lease = LeaseAllowance {
        lease_size: 2,
        low_water: 0,
        claim_ms: 1_000,
        global_burst: 0,
        global_interval_ns: 0,
        global_rate_mtps: 0,
        calendar: false,
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
    use crate::global::allowance::LeaseAllowance;
    let store = MemoryStore::new();
    let local = rule(&store, "local", 1, 100, 4);
    let lease = LeaseAllowance {
        lease_size: 4,
        low_water: 2,
        claim_ms: 1_000,
        global_burst: 0,
        global_interval_ns: 0,
        global_rate_mtps: 0,
        calendar: false,
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
    assert!(!first.admitted && first.refused_by.is_none());
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

#[test]
fn two_streams_of_one_key_share_its_byte_rate_and_another_key_has_its_own() {
    let store = MemoryStore::default();
    let tb = TokenBucket::new(1_000_000, SEC, 100_000).unwrap();
    let r = rule_with(&store, "bytes", Limit::TokenBucket(tb), 64);
    let (a, b) = (r.table.locate(b"a"), r.table.locate(b"b"));
    assert_eq!(pace(&store, &r.limit, &r.table, a, 100_000, NOW), Ok(0));
    // The key's second stream waits for the first's bytes: 50 ms for 50 000 bytes.
    assert_eq!(
        pace(&store, &r.limit, &r.table, a, 50_000, NOW),
        Ok(50 * MS)
    );
    assert_eq!(pace(&store, &r.limit, &r.table, b, 100_000, NOW), Ok(0));
}
