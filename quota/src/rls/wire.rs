//! RLS's request with bytes where Envoy puts request values: a descriptor's values come from
//! headers and need not be UTF-8, and Envoy's own `string` would refuse the whole call — which
//! Envoy's failure mode then decides, letting such a request through unlimited by default. Read
//! here as bytes and the values made text with U+FFFD for what is not UTF-8 (such values may share
//! a bucket: stricter, never looser); the same wire format, and the server for it.

use super::Rls;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry as EnvoyEntry, RateLimitOverride,
};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use std::sync::Arc;
use tonic::codegen::{http, BoxFuture, Context, Poll, Service, StdError};
use tonic::server::NamedService;

/// `RateLimitRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Request {
    #[prost(bytes = "vec", tag = "1")]
    pub domain: Vec<u8>,
    #[prost(message, repeated, tag = "2")]
    pub descriptors: Vec<Descriptor>,
    #[prost(uint32, tag = "3")]
    pub hits_addend: u32,
}

/// `RateLimitDescriptor`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Descriptor {
    #[prost(message, repeated, tag = "1")]
    pub entries: Vec<Entry>,
    #[prost(message, optional, tag = "2")]
    pub limit: Option<RateLimitOverride>,
    #[prost(message, optional, tag = "3")]
    pub hits_addend: Option<UInt64Value>,
    #[prost(bool, tag = "4")]
    pub is_negative_hits: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Entry {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub value: Vec<u8>,
}

fn text(b: Vec<u8>) -> String {
    String::from_utf8(b).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

impl From<Request> for RateLimitRequest {
    fn from(r: Request) -> Self {
        Self {
            domain: text(r.domain),
            descriptors: r
                .descriptors
                .into_iter()
                .map(|d| RateLimitDescriptor {
                    entries: d
                        .entries
                        .into_iter()
                        .map(|e| EnvoyEntry {
                            key: text(e.key),
                            value: text(e.value),
                        })
                        .collect(),
                    limit: d.limit,
                    hits_addend: d.hits_addend,
                    is_negative_hits: d.is_negative_hits,
                })
                .collect(),
            hits_addend: r.hits_addend,
        }
    }
}

pub const SERVICE_NAME: &str = "envoy.service.ratelimit.v3.RateLimitService";
const METHOD: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// The gRPC service of [`Rls`] (what tonic's generated server does, with this request).
#[derive(Clone)]
pub struct RlsServer(pub Arc<Rls>);

impl NamedService for RlsServer {
    const NAME: &'static str = SERVICE_NAME;
}

struct Method(Arc<Rls>);

impl tonic::server::UnaryService<Request> for Method {
    type Response = RateLimitResponse;
    type Future = BoxFuture<tonic::Response<RateLimitResponse>, tonic::Status>;

    fn call(&mut self, request: tonic::Request<Request>) -> Self::Future {
        let inner = self.0.clone();
        Box::pin(async move { inner.should_rate_limit(request.map(Into::into)).await })
    }
}

impl<B> Service<http::Request<B>> for RlsServer
where
    B: tonic::codegen::Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if req.uri().path() != METHOD {
            return Box::pin(async move { Ok(tonic::Status::unimplemented("").into_http()) });
        }
        let inner = self.0.clone();
        Box::pin(async move {
            let codec = tonic_prost::ProstCodec::<RateLimitResponse, Request>::default();
            let mut grpc = tonic::server::Grpc::new(codec);
            Ok(grpc.unary(Method(inner), req).await)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn the_request_is_envoys_on_the_wire_and_takes_any_bytes() {
        let bad = Request {
            domain: b"messaging".to_vec(),
            descriptors: vec![Descriptor {
                entries: vec![Entry {
                    key: b"to_number".to_vec(),
                    value: b"206\xff\xfe".to_vec(),
                }],
                hits_addend: Some(UInt64Value { value: 3 }),
                ..Descriptor::default()
            }],
            hits_addend: 2,
        };
        let bytes = bad.encode_to_vec();
        assert!(RateLimitRequest::decode(bytes.as_slice()).is_err());
        let read: RateLimitRequest = Request::decode(bytes.as_slice()).unwrap().into();
        assert_eq!(read.domain, "messaging");
        assert_eq!(read.descriptors[0].entries[0].value, "206\u{fffd}\u{fffd}");
        assert_eq!(
            read.descriptors[0].hits_addend,
            Some(UInt64Value { value: 3 })
        );
        assert_eq!(read.hits_addend, 2);
    }
}
