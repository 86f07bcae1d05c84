//! Global buckets in Redis or a Redis Cluster: one Lua script per call (per slot on a cluster).
//!
//! A bucket is one hash, `{tg:<limit_id>:<key>}:b` (tokens, updated, its holders), so an item
//! touches one cluster slot. Each slot also has an epoch marker (a key whose hash tag is
//! chosen to fall in that slot), set when the slot's first bucket is made and lost with the
//! node's data: a bucket missing while its marker is young was forgotten, not unused, and a
//! conservative cold start applies.

use crate::store::StoreError;
use futures::future::join_all;
use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::time::Duration;
use tollgate_core::lease::{LeaseGrant, LeaseItem};

const LEASE_LUA: &str = include_str!("lease.lua");
const SLOTS: usize = 16_384;

/// Where the Redis data lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisTarget {
    /// One Redis (or a proxy in front of several).
    Single(String),
    /// A Redis Cluster, given by one or more of its nodes.
    Cluster(Vec<String>),
}

#[derive(Clone)]
enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

pub struct RedisStore {
    conn: Connection,
    script: redis::Script,
    timeout: Duration,
    conservative: bool,
}

/// A cluster slot of a hash tag (CRC16/XMODEM, as Redis Cluster computes it).
fn slot(tag: &str) -> usize {
    usize::from(crc16::State::<crc16::XMODEM>::calculate(tag.as_bytes())) % SLOTS
}

/// The epoch marker key of each slot.
fn marker(slot: usize) -> &'static str {
    static MARKERS: OnceLock<Vec<String>> = OnceLock::new();
    let markers = MARKERS.get_or_init(|| {
        let mut markers = vec![String::new(); SLOTS];
        let mut missing = SLOTS;
        let mut n = 0u64;
        while missing > 0 {
            let tag = format!("tg-epoch-{n}");
            let s = self::slot(&tag);
            if markers[s].is_empty() {
                markers[s] = format!("{{{tag}}}");
                missing -= 1;
            }
            n += 1;
        }
        markers
    });
    markers[slot].as_str()
}

fn failed(e: impl std::fmt::Display) -> StoreError {
    StoreError::Failed(e.to_string())
}

impl RedisStore {
    /// Connect (within 5 s); every later call is bounded by `timeout`. `conservative`: buckets
    /// the store lost start cold (see [`tollgate_core::lease::ColdStart`]).
    pub async fn connect(
        target: &RedisTarget,
        timeout: Duration,
        conservative: bool,
    ) -> Result<Self, StoreError> {
        let connect_timeout = timeout.max(Duration::from_millis(500));
        let connecting = async {
            match target {
                RedisTarget::Single(url) => {
                    let client = redis::Client::open(url.as_str()).map_err(failed)?;
                    let config = redis::aio::ConnectionManagerConfig::new()
                        .set_connection_timeout(Some(connect_timeout))
                        .set_response_timeout(Some(timeout))
                        .set_number_of_retries(0);
                    client
                        .get_connection_manager_with_config(config)
                        .await
                        .map(Connection::Single)
                        .map_err(failed)
                }
                RedisTarget::Cluster(nodes) => {
                    let client = redis::cluster::ClusterClientBuilder::new(nodes.clone())
                        .connection_timeout(connect_timeout)
                        .response_timeout(timeout)
                        .retries(1)
                        .min_retry_wait(1)
                        .max_retry_wait(10)
                        .build()
                        .map_err(failed)?;
                    client
                        .get_async_connection()
                        .await
                        .map(Connection::Cluster)
                        .map_err(failed)
                }
            }
        };
        let conn = tokio::time::timeout(Duration::from_secs(5), connecting)
            .await
            .map_err(|_| StoreError::Timeout(Duration::from_secs(5)))??;
        // The slots' marker keys, worked out once (a few ms) before the first call needs them.
        let _ = marker(0);
        let store = Self {
            conn,
            script: redis::Script::new(LEASE_LUA),
            timeout,
            conservative,
        };
        Ok(store)
    }

    /// Serve all items in one script run per slot group (all of them on a single Redis), the
    /// runs sent together, the whole bounded by the storage timeout.
    pub async fn lease(
        &self,
        instance: &str,
        items: &[LeaseItem],
        ttl_ms: u64,
    ) -> Result<Vec<LeaseGrant>, StoreError> {
        let mut groups: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for (i, item) in items.iter().enumerate() {
            let group = match self.conn {
                Connection::Single(_) => 0,
                Connection::Cluster(_) => slot(&tag(item)),
            };
            groups.entry(group).or_default().push(i);
        }
        let runs = groups.values().map(|members| {
            let mut invocation = self.script.prepare_invoke();
            invocation
                .arg(instance)
                .arg(ttl_ms)
                .arg(if self.conservative { "1" } else { "0" });
            for &i in members {
                let item = &items[i];
                let tag = tag(item);
                invocation
                    .key(format!("{{{tag}}}:b"))
                    .key(marker(slot(&tag)))
                    .arg(item.requests)
                    .arg(item.per_ms)
                    .arg(item.burst)
                    .arg(item.wanted)
                    .arg(item.demand_mtps());
            }
            let conn = self.conn.clone();
            async move {
                let answers: Vec<(u64, u64, u64, u64, u64)> = match conn {
                    Connection::Single(mut c) => invocation.invoke_async(&mut c).await,
                    Connection::Cluster(mut c) => invocation.invoke_async(&mut c).await,
                }
                .map_err(failed)?;
                if answers.len() != members.len() {
                    return Err(failed(
                        "the lease script answered the wrong number of items",
                    ));
                }
                Ok::<_, StoreError>((members, answers))
            }
        });
        let results = tokio::time::timeout(self.timeout, join_all(runs))
            .await
            .map_err(|_| StoreError::Timeout(self.timeout))?;
        let mut grants = vec![None; items.len()];
        for result in results {
            let (members, answers) = result?;
            for (&i, (granted, remaining, reset_ms, share, retry_ms)) in members.iter().zip(answers)
            {
                grants[i] = Some(LeaseGrant {
                    granted,
                    ttl_ms,
                    remaining,
                    reset_ms,
                    rate: share as f64 / 1_000.0,
                    retry_ms,
                });
            }
        }
        grants
            .into_iter()
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| failed("an item got no answer"))
    }
}

/// The hash tag of an item's keys.
fn tag(item: &LeaseItem) -> String {
    format!("tg:{}:{}", item.limit_id, item.key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_the_clusters_and_every_slot_has_a_marker() {
        // Values from the Redis Cluster specification (CLUSTER KEYSLOT).
        assert_eq!(slot("123456789"), 0x31C3);
        assert_eq!(slot("foo"), 12_182);
        for s in [0, 1, 12_182, SLOTS - 1] {
            let m = marker(s);
            assert_eq!(slot(&m[1..m.len() - 1]), s);
        }
    }
}
