//! A request's response: the rate-limit headers, what overload rules learn, the cost its
//! reservations settle by, and its download paced by byte limits.

use super::super::holdings::hold_index;
use super::super::host::{Action, Host};
use super::super::plugin::Plugin;
use super::Stream;
use crate::config::PaceBody;
use crate::number::whole_number;
use crate::usage::UsageReader;

impl<H: Host> Stream<H> {
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
    pub(super) fn learn(&mut self, plugin: &Plugin<H>, status: Option<u32>) {
        if !self.forwarded {
            self.holdings.give_up_seats(plugin);
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

    /// What the response's headers (its `status` among them) say of the cost its reservations
    /// settle.
    pub(super) fn note_response(&mut self, plugin: &Plugin<H>, status: Option<u32>) {
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
    pub(super) fn pace(&mut self, plugin: &Plugin<H>, body: PaceBody, new: usize) -> Action {
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
    pub(super) fn settle(&mut self) {
        let Some(plugin) = self.plugin.clone() else {
            return;
        };
        self.finish_reading();
        self.holdings.settle(&plugin, &self.seen);
    }

    /// What the response body showed, once it is over.
    pub(super) fn finish_reading(&mut self) {
        if self.holdings.reservations.is_empty() {
            return;
        }
        if let Some(reader) = self.body_reader.as_mut() {
            self.seen.usage = reader.finish();
            self.seen.fields = reader.fields();
        }
    }
}
