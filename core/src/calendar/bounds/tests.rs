use super::*;
use crate::calendar::TIME_ZONES;
use chrono::{DateTime, Timelike, Weekday};
use proptest::prelude::*;

const H: u64 = 3_600_000;
const D: u64 = 24 * H;

fn at(rfc3339: &str) -> u64 {
    DateTime::parse_from_rfc3339(rfc3339)
        .map(|t| t.timestamp_millis() as u64)
        .unwrap_or(0)
}

fn local(zone: &str, ms: u64) -> chrono::DateTime<Tz> {
    let tz: Tz = zone.parse().unwrap_or(Tz::UTC);
    tz.timestamp_millis_opt(ms as i64).unwrap()
}

#[test]
fn months_of_every_length_and_both_changes_of_offset() {
    let cases = [
        // Berlin's spring change (29 March 2026, 02:00 → 03:00): one hour short.
        (
            "Europe/Berlin",
            "2026-03-15T12:00:00+01:00",
            "2026-03-01T00:00:00+01:00",
            31 * D - H,
        ),
        // Its autumn change (25 October 2026): one hour long.
        (
            "Europe/Berlin",
            "2026-10-31T23:59:59+01:00",
            "2026-10-01T00:00:00+02:00",
            31 * D + H,
        ),
        (
            "Europe/Berlin",
            "2026-11-30T23:59:59.999+01:00",
            "2026-11-01T00:00:00+01:00",
            30 * D,
        ),
        (
            "Europe/Berlin",
            "2026-12-01T00:00:00+01:00",
            "2026-12-01T00:00:00+01:00",
            31 * D,
        ),
        (
            "UTC",
            "2028-02-29T23:00:00Z",
            "2028-02-01T00:00:00Z",
            29 * D,
        ),
        (
            "UTC",
            "2027-02-10T00:00:00Z",
            "2027-02-01T00:00:00Z",
            28 * D,
        ),
        (
            "America/New_York",
            "2026-11-01T01:30:00-05:00",
            "2026-11-01T00:00:00-04:00",
            30 * D + H,
        ),
        (
            "Asia/Kolkata",
            "2026-01-31T23:59:00+05:30",
            "2026-01-01T00:00:00+05:30",
            31 * D,
        ),
    ];
    for (zone, now, start, len) in cases {
        let (s, e) = period_at(CalendarUnit::Month, zone, at(now)).unwrap();
        assert_eq!((s, e - s), (at(start), len), "{zone} {now}");
    }
}

#[test]
fn days_and_weeks() {
    // The day of Berlin's spring change has 23 hours, of its autumn change 25.
    let (s, e) = period_at(
        CalendarUnit::Day,
        "Europe/Berlin",
        at("2026-03-29T12:00:00+02:00"),
    )
    .unwrap();
    assert_eq!((s, e - s), (at("2026-03-29T00:00:00+01:00"), 23 * H));
    let (s, e) = period_at(
        CalendarUnit::Day,
        "Europe/Berlin",
        at("2026-10-25T12:00:00+01:00"),
    )
    .unwrap();
    assert_eq!((s, e - s), (at("2026-10-25T00:00:00+02:00"), 25 * H));
    // 27 November 2026 is a Friday: its week began on Monday the 23rd.
    let (s, e) = period_at(CalendarUnit::Week, "UTC", at("2026-11-27T10:00:00Z")).unwrap();
    assert_eq!(
        (s, e),
        (at("2026-11-23T00:00:00Z"), at("2026-11-30T00:00:00Z"))
    );
    // A Monday's first and a Sunday's last millisecond.
    let (s, _) = period_at(CalendarUnit::Week, "UTC", at("2026-11-30T00:00:00Z")).unwrap();
    assert_eq!(s, at("2026-11-30T00:00:00Z"));
    let (_, e) = period_at(CalendarUnit::Week, "UTC", at("2026-11-29T23:59:59.999Z")).unwrap();
    assert_eq!(e, at("2026-11-30T00:00:00Z"));
}

