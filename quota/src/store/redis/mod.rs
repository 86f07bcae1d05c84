//! Global buckets and slot holdings in Redis, a Redis Cluster or a Redis watched by Sentinel: one
//! Lua script per call (per master on a cluster; lease calls that come while others run go
//! together, see [`batch`]).
//!
//! A bucket is one string, `{tg:<limit_id>:<key>}:b` (tokens, reserve, updated, its holders:
//! see lease.lua), and a global concurrency key's holdings a hash, `{tg:<limit_id>:<key>}:s`, so
//! an item touches one cluster slot. Each slot also has an epoch marker (a key whose hash tag is
//! chosen to fall in that slot), set when the slot's first bucket is made and lost with the
//! node's data: a bucket missing while its marker is young was forgotten, not unused, and a
//! conservative cold start applies.

mod admin;
mod batch;
mod clock;
mod cluster;
mod connection;
mod script;

use crate::store::StoreError;
use clock::UNKNOWN_OFFSET;
use cluster::{marker, master_of, slot, slot_ranges, SLOTS};
use connection::{failed, manager_config, reconnects, sentinel_client, Connection, SentinelLink};
pub use connection::{redact, MasterAccess, RedisTarget, RedisTls};
use futures::future::join_all;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use script::{eval_or_load, Script, Scripted, LEASE_LUA, SLOTS_LUA};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, AtomicU64};
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tollgate_core::global::lease::{ColdStart, LeaseGrant, LeaseItem};
use tollgate_core::global::permits::{PermitAnswer, PermitItem};
pub struct RedisStore {
    scripts: Arc<ScriptRunner>,
    leases: batch::LeaseBatches,
}

/// Runs the scripts: where the items' keys live, and one script run per Redis (or master).
struct ScriptRunner {
    conn: Connection,
    lease_script: Script,
    slots_script: Script,
    timeout: Duration,
    /// How buckets a slot does not know start ("0" full, "1" conservative, "2" auto), as the
    /// scripts take it; the epochs are the slots' markers.
    cold: &'static str,
    /// Cluster: which master serves each slot (as last learnt), so that a call runs one script
    /// per master rather than per slot. Empty: unknown (one script per slot).
    masters: RwLock<Vec<u16>>,
    /// Redis's clock less this process's (ms), as last learnt with `TIME`, so that a run tells
    /// the script when it was sent in Redis's clock ([`UNKNOWN_OFFSET`]: not known; not learnt on
    /// a cluster, whose masters each have a clock).
    clock_offset_ms: AtomicI64,
    /// When (this process's ms) the offset was last learnt.
    clock_learnt_ms: AtomicU64,
}

/// One script run: where (the master serving `slot`, on a cluster), which items, and whether
/// their keys are declared (they are, unless they span several slots of one master).
struct Run {
    slot: u16,
    members: Vec<usize>,
    declared: bool,
}

impl RedisStore {
    /// Connect (within 5 s); every later call is bounded by `timeout`. `cold`: how buckets a
    /// slot does not know start (its epoch is ignored: each slot's marker has its own).
    pub async fn connect(
        target: &RedisTarget,
        timeout: Duration,
        cold: ColdStart,
    ) -> Result<Self, StoreError> {
        Self::connect_with(target, timeout, cold, &RedisTls::default()).await
    }

