//! The per-request decision, host-independent: gather a request's checks from its view, decide them
//! against the slots (through the core's `CasStore`) and the worker's stashes, and answer admit,
//! refuse or wait — global rules' leases, strict answers and failure modes included. The host
//! layer only gathers what the engine asks for and carries out its answer.

mod arrival;
mod decide;
mod dry_run;
mod failure;
mod guard;
mod inspect;
mod lease;
mod pace;
mod refused;
mod reply;
mod settle;
mod strict;
#[cfg(test)]
mod tests;
mod top;

pub use arrival::Clock;
pub use guard::{reported_cpu, Seat, Seats};
pub use inspect::KeyState;
pub use lease::{read_answer, read_permit_answer, Call, Refill};
pub use pace::{Pacer, Pacers};
pub use settle::{Reservation, Reservations, ResponseSeen};
pub use strict::Strict;
pub use top::{json_string, ProcessTop, TopKey};

use crate::config::{Config, Cost, OverrideAction, Quota};
use crate::request::{header_cost, Request, RequestView};
use crate::stats::{ProcessStat, RuleStat, Stats};
use log::debug;
use smallvec::SmallVec;
use tollgate_core::limiter::INLINE_RULES;
use tollgate_core::slot::{key_hash, KeyPlacement};
use tollgate_core::{release, return_stash, CasStore, Hold, SlotId, StashTable};

/// How much longer than the quota call's timeout a request waits for quota: two of the plugin's
/// 5 ms ticks, so that by then a call that failed has marked its keys (and the failure mode, not a
/// refusal, decides).
pub const WAIT_GRACE_MS: u64 = 10;

/// Which quota a check runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuotaRef {
    /// The rule's own.
    Rule(usize),
    /// An override's own limit.
    Override(usize, usize),
    /// A global rule's local stand-in (failure mode `local`, provisional quota).
    Fallback(usize),
}

impl QuotaRef {
    pub fn rule(self) -> usize {
        match self {
            Self::Rule(i) | Self::Override(i, _) | Self::Fallback(i) => i,
        }
    }

    /// The quota's name in worker stashes (fallback quotas take no batches).
    fn stash_id(self) -> Option<u32> {
        let (rule, sub) = match self {
            Self::Rule(i) => (i, 0),
            Self::Override(i, j) => (i, j.checked_add(1)?),
            Self::Fallback(_) => return None,
        };
        let (rule, sub) = (u16::try_from(rule).ok()?, u16::try_from(sub).ok()?);
        Some(u32::from(rule) << 16 | u32::from(sub))
    }

    fn from_stash_id(id: u32) -> Self {
        let (rule, sub) = ((id >> 16) as usize, (id & 0xffff) as usize);
        match sub {
            0 => Self::Rule(rule),
            j => Self::Override(rule, j - 1),
        }
    }
}

/// One rule's part in a request, kept so that a paused request can be decided again later.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckInput {
    pub which: QuotaRef,
    /// The client key's name at the quota service (an unkeyed hash, the same on every proxy;
    /// keyed by `key_secret` on the wire). 0 for local rules.
    pub key: u128,
    /// The client key's placement hash (keyed by the deployment's secret): its slot in any table.
    pub place: u128,
    pub slot: SlotId,
    pub cost: u64,
    pub enforced: bool,
    /// The key's own `limit.requests` (`limit_from`), else the rule's.
    pub own_requests: Option<u64>,
}

/// A request's checks: on the stack for the usual few rules.
pub type Inputs = SmallVec<[CheckInput; INLINE_RULES]>;

/// Quota a request holds until it ends (concurrency rules), kept inline for one or two rules.
pub type Holds = SmallVec<[(QuotaRef, Hold); 2]>;

/// The quota a response describes in its rate-limit headers (rendered only when they are added).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuotaReport {
    pub which: QuotaRef,
    /// The key's own `limit.requests`, stated in place of the rule's.
    pub own_requests: Option<u64>,
    pub remaining: u64,
    pub reset_secs: u64,
}

/// What an admitted request takes along.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Admitted {
    pub report: Option<QuotaReport>,
    pub holds: Holds,
    /// What the request reserved of rules that settle its cost after the response.
    pub reservations: Reservations,
    /// Hold the request this long before passing it on (leaky buckets).
    pub delay_ns: u64,
}

/// Why a request is refused, and what its answer says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    /// The refusing rule: its response and its `x-tollgate-rule`.
    pub rule: usize,
    pub quota: Option<QuotaReport>,
    pub retry_after_secs: Option<u64>,
}

