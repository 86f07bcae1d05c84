//! Byte limits: the rules that pace a request's or a response's body per key, and each chunk of
//! it charged to the key's byte bucket with how long to hold it before it goes on.

use super::Engine;
use crate::config::PaceBody;
use crate::request::{Request, RequestView};
use crate::stats::RuleStat;
use smallvec::SmallVec;
use tollgate_core::limiter::return_stash;
use tollgate_core::{pace, CasStore, SlotId};

/// One byte limit's part in a request: the key's slot, and how much of the body it paced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pacer {
    pub rule: usize,
    pub slot: SlotId,
    pub body: PaceBody,
    /// Bytes of the body that passed before pacing starts.
    pub after: u64,
    /// Bytes of the body seen so far.
    pub seen: u64,
}

/// A request's byte limits: inline for one.
pub type Pacers = SmallVec<[Pacer; 1]>;

impl Engine {
    /// The byte limits that apply to `request` (matched, and keyed as every rule is).
    pub fn pacers<V: RequestView>(&self, request: &Request<V>) -> Pacers {
        let mut pacers = Pacers::new();
        if !self.paces {
            return pacers;
        }
        for (i, rule) in self.config.rules.iter().enumerate() {
            let (Some(p), Some(quota)) = (rule.pace(), rule.quota()) else {
                continue;
            };
            if !request.matches(&rule.matcher) {
                continue;
            }
            let Some(key) = request.key(&rule.key, rule.missing_key, rule.unreadable_body) else {
                continue;
            };
            pacers.push(Pacer {
                rule: i,
                slot: quota.table.locate_hash(self.placement.hash(&key)),
                body: p.body,
                after: p.after,
                seen: 0,
            });
        }
        pacers
    }

    /// `bytes` more of a request's `body` are about to go on: charge them (beyond each rule's
    /// `after`) to the keys' byte buckets. Returns how long (ns) to hold them first: the longest
    /// wait any enforced rule asks (dry-run rules count, never hold).
    pub fn pace<S: CasStore + ?Sized>(
        &mut self,
        store: &S,
        pacers: &mut Pacers,
        body: PaceBody,
        bytes: u64,
        now: u64,
    ) -> u64 {
        let mut wait = 0;
        for p in pacers.iter_mut().filter(|p| p.body == body) {
            let before = p.seen;
            p.seen = p.seen.saturating_add(bytes);
            let charged = p.seen.saturating_sub(before.max(p.after));
            if charged == 0 {
                continue;
            }
            let Some(rule) = self.config.rules.get(p.rule) else {
                continue;
            };
            let Some(quota) = rule.quota() else {
                continue;
            };
            match pace(store, &quota.limit, &quota.table, p.slot, charged, now) {
                Ok(w) => {
                    self.stats
                        .add(p.rule, RuleStat::PacedBytes, super::saturating_i64(charged));
                    if !rule.dry_run {
                        wait = wait.max(w);
                    } else if w > 0 {
                        self.dry_run_log.note(&mut self.stats, p.rule);
                    }
                }
                // The store failed: these bytes go on unpaced.
                Err(_) => self.stats.bump(p.rule, RuleStat::StoreErrors),
            }
        }
        wait
    }

    /// `bytes` of a request's `body`, charged and held, never went on (the stream ended): give
    /// them back to the keys' byte buckets (at most what each rule charged of the body; not to a
    /// slot another key holds now).
    pub fn unpace<S: CasStore + ?Sized>(
        &mut self,
        store: &S,
        pacers: &Pacers,
        body: PaceBody,
        bytes: u64,
        now: u64,
    ) {
        if bytes == 0 {
            return;
        }
        for p in pacers.iter().filter(|p| p.body == body) {
            let back = bytes.min(p.seen.saturating_sub(p.after));
            let Some(quota) = self.config.rules.get(p.rule).and_then(|r| r.quota()) else {
                continue;
            };
            if back == 0 {
                continue;
            }
            // (`paced_bytes` is a counter: it keeps them.)
            if return_stash(store, &quota.limit, &quota.table, p.slot, back, now).is_err() {
                self.stats.bump(p.rule, RuleStat::StoreErrors);
            }
        }
    }

    /// Time a body of this request was held by byte limits, counted for each of its `pacers`.
    pub fn held(&mut self, pacers: &Pacers, body: PaceBody, held_ns: u64) {
        let ms = super::saturating_i64(held_ns / 1_000_000);
        for p in pacers.iter().filter(|p| p.body == body) {
            self.stats.add(p.rule, RuleStat::HeldMs, ms);
        }
    }
}
