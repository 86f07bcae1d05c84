//! The bounds of the calendar period an instant falls in, by the zone's rules (chrono-tz).

use super::CalendarUnit;
use chrono::{Datelike, Days, Months, NaiveDate, NaiveTime, TimeZone};
use chrono_tz::Tz;

/// The period of `unit` in the time zone named `zone` that `now_ms` (ms since the Unix epoch)
/// falls in: its first millisecond and the next period's (`start <= now_ms < end`). A period
/// begins at local midnight, or, where a change of offset skips midnight, at the first local
/// time that exists that day. None for a zone chrono-tz does not know, or a time beyond its
/// calendar.
pub fn period_at(unit: CalendarUnit, zone: &str, now_ms: u64) -> Option<(u64, u64)> {
    let tz: Tz = zone.parse().ok()?;
    let now = tz
        .timestamp_millis_opt(i64::try_from(now_ms).ok()?)
        .single()?;
    let today = now.date_naive();
    let (first, next) = match unit {
        CalendarUnit::Day => (today, today.checked_add_days(Days::new(1))?),
        CalendarUnit::Week => {
            let monday = today
                .checked_sub_days(Days::new(u64::from(today.weekday().num_days_from_monday())))?;
            (monday, monday.checked_add_days(Days::new(7))?)
        }
        CalendarUnit::Month => {
            let first = today.with_day(1)?;
            (first, first.checked_add_months(Months::new(1))?)
        }
    };
    let start = day_start(tz, first)?;
    let end = day_start(tz, next)?;
    (start <= now_ms && now_ms < end).then_some((start, end))
}

/// An RFC 3339 time (`2026-12-01T00:05:00+01:00`) as ms since the Unix epoch; None for anything
/// else, or a time before 1970.
pub fn rfc3339_ms(at: &str) -> Option<u64> {
    let t = chrono::DateTime::parse_from_rfc3339(at).ok()?;
    u64::try_from(t.timestamp_millis()).ok()
}

/// The first instant of `date` in `tz` (ms): its midnight, the earlier one where midnight comes
/// twice, the first local time after the gap where a change of offset skips it.
fn day_start(tz: Tz, date: NaiveDate) -> Option<u64> {
    // Gaps are at most a few hours; a quarter of an hour is the finest step any zone uses.
    for quarter in 0..4 * 24 {
        let time = NaiveTime::from_num_seconds_from_midnight_opt(quarter * 900, 0)?;
        if let Some(at) = tz.from_local_datetime(&date.and_time(time)).earliest() {
            // A gap's first instant: the quarter before was skipped, so its start is where the
            // new offset begins; step back within the quarter to the gap's end.
            let ms = at.timestamp_millis();
            let ms = if quarter == 0 {
                ms
            } else {
                gap_end(tz, date, ms)
            };
            return u64::try_from(ms).ok();
        }
    }
    None
}

/// The first instant of `date` when its midnight fell into a gap: the instant the offset
/// changed, found by bisection below `found_ms` (a local time on `date` that exists).
fn gap_end(tz: Tz, date: NaiveDate, found_ms: i64) -> i64 {
    let on_date = |ms: i64| {
        tz.timestamp_millis_opt(ms)
            .single()
            .is_some_and(|t| t.date_naive() == date)
    };
    let (mut lo, mut hi) = (found_ms - 900_000, found_ms);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if on_date(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    hi
}

#[cfg(test)]
mod tests;
