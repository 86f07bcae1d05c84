//! Buckets and global concurrency holdings in this process.

use super::{Answers, ItemResult, StoreError};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use tollgate_core::global::lease::{ColdStart, GlobalBucket, LeaseGrant, LeaseItem};
use tollgate_core::global::permits::{Holdings, PermitAnswer, PermitItem};

/// The credential an instance name belongs to: a proxy token's name (instances `NAME/...`), or
/// "" for the shared token (or a service without one).
fn credential_of(instance: &str) -> &str {
    instance.split_once('/').map_or("", |(name, _)| name)
}

/// Entries by `(limit_id, key)`: at most `max_keys`, and at most `per_credential` made by any one
/// credential, so that a caller filling the store leaves room for the others'. Idle entries make
/// room; live ones are never dropped (they still limit someone).
struct KeyTable<T> {
    entries: HashMap<(String, String), (T, String)>,
    made: HashMap<String, usize>,
    max_keys: usize,
    per_credential: usize,
}

impl<T> KeyTable<T> {
    fn new(max_keys: usize, per_credential: usize) -> Self {
        Self {
            entries: HashMap::new(),
            made: HashMap::new(),
            max_keys,
            per_credential: per_credential.max(1),
        }
    }

    fn get(&self, limit_id: &str, key: &str) -> Option<&T> {
        self.entries
            .get(&(limit_id.to_owned(), key.to_owned()))
            .map(|(t, _)| t)
    }

    /// Drop the entries `idle` says are as good as new.
    fn sweep(&mut self, mut idle: impl FnMut(&mut T) -> bool) {
        let made = &mut self.made;
        self.entries.retain(|_, (t, owner)| {
            let keep = !idle(t);
            if !keep {
                if let Some(n) = made.get_mut(owner.as_str()) {
                    *n = n.saturating_sub(1);
                }
            }
            keep
        });
        made.retain(|_, n| *n > 0);
    }

    /// The entry for `(limit_id, key)`, made for `credential` if new and there is room (after
    /// one sweep per call: `swept`).
    fn entry(
        &mut self,
        limit_id: &str,
        key: &str,
        credential: &str,
        swept: &mut bool,
        mut idle: impl FnMut(&mut T) -> bool,
        make: impl FnOnce() -> T,
    ) -> ItemResult<&mut T> {
        let id = (limit_id.to_owned(), key.to_owned());
        if !self.entries.contains_key(&id) {
            let made = |t: &Self| t.made.get(credential).copied().unwrap_or(0);
            let full = |t: &Self| t.entries.len() >= t.max_keys || made(t) >= t.per_credential;
            if full(self) && !*swept {
                *swept = true;
                self.sweep(&mut idle);
            }
            if self.entries.len() >= self.max_keys {
                return Err(format!("storage is full ({} keys)", self.max_keys));
            }
            if made(self) >= self.per_credential {
                return Err(format!(
                    "this credential's share of the store is full ({} keys)",
                    self.per_credential
                ));
            }
            *self.made.entry(credential.to_owned()).or_default() += 1;
            self.entries
                .insert(id.clone(), (make(), credential.to_owned()));
        }
        match self.entries.get_mut(&id) {
            Some((t, _)) => Ok(t),
            None => Err("storage failed".into()),
        }
    }

    fn len(&self) -> usize {
        self.entries.len()
    }
}

/// Buckets (and global concurrency holdings) in this process, at most `max_keys` of each and
/// `per_credential` of each made by one credential; idle ones are swept. A restart forgets them
/// all: `cold` says how new ones start (the epoch is the process's start), and `lost` records
/// that a call showed this store forgot what instances were using (their evidence).
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
        let mut swept = false;
        Ok(Answers::from_results(items.iter().map(|item| {
            let bucket = buckets.entry(
                &item.limit_id,
                &item.key,
                credential,
                &mut swept,
                |b| b.is_idle(now_ms),
                || {
                    let evidence = item.known_ms > 0;
                    if evidence && self.cold.checks_evidence() {
                        self.lost();
                    }
                    let lost = evidence || self.lost.load(Ordering::Relaxed);
                    GlobalBucket::new(item, now_ms, ttl_ms, self.cold.for_new(lost))
                },
            )?;
            if self.cold.checks_evidence() && bucket.reconcile(item, now_ms, ttl_ms) {
                self.lost();
            }
            Ok(bucket.lease(instance, item, now_ms, ttl_ms))
        })))
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
        let mut swept = false;
        Ok(Answers::from_results(items.iter().map(|item| {
            let held = holdings.entry(
                &item.limit_id,
                &item.key,
                credential,
                &mut swept,
                |h| {
                    h.prune(now_ms);
                    h.is_empty()
                },
                Holdings::default,
            )?;
            let g = held.grant(instance, &item.ask(), now_ms, ttl_ms, settled);
            Ok(PermitAnswer {
                held: g.held,
                share: g.share,
                free: g.free,
                ttl_ms,
            })
        })))
    }
}
