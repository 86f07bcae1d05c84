//! A fixed table of slots in a CAS store: keys map to slots by hash, so memory never grows with
//! the number of distinct client keys.
//!
//! Slots come in groups of [`WAYS`] stored under one store key: one read finds a key's own slot,
//! a free or idle one to take, or failing that the slot to evict (see [`crate::limiter`]). Every
//! group is written once at start-up, which also gives every later write a real CAS (hosts such as
//! Envoy have no atomic create-if-absent).

use crate::state::{State, STATE_BYTES};
use crate::store::{update, CasStore, StoreError, UpdateError};
use smallvec::SmallVec;
use xxhash_rust::xxh3::xxh3_128_with_seed;

/// Slots per group.
pub const WAYS: usize = 4;
/// One slot: the owner's tag (u64 LE), when the owner was last admitted (ns, u64 LE), then the
/// algorithm state.
pub const SLOT_BYTES: usize = 16 + STATE_BYTES;
/// One group as stored.
pub const GROUP_BYTES: usize = WAYS * SLOT_BYTES;
/// The value every group starts with: every slot free.
pub const EMPTY_GROUP: [u8; GROUP_BYTES] = [0; GROUP_BYTES];

/// Seed for the key hash: fixed, so every worker VM (and every process) agrees on slots.
const KEY_SEED: u64 = 0x746f_6c6c_6761_7465; // "tollgate"

/// A stable 64-bit hash, the same in every VM and process (e.g. to name a rule's parameters).
pub fn fingerprint(bytes: &[u8]) -> u64 {
    xxh3_128_with_seed(bytes, KEY_SEED) as u64
}

/// The 128-bit hash of a client key that slots are derived from (also its name at the quota
/// service: client values never leave the proxy).
pub fn key_hash(key: &[u8]) -> u128 {
    xxh3_128_with_seed(key, KEY_SEED)
}

/// The keyed hash that places client keys: their slot group and tag, and overload rules' fairness
/// flows. Keyed by a secret of the deployment (SipHash-1-3, 128 bits), so which keys share a group
/// or a flow cannot be computed from outside, and colliding keys cannot be chosen on purpose.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct KeyPlacement {
    secret: [u8; 16],
}

impl KeyPlacement {
    pub fn new(secret: [u8; 16]) -> Self {
        Self { secret }
    }

    /// A placement keyed by any bytes (a configured secret, of any length).
    pub fn from_secret(secret: &[u8]) -> Self {
        Self::new(xxh3_128_with_seed(secret, KEY_SEED).to_le_bytes())
    }

    pub fn hash(&self, key: &[u8]) -> u128 {
        use siphasher::sip128::Hasher128;
        use std::hash::Hasher;
        let mut h = siphasher::sip128::SipHasher13::new_with_key(&self.secret);
        h.write(key);
        h.finish128().as_u128()
    }
}

impl std::fmt::Debug for KeyPlacement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never in a log line.
        f.write_str("KeyPlacement(..)")
    }
}

/// Where a client key lives: its group and the tag that marks a slot as its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct SlotId {
    pub group: u32,
    /// Never 0: 0 marks a free slot.
    pub tag: u64,
}

/// One slot, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Slot {
    /// The owning key's tag; 0 = free.
    pub tag: u64,
    /// When the owner was last admitted (ns): the least recently used of equals is evicted first.
    pub last_ns: u64,
    pub state: State,
}

/// A group's slots, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Group {
    pub slots: [Slot; WAYS],
}

impl Group {
    /// Anything that is not a group of ours (absent, another layout) reads as all free.
    pub fn decode(bytes: &[u8]) -> Self {
        let mut group = Self {
            slots: [Slot::default(); WAYS],
        };
        group.decode_from(bytes);
        group
    }

    /// [`Group::decode`] into this group; bytes that are not a group leave it as it was.
    pub fn decode_from(&mut self, bytes: &[u8]) {
        if bytes.len() == GROUP_BYTES {
            for (i, slot) in self.slots.iter_mut().enumerate() {
                let at = i * SLOT_BYTES;
                slot.tag = le_u64(&bytes[at..at + 8]);
                slot.last_ns = le_u64(&bytes[at + 8..at + 16]);
                slot.state.copy_from_slice(&bytes[at + 16..at + SLOT_BYTES]);
            }
        }
    }

    pub fn encode(&self) -> [u8; GROUP_BYTES] {
        let mut out = [0; GROUP_BYTES];
        self.encode_into(&mut out);
        out
    }

    /// [`Group::encode`] into `out`.
    pub fn encode_into(&self, out: &mut [u8; GROUP_BYTES]) {
        for (i, slot) in self.slots.iter().enumerate() {
            let at = i * SLOT_BYTES;
            out[at..at + 8].copy_from_slice(&slot.tag.to_le_bytes());
            out[at + 8..at + 16].copy_from_slice(&slot.last_ns.to_le_bytes());
            out[at + 16..at + SLOT_BYTES].copy_from_slice(&slot.state);
        }
    }
}

/// [`update`] of one slot of the group at `key`: `find` picks it (`None`: it is gone — another
/// key took it over — and nothing is written), `change` changes it and says whether to write it.
/// `Ok(None)`: no such slot (or no group at `key`).
pub fn update_slot<S, T>(
    store: &S,
    key: &str,
    attempts: u32,
    find: impl Fn(&Group) -> Option<usize>,
    mut change: impl FnMut(&mut Slot) -> (bool, T),
) -> Result<Option<T>, UpdateError>
where
    S: CasStore + ?Sized,
{
    update(store, key, attempts, |bytes| {
        let Some(bytes) = bytes else {
            return (None, None);
        };
        let mut group = Group::decode(bytes);
        let Some(i) = find(&group) else {
            return (None, None);
        };
        let (write, result) = change(&mut group.slots[i]);
        (write.then(|| group.encode()), Some(result))
    })
}

