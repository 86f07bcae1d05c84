//! Where the global buckets live: in this process, or in Redis (see [`crate::redis_store`]).

use crate::redis_store::RedisStore;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;
use tollgate_core::lease::{ColdStart, GlobalBucket, LeaseGrant, LeaseItem};
use tollgate_core::slot_lease::{Holdings, SlotAnswer, SlotItem};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("storage timed out after {0:?}")]
    Timeout(Duration),
    #[error("storage failed: {0}")]
    Failed(String),
    #[error("storage is full ({0} keys)")]
    Full(usize),
}

/// The clock the memory store's buckets run on: milliseconds since the Unix epoch as the process
/// started, advanced by the monotonic clock since. A step of the system clock does not move it: a
/// backward step would otherwise stop every bucket's refill (and extend every holding) for its
/// length, a forward one refill every bucket by it.
pub fn now_ms() -> u64 {
    static START: std::sync::OnceLock<(std::time::Instant, u64)> = std::sync::OnceLock::new();
    let (at, wall_ms) = START.get_or_init(|| {
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        (std::time::Instant::now(), wall)
    });
    wall_ms.saturating_add(at.elapsed().as_millis() as u64)
}

pub enum Store {
    Memory(MemoryStore),
    Redis(RedisStore),
}

impl Store {
    /// Serve a batch of items for `instance`, all or nothing, within the storage timeout.
    pub async fn lease(
        &self,
        instance: &str,
        items: &[LeaseItem],
        ttl_ms: u64,
    ) -> Result<Vec<LeaseGrant>, StoreError> {
        match self {
            Self::Memory(m) => m.lease(instance, items, now_ms(), ttl_ms),
            Self::Redis(r) => r.lease(instance, items, ttl_ms).await,
        }
    }

    /// Serve a batch of slot items for `instance`, all or nothing, within the storage timeout.
    pub async fn slots(
        &self,
        instance: &str,
        items: &[SlotItem],
        ttl_ms: u64,
    ) -> Result<Vec<SlotAnswer>, StoreError> {
        match self {
            Self::Memory(m) => m.slots(instance, items, now_ms(), ttl_ms),
            Self::Redis(r) => r.slots(instance, items, ttl_ms).await,
        }
    }
}

/// Buckets (and global concurrency holdings) in this process, at most `max_keys` of each; idle
/// ones are swept. A restart forgets them all: `cold` says how new ones start (the epoch is the
/// process's start), and `lost` records that a call showed this store forgot what instances
/// were using (their evidence).
pub struct MemoryStore {
    buckets: Mutex<HashMap<(String, String), GlobalBucket>>,
    /// Global concurrency keys' holdings.
    holdings: Mutex<HashMap<(String, String), Holdings>>,
    max_keys: usize,
    cold: ColdStart,
    lost: AtomicBool,
}

impl MemoryStore {
    pub fn new(max_keys: usize, cold: ColdStart) -> Self {
        Self {
            buckets: Mutex::new(HashMap::new()),
            holdings: Mutex::new(HashMap::new()),
            max_keys,
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

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), GlobalBucket>> {
        self.buckets.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn lease(
        &self,
        instance: &str,
        items: &[LeaseItem],
        now_ms: u64,
        ttl_ms: u64,
    ) -> Result<Vec<LeaseGrant>, StoreError> {
        let mut buckets = self.lock();
        let new_keys = items
            .iter()
            .filter(|i| !buckets.contains_key(&(i.limit_id.clone(), i.key.clone())))
            .count();
        if buckets.len() + new_keys > self.max_keys {
            // Make room from buckets that are as good as new, else refuse (never forget state
            // that still limits someone).
            buckets.retain(|_, b| !b.is_idle(now_ms));
            if buckets.len() + new_keys > self.max_keys {
                return Err(StoreError::Full(self.max_keys));
            }
        }
        Ok(items
            .iter()
            .map(|item| {
                let bucket = buckets
                    .entry((item.limit_id.clone(), item.key.clone()))
                    .or_insert_with(|| {
                        let evidence = item.known_ms > 0;
                        if evidence && self.cold.checks_evidence() {
                            self.lost();
                        }
                        let lost = evidence || self.lost.load(Ordering::Relaxed);
                        GlobalBucket::new(item, now_ms, ttl_ms, self.cold.for_new(lost))
                    });
                if self.cold.checks_evidence() && bucket.reconcile(item, now_ms, ttl_ms) {
                    self.lost();
                }
                bucket.lease(instance, item, now_ms, ttl_ms)
            })
            .collect())
    }

    /// Serve slot items; holdings of keys whose every holder's term ended are forgotten when
    /// room is needed. Until the store has been up for a lease term (conservative cold start),
    /// nothing new is granted: holders of before a restart declare what they keep.
    pub fn slots(
        &self,
        instance: &str,
        items: &[SlotItem],
        now_ms: u64,
        ttl_ms: u64,
    ) -> Result<Vec<SlotAnswer>, StoreError> {
        let mut holdings = self.holdings.lock().unwrap_or_else(|e| e.into_inner());
        if self.cold.checks_evidence()
            && items.iter().any(|i| {
                let known = holdings.get(&(i.limit_id.clone(), i.key.clone()));
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
        let new_keys = items
            .iter()
            .filter(|i| !holdings.contains_key(&(i.limit_id.clone(), i.key.clone())))
            .count();
        if holdings.len() + new_keys > self.max_keys {
            holdings.retain(|_, h| {
                h.prune(now_ms);
                !h.is_empty()
            });
            if holdings.len() + new_keys > self.max_keys {
                return Err(StoreError::Full(self.max_keys));
            }
        }
        Ok(items
            .iter()
            .map(|item| {
                let g = holdings
                    .entry((item.limit_id.clone(), item.key.clone()))
                    .or_default()
                    .grant(instance, &item.ask(), now_ms, ttl_ms, settled);
                SlotAnswer {
                    held: g.held,
                    share: g.share,
                    free: g.free,
                    ttl_ms,
                }
            })
            .collect())
    }
}
