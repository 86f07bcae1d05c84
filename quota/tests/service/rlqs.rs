//! RLQS over the wire, as Envoy's rate_limit_quota filter speaks it: assignments of what was
//! granted (a blanket rule first, then the token bucket), blanket rules for what has no limit,
//! abandoned idle buckets, and grants that never exceed the bucket over two streams.

use super::*;
use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as Action;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::Duration as ProtoDuration;
use tokio::sync::mpsc;

const LIMITS: &str = "domain: api
descriptors:
  - key: tenant
    rate_limit: { unit: minute, requests_per_unit: 80 }
  - key: tier
    value: blocked
    rate_limit: { unit: minute, requests_per_unit: 0 }
";

/// The service with RLQS on a port of its own; killed on drop.
struct Service {
    child: Child,
    grpc: u16,
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(args: &[&str]) -> Service {
    let dir = std::env::temp_dir().join(format!(
        "tollgate-rlqs-{}-{}",
        std::process::id(),
        free_port()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let limits = dir.join("limits.yaml");
    std::fs::write(&limits, LIMITS).unwrap();
    let (http, grpc) = (free_port(), free_port());
    let child = Command::new(env!("CARGO_BIN_EXE_tollgate-quota"))
        .args(["--listen", &format!("127.0.0.1:{http}")])
        .args(["--grpc-listen", &format!("127.0.0.1:{grpc}")])
        .args(["--rls-config", &limits.display().to_string()])
        .args(args)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let listening = || std::net::TcpStream::connect(("127.0.0.1", http)).is_ok();
    assert!(
        eventually(Duration::from_secs(10), listening),
        "did not start"
    );
    Service { child, grpc }
}

/// One Envoy's stream: reports in, answers out.
struct Stream {
    reports: mpsc::Sender<RateLimitQuotaUsageReports>,
    answers: tonic::Streaming<RateLimitQuotaResponse>,
}

async fn open(service: &Service, token: Option<&str>) -> Result<Stream, tonic::Status> {
    let mut client =
        RateLimitQuotaServiceClient::connect(format!("http://127.0.0.1:{}", service.grpc))
            .await
            .unwrap();
    let (tx, rx) = mpsc::channel(8);
    let outbound =
        futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
    let mut request = tonic::Request::new(outbound);
    if let Some(t) = token {
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    let answers = client.stream_rate_limit_quotas(request).await?.into_inner();
    Ok(Stream {
        reports: tx,
        answers,
    })
}

fn id(entries: &[(&str, &str)]) -> BucketId {
    BucketId {
        bucket: entries
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
    }
}

fn report(buckets: &[(&[(&str, &str)], u64)], seconds: i64) -> RateLimitQuotaUsageReports {
    RateLimitQuotaUsageReports {
        domain: "api".into(),
        bucket_quota_usages: buckets
            .iter()
            .map(|(entries, allowed)| BucketQuotaUsage {
                bucket_id: Some(id(entries)),
                time_elapsed: Some(ProtoDuration { seconds, nanos: 0 }),
                num_requests_allowed: *allowed,
                num_requests_denied: 0,
            })
            .collect(),
    }
}

impl Stream {
    async fn ask(&mut self, buckets: &[(&[(&str, &str)], u64)], seconds: i64) -> Vec<Action> {
        self.reports.send(report(buckets, seconds)).await.unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(5), self.answers.message())
            .await
            .expect("an answer")
            .unwrap()
            .unwrap();
        answer
            .bucket_action
            .into_iter()
            .map(|a| a.bucket_action.unwrap())
            .collect()
    }
}

fn strategy(action: &Action) -> Strategy {
    match action {
        Action::QuotaAssignmentAction(a) => a.rate_limit_strategy.unwrap().strategy.unwrap(),
        Action::AbandonAction(_) => panic!("abandoned"),
    }
}

/// Tokens an answer assigned (a token bucket's start), 0 for a blanket rule alone.
fn tokens(actions: &[Action]) -> u64 {
    actions
        .iter()
        .filter_map(|a| match strategy(a) {
            Strategy::TokenBucket(b) => Some(u64::from(b.max_tokens)),
            _ => None,
        })
        .sum()
}

#[tokio::test]
async fn assignments_are_what_was_granted_and_blanket_rules_what_has_no_limit() {
    let service = start(&[]);
    let mut s = open(&service, None).await.unwrap();
    let acme: &[(&str, &str)] = &[("tenant", "acme")];
    let actions = s.ask(&[(acme, 0)], 0).await;
    // A blanket rule, then the token bucket: an eighth of 80 to start with, all of it granted.
    assert_eq!(actions.len(), 2, "{actions:?}");
    assert_eq!(
        strategy(&actions[0]),
        Strategy::BlanketRule(BlanketRule::DenyAll as i32)
    );
    let Strategy::TokenBucket(bucket) = strategy(&actions[1]) else {
        panic!("{actions:?}");
    };
    assert_eq!(bucket.max_tokens, 10);
    // Refill: the whole rate was asked first, 80/60 s reserved at most: 1 token a second.
    assert_eq!(bucket.tokens_per_fill.unwrap().value, 1);
    assert_eq!(bucket.fill_interval.unwrap().seconds, 1);
    let Action::QuotaAssignmentAction(a) = &actions[1] else {
        panic!()
    };
    assert_eq!(
        a.assignment_time_to_live.unwrap().seconds,
        9,
        "lease TTL less 250 ms"
    );
    // No limit: ALLOW_ALL; a limit of 0: DENY_ALL; nothing leased for either.
    let free: &[(&str, &str)] = &[("user", "x")];
    let blocked: &[(&str, &str)] = &[("tier", "blocked")];
    let actions = s.ask(&[(free, 1), (blocked, 1)], 0).await;
    let rules: Vec<Strategy> = actions.iter().map(strategy).collect();
    assert_eq!(
        rules,
        [
            Strategy::BlanketRule(BlanketRule::AllowAll as i32),
            Strategy::BlanketRule(BlanketRule::DenyAll as i32)
        ]
    );
    // Idle for two reports: abandoned.
    s.ask(&[(acme, 0)], 5).await;
    let actions = s.ask(&[(acme, 0)], 5).await;
    assert!(
        matches!(actions[..], [Action::AbandonAction(_)]),
        "{actions:?}"
    );
}

#[tokio::test]
async fn two_streams_are_never_assigned_more_than_the_bucket_holds() {
    let service = start(&[]);
    let mut a = open(&service, None).await.unwrap();
    let mut b = open(&service, None).await.unwrap();
    let acme: &[(&str, &str)] = &[("tenant", "acme")];
    // Both report heavy use as fast as they can: what they are assigned to start with, in all,
    // stays within 80 and what refills meanwhile (rate shares reserved come on top, paced).
    let started = Instant::now();
    let mut assigned = 0;
    for round in 0..20 {
        for s in [&mut a, &mut b] {
            assigned += tokens(&s.ask(&[(acme, 500)], if round == 0 { 0 } else { 1 }).await);
        }
    }
    let refill = 80.0 / 60.0 * started.elapsed().as_secs_f64();
    assert!(
        assigned as f64 <= 80.0 + refill + 1.0,
        "{assigned} tokens assigned in {:?}",
        started.elapsed()
    );
    assert!(assigned >= 40, "both were served: {assigned}");
}

#[tokio::test]
async fn a_stream_without_the_token_is_refused() {
    let service = start(&["--token", "rlqs-token-0123456789"]);
    let err = open(&service, None).await.err().expect("refused");
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    let mut ok = open(&service, Some("rlqs-token-0123456789")).await.unwrap();
    let actions = ok.ask(&[(&[("tenant", "acme")], 0)], 0).await;
    assert_eq!(tokens(&actions), 10);
}

#[tokio::test]
async fn a_bucket_id_that_is_not_utf8_goes_unanswered_and_the_stream_lives_on() {
    use tollgate_quota::rlqs::wire;
    let service = start(&[]);
    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{}", service.grpc))
            .unwrap()
            .connect()
            .await
            .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let (tx, rx) = mpsc::channel(8);
    let outbound =
        futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(
        "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas",
    );
    let codec = tonic_prost::ProstCodec::<wire::Reports, wire::Response>::default();
    let mut answers = grpc
        .streaming(tonic::Request::new(outbound), path, codec)
        .await
        .unwrap()
        .into_inner();
    let id = |value: &[u8]| wire::BucketId {
        bucket: vec![wire::Entry {
            key: b"tenant".to_vec(),
            value: value.to_vec(),
        }],
    };
    let usage = |value: &[u8]| wire::Usage {
        bucket_id: Some(id(value)),
        time_elapsed: Some(ProtoDuration {
            seconds: 0,
            nanos: 0,
        }),
        ..wire::Usage::default()
    };
    // Envoy cannot take an answer that holds such an id (its `string` refuses it): it is left
    // out, and the report's other buckets are answered.
    tx.send(wire::Reports {
        domain: "api".into(),
        bucket_quota_usages: vec![usage(b"bad\xff\xfe"), usage(b"good")],
    })
    .await
    .unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(5), answers.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(answer.bucket_action.len(), 2, "{answer:?}");
    for action in &answer.bucket_action {
        assert_eq!(action.bucket_id, Some(id(b"good")));
    }
    let Some(wire::Action::QuotaAssignmentAction(a)) = &answer.bucket_action[1].bucket_action
    else {
        panic!("{answer:?}");
    };
    let Some(Strategy::TokenBucket(b)) = a.rate_limit_strategy.unwrap().strategy else {
        panic!("{answer:?}");
    };
    assert_eq!(b.max_tokens, 10);
}

#[tokio::test]
async fn sigterm_ends_open_streams_and_the_service_stops() {
    let mut service = start(&[]);
    let mut s = open(&service, None).await.unwrap();
    s.ask(&[(&[("tenant", "acme")], 0)], 0).await;
    Command::new("kill")
        .args(["-TERM", &service.child.id().to_string()])
        .status()
        .unwrap();
    // The stream ends (Envoy then reconnects elsewhere) and the process exits.
    let ended = tokio::time::timeout(Duration::from_secs(5), s.answers.message()).await;
    assert!(matches!(ended, Ok(Ok(None)) | Ok(Err(_))), "{ended:?}");
    let stopped = eventually(Duration::from_secs(12), || {
        matches!(service.child.try_wait(), Ok(Some(_)))
    });
    assert!(stopped, "still running 12 s after SIGTERM");
}

/// A Redis without persistence restarted under an open stream: the stream's reports carry what it
/// was last assigned (its evidence), so the store sees that it lost the bucket and starts it
/// conservatively rather than full: after the loss the stream is assigned no more tokens than the
/// newcomers' reserve (an eighth of 80) and what refilled, where a bucket made anew full would
/// hand out 80 again.
#[tokio::test]
async fn a_redis_that_lost_its_data_under_an_open_stream_does_not_hand_the_limit_out_again() {
    let mut redis = Redis::start();
    let url = redis.url();
    let service = start(&["--redis", &url]);
    let mut a = open(&service, None).await.unwrap();
    let acme: &[(&str, &str)] = &[("tenant", "acme")];
    let mut before = 0;
    for round in 0..12 {
        before += tokens(&a.ask(&[(acme, 500)], i64::from(round > 0)).await);
    }
    assert!(
        before >= 70,
        "the bucket was spent before the loss: {before}"
    );
    redis.kill();
    redis.restart();
    let lost = Instant::now();
    // Reports the service cannot serve (its store reconnecting) go unanswered: Envoy keeps its
    // assignments until their TTL.
    let (mut answered, mut after) = (0, 0);
    while answered < 12 {
        a.reports.send(report(&[(acme, 500)], 1)).await.unwrap();
        match tokio::time::timeout(Duration::from_millis(500), a.answers.message()).await {
            Ok(message) => {
                let actions = message.unwrap().unwrap().bucket_action;
                after += tokens(
                    &actions
                        .into_iter()
                        .map(|a| a.bucket_action.unwrap())
                        .collect::<Vec<_>>(),
                );
                answered += 1;
            }
            Err(_) => assert!(
                lost.elapsed() < Duration::from_secs(10),
                "no answer after the store came back"
            ),
        }
    }
    let refill = 80.0 / 60.0 * lost.elapsed().as_secs_f64();
    assert!(
        after as f64 <= 10.0 + refill + 1.0,
        "{after} tokens assigned after the loss (in {:?})",
        lost.elapsed()
    );
}