fn le_u64(bytes: &[u8]) -> u64 {
    let mut b = [0; 8];
    b.copy_from_slice(bytes);
    u64::from_le_bytes(b)
}

/// Groups named `<prefix><index>` in the store, `WAYS` slots each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotTable {
    prefix: String,
    groups: u32,
}

impl SlotTable {
    /// Room for at least `max_keys` keys. `prefix` must not contain `/` (nginx-like hosts read it
    /// as a zone name).
    pub fn new(prefix: String, max_keys: u32) -> Self {
        Self {
            prefix,
            groups: max_keys.div_ceil(WAYS as u32).max(1),
        }
    }

    pub fn groups(&self) -> u32 {
        self.groups
    }

    /// Slots in the table.
    pub fn capacity(&self) -> u64 {
        u64::from(self.groups) * WAYS as u64
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The slot group for a client key (any bytes, already made unambiguous by the caller).
    pub fn locate(&self, key: &[u8]) -> SlotId {
        self.locate_hash(key_hash(key))
    }

    /// The slot group for a client key by its [`key_hash`].
    pub fn locate_hash(&self, h: u128) -> SlotId {
        SlotId {
            group: ((h as u64) % u64::from(self.groups)) as u32,
            tag: ((h >> 64) as u64).max(1),
        }
    }

    /// The store key of group `index`.
    pub fn store_key(&self, index: u32) -> StoreKey {
        let mut digits = itoa::Buffer::new();
        let (prefix, digits) = (self.prefix.as_bytes(), digits.format(index).as_bytes());
        let len = prefix.len() + digits.len();
        if len > STORE_KEY_INLINE {
            return StoreKey([prefix, digits].concat().into());
        }
        // (Two copies into one buffer: a vector's appends cost several times as much.)
        let mut inline = [0u8; STORE_KEY_INLINE];
        inline[..prefix.len()].copy_from_slice(prefix);
        inline[prefix.len()..len].copy_from_slice(digits);
        StoreKey(SmallVec::from_buf_and_len(inline, len))
    }

    /// Create every group that does not exist yet; returns how many were created. Existing groups
    /// keep their state (a configuration reload of an unchanged rule).
    pub fn initialize<S: CasStore + ?Sized>(&self, store: &S) -> Result<u32, StoreError> {
        let mut created = 0;
        for index in 0..self.groups {
            let key = self.store_key(index);
            if store.read(key.as_str())?.is_none() {
                match store.write(key.as_str(), &EMPTY_GROUP, 0) {
                    // Another worker created it between our read and write: that is fine.
                    Ok(()) | Err(StoreError::CasMismatch) => created += 1,
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(created)
    }
}

/// A group's name in the store, built on the stack for names of usual length: a request that
/// reads a group allocates nothing for its name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreKey(SmallVec<[u8; STORE_KEY_INLINE]>);

/// Bytes of a group's name kept on the stack.
const STORE_KEY_INLINE: usize = 96;

impl StoreKey {
    pub fn as_str(&self) -> &str {
        // SAFETY: only `SlotTable::store_key` makes a key with bytes (the field is private, and
        // the default is empty): a `str` prefix followed by ASCII digits, which is UTF-8. (The
        // check would cost the request path its longest loop over the name, twice.)
        unsafe { std::str::from_utf8_unchecked(&self.0) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    #[test]
    fn locate_is_stable_and_in_range() {
        let table = SlotTable::new("t.".into(), 100);
        assert_eq!(table.groups(), 25);
        let a = table.locate(b"10.0.0.1");
        assert_eq!(a, table.locate(b"10.0.0.1"));
        assert!(a.group < 25);
        assert_ne!(a.tag, 0);
        assert_ne!(a.tag, table.locate(b"10.0.0.2").tag);
        assert_eq!(table.locate_hash(key_hash(b"10.0.0.1")), a);
        assert_eq!(table.store_key(17).as_str(), "t.17");
        // Names at, and past, what the stack holds (a rule named at length, in any script).
        for len in [
            STORE_KEY_INLINE - 10,
            STORE_KEY_INLINE - 1,
            STORE_KEY_INLINE,
            300,
        ] {
            let prefix: String = "é.".chars().cycle().take(len).collect();
            let table = SlotTable::new(prefix.clone(), 1 << 20);
            for index in [0, 7, 4_294_967_295 % table.groups(), table.groups() - 1] {
                assert_eq!(table.store_key(index).as_str(), format!("{prefix}{index}"));
            }
        }
    }

    #[test]
    fn groups_round_trip() {
        let mut g = Group::decode(&EMPTY_GROUP);
        g.slots[2] = Slot {
            tag: 7,
            last_ns: 3,
            state: [9; STATE_BYTES],
        };
        assert_eq!(Group::decode(&g.encode()), g);
        assert_eq!(Group::decode(b"short"), Group::decode(&EMPTY_GROUP));
    }

    #[test]
    fn initialize_creates_once_and_keeps_existing_state() {
        let store = MemoryStore::new();
        let table = SlotTable::new("t.".into(), 30);
        assert_eq!(table.initialize(&store), Ok(8));
        let (_, cas) = store.read("t.3").unwrap().unwrap();
        store.write("t.3", b"x", cas).unwrap();
        assert_eq!(table.initialize(&store), Ok(0));
        assert_eq!(store.read("t.3").unwrap().unwrap().0, b"x");
        assert_eq!(store.len(), 8);
    }
}
