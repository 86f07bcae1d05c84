//! Requests whose global rules are asked with a call of their own: strict mode, and lease-mode
//! waits on hosts that can only resume a request from its own callbacks.

use super::decide::stashed_quota;
use super::{quota_of, CheckInput, Engine, Inputs, QuotaRef, QuotaReport, Refusal, Step};
use crate::config::FailureMode;
use crate::headers::{ceil_secs, retry_after_secs};
use crate::stats::{ProcessStat, RuleStat};
use log::warn;
use smallvec::SmallVec;
use tollgate_core::global::lease::{LeaseItem, LeaseResponse};
use tollgate_core::limiter::{preview, Check, SlotEvent, INLINE_RULES};
use tollgate_core::{Ask, CasStore};

/// What the engine keeps of requests' own calls between requests.
#[derive(Default)]
pub struct StrictCalls {
    /// After a request's own call failed, until when (ms) this worker's requests apply the
    /// failure mode without calling (`quota_service.retry`).
    calls_off_until_ms: u64,
    /// Keys the service refused in answer to requests' own calls: not asked for again for
    /// `retry`.
    refused_keys: super::refused::RefusedKeys,
}

/// A request waiting for its own call to the quota service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Strict {
    /// Checks of global rules, asked for `cost` tokens each.
    pub globals: Inputs,
    /// Checks of global rules whose keys the service refused less than `retry` ago: not asked
    /// for, the failure mode decides them.
    pub refused: Inputs,
    /// Local rules (and stand-ins), decided once the global ones have granted.
    pub locals: Inputs,
}

impl Engine {
    fn is_global(&self, input: &CheckInput) -> bool {
        matches!(input.which, QuotaRef::Rule(i)
            if self.config.rules.get(i).is_some_and(|r| r.global().is_some()))
    }

    /// Strict mode: true if the request makes a call of its own (an enforced global rule applies).
    pub fn is_strict(&self, inputs: &Inputs) -> bool {
        let strict = self.config.quota_service.as_ref().is_some_and(|q| q.strict);
        strict && inputs.iter().any(|i| i.enforced && self.is_global(i))
    }

    /// The checks split into those asked by a call of the request's own, those of keys the
    /// service refused lately, and the rest.
    pub fn split(&self, inputs: Inputs, now: u64) -> Strict {
        let (now_ms, retry_ms) = (now / 1_000_000, self.retry_ms());
        let mut strict = Strict {
            globals: Inputs::new(),
            refused: Inputs::new(),
            locals: Inputs::new(),
        };
        for input in inputs {
            let rule = input.which.rule();
            if !self.is_global(&input) {
                strict.locals.push(input);
            } else if self
                .strict_calls
                .refused_keys
                .holds(rule, input.key, now_ms, retry_ms)
            {
                strict.refused.push(input);
            } else {
                strict.globals.push(input);
            }
        }
        strict
    }

    /// True if the request's own call goes out: calls are on ([`Engine::may_call`]) and it has
    /// global checks to ask for. Else it is decided at once: pass `None` to
    /// [`Engine::finish_strict`].
    pub fn needs_call(&self, strict: &Strict, now: u64) -> bool {
        self.may_call(now) && !strict.globals.is_empty()
    }

    /// False while a request's own call failed less than `retry` ago: such requests are decided
    /// by the failure mode without calling (pass `None` to [`Engine::finish_strict`]).
    pub fn may_call(&self, now: u64) -> bool {
        let now_ms = now / 1_000_000;
        let retry_ms = self.retry_ms();
        // Off further ahead than `retry` puts it: the clock stepped back; calls are on again.
        now_ms >= self.strict_calls.calls_off_until_ms
            || self.strict_calls.calls_off_until_ms
                > now_ms
                    .saturating_add(retry_ms)
                    .saturating_add(tollgate_core::state::CLOCK_SKEW_MS)
    }

