//! Global buckets and slot holdings in Redis, a Redis Cluster or a Redis watched by Sentinel: one
//! Lua script per call (per master on a cluster).
//!
//! A bucket is one hash, `{tg:<limit_id>:<key>}:b` (tokens, updated, its holders), and a global
//! concurrency key's holdings another, `{tg:<limit_id>:<key>}:s`, so an item touches one cluster
//! slot. Each slot also has an epoch marker (a key whose hash tag is
//! chosen to fall in that slot), set when the slot's first bucket is made and lost with the
//! node's data: a bucket missing while its marker is young was forgotten, not unused, and a
//! conservative cold start applies.

use crate::store::StoreError;
use futures::future::join_all;
use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::sentinel::{SentinelClient, SentinelServerType};
use std::collections::BTreeMap;
use std::sync::{OnceLock, RwLock};
use std::time::Duration;
use tollgate_core::lease::{ColdStart, LeaseGrant, LeaseItem};
use tollgate_core::slot_lease::{SlotAnswer, SlotItem};

const LEASE_LUA: &str = include_str!("lease.lua");
const SLOTS_LUA: &str = include_str!("slots.lua");
/// Helpers both scripts use, prepended to each.
const FAIR_LUA: &str = include_str!("fair.lua");
/// On a cluster the script may touch keys of several slots of the master it runs on (Redis 7).
const CLUSTER_FLAGS: &str = "#!lua flags=allow-cross-slot-keys\n";
const SLOTS: usize = 16_384;

/// Where the Redis data lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RedisTarget {
    /// One Redis (or a proxy in front of several).
    Single(String),
    /// A Redis Cluster, given by one or more of its nodes.
    Cluster(Vec<String>),
    /// The master of `master` as Redis Sentinel names it, asked of one of `sentinels`, reached
    /// with `access`.
    Sentinel {
        sentinels: Vec<String>,
        master: String,
        access: MasterAccess,
    },
}

/// How the service logs in to the master Sentinel names (the sentinels' own credentials and TLS
/// come from their URLs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MasterAccess {
    pub user: Option<String>,
    pub password: Option<String>,
    /// Connect to the master over TLS.
    pub tls: bool,
}

/// TLS connections to Redis: the certificate authorities they trust (PEM; else the system's),
/// and the client certificate and key (PEM) they present where Redis asks for one.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct RedisTls {
    pub ca_pem: Option<Vec<u8>>,
    pub client_pem: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for RedisTls {
    /// Never the key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisTls")
            .field("ca", &self.ca_pem.is_some())
            .field("client_certificate", &self.client_pem.is_some())
            .finish()
    }
}

impl RedisTls {
    fn certificates(&self) -> Option<redis::TlsCertificates> {
        if self.ca_pem.is_none() && self.client_pem.is_none() {
            return None;
        }
        Some(redis::TlsCertificates {
            client_tls: self
                .client_pem
                .as_ref()
                .map(|(cert, key)| redis::ClientTlsConfig {
                    client_cert: cert.clone(),
                    client_key: key.clone(),
                }),
            root_cert: self.ca_pem.clone(),
        })
    }
}

impl std::fmt::Display for RedisTarget {
    /// The target as a log line may show it: passwords in URLs replaced by `***`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list = |urls: &[String]| urls.iter().map(|u| redact(u)).collect::<Vec<_>>().join(",");
        match self {
            Self::Single(url) => f.write_str(&redact(url)),
            Self::Cluster(nodes) => write!(f, "cluster {}", list(nodes)),
            Self::Sentinel {
                sentinels, master, ..
            } => {
                write!(f, "master {master:?} of sentinels {}", list(sentinels))
            }
        }
    }
}

