//! Buckets and global concurrency holdings in this process.

use super::{Answers, ItemResult, StoreError};
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tollgate_core::global::lease::{ColdStart, GlobalBucket, LeaseGrant, LeaseItem};
use tollgate_core::global::permits::{Holdings, PermitAnswer, PermitItem};

/// The credential an instance name belongs to: a proxy token's name (instances `NAME/...`), or
/// "" for the shared token (or a service without one).
fn credential_of(instance: &str) -> &str {
    instance.split_once('/').map_or("", |(name, _)| name)
}

/// An entry's name: `(limit_id, key)`.
type Id = Arc<(String, String)>;

/// Entries in the order they fall idle, the earliest first: when, and which.
type IdleOrder = BTreeSet<(u64, Id)>;

/// What a [`KeyTable`] keeps: it knows from when it is as good as new, so that it can go.
trait FallsIdle {
    fn idle_at_ms(&self) -> u64;
}

impl FallsIdle for GlobalBucket {
    fn idle_at_ms(&self) -> u64 {
        self.idle_at_ms
    }
}

impl FallsIdle for Holdings {
    fn idle_at_ms(&self) -> u64 {
        Holdings::idle_at_ms(self)
    }
}

/// One entry of a [`KeyTable`]: when it falls idle as of its last change (its place in the
/// orders), and the credential that made it.
struct Entry<T> {
    value: T,
    id: Id,
    owner: Arc<str>,
    idle_at_ms: u64,
}

/// Entries by `(limit_id, key)`: at most `max_keys`, and at most `per_credential` made by any one
/// credential, so that a caller filling the store leaves room for the others'. Idle entries make
/// room; live ones are never dropped (they still limit someone). Every entry stands in two
/// orders by when it falls idle, all entries' and its maker's, so that a new key that needs room
/// drops the earliest idle entry, and one that finds none is refused, in O(log n): nothing looks
/// through the others (a credential at its share sending new keys without end held the store's
/// lock for a pass over every entry per call).
struct KeyTable<T> {
    entries: HashMap<Id, Entry<T>>,
    idle_order: IdleOrder,
    /// The entries each credential made, in the order they fall idle (its count: the length).
    made: HashMap<Arc<str>, IdleOrder>,
    max_keys: usize,
    per_credential: usize,
}

/// The earliest entry of `order`, if it is idle at `now_ms`.
fn idle_first(order: &IdleOrder, now_ms: u64) -> Option<Id> {
    order
        .first()
        .filter(|(at, _)| *at <= now_ms)
        .map(|(_, id)| id.clone())
}

/// Move `id` from its place at `was` in `order` to `now_at`.
fn reorder(order: &mut IdleOrder, id: &Id, was: u64, now_at: u64) {
    if order.remove(&(was, id.clone())) {
        order.insert((now_at, id.clone()));
    }
}

impl<T: FallsIdle> KeyTable<T> {
    fn new(max_keys: usize, per_credential: usize) -> Self {
        Self {
            entries: HashMap::new(),
            idle_order: BTreeSet::new(),
            made: HashMap::new(),
            max_keys,
            per_credential: per_credential.max(1),
        }
    }

    fn get(&self, limit_id: &str, key: &str) -> Option<&T> {
        self.entries
            .get(&(limit_id.to_owned(), key.to_owned()))
            .map(|e| &e.value)
    }

    fn get_mut(&mut self, limit_id: &str, key: &str) -> Option<&mut T> {
        self.entries
            .get_mut(&(limit_id.to_owned(), key.to_owned()))
            .map(|e| &mut e.value)
    }

    fn made_by(&self, credential: &str) -> usize {
        self.made.get(credential).map_or(0, BTreeSet::len)
    }

    fn remove(&mut self, id: &Id) {
        let Some(e) = self.entries.remove(id) else {
            return;
        };
        let place = (e.idle_at_ms, e.id);
        self.idle_order.remove(&place);
        if let Some(order) = self.made.get_mut(&e.owner) {
            order.remove(&place);
            if order.is_empty() {
                self.made.remove(&e.owner);
            }
        }
    }

