//! One configuration's paused requests in one worker: held by leaky buckets until due, waiting
//! for global quota, decided on the tick and not yet picked up by their context; and its lease
//! calls in flight. Host-independent: the callbacks resume what these say.

use crate::config::PaceBody;
use crate::engine::{Admitted, Inputs, Refill};
use crate::stats::ProcessStat;
use rustc_hash::FxHashMap;
use std::collections::BTreeSet;

/// A request waiting for a global rule's quota, decided again on every tick.
#[derive(Debug)]
pub struct Waiting {
    pub context_id: u32,
    pub deadline_ms: u64,
    pub inputs: Inputs,
}

#[derive(Debug, Default)]
pub struct Queues {
    /// (due time ns, context id) of requests held by leaky buckets.
    held: BTreeSet<(u64, u32)>,
    waiting: Vec<Waiting>,
    /// Decisions made on the tick for paused requests, picked up by their contexts.
    /// With when a leaky bucket holds them until, if it does.
    resumed: FxHashMap<u32, (Admitted, Option<u64>)>,
    /// Refills sent and not answered yet, by call token, and whether the call was for slots.
    in_flight: FxHashMap<u32, (bool, Vec<Refill>)>,
    /// (due time ns, context id, which body) of bodies held by byte limits.
    bodies: BTreeSet<(u64, u32, PaceBody)>,
    /// What the gauges of held requests, waiting requests and held bodies were last told of
    /// these queues (the gauges are process-wide: each queue adds its own changes).
    reported: [usize; 3],
}

/// The process-wide gauges that count what these queues hold, in the order of `reported`.
const GAUGES: [ProcessStat; 3] = [
    ProcessStat::QueueHeld,
    ProcessStat::QuotaWaiting,
    ProcessStat::BodiesHeld,
];

impl Queues {
    /// How the gauges of what these queues hold changed since the last call: the queues are
    /// the only count, so no hold or release anywhere moves a gauge by hand.
    pub fn gauge_changes(&mut self) -> impl Iterator<Item = (ProcessStat, i64)> {
        let now = [self.held.len(), self.waiting.len(), self.bodies.len()];
        let before = std::mem::replace(&mut self.reported, now);
        GAUGES
            .into_iter()
            .zip(now.into_iter().zip(before))
            .filter(|(_, (n, b))| n != b)
            .map(|(g, (n, b))| (g, n as i64 - b as i64))
    }

    pub fn hold(&mut self, due_ns: u64, context_id: u32) {
        self.held.insert((due_ns, context_id));
    }

    /// Take out the held requests due by `now_ns`, earliest first.
    pub fn due(&mut self, now_ns: u64) -> Vec<u32> {
        let mut due = Vec::new();
        while let Some(&(at, id)) = self.held.first() {
            if at > now_ns {
                break;
            }
            self.held.pop_first();
            due.push(id);
        }
        due
    }

    /// Take a request out of the held queue (its client went away); false if it was not there.
    pub fn unhold(&mut self, due_ns: u64, context_id: u32) -> bool {
        self.held.remove(&(due_ns, context_id))
    }

    /// When a held request is due, if it is held.
    pub fn held_until(&self, context_id: u32) -> Option<u64> {
        self.held
            .iter()
            .find(|(_, id)| *id == context_id)
            .map(|(due, _)| *due)
    }

    /// Hold a request's `body` until `due_ns`, in place of its hold until `held` (if any).
    pub fn hold_body(&mut self, held: Option<u64>, due_ns: u64, context_id: u32, body: PaceBody) {
        if let Some(at) = held {
            self.bodies.remove(&(at, context_id, body));
        }
        self.bodies.insert((due_ns, context_id, body));
    }

    /// Whether a request's `body` is still held until `due_ns` (the tick has not let it go).
    pub fn body_held(&self, due_ns: u64, context_id: u32, body: PaceBody) -> bool {
        self.bodies.contains(&(due_ns, context_id, body))
    }

    /// Take out the bodies due by `now_ns`, earliest first.
    pub fn bodies_due(&mut self, now_ns: u64) -> Vec<(u32, PaceBody)> {
        let mut due = Vec::new();
        while let Some(&(at, id, body)) = self.bodies.first() {
            if at > now_ns {
                break;
            }
            self.bodies.pop_first();
            due.push((id, body));
        }
        due
    }

