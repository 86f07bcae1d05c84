//! A fixed table of state slots in a CAS store: keys map to slots by hash, so memory never grows
//! with the number of distinct client keys.
//!
//! Every slot is written once at start-up, which also gives every later write a real CAS (hosts
//! such as Envoy have no atomic create-if-absent).

use crate::store::{CasStore, StoreError};
use xxhash_rust::xxh3::xxh3_128_with_seed;

/// Seed for the key hash: fixed, so every worker VM (and every process) agrees on slots.
const KEY_SEED: u64 = 0x746f_6c6c_6761_7465; // "tollgate"

/// A stable 64-bit hash, the same in every VM and process (e.g. to name a rule's parameters).
pub fn fingerprint(bytes: &[u8]) -> u64 {
    xxh3_128_with_seed(bytes, KEY_SEED) as u64
}

/// Where a client key lives: the slot index and the tag that says whether the slot is its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotId {
    pub index: u32,
    /// Never 0: 0 marks an empty slot.
    pub tag: u64,
}

/// `len` slots named `<prefix><index>` in the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotTable {
    prefix: String,
    len: u32,
}

impl SlotTable {
    /// `prefix` must not contain `/` (nginx-like hosts read it as a zone name); `len >= 1`.
    pub fn new(prefix: String, len: u32) -> Self {
        Self {
            prefix,
            len: len.max(1),
        }
    }

    pub fn len(&self) -> u32 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The slot for a client key (any bytes, already made unambiguous by the caller).
    pub fn locate(&self, key: &[u8]) -> SlotId {
        let h = xxh3_128_with_seed(key, KEY_SEED);
        let low = h as u64;
        let high = (h >> 64) as u64;
        SlotId {
            index: (low % u64::from(self.len)) as u32,
            tag: high.max(1),
        }
    }

    /// The store key of slot `index`.
    pub fn store_key(&self, index: u32) -> String {
        format!("{}{}", self.prefix, index)
    }

    /// Create every slot that does not exist yet with `empty`; returns how many were created.
    /// Existing slots keep their state (a configuration reload of an unchanged rule).
    pub fn initialize<S: CasStore + ?Sized>(
        &self,
        store: &S,
        empty: &[u8],
    ) -> Result<u32, StoreError> {
        let mut created = 0;
        for index in 0..self.len {
            let key = self.store_key(index);
            if store.read(&key)?.is_none() {
                match store.write(&key, empty, 0) {
                    // Another worker created it between our read and write: that is fine.
                    Ok(()) | Err(StoreError::CasMismatch) => created += 1,
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(created)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    #[test]
    fn locate_is_stable_and_in_range() {
        let table = SlotTable::new("t.".into(), 100);
        let a = table.locate(b"10.0.0.1");
        assert_eq!(a, table.locate(b"10.0.0.1"));
        assert!(a.index < 100);
        assert_ne!(a.tag, 0);
        assert_ne!(a.tag, table.locate(b"10.0.0.2").tag);
    }

    #[test]
    fn initialize_creates_once_and_keeps_existing_state() {
        let store = MemoryStore::new();
        let table = SlotTable::new("t.".into(), 8);
        assert_eq!(table.initialize(&store, b"e"), Ok(8));
        store
            .write("t.3", b"x", store.read("t.3").unwrap().unwrap().1)
            .unwrap();
        assert_eq!(table.initialize(&store, b"e"), Ok(0));
        assert_eq!(store.read("t.3").unwrap().unwrap().0, b"x");
        assert_eq!(store.len(), 8);
    }
}
