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
mod tests;
