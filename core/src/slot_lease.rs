//! Global concurrency at the quota service: the slots of one key's limit, leased to proxy
//! instances. Each instance holds some slots until its holding expires unless renewed; a proxy
//! that dies or is cut off loses its slots one lease term after its last renewal, and no one has
//! to decrement anything for it.
//!
//! A call says how many slots the instance wants to hold (`wanted`) and how many of those it
//! holds it keeps using whatever the answer (`keep`: its requests in flight, at least). The
//! instance then holds `max(keep, min(wanted, fair share, what others do not hold))`: never fewer
//! than it keeps (it may still be using them), never more than the limit in total. Fair shares are
//! max-min fair by `wanted` among the instances with live holdings; an instance above its share
//! is told its share and lets slots go as its requests end.
//!
//! Until the store has been up for a lease term (`settled`), a store that lost its holdings (a
//! restart) grants nothing new: instances renewing declare what they keep, and get that back.

use crate::fair_share::max_min_fair;
use crate::lease::{MAX_COUNT, MAX_ITEMS, MAX_NAME};
use serde::{Deserialize, Serialize};

/// `POST /v1/slots`: one instance's holdings of some keys, renewed, grown or given back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotRequest {
    pub instance: String,
    pub items: Vec<SlotItem>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotItem {
    /// The rule's name (metrics and logs).
    pub rule: String,
    /// A fingerprint of the rule's limit: configurations that differ never share state.
    pub limit_id: String,
    /// The client key's hash (hex).
    pub key: String,
    /// The limit: requests in flight across all instances.
    pub concurrent: u64,
    /// Slots the instance wants to hold.
    pub wanted: u64,
    /// Slots it holds and keeps using until the answer comes.
    #[serde(default)]
    pub keep: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotResponse {
    /// One per request item, in the same order.
    pub items: Vec<SlotAnswer>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotAnswer {
    /// Slots the instance holds now, for `ttl_ms` from its call.
    pub held: u64,
    /// Its max-min fair share of the limit: above it, let slots go as requests end.
    pub share: u64,
    /// Slots no instance holds.
    pub free: u64,
    pub ttl_ms: u64,
}

impl SlotItem {
    pub fn problem(&self) -> Option<String> {
        let long = [&self.rule, &self.limit_id, &self.key]
            .into_iter()
            .any(|s| s.is_empty() || s.len() > MAX_NAME);
        if long {
            return Some(format!(
                "rule, limit_id and key must be 1 to {MAX_NAME} bytes"
            ));
        }
        if self.concurrent == 0 || self.concurrent > MAX_COUNT {
            return Some(format!("concurrent must be 1 to {MAX_COUNT}"));
        }
        if self.wanted > MAX_COUNT || self.keep > MAX_COUNT {
            return Some(format!("wanted and keep must be at most {MAX_COUNT}"));
        }
        None
    }

    pub fn ask(&self) -> SlotAsk {
        SlotAsk {
            limit: self.concurrent,
            wanted: self.wanted,
            keep: self.keep,
        }
    }
}

impl SlotRequest {
    pub fn problem(&self) -> Option<String> {
        if self.instance.is_empty() || self.instance.len() > MAX_NAME {
            return Some(format!("instance must be 1 to {MAX_NAME} bytes"));
        }
        if self.items.len() > MAX_ITEMS {
            return Some(format!("at most {MAX_ITEMS} items per call"));
        }
        self.items
            .iter()
            .enumerate()
            .find_map(|(i, item)| item.problem().map(|p| format!("items[{i}]: {p}")))
    }
}

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

/// What an instance asks of one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotAsk {
    /// The limit: slots in flight across all instances.
    pub limit: u64,
    /// Slots the instance wants to hold (0 with `keep` 0: it gives the key back).
    pub wanted: u64,
    /// Slots it holds and keeps using until the answer comes.
    pub keep: u64,
}

/// The answer for one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SlotGrant {
    /// Slots the instance holds now, until `ttl_ms` from the call.
    pub held: u64,
    /// Its max-min fair share: above it, it should let slots go as its requests end.
    pub share: u64,
    /// Slots no instance holds.
    pub free: u64,
}

impl Holdings {
    /// Forget holdings that ended.
    pub fn prune(&mut self, now_ms: u64) {
        self.entries.retain(|h| h.expires_ms > now_ms);
    }

