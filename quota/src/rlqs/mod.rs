//! Envoy's rate limit quota service (RLQS, `envoy.service.rate_limit_quota.v3`): each Envoy's
//! stream of usage reports answered with bucket assignments leased from the service's buckets, so
//! that what every Envoy may admit was granted to it first.
//!
//! A bucket's id (its entries sorted by name) is an RLS descriptor of `--rls-config`. Each report
//! of a limited bucket leases, for that Envoy, a few tokens outright and a share of the bucket's
//! refill for a lease TTL, and assigns a fresh token bucket of exactly that: as many tokens as
//! were granted to start with, refilled at most at the rate reserved, for as long as the
//! reservation lasts. Envoy carries a token bucket over to a new assignment (unchanged, or with
//! as large a part of it left), so each token bucket assignment follows a blanket rule for the
//! same bucket in the same answer: Envoy drops the old one and makes the new one full. A bucket
//! never outlives what paid for it; tokens an Envoy's replaced bucket still held are lost, never
//! spent twice.

pub mod wire;

use crate::rls::config::{Limit, RlsConfig};
use crate::service::Service;
use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::r#type::v3::{RateLimitStrategy, TokenBucket};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    AbandonAction, QuotaAssignmentAction,
};
use envoy_types::pb::google::protobuf::{Duration, UInt32Value};
use futures::Stream;
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tollgate_core::global::lease::{LeaseGrant, LeaseItem};
use tonic::{Request, Response, Status, Streaming};
use wire::{
    Action, BucketAction, BucketId, Reports as RateLimitQuotaUsageReports,
    Response as RateLimitQuotaResponse, Usage as BucketQuotaUsage,
};

/// Most buckets one stream may have assigned at once; reports of more are answered for the
/// first ones only (the rest go by Envoy's `no_assignment_behavior`).
pub const MAX_BUCKETS: usize = 10_000;
/// Most entries in a bucket's id.
pub const MAX_ID_ENTRIES: usize = 32;
/// An assignment ends this long before the reservation that pays for it: the answer's way to
/// Envoy.
const TTL_MARGIN_MS: u64 = 250;
/// Reports in a row of a bucket without requests after which it is abandoned.
const IDLE_REPORTS: u32 = 2;

pub struct Rlqs {
    pub service: Arc<Service>,
    pub config: Arc<RlsConfig>,
    pub key_secret: Option<[u8; 16]>,
    /// Names each stream's instance.
    streams: AtomicU64,
    started_ms: u64,
    /// Becomes true when the service stops: every stream then ends (else Envoy would keep it,
    /// and the process, open for ever).
    stopping: Option<tokio::sync::watch::Receiver<bool>>,
}

impl Rlqs {
    pub fn new(
        service: Arc<Service>,
        config: Arc<RlsConfig>,
        key_secret: Option<[u8; 16]>,
    ) -> Self {
        Self {
            service,
            config,
            key_secret,
            streams: AtomicU64::new(0),
            started_ms: crate::store::now_ms(),
            stopping: None,
        }
    }

    /// Streams end when `stopping` becomes true.
    pub fn ending_with(mut self, stopping: tokio::sync::watch::Receiver<bool>) -> Self {
        self.stopping = Some(stopping);
        self
    }
}

/// What a stream assigned a bucket last.
#[derive(Debug, Clone)]
struct Assigned {
    /// Its store item (limit and key), to renew and to let go of.
    item: LeaseItem,
    /// The last grant, as evidence for the next call (ms since the epoch when it came).
    grant: Option<(LeaseGrant, u64)>,
    /// Reports in a row without a request.
    idle: u32,
}

impl Assigned {
    /// The token bucket of a grant: `granted` tokens to start with (and at most), refilled at a
    /// whole number of tokens per whole number of seconds no faster than the reserved `rate`
    /// (Envoy reads the interval in whole seconds).
    fn next(&mut self, g: &LeaseGrant) -> Option<TokenBucket> {
        if g.granted == 0 {
            return None;
        }
        let (tokens, seconds) = if g.rate >= 1.0 {
            ((g.rate.floor() as u64).min(u64::from(u32::MAX)), 1)
        } else if g.rate > 0.0 {
            (1, ((1.0 / g.rate).ceil() as i64).min(3_600))
        } else {
            // Nothing reserved: one token an hour, which a bucket that lives at most a lease
            // TTL (well below an hour) never completes.
            (1, 3_600)
        };
        Some(TokenBucket {
            max_tokens: u32::try_from(g.granted).unwrap_or(u32::MAX),
            tokens_per_fill: Some(UInt32Value {
                value: u32::try_from(tokens).unwrap_or(u32::MAX),
            }),
            fill_interval: Some(Duration { seconds, nanos: 0 }),
        })
    }
}

