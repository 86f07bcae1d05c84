//! Dry-run rules' would-be refusals in the log: counted per rule, one line a second at most.

use super::Engine;
use crate::stats::{RuleStat, Stats};
use log::info;

/// At most one line per rule this often.
const EVERY_MS: u64 = 1_000;

/// Per rule: would-be refusals not logged yet, and when the last line was (ms; 0: never).
#[derive(Debug)]
pub(super) struct DryRunLog {
    pending: Vec<(u64, u64)>,
}

impl DryRunLog {
    /// For `rules` rules, allocated here so that counting never allocates.
    pub(super) fn new(rules: usize) -> Self {
        Self {
            pending: vec![(0, 0); rules],
        }
    }

    /// A dry-run rule would have refused a request: counted in `stats` at once, logged by
    /// [`Engine::log_dry_runs`].
    pub(super) fn note(&mut self, stats: &mut Stats, rule: usize) {
        stats.bump(rule, RuleStat::DryRunLimited);
        if let Some((count, _)) = self.pending.get_mut(rule) {
            *count += 1;
        }
    }
}

impl Engine {
    /// A dry-run rule would have refused this request.
    pub(super) fn would_refuse(&mut self, rule: usize) {
        self.dry_run_log.note(&mut self.stats, rule);
    }

    /// Log each dry-run rule's would-be refusals since its last line, if that was a second ago
    /// or more (after a request's decision, and at the tick, so the last ones are not kept).
    pub fn log_dry_runs(&mut self, now: u64) {
        let now_ms = now / 1_000_000;
        for (rule, (count, last_ms)) in self.dry_run_log.pending.iter_mut().enumerate() {
            if *count == 0 || (*last_ms != 0 && now_ms.saturating_sub(*last_ms) < EVERY_MS) {
                continue;
            }
            let rule = self.config.rules.get(rule);
            let name = rule.map_or("?", |r| r.name.as_str());
            let what = if rule.is_some_and(|r| r.pace().is_some()) {
                "held back"
            } else {
                "refused"
            };
            let unit = if what == "refused" {
                "request(s)"
            } else {
                "body chunk(s)"
            };
            info!(
                "dry run: rule {name} would have {what} {count} {unit} (logged at most once a \
                 second; all counted in dry_run_limited)"
            );
            (*count, *last_ms) = (0, now_ms.max(1));
        }
    }
}