    /// Strict mode, before the request's own call: the local rules' refusal, if they refuse now
    /// (one read each, nothing written), so that a request they refuse spends no global quota.
    /// A rule whose tokens this worker holds in its stash is not asked (the request would spend
    /// them).
    pub fn local_refusal<S: CasStore + ?Sized>(
        &mut self,
        store: &S,
        locals: &Inputs,
        now: u64,
    ) -> Option<Step> {
        let mut checked: Inputs = Inputs::new();
        let limits = locals
            .iter()
            .map(|i| Some(quota_of(&self.config, i.which)?.limit_for(i.own_requests)))
            .collect::<Option<SmallVec<[tollgate_core::Limit; INLINE_RULES]>>>()?;
        let mut checks: SmallVec<[Check; INLINE_RULES]> = SmallVec::new();
        for (n, input) in locals.iter().enumerate() {
            let stashed = stashed_quota(&self.config, input)
                .is_some_and(|id| self.stash.holds(id, input.slot, input.cost, now));
            if !input.enforced || stashed {
                continue;
            }
            let quota = quota_of(&self.config, input.which)?;
            checks.push(Check {
                limit: &limits[n],
                table: &quota.table,
                slot: input.slot,
                cost: input.cost,
                enforced: true,
                batch: 0,
                wait_for_stashes: false,
            });
            checked.push(*input);
        }
        let mut outcome = preview(store, &checks, now);
        drop(checks);
        let refused = outcome.refused_by?;
        for (n, check) in outcome.checks.iter_mut().enumerate() {
            if n != refused {
                check.slot = SlotEvent::Own;
            }
        }
        Some(self.conclude(&checked, &outcome))
    }

    /// The call's items: each global check's cost.
    pub fn strict_items(&self, strict: &Strict) -> Vec<LeaseItem> {
        strict
            .globals
            .iter()
            .filter_map(|g| {
                let ask = Ask {
                    wanted: g.cost,
                    used: g.cost,
                    ..Ask::default()
                };
                self.lease_item(g.which.rule(), g.key, &ask)
            })
            .collect()
    }

    /// Decide a request once its own call answered (`None`: the call failed, or none went out:
    /// see [`Engine::needs_call`]).
    pub fn finish_strict<S: CasStore + ?Sized>(
        &mut self,
        store: &S,
        strict: Strict,
        answer: Option<&LeaseResponse>,
        now: u64,
    ) -> Step {
        let Strict {
            globals,
            mut refused,
            mut locals,
        } = strict;
        let Some(answer) = answer else {
            return self.strict_failed(store, globals, refused, locals, now);
        };
        // Items the service refused one by one (e.g. a new key of a store that is full): the
        // failure mode decides their keys, as if the call had failed for them alone, and they are
        // not asked for again for `retry`; the call's other items count as answered.
        if let Some(e) = answer.errors.first() {
            warn!("quota service refused an item: {}", e.error);
        }
        let (now_ms, retry_ms) = (now / 1_000_000, self.retry_ms());
        for (n, g) in globals.iter().enumerate() {
            if is_refused(answer, n) {
                self.strict_calls
                    .refused_keys
                    .keep(g.which.rule(), g.key, now_ms, retry_ms);
                refused.push(*g);
            }
        }
        let mut refusal = self.fail_over(refused, &mut locals);
        for (n, (g, grant)) in globals.iter().zip(&answer.items).enumerate() {
            if grant.granted >= g.cost || is_refused(answer, n) {
                continue;
            }
            let rule = g.which.rule();
            if !g.enforced {
                self.would_refuse(rule);
                continue;
            }
            if refusal.is_some() {
                continue;
            }
            self.stats.bump(rule, RuleStat::Limited);
            let global = self.config.rules.get(rule).and_then(|r| r.global());
            // The time `cost` tokens take to come back.
            // (A calendar quota's: when its period ends.)
            let wait_ms = global.map_or(1_000, |gl| match gl.calendar {
                Some(_) => grant.reset_ms,
                None => g.cost.max(1).saturating_mul(gl.per_ms) / gl.requests,
            });
            refusal = Some(Refusal {
                rule,
                quota: Some(QuotaReport {
                    own_requests: None,
                    which: QuotaRef::Rule(rule),
                    remaining: grant.remaining,
                    reset_secs: ceil_secs(grant.reset_ms.saturating_mul(1_000_000)),
                }),
                retry_after_secs: Some(retry_after_secs(wait_ms.saturating_mul(1_000_000))),
            });
        }
        if let Some(r) = refusal {
            self.log_dry_runs(now);
            self.give_back_unspent(&globals, answer, false);
            return Step::Refuse(r);
        }
        for (n, (g, grant)) in globals.iter().zip(&answer.items).enumerate() {
            if grant.granted >= g.cost && !is_refused(answer, n) {
                self.stats.bump(g.which.rule(), RuleStat::Allowed);
            }
        }
        let mut step = self.evaluate_at_once(store, &mut locals, now, false);
        // A local rule refused it after all (another request took the last token since the
        // pre-check): its grants go back too.
        let admitted = !matches!(step, Step::Refuse(_));
        self.give_back_unspent(&globals, answer, admitted);
        // Without a local rule to report, the headers state the global bucket as the service
        // just did: the fewest tokens left of the rules it answered for.
        if let Step::Admit(a) = &mut step {
            if a.report.is_none() {
                a.report = globals
                    .iter()
                    .zip(&answer.items)
                    .enumerate()
                    .filter(|(n, _)| !is_refused(answer, *n))
                    .map(|(_, answered)| answered)
                    .min_by_key(|(_, grant)| grant.remaining)
                    .map(|(g, grant)| QuotaReport {
                        own_requests: None,
                        which: QuotaRef::Rule(g.which.rule()),
                        remaining: grant.remaining,
                        reset_secs: ceil_secs(grant.reset_ms.saturating_mul(1_000_000)),
                    });
            }
        }
        step
    }

