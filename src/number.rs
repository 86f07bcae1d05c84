//! Whole numbers as requests and responses write them: ASCII digits in a header, or a JSON value
//! at a field path.

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

/// A JSON value as a whole number: a number without fraction (`2000`, `2000.0`, `2e3`; beyond
/// 64 bits `u64::MAX`), or a string of ASCII digits.
pub fn whole(value: &Value) -> Option<u64> {
    match value {
        Value::Number(n) => n.as_u64().or_else(|| {
            let f = n.as_f64()?;
            // A float cast saturates: 1e30 is u64::MAX.
            (f >= 0.0 && f.fract() == 0.0).then_some(f as u64)
        }),
        Value::String(s) => whole_number(s.as_bytes()),
        _ => None,
    }
}
