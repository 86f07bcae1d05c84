//! The proxy-wasm header-map wire format: a pair count, each pair's key and value lengths, then
//! every key and value followed by a NUL byte (all integers u32 little-endian).

/// Append `pairs` to `out` in the wire format.
pub fn serialize<'a, I>(pairs: I, out: &mut Vec<u8>)
where
    I: Iterator<Item = (&'a [u8], &'a [u8])> + Clone,
{
    let len32 = |n: usize| u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes();
    out.extend_from_slice(&len32(pairs.clone().count()));
    for (k, v) in pairs.clone() {
        out.extend_from_slice(&len32(k.len()));
        out.extend_from_slice(&len32(v.len()));
    }
    for (k, v) in pairs {
        out.extend_from_slice(k);
        out.push(0);
        out.extend_from_slice(v);
        out.push(0);
    }
}

/// The pairs of a wire-format map, or `None` if the bytes are not one.
pub fn deserialize(bytes: &[u8]) -> Option<Vec<(&[u8], &[u8])>> {
    Some(pairs(bytes)?.collect())
}

/// The pairs of a wire-format map as they are read (nothing allocated), or `None` if the bytes
/// are not one: every pair is checked before the first is handed out.
pub fn pairs(bytes: &[u8]) -> Option<Pairs<'_>> {
    let all = Pairs {
        bytes,
        left: u32_at(bytes, 0)?,
        sizes_at: 4,
        data_at: u32_at(bytes, 0)?.checked_mul(8)?.checked_add(4)?,
    };
    let mut check = all.clone();
    for _ in 0..all.left {
        check.pair()?;
    }
    (check.data_at <= bytes.len()).then_some(all)
}

fn u32_at(bytes: &[u8], at: usize) -> Option<usize> {
    let b = bytes.get(at..at.checked_add(4)?)?;
    usize::try_from(u32::from_le_bytes([b[0], b[1], b[2], b[3]])).ok()
}

/// A wire-format map's pairs (see [`pairs`]).
#[derive(Clone)]
pub struct Pairs<'a> {
    bytes: &'a [u8],
    left: usize,
    sizes_at: usize,
    data_at: usize,
}

impl<'a> Pairs<'a> {
    fn pair(&mut self) -> Option<(&'a [u8], &'a [u8])> {
        let bytes = self.bytes;
        let k_len = u32_at(bytes, self.sizes_at)?;
        let v_len = u32_at(bytes, self.sizes_at.checked_add(4)?)?;
        self.sizes_at = self.sizes_at.checked_add(8)?;
        let k = bytes.get(self.data_at..self.data_at.checked_add(k_len)?)?;
        self.data_at = self.data_at.checked_add(k_len)?.checked_add(1)?;
        let v = bytes.get(self.data_at..self.data_at.checked_add(v_len)?)?;
        self.data_at = self.data_at.checked_add(v_len)?.checked_add(1)?;
        Some((k, v))
    }
}

impl<'a> Iterator for Pairs<'a> {
    type Item = (&'a [u8], &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        self.pair()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_documented_layout() {
        let mut out = Vec::new();
        serialize([(&b"a"[..], &b"bc"[..])].into_iter(), &mut out);
        assert_eq!(out, b"\x01\0\0\0\x01\0\0\0\x02\0\0\0a\0bc\0");
        let mut empty = Vec::new();
        serialize(std::iter::empty(), &mut empty);
        assert_eq!(empty, [0, 0, 0, 0]);
    }

    proptest! {
        #[test]
        fn round_trips(pairs in proptest::collection::vec(
            (proptest::collection::vec(any::<u8>(), 0..16), proptest::collection::vec(any::<u8>(), 0..16)), 0..8)) {
            let mut out = Vec::new();
            serialize(pairs.iter().map(|(k, v)| (&k[..], &v[..])), &mut out);
            let back = deserialize(&out).unwrap();
            prop_assert_eq!(back.len(), pairs.len());
            for ((k, v), (bk, bv)) in pairs.iter().zip(back) {
                prop_assert_eq!(&k[..], bk);
                prop_assert_eq!(&v[..], bv);
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = deserialize(&bytes);
        }
    }
}