type Answers = Pin<Box<dyn Stream<Item = Result<RateLimitQuotaResponse, Status>> + Send>>;

#[tonic::async_trait]
impl wire::QuotaStreams for Rlqs {
    type Answers = Answers;

    async fn stream(
        &self,
        request: Request<Streaming<RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Answers>, Status> {
        let metrics = &self.service.metrics;
        let outcome = |o: &'static str| {
            metrics
                .rlqs_streams
                .get_or_create(&crate::metrics::Outcome { outcome: o })
                .inc();
        };
        let n = self.streams.fetch_add(1, Ordering::Relaxed);
        let name = format!("rlqs-{:x}-{}-{n}", self.started_ms, std::process::id());
        let instance = crate::credentials::bind_grpc_instance(
            &self.service.credentials,
            request.metadata(),
            &name,
        )
        .inspect_err(|s| {
            outcome(if s.code() == tonic::Code::Unauthenticated {
                "unauthorized"
            } else {
                "forbidden"
            })
        })?;
        outcome("ok");
        let mut reports = request.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        let stream = StreamState {
            service: self.service.clone(),
            config: self.config.clone(),
            key_secret: self.key_secret,
            instance,
            domain: String::new(),
            buckets: HashMap::new(),
        };
        let mut stopping = self.stopping.clone();
        tokio::spawn(async move {
            let mut stream = stream;
            loop {
                let next = async {
                    match &mut stopping {
                        Some(s) => {
                            tokio::select! {
                                r = reports.message() => Some(r),
                                _ = s.wait_for(|stop| *stop) => None,
                            }
                        }
                        None => Some(reports.message().await),
                    }
                };
                let report = match next.await {
                    Some(Ok(Some(r))) => r,
                    // The Envoy ended it, it broke, or the service stops.
                    Some(Ok(None)) | Some(Err(_)) | None => break,
                };
                let answer = stream.answer(report).await;
                if !answer.bucket_action.is_empty() && tx.send(Ok(answer)).await.is_err() {
                    break;
                }
            }
            stream.let_go().await;
        });
        let answers =
            futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
        Ok(Response::new(Box::pin(answers)))
    }
}

/// One Envoy's stream: its instance and what it was assigned.
struct StreamState {
    service: Arc<Service>,
    config: Arc<RlsConfig>,
    key_secret: Option<[u8; 16]>,
    instance: String,
    domain: String,
    buckets: HashMap<Vec<(String, String)>, Assigned>,
}

/// What a reported bucket gets.
enum Plan {
    Blanket(BlanketRule),
    Lease(Vec<(String, String)>),
    /// Not answered (a bucket past [`MAX_BUCKETS`], an empty id).
    Nothing,
}

impl StreamState {
    fn ttl(&self) -> Duration {
        let ms = self
            .service
            .lease_ttl_ms
            .saturating_sub(TTL_MARGIN_MS)
            .max(1);
        Duration {
            seconds: (ms / 1_000) as i64,
            nanos: ((ms % 1_000) * 1_000_000) as i32,
        }
    }

    fn action(&self, id: BucketId, strategy: Strategy) -> BucketAction {
        BucketAction {
            bucket_id: Some(id),
            bucket_action: Some(Action::QuotaAssignmentAction(QuotaAssignmentAction {
                assignment_time_to_live: Some(self.ttl()),
                rate_limit_strategy: Some(RateLimitStrategy {
                    strategy: Some(strategy),
                }),
            })),
        }
    }

