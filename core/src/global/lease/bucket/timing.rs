//! When a bucket is full again, and when a caller that got nothing may ask again.

use super::{GlobalBucket, RENEWAL_MARGIN_MS};
use crate::global::lease::api::LeaseItem;

impl GlobalBucket {
    /// Milliseconds until the bucket is full (its unreserved refill first, its whole rate once
    /// the reservations end), and, for an instance that got nothing, until asking again can get
    /// something (a token flows in, or a reservation ends).
    pub(super) fn timing(
        &self,
        item: &LeaseItem,
        now_ms: u64,
        ttl_ms: u64,
        got_nothing: bool,
        light: bool,
    ) -> (u64, u64) {
        let rate = item.rate_per_ms();
        let rate_mtps = item.rate_mtps();
        let reserved = self.reserved_at(now_ms);
        let free = (rate - reserved as f64 / 1e6).max(0.0);
        let last_until = self
            .holders
            .iter()
            .map(|h| h.until_ms.saturating_sub(now_ms))
            .max()
            .unwrap_or(0);
        let missing = (item.burst as f64 - self.tokens - self.reserve).max(0.0);
        let reset = if missing == 0.0 {
            0.0
        } else if free > 0.0 && missing / free <= last_until as f64 {
            missing / free
        } else {
            let by_then = free * last_until as f64;
            last_until as f64 + (missing - by_then).max(0.0) / rate
        };
        let retry = if got_nothing {
            // To the next whole token (in debt: the debt repaid, and a token).
            let need = if self.tokens < 0.0 {
                1.0 - self.tokens
            } else {
                1.0 - self.tokens.fract()
            };
            let token = need / rate;
            let first_free = if free > 0.0 {
                need / free
            } else {
                f64::INFINITY
            };
            let ends = self
                .holders
                .iter()
                .filter(|h| h.until_ms > now_ms && h.share > 0)
                .map(|h| (h.until_ms - now_ms) as f64)
                .fold(f64::INFINITY, f64::min);
            // One within its fair share is short of it only until a holder capped by fairness
            // renews (they do every sixteenth of a term) and leaves it its share.
            let renews = if light {
                self.holders
                    .iter()
                    .filter(|h| {
                        let capped = h.share < h.demand || h.demand >= rate_mtps;
                        h.share > 0 && capped && h.until_ms > now_ms
                    })
                    .map(|h| {
                        let at = h.asked_ms.saturating_add(ttl_ms / 16).max(now_ms);
                        (at - now_ms) as f64 + RENEWAL_MARGIN_MS
                    })
                    .fold(f64::INFINITY, f64::min)
            } else {
                f64::INFINITY
            };
            let soonest = first_free.min(ends).min(renews);
            let retry = if soonest.is_finite() {
                soonest.max(token)
            } else {
                token
            };
            retry.ceil().max(1.0)
        } else {
            0.0
        };
        (reset.ceil() as u64, retry as u64)
    }
}
