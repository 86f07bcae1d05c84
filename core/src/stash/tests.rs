//! Busy keys, spending, expiry, trusted refusals, and bursts spread over workers.

use super::*;
use crate::algorithm::Limit;
use crate::limiter::{admit, return_stash, Check, Verdict};
use crate::local::token_bucket::TokenBucket;
use crate::slot::SlotTable;
use crate::store::{CasStore, MemoryStore};
use proptest::prelude::*;

const MS: u64 = 1_000_000;
const NOW: u64 = 1_700_000_000_000_000_000;
const SLOT: SlotId = SlotId { group: 3, tag: 77 };

#[test]
fn a_key_is_batched_only_once_busy() {
    let mut t = StashTable::new(8);
    assert_eq!(t.lookup(1, SLOT, 1, 8, NOW), Lookup::Ask { batch: 0 });
    assert_eq!(
        t.lookup(1, SLOT, 1, 8, NOW + BUSY_GAP_NS + 1),
        Lookup::Ask { batch: 0 }
    );
    assert_eq!(
        t.lookup(1, SLOT, 1, 8, NOW + BUSY_GAP_NS + 2),
        Lookup::Ask { batch: 8 }
    );
}

#[test]
fn spends_then_expires_and_returns_leftovers() {
    let mut t = StashTable::new(8);
    t.lookup(1, SLOT, 1, 8, NOW);
    t.stash(1, SLOT, 3, 10, 5 * MS, NOW);
    assert_eq!(
        t.lookup(1, SLOT, 1, 8, NOW + MS),
        Lookup::Spent {
            remaining: 9,
            reset_ns: 4 * MS
        }
    );
    assert_eq!(t.held(), 2);
    // A cost larger than the stash asks the bucket.
    assert_eq!(t.lookup(1, SLOT, 3, 8, NOW + MS), Lookup::Ask { batch: 8 });
    assert!(t.expired(NOW + STASH_LIFETIME_NS - 1).is_empty());
    assert_eq!(
        t.expired(NOW + STASH_LIFETIME_NS),
        vec![Leftover {
            quota: 1,
            slot: SLOT,
            tokens: 2
        }]
    );
    assert_eq!(t.held(), 0);
    assert_eq!(t.holding, 0);
}

#[test]
fn another_keys_stash_is_not_evicted() {
    let mut t = StashTable::new(1);
    t.lookup(1, SLOT, 1, 8, NOW);
    t.stash(1, SLOT, 3, 10, 0, NOW);
    let other = SlotId { group: 9, tag: 5 };
    assert_eq!(t.lookup(1, other, 1, 8, NOW), Lookup::Ask { batch: 0 });
    assert!(!t.stash(1, other, 2, 10, 0, NOW));
    assert_eq!(t.held(), 3);
}

#[test]
fn refusals_are_trusted_briefly_and_only_for_costs_as_large() {
    let mut t = StashTable::new(8);
    t.lookup(1, SLOT, 2, 8, NOW);
    t.refused(1, SLOT, 2, 60_000 * MS, 60_000 * MS, NOW);
    assert!(matches!(
        t.lookup(1, SLOT, 2, 8, NOW + MS),
        Lookup::Refused { retry_after_ns, .. } if retry_after_ns == 59_999 * MS
    ));
    assert!(matches!(
        t.lookup(1, SLOT, 1, 8, NOW + MS),
        Lookup::Ask { .. }
    ));
    assert!(matches!(
        t.lookup(1, SLOT, 2, 8, NOW + REFUSAL_TRUST_NS),
        Lookup::Ask { .. }
    ));
}

#[test]
fn put_back_undoes_a_spend() {
    let mut t = StashTable::new(8);
    t.lookup(1, SLOT, 1, 8, NOW);
    t.stash(1, SLOT, 1, 10, 0, NOW);
    assert!(matches!(t.lookup(1, SLOT, 1, 8, NOW), Lookup::Spent { .. }));
    assert_eq!(t.holding, 0);
    t.put_back(1, SLOT, 1);
    assert_eq!((t.held(), t.holding), (1, 1));
}