#[test]
fn a_day_whose_midnight_is_skipped_begins_when_the_clock_jumps() {
    // Cuba moves its clocks from 00:00 to 01:00 on the second Sunday of March: 8 March 2026
    // begins at 01:00 (−04:00), and the day before ends then.
    let (s, e) = period_at(
        CalendarUnit::Day,
        "America/Havana",
        at("2026-03-08T12:00:00-04:00"),
    )
    .unwrap();
    assert_eq!((s, e - s), (at("2026-03-08T01:00:00-04:00"), 23 * H));
    let (_, e) = period_at(
        CalendarUnit::Day,
        "America/Havana",
        at("2026-03-07T12:00:00-05:00"),
    )
    .unwrap();
    assert_eq!(e, at("2026-03-08T01:00:00-04:00"));
}

#[test]
fn unknown_zones_and_the_edges_of_time() {
    assert_eq!(period_at(CalendarUnit::Day, "Mars/Olympus_Mons", 0), None);
    assert_eq!(period_at(CalendarUnit::Day, "europe/berlin", 0), None);
    assert_eq!(period_at(CalendarUnit::Day, "UTC", 0), Some((0, D)));
    assert_eq!(period_at(CalendarUnit::Month, "UTC", u64::MAX), None);
}

#[test]
fn the_filters_list_is_chrono_tzs() {
    let mut names: Vec<&str> = chrono_tz::TZ_VARIANTS.iter().map(|t| t.name()).collect();
    names.sort_unstable();
    assert_eq!(TIME_ZONES, names.as_slice());
    assert!(crate::calendar::is_time_zone("Europe/Berlin"));
    assert!(crate::calendar::is_time_zone("UTC"));
    assert!(!crate::calendar::is_time_zone("Europe/berlin"));
    assert!(!crate::calendar::is_time_zone(""));
}

fn unit() -> impl Strategy<Value = CalendarUnit> {
    prop_oneof![
        Just(CalendarUnit::Day),
        Just(CalendarUnit::Week),
        Just(CalendarUnit::Month)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4_000))]

    /// Any instant from 1971 to 2100 in any zone: inside its period, which begins at the first
    /// instant of a day that is a 1st (a Monday; any day), ends where the next one begins, and
    /// is as long as its days.
    #[test]
    fn every_instant_in_every_zone_lies_in_one_period(
        zone in proptest::sample::select(TIME_ZONES),
        now in 31_536_000_000u64..4_102_444_800_000,
        unit in unit(),
    ) {
        let (s, e) = period_at(unit, zone, now).unwrap();
        prop_assert!(s <= now && now < e);
        let first = local(zone, s);
        let before = local(zone, s - 1);
        // The first instant of its local day.
        prop_assert_ne!(before.date_naive(), first.date_naive());
        match unit {
            CalendarUnit::Day => {}
            CalendarUnit::Week => prop_assert_eq!(first.weekday(), Weekday::Mon),
            CalendarUnit::Month => prop_assert_eq!(first.day(), 1),
        }
        // Midnight, unless the zone skipped it.
        prop_assert!(first.hour() == 0 && first.minute() == 0 || before.date_naive() < first.date_naive());
        // The next period begins where this one ends.
        let (next, _) = period_at(unit, zone, e).unwrap();
        prop_assert_eq!(next, e);
        prop_assert_eq!(period_at(unit, zone, e - 1).unwrap(), (s, e));
        // Days, weeks and months of their lengths, give or take the zone's changes of offset
        // (at most a day's worth over a period: zones have changed their date line).
        let days = match unit {
            CalendarUnit::Day => 1..=1,
            CalendarUnit::Week => 7..=7,
            CalendarUnit::Month => 28..=31,
        };
        let len = e - s;
        prop_assert!((*days.start() - 1) * D < len && len < (*days.end() + 1) * D, "{}", len);
    }
}
