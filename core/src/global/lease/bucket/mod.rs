//! The global bucket of one key and its lease step: fair shares of the burst and of the refill
//! rate among the instances that hold it, reservations, give-backs, cold starts and clock steps.

mod evidence;
mod timing;

use super::api::{LeaseGrant, LeaseItem, MAX_DEBT, RESET_TOKENS};
use crate::global::fair_share::max_min_fair_from;

/// Rate shares are reserved only if they accrue at least two tokens within a lease TTL (in
/// milli-tokens per second × ms).
pub const MIN_RESERVED_MTPS_MS: u128 = 2 * 1_000_000;

/// The most a call and its answer take between the service and a proxy, on top of the age of
/// the proxy's evidence (`known_ms` counts from the answer's arrival; the service's record of the
/// call from before it was answered).
pub const EVIDENCE_TRANSIT_MS: u64 = 250;

/// A capped holder's renewal reaches the service this long after it is due (its next request,
/// then its worker's tick and the call).
const RENEWAL_MARGIN_MS: f64 = 20.0;

/// An instance's standing at one bucket: what it last asked for, and the refill rate reserved for
/// it. Sorted by instance; the empty name stands for the proxies of before a cold start.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Holder {
    pub instance: String,
    /// Tokens it asked for with its last call (its demand on the burst).
    pub wanted: u64,
    /// The refill rate it asked for with its last call (milli-tokens per second).
    pub demand: u64,
    pub asked_ms: u64,
    /// The refill rate reserved for it (milli-tokens per second), from its last call until
    /// `until_ms`: the bucket does not refill by that much meanwhile.
    pub share: u64,
    pub until_ms: u64,
    /// Tokens granted to it and not given back since it became a holder: the most it may give
    /// back (so giving back never fills the bucket beyond what the instance took from it).
    pub outstanding: u64,
}

/// One global bucket: tokens refill at `requests / per_ms` up to `burst`, less the refill rate
/// reserved for instances (rate leases); recent demands of each instance decide fair shares.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GlobalBucket {
    /// Tokens anyone may be granted; below zero, what the bucket owes.
    pub tokens: f64,
    /// Tokens kept for instances within their fair share (newcomers above all), at most
    /// [`newcomers_reserve`] of the burst: refilled before `tokens`, never from the burst a new
    /// bucket starts with (a lone instance gets all of that at once).
    pub reserve: f64,
    pub updated_ms: u64,
    pub holders: Vec<Holder>,
    /// From then on it is as good as new (full, no live demand, nothing reserved): it can go.
    pub idle_at_ms: u64,
}

/// How a store starts buckets it does not know: new ones, or ones it forgot (a restart, a Redis
/// that lost its data).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ColdStart {
    /// Full, unless the store is known to have lost buckets: the call carries an instance's
    /// evidence of the bucket, or an earlier call showed that this store (or this Redis slot)
    /// forgot buckets instances were using. Then as `Conservative`. A new deployment serves its
    /// limits at once; a restart that lost state holds them.
    Auto { epoch_ms: u64 },
    /// As if, at the store's start (`epoch_ms`), every bucket had just been emptied and its whole
    /// refill rate leased for one lease TTL: a restart admits nothing that the limit would not
    /// have admitted had the store never stopped. So does a new deployment, for a while.
    Conservative { epoch_ms: u64 },
    /// New buckets start full: a restart can admit up to a burst (and a lease TTL of refill)
    /// more per key.
    Full,
}

impl ColdStart {
    /// How a bucket the store does not know starts: `lost` if the store is known to have lost
    /// buckets (by this call's evidence or an earlier one's).
    pub fn for_new(self, lost: bool) -> Self {
        match self {
            Self::Auto { epoch_ms } if lost => Self::Conservative { epoch_ms },
            Self::Auto { .. } => Self::Full,
            other => other,
        }
    }

    /// Whether buckets the store knows are checked against instances' evidence (not when
    /// buckets start full by choice).
    pub fn checks_evidence(self) -> bool {
        self != Self::Full
    }

    /// When the store's memory begins (`None`: never conservative).
    pub fn epoch_ms(self) -> Option<u64> {
        match self {
            Self::Auto { epoch_ms } | Self::Conservative { epoch_ms } => Some(epoch_ms),
            Self::Full => None,
        }
    }
}