    /// Slots held by all instances.
    pub fn total(&self) -> u64 {
        self.entries.iter().map(|h| h.held).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Serve one instance's call at `now_ms`: its holding afterwards lasts `ttl_ms`.
    pub fn grant(
        &mut self,
        instance: &str,
        ask: &SlotAsk,
        now_ms: u64,
        ttl_ms: u64,
        settled: bool,
    ) -> SlotGrant {
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
        // What it keeps: what it holds here; after a loss of holdings, what it says it holds.
        let keep = if known {
            ask.keep.min(self.entries[at].held)
        } else if settled {
            0
        } else {
            ask.keep
        }
        .min(available);
        self.entries[at].wanted = ask.wanted.max(keep);
        let demands: Vec<u64> = self.entries.iter().map(|h| h.wanted).collect();
        let share = max_min_fair(ask.limit, &demands)[at];
        let held = if settled {
            keep.max(ask.wanted.min(share).min(available))
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
        SlotGrant {
            held,
            share,
            free: ask.limit.saturating_sub(others + held),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const TTL: u64 = 10_000;

    fn ask(wanted: u64, keep: u64) -> SlotAsk {
        SlotAsk {
            limit: 10,
            wanted,
            keep,
        }
    }

    #[test]
    fn a_lone_instance_gets_what_it_wants_up_to_the_limit() {
        let mut h = Holdings::default();
        assert_eq!(h.grant("a", &ask(4, 0), 0, TTL, true).held, 4);
        assert_eq!(h.grant("a", &ask(30, 4), 100, TTL, true).held, 10);
        assert_eq!(h.total(), 10);
    }

    #[test]
    fn a_newcomer_gets_what_is_free_and_the_holder_lets_go_to_its_share() {
        let mut h = Holdings::default();
        h.grant("a", &ask(10, 0), 0, TTL, true);
        // b wants 10 too: nothing is free; both are told their share of 5.
        let b = h.grant("b", &ask(10, 0), 10, TTL, true);
        assert_eq!((b.held, b.share, b.free), (0, 5, 0));
        // a still has 8 in flight: it keeps 8 (more than its share).
        let a = h.grant("a", &ask(10, 8), 20, TTL, true);
        assert_eq!((a.held, a.share), (8, 5));
        assert_eq!(h.grant("b", &ask(10, 0), 30, TTL, true).held, 2);
        // Its requests end: a keeps 5, and b gets the rest.
        assert_eq!(h.grant("a", &ask(10, 5), 40, TTL, true).held, 5);
        assert_eq!(h.grant("b", &ask(10, 2), 50, TTL, true).held, 5);
        assert_eq!(h.total(), 10);
    }

    #[test]
    fn a_holding_that_is_not_renewed_ends_and_its_slots_go_to_others() {
        let mut h = Holdings::default();
        h.grant("dead", &ask(10, 0), 0, TTL, true);
        assert_eq!(h.grant("b", &ask(10, 0), TTL - 1, TTL, true).held, 0);
        assert_eq!(h.grant("b", &ask(10, 0), TTL, TTL, true).held, 10);
        assert_eq!(h.entries.len(), 1);
    }

    #[test]
    fn giving_a_key_back_forgets_the_instance() {
        let mut h = Holdings::default();
        h.grant("a", &ask(3, 0), 0, TTL, true);
        assert_eq!(h.grant("a", &ask(0, 0), 10, TTL, true).held, 0);
        assert!(h.is_empty());
    }

    #[test]
    fn after_a_loss_of_holdings_instances_get_back_what_they_keep_and_nothing_new() {
        let mut h = Holdings::default();
        assert_eq!(h.grant("a", &ask(10, 6), 0, TTL, false).held, 6);
        assert_eq!(h.grant("new", &ask(10, 0), 0, TTL, false).held, 0);
        // More than the limit declared: what fits.
        assert_eq!(h.grant("b", &ask(10, 7), 0, TTL, false).held, 4);
        // Settled: free slots are granted again.
        h.grant("a", &ask(6, 2), TTL, TTL, true);
        assert_eq!(h.grant("new", &ask(10, 0), TTL, TTL, true).held, 4);
    }

    proptest! {
        #[test]
        fn the_limit_is_never_exceeded_and_no_one_loses_what_it_keeps(
            calls in prop::collection::vec(
                (0usize..4, 0u64..15, 0u64..15, 0u64..3_000, any::<bool>()), 1..200),
        ) {
            let mut h = Holdings::default();
            let names = ["a", "b", "c", "d"];
            let mut now = 0;
            for (who, wanted, keep, step, settled) in calls {
                now += step;
                let before = h
                    .entries
                    .iter()
                    .find(|e| e.instance == names[who] && e.expires_ms > now)
                    .map(|e| e.held);
                let g = h.grant(names[who], &ask(wanted, keep), now, TTL, settled);
                prop_assert!(h.total() <= 10, "{h:?}");
                if let Some(held) = before {
                    prop_assert!(g.held >= keep.min(held));
                }
                prop_assert!(g.held <= wanted.max(keep));
                prop_assert_eq!(g.free, 10 - h.total());
            }
        }
    }
}
