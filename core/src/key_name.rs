//! A client key's bytes and its name at the quota service, made the same way by the filter and by
//! the service's RLS descriptors that share a filter rule's bucket.

use siphasher::sip128::{Hasher128, SipHasher24};
use smallvec::SmallVec;
use std::hash::Hasher;

/// A rule's bucket key for one request: on the stack for keys of usual length.
pub type KeyBytes = SmallVec<[u8; 128]>;

/// Append one part: `1, len (u32 LE), value` if present, `0` if absent.
pub fn push_key_part(key: &mut KeyBytes, value: Option<&[u8]>) {
    match value {
        Some(v) => {
            // A value longer than 4 GiB cannot reach a filter; saturate rather than wrap.
            let len = u32::try_from(v.len()).unwrap_or(u32::MAX).to_le_bytes();
            // (The marker and the length in one append: each append checks where the key lives.)
            key.extend_from_slice(&[1, len[0], len[1], len[2], len[3]]);
            key.extend_from_slice(v);
        }
        None => key.push(0),
    }
}

/// The name of a client key (its [`crate::slot::key_hash`]) at the quota service: keyed by the
/// deployment's secret (SipHash-2-4) when there is one.
pub fn service_key(secret: Option<[u8; 16]>, key: u128) -> u128 {
    match secret {
        Some(secret) => {
            let mut h = SipHasher24::new_with_key(&secret);
            h.write(&key.to_le_bytes());
            h.finish128().as_u128()
        }
        None => key,
    }
}

/// The secret client keys' names are keyed by: from `key_secret` (the filter's
/// `quota_service.key_secret`), else from the token every proxy of a deployment holds.
pub fn key_secret(key_secret: Option<&str>, token: Option<&str>) -> Option<[u8; 16]> {
    match key_secret {
        Some(secret) => Some(crate::slot::key_hash(secret.as_bytes()).to_le_bytes()),
        None => token.map(|token| {
            let mut bytes = b"tollgate key names\0".to_vec();
            bytes.extend_from_slice(token.as_bytes());
            crate::slot::key_hash(&bytes).to_le_bytes()
        }),
    }
}
