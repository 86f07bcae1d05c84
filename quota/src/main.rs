//! `tollgate-quota`: serve global limits to tollgate filters (see docs/quota-api.md).

use clap::Parser;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tollgate_quota::metrics::Metrics;
use tollgate_quota::service::{router, Service};
use tollgate_quota::store::{MemoryStore, RedisStore, Store};

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
    #[arg(long, env = "TOLLGATE_QUOTA_REDIS")]
    redis: Option<String>,
    /// Require `Authorization: Bearer <token>` on lease calls.
    #[arg(long, env = "TOLLGATE_QUOTA_TOKEN")]
    token: Option<String>,
    /// Longest wait for Redis before answering 503.
    #[arg(long, env = "TOLLGATE_QUOTA_STORAGE_TIMEOUT_MS", default_value_t = 20)]
    storage_timeout_ms: u64,
    /// How long a proxy may keep tokens it was granted (and how long its demand counts).
    #[arg(long, env = "TOLLGATE_QUOTA_LEASE_TTL_MS", default_value_t = 10_000)]
    lease_ttl_ms: u64,
    /// In-memory store: most buckets kept at once (idle ones make room).
    #[arg(long, env = "TOLLGATE_QUOTA_MAX_KEYS", default_value_t = 1_000_000)]
    max_keys: usize,
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
    let timeout = Duration::from_millis(args.storage_timeout_ms);
    let store = match &args.redis {
        Some(url) => Store::Redis(
            RedisStore::connect(url, timeout)
                .await
                .map_err(|e| format!("cannot use Redis at {url}: {e}"))?,
        ),
        None => Store::Memory(MemoryStore::new(args.max_keys)),
    };
    let service = Arc::new(Service {
        store,
        token: args.token,
        lease_ttl_ms: args.lease_ttl_ms,
        metrics: Metrics::default(),
    });
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    tracing::info!(
        listen = %local,
        storage = if args.redis.is_some() { "redis" } else { "memory" },
        "tollgate-quota serving"
    );
    axum::serve(listener, router(service))
        .with_graceful_shutdown(shutdown())
        .await
        .map_err(|e| e.to_string())?;
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
