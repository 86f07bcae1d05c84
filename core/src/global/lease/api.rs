//! The lease API's wire types (`POST /v1/lease`) and the checks every call passes before any
//! item is served.

use crate::calendar::{is_time_zone, CalendarUnit};
use serde::{Deserialize, Serialize};

/// At most this many items in one lease call.
pub const MAX_ITEMS: usize = 1_000;
/// Longest accepted `rule`, `limit_id`, `key` and `instance` strings.
pub const MAX_NAME: usize = 128;
/// Longest accepted `time_zone` (IANA names are at most 32 bytes).
pub const MAX_TIME_ZONE: usize = 64;
/// Largest accepted `requests`, `burst` and `wanted`: limits beyond are not rate limits, and both
/// stores compute exactly within them.
pub const MAX_COUNT: u64 = 1_000_000_000;
/// Longest accepted `per_ms`: 366 days.
pub const MAX_PER_MS: u64 = 366 * 86_400_000;
/// Milli-tokens per second: the unit rate shares are divided in (whole numbers, so that the
/// memory and Redis stores round alike).
pub fn rate_mtps(requests: u64, per_ms: u64) -> u64 {
    u64::try_from(u128::from(requests) * 1_000_000 / u128::from(per_ms.max(1))).unwrap_or(u64::MAX)
}

/// Tokens of a bucket's burst kept for instances within their fair share (newcomers above all):
/// instances that want more, holding rate shares, take only what is above them.
pub fn newcomers_reserve(burst: u64) -> u64 {
    burst / 8
}

/// The most tokens a bucket owes: a larger charge (any `owed`, however large) owes this many.
/// At the fastest rate a limit can have (10⁹ per ms) that is still 1 s of refusal; at any rate a
/// person configures, years.
pub const MAX_DEBT: u64 = 1_000_000_000_000;

/// A reset bucket's tokens until its next refill caps them at its burst: above any burst a
/// limit can have (a burst is a `u64` of tokens, but one above this would never be reached).
pub const RESET_TOKENS: f64 = 1e15;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseRequest {
    /// Who asks: one id per proxy process (fair sharing is between instances).
    pub instance: String,
    pub items: Vec<LeaseItem>,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
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
    /// Tokens per second the instance would spend (its measured demand, with headroom): asks for
    /// a rate lease. 0 (or absent): tokens only.
    #[serde(default)]
    pub demand: f64,
    /// The instance's evidence of the bucket: it had an answer for it at most `known_ms` ago,
    /// which said the bucket had `known_remaining` tokens left. 0 (or absent): no evidence (it
    /// never had an answer, or by that answer the bucket is full again). A store that does not
    /// know a bucket some instance has evidence of lost it (see [`ColdStart::Auto`]).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub known_ms: u64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub known_remaining: u64,
    /// With the evidence: the bucket owed this many tokens by that answer (it was below zero).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub known_debt: u64,
    /// Tokens the instance spent beyond what it was granted (a settlement charged more than its
    /// lease held): the bucket is charged them now, below zero if need be (a debt every instance
    /// then sees), at most [`MAX_DEBT`] owed in all.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub owed: u64,
    /// Tokens the instance holds unspent (granted to it for this key): while the bucket is in
    /// debt, the service takes them back (at most what it owes, and what this instance was
    /// granted), so that they repay the debt instead of being spent.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub held: u64,
    /// The instance's evidence of its own reservation: its live lease runs at `share` tokens per
    /// second for `share_ms` more. A store that lost the bucket gives it back to the instance
    /// from the rate it holds for the holders of before it does not know.
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub share: f64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub share_ms: u64,
    /// Tokens the instance gives back: granted to it earlier for this key and never to be spent
    /// (a strict request refused after its call). They go back into the bucket, at most what the
    /// instance was granted and has not given back yet. 0 (or absent): none.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub returned: u64,
    /// A calendar quota: `requests` (= `burst`) per calendar `day`, `week` (from Monday) or
    /// `month` in `time_zone`, full again when the next one begins; none: a token bucket
    /// refilling at `requests / per_ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calendar: Option<String>,
    /// The calendar's time zone, an IANA name; `UTC` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_zone: Option<String>,
    /// A calendar item's period as the service serves it (its first ms and the next period's,
    /// since the Unix epoch): set by the service, never on the wire.
    #[serde(skip)]
    pub period: Option<(u64, u64)>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn is_zero_f64(n: &f64) -> bool {
    *n == 0.0
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LeaseResponse {
    /// One per request item, in the same order.
    pub items: Vec<LeaseGrant>,
    /// Items the service refused (their grants are all zero): the caller treats each as a failed
    /// call for that key alone.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<ItemError>,
}

/// Why the service refused one item of a call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ItemError {
    /// Its index in the call's `items`.
    pub item: usize,
    pub error: String,
}

/// Refuse the items whose `problems` are set: the answer for those (all zero) and the errors,
/// merged with `served`, the answers to the others in order. `None` if `served` is short.
pub fn merge_refused<A: Copy>(
    problems: &[Option<String>],
    served: &[A],
    refused: A,
) -> Option<(Vec<A>, Vec<ItemError>)> {
    let mut served = served.iter();
    let mut answers = Vec::with_capacity(problems.len());
    let mut errors = Vec::new();
    for (item, problem) in problems.iter().enumerate() {
        match problem {
            Some(p) => {
                answers.push(refused);
                errors.push(ItemError {
                    item,
                    error: format!("items[{item}]: {p}"),
                });
            }
            None => answers.push(*served.next()?),
        }
    }
    Some((answers, errors))
}

#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct LeaseGrant {
    /// Tokens now the instance's to spend (taken from the global bucket).
    pub granted: u64,
    /// How long the instance may keep unspent tokens.
    pub ttl_ms: u64,
    /// Tokens left in the global bucket after this grant.
    pub remaining: u64,
    /// Milliseconds until the global bucket is full again.
    pub reset_ms: u64,
    /// Tokens per second of the bucket's refill now reserved for the instance, for `ttl_ms`: it
    /// may admit at this rate beyond `granted`, without asking again (a rate lease).
    #[serde(default)]
    pub rate: f64,
    /// Granted nothing: milliseconds until asking again may get something (0: no hint, or the
    /// item asked for nothing).
    #[serde(default)]
    pub retry_ms: u64,
    /// Tokens of the item's `returned` the service took back: at most what the instance had out.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub returned: u64,
    /// Tokens the bucket owes (it is below zero: settlements charged more than it had); 0 when
    /// it is not in debt. Nothing is granted until it is repaid.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub debt: u64,
    /// Tokens of the item's `held` the service took back to repay the bucket's debt: no longer
    /// the instance's to spend.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub revoked: u64,
}

