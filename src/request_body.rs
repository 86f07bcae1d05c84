//! A request's JSON body as the rules read it: its size, and the fields they name, from the bytes
//! the host buffered (at most the configuration's `max_request_body_bytes`).

use crate::number::{field_at, whole};
use serde_json::Value;

/// The request body, read once when the host has buffered it.
#[derive(Debug, Default)]
pub struct RequestBody {
    /// How many bytes the body had (as far as it was seen).
    bytes: u64,
    /// Longer than the configuration buffers: its fields are not read.
    cut: bool,
    /// The body as JSON; `None`: cut, empty, or not JSON.
    document: Option<Value>,
}

/// What a body says of a field named as a key part.
#[derive(Debug, PartialEq, Eq)]
pub enum BodyPart {
    /// The field's value as a key part.
    Value(Vec<u8>),
    /// The body was read and the field is absent (or null, an array, an object), or there is
    /// no body.
    Absent,
    /// A body came but could not be read: cut, or not strict JSON (an upstream may read it
    /// all the same: `NaN`, `1e400`, a byte-order mark).
    Unreadable,
}

impl RequestBody {
    /// `bytes` of the body's `total` bytes were buffered; `cut`: the body went on past them.
    pub fn read(buffered: &[u8], total: u64, cut: bool) -> Self {
        // Bounded by the buffered bytes; serde_json refuses nesting deeper than 128 levels
        // instead of recursing without end.
        let document = (!cut)
            .then(|| serde_json::from_slice(buffered).ok())
            .flatten();
        Self {
            bytes: total,
            cut,
            document,
        }
    }

    fn field(&self, path: &[String]) -> Option<&Value> {
        field_at(self.document.as_ref()?, path)
    }

    /// A body came that the rules cannot read: cut (longer than they keep, stalled, too slow),
    /// or not strict JSON. What a lenient upstream reads in it is unknown: the worst case.
    pub fn unreadable(&self) -> bool {
        self.cut || (self.bytes > 0 && self.document.is_none())
    }

    /// A field as a key part, or why there is none.
    pub fn part(&self, path: &[String]) -> BodyPart {
        if self.unreadable() {
            return BodyPart::Unreadable;
        }
        self.text(path).map_or(BodyPart::Absent, BodyPart::Value)
    }

    /// A field as a key part: a string's bytes, a number or boolean as JSON writes it; `None`
    /// when absent, null, an array or an object.
    pub fn text(&self, path: &[String]) -> Option<Vec<u8>> {
        match self.field(path)? {
            Value::String(s) => Some(s.as_bytes().to_vec()),
            Value::Number(n) => Some(n.to_string().into_bytes()),
            Value::Bool(b) => Some(if *b {
                b"true".to_vec()
            } else {
                b"false".to_vec()
            }),
            _ => None,
        }
    }

    /// A field as a whole number: a JSON number without fraction (`2000`, `2000.0`, `2e3`), or a
    /// string of ASCII digits; `None` for anything else. Numbers beyond 64 bits are `u64::MAX`.
    pub fn number(&self, path: &[String]) -> Option<u64> {
        whole(self.field(path)?)
    }

