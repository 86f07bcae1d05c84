//! Envoy's rate limit service (RLS, `envoy.service.ratelimit.v3.RateLimitService`) over the
//! service's own buckets: a descriptor's limit, found as envoyproxy/ratelimit finds it, is a token
//! bucket of the store, taken from by the call's hits.

pub mod config;
pub mod wire;

use crate::metrics::{Outcome, RlsDescriptor};
use crate::service::{bound_limit_id, Service};
use config::{Found, Limit, Rate, RlsConfig};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::Duration;
use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::Arc;
use tollgate_core::global::lease::{LeaseGrant, LeaseItem};
use tollgate_core::key_name::{push_key_part, service_key, KeyBytes};
use tonic::{Request, Response, Status};

/// Most descriptors one call may carry.
pub const MAX_DESCRIPTORS: usize = 64;
/// Most hits one descriptor may add (a lease item's `wanted` at most).
pub const MAX_HITS: u64 = 1_000_000_000;
/// The instance RLS calls take tokens as (under a proxy token's name: `<name>/rls`).
pub const INSTANCE: &str = "rls";

/// The RLS server: the service's store, credentials and metrics, and the descriptors' limits.
pub struct Rls {
    pub service: Arc<Service>,
    pub config: Arc<RlsConfig>,
    /// Keys the names of shared buckets' keys, as the filters' `quota_service.key_secret`.
    pub key_secret: Option<[u8; 16]>,
}

/// What one descriptor of a call asks.
enum Check<'a> {
    /// No limit applies (none configured, or replaced by another of the call's limits).
    None,
    Unlimited(Cow<'a, Limit>),
    Counted {
        limit: Cow<'a, Limit>,
        rate: Rate,
        /// Its item in the store call (none for a limit of 0: every hit is over it).
        item: Option<usize>,
        hits: u64,
        /// The hits are given back (`is_negative_hits`).
        negative: bool,
    },
}

impl Rls {
    /// The caller a call's `authorization` metadata proves, bound to its RLS instance.
    fn instance(&self, request: &Request<RateLimitRequest>) -> Result<String, Status> {
        crate::credentials::bind_grpc_instance(
            &self.service.credentials,
            request.metadata(),
            INSTANCE,
        )
    }

