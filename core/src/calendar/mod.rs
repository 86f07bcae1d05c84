//! Calendar periods — a day, a week from Monday, a month — in a time zone: where a calendar
//! quota's period begins and ends (the quota service's side, with the `calendar` feature), and
//! which names the filter accepts.

mod zones;

pub use zones::TIME_ZONES;

/// A calendar quota's period.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CalendarUnit {
    /// From midnight to midnight.
    Day,
    /// From Monday's midnight to the next (ISO 8601 weeks).
    Week,
    /// From midnight on the 1st to midnight on the next 1st.
    Month,
}

impl CalendarUnit {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "day" => Some(Self::Day),
            "week" => Some(Self::Week),
            "month" => Some(Self::Month),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Day => "day",
            Self::Week => "week",
            Self::Month => "month",
        }
    }

    /// The period's nominal length (ms): a day, 7 days, 31 days. What a calendar item sends as
    /// `per_ms`; its real bounds are the service's to compute.
    pub fn nominal_ms(self) -> u64 {
        const DAY_MS: u64 = 86_400_000;
        match self {
            Self::Day => DAY_MS,
            Self::Week => 7 * DAY_MS,
            Self::Month => 31 * DAY_MS,
        }
    }
}

/// Whether `name` is a time zone a calendar quota may name: an IANA name (`Europe/Berlin`,
/// `America/New_York`, `UTC`), spelt exactly.
pub fn is_time_zone(name: &str) -> bool {
    TIME_ZONES.binary_search(&name).is_ok()
}

#[cfg(any(feature = "calendar", test))]
mod bounds;

#[cfg(any(feature = "calendar", test))]
pub use bounds::{period_at, rfc3339_ms};
