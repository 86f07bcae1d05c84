//! One local key's state, for the status path, and an operator's reset of it: read from (and
//! written to) the key's slot as requests find it, through the same overrides.

use super::Engine;
use crate::config::{OverrideAction, Quota};
use tollgate_core::slot::{update_slot, Slot};
use tollgate_core::state::STATE_BYTES;
use tollgate_core::{CasStore, Decision, Limit};

/// A key's standing at its rule now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyState {
    /// An override exempts the key (`unlimited`) or refuses it (`block`).
    Override(&'static str),
    Limited {
        /// The key has a slot of its own (none: it is fresh, as good as new).
        found: bool,
        /// Requests of cost 1 it would admit now.
        available: u64,
        /// Until it admits again (0: it admits now), and until it is full again (ns).
        wait_ns: u64,
        full_in_ns: u64,
        debt: u64,
        /// Concurrency rules: requests in flight now.
        in_flight: Option<u64>,
    },
}

impl Engine {
    /// The quota `key` of rule `rule` is decided by, as `gather` finds it (overrides first);
    /// an override's action that has none; or why the key cannot be looked at here.
    fn quota_for(&self, rule: usize, key: &[u8]) -> Result<Result<&Quota, &'static str>, String> {
        let r = self.config.rules.get(rule).ok_or("no such rule")?;
        if r.global().is_some() {
            return Err(format!(
                "rule {:?} is global: its bucket is the quota service's (its admin API, \
                 docs/quota-api.md)",
                r.name
            ));
        }
        let Some(own) = r.quota() else {
            return Err(format!("rule {:?} keeps no state per key", r.name));
        };
        Ok(
            match r
                .overrides
                .iter()
                .find(|o| o.matches(key))
                .map(|o| &o.action)
            {
                None => Ok(own),
                Some(OverrideAction::Limit(q)) => Ok(q),
                Some(OverrideAction::Unlimited) => Err("unlimited"),
                Some(OverrideAction::Block) => Err("block"),
            },
        )
    }

    /// `change` the slot of `key` at `quota` (writing it if it says so), if the key has one.
    fn on_slot<S: CasStore + ?Sized, T>(
        &self,
        store: &S,
        quota: &Quota,
        key: &[u8],
        attempts: u32,
        change: impl FnMut(&mut Slot) -> (bool, T),
    ) -> Result<Option<T>, String> {
        let slot = quota.table.locate_hash(self.placement.hash(key));
        let group = quota.table.store_key(slot.group);
        update_slot(
            store,
            group.as_str(),
            attempts,
            |g| g.slots.iter().position(|s| s.tag == slot.tag),
            change,
        )
        .map_err(|e| format!("shared data: {e:?}"))
    }

    /// Key `key` of local rule `rule` at `now_ns`.
    pub fn key_state<S: CasStore + ?Sized>(
        &self,
        store: &S,
        rule: usize,
        key: &[u8],
        now_ns: u64,
    ) -> Result<KeyState, String> {
        let quota = match self.quota_for(rule, key)? {
            Ok(q) => q,
            Err(action) => return Ok(KeyState::Override(action)),
        };
        let state = self.on_slot(store, quota, key, 1, |s| (false, s.state))?;
        let found = state.is_some();
        let state = state.unwrap_or([0; STATE_BYTES]);
        let limit = &quota.limit;
        let (available, wait_ns, full_in_ns) = match limit.decide(&state, now_ns, 1) {
            Decision::Admit {
                remaining,
                reset_ns,
                ..
            } => (remaining.saturating_add(1), 0, reset_ns),
            Decision::Refuse {
                retry_after_ns,
                reset_ns,
                ..
            } => (0, retry_after_ns, reset_ns),
            _ => (0, 0, 0),
        };
        let in_flight = matches!(limit, Limit::Concurrency(_)).then(|| {
            let fresh = match limit.decide(&[0; STATE_BYTES], now_ns, 1) {
                Decision::Admit { remaining, .. } => remaining.saturating_add(1),
                _ => 0,
            };
            fresh.saturating_sub(available)
        });
        Ok(KeyState::Limited {
            found,
            available,
            wait_ns,
            full_in_ns,
            debt: limit.debt(&state, now_ns),
            in_flight,
        })
    }

    /// Start key `key` of local rule `rule` anew (full, nothing owed); false if it has no slot
    /// of its own (it is fresh already). Not a concurrency rule's: its count is requests in
    /// flight, which give their places back as they end.
    pub fn reset_key<S: CasStore + ?Sized>(
        &self,
        store: &S,
        rule: usize,
        key: &[u8],
    ) -> Result<bool, String> {
        let quota = match self.quota_for(rule, key)? {
            Ok(q) => q,
            Err(action) => return Err(format!("the key is {action} by an override")),
        };
        if matches!(quota.limit, Limit::Concurrency(_)) {
            return Err(
                "a concurrency rule counts requests in flight: they give their places back as \
                 they end, nothing to reset"
                    .into(),
            );
        }
        let reset = self.on_slot(store, quota, key, 8, |s| {
            s.state = [0; STATE_BYTES];
            (true, ())
        })?;
        Ok(reset.is_some())
    }
}