/// The body of every error answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
}

impl LeaseItem {
    /// `demand` in milli-tokens per second (a negative or non-finite demand asks for nothing).
    pub fn demand_mtps(&self) -> u64 {
        mtps(self.demand)
    }

    /// `share` in milli-tokens per second.
    pub fn share_mtps(&self) -> u64 {
        mtps(self.share)
    }

    /// The refill rate, tokens per ms: none for a calendar quota (it is full again when its next
    /// period begins).
    pub fn rate_per_ms(&self) -> f64 {
        if self.period.is_some() {
            0.0
        } else {
            self.requests as f64 / self.per_ms as f64
        }
    }

    /// The refill rate in milli-tokens per second (none for a calendar quota).
    pub fn rate_mtps(&self) -> u64 {
        if self.period.is_some() {
            0
        } else {
            rate_mtps(self.requests, self.per_ms)
        }
    }

    /// Tokens kept for instances within their fair share ([`newcomers_reserve`]): none for a
    /// calendar quota, which nothing refills within its period.
    pub fn reserve(&self) -> u64 {
        if self.period.is_some() {
            0
        } else {
            newcomers_reserve(self.burst)
        }
    }

    /// The item's calendar unit and time zone, if it is a calendar quota, or why it cannot be.
    pub fn calendar(&self) -> Result<Option<(CalendarUnit, &str)>, String> {
        let zone = self.time_zone.as_deref();
        // (Never echoed beyond a zone name's length: the error goes to the log and the answer.)
        if zone.is_some_and(|z| z.len() > MAX_TIME_ZONE) {
            return Err(format!("time_zone must be at most {MAX_TIME_ZONE} bytes"));
        }
        if self
            .calendar
            .as_ref()
            .is_some_and(|c| c.len() > MAX_TIME_ZONE)
        {
            return Err("calendar must be \"day\", \"week\" or \"month\"".into());
        }
        let Some(unit) = self.calendar.as_deref() else {
            return match zone {
                Some(_) => Err("time_zone needs calendar".into()),
                None => Ok(None),
            };
        };
        let unit = CalendarUnit::parse(unit).ok_or_else(|| {
            format!("calendar must be \"day\", \"week\" or \"month\", not {unit:?}")
        })?;
        let zone = zone.unwrap_or("UTC");
        if !is_time_zone(zone) {
            return Err(format!("time_zone {zone:?} is not an IANA time zone name"));
        }
        if self.burst != self.requests {
            return Err("a calendar item's burst is its requests".into());
        }
        Ok(Some((unit, zone)))
    }

