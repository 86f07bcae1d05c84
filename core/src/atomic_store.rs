//! A CAS store in the process's own memory, for a host whose workers are threads of one process
//! (the Envoy dynamic module): every value under a sequence lock of atomics, so a read writes
//! nothing another worker reads, and a write is one compare-and-swap of the value's version.

use crate::store::{CasStore, StoreError};
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;

/// Words of a value kept in its entry (a slot group is 192 bytes: the request path's values).
const INLINE_WORDS: usize = 24;
const INLINE_BYTES: usize = INLINE_WORDS * 8;
/// Spins on a value being written before the reader yields its thread (the writer may have been
/// preempted mid-write).
const SPINS: u32 = 64;

/// One value and its version.
struct Entry {
    /// Even: the version of the value (never 0: a CAS of 0 means "absent"). Odd: a writer
    /// holds the entry.
    seq: AtomicU32,
    len: AtomicU32,
    words: [AtomicU64; INLINE_WORDS],
    /// A value longer than the words (a rule's busiest keys, on the tick): under a lock of its
    /// own, read and written while the version says the entry is held.
    large: Mutex<Vec<u8>>,
}

impl Entry {
    fn new(value: &[u8]) -> Self {
        let entry = Self {
            seq: AtomicU32::new(1),
            len: AtomicU32::new(0),
            words: std::array::from_fn(|_| AtomicU64::new(0)),
            large: Mutex::new(Vec::new()),
        };
        entry.store(value);
        entry.seq.store(2, Ordering::Release);
        entry
    }

    /// Write `value` while holding the entry (its version odd).
    fn store(&self, value: &[u8]) {
        if value.len() > INLINE_BYTES {
            let mut large = self.large.lock().unwrap_or_else(|e| e.into_inner());
            large.clear();
            large.extend_from_slice(value);
        } else {
            let mut chunks = value.chunks_exact(8);
            for (word, chunk) in self.words.iter().zip(&mut chunks) {
                let bytes = <[u8; 8]>::try_from(chunk).unwrap_or_default();
                word.store(u64::from_le_bytes(bytes), Ordering::Relaxed);
            }
            let tail = chunks.remainder();
            if let Some(word) = self.words.get(value.len() / 8).filter(|_| !tail.is_empty()) {
                let mut bytes = [0; 8];
                bytes[..tail.len()].copy_from_slice(tail);
                word.store(u64::from_le_bytes(bytes), Ordering::Relaxed);
            }
        }
        // (Values are at most a few KiB: their length fits.)
        self.len.store(
            u32::try_from(value.len()).unwrap_or(u32::MAX),
            Ordering::Relaxed,
        );
    }

