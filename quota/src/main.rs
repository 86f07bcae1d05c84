//! `tollgate-quota`: serve global limits to tollgate filters (see docs/quota-api.md).

use clap::Parser;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tollgate_core::global::lease::ColdStart;
use tollgate_quota::calendar::CalendarClock;
use tollgate_quota::credentials::{Credentials, ProxyToken};
use tollgate_quota::metrics::Metrics;
use tollgate_quota::server::{serve, ServerLimits};
use tollgate_quota::service::{router, Service};
use tollgate_quota::store::redis::{MasterAccess, RedisStore, RedisTarget, RedisTls};
use tollgate_quota::store::{now_ms, MemoryStore, Store};

#[derive(Parser)]
#[command(
    version,
    about = "The tollgate quota service: global limits leased to proxies in batches"
)]
struct Args {
    /// Address to serve on.
    #[arg(long, env = "TOLLGATE_QUOTA_LISTEN", default_value = "127.0.0.1:8090")]
    listen: SocketAddr,
    /// Keep the buckets in Redis (e.g. redis://127.0.0.1:6379), so that several replicas serve one
    /// limit. Without it they live in this process.
    #[arg(
        long,
        env = "TOLLGATE_QUOTA_REDIS",
        conflicts_with = "redis_cluster",
        hide_env_values = true
    )]
    redis: Option<String>,
    /// Keep the buckets in a Redis Cluster: one or more of its nodes, comma-separated
    /// (redis://127.0.0.1:7000,redis://127.0.0.1:7001). Buckets spread over its slots and the
    /// service follows failovers.
    #[arg(
        long,
        env = "TOLLGATE_QUOTA_REDIS_CLUSTER",
        value_delimiter = ',',
        hide_env_values = true
    )]
    redis_cluster: Option<Vec<String>>,
    /// Keep the buckets in the Redis master that Sentinel names `--redis-master`: one or more
    /// sentinels, comma-separated (redis://127.0.0.1:26379,redis://127.0.0.1:26380). After any
    /// storage error the service asks the sentinels again, so it follows failovers.
    #[arg(long, env = "TOLLGATE_QUOTA_REDIS_SENTINEL", value_delimiter = ',',
          conflicts_with_all = ["redis", "redis_cluster"], requires = "redis_master",
          hide_env_values = true)]
    redis_sentinel: Option<Vec<String>>,
    /// The master's name in Sentinel's configuration (with `--redis-sentinel`).
    #[arg(long, env = "TOLLGATE_QUOTA_REDIS_MASTER", requires = "redis_sentinel")]
    redis_master: Option<String>,
    /// The master's password, when it asks for one (with `--redis-sentinel`; the sentinels' own
    /// password goes in their URLs).
    #[arg(
        long,
        env = "TOLLGATE_QUOTA_REDIS_MASTER_PASSWORD",
        hide_env_values = true,
        requires = "redis_sentinel"
    )]
    redis_master_password: Option<String>,
    /// The master's user name (ACL), with `--redis-master-password`.
    #[arg(
        long,
        env = "TOLLGATE_QUOTA_REDIS_MASTER_USER",
        requires = "redis_master_password"
    )]
    redis_master_user: Option<String>,
    /// Reach the master over TLS (with `--redis-sentinel`; sentinels are reached over TLS when
    /// their URLs are `rediss://`).
    #[arg(
        long,
        env = "TOLLGATE_QUOTA_REDIS_MASTER_TLS",
        requires = "redis_sentinel"
    )]
    redis_master_tls: bool,
    /// Certificate authorities (a PEM file) that TLS connections to Redis trust — `rediss://`
    /// URLs, `--redis-master-tls` — instead of the system's.
    #[arg(long, env = "TOLLGATE_QUOTA_REDIS_CA")]
    redis_ca: Option<std::path::PathBuf>,
    /// A client certificate (PEM file) that TLS connections to Redis present, for a Redis that
    /// asks for one (`tls-auth-clients yes`); with `--redis-client-key`.
    #[arg(
        long,
        env = "TOLLGATE_QUOTA_REDIS_CLIENT_CERT",
        requires = "redis_client_key"
    )]
    redis_client_cert: Option<std::path::PathBuf>,
    /// The client certificate's private key (PEM file), with `--redis-client-cert`.
    #[arg(
        long,
        env = "TOLLGATE_QUOTA_REDIS_CLIENT_KEY",
        requires = "redis_client_cert"
    )]
    redis_client_key: Option<std::path::PathBuf>,
    /// How buckets (and global concurrency slots) the store does not know start. `auto`: full,
    /// unless proxies' calls show the store lost what they were using (a restart of the memory
    /// store, a Redis that lost data): then conservatively. `conservative`: always as after a
    /// loss (nothing granted for one lease TTL from the store's start, then refilling from
    /// empty). `full`: always full (a restart can admit up to a burst more per key).
    #[arg(long, env = "TOLLGATE_QUOTA_COLD_START", value_enum, default_value_t = ColdStartArg::Auto)]
    cold_start: ColdStartArg,
    /// Require `Authorization: Bearer <token>` on lease calls. Required to listen beyond loopback.
    #[arg(long, env = "TOLLGATE_QUOTA_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// A proxy's own token, `NAME=TOKEN` (token of 16 bytes or more); repeat it, or give several
    /// comma-separated. A call with it acts as instances `NAME/<instance>` only: it cannot speak
    /// for another proxy's instances (free its slots, take its reservations).
    #[arg(
        long,
        env = "TOLLGATE_QUOTA_PROXY_TOKENS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    proxy_token: Vec<String>,
    /// Open the admin API (`/admin/v1/…`: the limits served lately and their busiest keys, a
    /// bucket's state, its reset) to calls with `Authorization: Bearer <this>` — 16 bytes or more,
    /// none of the proxies' tokens. Without it the admin API is not served (404).
    #[arg(long, env = "TOLLGATE_QUOTA_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// Live instances (those that called within a lease TTL) one credential may act as: a caller
    /// cannot invent instances without end to collect fair shares. A call for one more is
    /// answered 403.
    #[arg(long, env = "TOLLGATE_QUOTA_MAX_INSTANCES", default_value_t = tollgate_quota::credentials::DEFAULT_MAX_INSTANCES)]
    max_instances: usize,
    /// Longest wait for Redis before answering 503; within it a dropped connection is made
    /// again and the call sent again. Keep it below the proxies' call timeout (200 ms by default).
    #[arg(long, env = "TOLLGATE_QUOTA_STORAGE_TIMEOUT_MS", default_value_t = 100)]
    storage_timeout_ms: u64,
    /// How long a proxy may keep tokens it was granted (and how long its demand counts).
    #[arg(long, env = "TOLLGATE_QUOTA_LEASE_TTL_MS", default_value_t = 10_000)]
    lease_ttl_ms: u64,
    /// Connections open at once. When all are open, a new one takes the place of the oldest that
    /// has not yet had a call answered 200 (a slow or idle client); only when every one has does a
    /// new connection wait in the listen backlog. The process needs this many open files, and
    /// about 64 more (Redis connections, logs).
    #[arg(long, env = "TOLLGATE_QUOTA_MAX_CONNECTIONS", default_value_t = 512)]
    max_connections: usize,
    /// A connection's next request headers must arrive within this long of its opening or of its
    /// previous answer: idle and half-sent connections are closed. Keep proxies' idle timeout
    /// for this service below it.
    #[arg(
        long,
        env = "TOLLGATE_QUOTA_HEADER_TIMEOUT_MS",
        default_value_t = 5_000
    )]
    header_timeout_ms: u64,
    /// A lease call's body must arrive within this long (408 otherwise).
    #[arg(long, env = "TOLLGATE_QUOTA_BODY_TIMEOUT_MS", default_value_t = 5_000)]
    body_timeout_ms: u64,
    /// The time calendar quotas' periods are read at when the service starts (RFC 3339, such as
    /// 2026-11-30T23:59:50+01:00); they run on from it. To try a period's end without waiting
    /// for it: never in production (the proxies' clocks do not follow).
    #[arg(long, env = "TOLLGATE_QUOTA_CALENDAR_CLOCK")]
    calendar_clock: Option<String>,
    /// Also serve Envoy's gRPC rate limit service (RLS: `envoy.service.ratelimit.v3`) on this
    /// address, over the same buckets (docs/quota-api.md#envoys-rate-limit-service-rls).
    #[arg(long, env = "TOLLGATE_QUOTA_GRPC_LISTEN")]
    grpc_listen: Option<SocketAddr>,
    /// RLS limits: envoyproxy/ratelimit's YAML configuration, files or directories of `.yaml`
    /// files (comma-separated, or the flag repeated). Needs `--grpc-listen`.
    #[arg(
        long,
        env = "TOLLGATE_QUOTA_RLS_CONFIG",
        value_delimiter = ',',
        requires = "grpc_listen"
    )]
    rls_config: Vec<std::path::PathBuf>,
    /// The filters' `quota_service.key_secret` (16 bytes or more), so that an RLS descriptor with
    /// a `tollgate_bucket` names its keys as the filters do. Without it, the secret the filters
    /// derive from `--token` when they have no key_secret.
    #[arg(long, env = "TOLLGATE_QUOTA_KEY_SECRET", hide_env_values = true)]
    key_secret: Option<String>,
    /// In-memory store: most buckets kept at once (idle ones make room).
    #[arg(long, env = "TOLLGATE_QUOTA_MAX_KEYS", default_value_t = 1_000_000)]
    max_keys: usize,
    /// In-memory store: most buckets one credential's calls may make (the shared token is one
    /// credential, each proxy token another); its further new keys are refused one by one, so a
    /// leaked token cannot fill the store for the others. Default: --max-keys divided by the
    /// number of credentials, rounded down.
    #[arg(long, env = "TOLLGATE_QUOTA_MAX_KEYS_PER_CREDENTIAL")]
    max_keys_per_credential: Option<usize>,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ColdStartArg {
    Auto,
    Conservative,
    Full,
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    if let Err(e) = run(args).await {
        tracing::error!("{e}");
        std::process::exit(1);
    }
}

