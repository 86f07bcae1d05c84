//! What a request holds while it lives — quota of concurrency rules, reservations to settle,
//! seats in overload rules, its place in the queues, its own call to the quota service, bodies
//! held by byte limits — let go of once, however its stream ends.

use super::calls::Callers;
use super::host::Host;
use super::plugin::Plugin;
use crate::config::PaceBody;
use crate::engine::{Holds, Pacers, Reservations, ResponseSeen, Seats, Strict};

#[derive(Default)]
pub struct Holdings {
    /// Quota held until the stream ends (concurrency rules).
    pub holds: Holds,
    /// What it reserved of rules that settle after the response.
    pub reservations: Reservations,
    /// What it holds of overload rules while in flight.
    pub seats: Seats,
    /// Set while the request is held by a leaky bucket.
    pub held_until: Option<u64>,
    /// The call this request waits for, with its checks (boxed: a request that calls is rare,
    /// and every stream carries this).
    pub own_call: Option<(u32, Box<Strict>)>,
    /// Byte limits that pace its bodies, and until when each body was last held (request,
    /// response).
    pub pacers: Pacers,
    pub body_holds: [Option<u64>; 2],
    /// Per body, the bytes charged to byte limits while it is held, not passed on yet: given
    /// back if the stream ends before they are.
    pub unpassed: [u64; 2],
}

/// Where a stream keeps its hold of `body`.
pub fn hold_index(body: PaceBody) -> usize {
    match body {
        PaceBody::Request => 0,
        PaceBody::Response => 1,
    }
}

impl Holdings {
    /// Nothing held, reserved, seated, queued, called or paced.
    pub fn is_empty(&self) -> bool {
        self.holds.is_empty()
            && self.reservations.is_empty()
            && self.seats.is_empty()
            && self.held_until.is_none()
            && self.own_call.is_none()
            && self.pacers.is_empty()
            && self.body_holds.iter().all(Option::is_none)
    }

    /// Give the seats in overload rules back (the request was refused, or it ended).
    pub fn give_up_seats<H: Host>(&mut self, plugin: &Plugin<H>) {
        if self.seats.is_empty() {
            return;
        }
        let now = plugin.host.now_ns().unwrap_or(0);
        let seats = std::mem::take(&mut self.seats);
        plugin.engine.borrow_mut().abandon(&plugin.host, seats, now);
    }

    /// Settle the reservations with what the response showed (`seen`), once.
    pub fn settle<H: Host>(&mut self, plugin: &Plugin<H>, seen: &ResponseSeen) {
        if self.reservations.is_empty() {
            return;
        }
        let reservations = std::mem::take(&mut self.reservations);
        let now = plugin.host.now_ns().unwrap_or(0);
        plugin
            .engine
            .borrow_mut()
            .settle_costs(&plugin.host, reservations, seen, now);
    }

    /// Let go of everything, as the stream of request `id` ends (taken: it cannot be let go of
    /// twice). Bodies still held give back the bytes charged for them that never left; the
    /// request leaves the queues it is in and forgets its call; its seats, its reservations
    /// (settled by `seen`) and its holds go back.
    pub fn release<H: Host>(
        mut self,
        plugin: &Plugin<H>,
        id: u32,
        callers: &Callers,
        seen: &ResponseSeen,
    ) {
        for body in [PaceBody::Request, PaceBody::Response] {
            let Some(at) = self.body_holds[hold_index(body)] else {
                continue;
            };
            // Still queued means the client went away while its body was held.
            if plugin.queues.borrow_mut().unhold_body(at, id, body) {
                let unpassed = self.unpassed[hold_index(body)];
                let now = plugin.host.now_ns().unwrap_or(0);
                plugin
                    .engine
                    .borrow_mut()
                    .unpace(&plugin.host, &self.pacers, body, unpassed, now);
            }
        }
        if let Some(due) = self.held_until {
            // (Still queued: the client went away while held.)
            plugin.queues.borrow_mut().unhold(due, id);
        }
        plugin.queues.borrow_mut().leave_waiting(id);
        if let Some((token, _)) = self.own_call {
            callers.forget(token);
        }
        self.give_up_seats(plugin);
        self.settle(plugin, seen);
        if !self.holds.is_empty() {
            let now = plugin.host.now_ns().unwrap_or(0);
            plugin
                .engine
                .borrow_mut()
                .release(&plugin.host, self.holds, now);
        }
    }
}
