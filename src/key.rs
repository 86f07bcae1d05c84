//! Bucket keys: each part's value tagged and length-prefixed, so that no two different combinations
//! of values (or of present and absent parts) give the same bytes. Values are bytes, never text.

pub use tollgate_core::key_name::{push_key_part, service_key, KeyBytes};

/// What [`parts`] reads for a part [`push_unreadable_part`] wrote: bytes no configured value (UTF-8)
/// equals.
pub const UNREADABLE_PART: &[u8] = b"\xff(unreadable body)";

/// Append a `body:` part of a body that came but cannot be read: `2`, distinct from every value
/// and from an absent part, so such requests share one bucket.
pub fn push_unreadable_part(key: &mut KeyBytes) {
    key.push(2);
}

/// Key bytes from part values, as requests make them (for override values).
pub fn encode_key<'v>(values: impl Iterator<Item = Option<&'v [u8]>>) -> Vec<u8> {
    let mut key = KeyBytes::new();
    for value in values {
        push_key_part(&mut key, value);
    }
    key.into_vec()
}

/// The part values of key bytes (as [`push_key_part`] wrote them): `Some(value)` or `None` for an
/// absent part. Bytes that are not such a key end the parts early.
pub fn parts(mut key: &[u8]) -> impl Iterator<Item = Option<&[u8]>> {
    std::iter::from_fn(move || {
        let (&tag, rest) = key.split_first()?;
        if tag == 0 {
            key = rest;
            return Some(None);
        }
        if tag == 2 {
            key = rest;
            return Some(Some(UNREADABLE_PART));
        }
        let len = usize::try_from(u32::from_le_bytes(rest.get(..4)?.try_into().ok()?)).ok()?;
        let value = rest.get(4..4 + len)?;
        key = &rest[4 + len..];
        Some(Some(value))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Different part values (present or absent) never encode to the same key.
        #[test]
        fn keys_are_unambiguous(
            a in proptest::collection::vec(proptest::option::of(proptest::collection::vec(any::<u8>(), 0..8)), 0..4),
            b in proptest::collection::vec(proptest::option::of(proptest::collection::vec(any::<u8>(), 0..8)), 0..4),
        ) {
            let encode = |v: &Vec<Option<Vec<u8>>>| encode_key(v.iter().map(|p| p.as_deref()));
            prop_assert_eq!(a == b, encode(&a) == encode(&b));
        }

        /// Parts read back from key bytes are the values they were made of.
        #[test]
        fn parts_read_back(
            a in proptest::collection::vec(proptest::option::of(proptest::collection::vec(any::<u8>(), 0..8)), 0..4),
        ) {
            let key = encode_key(a.iter().map(|p| p.as_deref()));
            let back: Vec<Option<Vec<u8>>> = parts(&key).map(|p| p.map(<[u8]>::to_vec)).collect();
            prop_assert_eq!(back, a);
        }

        #[test]
        fn any_bytes_are_safe(bytes in proptest::collection::vec(any::<u8>(), 0..40)) {
            let _ = parts(&bytes).count();
        }
    }
}
