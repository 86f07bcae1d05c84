//! Per-worker token stashes: a worker takes a few tokens of a busy key's bucket in the CAS it writes
//! anyway, then spends them (and remembers a fresh refusal) without touching shared data.
//!
//! Accuracy: tokens leave the shared bucket before they are spent, so a key is never admitted more
//! than its bucket gave out. What a stash changes is *when* and *where*: a worker holds at most
//! `batch` tokens per key for at most [`STASH_LIFETIME_NS`] (then they go back to the bucket), so
//! another worker may be refused while those tokens wait, and in any interval a key may be admitted
//! up to the stashed tokens more than the bucket alone would allow in that interval. Batches are
//! only taken from a bucket with plenty left (see [`crate::limiter`]), so a key near its limit is
//! decided one token at a time, exactly.

use crate::slot::SlotId;

/// How long stashed tokens stay usable; later they are returned to the bucket.
pub const STASH_LIFETIME_NS: u64 = 20_000_000;

/// By when every token a bucket handed to a stash has been spent or returned: the lifetime, then
/// the worker's tick that returns leftovers (every 10 ms at most), with room to spare.
pub const STASH_RETURNED_NS: u64 = STASH_LIFETIME_NS + 15_000_000;

/// A key is busy on a worker (worth a batch) when its requests there come closer than this.
pub const BUSY_GAP_NS: u64 = STASH_LIFETIME_NS;

/// How long a worker trusts a refusal it saw: refunds elsewhere can make it stale.
pub const REFUSAL_TRUST_NS: u64 = STASH_LIFETIME_NS;

/// Stash entries per worker: memory does not grow with the number of keys.
pub const DEFAULT_ENTRIES: usize = 1024;

/// What the stash says about one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// Paid from the stash. `remaining` and `reset_ns` are estimates for headers.
    Spent { remaining: u64, reset_ns: u64 },
    /// The bucket refused this cost moments ago and cannot have refilled since.
    Refused { retry_after_ns: u64, reset_ns: u64 },
    /// Ask the bucket, taking up to `batch` tokens more for the stash.
    Ask { batch: u64 },
}

/// Tokens to give back to the shared bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Leftover {
    pub quota: u32,
    pub slot: SlotId,
    pub tokens: u64,
}

#[derive(Debug, Clone, Copy, Default)]
struct Entry {
    quota: u32,
    /// `slot.tag == 0`: a free entry.
    slot: SlotId,
    seen_ns: u64,
    tokens: u64,
    expires_ns: u64,
    /// The bucket's remaining count, stash included, as last known.
    remaining: u64,
    reset_at_ns: u64,
    refused_until_ns: u64,
    refused_cost: u64,
    conform_at_ns: u64,
}

impl Entry {
    fn is(&self, quota: u32, slot: SlotId) -> bool {
        self.slot == slot && self.quota == quota && slot.tag != 0
    }
}

/// One worker's stashes, by key: a fixed, direct-mapped table.
#[derive(Debug, Clone)]
pub struct StashTable {
    entries: Vec<Entry>,
    /// Entries holding tokens: the tick has nothing to look at while this is 0.
    holding: usize,
}

impl Default for StashTable {
    fn default() -> Self {
        Self::new(DEFAULT_ENTRIES)
    }
}

impl StashTable {
    /// `entries` is rounded up to a power of two (at least 1).
    pub fn new(entries: usize) -> Self {
        Self {
            entries: vec![Entry::default(); entries.max(1).next_power_of_two()],
            holding: 0,
        }
    }

    /// The entry of this key, if it has one here.
    fn own(&self, quota: u32, slot: SlotId) -> Option<usize> {
        let i = self.index(quota, slot);
        self.entries[i].is(quota, slot).then_some(i)
    }

    fn index(&self, quota: u32, slot: SlotId) -> usize {
        let h = slot.tag
            ^ u64::from(quota).wrapping_mul(0x9e37_79b9_7f4a_7c15)
            ^ u64::from(slot.group).rotate_left(32);
        // Masked to the table size, which is a power of two.
        (h as usize) & (self.entries.len() - 1)
    }

    /// Decide a request of `cost` from the stash if possible, else say how much to ask for.
    /// True if this worker's stash holds `cost` usable tokens of the key (nothing changes).
    pub fn holds(&self, quota: u32, slot: SlotId, cost: u64, now_ns: u64) -> bool {
        let e = &self.entries[self.index(quota, slot)];
        e.is(quota, slot) && e.tokens >= cost && now_ns < e.expires_ns
    }

