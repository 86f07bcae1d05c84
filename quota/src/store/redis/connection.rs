//! Where the Redis data lives and how the store reaches it: one Redis, a Cluster or a master
//! named by Sentinel, over TCP or TLS; which errors a new connection may cure.

use crate::store::StoreError;

/// A storage failure with `e`'s words.
pub(super) fn failed(e: impl std::fmt::Display) -> StoreError {
    StoreError::Failed(e.to_string())
}
use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelServerType};
use std::time::Duration;
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
    pub(super) fn certificates(&self) -> Option<redis::TlsCertificates> {
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
pub(super) fn sentinel_client(
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
    if let Some(problem) = untrusted_sentinels(sentinels, &addrs, access, trust) {
        return Err(StoreError::Failed(problem));
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

/// Why the sentinels' replies cannot be trusted to name a TLS master, if they cannot. A reply over
/// plain TCP is not authenticated: anyone on the network could name as the master any host holding
/// a certificate the system's authorities vouch for, and the service would send it the master's
/// password and its buckets. Over TLS the reply comes from a sentinel; with `--redis-ca` only a
/// certificate of that authority is accepted, whoever names the host.
fn untrusted_sentinels(
    urls: &[String],
    addrs: &[redis::ConnectionAddr],
    access: &MasterAccess,
    trust: &RedisTls,
) -> Option<String> {
    if !access.tls || trust.ca_pem.is_some() {
        return None;
    }
    let (url, _) = urls
        .iter()
        .zip(addrs)
        .find(|(_, a)| matches!(a, redis::ConnectionAddr::Tcp(..)))?;
    Some(format!(
        "--redis-master-tls with the plain sentinel {}: a reply over plain TCP is not \
         authenticated, so anyone on the network could name as the master a host holding any \
         certificate the system trusts and be sent the master's password; give every sentinel as \
         a rediss:// URL, or pin the authority of Redis's certificates with --redis-ca",
        redact(url)
    ))
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
pub(super) enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
    Sentinel(std::sync::Arc<SentinelLink>),
}

/// The master Sentinel names: connected when first needed, and asked of the sentinels again after
/// any error (after a failover the old address is a replica that refuses writes, or gone).
pub(super) struct SentinelLink {
    pub(super) sentinel: tokio::sync::Mutex<SentinelClient>,
    pub(super) master: std::sync::Mutex<Option<ConnectionManager>>,
    pub(super) config: redis::aio::ConnectionManagerConfig,
}

impl SentinelLink {
    pub(super) async fn connection(&self) -> redis::RedisResult<ConnectionManager> {
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

    pub(super) fn forget(&self) {
        if let Ok(mut m) = self.master.lock() {
            *m = None;
        }
    }
}

/// True for errors that a new connection, or a moment, may cure: the connection dropped or was
/// refused (a restart), Redis is loading its data, a replica refuses writes after a failover, a
/// cluster is between owners of a slot.
pub(super) fn reconnects(e: &redis::RedisError) -> bool {
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

pub(super) fn manager_config(
    connect_timeout: Duration,
    timeout: Duration,
) -> redis::aio::ConnectionManagerConfig {
    redis::aio::ConnectionManagerConfig::new()
        .set_connection_timeout(Some(connect_timeout))
        .set_response_timeout(Some(timeout))
        .set_number_of_retries(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tls_master_is_named_only_by_sentinels_over_tls_or_under_a_pinned_authority() {
        let tls = MasterAccess {
            tls: true,
            ..MasterAccess::default()
        };
        let pinned = RedisTls {
            ca_pem: Some(b"-----BEGIN CERTIFICATE-----".to_vec()),
            ..RedisTls::default()
        };
        let system = RedisTls::default();
        let check = |urls: &[&str], access: &MasterAccess, trust: &RedisTls| {
            let urls: Vec<String> = urls.iter().map(|u| u.to_string()).collect();
            let addrs: Vec<_> = urls
                .iter()
                .map(|u| {
                    use redis::IntoConnectionInfo;
                    u.as_str().into_connection_info().unwrap().addr().clone()
                })
                .collect();
            untrusted_sentinels(&urls, &addrs, access, trust)
        };
        let plain = ["rediss://s1:26379", "redis://:pw@s2:26379"];
        let e = check(&plain, &tls, &system).unwrap();
        assert!(
            e.contains("redis://:***@s2:26379") && !e.contains("pw@"),
            "{e}"
        );
        assert!(check(&plain, &tls, &pinned).is_none());
        assert!(check(&["rediss://s1:26379", "rediss://s2:26379"], &tls, &system).is_none());
        // A master reached without TLS is promised nothing.
        assert!(check(&plain, &MasterAccess::default(), &system).is_none());
    }

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
}