impl GlobalBucket {
    /// A bucket the store does not know, first asked for at `now_ms` (`cold` as resolved by
    /// [`ColdStart::for_new`]; `Auto` starts full).
    /// A calendar quota's bucket starts full whatever `cold` says: nothing would refill one
    /// started empty before its period ends. A store that lost it learns what was spent from
    /// the proxies' evidence ([`GlobalBucket::reconcile`]).
    pub fn new(item: &LeaseItem, now_ms: u64, ttl_ms: u64, cold: ColdStart) -> Self {
        let cold = if item.period.is_some() {
            ColdStart::Full
        } else {
            cold
        };
        match cold {
            ColdStart::Full | ColdStart::Auto { .. } => Self {
                tokens: item.burst as f64,
                reserve: 0.0,
                updated_ms: now_ms,
                holders: Vec::new(),
                idle_at_ms: now_ms,
            },
            // Empty at the epoch but for the reserve (proxies within their fair share bridge
            // with it until the renewing holders' shares are cut to theirs), with the whole rate
            // held by the proxies of before; the first lease refills it from there (long after
            // the epoch: full, as if never lost).
            ColdStart::Conservative { epoch_ms } => Self {
                tokens: 0.0,
                reserve: item.reserve() as f64,
                updated_ms: epoch_ms.min(now_ms),
                holders: vec![Holder {
                    instance: String::new(),
                    // Rounded up: all of the refill, never a fraction less.
                    share: item.rate_mtps().saturating_add(1),
                    asked_ms: epoch_ms,
                    until_ms: epoch_ms.saturating_add(ttl_ms),
                    ..Holder::default()
                }],
                idle_at_ms: 0,
            },
        }
    }

    /// Add what flowed in since the last update: the refill rate less what was reserved.
    fn refill(&mut self, item: &LeaseItem, now_ms: u64) {
        // Updated after now: the clock stepped back. The step counts as no time (else nothing
        // would flow in until the clock caught up).
        self.updated_ms = self.updated_ms.min(now_ms);
        let rate = item.rate_per_ms();
        let elapsed = now_ms.saturating_sub(self.updated_ms) as f64;
        let reserved: f64 = self
            .holders
            .iter()
            .map(|h| {
                let overlap = h.until_ms.min(now_ms).saturating_sub(self.updated_ms);
                (h.share as f64 / 1e6).min(rate) * overlap as f64
            })
            .sum();
        let inflow = (elapsed * rate - reserved).max(0.0);
        self.add(item, inflow);
        self.updated_ms = self.updated_ms.max(now_ms);
    }

    /// Put `n` tokens in: what the bucket owes first, then its reserve (to its size), then the
    /// rest (to `burst` in all).
    fn add(&mut self, item: &LeaseItem, mut n: f64) {
        if self.tokens < 0.0 {
            let repaid = n.min(-self.tokens);
            self.tokens += repaid;
            n -= repaid;
        }
        let room = (item.reserve() as f64 - self.reserve).max(0.0);
        let kept = n.min(room);
        self.reserve += kept;
        self.tokens = (self.tokens + n - kept).min(item.burst as f64 - self.reserve);
    }

    /// Take `n` tokens out (a debt charged): from the tokens first, the reserve once they are
    /// spent, below zero after that (at most [`MAX_DEBT`] owed).
    fn charge(&mut self, n: f64) {
        self.tokens -= n;
        if self.tokens < 0.0 {
            let from_reserve = self.reserve.min(-self.tokens);
            self.reserve -= from_reserve;
            self.tokens += from_reserve;
        }
        self.tokens = self.tokens.max(-(MAX_DEBT as f64));
    }

    /// The tokens the bucket holds at `now_ms` (below zero: in debt), without changing it.
    pub fn tokens_at(&self, item: &LeaseItem, now_ms: u64) -> f64 {
        let mut b = self.clone();
        b.refill(item, now_ms);
        b.tokens + b.reserve
    }

    /// Forget holders that neither asked within `ttl_ms` nor hold a reservation.
    fn forget(&mut self, now_ms: u64, ttl_ms: u64) {
        self.holders
            .retain(|h| h.asked_ms.saturating_add(ttl_ms) > now_ms || h.until_ms > now_ms);
    }

