//! Requests paused for their body: how long they wait, and the bytes they keep together.

use super::Plugin;
use crate::lifecycle::host::Host;
use crate::stats::ProcessStat;

/// How long a request paused for its body waits for the first body callback before this worker
/// concludes that Envoy holds bodies back from paused requests.
pub(super) const BODY_WAIT_NS: u64 = 2_000_000_000;
/// How long a body may stop coming before its request is decided without it.
pub(super) const BODY_STALL_NS: u64 = 500_000_000;

/// A request paused for its body: since when, and when its last chunk came.
#[derive(Debug)]
pub(super) struct BodyWait {
    pub(super) since: u64,
    pub(super) last_chunk: Option<u64>,
}

impl<H: Host> Plugin<H> {
    /// Request `id` pauses on its headers for its body (Envoy).
    pub fn awaits_body(&self, id: u32, now: u64) {
        self.body_waits.borrow_mut().insert(
            id,
            BodyWait {
                since: now,
                last_chunk: None,
            },
        );
    }

    /// A chunk of the body request `id` waits for came.
    pub fn body_chunk(&self, id: u32, now: u64) {
        self.body_seen.set(true);
        if let Some(w) = self.body_waits.borrow_mut().get_mut(&id) {
            w.last_chunk = Some(now);
        }
    }

    /// Request `id` waits for its body no more (decided, or gone).
    pub fn body_done(&self, id: u32) {
        self.body_waits.borrow_mut().remove(&id);
    }

    /// Room for `n` more bytes of waiting bodies on this worker: taken if there is (true).
    pub fn keep_body_bytes(&self, n: usize) -> bool {
        let max = self.engine.borrow().config().max_waiting_body_bytes;
        let kept = self.body_bytes_kept.get().saturating_add(n);
        if kept > max {
            return false;
        }
        self.body_bytes_kept.set(kept);
        self.add(
            ProcessStat::BodyBytesKept,
            i64::try_from(n).unwrap_or(i64::MAX),
        );
        true
    }

    /// `n` bytes of a waiting body are kept no more.
    pub fn release_body_bytes(&self, n: usize) {
        if n == 0 {
            return;
        }
        self.body_bytes_kept
            .set(self.body_bytes_kept.get().saturating_sub(n));
        self.add(
            ProcessStat::BodyBytesKept,
            -i64::try_from(n).unwrap_or(i64::MAX),
        );
    }

    /// Requests paused for their body that must be decided without it, taken: those whose body
    /// stopped coming (Envoy stops reading a client whose held body fills its buffer limit), and
    /// — while no body callback ever came to this worker — those that got none in 2 s: Envoy holds
    /// bodies back from a request paused on its headers unless the filter's
    /// `allow_on_headers_stop_iteration` is set (the first time, an error says so).
    pub fn stale_body_waits(&self, now: u64) -> Vec<u32> {
        let timeout = self.engine.borrow().config().request_body_timeout_ns;
        let mut waits = self.body_waits.borrow_mut();
        let seen = self.body_seen.get();
        let stale: Vec<u32> = waits
            .iter()
            .filter(|(_, w)| {
                // However it comes: a body dripped a byte at a time never stalls.
                now.saturating_sub(w.since) >= timeout
                    || match w.last_chunk {
                        Some(last) => now.saturating_sub(last) >= BODY_STALL_NS,
                        None => !seen && now.saturating_sub(w.since) >= BODY_WAIT_NS,
                    }
            })
            .map(|(&id, _)| id)
            .collect();
        if stale.is_empty() {
            return stale;
        }
        for id in &stale {
            waits.remove(id);
        }
        if !seen && !self.body_warned.replace(true) {
            log::error!(
                "a rule reads the request body, but Envoy delivered none to a request paused \
                 for it for {} s: set \"allow_on_headers_stop_iteration\": true in the wasm \
                 filter's config (Envoy 1.35 or later); until then such requests are decided \
                 without their body (a cost from the body is its max, body: key parts the \
                 \"unreadable\" value) after that wait",
                BODY_WAIT_NS.min(timeout) as f64 / 1e9
            );
        }
        stale
    }
}
