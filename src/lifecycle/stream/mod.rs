//! An HTTP context: one request. It gathers the request's inputs through the host layer, asks
//! the engine, and carries out the answer: go on, a refusal, a hold, a wait, or a call of its
//! own; at the end of the stream it gives back what the request held.

mod request_body;
mod response;

use super::calls::Callers;
use super::holdings::Holdings;
use super::host::{Action, Host, HostRequest};
use super::plugin::Plugin;
use super::queues::Waiting;
use super::quota_call;
use crate::engine::{
    Admitted, Clock, Inputs, QuotaReport, ResponseSeen, Step, Strict, WAIT_GRACE_MS,
};
use crate::number::whole_number;
use crate::request::Request;
use crate::request_body::RequestBody;
use crate::usage::UsageReader;
use std::rc::Rc;
use tollgate_core::global::lease::LeaseRequest;

pub struct Stream<H: Host> {
    id: u32,
    plugin: Option<Rc<Plugin<H>>>,
    /// The quota to describe in the upstream's response headers.
    report: Option<QuotaReport>,
    /// What it holds until it ends, let go of once.
    holdings: Holdings,
    /// What the response showed of the cost its reservations settle.
    seen: ResponseSeen,
    /// Reads the response body for the usage or fields reservations settle by.
    body_reader: Option<UsageReader>,
    /// Set once the request was let through to the upstream (a response without it is ours).
    forwarded: bool,
    /// The decision waits for the request body (a rule that applies reads it), kept here as it
    /// comes (at most `max_request_body_bytes`), and how many bytes came.
    awaiting_body: bool,
    request_body: Vec<u8>,
    request_body_bytes: usize,
    /// The host handed over fewer body bytes than it said came: the body cannot be read.
    body_short: bool,
    ended: bool,
}

/// What a request let through keeps for its response: the rate-limit headers to add.
pub type KeptReport<H> = (Rc<Plugin<H>>, QuotaReport);

/// What a stream leaves to keep once a callback is done with it ([`Stream::left_after`]).
pub enum Left<H: Host> {
    Nothing,
    Report(KeptReport<H>),
    Stream,
}

impl<H: Host> Stream<H> {
    pub fn new(id: u32, plugin: Option<Rc<Plugin<H>>>) -> Self {
        Self {
            id,
            plugin,
            report: None,
            holdings: Holdings::default(),
            seen: ResponseSeen::default(),
            body_reader: None,
            forwarded: false,
            awaiting_body: false,
            request_body: Vec::new(),
            request_body_bytes: 0,
            body_short: false,
            ended: false,
        }
    }

    /// `end_of_stream`: no body follows (where the host knows).
    pub fn on_request_headers(&mut self, callers: &Callers, end_of_stream: bool) -> Action {
        let Some(plugin) = self.plugin.clone() else {
            return Action::Continue;
        };
        if plugin.engine.borrow().config().reads_request_body
            && body_follows(&plugin, end_of_stream)
        {
            let view = HostRequest {
                host: &plugin.host,
                caps: plugin.caps,
            };
            let trusted_hops = plugin.engine.borrow().config().client_ip;
            if plugin
                .engine
                .borrow()
                .reads_body(&Request::new(&view, trusted_hops))
            {
                // nginx calls no body callback for an empty chunked body: without a length, the
                // request is decided now, as one whose body cannot be read (the worst case).
                if !plugin.caps.request_end_known && !length_given(&plugin) {
                    return self.decide_as_unread(&plugin, callers);
                }
                self.awaiting_body = true;
                // Envoy would forward the headers unless paused; nginx reads the body before
                // its content handler forwards anything, and a pause here would never end.
                if !plugin.caps.request_end_known {
                    return Action::Continue;
                }
                plugin.awaits_body(self.id, plugin.host.now_ns().unwrap_or(0));
                return Action::Pause;
            }
        }
        self.decide(plugin, callers, None)
    }

    /// It went on, and nothing is held, reserved or seated, no body to read, keep or pace (its
    /// rate-limit headers aside).
    fn holds_nothing(&self) -> bool {
        self.forwarded
            && !self.ended
            && self.holdings.is_empty()
            && self.body_reader.is_none()
            && !self.awaiting_body
            && self.request_body.is_empty()
    }