    /// Room at `now_ms` for one more entry made by `credential`: at its share, its earliest idle
    /// entry goes; in a full table, the earliest idle one of all. Else why there is none.
    fn make_room(&mut self, credential: &str, now_ms: u64) -> ItemResult<()> {
        if self.made_by(credential) >= self.per_credential {
            if let Some(id) = self
                .made
                .get(credential)
                .and_then(|o| idle_first(o, now_ms))
            {
                self.remove(&id);
            }
        }
        if self.entries.len() >= self.max_keys {
            if let Some(id) = idle_first(&self.idle_order, now_ms) {
                self.remove(&id);
            }
        }
        if self.entries.len() >= self.max_keys {
            return Err(format!("storage is full ({} keys)", self.max_keys));
        }
        if self.made_by(credential) >= self.per_credential {
            return Err(format!(
                "this credential's share of the store is full ({} keys)",
                self.per_credential
            ));
        }
        Ok(())
    }

    /// `serve` the entry for `(limit_id, key)` at `now_ms`: if new, `make` it for `credential`
    /// when there is room (or can be made), else why not.
    fn serve<R>(
        &mut self,
        limit_id: &str,
        key: &str,
        credential: &str,
        now_ms: u64,
        make: impl FnOnce() -> T,
        serve: impl FnOnce(&mut T) -> R,
    ) -> ItemResult<R> {
        let id = (limit_id.to_owned(), key.to_owned());
        let entry = match self.entries.get_mut(&id) {
            Some(e) => e,
            None => {
                self.make_room(credential, now_ms)?;
                let value = make();
                let idle_at_ms = value.idle_at_ms();
                let id = Arc::new(id);
                let owner = match self.made.get_key_value(credential) {
                    Some((owner, _)) => owner.clone(),
                    None => Arc::from(credential),
                };
                self.idle_order.insert((idle_at_ms, id.clone()));
                self.made
                    .entry(owner.clone())
                    .or_default()
                    .insert((idle_at_ms, id.clone()));
                self.entries.entry(id.clone()).or_insert(Entry {
                    value,
                    id,
                    owner,
                    idle_at_ms,
                })
            }
        };
        let answer = serve(&mut entry.value);
        let idle_at_ms = entry.value.idle_at_ms();
        if idle_at_ms != entry.idle_at_ms {
            let was = std::mem::replace(&mut entry.idle_at_ms, idle_at_ms);
            reorder(&mut self.idle_order, &entry.id, was, idle_at_ms);
            if let Some(order) = self.made.get_mut(&entry.owner) {
                reorder(order, &entry.id, was, idle_at_ms);
            }
        }
        Ok(answer)
    }

    fn len(&self) -> usize {
        self.entries.len()
    }
}

/// Buckets (and global concurrency holdings) in this process, at most `max_keys` of each and
/// `per_credential` of each made by one credential; an idle one goes when a new one needs its
/// room. A restart forgets them all: `cold` says how new ones start (the epoch is the process's
/// start), and `lost` records that a call showed this store forgot what instances were using
/// (their evidence).
pub struct MemoryStore {
    buckets: Mutex<KeyTable<GlobalBucket>>,
    /// Global concurrency keys' holdings.
    holdings: Mutex<KeyTable<Holdings>>,
    cold: ColdStart,
    lost: AtomicBool,
}

impl MemoryStore {
    /// A store whose callers share its keys with no per-credential cap.
    pub fn new(max_keys: usize, cold: ColdStart) -> Self {
        Self::with_caps(max_keys, max_keys, cold)
    }

    /// `per_credential`: the most keys of each kind one credential's calls may make.
    pub fn with_caps(max_keys: usize, per_credential: usize, cold: ColdStart) -> Self {
        Self {
            buckets: Mutex::new(KeyTable::new(max_keys, per_credential)),
            holdings: Mutex::new(KeyTable::new(max_keys, per_credential)),
            cold,
            lost: AtomicBool::new(false),
        }
    }

