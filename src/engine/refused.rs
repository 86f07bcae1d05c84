//! Keys the quota service refused lately, kept per worker for `retry` in a table of fixed size.

use tollgate_core::state::CLOCK_SKEW_MS;

/// Keys a worker keeps at most. More refused within `retry` take the places of those kept
/// longest: a key dropped early is only asked for again (and refused again).
pub const REFUSED_KEYS: usize = 64;

/// A global rule's key the service refused, and until when (ms) it is not asked for.
#[derive(Clone, Copy)]
struct RefusedKey {
    rule: usize,
    key: u128,
    /// 0: a free place.
    until_ms: u64,
}

const FREE: RefusedKey = RefusedKey {
    rule: 0,
    key: 0,
    until_ms: 0,
};

/// Global rules' keys the service refused one by one (an item listed under `errors`): a request
/// calling for itself does not ask for them again for `retry`, the failure mode decides them.
/// The same memory whatever the number of keys.
pub struct RefusedKeys {
    places: [RefusedKey; REFUSED_KEYS],
    /// The latest `until_ms` of any place: from then on, no place holds a key (none is looked at).
    latest_ms: u64,
}

impl Default for RefusedKeys {
    fn default() -> Self {
        Self {
            places: [FREE; REFUSED_KEYS],
            latest_ms: 0,
        }
    }
}

impl RefusedKeys {
    /// Keep `rule`'s `key`, refused at `now_ms`, for `retry_ms`: in its own place, else a free
    /// one, else the place of the key kept longest.
    pub fn keep(&mut self, rule: usize, key: u128, now_ms: u64, retry_ms: u64) {
        let until_ms = now_ms.saturating_add(retry_ms);
        let place = self
            .places
            .iter()
            .position(|p| p.rule == rule && p.key == key)
            .or_else(|| {
                self.places
                    .iter()
                    .position(|p| !holds_at(p.until_ms, now_ms, retry_ms))
            })
            .or_else(|| {
                let oldest = self
                    .places
                    .iter()
                    .enumerate()
                    .min_by_key(|(_, p)| p.until_ms);
                oldest.map(|(n, _)| n)
            });
        if let Some(p) = place.and_then(|n| self.places.get_mut(n)) {
            *p = RefusedKey {
                rule,
                key,
                until_ms,
            };
            self.latest_ms = self.latest_ms.max(until_ms);
        }
    }

    /// True while `rule`'s `key` was refused less than `retry_ms` before `now_ms`.
    pub fn holds(&self, rule: usize, key: u128, now_ms: u64, retry_ms: u64) -> bool {
        now_ms < self.latest_ms
            && self
                .places
                .iter()
                .any(|p| p.rule == rule && p.key == key && holds_at(p.until_ms, now_ms, retry_ms))
    }
}

/// A place kept until `until_ms` still holds its key at `now_ms`; one further ahead than `retry`
/// puts it does not (the clock stepped back: the key is asked for again at once).
fn holds_at(until_ms: u64, now_ms: u64, retry_ms: u64) -> bool {
    until_ms > now_ms
        && until_ms
            <= now_ms
                .saturating_add(retry_ms)
                .saturating_add(CLOCK_SKEW_MS)
}

#[cfg(test)]
mod tests {
    use super::*;

    const RETRY: u64 = 1_000;

    #[test]
    fn a_refused_key_is_kept_for_retry_and_the_table_never_grows() {
        let mut t = RefusedKeys::default();
        assert!(!t.holds(0, 7, 10, RETRY));
        t.keep(0, 7, 10, RETRY);
        assert!(t.holds(0, 7, 10, RETRY));
        assert!(t.holds(0, 7, 1_009, RETRY));
        assert!(!t.holds(0, 7, 1_010, RETRY), "for retry only");
        assert!(!t.holds(1, 7, 10, RETRY), "another rule's key");
        assert!(!t.holds(0, 8, 10, RETRY), "another key");
        // Refused again: kept from then, in the same place.
        t.keep(0, 7, 500, RETRY);
        assert!(t.holds(0, 7, 1_499, RETRY));
        // Ten times more keys than places: as many as there are places are kept, the newest
        // among them; the key kept longest gave way first.
        let last = 100 + 10 * REFUSED_KEYS as u128;
        for key in 100..last {
            t.keep(0, key, 600, RETRY);
        }
        let kept = (100..last).filter(|&k| t.holds(0, k, 600, RETRY)).count();
        assert_eq!(kept, REFUSED_KEYS);
        assert!(t.holds(0, last - 1, 600, RETRY));
        assert!(!t.holds(0, 7, 600, RETRY));
    }

    #[test]
    fn a_clock_stepped_back_forgets_refused_keys() {
        let mut t = RefusedKeys::default();
        t.keep(0, 7, 3_600_000, RETRY);
        assert!(!t.holds(0, 7, 10, RETRY));
        // A lapsed or stepped-over place is free for another key.
        t.keep(0, 8, 10, RETRY);
        assert!(t.holds(0, 8, 10, RETRY));
    }
}