    /// What is left of it once a callback answered `action`: nothing, only its quota's headers to
    /// add to the response (its plugin and report, kept without the stream), or the stream itself.
    pub fn left_after(&self, action: Action) -> Left<H> {
        if action != Action::Continue || !self.holds_nothing() {
            return Left::Stream;
        }
        match (self.report, &self.plugin) {
            (None, _) => Left::Nothing,
            (Some(report), Some(plugin)) => Left::Report((plugin.clone(), report)),
            (Some(_), None) => Left::Stream,
        }
    }

    /// Still paused by its decision: refused, waiting for quota or held.
    fn still_paused(&mut self, plugin: &Plugin<H>) -> bool {
        self.take_resumed();
        !self.forwarded || plugin.queues.borrow().held_until(self.id).is_some()
    }

    /// Decide the request (with its body, where a rule reads it) and carry out the answer.
    fn decide(
        &mut self,
        plugin: Rc<Plugin<H>>,
        callers: &Callers,
        body: Option<&RequestBody>,
    ) -> Action {
        let view = HostRequest {
            host: &plugin.host,
            caps: plugin.caps,
        };
        let trusted_hops = plugin.engine.borrow().config().client_ip;
        let request = Request::new(&view, trusted_hops).with_body(body);
        if let Some(answered) = super::status::serve(&plugin, &request) {
            return answered;
        }
        self.holdings.pacers = plugin.engine.borrow().pacers(&request);
        let read = || plugin.host.now_ns();
        let mut clock = Clock::new(&read);
        let mut inputs = Inputs::new();
        let step = plugin.engine.borrow_mut().decide(
            &plugin.host,
            &request,
            &mut clock,
            &mut self.holdings.seats,
            &mut inputs,
        );
        match step {
            Step::Pass => {
                self.forwarded = true;
                Action::Continue
            }
            Step::Wait => {
                let now = clock.now().unwrap_or(0);
                self.wait(&plugin, callers, inputs, now)
            }
            Step::Call(strict) => {
                let now = clock.now().unwrap_or(0);
                self.call_own(&plugin, callers, strict, now)
            }
            // (A refusal needs no time: a request blocked before any was read asks for none.)
            Step::Refuse(_) => self.carry_out(&plugin, step, 0, false),
            Step::Admit(_) => {
                let now = clock.now().unwrap_or(0);
                self.carry_out(&plugin, step, now, false)
            }
        }
    }

    /// Some global rule has no quota yet. Where the host can resume the request from the timer,
    /// it waits in the plugin's list, decided again on every tick; elsewhere it asks the quota
    /// service for its own tokens, so that the answer comes back to this context.
    fn wait(&mut self, plugin: &Plugin<H>, callers: &Callers, inputs: Inputs, now: u64) -> Action {
        plugin.engine.borrow_mut().waits(&inputs);
        if !plugin.caps.resume_from_timer {
            let strict = plugin.engine.borrow().split(inputs, now);
            return self.call_own(plugin, callers, Box::new(strict), now);
        }
        let timeout_ms = plugin
            .engine
            .borrow()
            .config()
            .quota_service
            .as_ref()
            .map_or(200, |q| q.timeout_ms);
        plugin.queues.borrow_mut().wait(Waiting {
            context_id: self.id,
            deadline_ms: now / 1_000_000 + timeout_ms + WAIT_GRACE_MS,
            inputs,
        });
        Action::Pause
    }

    /// Ask the quota service for this request's global checks; the request waits for the answer.
    /// Within `retry` of a failed call, or when the service refused each of its keys less than
    /// `retry` ago, the failure mode decides at once instead.
    fn call_own(
        &mut self,
        plugin: &Plugin<H>,
        callers: &Callers,
        strict: Box<Strict>,
        now: u64,
    ) -> Action {
        if !plugin.engine.borrow().needs_call(&strict, now) {
            let step = plugin
                .engine
                .borrow_mut()
                .finish_strict(&plugin.host, *strict, None, now);
            return self.carry_out(plugin, step, now, false);
        }
        let request = LeaseRequest {
            instance: plugin.instance.clone(),
            items: plugin.engine.borrow().strict_items(&strict),
        };
        match plugin.call(&request) {
            Some(token) => {
                callers.register(token, self.id);
                self.holdings.own_call = Some((token, strict));
                Action::Pause
            }
            None => {
                let step =
                    plugin
                        .engine
                        .borrow_mut()
                        .finish_strict(&plugin.host, *strict, None, now);
                self.carry_out(plugin, step, now, false)
            }
        }
    }

