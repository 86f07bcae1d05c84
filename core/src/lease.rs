//! The quota service's lease API (`POST /v1/lease`), shared by the filter and the service, and the
//! global bucket step both of the service's stores implement.
//!
//! See `docs/quota-api.md`.

use crate::fair_share::max_min_fair;
use serde::{Deserialize, Serialize};

/// At most this many items in one lease call.
pub const MAX_ITEMS: usize = 1_000;
/// Longest accepted `rule`, `limit_id`, `key` and `instance` strings.
pub const MAX_NAME: usize = 128;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseRequest {
    /// Who asks: one id per proxy process (fair sharing is between instances).
    pub instance: String,
    pub items: Vec<LeaseItem>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseItem {
    /// The rule's name (metrics and logs).
    pub rule: String,
    /// A fingerprint of the rule's limit: configurations that differ never share state.
    pub limit_id: String,
    /// The client key's hash (hex): the service never sees client values.
    pub key: String,
    /// The global limit: `requests` per `per_ms`, bucket capacity `burst`.
    pub requests: u64,
    pub per_ms: u64,
    pub burst: u64,
    /// Tokens the instance asks for now.
    pub wanted: u64,
    /// Tokens the instance spent since its previous call for this key.
    pub used: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseResponse {
    /// One per request item, in the same order.
    pub items: Vec<LeaseGrant>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseGrant {
    /// Tokens now the instance's to spend (taken from the global bucket).
    pub granted: u64,
    /// How long the instance may keep unspent tokens.
    pub ttl_ms: u64,
    /// Tokens left in the global bucket after this grant.
    pub remaining: u64,
    /// Milliseconds until the global bucket is full again.
    pub reset_ms: u64,
}

/// The body of every error answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
}

impl LeaseItem {
    /// Why the service cannot serve this item, if it cannot.
    pub fn problem(&self) -> Option<String> {
        let long = [&self.rule, &self.limit_id, &self.key]
            .into_iter()
            .any(|s| s.is_empty() || s.len() > MAX_NAME);
        if long {
            return Some(format!(
                "rule, limit_id and key must be 1 to {MAX_NAME} bytes"
            ));
        }
        if self.requests == 0 || self.per_ms == 0 || self.burst == 0 {
            return Some("requests, per_ms and burst must be positive".into());
        }
        None
    }
}

impl LeaseRequest {
    pub fn problem(&self) -> Option<String> {
        if self.instance.is_empty() || self.instance.len() > MAX_NAME {
            return Some(format!("instance must be 1 to {MAX_NAME} bytes"));
        }
        if self.items.len() > MAX_ITEMS {
            return Some(format!("at most {MAX_ITEMS} items per call"));
        }
        self.items
            .iter()
            .enumerate()
            .find_map(|(i, item)| item.problem().map(|p| format!("items[{i}]: {p}")))
    }
}

/// One global bucket: tokens refill at `requests / per_ms` up to `burst`; recent demands of each
/// instance decide fair shares.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GlobalBucket {
    pub tokens: f64,
    pub updated_ms: u64,
    /// (instance, wanted, when), sorted by instance.
    pub demands: Vec<(String, u64, u64)>,
}

impl GlobalBucket {
    /// A bucket never seen before: full.
    pub fn new(burst: u64, now_ms: u64) -> Self {
        Self {
            tokens: burst as f64,
            updated_ms: now_ms,
            demands: Vec::new(),
        }
    }

    /// Serve one lease item for `instance` at `now_ms`; demands older than `ttl_ms` are forgotten.
    /// The grant never exceeds what the bucket holds, nor the instance's max-min fair share of
    /// the bucket's capacity among the instances that asked within `ttl_ms`.
    pub fn lease(
        &mut self,
        instance: &str,
        item: &LeaseItem,
        now_ms: u64,
        ttl_ms: u64,
    ) -> LeaseGrant {
        let rate = item.requests as f64 / item.per_ms as f64;
        let burst = item.burst as f64;
        let elapsed = now_ms.saturating_sub(self.updated_ms) as f64;
        self.tokens = (self.tokens + elapsed * rate).min(burst);
        self.updated_ms = self.updated_ms.max(now_ms);

        self.demands
            .retain(|(who, _, at)| who != instance && at + ttl_ms > now_ms);
        let at = self
            .demands
            .partition_point(|(who, _, _)| who.as_str() < instance);
        self.demands
            .insert(at, (instance.to_owned(), item.wanted, now_ms));
        let wants: Vec<u64> = self.demands.iter().map(|d| d.1).collect();
        let fair = max_min_fair(item.burst, &wants)[at];

        let available = self.tokens.floor().max(0.0) as u64;
        let granted = item.wanted.min(fair).min(available);
        self.tokens -= granted as f64;
        LeaseGrant {
            granted,
            ttl_ms,
            remaining: self.tokens.floor().max(0.0) as u64,
            reset_ms: ((burst - self.tokens) / rate).ceil().max(0.0) as u64,
        }
    }

    /// True once nothing distinguishes it from a new bucket (full, no live demand): it can go.
    pub fn is_idle(
        &self,
        burst: u64,
        requests: u64,
        per_ms: u64,
        now_ms: u64,
        ttl_ms: u64,
    ) -> bool {
        let rate = requests as f64 / per_ms as f64;
        let tokens = self.tokens + now_ms.saturating_sub(self.updated_ms) as f64 * rate;
        tokens >= burst as f64 && self.demands.iter().all(|d| d.2 + ttl_ms <= now_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(wanted: u64) -> LeaseItem {
        LeaseItem {
            rule: "r".into(),
            limit_id: "l".into(),
            key: "k".into(),
            requests: 120,
            per_ms: 60_000,
            burst: 120,
            wanted,
            used: 0,
        }
    }

    #[test]
    fn grants_are_fair_and_never_exceed_the_bucket() {
        let mut b = GlobalBucket::new(120, 0);
        // Three instances report demand; the small ones are served in full, the big one its share.
        assert_eq!(b.lease("c", &item(10), 0, 10_000).granted, 10);
        assert_eq!(b.lease("b", &item(50), 0, 10_000).granted, 50);
        let a = b.lease("a", &item(1000), 0, 10_000);
        assert_eq!(a.granted, 60);
        assert_eq!(a.remaining, 0);
        assert_eq!(a.reset_ms, 60_000);
        // Empty: nothing more until it refills (2 per second).
        assert_eq!(b.lease("a", &item(1000), 0, 10_000).granted, 0);
        assert_eq!(b.lease("a", &item(1000), 1_000, 10_000).granted, 2);
    }

    #[test]
    fn old_demands_are_forgotten() {
        let mut b = GlobalBucket::new(120, 0);
        b.lease("b", &item(1000), 0, 1_000);
        // b's demand has expired: a alone may take the whole capacity that is left.
        let g = b.lease("a", &item(1000), 60_000, 1_000);
        assert_eq!(g.granted, 120);
        assert!(!b.is_idle(120, 120, 60_000, 60_000, 1_000));
        assert!(b.is_idle(120, 120, 60_000, 120_000, 1_000));
    }

    proptest::proptest! {
        /// Whatever a broken or hostile service sends, parsing answers with an error, never a
        /// panic (the filter then applies its failure mode).
        #[test]
        fn any_answer_parses_or_fails_cleanly(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..300)) {
            let _ = serde_json::from_slice::<LeaseResponse>(&bytes);
        }

        #[test]
        fn json_shaped_answers_parse_or_fail_cleanly(
            granted in proptest::num::i128::ANY,
            extra in "[a-z_]{0,8}",
            items in 0usize..4,
        ) {
            let item = format!(r#"{{"granted":{granted},"ttl_ms":1,"remaining":0,"reset_ms":0{}}}"#,
                if extra.is_empty() { String::new() } else { format!(r#","{extra}":1"#) });
            let body = format!(r#"{{"items":[{}]}}"#, vec![item; items].join(","));
            let parsed = serde_json::from_slice::<LeaseResponse>(body.as_bytes());
            if let Ok(r) = parsed {
                proptest::prop_assert_eq!(r.items.len(), items);
            }
        }
    }

    #[test]
    fn wire_format() {
        let req: LeaseRequest = serde_json::from_str(
            r#"{"instance":"i","items":[{"rule":"r","limit_id":"l","key":"k","requests":1,
                "per_ms":1000,"burst":1,"wanted":5,"used":0}]}"#,
        )
        .unwrap();
        assert_eq!(req.problem(), None);
        let mut bad = req.clone();
        bad.items[0].burst = 0;
        assert_eq!(
            bad.problem().as_deref(),
            Some("items[0]: requests, per_ms and burst must be positive")
        );
        assert!(serde_json::from_str::<LeaseResponse>(r#"{"items":[{"granted":1}]}"#).is_err());
    }
}