/// The decision for a request: what the stream (or the tick, for a paused one) carries out.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    Admit(Admitted),
    Refuse(Refusal),
    /// Some global rule has no quota yet: decide again once it may have some.
    Wait,
    /// No rule applies (or the host gave no time): the request goes on, unlimited.
    Pass,
    /// Strict mode: the request asks the quota service for its global checks itself, and is
    /// decided by the answer. (Boxed: a step is moved on every request, and the checks of a
    /// strict request are large; that request makes a call anyway.)
    Call(Box<Strict>),
}

/// One configuration's decisions in one worker: the rules, the worker's stashes, its stats and
/// the refills its requests claimed.
pub struct Engine {
    config: Config,
    stash: StashTable,
    stats: Stats,
    /// Refills, give-backs and global concurrency keys: `lease/`'s.
    leases: lease::Leases,
    /// What this worker last reported of its stashed tokens (the gauge is process-wide).
    stash_reported: i64,
    /// Requests' own calls (strict mode, and waiting requests on nginx): `strict.rs`'s.
    strict_calls: strict::StrictCalls,
    /// Overload rules: `guard.rs`'s.
    guards: guard::Guards,
    /// Some rule is a byte limit.
    paces: bool,
    dry_run_log: dry_run::DryRunLog,
    /// Places client keys in slot groups and flows (the configured `placement_secret`, else the
    /// deployment's random one).
    placement: KeyPlacement,
    /// The host can hold a request and resume it from the tick: a token bucket's refusal while
    /// other workers' stashes hold its tokens waits for them (see [`Engine::hold_for_stashes`]).
    holds_for_stashes: bool,
    /// The keys each rule sees most, for the status path (none without one).
    top: top::TopCounts,
    /// Each rule's own quota headers, rendered once (none for overload rules).
    policies: Vec<Option<crate::headers::RenderedQuota>>,
}

impl Engine {
    pub fn new(config: Config, deployment: KeyPlacement) -> Self {
        let placement = config.placement.unwrap_or(deployment);
        let guarded = config.rules.iter().any(|r| r.guard().is_some());
        let paces = config.rules.iter().any(|r| r.pace().is_some());
        let top = match &config.status {
            Some(status) => top::TopCounts::new(config.rules.len(), status.max_key_bytes)
                .stored_at(
                    config
                        .rules
                        .iter()
                        .map(|r| r.quota().map(|q| format!("{}.top", q.table.prefix())))
                        .collect(),
                ),
            None => top::TopCounts::default(),
        };
        let policies = config
            .rules
            .iter()
            .map(|r| {
                r.quota()
                    .map(|q| crate::headers::RenderedQuota::new(&r.name, q.policy))
            })
            .collect();
        Self {
            top,
            policies,
            stats: Stats::new(config.rules.len()),
            dry_run_log: dry_run::DryRunLog::new(config.rules.len()),
            config,
            stash: StashTable::default(),
            leases: lease::Leases::default(),
            stash_reported: 0,
            strict_calls: strict::StrictCalls::default(),
            guards: guard::Guards::new(guarded),
            paces,
            placement,
            holds_for_stashes: false,
        }
    }

