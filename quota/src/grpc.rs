//! The gRPC server (Envoy's protocols) on its own port, beside the HTTP API and on the same
//! runtime, stores and credentials.

use crate::credentials::Caller;
use crate::rlqs::Rlqs;
use crate::rls::Rls;
use crate::service::Service;
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

/// The instance a gRPC call acts as: its `authorization` metadata proves the caller (as the HTTP
/// API's header does), bound to `instance` ([`crate::credentials::Credentials::bind`]).
pub fn bind_instance(
    service: &Service,
    metadata: &tonic::metadata::MetadataMap,
    instance: &str,
) -> Result<String, tonic::Status> {
    let given = metadata.get("authorization").and_then(|v| v.to_str().ok());
    let credentials = &service.credentials;
    let caller = match credentials.caller(given) {
        None => {
            return Err(tonic::Status::unauthenticated(
                "missing or wrong bearer token",
            ))
        }
        // (No token required: the instance is named as the shared token's would be.)
        Some(Caller::Anyone) => Caller::Shared,
        Some(c) => c,
    };
    credentials
        .bind(&caller, instance)
        .map_err(tonic::Status::permission_denied)
}