    /// Serve one lease item for `instance` at `now_ms`.
    ///
    /// Tokens: never more than the bucket holds, nor the instance's max-min fair share of `burst`
    /// among the instances that asked within `ttl_ms`. Rate: the instance's max-min fair share of
    /// the refill rate by the rates they asked for, never more than is not reserved for others; it
    /// replaces the instance's previous reservation and holds for `ttl_ms`.
    pub fn lease(
        &mut self,
        instance: &str,
        item: &LeaseItem,
        now_ms: u64,
        ttl_ms: u64,
    ) -> LeaseGrant {
        let rate_mtps = item.rate_mtps();
        // Asked after now, or reserved for more than a term from now: the clock stepped back.
        // A term from now at most (else the share stays reserved for the step's length).
        for h in &mut self.holders {
            h.asked_ms = h.asked_ms.min(now_ms);
            h.until_ms = h.until_ms.min(now_ms.saturating_add(ttl_ms));
        }
        self.refill(item, now_ms);
        self.forget(now_ms, ttl_ms);
        let restored = self.restore(instance, item, now_ms);
        // What the instance may give back: what it was granted, and what its reservation let
        // it accrue since its last call (replaced now), less what it gave back.
        let before = self.holders.iter().find(|h| h.instance == instance);
        let demand_before = before.map_or(0, |h| h.demand);
        let share_before = before
            .filter(|h| h.until_ms > now_ms)
            .map_or(0, |h| h.share);
        let outstanding = before.map_or(0, |h| {
            let reserved_ms = h.until_ms.min(now_ms).saturating_sub(h.asked_ms);
            let accrued = u128::from(h.share) * u128::from(reserved_ms) / 1_000_000;
            h.outstanding
                .saturating_add(u64::try_from(accrued).unwrap_or(u64::MAX))
        });
        let returned = item.returned.min(outstanding);
        self.add(item, returned as f64);
        // What a settlement charged beyond the instance's lease is the bucket's debt now: below
        // zero, every instance's next call sees it.
        self.charge(item.owed as f64);
        // In debt, what the instance holds unspent repays it rather than being spent (at most
        // what it was granted and has not given back).
        let revoked = if self.tokens < 0.0 {
            let debt = (-self.tokens).ceil() as u64;
            item.held.min(outstanding - returned).min(debt)
        } else {
            0
        };
        self.add(item, revoked as f64);
        let outstanding = outstanding - returned - revoked;
        self.holders.retain(|h| h.instance != instance);
        let demand = item.demand_mtps().min(rate_mtps);
        let at = self
            .holders
            .partition_point(|h| h.instance.as_str() < instance);
        self.holders.insert(
            at,
            Holder {
                instance: instance.to_owned(),
                wanted: item.wanted,
                demand,
                asked_ms: now_ms,
                share: 0,
                until_ms: now_ms,
                outstanding,
            },
        );
        let live = |h: &Holder| h.asked_ms.saturating_add(ttl_ms) > now_ms;
        let of_live = |f: fn(&Holder) -> u64| -> Vec<u64> {
            self.holders
                .iter()
                .map(|h| if live(h) { f(h) } else { 0 })
                .collect()
        };
        let fair_tokens = max_min_fair_from(item.burst, &of_live(|h| h.wanted), at)[at];
        // The reserve for newcomers: while the bucket holds less than it, shares are cut so that
        // part of the refill flows in to fill it (not while it holds the rate for the holders
        // of before a loss: their renewals come first).
        let reserve = item.reserve();
        let after_loss = self
            .holders
            .first()
            .is_some_and(|h| h.instance.is_empty() && h.until_ms > now_ms);
        // Short of it, shares take at most three quarters of the rate, so that it fills again
        // (the refill goes to it before the tokens).
        let pool = if after_loss || self.reserve >= reserve as f64 {
            rate_mtps
        } else {
            rate_mtps - rate_mtps / 4
        };
        let fair_rate = max_min_fair_from(pool, &of_live(|h| h.demand), at)[at];
        let reserved = self.reserved_at(now_ms);
        // After a loss, an instance with evidence of the bucket renews: it was one of the
        // holders the rate is held for (a token lease drawing on the refill has no share to
        // show, only its demand), so it may take what it asks for of that rate. What nobody
        // claims stays held.
        let held_for_before = if after_loss && item.known_ms > 0 && at > 0 {
            self.holders[0].share
        } else {
            0
        };
        let share = demand
            .min(fair_rate)
            .min((pool + held_for_before).saturating_sub(reserved));
        // One that had a share grows by at most half of it out of what is held: the holders of
        // before not yet renewed count for nothing in the fair shares, and a proxy whose lease
        // ran dry asks for twice what it spent.
        let had = share_before.max(item.share_mtps());
        let share = if held_for_before > 0 && had > 0 {
            share.min(
                pool.saturating_sub(reserved)
                    .max(had.saturating_add(had / 2)),
            )
        } else {
            share
        };
        // A share that cannot accrue a few tokens within the lease is no share: what accrues
        // is lost at the lease's end. The bucket refills by it instead, and the instance asks
        // for its tokens (`retry_ms` says when one comes). A bucket in debt reserves nothing:
        // its whole refill repays the debt.
        let share =
            if u128::from(share) * u128::from(ttl_ms) < MIN_RESERVED_MTPS_MS || self.tokens < 0.0 {
                0
            } else {
                share
            };

        // The reserve is for instances whose demand is within their max-min fair share (a
        // newcomer's first call asks for no rate): they may be short of it only because others
        // hold the rate until they renew. The others, holding shares, take tokens only above
        // it. (By the smaller of its demands before and now: one that was light and ran dry on
        // a burst asks for more, and is light still.)
        let light = demand.min(demand_before) <= fair_rate;
        // (Without rate shares, the refill flows into the bucket and newcomers get their fair
        // share of it by asking: no reserve is kept then.) After a loss, not an instance that got
        // all the rate it asked for: the first to renew may have taken more than its fair share
        // of what was held for the holders of before, and the reserve bridges the others until
        // it renews.
        let may_take_reserve =
            (light || share == 0) && (!after_loss || share < demand || demand == 0);
        let reachable = |b: &Self| {
            let tokens = b.tokens.max(0.0);
            if may_take_reserve {
                tokens + b.reserve
            } else {
                tokens
            }
        };
        let available = reachable(self).floor() as u64;
        let granted = item.wanted.min(fair_tokens).min(available);
        // From the tokens first, then the reserve.
        let from_tokens = (granted as f64).min(self.tokens.max(0.0));
        self.tokens -= from_tokens;
        self.reserve -= granted as f64 - from_tokens;
        self.holders[at].outstanding = self.holders[at].outstanding.saturating_add(granted);
        if share > 0 {
            self.holders[at].share = share;
            self.holders[at].until_ms = now_ms.saturating_add(ttl_ms);
        }
        if held_for_before > 0 {
            // Only what it takes beyond its own share of before (restored already, or live here).
            let taken = share
                .saturating_sub(share_before.max(restored))
                .min(held_for_before);
            self.holders[0].share -= taken;
        }
        let asked = item.wanted > 0 || demand > 0;
        let nothing = asked && granted == 0 && share == 0;
        let (reset_ms, retry_ms) = match item.period {
            // Full again when the next period begins, and nothing comes before (but tokens given
            // back, or an operator's reset: the proxies ask again within a second).
            Some((_, end_ms)) => {
                let left = end_ms.saturating_sub(now_ms).max(1);
                (left, if nothing { left } else { 0 })
            }
            None => self.timing(item, now_ms, ttl_ms, nothing, light),
        };
        self.idle_at_ms = self
            .holders
            .iter()
            .map(|h| h.until_ms.max(h.asked_ms.saturating_add(ttl_ms)))
            .fold(now_ms.saturating_add(reset_ms), u64::max);
        LeaseGrant {
            granted,
            // A calendar quota's tokens are the instance's until its period ends.
            ttl_ms: item.period.map_or(ttl_ms, |_| reset_ms),
            remaining: reachable(self).floor() as u64,
            reset_ms,
            rate: share as f64 / 1_000.0,
            retry_ms,
            returned,
            debt: self.debt(),
            revoked,
        }
    }