    /// Why the service cannot serve this item, if it cannot.
    pub fn problem(&self) -> Option<String> {
        if let Some(p) = names_problem(&self.rule, &self.limit_id, &self.key) {
            return Some(p);
        }
        if let Err(p) = self.calendar() {
            return Some(p);
        }
        if self.requests == 0 || self.per_ms == 0 || self.burst == 0 {
            return Some("requests, per_ms and burst must be positive".into());
        }
        if [self.requests, self.burst, self.wanted, self.returned]
            .iter()
            .any(|&n| n > MAX_COUNT)
        {
            return Some(format!(
                "requests, burst, wanted and returned must be at most {MAX_COUNT}"
            ));
        }
        if self.per_ms > MAX_PER_MS {
            return Some(format!("per_ms must be at most {MAX_PER_MS} (366 days)"));
        }
        if ![self.demand, self.share]
            .iter()
            .all(|n| n.is_finite() && *n >= 0.0)
        {
            return Some("demand and share must be numbers >= 0".into());
        }
        if self.known_remaining > MAX_COUNT || self.known_ms > 2 * MAX_PER_MS {
            return Some(format!(
                "known_remaining must be at most {MAX_COUNT} and known_ms at most {}",
                2 * MAX_PER_MS
            ));
        }
        None
    }

    /// The most tokens the bucket can hold now by the item's evidence: what the instance was
    /// told was left (or owed), the reserve for newcomers (an instance with a share is told
    /// what is above it), one more for the fraction, and the whole refill since (reservations
    /// only make it less). None without evidence.
    pub fn evidence_bound(&self) -> Option<f64> {
        if self.known_ms == 0 {
            return None;
        }
        // A bucket in debt told everyone the debt; one with tokens told an instance with a share
        // what it held above the reserve.
        let known = if self.known_debt > 0 {
            -(self.known_debt.min(MAX_DEBT) as f64)
        } else {
            (self.known_remaining + self.reserve()) as f64
        };
        // (A calendar quota's tokens are whole: nothing flows in but at a new period.)
        if self.period.is_some() {
            return Some(known);
        }
        Some(known + 1.0 + self.rate_per_ms() * self.known_ms as f64)
    }
}

impl LeaseRequest {
    /// What is wrong with the call as a whole (its instance, its size), if anything.
    pub fn problem(&self) -> Option<String> {
        call_problem(&self.instance, self.items.len())
    }

    /// What is wrong with each item (`None`: nothing): the service refuses those alone.
    pub fn item_problems(&self) -> Vec<Option<String>> {
        self.items.iter().map(LeaseItem::problem).collect()
    }
}

/// Tokens per second in milli-tokens per second (anything negative or not finite is none).
pub fn mtps(per_s: f64) -> u64 {
    if per_s.is_finite() && per_s > 0.0 {
        (per_s * 1_000.0) as u64
    } else {
        0
    }
}

/// What is wrong with an item's names, if anything.
pub(crate) fn names_problem(rule: &str, limit_id: &str, key: &str) -> Option<String> {
    let long = [rule, limit_id, key]
        .into_iter()
        .any(|s| s.is_empty() || s.len() > MAX_NAME);
    long.then(|| format!("rule, limit_id and key must be 1 to {MAX_NAME} bytes"))
}

/// What is wrong with a call of `instance` for `items` items as a whole, if anything.
pub(crate) fn call_problem(instance: &str, items: usize) -> Option<String> {
    if instance.is_empty() || instance.len() > MAX_NAME {
        return Some(format!("instance must be 1 to {MAX_NAME} bytes"));
    }
    if items > MAX_ITEMS {
        return Some(format!("at most {MAX_ITEMS} items per call"));
    }
    None
}
