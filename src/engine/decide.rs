//! Deciding a request's checks: from the worker's stashes where they can, from the shared slots
//! otherwise (all or nothing), then the stats, logs and headers of the outcome.

use super::{quota_of, saturating_i64, Admitted, CheckInput, Engine, QuotaRef, Refusal, Step};
use crate::config::{Config, Quota};
use crate::headers::{ceil_secs, retry_after_secs};
use crate::stats::RuleStat;
use log::debug;
use smallvec::SmallVec;
use tollgate_core::limiter::INLINE_RULES;
use tollgate_core::{
    admit, CasStore, Check, CheckOutcome, CheckOutcomes, Lookup, Outcome, SlotEvent, Verdict,
};

/// The stash name of an input's quota if a worker may stash for it: an enforced check of a rule
/// with `worker_batch`.
pub(super) fn stashed_quota(config: &Config, input: &CheckInput) -> Option<u32> {
    let batches = config
        .rules
        .get(input.which.rule())
        .is_some_and(|r| r.worker_batch > 0);
    input.which.stash_id().filter(|_| batches && input.enforced)
}

/// The shared slots' check of `input` against `limit` (its quota's, or the key's own).
fn check<'a>(
    input: &CheckInput,
    limit: &'a tollgate_core::Limit,
    quota: &'a Quota,
    batch: u64,
    wait_for_stashes: bool,
) -> Check<'a> {
    Check {
        limit,
        table: &quota.table,
        slot: input.slot,
        cost: input.cost,
        enforced: input.enforced,
        batch,
        wait_for_stashes,
    }
}

impl Engine {
    /// Decide `inputs` as one all-or-nothing outcome aligned with them. `None` if a quota is gone.
    pub(super) fn admit_checks<S: CasStore + ?Sized>(
        &mut self,
        store: &S,
        inputs: &[CheckInput],
        now: u64,
        hold_for_stashes: bool,
    ) -> Option<Outcome> {
        let (config, stash) = (&self.config, &mut self.stash);
        if let [input] = inputs {
            if stashed_quota(config, input).is_none() {
                // One check no stash serves (the usual request): the shared slots decide it, as
                // below, without the per-check bookkeeping.
                let quota = quota_of(config, input.which)?;
                let limit = quota.limit_for(input.own_requests);
                return Some(admit(store, &[check(input, &limit, quota, 0, false)], now));
            }
        }
        let limits = inputs
            .iter()
            .map(|i| Some(quota_of(config, i.which)?.limit_for(i.own_requests)))
            .collect::<Option<SmallVec<[tollgate_core::Limit; INLINE_RULES]>>>()?;
        let mut results = CheckOutcomes::new();
        let mut checks: SmallVec<[Check; INLINE_RULES]> = SmallVec::new();
        let mut asked: SmallVec<[usize; INLINE_RULES]> = SmallVec::new();
        let mut refused = None;
        // Dry-run rules count would-be refusals of every request: a remembered refusal would hide
        // them.
        let any_dry_run = inputs.iter().any(|i| !i.enforced);
        for (n, input) in inputs.iter().enumerate() {
            let quota = quota_of(config, input.which)?;
            let max_batch = config.rules.get(input.which.rule())?.worker_batch;
            let lookup = match stashed_quota(config, input) {
                Some(id) => stash.lookup(id, input.slot, input.cost, max_batch, now),
                None => Lookup::Ask { batch: 0 },
            };
            let lookup = match lookup {
                Lookup::Refused { .. } if any_dry_run => Lookup::Ask { batch: 0 },
                other => other,
            };
            let verdict = match lookup {
                Lookup::Spent {
                    remaining,
                    reset_ns,
                } => Verdict::Admitted {
                    remaining,
                    reset_ns,
                    delay_ns: 0,
                },
                Lookup::Refused {
                    retry_after_ns,
                    reset_ns,
                } => {
                    refused.get_or_insert(n);
                    Verdict::Refused {
                        retry_after_ns,
                        remaining: 0,
                        reset_ns,
                    }
                }
                Lookup::Ask { batch } => {
                    asked.push(n);
                    // Only rules that stash can have tokens in other workers' stashes.
                    let wait = hold_for_stashes && stashed_quota(config, input).is_some();
                    checks.push(check(input, &limits[n], quota, batch, wait));
                    Verdict::Skipped
                }
            };
            results.push(CheckOutcome {
                verdict,
                slot: SlotEvent::Own,
                hold: None,
                refill: false,
                stashed: 0,
            });
        }
        let outcome = if refused.is_some() || checks.is_empty() {
            Outcome {
                admitted: refused.is_none(),
                refused_by: refused,
                checks: results,
            }
        } else if asked.len() == inputs.len() {
            // Every check asked the shared slots (no stash served one): their outcome is the
            // request's, in the same order.
            admit(store, &checks, now)
        } else {
            let shared = admit(store, &checks, now);
            for (&n, result) in asked.iter().zip(&shared.checks) {
                results[n] = *result;
            }
            Outcome {
                admitted: shared.admitted,
                refused_by: shared.refused_by.map(|i| asked[i]),
                checks: results,
            }
        };
        drop(checks);
        self.keep_stashes(store, inputs, &outcome, &asked, now);
        Some(outcome)
    }

