//! The gRPC server (Envoy's protocols) on its own port, beside the HTTP API and on the same
//! runtime, stores and credentials.

use crate::rlqs::Rlqs;
use crate::rls::Rls;
use std::future::Future;
use std::time::Duration;
use tokio::net::TcpListener;

/// Serve RLS and RLQS on `listener` until `shutdown` ends: calls in flight then get up to the server's
/// grace to finish.
pub async fn serve(
    listener: TcpListener,
    rls: Rls,
    rlqs: Rlqs,
    header_timeout: Duration,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), String> {
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    tonic::transport::Server::builder()
        // A call must be answered within this long; idle connections are probed and closed.
        .timeout(Duration::from_secs(5))
        .http2_keepalive_interval(Some(header_timeout))
        .http2_keepalive_timeout(Some(header_timeout))
        .concurrency_limit_per_connection(256)
        .add_service(crate::rls::wire::RlsServer(std::sync::Arc::new(rls)))
        .add_service(crate::rlqs::wire::QuotaServer(std::sync::Arc::new(rlqs)))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
        .map_err(|e| format!("gRPC server failed: {e}"))
}