    /// Strict mode: give back what the request's call was granted and the request will not
    /// spend — all of it if it was refused, else what falls short of a check's cost (a partial
    /// grant, or a dry-run rule's). Lease-mode requests that ask for themselves (nginx) give
    /// nothing back: the service would take the call for the key's lease renewal.
    /// An item the service refused was granted nothing (whatever its grant says).
    fn give_back_unspent(&mut self, globals: &Inputs, answer: &LeaseResponse, admitted: bool) {
        if !self.config.quota_service.as_ref().is_some_and(|q| q.strict) {
            return;
        }
        for (n, (g, grant)) in globals.iter().zip(&answer.items).enumerate() {
            if is_refused(answer, n) {
                continue;
            }
            let spent = if admitted && grant.granted >= g.cost {
                g.cost
            } else {
                0
            };
            self.give_back(g.which.rule(), g.key, grant.granted.saturating_sub(spent));
        }
    }

    /// The call failed (or none went out): the failure mode decides the global rules.
    fn strict_failed<S: CasStore + ?Sized>(
        &mut self,
        store: &S,
        globals: Inputs,
        refused: Inputs,
        mut locals: Inputs,
        now: u64,
    ) -> Step {
        // A call that failed (rather than none made: calls are off, or every key was refused
        // lately) starts `retry` for the worker's calls.
        if self.may_call(now) && !globals.is_empty() {
            self.stats.add_process(ProcessStat::QuotaFailures, 1);
            self.strict_calls.calls_off_until_ms =
                (now / 1_000_000).saturating_add(self.retry_ms());
        }
        match self.fail_over(globals.into_iter().chain(refused), &mut locals) {
            Some(r) => Step::Refuse(r),
            None => self.evaluate_at_once(store, &mut locals, now, false),
        }
    }

    /// The failure mode decides `failed` global checks for this request: `allow` drops them,
    /// `local` puts their stand-ins among `locals`, `deny` refuses the request (the first
    /// enforced one's refusal).
    fn fail_over(
        &mut self,
        failed: impl IntoIterator<Item = CheckInput>,
        locals: &mut Inputs,
    ) -> Option<Refusal> {
        let mode = self.failure_mode();
        let mut refusal = None;
        for mut g in failed {
            let rule = g.which.rule();
            self.stats.bump(rule, RuleStat::Fallback);
            match mode {
                FailureMode::Deny if g.enforced && refusal.is_none() => {
                    self.stats.bump(rule, RuleStat::Limited);
                    let service = self.config.quota_service.as_ref();
                    refusal = Some(Refusal::failure_mode(rule, service));
                }
                FailureMode::Local => {
                    self.to_stand_in(&mut g);
                    locals.push(g);
                }
                FailureMode::Allow | FailureMode::Deny => {}
            }
        }
        refusal
    }
}

/// The service refused the call's item `n` alone (it lists it under `errors`).
fn is_refused(answer: &LeaseResponse, n: usize) -> bool {
    answer.errors.iter().any(|e| e.item == n)
}
