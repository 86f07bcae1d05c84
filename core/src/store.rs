//! The compare-and-swap key/value store the algorithms run against, and an in-memory one.

use std::collections::HashMap;
use std::sync::Mutex;

/// Why a store operation did not happen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// The value changed since it was read: read again and retry.
    CasMismatch,
    /// The store refused or failed; the message says how.
    Unavailable(String),
}

/// A key/value store with compare-and-swap writes, like proxy-wasm shared data.
///
/// `read` returns the value and its version (`cas`). `write` succeeds only if the key's version is
/// still `cas`; `cas == 0` is only meant for keys that do not exist yet.
pub trait CasStore {
    fn read(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError>;
    fn write(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError>;
}

/// A process-local store with the strict semantics of nginx-like hosts: a write with `cas == 0`
/// to an existing key fails, as does any write with a stale `cas`.
#[derive(Default)]
pub struct MemoryStore {
    inner: Mutex<MemoryInner>,
}

#[derive(Default)]
struct MemoryInner {
    entries: HashMap<String, (Vec<u8>, u32)>,
    next_cas: u32,
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MemoryInner> {
        // A poisoned lock only means another thread panicked mid-test; the map itself is intact.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl CasStore for MemoryStore {
    fn read(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        Ok(self.lock().entries.get(key).cloned())
    }

    fn write(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
        let mut inner = self.lock();
        let current = inner.entries.get(key).map(|(_, c)| *c);
        if current != (if cas == 0 { None } else { Some(cas) }) {
            return Err(StoreError::CasMismatch);
        }
        inner.next_cas = inner.next_cas.wrapping_add(1).max(1);
        let next = inner.next_cas;
        inner.entries.insert(key.to_owned(), (value.to_vec(), next));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cas_is_checked_on_every_write() {
        let store = MemoryStore::new();
        assert_eq!(store.write("k", b"a", 0), Ok(()));
        assert_eq!(store.write("k", b"b", 0), Err(StoreError::CasMismatch));
        let (value, cas) = store.read("k").ok().flatten().unwrap_or_default();
        assert_eq!(value, b"a");
        assert_eq!(
            store.write("k", b"c", cas + 1),
            Err(StoreError::CasMismatch)
        );
        assert_eq!(store.write("k", b"c", cas), Ok(()));
        assert_eq!(store.write("k", b"d", cas), Err(StoreError::CasMismatch));
    }
}
