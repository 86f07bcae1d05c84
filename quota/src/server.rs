//! The HTTP/1.1 server: at most so many connections at once, none kept by a slow client, and
//! proxies' connections served ahead of connections that have not yet made a call.
//!
//! A connection is *proven* once it has been answered 200 on a call (`/v1/…`): a proxy's
//! keep-alive connection. When every place is taken, a new connection takes the place of the
//! oldest connection not yet proven (a slow or idle client, most likely), so half-sent requests
//! can hold places but never keep a proxy out: a proxy's new connection sends its call at once
//! and is proven within one round trip. Only when every place is proven does a new connection
//! wait in the listen backlog.

use axum::body::Body;
use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, Notify};
use tower::ServiceExt;

#[derive(Debug, Clone, Copy)]
pub struct ServerLimits {
    /// Connections served at once; beyond, a new one replaces the oldest not yet proven, or
    /// waits in the listen backlog.
    pub max_connections: usize,
    /// A connection's next request headers must arrive within this long (from its opening, or
    /// from the end of its previous request): idle and half-sent connections are closed.
    pub header_timeout: Duration,
}

/// What the server reports: connections open now, and those closed to make room.
#[derive(Clone, Default)]
pub struct ServerMetrics {
    pub open: Gauge,
    pub evicted: Counter,
}

/// One open connection, as the accept loop sees it.
struct Place {
    proven: Arc<AtomicBool>,
    /// Closes the connection (dropped: nothing happens).
    close: oneshot::Sender<()>,
}

/// The open connections by age (ids grow), and a signal when one closes.
#[derive(Default)]
struct Places {
    open: Mutex<BTreeMap<u64, Place>>,
    closed: Notify,
}

impl Places {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Place>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Make room for one more within `max`: close the oldest connection not yet proven if every
    /// place is taken. False if every place is taken by proven connections.
    fn make_room(&self, max: usize, evicted: &Counter) -> bool {
        let mut open = self.lock();
        if open.len() < max {
            return true;
        }
        let victim = open
            .iter()
            .find(|(_, p)| !p.proven.load(Ordering::Relaxed))
            .map(|(&id, _)| id);
        match victim.and_then(|id| open.remove(&id)) {
            Some(place) => {
                let _ = place.close.send(());
                evicted.inc();
                true
            }
            None => false,
        }
    }
}

/// Serve `app` on `listener` until `shutdown`, then let requests in progress finish (at most
/// `drain` more).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ServerLimits,
    metrics: ServerMetrics,
    shutdown: impl Future<Output = ()>,
    drain: Duration,
) {
    let places = Arc::new(Places::default());
    let max = limits.max_connections.max(1);
    let graceful = GracefulShutdown::new();
    let mut next_id = 0u64;
    tokio::pin!(shutdown);
    loop {
        // Every place proven: wait for one to close (new connections wait in the backlog).
        while !places.make_room(max, &metrics.evicted) {
            let closed = places.closed.notified();
            tokio::select! {
                () = closed => {}
                () = &mut shutdown => return finish(listener, graceful, drain).await,
            }
        }
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
        let proven = Arc::new(AtomicBool::new(false));
        let (close, closing) = oneshot::channel();
        next_id += 1;
        let id = next_id;
        places.lock().insert(
            id,
            Place {
                proven: proven.clone(),
                close,
            },
        );
        let app = app.clone();
        let service = tower::service_fn(move |req: axum::http::Request<hyper::body::Incoming>| {
            let call = req.uri().path().starts_with("/v1/");
            let (app, proven) = (app.clone(), proven.clone());
            async move {
                let response = app.oneshot(req.map(Body::new)).await;
                if let Ok(r) = &response {
                    if call && r.status() == axum::http::StatusCode::OK {
                        proven.store(true, Ordering::Relaxed);
                    }
                }
                response
            }
        });
        let conn = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_timeout)
            .serve_connection(TokioIo::new(stream), TowerToHyperService::new(service));
        let conn = graceful.watch(conn);
        let (open, places) = (metrics.open.clone(), places.clone());
        open.inc();
        tokio::spawn(async move {
            // Evicted: dropping the connection closes it.
            tokio::select! {
                _ = conn => {}
                _ = closing => {}
            }
            open.dec();
            places.lock().remove(&id);
            places.closed.notify_one();
        });
    }
    finish(listener, graceful, drain).await;
}

async fn finish(listener: TcpListener, graceful: GracefulShutdown, drain: Duration) {
    drop(listener);
    if tokio::time::timeout(drain, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("requests still in progress after {drain:?}: stopping anyway");
    }
}