    /// Answer one report: an action for each bucket it names.
    async fn answer(&mut self, report: RateLimitQuotaUsageReports) -> RateLimitQuotaResponse {
        self.service.metrics.rlqs_reports.inc();
        if !report.domain.is_empty() {
            self.domain = report.domain;
        }
        let now_ms = crate::store::now_ms();
        let mut actions = Vec::new();
        let mut leases: Vec<(BucketId, Vec<(String, String)>)> = Vec::new();
        let mut abandoned = Vec::new();
        for usage in report.bucket_quota_usages.into_iter().take(MAX_BUCKETS) {
            let Some(id) = usage.bucket_id.clone() else {
                continue;
            };
            tracing::debug!(instance = %self.instance, usage = ?usage, "RLQS usage");
            match self.plan(&usage) {
                Plan::Nothing => {}
                Plan::Blanket(rule) => {
                    actions.push(self.action(id, Strategy::BlanketRule(rule as i32)))
                }
                Plan::Lease(entries) => {
                    // (A periodic report: one with no time elapsed is a bucket's first.)
                    let used = usage.num_requests_allowed + usage.num_requests_denied;
                    let periodic = usage.time_elapsed.is_some_and(|d| d.seconds > 0);
                    let idle = self.buckets.get_mut(&entries).map(|a| {
                        a.idle = if used == 0 && periodic { a.idle + 1 } else { 0 };
                        a.idle
                    });
                    if idle.is_some_and(|n| n >= IDLE_REPORTS) {
                        abandoned.push(entries);
                        actions.push(BucketAction {
                            bucket_id: Some(id),
                            bucket_action: Some(Action::AbandonAction(AbandonAction {})),
                        });
                        continue;
                    }
                    self.ask(&entries, &usage, now_ms);
                    leases.push((id, entries));
                }
            }
        }
        let mut items: Vec<LeaseItem> = leases
            .iter()
            .filter_map(|(_, e)| self.buckets.get(e).map(|a| a.item.clone()))
            .collect();
        // Abandoned buckets give back their reservation.
        for entries in &abandoned {
            if let Some(a) = self.buckets.remove(entries) {
                items.push(LeaseItem {
                    wanted: 0,
                    used: 0,
                    demand: 0.0,
                    ..a.item
                });
            }
        }
        let ttl = self.service.lease_ttl_ms;
        let metrics = &self.service.metrics;
        let grants = if items.is_empty() {
            Vec::new()
        } else {
            match self.service.store.lease(&self.instance, &items, ttl).await {
                Ok(answers) => answers.items,
                Err(e) => {
                    // Nothing assigned: Envoy keeps its assignments until their TTL, then goes
                    // by its expired_assignment_behavior.
                    metrics.storage_errors.inc();
                    tracing::warn!(error = %e, "RLQS: storage failed");
                    Vec::new()
                }
            }
        };
        for ((id, entries), grant) in leases.iter().zip(grants) {
            let Some(a) = self.buckets.get_mut(entries) else {
                continue;
            };
            metrics.granted.inc_by(grant.granted);
            tracing::debug!(
                instance = %self.instance, bucket = ?entries, wanted = a.item.wanted,
                demand = a.item.demand, grant = ?grant, "RLQS bucket assigned"
            );
            a.grant = Some((grant, now_ms));
            let strategy = match a.next(&grant) {
                Some(bucket) => Strategy::TokenBucket(bucket),
                // Nothing to start with: refused until the next report asks again.
                None => Strategy::BlanketRule(BlanketRule::DenyAll as i32),
            };
            metrics
                .rlqs_assignments
                .get_or_create(&crate::metrics::Outcome {
                    outcome: match strategy {
                        Strategy::TokenBucket(_) => "token_bucket",
                        _ => "deny_all",
                    },
                })
                .inc();
            if let Strategy::TokenBucket(_) = strategy {
                // First a blanket rule: Envoy then has no token bucket of this bucket's left
                // to carry over, and makes the new one full — of the tokens just granted.
                let deny = Strategy::BlanketRule(BlanketRule::DenyAll as i32);
                actions.push(self.action(id.clone(), deny));
            }
            actions.push(self.action(id.clone(), strategy));
        }
        RateLimitQuotaResponse {
            bucket_action: actions,
        }
    }

