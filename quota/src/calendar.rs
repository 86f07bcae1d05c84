//! Calendar quotas: the period each calendar item is served in, by the service's clock, and the
//! bucket that period counts in.

use tollgate_core::calendar::period_at;
use tollgate_core::global::lease::{LeaseItem, EVIDENCE_TRANSIT_MS};

/// The calendar's clock: the store's, moved by `offset_ms` (`--calendar-clock`: to try a
/// period's end without waiting for it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CalendarClock {
    pub offset_ms: i64,
}

impl CalendarClock {
    /// A clock that reads `at_ms` (ms since the Unix epoch) when the store's reads `now_ms`.
    pub fn reading(at_ms: u64, now_ms: u64) -> Self {
        Self {
            offset_ms: i64::try_from(i128::from(at_ms) - i128::from(now_ms)).unwrap_or(0),
        }
    }

    /// Put a calendar item into the period the calendar is in at `now_ms` (the store's clock),
    /// its bounds in the store's clock; and say the period's bounds by the calendar, which name
    /// the bucket it counts in (full when the period begins; a service restarted with another
    /// offset finds it).
    /// The caller's evidence counts only if it is of this period and younger than a lease TTL
    /// (`ttl_ms`): older, it may be of the bucket before an operator's reset, or of the period
    /// before. Why it cannot be served, if it cannot (a time beyond the zone's calendar).
    pub fn place(
        &self,
        item: &mut LeaseItem,
        now_ms: u64,
        ttl_ms: u64,
    ) -> Result<Option<(u64, u64)>, String> {
        let Some((unit, zone)) = item.calendar()? else {
            return Ok(None);
        };
        let shift = |ms: u64, by: i64| u64::try_from(i128::from(ms) + i128::from(by)).ok();
        let no_period = || format!("no {} in {zone} now", unit.as_str());
        let (first, next) = shift(now_ms, self.offset_ms)
            .and_then(|at| period_at(unit, zone, at))
            .ok_or_else(no_period)?;
        let (start, end) = shift(first, -self.offset_ms)
            .zip(shift(next, -self.offset_ms))
            .ok_or_else(no_period)?;
        let age = item.known_ms.saturating_add(EVIDENCE_TRANSIT_MS);
        if age >= ttl_ms.min(now_ms.saturating_sub(start)) {
            item.known_ms = 0;
            item.known_remaining = 0;
            item.known_debt = 0;
        }
        item.period = Some((start, end));
        Ok(Some((first, next)))
    }
}