/// The client asking `sentinels` for `master`, which it reaches with `access`.
fn sentinel_client(
    sentinels: &[String],
    master: &str,
    access: &MasterAccess,
    trust: &RedisTls,
) -> Result<SentinelClient, StoreError> {
    use redis::IntoConnectionInfo;
    let mut addrs = Vec::new();
    let mut sentinel_login = None;
    for url in sentinels {
        let info = url.as_str().into_connection_info().map_err(failed)?;
        if sentinel_login.is_none() {
            let redis = info.redis_settings();
            sentinel_login = redis
                .password()
                .map(|p| (redis.username().map(str::to_owned), p.to_owned()));
        }
        addrs.push(info.addr().clone());
    }
    let tls_to_sentinels = addrs
        .iter()
        .any(|a| matches!(a, redis::ConnectionAddr::TcpTls { .. }));
    let mut builder =
        redis::sentinel::SentinelClientBuilder::new(addrs, master, SentinelServerType::Master)
            .map_err(failed)?;
    if let Some((user, password)) = sentinel_login {
        builder = builder.set_client_to_sentinel_password(password);
        if let Some(user) = user {
            builder = builder.set_client_to_sentinel_username(user);
        }
    }
    if let Some(password) = &access.password {
        builder = builder.set_client_to_redis_password(password);
    }
    if let Some(user) = &access.user {
        builder = builder.set_client_to_redis_username(user);
    }
    if access.tls {
        builder = builder.set_client_to_redis_tls_mode(redis::TlsMode::Secure);
    }
    if let Some(certs) = trust.certificates() {
        if access.tls {
            builder = builder.set_client_to_redis_certificates(certs.clone());
        }
        if tls_to_sentinels {
            builder = builder
                .set_client_to_sentinel_tls_mode(redis::TlsMode::Secure)
                .set_client_to_sentinel_certificates(certs);
        }
    }
    builder.build().map_err(failed)
}

/// A Redis URL without its password: `redis://user:secret@host` → `redis://user:***@host`.
pub fn redact(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return url.to_owned();
    };
    let rest = &url[scheme_end..];
    let Some(at) = rest.rfind('@') else {
        return url.to_owned();
    };
    let userinfo = &rest[..at];
    let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
    let hidden = if userinfo.contains(':') {
        format!("{user}:***")
    } else {
        // `redis://secret@host`: the whole userinfo is the password.
        "***".to_owned()
    };
    format!("{}{hidden}{}", &url[..scheme_end], &rest[at..])
}

#[derive(Clone)]
enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
    Sentinel(std::sync::Arc<SentinelLink>),
}

/// The master Sentinel names: connected when first needed, and asked of the sentinels again after
/// any error (after a failover the old address is a replica that refuses writes, or gone).
struct SentinelLink {
    sentinel: tokio::sync::Mutex<SentinelClient>,
    master: std::sync::Mutex<Option<ConnectionManager>>,
    config: redis::aio::ConnectionManagerConfig,
}

impl SentinelLink {
    async fn connection(&self) -> redis::RedisResult<ConnectionManager> {
        if let Some(c) = self.master.lock().ok().and_then(|m| m.clone()) {
            return Ok(c);
        }
        let client = self.sentinel.lock().await.async_get_client().await?;
        let c = client
            .get_connection_manager_with_config(self.config.clone())
            .await?;
        if let Ok(mut m) = self.master.lock() {
            *m = Some(c.clone());
        }
        Ok(c)
    }

    fn forget(&self) {
        if let Ok(mut m) = self.master.lock() {
            *m = None;
        }
    }
}

/// A script as sent with `SCRIPT LOAD`, and its SHA-1 for `EVALSHA`.
struct Script {
    text: String,
    sha: String,
}

impl Script {
    fn new(body: &str, cluster: bool) -> Self {
        let flags = if cluster { CLUSTER_FLAGS } else { "" };
        let text = format!("{flags}{FAIR_LUA}{body}");
        let sha = redis::Script::new(&text).get_hash().to_owned();
        Self { text, sha }
    }
}

/// Items a script serves: where their keys are and what the script is told of each.
trait Scripted {
    /// The item's hash, after its hash tag.
    const SUFFIX: &'static str;
    /// Numbers the script answers per item.
    const ANSWER: usize;
    /// The hash tag of the item's keys.
    fn tag(&self) -> String;
    fn push_args(&self, cmd: &mut redis::Cmd);
}

