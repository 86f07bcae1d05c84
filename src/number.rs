//! Whole numbers as requests and responses write them: ASCII digits in a header, a JSON value
//! at a field path, or a metadata value.

use serde_json::Value;

/// A whole number: ASCII digits, surrounding whitespace ignored; one too large for 64 bits is
/// `u64::MAX`. `None` for anything else (empty, a sign, a fraction, other bytes).
pub fn whole_number(value: &[u8]) -> Option<u64> {
    let digits = value.trim_ascii();
    if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let mut n: u64 = 0;
    for &d in digits {
        match n
            .checked_mul(10)
            .and_then(|n| n.checked_add(u64::from(d - b'0')))
        {
            Some(next) => n = next,
            None => return Some(u64::MAX),
        }
    }
    Some(n)
}

/// The value at `path` in `document` (objects only).
pub fn field_at<'v>(document: &'v Value, path: &[String]) -> Option<&'v Value> {
    path.iter()
        .try_fold(document, |v, name| v.as_object()?.get(name))
}

/// A double as a whole number: none if negative, fractional, infinite or NaN (whose `fract` is
/// NaN); beyond 64 bits `u64::MAX` (a float cast saturates: 1e30 is u64::MAX).
pub fn whole_double(f: f64) -> Option<u64> {
    (f >= 0.0 && f.fract() == 0.0).then_some(f as u64)
}

/// A JSON value as a whole number: a number without fraction (`2000`, `2000.0`, `2e3`; beyond
/// 64 bits `u64::MAX`), or a string of ASCII digits.
pub fn whole(value: &Value) -> Option<u64> {
    match value {
        Value::Number(n) => n.as_u64().or_else(|| whole_double(n.as_f64()?)),
        Value::String(s) => whole_number(s.as_bytes()),
        _ => None,
    }
}

/// The whole number a metadata value holds: a string of digits, or a number. A number comes as
/// the 8 bytes of a little-endian double, a string as its bytes: the host says not which. Eight
/// printable bytes are read as a string ("business"): a whole number's double has a zero low byte
/// up to 2⁴⁵, and a plan number is far below.
pub fn metadata_number(value: &[u8]) -> Option<u64> {
    let printable = value
        .iter()
        .all(|b| b.is_ascii_graphic() || b.is_ascii_whitespace());
    if printable {
        return whole_number(value);
    }
    whole_double(f64::from_le_bytes(<[u8; 8]>::try_from(value).ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Every whole number a metadata double can carry up to 2⁴⁵ reads as itself; every
        /// double past 64 bits as the largest; a negative, fractional or non-finite one as none.
        #[test]
        fn a_metadata_double_reads_as_its_whole_number(n in any::<f64>(), whole in 0u64..(1 << 45)) {
            prop_assert_eq!(metadata_number(&(whole as f64).to_le_bytes()), Some(whole));
            let bytes = n.to_le_bytes();
            let text = bytes.iter().all(|b| b.is_ascii_graphic() || b.is_ascii_whitespace());
            let want = if text {
                whole_number(&bytes)
            } else if n.is_finite() && n >= 0.0 && n.fract() == 0.0 {
                Some(if n >= u64::MAX as f64 { u64::MAX } else { n as u64 })
            } else {
                None
            };
            prop_assert_eq!(metadata_number(&bytes), want);
        }

        /// A string of eight printable bytes is a string, never a double: digits are its number,
        /// anything else none (before: "business" read as a double, clamped to `max`).
        #[test]
        fn an_eight_byte_word_in_metadata_is_a_string(word in "[ -~]{8}") {
            prop_assert_eq!(metadata_number(word.as_bytes()), whole_number(word.as_bytes()));
        }

        /// Header numbers over the whole u64 space and past it: digits read as themselves, more
        /// digits than 64 bits hold as the largest, anything else as none.
        #[test]
        fn a_header_number_is_its_digits_or_none(n in any::<u64>(), extra in 1u32..30, junk in "[^0-9\\s]{1,4}") {
            prop_assert_eq!(whole_number(n.to_string().as_bytes()), Some(n));
            prop_assert_eq!(whole_number(format!(" {n}\t").as_bytes()), Some(n));
            let long = format!("{}{}", u64::MAX, "9".repeat(extra as usize));
            prop_assert_eq!(whole_number(long.as_bytes()), Some(u64::MAX));
            prop_assert_eq!(whole_number(format!("{n}{junk}").as_bytes()), None);
            prop_assert_eq!(whole_number(format!("-{n}").as_bytes()), None);
        }
    }

    #[test]
    fn plan_names_in_metadata_are_no_number() {
        for word in ["business", "standard", "platinum", "12345678", "  42    "] {
            let want = whole_number(word.as_bytes());
            assert_eq!(metadata_number(word.as_bytes()), want, "{word}");
        }
        assert_eq!(metadata_number(b"business"), None);
        assert_eq!(metadata_number(&3.0f64.to_le_bytes()), Some(3));
        assert_eq!(metadata_number(&1e30f64.to_le_bytes()), Some(u64::MAX));
        assert_eq!(metadata_number(&(-1.0f64).to_le_bytes()), None);
        assert_eq!(metadata_number(&f64::NAN.to_le_bytes()), None);
        assert_eq!(metadata_number(&2.5f64.to_le_bytes()), None);
    }
}