/// Workers sharing one bucket through stashes, as the filter drives them.
struct World {
    store: MemoryStore,
    limit: Limit,
    table: SlotTable,
    workers: Vec<StashTable>,
    /// Refusals while stashed tokens may come back are `Waiting` (as in Envoy).
    wait_for_stashes: bool,
}

impl World {
    fn new(requests: u64, burst: u64, workers: usize) -> Self {
        let store = MemoryStore::default();
        let table = SlotTable::new("t.".into(), 16);
        table.initialize(&store).unwrap();
        let tb = TokenBucket::new(requests, 1_000 * MS, burst).unwrap();
        Self {
            store,
            limit: Limit::TokenBucket(tb),
            table,
            workers: vec![StashTable::new(16); workers],
            wait_for_stashes: false,
        }
    }

    fn request(&mut self, worker: usize, now: u64) -> bool {
        self.ask(worker, now) == Some(true)
    }

    /// As the filter in Envoy: a request told to wait is held and decided again on the
    /// worker's ticks (every 10 ms, each returning expired stashes). The time it was decided.
    fn request_held(&mut self, worker: usize, mut now: u64) -> (bool, u64) {
        loop {
            if let Some(admitted) = self.ask(worker, now) {
                return (admitted, now);
            }
            now += 10 * MS;
            self.tick(now);
        }
    }

    /// `None`: wait and ask again.
    fn ask(&mut self, worker: usize, now: u64) -> Option<bool> {
        let slot = self.table.locate(b"k");
        Some(match self.workers[worker].lookup(0, slot, 1, 8, now) {
            Lookup::Spent { .. } => true,
            Lookup::Refused { .. } => false,
            Lookup::Ask { batch } => {
                let check = Check {
                    limit: &self.limit,
                    table: &self.table,
                    slot,
                    cost: 1,
                    enforced: true,
                    batch,
                    wait_for_stashes: self.wait_for_stashes,
                };
                let out = admit(&self.store, &[check], now);
                let c = out.checks[0];
                match c.verdict {
                    Verdict::Admitted {
                        remaining,
                        reset_ns,
                        ..
                    } => {
                        self.workers[worker].stash(0, slot, c.stashed, remaining, reset_ns, now);
                        true
                    }
                    Verdict::Refused {
                        retry_after_ns,
                        reset_ns,
                        ..
                    } => {
                        self.workers[worker].refused(0, slot, 1, retry_after_ns, reset_ns, now);
                        false
                    }
                    Verdict::Waiting if self.wait_for_stashes => return None,
                    // A leased allowance that ran out: no refill in these tests.
                    Verdict::Waiting => false,
                    v => panic!("{v:?}"),
                }
            }
        })
    }

    fn tick(&mut self, now: u64) {
        for w in 0..self.workers.len() {
            for l in self.workers[w].expired(now) {
                return_stash(&self.store, &self.limit, &self.table, l.slot, l.tokens, now).unwrap();
            }
        }
    }
}

#[test]
fn a_leased_allowance_is_stashed_and_spent_exactly() {
    use crate::global::allowance::LeaseAllowance;
    let mut w = World::new(1, 1, 2);
    let lease = LeaseAllowance {
        lease_size: 100,
        low_water: 0,
        claim_ms: 200,
        global_burst: 0,
        global_interval_ns: 0,
        global_rate_mtps: 0,
        calendar: false,
    };
    w.limit = Limit::Lease(lease);
    let slot = w.table.locate(b"k");
    let key = w.table.store_key(slot.group);
    let mut group = crate::slot::Group::decode(&w.store.read(key.as_str()).unwrap().unwrap().0);
    group.slots[0].tag = slot.tag;
    group.slots[0].state = lease.with_tokens(&group.slots[0].state, NOW / MS, 100, 60_000);
    let cas = w.store.read(key.as_str()).unwrap().unwrap().1;
    w.store.write(key.as_str(), &group.encode(), cas).unwrap();
    let admitted = (0..400u64)
        .filter(|&i| w.request((i % 2) as usize, NOW + i))
        .count();
    assert_eq!(admitted, 100);
    assert_eq!(w.workers.iter().map(StashTable::held).sum::<u64>(), 0);
}