    /// What a reported bucket gets, by the limit its id finds.
    fn plan(&mut self, usage: &BucketQuotaUsage) -> Plan {
        let Some(id) = &usage.bucket_id else {
            return Plan::Nothing;
        };
        if id.bucket.is_empty() || id.bucket.len() > MAX_ID_ENTRIES {
            return Plan::Nothing;
        }
        // An id that is not UTF-8 (a header's bytes) cannot be answered: Envoy refuses a message
        // that holds one, and finds buckets by their exact id. It goes by Envoy's
        // no_assignment_behavior; the others are answered as ever.
        let text = |b: &[u8]| std::str::from_utf8(b).ok().map(str::to_owned);
        let entries: Option<Vec<(String, String)>> = id
            .bucket
            .iter()
            .map(|e| Some((text(&e.key)?, text(&e.value)?)))
            .collect();
        let Some(mut entries) = entries else {
            self.service
                .metrics
                .rlqs_assignments
                .get_or_create(&crate::metrics::Outcome {
                    outcome: "unanswered_not_utf8",
                })
                .inc();
            return Plan::Nothing;
        };
        entries.sort();
        if self.buckets.contains_key(&entries) {
            return Plan::Lease(entries);
        }
        let pairs: Vec<(&str, &str)> = entries
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let Some(found) = self.config.find(&self.domain, &pairs) else {
            return Plan::Blanket(BlanketRule::AllowAll);
        };
        let limit: &Limit = found.limit;
        let Some(rate) = limit.rate.filter(|_| !limit.shadow_mode) else {
            return Plan::Blanket(BlanketRule::AllowAll);
        };
        if rate.requests_per_unit == 0 {
            return Plan::Blanket(BlanketRule::DenyAll);
        }
        if self.buckets.len() >= MAX_BUCKETS {
            return Plan::Nothing;
        }
        let pairs: Vec<(&str, &str)> = entries
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        // The same bucket as an RLS descriptor with these entries.
        let item = crate::rls::bucket_of(limit, rate, &found.key_values, &pairs, self.key_secret);
        self.buckets.insert(
            entries.clone(),
            Assigned {
                item,
                grant: None,
                idle: 0,
            },
        );
        Plan::Lease(entries)
    }

    /// Set a bucket's item for this report: tokens for about a second of what it was offered
    /// (an eighth of the burst at first), the refill it was offered with an eighth more (the
    /// whole refill at first), and the evidence of its last grant.
    fn ask(&mut self, entries: &[(String, String)], usage: &BucketQuotaUsage, now_ms: u64) {
        let Some(a) = self.buckets.get_mut(entries) else {
            return;
        };
        let seconds = usage.time_elapsed.map_or(0, |d| d.seconds.max(0) as u64);
        let offered = usage.num_requests_allowed + usage.num_requests_denied;
        let burst = a.item.burst;
        let (wanted, demand) = if a.grant.is_none() || seconds == 0 {
            // Nothing measured yet, and the next report is 5 s away: ask for the whole refill
            // (fair shares split it among the Envoys that ask).
            let whole = a.item.requests as f64 * 1_000.0 / a.item.per_ms as f64;
            (burst.div_ceil(8).max(1), whole)
        } else {
            let per_second = offered as f64 / seconds as f64;
            (
                (per_second.ceil() as u64).clamp(1, burst),
                per_second * 1.125,
            )
        };
        a.item.wanted = wanted;
        a.item.used = usage.num_requests_allowed;
        a.item.demand = demand;
        if let Some((g, at)) = a.grant {
            let age = now_ms.saturating_sub(at);
            a.item.known_ms = age.max(1);
            a.item.known_remaining = g.remaining;
            a.item.known_debt = g.debt;
            a.item.share = g.rate;
            a.item.share_ms = g.ttl_ms.saturating_sub(age);
        }
    }

    /// The stream ended: its reservations end now.
    async fn let_go(&mut self) {
        let items: Vec<LeaseItem> = self
            .buckets
            .drain()
            .map(|(_, a)| LeaseItem {
                wanted: 0,
                used: 0,
                demand: 0.0,
                ..a.item
            })
            .collect();
        if items.is_empty() {
            return;
        }
        let ttl = self.service.lease_ttl_ms;
        if let Err(e) = self.service.store.lease(&self.instance, &items, ttl).await {
            tracing::debug!(error = %e, "RLQS: could not let go of a stream's reservations");
        }
    }
}