async fn run(args: Args) -> Result<(), String> {
    let proxies = args
        .proxy_token
        .iter()
        .map(|s| ProxyToken::parse(s))
        .collect::<Result<Vec<_>, _>>()?;
    if args.token.as_deref().is_some_and(str::is_empty) {
        return Err("--token must not be empty (leave it out for no token)".into());
    }
    if let Some(admin) = &args.admin_token {
        let mut proxy_tokens: Vec<&str> = proxies.iter().map(|p| p.token.as_str()).collect();
        proxy_tokens.extend(args.token.as_deref());
        tollgate_quota::admin::check_admin_token(admin, &proxy_tokens)?;
    }
    let credentials = Credentials::new(
        args.token.clone(),
        proxies,
        args.max_instances,
        Duration::from_millis(args.lease_ttl_ms),
    );
    for listen in std::iter::once(args.listen).chain(args.grpc_listen) {
        if !credentials.required() && !listen.ip().is_loopback() {
            return Err(format!(
                "refusing to listen on {listen} without --token: anyone who reaches it could \
                 take every key's quota and free other proxies' slots; set --token \
                 (TOLLGATE_QUOTA_TOKEN) or --proxy-token, or listen on 127.0.0.1"
            ));
        }
    }
    if args.key_secret.as_ref().is_some_and(|s| s.len() < 16) {
        return Err("--key-secret must be at least 16 bytes (the filters' key_secret)".into());
    }
    let rls_config = tollgate_quota::rls::config::RlsConfig::load(&args.rls_config)
        .map_err(|e| format!("--rls-config: {e}"))?;
    let timeout = Duration::from_millis(args.storage_timeout_ms);
    let epoch_ms = now_ms();
    let cold = match args.cold_start {
        ColdStartArg::Auto => ColdStart::Auto { epoch_ms },
        ColdStartArg::Conservative => ColdStart::Conservative { epoch_ms },
        ColdStartArg::Full => ColdStart::Full,
    };
    let target = match (&args.redis, &args.redis_cluster, &args.redis_sentinel) {
        (Some(url), _, _) => Some(RedisTarget::Single(url.clone())),
        (None, Some(nodes), _) => Some(RedisTarget::Cluster(nodes.clone())),
        (None, None, Some(sentinels)) => Some(RedisTarget::Sentinel {
            sentinels: sentinels.clone(),
            master: args.redis_master.clone().unwrap_or_default(),
            access: MasterAccess {
                user: args.redis_master_user.clone(),
                password: args.redis_master_password.clone(),
                tls: args.redis_master_tls,
            },
        }),
        (None, None, None) => None,
    };
    let storage = match &target {
        Some(RedisTarget::Single(_)) => "redis",
        Some(RedisTarget::Cluster(_)) => "redis-cluster",
        Some(RedisTarget::Sentinel { .. }) => "redis-sentinel",
        None => "memory",
    };
    let read = |flag: &str, path: &std::path::Path| {
        std::fs::read(path).map_err(|e| format!("cannot read {flag} {}: {e}", path.display()))
    };
    let trust = RedisTls {
        ca_pem: match &args.redis_ca {
            Some(path) => Some(read("--redis-ca", path)?),
            None => None,
        },
        client_pem: match (&args.redis_client_cert, &args.redis_client_key) {
            (Some(cert), Some(key)) => Some((
                read("--redis-client-cert", cert)?,
                read("--redis-client-key", key)?,
            )),
            _ => None,
        },
    };
    let store = match &target {
        Some(target) => Store::Redis(
            RedisStore::connect_with(target, timeout, cold, &trust)
                .await
                .map_err(|e| format!("cannot use {target}: {e}"))?,
        ),
        None => Store::Memory(MemoryStore::with_caps(
            args.max_keys,
            args.max_keys_per_credential
                .unwrap_or(args.max_keys / credentials.count()),
            cold,
        )),
    };
    let calendar = match &args.calendar_clock {
        None => CalendarClock::default(),
        Some(at) => {
            let at = tollgate_core::calendar::rfc3339_ms(at)
                .ok_or_else(|| {
                    format!("--calendar-clock {at:?} is not an RFC 3339 time after 1970 (2026-11-30T23:59:50+01:00)")
                })?;
            tracing::warn!(
                offset_ms = at as i64 - now_ms() as i64,
                "calendar quotas read their periods by --calendar-clock, not this machine's clock"
            );
            CalendarClock::reading(at, now_ms())
        }
    };
    let service = Arc::new(Service {
        store,
        credentials,
        lease_ttl_ms: args.lease_ttl_ms,
        metrics: Metrics::default(),
        body_timeout: Duration::from_millis(args.body_timeout_ms),
        calendar,
    });
    // gRPC first: once the HTTP port answers (what readiness checks wait for), both do.
    let grpc_listener = match args.grpc_listen {
        None => None,
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| format!("cannot listen on {addr} (--grpc-listen): {e}"))?,
        ),
    };
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    tracing::info!(
        listen = %local,
        storage,
        "tollgate-quota serving"
    );
    let limits = ServerLimits {
        max_connections: args.max_connections,
        header_timeout: Duration::from_millis(args.header_timeout_ms),
    };
    let server_metrics = service.metrics.server.clone();
    let rls_service = service.clone();
    let mut app = router(service.clone());
    if let Some(token) = args.admin_token.clone() {
        app = app.merge(tollgate_quota::admin::router(service, token));
    }
    let (stop, stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown().await;
        let _ = stop.send(true);
    });
    let until_stopped = |mut stopped: tokio::sync::watch::Receiver<bool>| async move {
        let _ = stopped.wait_for(|s| *s).await;
    };
    let grpc = match grpc_listener {
        None => None,
        Some(listener) => {
            let local = listener.local_addr().map_err(|e| e.to_string())?;
            if args.lease_ttl_ms < 6_000 {
                tracing::warn!(
                    lease_ttl_ms = args.lease_ttl_ms,
                    "RLQS assignments last a lease TTL and Envoy reports every 5 s: set \
                     --lease-ttl-ms above 6000, or assignments expire between reports"
                );
            }
            if rls_config.domains() == 0 {
                tracing::warn!("RLS without --rls-config: every descriptor is answered OK");
            }
            tracing::info!(grpc_listen = %local, rls_domains = rls_config.domains(), "gRPC serving");
            let key_secret = tollgate_core::key_name::key_secret(
                args.key_secret.as_deref(),
                args.token.as_deref(),
            );
            let config = Arc::new(rls_config);
            let rlqs =
                tollgate_quota::rlqs::Rlqs::new(rls_service.clone(), config.clone(), key_secret)
                    .ending_with(stopped.clone());
            let rls = tollgate_quota::rls::Rls {
                service: rls_service,
                config,
                key_secret,
            };
            Some(tokio::spawn(tollgate_quota::grpc::serve(
                listener,
                rls,
                rlqs,
                limits.header_timeout,
                until_stopped(stopped.clone()),
            )))
        }
    };
    serve(
        listener,
        app,
        limits,
        server_metrics,
        until_stopped(stopped),
        Duration::from_secs(10),
    )
    .await;
    if let Some(grpc) = grpc {
        // RLQS streams end with the service (see Rlqs::ending_with); calls in flight get the
        // same grace as the HTTP API's.
        match tokio::time::timeout(Duration::from_secs(10), grpc).await {
            Ok(Ok(Err(e))) => tracing::error!("{e}"),
            Ok(Err(e)) => tracing::error!("gRPC server: {e}"),
            Ok(Ok(Ok(()))) => {}
            Err(_) => tracing::warn!("gRPC calls still open after 10 s: stopped anyway"),
        }
    }
    tracing::info!("stopped");
    Ok(())
}

async fn shutdown() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}