    /// The call's checks and the store items they take from, or why the call is invalid.
    fn checks<'a>(
        &'a self,
        request: &'a RateLimitRequest,
    ) -> Result<(Vec<Check<'a>>, Vec<LeaseItem>), Status> {
        if request.domain.is_empty() {
            return Err(Status::invalid_argument(
                "rate limit domain must not be empty",
            ));
        }
        if request.descriptors.is_empty() {
            return Err(Status::invalid_argument(
                "rate limit descriptor list must not be empty",
            ));
        }
        if request.descriptors.len() > MAX_DESCRIPTORS {
            return Err(Status::invalid_argument(format!(
                "at most {MAX_DESCRIPTORS} descriptors in one call"
            )));
        }
        let mut found = Vec::with_capacity(request.descriptors.len());
        for d in &request.descriptors {
            if d.entries.len() > config::MAX_DEPTH {
                return Err(Status::invalid_argument(format!(
                    "a descriptor has at most {} entries",
                    config::MAX_DEPTH
                )));
            }
            found.push(self.find(&request.domain, d));
        }
        // A limit another of the call's limits `replaces` does not apply.
        let replaced: HashSet<&str> = found
            .iter()
            .flatten()
            .flat_map(|(f, _)| f.limit.replaces.iter().map(String::as_str))
            .collect();
        let mut checks = Vec::with_capacity(found.len());
        let mut items = Vec::new();
        for (d, f) in request.descriptors.iter().zip(found) {
            let Some((f, limit)) = f else {
                checks.push(Check::None);
                continue;
            };
            if !limit.name.is_empty() && replaced.contains(limit.name.as_str()) {
                checks.push(Check::None);
                continue;
            }
            let Some(rate) = limit.rate else {
                checks.push(Check::Unlimited(limit));
                continue;
            };
            let hits = hits(request, d);
            let item = (rate.requests_per_unit > 0).then(|| {
                items.push(self.item(&limit, rate, &f, d, hits));
                items.len() - 1
            });
            checks.push(Check::Counted {
                limit,
                rate,
                item,
                hits,
                negative: d.is_negative_hits,
            });
        }
        Ok((checks, items))
    }

    /// A descriptor's limit: its own (`limit` in the call, for a known domain) or the
    /// configuration's.
    fn find<'a>(
        &'a self,
        domain: &'a str,
        d: &'a RateLimitDescriptor,
    ) -> Option<(Found<'a>, Cow<'a, Limit>)> {
        let entries: Vec<(&str, &str)> = d
            .entries
            .iter()
            .map(|e| (e.key.as_str(), e.value.as_str()))
            .collect();
        if let Some(own) = &d.limit {
            // As envoyproxy/ratelimit: a call's own limit applies in a configured domain only.
            if !self.config.has_domain(domain) {
                return None;
            }
            // (An override without a unit this service knows is not one: the configuration's
            // limit applies, never none. A limit of 0 refuses every request, as configured ones.)
            if let Some(unit) = config::unit_of(own.unit) {
                let requests_per_unit = own.requests_per_unit.min(1_000_000_000);
                return Some(self.own_limit(domain, &entries, requests_per_unit, unit));
            }
        }
        let found = self.config.find(domain, &entries)?;
        let limit = Cow::Borrowed(found.limit);
        Some((found, limit))
    }

    /// A call's own limit (`RateLimitOverride`) for a descriptor's `entries`.
    fn own_limit<'a>(
        &self,
        domain: &str,
        entries: &[(&str, &str)],
        requests_per_unit: u32,
        unit: config::Unit,
    ) -> (Found<'a>, Cow<'a, Limit>) {
        {
            let full_key = descriptor_key(domain, entries);
            let limit = Limit {
                full_key,
                rate: Some(Rate {
                    requests_per_unit,
                    unit,
                }),
                shadow_mode: false,
                detailed_metric: false,
                name: String::new(),
                replaces: Vec::new(),
                tollgate: None,
            };
            let found = Found {
                limit: &NO_LIMIT,
                key_values: Vec::new(),
            };
            (found, Cow::Owned(limit))
        }
    }

    /// The store item of a counted descriptor: a bucket of its own per descriptor (every
    /// entry's key and value), or the tollgate rule's it shares, for the key the filter makes of
    /// the values its wildcard entries matched.
    fn item(
        &self,
        limit: &Limit,
        rate: Rate,
        found: &Found,
        d: &RateLimitDescriptor,
        hits: u64,
    ) -> LeaseItem {
        let entries: Vec<(&str, &str)> = d
            .entries
            .iter()
            .map(|e| (e.key.as_str(), e.value.as_str()))
            .collect();
        let bucket = bucket_of(limit, rate, &found.key_values, &entries, self.key_secret);
        let burst = bucket.burst;
        let negative = d.is_negative_hits;
        // More hits than the bucket holds can never be admitted: look only.
        let wanted = if negative || hits > burst { 0 } else { hits };
        LeaseItem {
            wanted,
            used: wanted,
            returned: if negative { hits } else { 0 },
            ..bucket
        }
    }
}

/// The store item (all but what it asks) of a limit's bucket for a descriptor's `entries`: a
/// bucket of its own per descriptor (every entry's key and value), or the tollgate rule's it
/// shares, keyed as the filters key it by the values its wildcard entries matched (`key_values`).
/// RLS descriptors and RLQS bucket ids name their buckets alike through it.
pub(crate) fn bucket_of(
    limit: &Limit,
    rate: Rate,
    key_values: &[&str],
    entries: &[(&str, &str)],
    key_secret: Option<[u8; 16]>,
) -> LeaseItem {
    let mut key = KeyBytes::new();
    let requests = u64::from(rate.requests_per_unit);
    let (limit_id, burst, name) = match &limit.tollgate {
        Some((limit_id, burst)) => {
            for v in key_values {
                push_key_part(&mut key, Some(v.as_bytes()));
            }
            let hash = tollgate_core::slot::key_hash(&key);
            (limit_id.clone(), *burst, service_key(key_secret, hash))
        }
        None => {
            for (k, v) in entries {
                push_key_part(&mut key, Some(k.as_bytes()));
                push_key_part(&mut key, Some(v.as_bytes()));
            }
            let id = tollgate_core::slot::fingerprint(format!("rls/{}", limit.full_key).as_bytes());
            (
                format!("{id:016x}"),
                requests,
                tollgate_core::slot::key_hash(&key),
            )
        }
    };
    LeaseItem {
        rule: rule_name(&limit.full_key),
        limit_id: bound_limit_id(&limit_id, &[requests, rate.unit.ms, burst]),
        key: format!("{name:032x}"),
        requests,
        per_ms: rate.unit.ms,
        burst,
        ..LeaseItem::default()
    }
}