    /// Whole tokens the bucket owes (rounded up: a client told when it is repaid is never told
    /// too early); 0 unless it is below zero.
    /// An operator's reset: the bucket is full again at its next refill (its tokens stand above
    /// any burst until then, and a refill caps them at `burst`), and what it owed is forgiven.
    /// Its holders stay: their reservations and what they were granted are theirs, and a holder's
    /// evidence of the bucket is not taken for a store that lost it (the store served it since).
    pub fn reset(&mut self) {
        self.tokens = RESET_TOKENS;
    }

    /// True between a [`GlobalBucket::reset`] and the bucket's next refill.
    pub fn is_reset_pending(&self) -> bool {
        self.tokens >= RESET_TOKENS
    }

    pub fn debt(&self) -> u64 {
        if self.tokens < 0.0 {
            (-self.tokens).ceil() as u64
        } else {
            0
        }
    }

    /// The refill rate reserved at `now_ms` (milli-tokens per second).
    fn reserved_at(&self, now_ms: u64) -> u64 {
        self.holders
            .iter()
            .filter(|h| h.until_ms > now_ms)
            .map(|h| h.share)
            .sum()
    }

    /// True once nothing distinguishes it from a new bucket: it can go.
    pub fn is_idle(&self, now_ms: u64) -> bool {
        self.idle_at_ms <= now_ms
    }
}
