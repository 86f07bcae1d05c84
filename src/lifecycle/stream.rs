//! An HTTP context: one request. It gathers the request's inputs through the host layer, asks
//! the engine, and carries out the answer: go on, a refusal, a hold, a wait, or a call of its
//! own; at the end of the stream it gives back what the request held.

use super::calls::Callers;
use super::holdings::{hold_index, Holdings};
use super::host::{Action, Host, HostRequest};
use super::plugin::Plugin;
use super::queues::Waiting;
use super::quota_call;
use crate::config::PaceBody;
use crate::engine::{Clock, Inputs, QuotaReport, ResponseSeen, Step, Strict, WAIT_GRACE_MS};
use crate::number::whole_number;
use crate::request::Request;
use crate::request_body::RequestBody;
use crate::stats::ProcessStat;
use crate::usage::UsageReader;
use log::debug;
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
    fn after_body_decision(&mut self, plugin: &Plugin<H>, action: Action) -> Action {
        match action {
            Action::Continue => self.pace_upload(plugin, self.request_body_bytes),
            Action::Pause => hold_body(plugin),
            other => other,
        }
    }

    /// The body kept for the decision, taken, and its bytes no longer counted as kept.
    fn let_go_of_body(&mut self, plugin: &Plugin<H>) -> Vec<u8> {
        let kept = std::mem::take(&mut self.request_body);
        plugin.release_body_bytes(kept.len());
        kept
    }

    /// `size` bytes of the request body are about to go on: paced by byte limits of uploads.
    fn pace_upload(&mut self, plugin: &Plugin<H>, size: usize) -> Action {
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
    fn decide_unread(&mut self, plugin: &Rc<Plugin<H>>, callers: &Callers) -> Option<Action> {
        if !std::mem::replace(&mut self.awaiting_body, false) {
            return None;
        }
        plugin.body_done(self.id);
        drop(self.let_go_of_body(plugin));
        Some(self.decide_as_unread(plugin, callers))
    }

    /// Decide the request as one whose body cannot be read (the worst case: a cost from the body
    /// is its `max`, `body:` parts are "unreadable").
    fn decide_as_unread(&mut self, plugin: &Rc<Plugin<H>>, callers: &Callers) -> Action {
        plugin.add(ProcessStat::BodiesUnread, 1);
        let total = u64::try_from(self.request_body_bytes).unwrap_or(u64::MAX);
        let body = RequestBody::read(&[], total, true);
        self.decide(plugin.clone(), callers, Some(&body))
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
                self.call_own(&plugin, callers, *strict, now)
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
            return self.call_own(plugin, callers, strict, now);
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
        strict: Strict,
        now: u64,
    ) -> Action {
        if !plugin.engine.borrow().needs_call(&strict, now) {
            let step = plugin
                .engine
                .borrow_mut()
                .finish_strict(&plugin.host, strict, None, now);
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
                        .finish_strict(&plugin.host, strict, None, now);
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
                .finish_strict(&plugin.host, strict, answer.as_ref(), now);
        if step == Step::Wait {
            // The remaining checks hold no leased allowance: nothing to wait for.
            self.forwarded = true;
            let _ = plugin.host.continue_request();
            return;
        }
        self.carry_out(&plugin, step, now, true);
    }

    /// Admit (with its headers, holds and any leaky-bucket hold) or refuse the request; resume
    /// it if it was `paused` and may go on.
    fn carry_out(&mut self, plugin: &Plugin<H>, step: Step, now: u64, paused: bool) -> Action {
        match step {
            Step::Admit(a) => {
                self.forwarded = true;
                self.report = a.report;
                self.holdings.holds.extend(a.holds);
                self.holdings.reservations.extend(a.reservations);
                // The configuration was checked against the host: only hosts that can resume
                // from the timer get delays.
                if a.delay_ns > 0 && plugin.caps.resume_from_timer {
                    let due = now.saturating_add(a.delay_ns);
                    plugin.queues.borrow_mut().hold(due, self.id);
                    self.holdings.held_until = Some(due);
                    return Action::Pause;
                }
                if paused {
                    if let Err(s) = plugin.host.continue_request() {
                        debug!("cannot resume request {}: {s}", self.id);
                    }
                }
                Action::Continue
            }
            Step::Refuse(r) => {
                self.give_up_seats(plugin);
                plugin.refuse(&r);
                Action::Pause
            }
            // (Decided whole by `Stream::decide`, never here: a request that waits stays paused.)
            Step::Wait | Step::Call(_) => Action::Pause,
            Step::Pass => {
                self.forwarded = true;
                if paused {
                    let _ = plugin.host.continue_request();
                }
                Action::Continue
            }
        }
    }

    pub fn on_response_headers(&mut self) -> Action {
        self.take_resumed();
        let Some(plugin) = self.plugin.clone() else {
            return Action::Continue;
        };
        if let Some(report) = self.report.take() {
            plugin.add_quota_headers(report);
        }
        // The status, read once, for whichever needs it.
        let learns = !self.holdings.seats.is_empty() && self.forwarded;
        let status = (learns || !self.holdings.reservations.is_empty())
            .then(|| {
                let status = plugin.host.response_header(":status")?;
                std::str::from_utf8(&status).ok()?.trim().parse().ok()
            })
            .flatten();
        if !self.holdings.reservations.is_empty() {
            self.note_response(&plugin, status);
        }
        if !self.holdings.seats.is_empty() {
            self.learn(&plugin, status);
        }
        Action::Continue
    }

    /// The upstream answered with `status` (or, if the request was never let through, this
    /// filter did): the overload rules learn from the answer.
    fn learn(&mut self, plugin: &Plugin<H>, status: Option<u32>) {
        if !self.forwarded {
            self.give_up_seats(plugin);
            return;
        }
        let now = plugin.host.now_ns().unwrap_or(0);
        let seats = std::mem::take(&mut self.holdings.seats);
        plugin
            .engine
            .borrow_mut()
            .answered(&plugin.host, seats, now, status, |name| {
                plugin.host.response_header(name)
            });
    }

    /// Leave the overload rules' seats without an answer to learn from.
    fn give_up_seats(&mut self, plugin: &Plugin<H>) {
        self.holdings.give_up_seats(plugin);
    }

    /// Take over what a decision made on the tick left for this request.
    fn take_resumed(&mut self) {
        let Some(plugin) = &self.plugin else {
            return;
        };
        let mut queues = plugin.queues.borrow_mut();
        if let Some(a) = queues.take_resumed(self.id) {
            self.forwarded = true;
            self.report = a.report;
            self.holdings.holds.extend(a.holds);
            self.holdings.reservations.extend(a.reservations);
            if a.delay_ns > 0 {
                // Its hold was queued by the tick.
                self.holdings.held_until = queues.held_until(self.id);
            }
        }
    }

    /// What the response's headers (its `status` among them) say of the cost its reservations
    /// settle.
    fn note_response(&mut self, plugin: &Plugin<H>, status: Option<u32>) {
        self.seen.status = status;
        let engine = plugin.engine.borrow();
        self.seen.headers = self
            .holdings
            .reservations
            .iter()
            .map(|r| {
                let value = plugin.host.response_header(engine.settle_header(r)?)?;
                // Beyond 64 bits saturates: a charge however large is a defined debt.
                whole_number(&value)
            })
            .collect();
        if let Some(reading) = engine.body_reading(&self.holdings.reservations) {
            let content_type = plugin.host.response_header("content-type");
            self.body_reader = Some(UsageReader::with_fields(
                content_type.as_deref(),
                reading.max_bytes,
                reading.usage,
                reading.fields,
            ));
        }
    }

    /// `size` more bytes of the response body (`end`: the last have come): counted and read for
    /// what reservations settle by, and paced by byte limits — held back while the key's byte
    /// bucket says so, else passed on at once. (While a body is held back, Envoy hands over each
    /// chunk as it comes, and passes them all on when the stream is continued.)
    pub fn on_response_body(&mut self, size: usize, end: bool) -> Action {
        if self.holdings.reservations.is_empty() && self.holdings.pacers.is_empty() {
            return Action::Continue;
        }
        let Some(plugin) = self.plugin.clone() else {
            return Action::Continue;
        };
        if !self.holdings.reservations.is_empty() {
            self.seen.body_bytes = self
                .seen
                .body_bytes
                .saturating_add(u64::try_from(size).unwrap_or(u64::MAX));
            if let Some(reader) = self.body_reader.as_mut() {
                if size > 0 {
                    if let Some(chunk) = plugin.host.response_body(size) {
                        reader.push(&chunk);
                    }
                }
            }
            if end {
                self.seen.body_ended = true;
                self.settle();
            }
        }
        // A response of this filter's own (a refusal) is not paced.
        if self.holdings.pacers.is_empty() || !self.forwarded {
            return Action::Continue;
        }
        self.pace(&plugin, PaceBody::Response, size)
    }

    /// `new` bytes of `body` are about to go on: charge them to the byte limits, and hold the
    /// body until they are covered.
    fn pace(&mut self, plugin: &Plugin<H>, body: PaceBody, new: usize) -> Action {
        let Some(now) = plugin.host.now_ns() else {
            return Action::Continue;
        };
        let wait = plugin.engine.borrow_mut().pace(
            &plugin.host,
            &mut self.holdings.pacers,
            body,
            u64::try_from(new).unwrap_or(u64::MAX),
            now,
        );
        let last = &mut self.holdings.body_holds[hold_index(body)];
        // Still held unless the tick has let it go since.
        let held = last.filter(|&at| plugin.queues.borrow().body_held(at, self.id, body));
        let unpassed = &mut self.holdings.unpassed[hold_index(body)];
        if held.is_none() {
            // What was held before went on.
            *unpassed = 0;
        }
        if wait == 0 && held.is_none() {
            return Action::Continue;
        }
        *unpassed = unpassed.saturating_add(u64::try_from(new).unwrap_or(u64::MAX));
        let due = now.saturating_add(wait);
        let until = held.map_or(due, |h| h.max(due));
        plugin
            .queues
            .borrow_mut()
            .hold_body(held, until, self.id, body);
        *last = Some(until);
        // The time it is held for, as scheduled (what the tick's resolution adds is not).
        let added = until.saturating_sub(held.unwrap_or(now).max(now));
        plugin
            .engine
            .borrow_mut()
            .held(&self.holdings.pacers, body, added);
        Action::HoldBody
    }

    /// Settle the reservations with what the response showed (exactly once).
    fn settle(&mut self) {
        let Some(plugin) = self.plugin.clone() else {
            return;
        };
        self.finish_reading();
        self.holdings.settle(&plugin, &self.seen);
    }

    /// What the response body showed, once it is over.
    fn finish_reading(&mut self) {
        if self.holdings.reservations.is_empty() {
            return;
        }
        if let Some(reader) = self.body_reader.as_mut() {
            self.seen.usage = reader.finish();
            self.seen.fields = reader.fields();
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

/// Keep a request's body back: under flow control where the host has it (Envoy: a body larger
/// than its buffer limit then stops the client instead of failing the request), else paused.
fn hold_body<H: Host>(plugin: &Plugin<H>) -> Action {
    if plugin.caps.request_end_known {
        Action::HoldBody
    } else {
        Action::Pause
    }
}