    /// Where the host can resume a request from the tick: a request a token bucket would refuse
    /// while tokens of it sit in other workers' stashes waits (at most ~35 ms) for them to come
    /// back and is decided again, so the end of a burst spread over workers is not refused with
    /// tokens left. Elsewhere it is refused (the bound `docs/architecture.md` states).
    pub fn hold_for_stashes(&mut self, yes: bool) {
        self.holds_for_stashes = yes;
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn stats_mut(&mut self) -> &mut Stats {
        &mut self.stats
    }

    /// Create every slot group of every rule that does not exist yet (existing ones keep their
    /// state: a reload of unchanged rules).
    pub fn initialize<S: CasStore + ?Sized>(&self, store: &S) -> Result<(), String> {
        let stand_ins = self.config.rules.iter().filter_map(|r| {
            let g = r.global()?;
            Some((r, &g.fallback))
        });
        for (rule, quota) in self.config.quotas().chain(stand_ins) {
            quota
                .table
                .initialize(store)
                .map_err(|e| format!("cannot create the slots of rule {}: {e:?}", rule.name))?;
        }
        Ok(())
    }

    pub fn quota_of(&self, which: QuotaRef) -> Option<&Quota> {
        quota_of(&self.config, which)
    }

    /// Some rule that reads the request body (its cost or key) matches `request`.
    pub fn reads_body<V: RequestView>(&self, request: &Request<V>) -> bool {
        self.config
            .rules
            .iter()
            .any(|r| r.reads_request_body() && request.matches(&r.matcher))
    }

    /// Put in `inputs` the checks of every rule that applies to `request`, in rule order; or
    /// return the refusal that refuses the request outright: a `block` override, or a cost more
    /// than the rule can ever admit.
    pub fn gather<V: RequestView>(
        &mut self,
        request: &Request<V>,
        inputs: &mut Inputs,
    ) -> Option<Refusal> {
        inputs.clear();
        for (i, rule) in self.config.rules.iter().enumerate() {
            let Some(own) = rule.quota() else {
                continue;
            };
            // Byte limits pace bodies; they never refuse a request.
            if rule.pace().is_some() {
                continue;
            }
            if !request.matches(&rule.matcher) {
                continue;
            }
            let Some(key) = request.key(&rule.key, rule.missing_key, rule.unreadable_body) else {
                continue;
            };
            let overridden = rule.overrides.iter().position(|o| o.matches(&key));
            let (which, quota) = match overridden.map(|j| (j, &rule.overrides[j].action)) {
                None => (QuotaRef::Rule(i), own),
                Some((_, OverrideAction::Unlimited)) => continue,
                Some((_, OverrideAction::Block)) => {
                    if rule.dry_run {
                        self.dry_run_log.note(&mut self.stats, i);
                        continue;
                    }
                    if self.config.status.is_some() {
                        let place = self.placement.hash(&key);
                        self.top.seen(i, place, &key);
                        self.top.refused(i, place);
                    }
                    self.stats.bump(i, RuleStat::Blocked);
                    return Some(Refusal {
                        rule: i,
                        quota: None,
                        retry_after_secs: None,
                    });
                }
                Some((j, OverrideAction::Limit(q))) => (QuotaRef::Override(i, j), q),
            };
            // A key's own limit keys its bucket too: a new plan starts a fresh bucket. An
            // override's own limit comes first.
            let own_requests = rule
                .limit_from
                .as_ref()
                .filter(|_| matches!(which, QuotaRef::Rule(_)))
                .and_then(|from| {
                    let n = request.number(&from.source)?;
                    Some(n.clamp(1, from.max))
                });
            let place = match own_requests {
                None => self.placement.hash(&key),
                Some(n) => {
                    let mut keyed = key.clone();
                    crate::key::push_key_part(
                        &mut keyed,
                        Some(itoa::Buffer::new().format(n).as_bytes()),
                    );
                    self.placement.hash(&keyed)
                }
            };
            self.top.seen(i, place, &key);
            let key = if rule.global().is_some() {
                key_hash(&key)
            } else {
                0
            };
            let cost = match &rule.cost {
                Cost::Fixed(n) => *n,
                Cost::Header {
                    name,
                    default,
                    min,
                    max,
                } => header_cost(request.view().header(name).as_deref(), *default, *min, *max),
                Cost::Body {
                    fields,
                    input_bytes_per_token,
                    default,
                    min,
                    max,
                } => match request.body() {
                    Some(body) => body.cost(fields, *input_bytes_per_token, (*default, *min, *max)),
                    // No body at all: nothing to read.
                    None => (*default).clamp(*min, *max),
                },
            };
            // A cost no bucket of this rule can ever hold: refused at once, without a Retry-After
            // that waiting would not honour.
            let capacity = match rule.global() {
                Some(g) => Some(g.burst),
                None => quota.limit_for(own_requests).capacity(),
            };
            if capacity.is_some_and(|c| cost > c) {
                if rule.dry_run {
                    self.dry_run_log.note(&mut self.stats, i);
                    continue;
                }
                self.stats.bump(i, RuleStat::CostExceeded);
                self.stats.bump(i, RuleStat::Limited);
                self.top.refused(i, place);
                return Some(Refusal {
                    rule: i,
                    quota: None,
                    retry_after_secs: None,
                });
            }
            inputs.push(CheckInput {
                which,
                slot: quota.table.locate_hash(place),
                key,
                place,
                cost,
                enforced: !rule.dry_run,
                own_requests,
            });
        }
        None
    }

    /// Decide a request from its checks. Global rules without quota yet make it wait, or (when
    /// their source failed, or once `timed_out`) follow the failure mode, which may rewrite
    /// `inputs`.
    pub fn evaluate<S: CasStore + ?Sized>(
        &mut self,
        store: &S,
        inputs: &mut Inputs,
        now: u64,
        timed_out: bool,
    ) -> Step {
        let hold = self.holds_for_stashes && !timed_out;
        self.evaluate_holding(store, inputs, now, timed_out, hold)
    }

    /// [`Engine::evaluate`] for a request that is not held again whatever it finds: one that made
    /// its own call (decided in the answer's callback), or whose configuration goes away.
    pub fn evaluate_at_once<S: CasStore + ?Sized>(
        &mut self,
        store: &S,
        inputs: &mut Inputs,
        now: u64,
        timed_out: bool,
    ) -> Step {
        self.evaluate_holding(store, inputs, now, timed_out, false)
    }

    fn evaluate_holding<S: CasStore + ?Sized>(
        &mut self,
        store: &S,
        inputs: &mut Inputs,
        now: u64,
        timed_out: bool,
        hold: bool,
    ) -> Step {
        loop {
            let Some(outcome) = self.admit_checks(store, inputs, now, hold) else {
                return Step::Admit(Admitted::default());
            };
            self.record_claims(inputs, &outcome, now);
            if outcome.admitted || outcome.refused_by.is_some() {
                let step = self.conclude(inputs, &outcome);
                self.log_dry_runs(now);
                return step;
            }
            for (input, result) in inputs.iter().zip(&outcome.checks) {
                self.count_slot(input.which.rule(), result.slot);
            }
            match self.fall_back(inputs, &outcome, timed_out) {
                failure::Undecided::Wait => return Step::Wait,
                failure::Undecided::Refuse(r) => return Step::Refuse(r),
                failure::Undecided::Again if inputs.is_empty() => {
                    return Step::Admit(Admitted::default())
                }
                failure::Undecided::Again => {}
            }
        }
    }

    /// Count a request that waits for global quota.
    pub fn waits(&mut self, inputs: &Inputs) {
        for input in inputs {
            self.stats.bump(input.which.rule(), RuleStat::Waited);
        }
    }

    /// Give back what an admitted request held, at its end (concurrency rules).
    pub fn release<S: CasStore + ?Sized>(&mut self, store: &S, holds: Holds, now: u64) {
        for (which, hold) in holds {
            let Some(quota) = self.quota_of(which) else {
                continue;
            };
            let result = release(store, &quota.limit, &quota.table, &hold, now);
            let rule = which.rule();
            self.stats
                .add(rule, RuleStat::InFlight, -saturating_i64(hold.cost));
            if let Err(e) = result {
                self.stats.add_process(ProcessStat::ReleaseErrors, 1);
                log::error!(
                    "rule {}: in-flight count not released: {e:?}",
                    self.config.rules[rule].name
                );
            }
        }
    }

    /// Give back to their buckets the tokens this worker stashed and did not spend in time (all
    /// of them with `u64::MAX`), and note what the stashes hold now.
    pub fn return_stashes<S: CasStore + ?Sized>(&mut self, store: &S, now: u64) {
        let leftovers = self.stash.expired(now);
        let held = saturating_i64(self.stash.held());
        let reported = std::mem::replace(&mut self.stash_reported, held);
        self.stats
            .add_process(ProcessStat::StashHeld, held - reported);
        for l in leftovers {
            self.return_leftover(
                store,
                QuotaRef::from_stash_id(l.quota),
                l.slot,
                l.tokens,
                now,
            );
        }
    }

    fn return_leftover<S: CasStore + ?Sized>(
        &mut self,
        store: &S,
        which: QuotaRef,
        slot: SlotId,
        tokens: u64,
        now: u64,
    ) {
        let Some(quota) = self.quota_of(which) else {
            return;
        };
        match return_stash(store, &quota.limit, &quota.table, slot, tokens, now) {
            Ok(()) => self.stats.add(
                which.rule(),
                RuleStat::StashReturned,
                saturating_i64(tokens),
            ),
            // Lost tokens only make the key stricter until its bucket refills.
            Err(e) => debug!("stashed tokens not returned: {e:?}"),
        }
    }

    /// Tokens sitting in this worker's stashes.
    pub fn stashed(&self) -> u64 {
        self.stash.held()
    }
}

/// The quota a check runs against, if the configuration still has it.
fn quota_of(config: &Config, which: QuotaRef) -> Option<&Quota> {
    let rule = config.rules.get(which.rule())?;
    match which {
        QuotaRef::Rule(_) => rule.quota(),
        QuotaRef::Override(_, j) => match &rule.overrides.get(j)?.action {
            OverrideAction::Limit(q) => Some(q),
            _ => None,
        },
        QuotaRef::Fallback(_) => rule.global().map(|g| &g.fallback),
    }
}

fn saturating_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}
