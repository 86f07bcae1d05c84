//! Durations as the configuration writes them: `<whole number><unit>`, unit one of ms, s, m, h, d;
//! and a limit's `per`, a duration or a calendar period.

use serde::de::{self, Deserializer};
use serde::Deserialize;
use tollgate_core::calendar::CalendarUnit;

/// The longest accepted duration.
const MAX_NS: u64 = 366 * 86_400_000_000_000;

/// A positive duration of at most 366 days.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Period {
    pub ns: u64,
}

impl Period {
    pub fn parse(s: &str) -> Option<Self> {
        let split = s.find(|c: char| !c.is_ascii_digit())?;
        let (digits, unit) = s.split_at(split);
        let n: u64 = digits.parse().ok()?;
        let unit_ns: u64 = match unit {
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60_000_000_000,
            "h" => 3_600_000_000_000,
            "d" => 86_400_000_000_000,
            _ => return None,
        };
        let ns = n.checked_mul(unit_ns)?;
        (ns > 0 && ns <= MAX_NS).then_some(Self { ns })
    }

    /// Whole milliseconds, at least 1.
    pub fn ms(self) -> u64 {
        (self.ns / 1_000_000).max(1)
    }
}

impl<'de> Deserialize<'de> for Period {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Self::parse(&s).ok_or_else(|| {
            de::Error::custom(format!(
                "invalid duration {s:?} (expected a positive whole number and a unit: ms, s, m, h \
                 or d, at most 366d, e.g. \"250ms\", \"1m\")"
            ))
        })
    }
}

/// A limit's `per`: a duration, or a calendar period (`"day"`, `"week"`, `"month"`: a calendar
/// quota, with `calendar` beside it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Per {
    Duration(Period),
    Calendar(CalendarUnit),
}

impl Per {
    /// The period's length (ns); a calendar period's nominal one (a day, 7 days, 31 days).
    pub fn ns(self) -> u64 {
        match self {
            Self::Duration(p) => p.ns,
            Self::Calendar(unit) => unit.nominal_ms() * 1_000_000,
        }
    }
}

impl<'de> Deserialize<'de> for Per {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if let Some(unit) = CalendarUnit::parse(&s) {
            return Ok(Self::Calendar(unit));
        }
        Period::parse(&s).map(Self::Duration).ok_or_else(|| {
            de::Error::custom(format!(
                "invalid duration {s:?} (expected a positive whole number and a unit: ms, s, m, h or \
                 d, at most 366d, e.g. \"250ms\", \"1m\"; or, with \"calendar\", \"day\", \
                 \"week\" or \"month\")"
            ))
        })
    }
}

/// Nanoseconds in the largest unit that divides them: "250ms", "1m".
pub fn format_duration(ns: u64) -> String {
    const UNITS: [(u64, &str); 5] = [
        (86_400_000_000_000, "d"),
        (3_600_000_000_000, "h"),
        (60_000_000_000, "m"),
        (1_000_000_000, "s"),
        (1_000_000, "ms"),
    ];
    for (unit, name) in UNITS {
        if ns % unit == 0 && ns >= unit {
            return format!("{}{name}", ns / unit);
        }
    }
    format!("{ns}ns")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(Period::parse("250ms"), Some(Period { ns: 250_000_000 }));
        assert_eq!(
            Period::parse("1d"),
            Some(Period {
                ns: 86_400_000_000_000
            })
        );
        for bad in [
            "",
            "5",
            "5x",
            "0s",
            "-1s",
            "1.5s",
            " 1s",
            "1S",
            "367d",
            "99999999999999999999d",
        ] {
            assert_eq!(Period::parse(bad), None, "{bad:?}");
        }
        assert_eq!(format_duration(90_000_000_000), "90s");
        assert_eq!(format_duration(3_600_000_000_000), "1h");
        assert_eq!(format_duration(1_500_000), "1500000ns");
    }
}
