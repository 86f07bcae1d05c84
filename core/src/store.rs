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

    /// [`CasStore::read`], with the bytes lent to `f` rather than returned: a store in the
    /// process's own memory ([`crate::AtomicStore`]) copies them onto the stack, so the request
    /// path reads without a heap allocation.
    fn read_with<R>(
        &self,
        key: &str,
        f: impl FnOnce(Option<(&[u8], u32)>) -> R,
    ) -> Result<R, StoreError> {
        let found = self.read(key)?;
        Ok(f(found.as_ref().map(|(bytes, cas)| (&bytes[..], *cas))))
    }

    /// [`CasStore::read_with`], then the bytes `f` returns (if any) written with the version
    /// read, and the write's result: one attempt of a read-modify-write. A store in the
    /// process's own memory ([`crate::AtomicStore`]) looks the key up once for both.
    fn read_then_write<W: AsRef<[u8]>, R>(
        &self,
        key: &str,
        f: impl FnOnce(Option<(&[u8], u32)>) -> (Option<W>, R),
    ) -> Result<(R, Option<Result<(), StoreError>>), StoreError> {
        let mut cas = 0;
        let (write, result) = self.read_with(key, |found| {
            cas = found.map_or(0, |(_, cas)| cas);
            f(found)
        })?;
        let written = write.map(|bytes| self.write(key, bytes.as_ref(), cas));
        Ok((result, written))
    }
}

/// Why [`update`] gave up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpdateError {
    /// The store refused or failed.
    Unavailable(String),
    /// Every attempt lost its race to another writer.
    Contended,
}

/// The one read-modify-write: read `key`, let `next` compute from its value (`None`: no such key)
/// the bytes to write (`None`: leave it as it is) and a result, and write them with the read's
/// CAS; on a lost race, again from a fresh read, at most `attempts` times.
pub fn update<S, V, T>(
    store: &S,
    key: &str,
    attempts: u32,
    mut next: impl FnMut(Option<&[u8]>) -> (Option<V>, T),
) -> Result<T, UpdateError>
where
    S: CasStore + ?Sized,
    V: AsRef<[u8]>,
{
    for _ in 0..attempts {
        let read = store.read_with(key, |found| {
            let cas = found.map_or(0, |(_, cas)| cas);
            let (value, result) = next(found.map(|(bytes, _)| bytes));
            (value, result, cas)
        });
        let (value, result, cas) = match read {
            Ok(read) => read,
            Err(StoreError::Unavailable(e)) => return Err(UpdateError::Unavailable(e)),
            Err(StoreError::CasMismatch) => continue,
        };
        let Some(value) = value else {
            return Ok(result);
        };
        match store.write(key, value.as_ref(), cas) {
            Ok(()) => return Ok(result),
            Err(StoreError::CasMismatch) => continue,
            Err(StoreError::Unavailable(e)) => return Err(UpdateError::Unavailable(e)),
        }
    }
    Err(UpdateError::Contended)
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
    fn an_update_reads_again_after_a_lost_race_and_gives_up_after_its_attempts() {
        let store = MemoryStore::new();
        // Absent: the function sees nothing and writes the first value.
        let first = update(&store, "k", 4, |v| (Some(*b"1"), v.is_none()));
        assert_eq!(first, Ok(true));
        // A writer that sneaks in before each write makes every attempt lose.
        let mut tries = 0;
        let lost = update(&store, "k", 3, |v| {
            tries += 1;
            let (_, cas) = store.read("k").unwrap().unwrap();
            store.write("k", b"x", cas).unwrap();
            (Some(v.map(<[u8]>::to_vec).unwrap_or_default()), ())
        });
        assert_eq!((lost, tries), (Err(UpdateError::Contended), 3));
        // Nothing to write: the value stays as it is.
        assert_eq!(update(&store, "k", 1, |_| (None::<[u8; 0]>, 7)), Ok(7));
        assert_eq!(store.read("k").unwrap().unwrap().0, b"x");
    }

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