    /// The answer to this request's own call.
    pub fn on_call_response(&mut self, token: u32, num_headers: usize, body_size: usize) {
        let ours = self
            .holdings
            .own_call
            .as_ref()
            .is_some_and(|(t, _)| *t == token);
        let (Some(plugin), true) = (self.plugin.clone(), ours) else {
            return;
        };
        let Some((_, strict)) = self.holdings.own_call.take() else {
            return;
        };
        let answer = quota_call::answer(&plugin.host, num_headers, body_size, strict.globals.len());
        let now = plugin.host.now_ns().unwrap_or(0);
        let step =
            plugin
                .engine
                .borrow_mut()
                .finish_strict(&plugin.host, *strict, answer.as_ref(), now);
        if step == Step::Wait {
            // The remaining checks hold no leased allowance: nothing to wait for.
            self.forwarded = true;
            let _ = plugin.host.continue_request();
            return;
        }
        self.carry_out(&plugin, step, now, true);
    }

    /// Carry out this request's decision (see [`Plugin::carry_out`]); resume it if it was
    /// `paused` and may go on.
    fn carry_out(&mut self, plugin: &Plugin<H>, step: Step, now: u64, paused: bool) -> Action {
        match step {
            Step::Refuse(_) => self.holdings.give_up_seats(plugin),
            Step::Pass => self.forwarded = true,
            _ => {}
        }
        let id = self.id;
        plugin.carry_out(id, step, now, paused, |a, held_until| {
            self.keep(a, held_until)
        })
    }

    /// Take on what an admitted request holds until it ends.
    fn keep(&mut self, a: Admitted, held_until: Option<u64>) {
        self.forwarded = true;
        self.report = a.report;
        // (Most requests hold and reserve nothing: no iterator over empty vectors.)
        if !a.holds.is_empty() {
            self.holdings.holds.extend(a.holds);
        }
        if !a.reservations.is_empty() {
            self.holdings.reservations.extend(a.reservations);
        }
        if held_until.is_some() {
            self.holdings.held_until = held_until;
        }
    }

    /// Take over what a decision made on the tick left for this request.
    fn take_resumed(&mut self) {
        let Some(plugin) = &self.plugin else {
            return;
        };
        let resumed = plugin.queues.borrow_mut().take_resumed(self.id);
        if let Some((a, held_until)) = resumed {
            self.keep(a, held_until);
        }
    }

    /// Give back held quota and leave the queues: however the stream ended, exactly once.
    pub fn end_of_stream(&mut self, callers: &Callers) {
        if std::mem::replace(&mut self.ended, true) {
            return;
        }
        let Some(plugin) = self.plugin.clone() else {
            return;
        };
        self.take_resumed();
        if self.awaiting_body {
            plugin.body_done(self.id);
        }
        // (A client gone while its body was kept: the worker's room for waiting bodies is back.)
        drop(self.let_go_of_body(&plugin));
        self.finish_reading();
        std::mem::take(&mut self.holdings).release(&plugin, self.id, callers, &self.seen);
    }
}

/// A body follows the request's headers: as the host says, or where it cannot say (nginx), as
/// the headers announce (a `content-length` above 0, or a `transfer-encoding`).
fn body_follows<H: Host>(plugin: &Plugin<H>, end_of_stream: bool) -> bool {
    if plugin.caps.request_end_known {
        return !end_of_stream;
    }
    length_given(plugin) || plugin.host.request_header("transfer-encoding").is_some()
}

/// The request states a body of at least one byte (`content-length`).
fn length_given<H: Host>(plugin: &Plugin<H>) -> bool {
    let length = plugin.host.request_header("content-length");
    length.is_some_and(|l| whole_number(&l).is_some_and(|n| n > 0))
}
