//! The permit API (`POST /v1/slots`), shared by the filter and the service, and what an
//! instance asks of one key.

use crate::global::lease::{call_problem, names_problem, MAX_COUNT};
use serde::{Deserialize, Serialize};

/// `POST /v1/slots`: one instance's holdings of some keys, renewed, grown or given back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PermitRequest {
    pub instance: String,
    pub items: Vec<PermitItem>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PermitItem {
    /// The rule's name (metrics and logs).
    pub rule: String,
    /// A fingerprint of the rule's limit: configurations that differ never share state.
    pub limit_id: String,
    /// The client key's hash (hex).
    pub key: String,
    /// The limit: requests in flight across all instances.
    pub concurrent: u64,
    /// Permits the instance wants to hold.
    pub wanted: u64,
    /// Permits it holds and keeps using until the answer comes.
    #[serde(default)]
    pub keep: u64,
    /// The instance's evidence: the permits the service last said it holds, while that lease
    /// lasts (0: none). A store that has no holding of the instance for the key lost it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub known_held: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PermitResponse {
    /// One per request item, in the same order.
    pub items: Vec<PermitAnswer>,
    /// Items the service refused (their answers are all zero): the caller treats each as a
    /// failed call for that key alone.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<crate::global::lease::ItemError>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PermitAnswer {
    /// Permits the instance holds now, for `ttl_ms` from its call.
    pub held: u64,
    /// Its max-min fair share of the limit: above it, let permits go as requests end.
    pub share: u64,
    /// Permits no instance holds.
    pub free: u64,
    pub ttl_ms: u64,
}

impl PermitItem {
    pub fn problem(&self) -> Option<String> {
        if let Some(p) = names_problem(&self.rule, &self.limit_id, &self.key) {
            return Some(p);
        }
        if self.concurrent == 0 || self.concurrent > MAX_COUNT {
            return Some(format!("concurrent must be 1 to {MAX_COUNT}"));
        }
        if self.wanted > MAX_COUNT || self.keep > MAX_COUNT || self.known_held > MAX_COUNT {
            return Some(format!(
                "wanted, keep and known_held must be at most {MAX_COUNT}"
            ));
        }
        None
    }

    pub fn ask(&self) -> PermitAsk {
        PermitAsk {
            limit: self.concurrent,
            wanted: self.wanted,
            keep: self.keep,
            known_held: self.known_held,
        }
    }
}

impl PermitRequest {
    /// What is wrong with the call as a whole (its instance, its size), if anything.
    pub fn problem(&self) -> Option<String> {
        call_problem(&self.instance, self.items.len())
    }

    /// What is wrong with each item (`None`: nothing): the service refuses those alone.
    pub fn item_problems(&self) -> Vec<Option<String>> {
        self.items.iter().map(PermitItem::problem).collect()
    }
}

/// What an instance asks of one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PermitAsk {
    /// The limit: permits in flight across all instances.
    pub limit: u64,
    /// Permits the instance wants to hold (0 with `keep` 0: it gives the key back).
    pub wanted: u64,
    /// Permits it holds and keeps using until the answer comes.
    pub keep: u64,
    /// Permits the service last said it holds, while that lease lasts (0: none).
    pub known_held: u64,
}
