//! Failure modes: what global rules do when their quota is not there — the quota service failed,
//! the wait for a first lease timed out, or a provisional allowance stands in — decided in one
//! place for leased and strict rules alike.

use super::{CheckInput, Engine, Inputs, QuotaRef, Refusal};
use crate::config::{FailureMode, FirstLease, QuotaService};
use crate::stats::RuleStat;
use smallvec::SmallVec;
use tollgate_core::limiter::INLINE_RULES;
use tollgate_core::{Outcome, Verdict};

/// What the failure mode makes of a request that some global rule could not decide.
pub(super) enum Undecided {
    /// Quota may still come: ask again later.
    Wait,
    /// `deny`: the request is refused.
    Refuse(Refusal),
    /// The checks were rewritten (dropped, or pointed at the local stand-in): decide them again.
    Again,
}

impl Refusal {
    /// A global rule's refusal by failure mode `deny`: retry once the quota service may be back.
    pub(super) fn failure_mode(rule: usize, service: Option<&QuotaService>) -> Self {
        let retry_ms = service.map_or(1_000, |q| q.retry_ms);
        Self {
            rule,
            quota: None,
            retry_after_secs: Some(retry_ms.div_ceil(1_000).max(1)),
        }
    }
}

impl Engine {
    /// The failure mode in force (no quota service configured: global rules cannot exist).
    pub(super) fn failure_mode(&self) -> FailureMode {
        self.config
            .quota_service
            .as_ref()
            .map_or(FailureMode::Allow, |q| q.failure_mode)
    }

    /// Apply the failure mode to an outcome that is neither admitted nor refused.
    pub(super) fn fall_back(
        &mut self,
        inputs: &mut Inputs,
        outcome: &Outcome,
        timed_out: bool,
    ) -> Undecided {
        let service = self.config.quota_service.as_ref();
        let failure = self.failure_mode();
        let provisional = service.is_some_and(|q| q.first_lease == FirstLease::Provisional);
        let mut rewritten = false;
        let mut dropped: SmallVec<[usize; INLINE_RULES]> = SmallVec::new();
        for (n, result) in outcome.checks.iter().enumerate() {
            let Some(input) = inputs.get_mut(n) else {
                continue;
            };
            // A token bucket waits for tokens in other workers' stashes: no failure, it waits.
            let local = matches!(
                super::quota_of(&self.config, input.which).map(|q| &q.limit),
                Some(tollgate_core::Limit::TokenBucket(_))
            );
            if !input.enforced || local {
                continue;
            }
            let rule = input.which.rule();
            match result.verdict {
                Verdict::Fallback => {}
                Verdict::Waiting if provisional => {}
                Verdict::Waiting if timed_out => {
                    // The service answers but had no quota for this request in time: a refusal,
                    // not a failure (a failed call marks the key, and that is `Fallback`).
                    self.stats.bump(rule, RuleStat::Limited);
                    return Undecided::Refuse(self.no_quota_in_time(rule));
                }
                _ => continue,
            }
            self.stats.bump(rule, RuleStat::Fallback);
            let mode = if result.verdict == Verdict::Waiting && provisional && !timed_out {
                FailureMode::Local
            } else {
                failure
            };
            match mode {
                FailureMode::Allow => dropped.push(n),
                FailureMode::Deny => {
                    self.stats.bump(rule, RuleStat::Limited);
                    return Undecided::Refuse(Refusal::failure_mode(rule, service));
                }
                FailureMode::Local => self.to_stand_in(input),
            }
            rewritten = true;
        }
        if !rewritten {
            return Undecided::Wait;
        }
        for n in dropped.into_iter().rev() {
            inputs.remove(n);
        }
        Undecided::Again
    }

    /// A global rule's refusal of a request that waited its time without quota: retry once a
    /// token can have come back to the global bucket.
    fn no_quota_in_time(&self, rule: usize) -> Refusal {
        let interval_ms = self
            .config
            .rules
            .get(rule)
            .and_then(|r| r.global())
            // (A calendar quota's tokens come back at its period's end: ask again in a second.)
            .filter(|g| g.calendar.is_none())
            .map_or(1_000, |g| g.per_ms.div_ceil(g.requests));
        Refusal {
            rule,
            quota: None,
            retry_after_secs: Some(interval_ms.div_ceil(1_000).max(1)),
        }
    }

    /// Point a global rule's check at its local stand-in (`limit / instances_hint`).
    pub(super) fn to_stand_in(&self, input: &mut CheckInput) {
        let rule = input.which.rule();
        if let Some(g) = self.config.rules.get(rule).and_then(|r| r.global()) {
            input.which = QuotaRef::Fallback(rule);
            input.slot = g.fallback.table.locate_hash(input.place);
        }
    }
}
