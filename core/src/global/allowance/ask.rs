//! What a key's refill asks the quota service for, and what it was granted.

use crate::global::lease::{mtps, LeaseGrant, LeaseItem};

/// What a refill asks the service for, from the key's state when the call goes out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ask {
    /// Tokens outright: the lease size less what is still held.
    pub wanted: u64,
    /// Tokens spent since the last grant.
    pub used: u64,
    /// The refill rate wanted (milli-tokens per second): the spending rate since the last grant
    /// with a quarter more, the whole global rate if the lease ran dry, 0 with nothing measured.
    pub demand_mtps: u64,
    /// Evidence of the bucket: this proxy had an answer for it at most `known_ms` ago, saying
    /// the bucket held `known_remaining` tokens (or owed `known_debt`); 0: none (never answered,
    /// or the bucket is as good as full again by what that answer said).
    pub known_ms: u64,
    pub known_remaining: u64,
    pub known_debt: u64,
    /// Tokens a settlement spent beyond what the allowance held: the service charges them to the
    /// global bucket (below zero if need be), and they are no longer owed here.
    pub owed: u64,
    /// Tokens held unspent (accrual included): what the service takes back while the global
    /// bucket is in debt.
    pub held: u64,
    /// Tokens given back: what a rate lease accrued beyond its lease size and did not spend
    /// (its demand fell, or a burst made it ask for more than it needed).
    pub returned: u64,
    /// The rate share (milli-tokens per second) this proxy's live lease runs at, and the ms it
    /// has left: a service that lost the bucket gives it back rather than hold it for proxies it
    /// does not know.
    pub share_mtps: u64,
    pub share_ms: u64,
}

impl Ask {
    /// The lease call's item that carries this ask for `key` of the limit `limit_id` of `rule`:
    /// `requests` per `per_ms`, `burst`.
    pub fn item(
        &self,
        rule: String,
        limit_id: String,
        key: String,
        (requests, per_ms, burst): (u64, u64, u64),
    ) -> LeaseItem {
        LeaseItem {
            rule,
            limit_id,
            key,
            requests,
            per_ms,
            burst,
            wanted: self.wanted,
            used: self.used,
            demand: self.demand_mtps as f64 / 1_000.0,
            known_ms: self.known_ms,
            known_remaining: self.known_remaining,
            known_debt: self.known_debt,
            owed: self.owed,
            held: self.held,
            share: self.share_mtps as f64 / 1_000.0,
            share_ms: self.share_ms,
            returned: self.returned,
            ..LeaseItem::default()
        }
    }
}

/// The service's answer for one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Grant {
    pub tokens: u64,
    pub rate_mtps: u64,
    pub ttl_ms: u64,
    /// When the call went out: the old lease accrued until then (the service replaces its
    /// reservation when the call arrives), and the new one ends `ttl_ms` after it (never after
    /// the service's own reservation does).
    pub sent_ms: u64,
    /// Granted nothing: ask again after this long.
    pub retry_ms: u64,
    /// The global bucket's remaining tokens, and what it owes (a debt: it is below zero).
    pub remaining: u64,
    pub debt: u64,
    /// Tokens of those the call said it held that the service took back (the bucket was in
    /// debt), and of those it gave back that the service took: no longer this proxy's.
    pub revoked: u64,
    pub returned: u64,
    pub asked: Ask,
}

impl Grant {
    /// The service's `answer` to a call sent at `sent_ms` with `asked`, for a limit of
    /// `requests` per `per_ms`. Nothing granted and no hint: ask again once a token may have come
    /// back.
    pub fn answered(
        answer: &LeaseGrant,
        asked: Ask,
        sent_ms: u64,
        (requests, per_ms): (u64, u64),
    ) -> Self {
        let retry_ms = if answer.retry_ms > 0 {
            answer.retry_ms
        } else {
            (per_ms / requests.max(1)).clamp(1, answer.reset_ms.max(1))
        };
        Self {
            tokens: answer.granted,
            rate_mtps: mtps(answer.rate),
            ttl_ms: answer.ttl_ms,
            sent_ms,
            retry_ms,
            remaining: answer.remaining,
            debt: answer.debt,
            revoked: answer.revoked,
            returned: answer.returned,
            asked,
        }
    }
}