static NO_LIMIT: Limit = Limit {
    full_key: String::new(),
    rate: None,
    shadow_mode: false,
    detailed_metric: false,
    name: String::new(),
    replaces: Vec::new(),
    tollgate: None,
};

/// A descriptor's hits: its own `hits_addend`, else the call's (0 read as 1), at most
/// [`MAX_HITS`].
fn hits(request: &RateLimitRequest, d: &RateLimitDescriptor) -> u64 {
    d.hits_addend
        .as_ref()
        .map_or(u64::from(request.hits_addend.max(1)), |h| h.value)
        .min(MAX_HITS)
}

/// `domain.key_value.key…` of a call's own limit, as envoyproxy/ratelimit names it.
fn descriptor_key(domain: &str, entries: &[(&str, &str)]) -> String {
    let parts: Vec<String> = entries
        .iter()
        .map(|(k, v)| {
            if v.is_empty() {
                (*k).to_owned()
            } else {
                format!("{k}_{v}")
            }
        })
        .collect();
    format!("{domain}.{}", parts.join("."))
}

/// A limit's place as a lease item's `rule` (1 to 128 bytes).
fn rule_name(full_key: &str) -> String {
    let mut end = full_key.len().min(128);
    while !full_key.is_char_boundary(end) {
        end -= 1;
    }
    full_key[..end].to_owned()
}

/// Milliseconds as a protobuf duration.
fn duration(ms: u64) -> Duration {
    Duration {
        seconds: i64::try_from(ms / 1_000).unwrap_or(i64::MAX),
        nanos: ((ms % 1_000) * 1_000_000) as i32,
    }
}

fn current_limit(limit: &Limit, rate: Rate) -> RateLimit {
    RateLimit {
        name: limit.name.clone(),
        requests_per_unit: rate.requests_per_unit,
        unit: rate.unit.proto,
    }
}

/// A counted descriptor's status from its grant: admitted if it got all its hits.
fn status(
    limit: &Limit,
    rate: Rate,
    hits: u64,
    negative: bool,
    g: &LeaseGrant,
) -> (DescriptorStatus, bool) {
    // (Hits given back are never over.)
    let over = !negative && hits > 0 && g.granted < hits;
    let left = g.remaining + if over { g.granted } else { 0 };
    let wait_ms = if over {
        // When this call's hits fit: as many tokens more as it lacks, at the refill rate (or
        // later, when others hold the refill); a call larger than the bucket never fits: when
        // it is full again.
        let burst = limit
            .tollgate
            .as_ref()
            .map_or(u64::from(rate.requests_per_unit), |(_, b)| *b);
        if hits > burst {
            g.reset_ms
        } else {
            let per_ms = rate.unit.ms as f64 / f64::from(rate.requests_per_unit.max(1));
            let lacking = hits.saturating_sub(left) as f64;
            ((lacking * per_ms).ceil() as u64).max(g.retry_ms)
        }
    } else {
        g.reset_ms
    };
    let status = DescriptorStatus {
        code: if over && !limit.shadow_mode {
            Code::OverLimit
        } else {
            Code::Ok
        } as i32,
        current_limit: Some(current_limit(limit, rate)),
        // A part of the hits granted goes back: it is left.
        limit_remaining: u32::try_from(left).unwrap_or(u32::MAX),
        duration_until_reset: Some(duration(wait_ms)),
        quota: None,
    };
    (status, over)
}