    /// Take a request's body held until `due_ns` out (it ended); false if it was not held.
    pub fn unhold_body(&mut self, due_ns: u64, context_id: u32, body: PaceBody) -> bool {
        self.bodies.remove(&(due_ns, context_id, body))
    }

    pub fn wait(&mut self, waiting: Waiting) {
        self.waiting.push(waiting);
    }

    /// Every waiting request, to decide again; those still waiting go back with [`Self::wait`].
    pub fn take_waiting(&mut self) -> Vec<Waiting> {
        std::mem::take(&mut self.waiting)
    }

    /// Take a request out of the waiting list; false if it was not there.
    pub fn leave_waiting(&mut self, context_id: u32) -> bool {
        let before = self.waiting.len();
        self.waiting.retain(|w| w.context_id != context_id);
        before != self.waiting.len()
    }

    pub fn resumed(&mut self, context_id: u32, admitted: Admitted, held_until: Option<u64>) {
        self.resumed.insert(context_id, (admitted, held_until));
    }

    /// What the tick decided for this paused request, if anything.
    pub fn take_resumed(&mut self, context_id: u32) -> Option<(Admitted, Option<u64>)> {
        // Most requests were never paused: skip hashing their id into an empty map.
        if self.resumed.is_empty() {
            return None;
        }
        self.resumed.remove(&context_id)
    }

    pub fn call_sent(&mut self, token: u32, slots: bool, refills: Vec<Refill>) {
        self.in_flight.insert(token, (slots, refills));
    }

    pub fn is_sent(&self, token: u32) -> bool {
        self.in_flight.contains_key(&token)
    }

    /// The refills a call was for (and whether it was for slots), if it is one of ours.
    pub fn call_answered(&mut self, token: u32) -> Option<(bool, Vec<Refill>)> {
        self.in_flight.remove(&token)
    }

    /// Everything paused, for a configuration that goes away: held request ids and waiting ones.
    pub fn drain(&mut self) -> (Vec<u32>, Vec<Waiting>) {
        let held = std::mem::take(&mut self.held);
        (
            held.into_iter().map(|(_, id)| id).collect(),
            self.take_waiting(),
        )
    }

    /// Every held body, for a configuration that goes away.
    pub fn drain_bodies(&mut self) -> Vec<(u32, PaceBody)> {
        std::mem::take(&mut self.bodies)
            .into_iter()
            .map(|(_, id, body)| (id, body))
            .collect()
    }

    #[cfg(test)]
    pub fn held_count(&self) -> usize {
        self.held.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_requests_come_out_when_due_or_when_they_leave() {
        let mut q = Queues::default();
        q.hold(30, 3);
        q.hold(10, 1);
        q.hold(20, 2);
        assert_eq!(q.held_until(2), Some(20));
        assert!(q.unhold(20, 2));
        assert!(!q.unhold(20, 2));
        assert_eq!(q.due(5), Vec::<u32>::new());
        assert_eq!(q.due(30), [1, 3]);
        assert_eq!(q.held_count(), 0);
    }

    #[test]
    fn waiting_resumed_and_calls() {
        let mut q = Queues::default();
        for id in [1, 2] {
            q.wait(Waiting {
                context_id: id,
                deadline_ms: 5,
                inputs: Inputs::new(),
            });
        }
        assert!(q.leave_waiting(1));
        assert!(!q.leave_waiting(1));
        let w = q.take_waiting();
        assert_eq!(w.len(), 1);
        assert!(q.take_waiting().is_empty());
        assert_eq!(q.take_resumed(2), None);
        q.resumed(2, Admitted::default(), Some(7));
        assert_eq!(q.take_resumed(2), Some((Admitted::default(), Some(7))));
        q.call_sent(9, true, Vec::new());
        assert_eq!(q.call_answered(9), Some((true, Vec::new())));
        assert_eq!(q.call_answered(9), None);
        q.hold(1, 7);
        q.wait(Waiting {
            context_id: 8,
            deadline_ms: 5,
            inputs: Inputs::new(),
        });
        let (held, waiting) = q.drain();
        assert_eq!((held, waiting.len()), (vec![7], 1));
    }
}