    /// The cost of a rule whose cost comes from the body: the largest whole number among
    /// `fields`, else `default`, plus the body's bytes divided by `input_bytes_per_token`
    /// (rounded up), kept within `min..=max`. A body that cannot be read costs `max`: a
    /// lenient upstream may read `max_tokens` in it where the strict reading sees none.
    pub fn cost(
        &self,
        fields: &[Vec<String>],
        input_bytes_per_token: Option<u64>,
        (default, min, max): (u64, u64, u64),
    ) -> u64 {
        if self.unreadable() {
            return max;
        }
        let output = fields
            .iter()
            .filter_map(|f| self.number(f))
            .max()
            .unwrap_or(default);
        let input = input_bytes_per_token.map_or(0, |per| self.bytes.div_ceil(per.max(1)));
        output.saturating_add(input).clamp(min, max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn path(p: &str) -> Vec<String> {
        p.split('.').map(str::to_owned).collect()
    }

    fn body(json: &str) -> RequestBody {
        RequestBody::read(json.as_bytes(), json.len() as u64, false)
    }

    #[test]
    fn fields_as_numbers_and_key_text() {
        let b = body(
            r#"{"model":"gpt-4o","max_tokens":300,"max_completion_tokens":"900",
                "generationConfig":{"maxOutputTokens":2e3},"n":-1,"f":1.5,"t":true,
                "o":{},"big":1e30}"#,
        );
        assert_eq!(b.text(&path("model")).as_deref(), Some(&b"gpt-4o"[..]));
        assert_eq!(b.text(&path("max_tokens")).as_deref(), Some(&b"300"[..]));
        assert_eq!(b.text(&path("t")).as_deref(), Some(&b"true"[..]));
        assert_eq!(b.text(&path("o")), None);
        assert_eq!(b.text(&path("absent")), None);
        assert_eq!(b.text(&path("model.x")), None);
        assert_eq!(b.number(&path("max_tokens")), Some(300));
        assert_eq!(b.number(&path("max_completion_tokens")), Some(900));
        assert_eq!(
            b.number(&path("generationConfig.maxOutputTokens")),
            Some(2000)
        );
        assert_eq!(b.number(&path("n")), None);
        assert_eq!(b.number(&path("f")), None);
        assert_eq!(b.number(&path("model")), None);
        assert_eq!(b.number(&path("big")), Some(u64::MAX));
    }

    #[test]
    fn costs_take_the_largest_field_and_the_input_estimate() {
        let json = r#"{"max_tokens":300,"max_completion_tokens":900,"messages":"0123456789"}"#;
        let b = body(json);
        let fields = [path("max_tokens"), path("max_completion_tokens")];
        // The larger of the two fields: a client cannot lower its reservation with one of them.
        assert_eq!(b.cost(&fields, None, (50, 1, 5_000)), 900);
        let input = (json.len() as u64).div_ceil(4);
        assert_eq!(b.cost(&fields, Some(4), (50, 1, 5_000)), 900 + input);
        assert_eq!(b.cost(&fields, Some(4), (50, 1, 910)), 910);
        assert_eq!(b.cost(&[path("absent")], None, (50, 1, 5_000)), 50);
        // Not strict JSON, or cut short: the most (an upstream may read more in it).
        let not_json = RequestBody::read(b"max_tokens=3", 12, false);
        assert_eq!(not_json.cost(&fields, None, (50, 1, 5_000)), 5_000);
        for lenient in [
            &br#"{"max_tokens":NaN}"#[..],
            br#"{"max_tokens":1e400}"#,
            b"\xef\xbb\xbf{\"max_tokens\":50000}",
            br#"{"max_tokens":50000,}"#,
        ] {
            let b = RequestBody::read(lenient, lenient.len() as u64, false);
            assert!(b.unreadable());
            assert_eq!(b.cost(&fields, None, (50, 1, 5_000)), 5_000);
            assert_eq!(b.part(&path("max_tokens")), BodyPart::Unreadable);
        }
        // Read: duplicate names, the last wins (as Python and Node read them); names are
        // case-sensitive.
        let dup = body(r#"{"max_tokens":10,"max_tokens":4000,"MAX_TOKENS":9}"#);
        assert_eq!(dup.cost(&fields, None, (50, 1, 5_000)), 4_000);
        assert_eq!(body("").part(&path("model")), BodyPart::Absent);
        let cut = RequestBody::read(br#"{"max_tokens":3"#, 1 << 30, true);
        assert_eq!(cut.cost(&fields, None, (50, 1, 5_000)), 5_000);
        assert_eq!(cut.text(&path("max_tokens")), None);
    }

    proptest! {
        /// A field over the whole u64 and f64 space reads as the whole number it writes:
        /// itself, the largest past 64 bits, none if negative or fractional; a number past a
        /// double's range makes the body unreadable (the most).
        #[test]
        fn any_field_number_reads_as_its_whole_number(n in any::<u64>(), f in any::<f64>()) {
            let fields = [path("max_tokens")];
            let b = body(&format!(r#"{{"max_tokens":{n}}}"#));
            prop_assert_eq!(b.number(&fields[0]), Some(n));
            prop_assert_eq!(b.cost(&fields, None, (0, 0, u64::MAX)), n);
            if f.is_finite() {
                let text = format!("{f:e}");
                let b = body(&format!(r#"{{"max_tokens":{text}}}"#));
                // (As the JSON reader rounds the text: it may be a neighbour of `f`.)
                let f: f64 = serde_json::from_str(&text).unwrap();
                let want = (f >= 0.0 && f.fract() == 0.0)
                    .then_some(if f >= u64::MAX as f64 { u64::MAX } else { f as u64 });
                prop_assert_eq!(b.number(&fields[0]), want);
                prop_assert!(!b.unreadable());
            }
            let past = body(r#"{"max_tokens":1e400}"#);
            prop_assert_eq!(past.cost(&fields, None, (5, 1, 7)), 7);
        }

        #[test]
        fn any_bytes_give_a_cost_within_bounds(
            bytes in proptest::collection::vec(any::<u8>(), 0..300),
            min in 0u64..100,
            extra in 0u64..10_000,
        ) {
            let max = min + extra;
            let b = RequestBody::read(&bytes, bytes.len() as u64, false);
            let cost = b.cost(&[path("max_tokens")], Some(1), (max, min, max));
            prop_assert!((min..=max).contains(&cost));
            let _ = b.text(&path("model"));
        }

        #[test]
        fn deep_nesting_is_refused_not_overflowed(depth in 1usize..5_000) {
            let json = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
            let b = RequestBody::read(json.as_bytes(), json.len() as u64, false);
            prop_assert_eq!(b.number(&path("max_tokens")), None);
        }
    }
}