    /// Stash what the bucket gave beyond the request, remember refusals, and put back stash
    /// spending of a request that goes no further.
    fn keep_stashes<S: CasStore + ?Sized>(
        &mut self,
        store: &S,
        inputs: &[CheckInput],
        outcome: &Outcome,
        asked: &[usize],
        now: u64,
    ) {
        for (n, (input, result)) in inputs.iter().zip(&outcome.checks).enumerate() {
            let Some(id) = stashed_quota(&self.config, input) else {
                continue;
            };
            let was_asked = asked.contains(&n);
            match result.verdict {
                Verdict::Admitted {
                    remaining,
                    reset_ns,
                    ..
                } if outcome.admitted && was_asked => {
                    let kept =
                        self.stash
                            .stash(id, input.slot, result.stashed, remaining, reset_ns, now);
                    if !kept && result.stashed > 0 {
                        self.return_leftover(store, input.which, input.slot, result.stashed, now);
                    }
                }
                // Spent from the stash, but the request goes no further: back into the stash.
                Verdict::Admitted { .. } if !outcome.admitted && !was_asked => {
                    self.stash.put_back(id, input.slot, input.cost)
                }
                Verdict::Refused {
                    retry_after_ns,
                    reset_ns,
                    ..
                } if was_asked => {
                    self.stash
                        .refused(id, input.slot, input.cost, retry_after_ns, reset_ns, now)
                }
                _ => {}
            }
        }
    }

    /// What a check found in its slot group, counted (also for requests not decided yet: a key
    /// waiting for its first lease takes its slot as any other).
    pub(super) fn count_slot(&mut self, rule: usize, slot: SlotEvent) {
        match slot {
            SlotEvent::Own => {}
            SlotEvent::TakenOver => self.stats.bump(rule, RuleStat::SlotTakenOver),
            SlotEvent::Evicted => self.stats.bump(rule, RuleStat::SlotEvicted),
            SlotEvent::Shared => self.stats.bump(rule, RuleStat::SlotShared),
        }
    }

    /// Stats, logs and headers of a decided request.
    pub(super) fn conclude(&mut self, inputs: &[CheckInput], outcome: &Outcome) -> Step {
        // The quota to report: the refusing rule, else the one with the least left.
        let mut report: Option<(QuotaRef, u64, u64, Option<u64>)> = None;
        let mut admitted = Admitted::default();
        for (n, result) in outcome.checks.iter().enumerate() {
            let (input, which) = (&inputs[n], inputs[n].which);
            let rule = which.rule();
            self.count_slot(rule, result.slot);
            let (remaining, reset_secs) = match result.verdict {
                Verdict::Admitted {
                    remaining,
                    reset_ns,
                    delay_ns: d,
                } => {
                    if outcome.admitted {
                        self.stats.bump(rule, RuleStat::Allowed);
                        self.reserve(&mut admitted.reservations, input);
                        if d > 0 && input.enforced {
                            self.stats.bump(rule, RuleStat::Delayed);
                            admitted.delay_ns = admitted.delay_ns.max(d);
                        }
                    }
                    (remaining, ceil_secs(reset_ns))
                }
                Verdict::Refused {
                    retry_after_ns,
                    remaining,
                    ..
                } => {
                    if input.enforced {
                        self.stats.bump(rule, RuleStat::Limited);
                        self.top.refused(rule, input.place);
                    } else {
                        self.would_refuse(rule);
                    }
                    (remaining, retry_after_secs(retry_after_ns))
                }
                Verdict::Contended => {
                    self.stats.bump(rule, RuleStat::Contended);
                    if input.enforced {
                        self.stats.bump(rule, RuleStat::Limited);
                        self.top.refused(rule, input.place);
                    }
                    (0, 1)
                }
                Verdict::Unavailable => {
                    self.stats.bump(rule, RuleStat::StoreErrors);
                    continue;
                }
                // Dry-run global rules without quota yet, or a token bucket waiting for stashed
                // tokens: no opinion yet; or not asked.
                Verdict::Waiting | Verdict::Fallback | Verdict::Skipped => continue,
            };
            debug!(
                "rule {} key {:016x} group {} {:?} {:?}",
                self.config.rules[rule].name,
                input.slot.tag,
                input.slot.group,
                result.verdict,
                result.slot
            );
            if let Some(hold) = result.hold {
                self.stats
                    .add(rule, RuleStat::InFlight, saturating_i64(hold.cost));
                admitted.holds.push((which, hold));
                if let (super::QuotaRef::Rule(_), Some(tollgate_core::Limit::PermitLease(_))) =
                    (which, self.quota_of(which).map(|q| &q.limit))
                {
                    self.watch_permits(rule, input.slot, input.key);
                }
            }
            let refusing = outcome.refused_by == Some(n);
            let tighter = report
                .is_none_or(|(_, r, t, _)| remaining < r || (remaining == r && reset_secs > t));
            if refusing || (outcome.admitted && tighter) {
                report = Some((which, remaining, reset_secs, input.own_requests));
            }
        }
        let report =
            report.map(
                |(which, remaining, reset_secs, own_requests)| super::QuotaReport {
                    which,
                    own_requests,
                    remaining,
                    reset_secs,
                },
            );
        if let (false, Some(r)) = (outcome.admitted, report) {
            return Step::Refuse(Refusal {
                rule: r.which.rule(),
                quota: Some(r),
                retry_after_secs: Some(r.reset_secs),
            });
        }
        admitted.report = report;
        Step::Admit(admitted)
    }
}