#[test]
fn a_burst_from_two_workers_is_exact() {
    let mut w = World::new(100, 100, 2);
    let admitted = (0..400u64)
        .filter(|&i| w.request((i % 2) as usize, NOW + i))
        .count();
    assert_eq!(admitted, 100);
}

/// One client's requests one after another, each on whichever worker: the run's admissions.
fn burst(w: &mut World, workers: &[usize], gap: u64) -> Vec<bool> {
    let mut now = NOW;
    workers
        .iter()
        .map(|&worker| {
            let (admitted, at) = w.request_held(worker, now);
            now = at + gap;
            admitted
        })
        .collect()
}

#[test]
fn without_waiting_a_token_in_another_workers_stash_is_refused_to_this_one() {
    // Worker 0 is busy and stashes; worker 1 drains the rest; its next request finds the
    // bucket empty while worker 0 still holds a token.
    let mut w = World::new(1, 20, 2);
    let workers: Vec<usize> = [0, 0, 0].into_iter().chain([1; 18]).collect();
    let admitted = burst(&mut w, &workers, MS);
    assert!(admitted.iter().filter(|a| **a).count() < 20, "{admitted:?}");
}

#[test]
fn a_request_waits_for_tokens_in_another_workers_stash_and_gets_them() {
    let mut w = World::new(1, 20, 2);
    w.wait_for_stashes = true;
    let workers: Vec<usize> = [0, 0, 0].into_iter().chain([1; 18]).collect();
    let admitted = burst(&mut w, &workers, MS);
    assert_eq!(admitted.iter().filter(|a| **a).count(), 20, "{admitted:?}");
    assert!(!admitted[20]);
}

proptest! {
    /// A burst from one client, requests one after another over any workers, at any pace
    /// under the refill: exactly the burst is admitted, the rest refused.
    #[test]
    fn a_burst_over_workers_is_admitted_in_full_when_refusals_wait_for_stashes(
        workers in proptest::collection::vec(0usize..3, 21..60),
        gap_us in 1u64..3_000,
    ) {
        let mut w = World::new(1, 20, 3);
        w.wait_for_stashes = true;
        // One token a second: the run must end before one comes back.
        let admitted = burst(&mut w, &workers, gap_us * 1_000);
        prop_assert_eq!(admitted.iter().filter(|a| **a).count(), 20, "{:?}", admitted);
    }

    /// Never more than the bucket gives out, over any run: burst plus refill over the span,
    /// plus what sat in stashes at the start (nothing, here).
    #[test]
    fn never_more_than_the_bucket_gives(
        gaps in proptest::collection::vec((0u64..3_000_000, 0usize..3), 1..400),
        requests in 1u64..500,
        burst in 1u64..60,
    ) {
        let mut w = World::new(requests, burst, 3);
        let mut now = NOW;
        let mut admitted = 0u64;
        for (gap, worker) in gaps {
            now += gap;
            w.tick(now);
            admitted += u64::from(w.request(worker, now));
        }
        let span = now - NOW;
        // Tokens back over the span (1 s period), rounded up.
        let refilled = (u128::from(span) * u128::from(requests)).div_ceil(1_000 * u128::from(MS));
        prop_assert!(u128::from(admitted) <= u128::from(burst) + refilled);
    }

    /// Once every stash is returned, the bucket is where exact accounting would put it.
    #[test]
    fn returned_stashes_leave_no_loss(
        workers in proptest::collection::vec(0usize..3, 1..60),
    ) {
        let mut w = World::new(1, 1_000, 3);
        let mut used = 0;
        for (i, worker) in workers.iter().enumerate() {
            used += u64::from(w.request(*worker, NOW + i as u64 * 1_000));
        }
        w.tick(u64::MAX);
        // One request per second: nothing refilled in these microseconds.
        let check = Check {
            limit: &w.limit,
            table: &w.table,
            slot: w.table.locate(b"k"),
            cost: 1_000 - used,
            enforced: true,
            batch: 0,
            wait_for_stashes: false,
        };
        let out = admit(&w.store, &[check], NOW + 60 * 1_000);
        prop_assert!(out.admitted, "{used} used, the rest should be there");
    }
}
