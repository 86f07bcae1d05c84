//! Where the global buckets live: in this process, or in Redis (atomic Lua, hash-tagged keys).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;
use tollgate_core::lease::{GlobalBucket, LeaseGrant, LeaseItem};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("storage timed out after {0:?}")]
    Timeout(Duration),
    #[error("storage failed: {0}")]
    Failed(String),
    #[error("storage is full ({0} keys)")]
    Full(usize),
}

/// The clock the buckets run on: milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
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
}

/// Buckets in this process, at most `max_keys` of them; idle ones are swept.
pub struct MemoryStore {
    buckets: Mutex<HashMap<(String, String), GlobalBucket>>,
    max_keys: usize,
}

impl MemoryStore {
    pub fn new(max_keys: usize) -> Self {
        Self {
            buckets: Mutex::new(HashMap::new()),
            max_keys,
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
            sweep(&mut buckets, items, now_ms, ttl_ms);
            if buckets.len() + new_keys > self.max_keys {
                return Err(StoreError::Full(self.max_keys));
            }
        }
        Ok(items
            .iter()
            .map(|item| {
                buckets
                    .entry((item.limit_id.clone(), item.key.clone()))
                    .or_insert_with(|| GlobalBucket::new(item.burst, now_ms))
                    .lease(instance, item, now_ms, ttl_ms)
            })
            .collect())
    }
}

/// Drop idle buckets. The limit of a bucket is only known from a request, so a bucket is judged
/// by the limit of an item for the same `limit_id` in this batch, or else by its being full after
/// a long quiet (its last update older than a day and no live demand).
fn sweep(
    buckets: &mut HashMap<(String, String), GlobalBucket>,
    items: &[LeaseItem],
    now_ms: u64,
    ttl_ms: u64,
) {
    const LONG_QUIET_MS: u64 = 86_400_000;
    let limits: HashMap<&str, &LeaseItem> =
        items.iter().map(|i| (i.limit_id.as_str(), i)).collect();
    buckets.retain(|(limit_id, _), b| match limits.get(limit_id.as_str()) {
        Some(i) => !b.is_idle(i.burst, i.requests, i.per_ms, now_ms, ttl_ms),
        None => {
            b.updated_ms + LONG_QUIET_MS > now_ms || b.demands.iter().any(|d| d.2 + ttl_ms > now_ms)
        }
    });
}

/// Buckets in Redis: one Lua script call per item, all sent together, under the storage timeout.
/// Keys `{tg:<limit_id>:<key>}:b` (tokens, updated) and `:d` (demands) share a hash tag, so each
/// item's script touches one Redis Cluster slot. Keys expire once idle.
pub struct RedisStore {
    conn: redis::aio::ConnectionManager,
    script: redis::Script,
    timeout: Duration,
}

const LEASE_LUA: &str = include_str!("lease.lua");

impl RedisStore {
    pub async fn connect(url: &str, timeout: Duration) -> Result<Self, StoreError> {
        let client = redis::Client::open(url).map_err(|e| StoreError::Failed(e.to_string()))?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout.max(Duration::from_millis(500))))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(0);
        let conn = tokio::time::timeout(
            Duration::from_secs(5),
            client.get_connection_manager_with_config(config),
        )
        .await
        .map_err(|_| StoreError::Timeout(Duration::from_secs(5)))?
        .map_err(|e| StoreError::Failed(e.to_string()))?;
        Ok(Self {
            conn,
            script: redis::Script::new(LEASE_LUA),
            timeout,
        })
    }

    async fn lease(
        &self,
        instance: &str,
        items: &[LeaseItem],
        ttl_ms: u64,
    ) -> Result<Vec<LeaseGrant>, StoreError> {
        let calls = items.iter().map(|item| {
            let mut conn = self.conn.clone();
            let tag = format!("{{tg:{}:{}}}", item.limit_id, item.key);
            let mut invocation = self.script.prepare_invoke();
            invocation
                .key(format!("{tag}:b"))
                .key(format!("{tag}:d"))
                .arg(instance)
                .arg(item.requests)
                .arg(item.per_ms)
                .arg(item.burst)
                .arg(item.wanted)
                .arg(ttl_ms);
            async move {
                let r: (u64, u64, u64) = invocation.invoke_async(&mut conn).await?;
                Ok::<_, redis::RedisError>(LeaseGrant {
                    granted: r.0,
                    ttl_ms,
                    remaining: r.1,
                    reset_ms: r.2,
                })
            }
        });
        // The calls are pipelined on the multiplexed connection: one round trip for the batch.
        let all = futures::future::join_all(calls);
        match tokio::time::timeout(self.timeout, all).await {
            Err(_) => Err(StoreError::Timeout(self.timeout)),
            Ok(results) => results
                .into_iter()
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| StoreError::Failed(e.to_string())),
        }
    }
}
