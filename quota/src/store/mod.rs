//! Where the global buckets live — the contract both stores keep (an answer per item, or that
//! item's refusal): in this process ([`memory`]) or in Redis ([`redis`]); `main.rs` picks one.

pub mod memory;
pub mod redis;

pub use memory::MemoryStore;
use redis::RedisStore;
use std::time::Duration;
use tollgate_core::global::lease::{GlobalBucket, LeaseGrant, LeaseItem};
use tollgate_core::global::permits::{PermitAnswer, PermitItem};

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("storage timed out after {0:?}")]
    Timeout(Duration),
    #[error("storage failed: {0}")]
    Failed(String),
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

// One per process: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub enum Store {
    Memory(MemoryStore),
    Redis(RedisStore),
}

impl Store {
    /// Serve a batch of items for `instance` within the storage timeout: an answer per item, or
    /// why that item alone was refused; an error if none could be served.
    pub async fn lease(
        &self,
        instance: &str,
        items: &[LeaseItem],
        ttl_ms: u64,
    ) -> Result<Answers<LeaseGrant>, StoreError> {
        match self {
            Self::Memory(m) => m.lease(instance, items, now_ms(), ttl_ms),
            Self::Redis(r) => Ok(r.lease(instance, items, ttl_ms).await?.into()),
        }
    }

    /// Serve a batch of slot items for `instance`, as [`Store::lease`].
    pub async fn slots(
        &self,
        instance: &str,
        items: &[PermitItem],
        ttl_ms: u64,
    ) -> Result<Answers<PermitAnswer>, StoreError> {
        match self {
            Self::Memory(m) => m.slots(instance, items, now_ms(), ttl_ms),
            Self::Redis(r) => Ok(r.slots(instance, items, ttl_ms).await?.into()),
        }
    }
}

/// One bucket as stored now, for an operator (the admin API).
#[derive(Debug, Clone, PartialEq)]
pub struct BucketState {
    /// None: the store has no bucket of that name (never leased, gone idle, or lost).
    pub bucket: Option<GlobalBucket>,
    /// The epoch of the bucket's store (Redis: of its slot): buckets it does not know start
    /// by the cold-start mode from then. None: not kept (`--cold-start full`, or a slot that
    /// never held a bucket).
    pub epoch_ms: Option<u64>,
    /// A proxy's call showed that the store (the slot) lost buckets in use.
    pub lost: bool,
    /// Redis: how long until the bucket's key expires (it is as good as new then).
    pub expires_in_ms: Option<u64>,
}

impl Store {
    /// The bucket of `(limit_id, key)` as stored now.
    pub async fn bucket(&self, limit_id: &str, key: &str) -> Result<BucketState, StoreError> {
        match self {
            Self::Memory(m) => {
                let (bucket, epoch_ms, lost) = m.bucket(limit_id, key);
                Ok(BucketState {
                    bucket,
                    epoch_ms,
                    lost,
                    expires_in_ms: None,
                })
            }
            Self::Redis(r) => r.bucket(limit_id, key).await,
        }
    }

    /// Reset the bucket of `(limit_id, key)` ([`GlobalBucket::reset`]): the bucket after.
    pub async fn reset(&self, limit_id: &str, key: &str) -> Result<BucketState, StoreError> {
        match self {
            Self::Memory(m) => {
                m.reset(limit_id, key);
                self.bucket(limit_id, key).await
            }
            Self::Redis(r) => r.reset(limit_id, key).await,
        }
    }
}

/// An item's answer, or why the store refused that item alone (the call's other items are
/// served).
type ItemResult<A> = Result<A, String>;

/// A store's answers to a call's items: one per item, in order (all zero for an item it refused),
/// and the items it refused alone, with why.
#[derive(Debug, Clone, PartialEq)]
pub struct Answers<A> {
    pub items: Vec<A>,
    pub refused: Vec<(usize, String)>,
}

impl<A: Default> Answers<A> {
    fn from_results(results: impl IntoIterator<Item = ItemResult<A>>) -> Self {
        let mut refused = Vec::new();
        let items = results
            .into_iter()
            .enumerate()
            .map(|(i, r)| {
                r.unwrap_or_else(|e| {
                    refused.push((i, e));
                    A::default()
                })
            })
            .collect();
        Self { items, refused }
    }
}

impl<A> From<Vec<A>> for Answers<A> {
    fn from(items: Vec<A>) -> Self {
        Self {
            items,
            refused: Vec::new(),
        }
    }
}

impl<A> std::ops::Deref for Answers<A> {
    type Target = [A];
    fn deref(&self) -> &[A] {
        &self.items
    }
}
