//! The HTTP/1.1 server: at most so many connections at once, and none kept by a slow client.

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use prometheus_client::metrics::gauge::Gauge;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

#[derive(Debug, Clone, Copy)]
pub struct ServerLimits {
    /// Connections served at once; more wait in the listen backlog.
    pub max_connections: usize,
    /// A connection's next request headers must arrive within this long (from its opening, or
    /// from the end of its previous request): idle and half-sent connections are closed.
    pub header_timeout: Duration,
}

/// Serve `app` on `listener` until `shutdown`, then let requests in progress finish (at most
/// `drain` more).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ServerLimits,
    open: Gauge,
    shutdown: impl Future<Output = ()>,
    drain: Duration,
) {
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            permit = permits.clone().acquire_owned() => match permit {
                Ok(p) => p,
                Err(_) => break,
            },
            () = &mut shutdown => break,
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of files, most likely: back off rather than spin.
                    tracing::warn!(error = %e, "cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let conn = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            .serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let conn = graceful.watch(conn);
        let open = open.clone();
        open.inc();
        tokio::spawn(async move {
            let _ = conn.await;
            open.dec();
            drop(permit);
        });
    }
    drop(listener);
    if tokio::time::timeout(drain, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("requests still in progress after {drain:?}: stopping anyway");
    }
}
