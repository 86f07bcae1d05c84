//! A bucket checked against a caller's evidence: a store that lost it (or writes to it) finds
//! out, and gives renewing holders their shares back.

use super::{GlobalBucket, Holder, EVIDENCE_TRANSIT_MS};
use crate::global::lease::api::{LeaseItem, MAX_DEBT};

impl GlobalBucket {
    /// Check the bucket against `instance`'s evidence at `now_ms` (unless the store has served
    /// the instance since that evidence): if it holds more tokens than it can
    /// ([`LeaseItem::evidence_bound`]), the store lost writes (or lost the bucket and made
    /// it anew): it restarts empty (or in the debt the evidence shows), its whole rate held for
    /// one lease TTL (for leases of before that only their holders know: each gets its own back
    /// when it calls). True if so.
    pub fn reconcile(
        &mut self,
        instance: &str,
        item: &LeaseItem,
        now_ms: u64,
        ttl_ms: u64,
    ) -> bool {
        self.refill(item, now_ms);
        let Some(bound) = item.evidence_bound() else {
            return false;
        };
        // The store remembers serving the instance at least as recently as the answer its
        // evidence is of: it lost nothing since (tokens others gave back or repaid meanwhile
        // may well exceed the evidence).
        let since_ms = now_ms.saturating_sub(item.known_ms.saturating_add(EVIDENCE_TRANSIT_MS));
        if self
            .holders
            .iter()
            .any(|h| h.instance == instance && h.asked_ms >= since_ms)
        {
            return false;
        }
        if item.period.is_some() {
            return self.reconcile_calendar(bound, now_ms, ttl_ms);
        }
        // The rate is already held for the holders of before: this loss is known.
        let holding = self
            .holders
            .first()
            .is_some_and(|h| h.instance.is_empty() && h.until_ms > now_ms);
        // A store that served the instance within a term remembers it (a holder is kept a term
        // after it asked): one that does not lost the bucket since, however many tokens it
        // holds now (a bucket made anew full may hold fewer than old evidence allows).
        let forgot = !holding && item.known_ms.saturating_add(EVIDENCE_TRANSIT_MS) < ttl_ms;
        if !forgot && self.tokens + self.reserve <= bound {
            return false;
        }
        // Empty but for the reserve (as a store that lost the bucket starts it), or owing what
        // the evidence says it owed (less the refill since); never more than it held.
        let tokens = self.tokens + self.reserve;
        self.tokens = bound.min(0.0).min(tokens).max(-(MAX_DEBT as f64));
        let reserve = item.reserve() as f64;
        self.reserve = if bound < 0.0 || tokens < 0.0 {
            0.0
        } else if holding {
            // (One reserve per loss.)
            self.reserve.min(reserve)
        } else {
            reserve
        };
        if !holding {
            let before = Holder {
                instance: String::new(),
                share: item.rate_mtps().saturating_add(1),
                asked_ms: now_ms,
                until_ms: now_ms.saturating_add(ttl_ms),
                ..Holder::default()
            };
            match self.holders.first_mut() {
                Some(h) if h.instance.is_empty() => *h = before,
                _ => self.holders.insert(0, before),
            }
        }
        self.idle_at_ms = self.idle_at_ms.max(now_ms.saturating_add(ttl_ms));
        true
    }

    /// A calendar quota's bucket holding more than the evidence allows (the store lost it, or
    /// writes to it, within its period): it holds what the evidence says was left. Not emptied,
    /// as a refilling bucket is: nothing would refill it before its period ends.
    pub(super) fn reconcile_calendar(&mut self, bound: f64, now_ms: u64, ttl_ms: u64) -> bool {
        if self.tokens + self.reserve <= bound {
            return false;
        }
        self.tokens = bound.max(-(MAX_DEBT as f64));
        self.reserve = 0.0;
        self.idle_at_ms = self.idle_at_ms.max(now_ms.saturating_add(ttl_ms));
        true
    }

    /// An instance with evidence of its own reservation (a live lease at `share` tokens per
    /// second) calls a bucket that holds the rate for holders it does not know (a store that lost
    /// the bucket starts so): that much of it is the instance's again, to renew now, rather than
    /// held back from it for a lease TTL. Only rate nobody has claimed stays held.
    /// Returns what it took (milli-tokens per second).
    pub(super) fn restore(&mut self, instance: &str, item: &LeaseItem, now_ms: u64) -> u64 {
        let claimed = item.share_mtps();
        if claimed == 0 || item.share_ms == 0 {
            return 0;
        }
        let known = self
            .holders
            .iter()
            .any(|h| h.instance == instance && h.share > 0 && h.until_ms > now_ms);
        if known {
            return 0;
        }
        let Some(before) = self
            .holders
            .first_mut()
            .filter(|h| h.instance.is_empty() && h.until_ms > now_ms)
        else {
            return 0;
        };
        let taken = claimed.min(before.share);
        before.share -= taken;
        taken
    }
}