    pub fn lookup(
        &mut self,
        quota: u32,
        slot: SlotId,
        cost: u64,
        max_batch: u64,
        now_ns: u64,
    ) -> Lookup {
        let i = self.index(quota, slot);
        let e = &mut self.entries[i];
        if !e.is(quota, slot) {
            if e.tokens > 0 {
                // Another busy key's stash: leave it alone, this request asks for itself only.
                return Lookup::Ask { batch: 0 };
            }
            *e = Entry {
                quota,
                slot,
                seen_ns: now_ns,
                ..Entry::default()
            };
            return Lookup::Ask { batch: 0 };
        }
        let busy = now_ns.saturating_sub(e.seen_ns) < BUSY_GAP_NS;
        e.seen_ns = now_ns;
        if e.tokens >= cost && now_ns < e.expires_ns {
            e.tokens -= cost;
            if e.tokens == 0 {
                self.holding -= 1;
            }
            let e = &mut self.entries[i];
            e.remaining = e.remaining.saturating_sub(cost);
            return Lookup::Spent {
                remaining: e.remaining,
                reset_ns: e.reset_at_ns.saturating_sub(now_ns),
            };
        }
        if now_ns < e.refused_until_ns && cost >= e.refused_cost {
            return Lookup::Refused {
                retry_after_ns: e.conform_at_ns.saturating_sub(now_ns).max(1),
                reset_ns: e.reset_at_ns.saturating_sub(now_ns),
            };
        }
        Lookup::Ask {
            batch: if busy { max_batch } else { 0 },
        }
    }

    /// The bucket admitted a request and gave `tokens` more for the stash; `remaining` and
    /// `reset_ns` are what it reported, the stash included. False if the key has no entry here:
    /// the tokens were not kept, and the caller returns them to the bucket itself.
    pub fn stash(
        &mut self,
        quota: u32,
        slot: SlotId,
        tokens: u64,
        remaining: u64,
        reset_ns: u64,
        now_ns: u64,
    ) -> bool {
        let Some(i) = self.own(quota, slot) else {
            return false;
        };
        let e = &mut self.entries[i];
        e.remaining = remaining;
        e.reset_at_ns = now_ns.saturating_add(reset_ns);
        e.refused_until_ns = 0;
        if tokens == 0 {
            return true;
        }
        if e.tokens == 0 {
            self.holding += 1;
        }
        let e = &mut self.entries[i];
        e.tokens = e.tokens.saturating_add(tokens);
        e.expires_ns = now_ns.saturating_add(STASH_LIFETIME_NS);
        true
    }

    /// The bucket refused `cost` for this key: remember it for a moment.
    pub fn refused(
        &mut self,
        quota: u32,
        slot: SlotId,
        cost: u64,
        retry_after_ns: u64,
        reset_ns: u64,
        now_ns: u64,
    ) {
        let Some(i) = self.own(quota, slot) else {
            return;
        };
        let e = &mut self.entries[i];
        e.refused_cost = cost;
        e.conform_at_ns = now_ns.saturating_add(retry_after_ns);
        e.refused_until_ns = now_ns.saturating_add(retry_after_ns.min(REFUSAL_TRUST_NS));
        e.reset_at_ns = now_ns.saturating_add(reset_ns);
        e.remaining = 0;
    }

    /// Undo a [`Lookup::Spent`]: another rule refused the request.
    pub fn put_back(&mut self, quota: u32, slot: SlotId, cost: u64) {
        let Some(i) = self.own(quota, slot) else {
            return;
        };
        let e = &mut self.entries[i];
        if e.tokens == 0 && cost > 0 {
            self.holding += 1;
        }
        let e = &mut self.entries[i];
        e.tokens = e.tokens.saturating_add(cost);
        e.remaining = e.remaining.saturating_add(cost);
    }

    /// Take out the stashes that expired by `now_ns` (all of them with `u64::MAX`): the caller
    /// returns them to their buckets.
    pub fn expired(&mut self, now_ns: u64) -> Vec<Leftover> {
        let mut out = Vec::new();
        if self.holding == 0 {
            return out;
        }
        for e in &mut self.entries {
            if e.tokens > 0 && e.expires_ns <= now_ns {
                out.push(Leftover {
                    quota: e.quota,
                    slot: e.slot,
                    tokens: e.tokens,
                });
                e.tokens = 0;
            }
        }
        self.holding -= out.len();
        out
    }

    /// Tokens held across all keys (for stats).
    pub fn held(&self) -> u64 {
        if self.holding == 0 {
            return 0;
        }
        self.entries.iter().map(|e| e.tokens).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::Limit;
    use crate::limiter::{admit, return_stash, Check, Verdict};
    use crate::slot::SlotTable;
    use crate::store::{CasStore, MemoryStore};
    use crate::token_bucket::TokenBucket;
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
                        Verdict::Allowed {
                            remaining,
                            reset_ns,
                            ..
                        } => {
                            self.workers[worker]
                                .stash(0, slot, c.stashed, remaining, reset_ns, now);
                            true
                        }
                        Verdict::Limited {
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
                    return_stash(&self.store, &self.limit, &self.table, l.slot, l.tokens, now)
                        .unwrap();
                }
            }
        }
    }

    #[test]
    fn a_leased_allowance_is_stashed_and_spent_exactly() {
        use crate::allowance::LeaseAllowance;
        let mut w = World::new(1, 1, 2);
        let lease = LeaseAllowance {
            lease_size: 100,
            low_water: 0,
            claim_ms: 200,
            global_burst: 0,
            global_interval_ns: 0,
            global_rate_mtps: 0,
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
}