    /// Copy the value out consistently and hand it to `f` with its version.
    fn load<R>(&self, f: impl FnOnce(&[u8], u32) -> R) -> R {
        let mut buf = [0u8; INLINE_BYTES];
        let mut spins = 0;
        loop {
            let before = self.seq.load(Ordering::Acquire);
            if before & 1 == 0 {
                let len = self.len.load(Ordering::Relaxed) as usize;
                if len > INLINE_BYTES {
                    let copy = self.large.lock().unwrap_or_else(|e| e.into_inner()).clone();
                    fence(Ordering::Acquire);
                    if self.seq.load(Ordering::Relaxed) == before && copy.len() == len {
                        return f(&copy, before);
                    }
                } else {
                    // Whole words (the buffer has room for all of them), then the value's length.
                    let words = len.div_ceil(8);
                    for (word, chunk) in self.words[..words].iter().zip(buf.chunks_exact_mut(8)) {
                        if let Ok(bytes) = <&mut [u8; 8]>::try_from(chunk) {
                            *bytes = word.load(Ordering::Relaxed).to_le_bytes();
                        }
                    }
                    fence(Ordering::Acquire);
                    if self.seq.load(Ordering::Relaxed) == before {
                        return f(&buf[..len], before);
                    }
                }
            }
            spins += 1;
            if spins % SPINS == 0 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// Replace the value if its version is still `cas`.
    fn compare_and_store(&self, value: &[u8], cas: u32) -> Result<(), StoreError> {
        if cas & 1 == 1
            || self
                .seq
                .compare_exchange(cas, cas | 1, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
        {
            return Err(StoreError::CasMismatch);
        }
        fence(Ordering::Release);
        self.store(value);
        let next = match cas.wrapping_add(2) {
            0 => 2,
            n => n,
        };
        self.seq.store(next, Ordering::Release);
        Ok(())
    }
}

/// Keys are the filter's own names (rule prefixes and slot groups), never a client's: a fast
/// hash needs no protection against chosen keys.
type Map = papaya::HashMap<Box<str>, Entry, rustc_hash::FxBuildHasher>;

/// Every worker's shared state in one process: keys are made once (a write with CAS 0 to a key
/// that exists fails, as in [`crate::MemoryStore`]) and may be removed when no configuration
/// uses them any more.
pub struct AtomicStore {
    map: Map,
}

impl Default for AtomicStore {
    fn default() -> Self {
        Self::new()
    }
}

impl AtomicStore {
    pub fn new() -> Self {
        Self {
            map: papaya::HashMap::builder()
                .hasher(rustc_hash::FxBuildHasher)
                .build(),
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Remove every key that starts with `prefix` (a configuration gone, whose rules no other
    /// uses): their memory comes back once no reader holds them. Returns how many went.
    pub fn remove_prefix(&self, prefix: &str) -> usize {
        let map = self.map.pin();
        let doomed: Vec<Box<str>> = map
            .keys()
            .filter(|k| k.starts_with(prefix))
            .cloned()
            .collect();
        doomed
            .iter()
            .filter(|k| map.remove(&***k).is_some())
            .count()
    }
}

impl CasStore for AtomicStore {
    fn read(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        self.read_with(key, |found| found.map(|(bytes, cas)| (bytes.to_vec(), cas)))
    }

    fn read_with<R>(
        &self,
        key: &str,
        f: impl FnOnce(Option<(&[u8], u32)>) -> R,
    ) -> Result<R, StoreError> {
        let map = self.map.pin();
        Ok(match map.get(key) {
            Some(entry) => entry.load(|bytes, cas| f(Some((bytes, cas)))),
            None => f(None),
        })
    }

    fn write(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
        let map = self.map.pin();
        match (map.get(key), cas) {
            (Some(entry), cas) if cas != 0 => entry.compare_and_store(value, cas),
            (None, 0) => insert(&map, key, value),
            _ => Err(StoreError::CasMismatch),
        }
    }

    fn read_then_write<W: AsRef<[u8]>, R>(
        &self,
        key: &str,
        f: impl FnOnce(Option<(&[u8], u32)>) -> (Option<W>, R),
    ) -> Result<(R, Option<Result<(), StoreError>>), StoreError> {
        // (One pin and one lookup for both: the request path's read and compare-and-swap.)
        let map = self.map.pin();
        Ok(match map.get(key) {
            Some(entry) => {
                let (write, result, cas) = entry.load(|bytes, cas| {
                    let (write, result) = f(Some((bytes, cas)));
                    (write, result, cas)
                });
                let written = write.map(|bytes| entry.compare_and_store(bytes.as_ref(), cas));
                (result, written)
            }
            None => {
                let (write, result) = f(None);
                (result, write.map(|bytes| insert(&map, key, bytes.as_ref())))
            }
        })
    }
}

/// Make `key` with `value`: a race lost to another maker is a lost compare-and-swap.
fn insert(
    map: &papaya::HashMapRef<
        '_,
        Box<str>,
        Entry,
        rustc_hash::FxBuildHasher,
        papaya::LocalGuard<'_>,
    >,
    key: &str,
    value: &[u8],
) -> Result<(), StoreError> {
    match map.try_insert(Box::from(key), Entry::new(value)) {
        Ok(_) => Ok(()),
        Err(_) => Err(StoreError::CasMismatch),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::update;
    use std::sync::Arc;

    #[test]
    fn keys_are_made_once_and_written_only_with_the_version_read() {
        let store = AtomicStore::new();
        assert_eq!(store.read("k"), Ok(None));
        assert_eq!(store.write("k", b"a", 2), Err(StoreError::CasMismatch));
        assert_eq!(store.write("k", b"a", 0), Ok(()));
        assert_eq!(store.write("k", b"b", 0), Err(StoreError::CasMismatch));
        let (value, cas) = store.read("k").unwrap().unwrap();
        assert_eq!((value.as_slice(), cas), (&b"a"[..], 2));
        assert_eq!(
            store.write("k", b"c", cas + 1),
            Err(StoreError::CasMismatch)
        );
        assert_eq!(
            store.write("k", b"c", cas + 2),
            Err(StoreError::CasMismatch)
        );
        assert_eq!(store.write("k", b"c", cas), Ok(()));
        assert_eq!(store.write("k", b"d", cas), Err(StoreError::CasMismatch));
        assert_eq!(store.read("k").unwrap().unwrap(), (b"c".to_vec(), 4));
    }

    #[test]
    fn values_of_any_length_read_back_as_written() {
        let store = AtomicStore::new();
        let lengths = [0, 1, 7, 8, 9, 191, 192, 193, 5000, 3, 192, 0];
        store.write("k", b"", 0).unwrap();
        for (i, len) in lengths.into_iter().enumerate() {
            let value: Vec<u8> = (0..len).map(|j| (i * 31 + j) as u8).collect();
            let (_, cas) = store.read("k").unwrap().unwrap();
            store.write("k", &value, cas).unwrap();
            let read = store.read_with("k", |found| found.map(|(b, _)| b.to_vec()));
            assert_eq!(read.unwrap().unwrap(), value, "length {len}");
        }
    }

    #[test]
    fn a_read_then_write_writes_what_it_read_at_the_version_it_read() {
        let store = AtomicStore::new();
        let none: Option<&[u8]> = None;
        // Absent: nothing asked, nothing made; asked, made (the write of version 0).
        let (seen, written) = store.read_then_write("k", |f| (none, f.is_none())).unwrap();
        assert_eq!((seen, written, store.read("k")), (true, None, Ok(None)));
        let (_, written) = store.read_then_write("k", |_| (Some(b"a"), ())).unwrap();
        assert_eq!(written, Some(Ok(())));
        // Present: the bytes and version read, and the write made at that version.
        let (read, written) = store
            .read_then_write("k", |f| {
                let (bytes, cas) = f.unwrap();
                (Some(b"bb"), (bytes.to_vec(), cas))
            })
            .unwrap();
        assert_eq!((read, written), ((b"a".to_vec(), 2), Some(Ok(()))));
        assert_eq!(store.read("k"), Ok(Some((b"bb".to_vec(), 4))));
        // Another write between its read and its write: a lost race, that write kept.
        let (_, written) = store
            .read_then_write("k", |f| {
                let (_, cas) = f.unwrap();
                store.write("k", b"c", cas).unwrap();
                (Some(b"d"), ())
            })
            .unwrap();
        assert_eq!(written, Some(Err(StoreError::CasMismatch)));
        assert_eq!(store.read("k"), Ok(Some((b"c".to_vec(), 6))));
    }

    #[test]
    fn the_version_skips_zero_when_it_wraps() {
        let entry = Entry::new(b"x");
        entry.seq.store(u32::MAX - 1, Ordering::Relaxed);
        entry.compare_and_store(b"y", u32::MAX - 1).unwrap();
        assert_eq!(entry.seq.load(Ordering::Relaxed), 2);
        entry.load(|bytes, cas| assert_eq!((bytes, cas), (&b"y"[..], 2)));
    }

    /// Threads that add to one counter and swap a long value back and forth lose no update and
    /// never see a torn value.
    #[test]
    fn concurrent_updates_are_exact_and_reads_are_never_torn() {
        let store = Arc::new(AtomicStore::new());
        store.write("n", &0u64.to_le_bytes(), 0).unwrap();
        store.write("v", &[0u8; 300], 0).unwrap();
        let threads: Vec<_> = (0..4u8)
            .map(|t| {
                let store = Arc::clone(&store);
                std::thread::spawn(move || {
                    for i in 0..5_000u32 {
                        let added = update(&*store, "n", u32::MAX, |b| {
                            let n = u64::from_le_bytes(b.unwrap().try_into().unwrap());
                            (Some((n + 1).to_le_bytes()), ())
                        });
                        assert!(added.is_ok());
                        // A value of one byte repeated: inline (100) or large (300).
                        let len = if i % 2 == 0 { 100 } else { 300 };
                        let _ = update(&*store, "v", u32::MAX, |_| (Some(vec![t; len]), ()));
                        store
                            .read_with("v", |found| {
                                let (b, _) = found.unwrap();
                                assert!(b.iter().all(|&x| x == b[0]), "a torn read");
                            })
                            .unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let (n, _) = store.read("n").unwrap().unwrap();
        assert_eq!(u64::from_le_bytes(n.try_into().unwrap()), 20_000);
    }

    #[test]
    fn a_prefix_is_removed_and_nothing_else() {
        let store = AtomicStore::new();
        for key in [
            "tollgate.a.1.0",
            "tollgate.a.1.1",
            "tollgate.ab.1.0",
            "tollgate.b.1.0",
        ] {
            store.write(key, b"x", 0).unwrap();
        }
        assert_eq!(store.remove_prefix("tollgate.a.1."), 2);
        assert_eq!(store.len(), 2);
        assert!(store.read("tollgate.ab.1.0").unwrap().is_some());
        // Made again from scratch.
        assert_eq!(store.write("tollgate.a.1.0", b"y", 0), Ok(()));
    }
}
