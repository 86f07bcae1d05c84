//! A request whose decision waits for its body (a rule reads it), and its upload paced by byte
//! limits.

use super::super::calls::Callers;
use super::super::host::{Action, Host};
use super::super::plugin::Plugin;
use super::Stream;
use crate::config::PaceBody;
use crate::request_body::RequestBody;
use crate::stats::ProcessStat;
use log::debug;
use std::rc::Rc;

impl<H: Host> Stream<H> {
    /// `size` more bytes of the request body (`end`: the last have come). A decision that waits
    /// for the body is made once it ended or the configured bytes came; until then it is kept
    /// back. Once decided, the body goes on as byte limits allow.
    pub fn on_request_body(&mut self, callers: &Callers, size: usize, end: bool) -> Action {
        let Some(plugin) = self.plugin.clone() else {
            return Action::Continue;
        };
        if !self.awaiting_body {
            // Decided already (on the headers or an earlier chunk): the body follows unless the
            // request is still paused by that decision (Envoy calls this while a request paused
            // on its headers waits, when `allow_on_headers_stop_iteration` is set), or paced.
            // (A request let through and not held needs no look at the queues.)
            let going = (self.forwarded && self.holdings.held_until.is_none())
                || !self.still_paused(&plugin);
            return if going {
                self.pace_upload(&plugin, size)
            } else {
                hold_body(&plugin)
            };
        }
        let now = plugin.host.now_ns().unwrap_or(0);
        plugin.body_chunk(self.id, now);
        // ngx_wasm_module hands over the whole body at once.
        let end = end || !plugin.caps.request_end_known;
        // Kept here, chunk by chunk, up to the configured bytes: the host holds the body back
        // under flow control meanwhile (Envoy: each callback hands over the new chunk alone, and a
        // body larger than its buffer limit stops the client's upload instead of failing it;
        // nginx: one callback with all of it).
        let max = plugin.engine.borrow().config().max_request_body_bytes;
        let room = max.saturating_sub(self.request_body.len());
        self.request_body_bytes = self.request_body_bytes.saturating_add(size);
        let take = size.min(room);
        if take > 0 {
            // The worker's waiting bodies keep no more: this one is decided now, unread, and
            // what it kept is let go (a flood of slow uploads costs a bounded memory).
            if !plugin.keep_body_bytes(take) {
                let action = self
                    .decide_unread(&plugin, callers)
                    .unwrap_or(Action::Continue);
                return self.after_body_decision(&plugin, action);
            }
            let before = self.request_body.len();
            if let Some(chunk) = plugin.host.request_body(take) {
                self.request_body.extend_from_slice(&chunk);
            }
            let got = self.request_body.len() - before;
            // Fewer bytes than the host said came: nginx spooled the body to a file
            // (`client_body_buffer_size`), where the filter cannot read it.
            self.body_short |= got < take;
            plugin.release_body_bytes(take.saturating_sub(got));
        }
        if !end && self.request_body_bytes < max {
            return hold_body(&plugin);
        }
        self.awaiting_body = false;
        plugin.body_done(self.id);
        let cut = !end || self.request_body_bytes > max || self.body_short;
        if cut {
            plugin.add(ProcessStat::BodiesUnread, 1);
        }
        let kept = self.let_go_of_body(&plugin);
        let total = self.request_body_bytes;
        let body = RequestBody::read(&kept, u64::try_from(total).unwrap_or(u64::MAX), cut);
        drop(kept);
        let action = self.decide(plugin.clone(), callers, Some(&body));
        self.after_body_decision(&plugin, action)
    }

    /// Carry out a decision made on the body (read or not): what was held for it goes on as the
    /// byte limits allow; a request still waiting keeps its body under flow control.
    pub(super) fn after_body_decision(&mut self, plugin: &Plugin<H>, action: Action) -> Action {
        match action {
            Action::Continue => self.pace_upload(plugin, self.request_body_bytes),
            Action::Pause => hold_body(plugin),
            other => other,
        }
    }

    /// The body kept for the decision, taken, and its bytes no longer counted as kept.
    pub(super) fn let_go_of_body(&mut self, plugin: &Plugin<H>) -> Vec<u8> {
        let kept = std::mem::take(&mut self.request_body);
        plugin.release_body_bytes(kept.len());
        kept
    }

    /// `size` bytes of the request body are about to go on: paced by byte limits of uploads.
    pub(super) fn pace_upload(&mut self, plugin: &Plugin<H>, size: usize) -> Action {
        if !self
            .holdings
            .pacers
            .iter()
            .any(|p| p.body == PaceBody::Request)
        {
            return Action::Continue;
        }
        self.pace(plugin, PaceBody::Request, size)
    }

    /// This request's body does not come, or stopped coming (see [`Plugin::stale_body_waits`]):
    /// decide it as one whose body was too large to read, and resume it if it may go on.
    pub fn decide_without_body(&mut self, callers: &Callers) {
        let Some(plugin) = self.plugin.clone() else {
            return;
        };
        if self.decide_unread(&plugin, callers) == Some(Action::Continue) {
            if let Err(s) = plugin.host.continue_request() {
                debug!("cannot resume request {}: {s}", self.id);
            }
        }
    }

    /// The request's trailers: its body ended without a last body callback (Envoy), so a
    /// decision that waits for the body is made now, without reading it.
    pub fn on_request_trailers(&mut self, callers: &Callers) -> Action {
        let Some(plugin) = self.plugin.clone() else {
            return Action::Continue;
        };
        if let Some(action) = self.decide_unread(&plugin, callers) {
            return action;
        }
        if self.still_paused(&plugin) {
            Action::Pause
        } else {
            Action::Continue
        }
    }

    /// Decide a request that waits for its body as one whose body was too long to read (a cost
    /// from the body is its `max`); `None` if it was not waiting.
    pub(super) fn decide_unread(
        &mut self,
        plugin: &Rc<Plugin<H>>,
        callers: &Callers,
    ) -> Option<Action> {
        if !std::mem::replace(&mut self.awaiting_body, false) {
            return None;
        }
        plugin.body_done(self.id);
        drop(self.let_go_of_body(plugin));
        Some(self.decide_as_unread(plugin, callers))
    }

    /// Decide the request as one whose body cannot be read (the worst case: a cost from the body
    /// is its `max`, `body:` parts are "unreadable").
    pub(super) fn decide_as_unread(&mut self, plugin: &Rc<Plugin<H>>, callers: &Callers) -> Action {
        plugin.add(ProcessStat::BodiesUnread, 1);
        let total = u64::try_from(self.request_body_bytes).unwrap_or(u64::MAX);
        let body = RequestBody::read(&[], total, true);
        self.decide(plugin.clone(), callers, Some(&body))
    }
}

/// Keep a request's body back: under flow control where the host has it (Envoy: a body larger
/// than its buffer limit then stops the client instead of failing the request), else paused.
fn hold_body<H: Host>(plugin: &Plugin<H>) -> Action {
    if plugin.caps.request_end_known {
        Action::HoldBody
    } else {
        Action::Pause
    }
}