#[tonic::async_trait]
impl RateLimitService for Rls {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let metrics = &self.service.metrics;
        let outcome = |o: &'static str| {
            metrics
                .rls_calls
                .get_or_create(&Outcome { outcome: o })
                .inc();
        };
        let instance = self.instance(&request).inspect_err(|s| {
            outcome(if s.code() == tonic::Code::Unauthenticated {
                "unauthorized"
            } else {
                "forbidden"
            })
        })?;
        let request = request.into_inner();
        let (checks, items) = self
            .checks(&request)
            .inspect_err(|_| outcome("bad_request"))?;
        let ttl = self.service.lease_ttl_ms;
        let answers = if items.is_empty() {
            Vec::new()
        } else {
            let answers = self
                .service
                .store
                .lease(&instance, &items, ttl)
                .await
                .map_err(|e| {
                    outcome("storage_error");
                    metrics.storage_errors.inc();
                    Status::unavailable(e.to_string())
                })?;
            if let Some((_, why)) = answers.refused.first() {
                outcome("storage_error");
                return Err(Status::unavailable(why.clone()));
            }
            answers.items
        };
        let mut statuses = Vec::with_capacity(checks.len());
        let mut give_back = Vec::new();
        let mut over_limit = false;
        for check in &checks {
            let (status, label) = match check {
                Check::None => (
                    DescriptorStatus {
                        code: Code::Ok as i32,
                        ..DescriptorStatus::default()
                    },
                    None,
                ),
                Check::Unlimited(limit) => (
                    DescriptorStatus {
                        code: Code::Ok as i32,
                        limit_remaining: u32::MAX,
                        ..DescriptorStatus::default()
                    },
                    Some((limit, "unlimited")),
                ),
                Check::Counted {
                    limit,
                    rate,
                    item,
                    hits,
                    negative,
                } => {
                    let grant = match item {
                        Some(i) => answers.get(*i).copied().unwrap_or_default(),
                        None => LeaseGrant {
                            reset_ms: rate.unit.ms,
                            retry_ms: rate.unit.ms,
                            ..LeaseGrant::default()
                        },
                    };
                    let (status, over) = status(limit, *rate, *hits, *negative, &grant);
                    if let (true, Some(i)) = (over && grant.granted > 0, item) {
                        // Part of the hits: not spent, back into the bucket.
                        give_back.push(LeaseItem {
                            wanted: 0,
                            used: 0,
                            returned: grant.granted,
                            ..items[*i].clone()
                        });
                    }
                    over_limit |= status.code == Code::OverLimit as i32;
                    let code = match (over, limit.shadow_mode) {
                        (false, _) => "ok",
                        (true, false) => "over_limit",
                        (true, true) => "shadow_over_limit",
                    };
                    (status, Some((limit, code)))
                }
            };
            self.count(&request, label, statuses.len());
            statuses.push(status);
        }
        if !give_back.is_empty() {
            if let Err(e) = self.service.store.lease(&instance, &give_back, ttl).await {
                tracing::warn!(error = %e, "RLS: could not give back a part of the hits");
            }
        }
        outcome("ok");
        Ok(Response::new(RateLimitResponse {
            overall_code: if over_limit {
                Code::OverLimit
            } else {
                Code::Ok
            } as i32,
            statuses,
            ..RateLimitResponse::default()
        }))
    }
}

impl Rls {
    /// Count a descriptor's answer by domain, descriptor and code (a `detailed_metric` limit by
    /// the value too).
    fn count(
        &self,
        request: &RateLimitRequest,
        label: Option<(&Cow<'_, Limit>, &'static str)>,
        index: usize,
    ) {
        let known = self.config.has_domain(&request.domain);
        let (descriptor, code) = match label {
            None => (String::new(), "no_limit"),
            Some((limit, code)) => {
                let mut key = limit.full_key.clone();
                if limit.detailed_metric {
                    if let Some(e) = request.descriptors[index].entries.last() {
                        // (The value comes from a client: at most 128 bytes of it in a label.)
                        let mut end = e.value.len().min(128);
                        while !e.value.is_char_boundary(end) {
                            end -= 1;
                        }
                        key.push('_');
                        key.push_str(&e.value[..end]);
                    }
                }
                (key, code)
            }
        };
        self.service.metrics.count_rls(RlsDescriptor {
            domain: if known {
                request.domain.clone()
            } else {
                "_unknown".into()
            },
            descriptor,
            code,
        });
    }
}
