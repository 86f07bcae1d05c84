//! RLQS's messages as bytes where Envoy puts request values: a bucket id's values come from
//! headers and need not be UTF-8, and one such value must not break the whole stream (the
//! protocol's `string` would refuse the message, and Envoy would send it again on every new
//! stream). The same wire format as `envoy.service.rate_limit_quota.v3`, and the server for it.

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    AbandonAction, QuotaAssignmentAction,
};
use envoy_types::pb::google::protobuf::Duration;
use std::sync::Arc;
use tonic::codegen::{http, BoxFuture, Context, Poll, Service, StdError};
use tonic::server::NamedService;

/// `RateLimitQuotaUsageReports`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Reports {
    #[prost(string, tag = "1")]
    pub domain: String,
    #[prost(message, repeated, tag = "2")]
    pub bucket_quota_usages: Vec<Usage>,
}

/// `RateLimitQuotaUsageReports.BucketQuotaUsage`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Usage {
    #[prost(message, optional, tag = "1")]
    pub bucket_id: Option<BucketId>,
    #[prost(message, optional, tag = "2")]
    pub time_elapsed: Option<Duration>,
    #[prost(uint64, tag = "3")]
    pub num_requests_allowed: u64,
    #[prost(uint64, tag = "4")]
    pub num_requests_denied: u64,
}

/// `BucketId`: its `map<string, string>` as the entries it is on the wire, in bytes.
#[derive(Clone, PartialEq, Eq, Hash, prost::Message)]
pub struct BucketId {
    #[prost(message, repeated, tag = "1")]
    pub bucket: Vec<Entry>,
}

#[derive(Clone, PartialEq, Eq, Hash, prost::Message)]
pub struct Entry {
    #[prost(bytes = "vec", tag = "1")]
    pub key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub value: Vec<u8>,
}

/// `RateLimitQuotaResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Response {
    #[prost(message, repeated, tag = "1")]
    pub bucket_action: Vec<BucketAction>,
}

/// `RateLimitQuotaResponse.BucketAction`: the bucket's id echoed byte for byte (Envoy finds the
/// bucket by it).
#[derive(Clone, PartialEq, prost::Message)]
pub struct BucketAction {
    #[prost(message, optional, tag = "1")]
    pub bucket_id: Option<BucketId>,
    #[prost(oneof = "Action", tags = "2, 3")]
    pub bucket_action: Option<Action>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Action {
    #[prost(message, tag = "2")]
    QuotaAssignmentAction(QuotaAssignmentAction),
    #[prost(message, tag = "3")]
    AbandonAction(AbandonAction),
}

/// What serves `StreamRateLimitQuotas`.
#[tonic::async_trait]
pub trait QuotaStreams: Send + Sync + 'static {
    type Answers: futures::Stream<Item = Result<Response, tonic::Status>> + Send + 'static;
    async fn stream(
        &self,
        request: tonic::Request<tonic::Streaming<Reports>>,
    ) -> Result<tonic::Response<Self::Answers>, tonic::Status>;
}

pub const SERVICE_NAME: &str = "envoy.service.rate_limit_quota.v3.RateLimitQuotaService";
const METHOD: &str =
    "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas";

/// The gRPC service of `T` (what tonic's generated server does, with these messages).
pub struct QuotaServer<T>(pub Arc<T>);

impl<T> Clone for QuotaServer<T> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<T> NamedService for QuotaServer<T> {
    const NAME: &'static str = SERVICE_NAME;
}

struct Method<T>(Arc<T>);

impl<T: QuotaStreams> tonic::server::StreamingService<Reports> for Method<T> {
    type Response = Response;
    type ResponseStream = T::Answers;
    type Future = BoxFuture<tonic::Response<T::Answers>, tonic::Status>;

    fn call(&mut self, request: tonic::Request<tonic::Streaming<Reports>>) -> Self::Future {
        let inner = self.0.clone();
        Box::pin(async move { inner.stream(request).await })
    }
}

impl<T, B> Service<http::Request<B>> for QuotaServer<T>
where
    T: QuotaStreams,
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
            let codec = tonic_prost::ProstCodec::<Response, Reports>::default();
            let mut grpc = tonic::server::Grpc::new(codec);
            Ok(grpc.streaming(Method(inner), req).await)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::service::rate_limit_quota::v3 as envoy;
    use prost::Message;

    #[test]
    fn the_messages_are_envoys_on_the_wire_and_take_any_bytes() {
        let theirs = envoy::RateLimitQuotaUsageReports {
            domain: "api".into(),
            bucket_quota_usages: vec![envoy::rate_limit_quota_usage_reports::BucketQuotaUsage {
                bucket_id: Some(envoy::BucketId {
                    bucket: [("tenant".to_owned(), "acme".to_owned())].into(),
                }),
                time_elapsed: Some(Duration {
                    seconds: 5,
                    nanos: 0,
                }),
                num_requests_allowed: 3,
                num_requests_denied: 4,
            }],
        };
        let ours = Reports::decode(theirs.encode_to_vec().as_slice()).unwrap();
        let usage = &ours.bucket_quota_usages[0];
        assert_eq!(
            usage.bucket_id.as_ref().unwrap().bucket,
            [Entry {
                key: b"tenant".to_vec(),
                value: b"acme".to_vec()
            }]
        );
        assert_eq!(
            (usage.num_requests_allowed, usage.num_requests_denied),
            (3, 4)
        );
        // A value that is not UTF-8 decodes here (Envoy's own type refuses the message).
        let bad = Reports {
            domain: "api".into(),
            bucket_quota_usages: vec![Usage {
                bucket_id: Some(BucketId {
                    bucket: vec![Entry {
                        key: b"tenant".to_vec(),
                        value: b"bad\xff\xfe".to_vec(),
                    }],
                }),
                ..Usage::default()
            }],
        };
        let bytes = bad.encode_to_vec();
        assert!(envoy::RateLimitQuotaUsageReports::decode(bytes.as_slice()).is_err());
        assert_eq!(Reports::decode(bytes.as_slice()).unwrap(), bad);
        // An answer is Envoy's.
        let answer = Response {
            bucket_action: vec![BucketAction {
                bucket_id: Some(BucketId {
                    bucket: vec![Entry {
                        key: b"tenant".to_vec(),
                        value: b"acme".to_vec(),
                    }],
                }),
                bucket_action: Some(Action::AbandonAction(AbandonAction {})),
            }],
        };
        let theirs =
            envoy::RateLimitQuotaResponse::decode(answer.encode_to_vec().as_slice()).unwrap();
        assert_eq!(
            theirs.bucket_action[0].bucket_id.as_ref().unwrap().bucket["tenant"],
            "acme"
        );
    }
}
