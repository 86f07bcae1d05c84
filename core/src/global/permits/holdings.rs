//! The service's side: the holdings of one key, and the step that serves an instance's ask.

use super::PermitAsk;
use crate::global::fair_share::max_min_fair_from;

/// One instance's holding at one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holding {
    pub instance: String,
    pub held: u64,
    pub wanted: u64,
    /// When the holding ends unless renewed (ms since the Unix epoch).
    pub expires_ms: u64,
}

/// The holdings of one key, sorted by instance.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Holdings {
    pub entries: Vec<Holding>,
}

/// The answer for one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PermitGrant {
    /// Permits the instance holds now, until `ttl_ms` from the call.
    pub held: u64,
    /// Its max-min fair share: above it, it should let permits go as its requests end.
    pub share: u64,
    /// Permits no instance holds.
    pub free: u64,
}

impl Holdings {
    /// True if `instance` says it holds `known_held` permits of the key (its lease still lasting)
    /// while the store has no holding of it: the store lost them.
    pub fn contradicts(
        holdings: Option<&Self>,
        instance: &str,
        known_held: u64,
        now_ms: u64,
    ) -> bool {
        known_held > 0
            && !holdings.is_some_and(|h| {
                h.entries
                    .iter()
                    .any(|e| e.instance == instance && e.expires_ms > now_ms)
            })
    }

    /// Forget holdings that ended.
    pub fn prune(&mut self, now_ms: u64) {
        self.entries.retain(|h| h.expires_ms > now_ms);
    }

    /// Permits held by all instances.
    pub fn total(&self) -> u64 {
        self.entries.iter().map(|h| h.held).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// From then on every holding has ended ([`Self::prune`] leaves it empty): as good as none, it
    /// can go.
    pub fn idle_at_ms(&self) -> u64 {
        self.entries.iter().map(|h| h.expires_ms).max().unwrap_or(0)
    }

    /// Serve one instance's call at `now_ms`: its holding afterwards lasts `ttl_ms`.
    pub fn grant(
        &mut self,
        instance: &str,
        ask: &PermitAsk,
        now_ms: u64,
        ttl_ms: u64,
        settled: bool,
    ) -> PermitGrant {
        // Expiring more than a term from now: the clock stepped back. A term from now at most
        // (else a stopped holder's permits stay held for the step's length).
        let latest = now_ms.saturating_add(ttl_ms);
        for h in &mut self.entries {
            h.expires_ms = h.expires_ms.min(latest);
        }
        self.prune(now_ms);
        let at = match self
            .entries
            .binary_search_by(|h| h.instance.as_str().cmp(instance))
        {
            Ok(i) => i,
            Err(i) => {
                self.entries.insert(
                    i,
                    Holding {
                        instance: instance.to_owned(),
                        held: 0,
                        wanted: 0,
                        expires_ms: 0,
                    },
                );
                i
            }
        };
        let known = self.entries[at].expires_ms != 0;
        let others: u64 = self
            .entries
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != at)
            .map(|(_, h)| h.held)
            .sum();
        let available = ask.limit.saturating_sub(others);
        let held_here = self.entries[at].held;
        // What it keeps: what it holds here; after a loss of holdings (not settled), what its
        // evidence says it held — its holding, not only what it has in flight, so that a
        // renewing holder admits as before.
        let keep = if known {
            ask.keep.min(held_here)
        } else if settled {
            0
        } else {
            ask.keep.max(ask.known_held)
        }
        .min(available);
        self.entries[at].wanted = ask.wanted.max(keep);
        let demands: Vec<u64> = self.entries.iter().map(|h| h.wanted).collect();
        let share = max_min_fair_from(ask.limit, &demands, at)[at];
        let held = if settled {
            keep.max(ask.wanted.min(share).min(available))
        } else if known {
            // Not settled: what it holds stays its own (up to what it wants); nothing new.
            keep.max(ask.wanted.min(held_here).min(available))
        } else {
            keep
        };
        if held == 0 && ask.wanted == 0 {
            self.entries.remove(at);
        } else {
            let h = &mut self.entries[at];
            h.held = held;
            h.expires_ms = now_ms.saturating_add(ttl_ms).max(1);
        }
        PermitGrant {
            held,
            share,
            free: ask.limit.saturating_sub(others + held),
        }
    }
}