    /// Note that instances' evidence showed this store forgot what they were using.
    fn lost(&self) {
        if !self.lost.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "a proxy's call shows this store lost state it was using (a restart): buckets \
                 and slots it does not know start conservatively until they refill"
            );
        }
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, KeyTable<GlobalBucket>> {
        self.buckets.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn lease(
        &self,
        instance: &str,
        items: &[LeaseItem],
        now_ms: u64,
        ttl_ms: u64,
    ) -> Result<Answers<LeaseGrant>, StoreError> {
        let mut buckets = self.lock();
        let credential = credential_of(instance);
        Ok(Answers::from_results(items.iter().map(|item| {
            buckets.serve(
                &item.limit_id,
                &item.key,
                credential,
                now_ms,
                || {
                    let evidence = item.known_ms > 0;
                    if evidence && self.cold.checks_evidence() {
                        self.lost();
                    }
                    let lost = evidence || self.lost.load(Ordering::Relaxed);
                    GlobalBucket::new(item, now_ms, ttl_ms, self.cold.for_new(lost))
                },
                |bucket| {
                    if self.cold.checks_evidence()
                        && bucket.reconcile(instance, item, now_ms, ttl_ms)
                    {
                        self.lost();
                    }
                    bucket.lease(instance, item, now_ms, ttl_ms)
                },
            )
        })))
    }

    /// A bucket as stored now (the admin API), and the store's epoch and whether a call showed
    /// it lost state.
    pub fn bucket(&self, limit_id: &str, key: &str) -> (Option<GlobalBucket>, Option<u64>, bool) {
        let bucket = self.lock().get(limit_id, key).cloned();
        (
            bucket,
            self.cold.epoch_ms(),
            self.lost.load(Ordering::Relaxed),
        )
    }

    /// Reset a bucket ([`GlobalBucket::reset`]); false if the store has none of that name.
    pub fn reset(&self, limit_id: &str, key: &str) -> bool {
        self.lock()
            .get_mut(limit_id, key)
            .map(GlobalBucket::reset)
            .is_some()
    }

    /// Serve slot items; holdings of keys whose every holder's term ended are forgotten when
    /// room is needed. Until the store has been up for a lease term (conservative cold start),
    /// nothing new is granted: holders of before a restart declare what they keep.
    pub fn slots(
        &self,
        instance: &str,
        items: &[PermitItem],
        now_ms: u64,
        ttl_ms: u64,
    ) -> Result<Answers<PermitAnswer>, StoreError> {
        let mut holdings = self.holdings.lock().unwrap_or_else(|e| e.into_inner());
        if self.cold.checks_evidence()
            && items.iter().any(|i| {
                let known = holdings.get(&i.limit_id, &i.key);
                Holdings::contradicts(known, instance, i.known_held, now_ms)
            })
        {
            self.lost();
        }
        let young = |epoch_ms: u64| now_ms.saturating_sub(epoch_ms) < ttl_ms;
        let settled = match self.cold {
            ColdStart::Full => true,
            ColdStart::Conservative { epoch_ms } => !young(epoch_ms),
            ColdStart::Auto { epoch_ms } => !(young(epoch_ms) && self.lost.load(Ordering::Relaxed)),
        };
        let credential = credential_of(instance);
        Ok(Answers::from_results(items.iter().map(|item| {
            holdings.serve(
                &item.limit_id,
                &item.key,
                credential,
                now_ms,
                Holdings::default,
                |held| {
                    let g = held.grant(instance, &item.ask(), now_ms, ttl_ms, settled);
                    PermitAnswer {
                        held: g.held,
                        share: g.share,
                        free: g.free,
                        ttl_ms,
                    }
                },
            )
        })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::cell::Cell;

    thread_local! {
        /// How many times a table asked an entry when it falls idle.
        static LOOKS: Cell<usize> = const { Cell::new(0) };
    }

    /// An entry that falls idle at the time it holds, and counts the looks at it.
    #[derive(Debug, Default)]
    struct Lapse(u64);

    impl FallsIdle for Lapse {
        fn idle_at_ms(&self) -> u64 {
            LOOKS.with(|n| n.set(n.get() + 1));
            self.0
        }
    }

    /// Serve `key` for `credential` at `now`: live for `lasts` ms from then.
    fn put(
        t: &mut KeyTable<Lapse>,
        credential: &str,
        key: &str,
        now: u64,
        lasts: u64,
    ) -> ItemResult<()> {
        t.serve("lim", key, credential, now, Lapse::default, |v| {
            v.0 = now + lasts
        })
    }

    fn looks() -> usize {
        LOOKS.with(Cell::take)
    }

    #[test]
    fn a_credential_at_its_share_is_answered_without_a_look_at_the_other_entries() {
        const N: usize = 20_000;
        let mut t = KeyTable::new(2 * N, N);
        for i in 0..N {
            put(&mut t, "a", &format!("a-{i}"), 0, 1_000).unwrap();
        }
        looks();
        // Its entries are all live: refused, and no entry asked (a pass over them asked each).
        assert_eq!(
            put(&mut t, "a", "new", 10, 1_000),
            Err(format!(
                "this credential's share of the store is full ({N} keys)"
            ))
        );
        assert_eq!(looks(), 0);
        put(&mut t, "b", "b-0", 10, 1_000).unwrap();
        assert_eq!(looks(), 2, "the new entry only, as made and as served");
        // They fall idle: a new key takes the place of one of them, and only of one.
        put(&mut t, "a", "new", 1_000, 1_000).unwrap();
        assert_eq!(looks(), 2);
        assert_eq!((t.len(), t.made_by("a")), (N + 1, N));
        assert_eq!(t.get("lim", "b-0").map(|v| v.0), Some(1_010));
    }

    proptest! {
        #[test]
        fn idle_entries_make_room_live_ones_stay_and_each_credential_keeps_to_its_share(
            max_keys in 1usize..8,
            per_credential in 1usize..8,
            calls in prop::collection::vec((0usize..3, 0u8..12, 0u64..4, 0u64..3), 1..200),
        ) {
            let names = ["", "a", "b"];
            let mut t = KeyTable::<Lapse>::new(max_keys, per_credential);
            let mut now = 0;
            for (who, key, lasts, step) in calls {
                now += step;
                let key = key.to_string();
                let live: Vec<(Id, Arc<str>, u64)> = t
                    .entries
                    .values()
                    .filter(|e| e.value.0 > now)
                    .map(|e| (e.id.clone(), e.owner.clone(), e.value.0))
                    .collect();
                let own = live.iter().filter(|(_, o, _)| **o == *names[who]).count();
                let expected = if t.get("lim", &key).is_some() {
                    Ok(())
                } else if live.len() >= max_keys {
                    Err(format!("storage is full ({max_keys} keys)"))
                } else if own >= per_credential {
                    Err(format!("this credential's share of the store is full ({per_credential} keys)"))
                } else {
                    Ok(())
                };
                prop_assert_eq!(put(&mut t, names[who], &key, now, lasts), expected);
                for (id, _, at) in live.iter().filter(|(id, ..)| id.1 != key) {
                    prop_assert_eq!(t.get(&id.0, &id.1).map(|v| v.0), Some(*at));
                }
                prop_assert!(t.len() <= max_keys);
                prop_assert_eq!(t.idle_order.len(), t.len());
                for e in t.entries.values() {
                    prop_assert_eq!(e.idle_at_ms, e.value.0);
                    prop_assert!(t.idle_order.contains(&(e.idle_at_ms, e.id.clone())));
                    let mine = t.made.get(&e.owner).is_some_and(|o| o.contains(&(e.idle_at_ms, e.id.clone())));
                    prop_assert!(mine);
                }
                let made: usize = t.made.values().map(BTreeSet::len).sum();
                prop_assert_eq!(made, t.len());
                prop_assert!(t.made.values().all(|o| !o.is_empty() && o.len() <= per_credential));
            }
        }
    }
}