    /// [`RedisStore::connect`], with TLS connections (`rediss://` URLs, a master reached over
    /// TLS) trusting `trust`.
    pub async fn connect_with(
        target: &RedisTarget,
        timeout: Duration,
        cold: ColdStart,
        trust: &RedisTls,
    ) -> Result<Self, StoreError> {
        let connect_timeout = timeout.max(Duration::from_millis(500));
        let connecting = async {
            match target {
                RedisTarget::Sentinel {
                    sentinels,
                    master,
                    access,
                } => {
                    let sentinel = sentinel_client(sentinels, master, access, trust)?;
                    let link = SentinelLink {
                        sentinel: tokio::sync::Mutex::new(sentinel),
                        master: std::sync::Mutex::new(None),
                        config: manager_config(connect_timeout, timeout),
                    };
                    link.connection().await.map_err(failed)?;
                    Ok(Connection::Sentinel(std::sync::Arc::new(link)))
                }
                RedisTarget::Single(url) => {
                    let client = match trust.certificates() {
                        Some(certs) => redis::Client::build_with_tls(url.as_str(), certs),
                        None => redis::Client::open(url.as_str()),
                    }
                    .map_err(failed)?;
                    let config = manager_config(connect_timeout, timeout);
                    client
                        .get_connection_manager_with_config(config)
                        .await
                        .map(Connection::Single)
                        .map_err(failed)
                }
                RedisTarget::Cluster(nodes) => {
                    let mut builder = redis::cluster::ClusterClientBuilder::new(nodes.clone());
                    if let Some(certs) = trust.certificates() {
                        builder = builder.certs(certs);
                    }
                    let client = builder
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
        let cluster = matches!(conn, Connection::Cluster(_));
        let scripts = ScriptRunner {
            conn,
            lease_script: Script::new(LEASE_LUA, cluster),
            slots_script: Script::new(SLOTS_LUA, cluster),
            timeout,
            cold: match cold {
                ColdStart::Full => "0",
                ColdStart::Conservative { .. } => "1",
                ColdStart::Auto { .. } => "2",
            },
            masters: RwLock::new(Vec::new()),
            clock_offset_ms: AtomicI64::new(UNKNOWN_OFFSET),
            clock_learnt_ms: AtomicU64::new(0),
        };
        scripts.learn_masters().await;
        let scripts = Arc::new(scripts);
        Ok(Self {
            leases: batch::LeaseBatches::start(scripts.clone(), timeout),
            scripts,
        })
    }

    /// Serve a lease call's items: with the items of calls that come while others run, in one
    /// script run.
    pub async fn lease(
        &self,
        instance: &str,
        items: &[LeaseItem],
        ttl_ms: u64,
    ) -> Result<Vec<LeaseGrant>, StoreError> {
        self.leases.lease(instance, items, ttl_ms).await
    }

    /// Serve a slot call's items (see [`ScriptRunner::serve`]).
    pub async fn slots(
        &self,
        instance: &str,
        items: &[PermitItem],
        ttl_ms: u64,
    ) -> Result<Vec<PermitAnswer>, StoreError> {
        let owners = vec![instance; items.len()];
        let answers = self
            .scripts
            .serve(&self.scripts.slots_script, &owners, items, ttl_ms)
            .await?;
        Ok(answers
            .into_iter()
            .map(|a| PermitAnswer {
                held: a[0],
                share: a[1],
                free: a[2],
                ttl_ms,
            })
            .collect())
    }
}

impl ScriptRunner {
    /// Ask the cluster which master serves each slot (`CLUSTER SLOTS`); on failure, forget.
    async fn learn_masters(&self) {
        let Connection::Cluster(mut conn) = self.conn.clone() else {
            return;
        };
        let asked = tokio::time::timeout(
            Duration::from_secs(2),
            conn.route_command(
                redis::cmd("CLUSTER").arg("SLOTS").clone(),
                RoutingInfo::SingleNode(SingleNodeRoutingInfo::RandomPrimary),
            ),
        )
        .await;
        let mut masters = vec![u16::MAX; SLOTS];
        let ranges = match asked {
            Ok(Ok(v)) => slot_ranges(v),
            _ => Vec::new(),
        };
        let mut nodes: Vec<(String, u16)> = Vec::new();
        for (start, end, node) in ranges {
            let id = nodes.iter().position(|n| *n == node).unwrap_or_else(|| {
                nodes.push(node);
                nodes.len() - 1
            });
            let (start, end) = (usize::from(start), usize::from(end).min(SLOTS - 1));
            if let Some(range) = masters.get_mut(start..=end) {
                range.fill(u16::try_from(id).unwrap_or(u16::MAX));
            }
        }
        let known = !nodes.is_empty() && masters.iter().all(|&m| m != u16::MAX);
        if let Ok(mut m) = self.masters.write() {
            *m = if known { masters } else { Vec::new() };
        }
    }

    /// `members` of `items` grouped into script runs: all in one on a single Redis; on a cluster
    /// one per master when `per_master` and the slot map is known, else one per slot.
    fn runs<I: Scripted>(&self, items: &[I], members: &[usize], per_master: bool) -> Vec<Run> {
        let masters = self.masters.read();
        let masters: &[u16] = match &masters {
            Ok(m) if per_master => m,
            _ => &[],
        };
        let declared = masters.is_empty() || !matches!(self.conn, Connection::Cluster(_));
        let mut groups: BTreeMap<usize, Run> = BTreeMap::new();
        for &i in members {
            let slot = slot(&items[i].tag());
            let group = match self.conn {
                Connection::Single(_) | Connection::Sentinel(_) => 0,
                Connection::Cluster(_) => {
                    masters.get(slot).map_or(SLOTS + slot, |&m| usize::from(m))
                }
            };
            groups
                .entry(group)
                .or_insert_with(|| Run {
                    slot: u16::try_from(slot).unwrap_or(0),
                    members: Vec::new(),
                    declared,
                })
                .members
                .push(i);
        }
        groups.into_values().collect()
    }

    /// Serve lease items, each for its instance in `owners` (see [`Self::serve`]).
    async fn lease(
        &self,
        owners: &[&str],
        items: &[LeaseItem],
        ttl_ms: u64,
    ) -> Result<Vec<LeaseGrant>, StoreError> {
        let answers = self
            .serve(&self.lease_script, owners, items, ttl_ms)
            .await?;
        Ok(answers
            .into_iter()
            .zip(items)
            .map(|(a, item)| LeaseGrant {
                granted: a[0],
                // A calendar quota's tokens are the instance's until its period ends.
                ttl_ms: item.period.map_or(ttl_ms, |_| a[2]),
                remaining: a[1],
                reset_ms: a[2],
                rate: a[3] as f64 / 1_000.0,
                retry_ms: a[4],
                returned: a[5],
                debt: a[6],
                revoked: a[7],
            })
            .collect())
    }

    /// Serve all items in one script run (one per master on a cluster), the runs sent together,
    /// the whole bounded by the storage timeout; item `i` is `owners[i]`'s. On a cluster whose
    /// slots moved, the runs that failed go again one per slot, and the slot map is learnt anew.
    /// Each item's answer is the script's `I::ANSWER` numbers.
    async fn serve<I: Scripted>(
        &self,
        script: &Script,
        owners: &[&str],
        items: &[I],
        ttl_ms: u64,
    ) -> Result<Vec<Vec<u64>>, StoreError> {
        let work = async {
            let all: Vec<usize> = (0..items.len()).collect();
            let runs = self.runs(items, &all, true);
            let results = join_all(
                runs.iter()
                    .map(|r| self.run(script, owners, items, r, ttl_ms)),
            )
            .await;
            let mut answers = vec![None; items.len()];
            let mut again = Vec::new();
            for (run, result) in runs.into_iter().zip(results) {
                match result {
                    Ok(got) => place(&mut answers, &run.members, got),
                    Err(e) if matches!(self.conn, Connection::Cluster(_)) => {
                        tracing::debug!(error = %e, "a run failed: again slot by slot");
                        again.extend(run.members);
                    }
                    Err(e) => return Err(e),
                }
            }
            if !again.is_empty() {
                self.learn_masters().await;
                let runs = self.runs(items, &again, false);
                let results = join_all(
                    runs.iter()
                        .map(|r| self.run(script, owners, items, r, ttl_ms)),
                )
                .await;
                for (run, result) in runs.into_iter().zip(results) {
                    place(&mut answers, &run.members, result?);
                }
            }
            answers
                .into_iter()
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| failed("an item got no answer"))
        };
        tokio::time::timeout(self.timeout, work)
            .await
            .map_err(|_| StoreError::Timeout(self.timeout))?
    }

    /// One script run: `run`'s items, on the master serving `run.slot` (a cluster) or on the one
    /// Redis. Loads the script first if that Redis does not have it.
    async fn run<I: Scripted>(
        &self,
        script: &Script,
        owners: &[&str],
        items: &[I],
        run: &Run,
        ttl_ms: u64,
    ) -> Result<Vec<Vec<u64>>, StoreError> {
        let keys: Vec<(String, &str)> = run
            .members
            .iter()
            .map(|&i| {
                let tag = items[i].tag();
                (format!("{{{tag}}}{}", I::SUFFIX), marker(slot(&tag)))
            })
            .collect();
        let mut evalsha = redis::cmd("EVALSHA");
        evalsha.arg(&script.sha);
        if run.declared {
            evalsha.arg(keys.len() * 2);
            for (key, marker) in &keys {
                evalsha.arg(key).arg(*marker);
            }
        } else {
            evalsha.arg(0);
        }
        if !I::INSTANCE_PER_ITEM {
            evalsha.arg(run.members.first().map_or("", |&i| owners[i]));
        }
        evalsha.arg(ttl_ms).arg(self.cold).arg(run.members.len());
        if I::INSTANCE_PER_ITEM {
            evalsha.arg(self.sent_ms().await);
        }
        for (&i, (key, marker)) in run.members.iter().zip(&keys) {
            evalsha.arg(key).arg(*marker);
            items[i].push_args(&mut evalsha);
            if I::INSTANCE_PER_ITEM {
                evalsha.arg(owners[i]);
            }
        }
        let mut load = redis::cmd("SCRIPT");
        load.arg("LOAD").arg(&script.text);
        // A dropped connection (a Redis restart, a failover, an idle timeout, CLIENT KILL) is
        // reconnected and the run sent again until it answers or the storage timeout ends the
        // call. A run that did reach Redis before its connection dropped then runs twice: its
        // first grants are lost to the caller (stricter, never looser). Not an answer that timed
        // out: the run is still queued in a busy Redis, and sending it again would only double
        // Redis's work when it is already behind (the response timeout is the storage timeout,
        // so the call is over anyway).
        let mut pause = Duration::from_millis(1);
        let numbers = loop {
            match self.run_once(&evalsha, &load, run.slot).await {
                Err(e) if reconnects(&e) && !e.is_timeout() => {
                    tracing::debug!(error = %e, "redis connection lost: again");
                    self.forget_clock();
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(10));
                }
                other => break other.map_err(failed)?,
            }
        };
        if numbers.len() != run.members.len() * I::ANSWER {
            return Err(failed("the script answered the wrong number of items"));
        }
        Ok(numbers.chunks(I::ANSWER).map(<[u64]>::to_vec).collect())
    }

    /// Send a script run once: to the one Redis, to the master Sentinel names (asked again after
    /// any error), or to the cluster master serving `slot`.
    async fn run_once(
        &self,
        evalsha: &redis::Cmd,
        load: &redis::Cmd,
        slot: u16,
    ) -> redis::RedisResult<Vec<u64>> {
        match self.conn.clone() {
            Connection::Single(mut c) => eval_or_load(&mut c, evalsha, load).await,
            Connection::Sentinel(link) => {
                let mut c = link.connection().await?;
                let answers = eval_or_load(&mut c, evalsha, load).await;
                if answers.is_err() {
                    link.forget();
                }
                answers
            }
            Connection::Cluster(mut c) => {
                let to = master_of(slot);
                // Server errors come back as values here: make them errors.
                let first = c
                    .route_command(evalsha.clone(), to.clone())
                    .await
                    .and_then(redis::Value::extract_error);
                let value = match first {
                    Err(e)
                        if e.kind()
                            == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
                    {
                        c.route_command(load.clone(), to.clone())
                            .await
                            .and_then(redis::Value::extract_error)?;
                        c.route_command(evalsha.clone(), to)
                            .await
                            .and_then(redis::Value::extract_error)
                    }
                    other => other,
                };
                Ok(redis::from_redis_value(value?)?)
            }
        }
    }
}

/// Put each run's answers in the items' places.
fn place(answers: &mut [Option<Vec<u64>>], members: &[usize], got: Vec<Vec<u64>>) {
    for (&i, a) in members.iter().zip(got) {
        answers[i] = Some(a);
    }
}