impl Scripted for LeaseItem {
    const SUFFIX: &'static str = ":b";
    const ANSWER: usize = 5;
    fn tag(&self) -> String {
        format!("tg:{}:{}", self.limit_id, self.key)
    }
    fn push_args(&self, cmd: &mut redis::Cmd) {
        cmd.arg(self.requests)
            .arg(self.per_ms)
            .arg(self.burst)
            .arg(self.wanted)
            .arg(self.demand_mtps())
            .arg(self.known_ms)
            .arg(self.known_remaining)
            .arg(self.returned);
    }
}

impl Scripted for SlotItem {
    const SUFFIX: &'static str = ":s";
    const ANSWER: usize = 3;
    fn tag(&self) -> String {
        format!("tg:{}:{}", self.limit_id, self.key)
    }
    fn push_args(&self, cmd: &mut redis::Cmd) {
        cmd.arg(self.concurrent)
            .arg(self.wanted)
            .arg(self.keep)
            .arg(self.known_held);
    }
}

pub struct RedisStore {
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
}

/// One script run: where (the master serving `slot`, on a cluster), which items, and whether
/// their keys are declared (they are, unless they span several slots of one master).
struct Run {
    slot: u16,
    members: Vec<usize>,
    declared: bool,
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
        let store = Self {
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
        };
        store.learn_masters().await;
        Ok(store)
    }

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

    /// Serve a lease call's items (see [`Self::serve`]).
    pub async fn lease(
        &self,
        instance: &str,
        items: &[LeaseItem],
        ttl_ms: u64,
    ) -> Result<Vec<LeaseGrant>, StoreError> {
        let answers = self
            .serve(&self.lease_script, instance, items, ttl_ms)
            .await?;
        Ok(answers
            .into_iter()
            .map(|a| LeaseGrant {
                granted: a[0],
                ttl_ms,
                remaining: a[1],
                reset_ms: a[2],
                rate: a[3] as f64 / 1_000.0,
                retry_ms: a[4],
            })
            .collect())
    }

    /// Serve a slot call's items (see [`Self::serve`]).
    pub async fn slots(
        &self,
        instance: &str,
        items: &[SlotItem],
        ttl_ms: u64,
    ) -> Result<Vec<SlotAnswer>, StoreError> {
        let answers = self
            .serve(&self.slots_script, instance, items, ttl_ms)
            .await?;
        Ok(answers
            .into_iter()
            .map(|a| SlotAnswer {
                held: a[0],
                share: a[1],
                free: a[2],
                ttl_ms,
            })
            .collect())
    }

    /// Serve all items in one script run (one per master on a cluster), the runs sent together,
    /// the whole bounded by the storage timeout. On a cluster whose slots moved, the runs that
    /// failed go again one per slot, and the slot map is learnt anew. Each item's answer is the
    /// script's `I::ANSWER` numbers.
    async fn serve<I: Scripted>(
        &self,
        script: &Script,
        instance: &str,
        items: &[I],
        ttl_ms: u64,
    ) -> Result<Vec<Vec<u64>>, StoreError> {
        let work = async {
            let all: Vec<usize> = (0..items.len()).collect();
            let runs = self.runs(items, &all, true);
            let results = join_all(
                runs.iter()
                    .map(|r| self.run(script, instance, items, r, ttl_ms)),
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
                        .map(|r| self.run(script, instance, items, r, ttl_ms)),
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
        instance: &str,
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
        evalsha
            .arg(instance)
            .arg(ttl_ms)
            .arg(self.cold)
            .arg(run.members.len());
        for (&i, (key, marker)) in run.members.iter().zip(&keys) {
            evalsha.arg(key).arg(*marker);
            items[i].push_args(&mut evalsha);
        }
        let mut load = redis::cmd("SCRIPT");
        load.arg("LOAD").arg(&script.text);
        // A dropped connection (a Redis restart, a failover, an idle timeout, CLIENT KILL) is
        // reconnected and the run sent again until it answers or the storage timeout ends the
        // call. A run that did reach Redis before its connection dropped then runs twice: its
        // first grants are lost to the caller (stricter, never looser).
        let mut pause = Duration::from_millis(1);
        let numbers = loop {
            match self.run_once(&evalsha, &load, run.slot).await {
                Err(e) if reconnects(&e) => {
                    tracing::debug!(error = %e, "redis connection lost: again");
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
                let to = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::new(
                    slot,
                    SlotAddr::Master,
                )));
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

/// True for errors that a new connection, or a moment, may cure: the connection dropped or was
/// refused (a restart), Redis is loading its data, a replica refuses writes after a failover, a
/// cluster is between owners of a slot.
fn reconnects(e: &redis::RedisError) -> bool {
    use redis::ServerErrorKind as S;
    e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || matches!(
            e.kind(),
            redis::ErrorKind::Server(
                S::BusyLoading | S::ReadOnly | S::TryAgain | S::ClusterDown | S::MasterDown
            )
        )
}

fn manager_config(
    connect_timeout: Duration,
    timeout: Duration,
) -> redis::aio::ConnectionManagerConfig {
    redis::aio::ConnectionManagerConfig::new()
        .set_connection_timeout(Some(connect_timeout))
        .set_response_timeout(Some(timeout))
        .set_number_of_retries(0)
}

/// Run the script by its hash, loading it first where the server does not know it.
async fn eval_or_load(
    c: &mut ConnectionManager,
    evalsha: &redis::Cmd,
    load: &redis::Cmd,
) -> redis::RedisResult<Vec<u64>> {
    match evalsha.query_async::<Vec<u64>>(c).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            load.query_async::<()>(c).await?;
            evalsha.query_async(c).await
        }
        other => other,
    }
}

/// Put each run's answers in the items' places.
fn place(answers: &mut [Option<Vec<u64>>], members: &[usize], got: Vec<Vec<u64>>) {
    for (&i, a) in members.iter().zip(got) {
        answers[i] = Some(a);
    }
}

/// `CLUSTER SLOTS`' answer as (first slot, last slot, master's host and port); entries that do
/// not read so are left out.
fn slot_ranges(answer: redis::Value) -> Vec<(u16, u16, (String, u16))> {
    use redis::Value;
    let Value::Array(entries) = answer else {
        return Vec::new();
    };
    let int = |v: &Value| match v {
        Value::Int(n) => u16::try_from(*n).ok(),
        _ => None,
    };
    entries
        .iter()
        .filter_map(|entry| {
            let Value::Array(parts) = entry else {
                return None;
            };
            let (start, end) = (int(parts.first()?)?, int(parts.get(1)?)?);
            let Value::Array(node) = parts.get(2)? else {
                return None;
            };
            let host = match node.first()? {
                Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                Value::SimpleString(s) => s.clone(),
                _ => return None,
            };
            Some((start, end, (host, int(node.get(1)?)?)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_reach_a_log_line() {
        assert_eq!(
            redact("redis://:s3cret@10.0.0.1:6379/0"),
            "redis://:***@10.0.0.1:6379/0"
        );
        assert_eq!(
            redact("rediss://app:p@ss@host:6380"),
            "rediss://app:***@host:6380"
        );
        assert_eq!(redact("redis://s3cret@host"), "redis://***@host");
        assert_eq!(redact("redis://host:6379"), "redis://host:6379");
        let target = RedisTarget::Sentinel {
            sentinels: vec!["redis://:a1@s1:26379".into(), "redis://s2:26379".into()],
            master: "mymaster".into(),
            access: MasterAccess {
                password: Some("zz9".into()),
                ..MasterAccess::default()
            },
        };
        let shown = target.to_string();
        assert!(!shown.contains("a1") && !shown.contains("zz9"), "{shown}");
        assert!(!RedisTarget::Single("redis://u:zz@h".into())
            .to_string()
            .contains("zz"));
    }

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
