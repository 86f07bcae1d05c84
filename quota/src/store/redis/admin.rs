//! The admin API's look at one bucket in Redis, and its reset: `admin.lua` on the node serving
//! the bucket's slot, its answer decoded into the bucket the lease script keeps.

use super::cluster::{marker, master_of, slot};
use super::connection::{failed, Connection};
use super::{RedisStore, ScriptRunner};
use crate::store::{BucketState, StoreError};
use tollgate_core::global::lease::{GlobalBucket, Holder};

const ADMIN_LUA: &str = include_str!("admin.lua");

impl RedisStore {
    /// The bucket of `(limit_id, key)` as stored now, with its slot's epoch.
    pub async fn bucket(&self, limit_id: &str, key: &str) -> Result<BucketState, StoreError> {
        self.scripts.admin(limit_id, key, "get").await
    }

    /// Reset the bucket of `(limit_id, key)` ([`GlobalBucket::reset`]); the bucket after.
    pub async fn reset(&self, limit_id: &str, key: &str) -> Result<BucketState, StoreError> {
        self.scripts.admin(limit_id, key, "reset").await
    }
}

impl ScriptRunner {
    async fn admin(&self, limit_id: &str, key: &str, op: &str) -> Result<BucketState, StoreError> {
        let tag = format!("tg:{limit_id}:{key}");
        let slot = slot(&tag);
        let mut eval = redis::cmd("EVAL");
        eval.arg(ADMIN_LUA)
            .arg(2)
            .arg(format!("{{{tag}}}:b"))
            .arg(marker(slot))
            .arg(op);
        let answer = tokio::time::timeout(self.timeout, self.query_at(&eval, slot as u16))
            .await
            .map_err(|_| StoreError::Timeout(self.timeout))?
            .map_err(failed)?;
        let (kind, value, marker, pttl): (String, redis::Value, Vec<u8>, i64) =
            redis::from_redis_value(answer).map_err(failed)?;
        let marker = String::from_utf8_lossy(&marker);
        let lost = marker.ends_with('L');
        Ok(BucketState {
            bucket: match kind.as_str() {
                "string" => {
                    decode_string(&redis::from_redis_value::<Vec<u8>>(value).map_err(failed)?)
                }
                "hash" => decode_hash(
                    &redis::from_redis_value::<Vec<(String, String)>>(value).map_err(failed)?,
                ),
                _ => None,
            },
            epoch_ms: marker.trim_end_matches('L').parse().ok(),
            lost,
            expires_in_ms: u64::try_from(pttl).ok(),
        })
    }

    /// One command on the one Redis, Sentinel's master, or the cluster master serving `slot`.
    async fn query_at(&self, cmd: &redis::Cmd, slot: u16) -> redis::RedisResult<redis::Value> {
        match self.conn.clone() {
            Connection::Single(mut c) => cmd.query_async(&mut c).await,
            Connection::Sentinel(link) => {
                let mut c = link.connection().await?;
                let answer = cmd.query_async(&mut c).await;
                if answer.is_err() {
                    link.forget();
                }
                answer
            }
            Connection::Cluster(mut c) => {
                let to = master_of(slot);
                c.route_command(cmd.clone(), to)
                    .await
                    .and_then(redis::Value::extract_error)
            }
        }
    }
}

/// A bucket's string as `lease.lua` writes it (three doubles, then per holder its name's length
/// in 2 bytes, the name and six doubles; tokens and reserve in millionths); none if it is not
/// one.
fn decode_string(v: &[u8]) -> Option<GlobalBucket> {
    let double = |at: usize| -> Option<f64> {
        Some(f64::from_le_bytes(v.get(at..at + 8)?.try_into().ok()?))
    };
    let mut bucket = GlobalBucket {
        tokens: double(0)? / 1e6,
        reserve: double(8)? / 1e6,
        updated_ms: double(16)? as u64,
        ..GlobalBucket::default()
    };
    let mut at = 24;
    while at < v.len() {
        let len = usize::from(u16::from_le_bytes(v.get(at..at + 2)?.try_into().ok()?));
        let name = v.get(at + 2..at + 2 + len)?;
        at += 2 + len;
        let n: Vec<f64> = (0..6).map(|i| double(at + 8 * i)).collect::<Option<_>>()?;
        at += 48;
        bucket.holders.push(Holder {
            instance: String::from_utf8_lossy(name).into_owned(),
            wanted: n[0] as u64,
            demand: n[1] as u64,
            asked_ms: n[2] as u64,
            share: n[3] as u64,
            until_ms: n[4] as u64,
            outstanding: n[5] as u64,
        });
    }
    Some(bucket)
}

/// A bucket's hash, as a service of before wrote it (`tokens`, `reserve` in millionths,
/// `updated`, and `@<instance>` -> `w:d:a:s:u[:o]`).
fn decode_hash(fields: &[(String, String)]) -> Option<GlobalBucket> {
    let mut bucket = GlobalBucket::default();
    for (field, value) in fields {
        let number = || value.parse::<f64>().ok();
        match field.as_str() {
            "tokens" => bucket.tokens = number()? / 1e6,
            "reserve" => bucket.reserve = number()? / 1e6,
            "updated" => bucket.updated_ms = number()? as u64,
            _ => {
                let Some(instance) = field.strip_prefix('@') else {
                    continue;
                };
                let n: Vec<u64> = value.split(':').filter_map(|x| x.parse().ok()).collect();
                if n.len() >= 5 {
                    bucket.holders.push(Holder {
                        instance: instance.to_owned(),
                        wanted: n[0],
                        demand: n[1],
                        asked_ms: n[2],
                        share: n[3],
                        until_ms: n[4],
                        outstanding: n.get(5).copied().unwrap_or(0),
                    });
                }
            }
        }
    }
    Some(bucket)
}
