//! One VM's contexts and the callbacks the host enters, dispatched to root contexts (one per
//! configuration and worker) and streams (one per request). A context the host names that is
//! unknown, or one that is busy (a re-entered callback), gets the neutral answer: nothing here
//! can panic.

use super::calls::Callers;
use super::host::{Action, Host};
use super::root::Root;
use super::stream::{KeptReport, Left, Stream};
use log::debug;
use rustc_hash::FxHashMap;
use std::cell::RefCell;

/// Every context of one VM (one worker's copy of the module). Roots and streams are borrowed
/// apart: a stream's callback re-entered from a root's (a refusal sent from the tick runs the
/// stream's response and log callbacks at once) still finds its stream.
pub struct Contexts<H: Host + Clone> {
    host: H,
    // Context ids are the host's small integers, never a client's: a fast hash (several lookups
    // per request) needs no protection against chosen keys.
    roots: RefCell<FxHashMap<u32, Root<H>>>,
    /// Requests in progress. The map keeps its capacity: a new request allocates nothing.
    streams: RefCell<FxHashMap<u32, Stream<H>>>,
    /// Requests let through whose only work left is their response's rate-limit headers (most
    /// requests, with the default headers): a few words each, where a stream is several hundred
    /// bytes to move in and out of its table.
    reports: RefCell<FxHashMap<u32, KeptReport<H>>>,
    callers: Callers,
}

impl<H: Host + Clone> Contexts<H> {
    pub fn new(host: H) -> Self {
        Self {
            host,
            roots: RefCell::default(),
            streams: RefCell::default(),
            reports: RefCell::default(),
            callers: Callers::default(),
        }
    }

    pub fn host(&self) -> &H {
        &self.host
    }

    fn with_root<R>(&self, id: u32, default: R, f: impl FnOnce(&mut Root<H>) -> R) -> R {
        match self.roots.try_borrow_mut() {
            Ok(mut roots) => roots.get_mut(&id).map_or(default, f),
            Err(_) => {
                debug!("root context {id} entered again while busy");
                default
            }
        }
    }

    fn with_stream<R>(&self, id: u32, default: R, f: impl FnOnce(&mut Stream<H>) -> R) -> R {
        match self.streams.try_borrow_mut() {
            Ok(mut streams) => streams.get_mut(&id).map_or(default, f),
            Err(_) => {
                debug!("context {id} entered again while busy");
                default
            }
        }
    }

    /// True if request `id` is known (and not being worked on).
    pub fn has_stream(&self, id: u32) -> bool {
        self.streams.try_borrow().is_ok_and(|m| m.contains_key(&id))
    }

    /// True if request `id` has anything left to do: a stream, or headers to add to its response.
    pub fn has_work(&self, id: u32) -> bool {
        // (Reports first: most requests that have work left have only that.)
        self.reports.try_borrow().is_ok_and(|m| m.contains_key(&id)) || self.has_stream(id)
    }

    /// A new context: a root (no parent) or a request of the root `parent_id`.
    pub fn create(&self, context_id: u32, parent_id: u32) {
        if parent_id == 0 {
            if let Ok(mut roots) = self.roots.try_borrow_mut() {
                roots.insert(context_id, Root::new(self.host.clone()));
            }
            return;
        }
        let plugin = self.with_root(parent_id, None, |root| root.plugin());
        if let Ok(mut streams) = self.streams.try_borrow_mut() {
            streams.insert(context_id, Stream::new(context_id, plugin));
        }
    }

    /// Load the root's configuration; false if it is refused.
    pub fn configure(&self, root_id: u32) -> bool {
        self.with_root(root_id, false, Root::configure)
    }

    pub fn tick(&self, root_id: u32) {
        self.with_root(root_id, (), Root::tick);
        let Some(plugin) = self.with_root(root_id, None, Root::plugin) else {
            return;
        };
        let Some(now) = self.host.now_ns() else {
            return;
        };
        for id in plugin.stale_body_waits(now) {
            if self.host.defer_stream_work(id) {
                continue;
            }
            if self.host.set_effective_context(id).is_ok() {
                self.stream_work(id);
            }
        }
    }

    /// What the tick found for stream `context_id` to do (a body that stalled: decide without
    /// it), on the stream's own thread.
    pub fn stream_work(&self, context_id: u32) {
        self.with_stream(context_id, (), |s| s.decide_without_body(&self.callers));
    }

    pub fn request_headers(&self, context_id: u32, end_of_stream: bool) -> Action {
        let action = self.with_stream(context_id, Action::Continue, |s| {
            s.on_request_headers(&self.callers, end_of_stream)
        });
        self.forget_if_idle(context_id, action);
        action
    }

    /// A stream that went on and has nothing left to do or let go of is forgotten now (one with
    /// only its response's rate-limit headers left keeps just those): its later callbacks find no
    /// stream and let it go on, which is all it would have done. (It holds nothing and is in no
    /// queue: its end would let go of nothing.)
    fn forget_if_idle(&self, context_id: u32, action: Action) {
        let Ok(mut streams) = self.streams.try_borrow_mut() else {
            return;
        };
        let left = match streams.get(&context_id) {
            Some(stream) => stream.left_after(action),
            None => return,
        };
        match left {
            Left::Stream => {}
            Left::Nothing => drop(streams.remove(&context_id)),
            Left::Report(report) => {
                streams.remove(&context_id);
                drop(streams);
                self.keep_report(context_id, report);
            }
        }
    }

    /// Keep `report` (with its plugin) for the response of request `id`.
    fn keep_report(&self, id: u32, report: KeptReport<H>) {
        if let Ok(mut reports) = self.reports.try_borrow_mut() {
            reports.insert(id, report);
        }
    }

    /// The report request `id` kept for its response, taken.
    fn take_report(&self, id: u32) -> Option<KeptReport<H>> {
        self.reports.try_borrow_mut().ok()?.remove(&id)
    }

    /// A request's headers, for a host that makes nothing for a request before them (the Envoy
    /// dynamic module): the stream of root `parent_id` is kept only if it has something left to
    /// do once they are decided.
    pub fn begin_request(&self, context_id: u32, parent_id: u32, end_of_stream: bool) -> Action {
        let plugin = self.with_root(parent_id, None, |root| root.plugin());
        let mut stream = Stream::new(context_id, plugin);
        // (Not in the table while it decides: a callback the host re-enters for it finds it busy,
        // as it would in the table.)
        let action = stream.on_request_headers(&self.callers, end_of_stream);
        match stream.left_after(action) {
            Left::Nothing => {}
            Left::Report(report) => self.keep_report(context_id, report),
            Left::Stream => {
                if let Ok(mut streams) = self.streams.try_borrow_mut() {
                    streams.insert(context_id, stream);
                }
            }
        }
        action
    }

    pub fn request_trailers(&self, context_id: u32) -> Action {
        self.with_stream(context_id, Action::Continue, |s| {
            s.on_request_trailers(&self.callers)
        })
    }

    pub fn request_body(&self, context_id: u32, size: usize, end: bool) -> Action {
        self.with_stream(context_id, Action::Continue, |s| {
            s.on_request_body(&self.callers, size, end)
        })
    }

    pub fn response_headers(&self, context_id: u32) -> Action {
        if let Some((plugin, report)) = self.take_report(context_id) {
            plugin.add_quota_headers(report);
            return Action::Continue;
        }
        let action = self.with_stream(context_id, Action::Continue, Stream::on_response_headers);
        self.forget_if_idle(context_id, action);
        action
    }

    pub fn response_body(&self, context_id: u32, size: usize, end: bool) -> Action {
        self.with_stream(context_id, Action::Continue, |s| {
            s.on_response_body(size, end)
        })
    }

    /// The stream's last callback before it is deleted.
    pub fn log(&self, context_id: u32) {
        self.with_stream(context_id, (), |s| s.end_of_stream(&self.callers));
    }

    /// A root is done (the configuration goes away).
    pub fn done(&self, context_id: u32) {
        self.with_root(context_id, (), Root::done);
    }

    /// A context goes away. A stream that never saw its log callback (an aborted request on some
    /// hosts) ends here.
    pub fn delete(&self, context_id: u32) {
        if self.take_report(context_id).is_some() {
            return;
        }
        let stream = self
            .streams
            .try_borrow_mut()
            .ok()
            .and_then(|mut s| s.remove(&context_id));
        if let Some(mut stream) = stream {
            stream.end_of_stream(&self.callers);
            return;
        }
        let root = self
            .roots
            .try_borrow_mut()
            .ok()
            .and_then(|mut r| r.remove(&context_id));
        if let Some(mut root) = root {
            root.done();
        }
    }

    /// The answer to the call `token` of context `caller`, for a host that names the caller of
    /// every answer and numbers calls per caller (the Envoy dynamic module: a stream's first
    /// call and a configuration's are both 1), so a token alone names no one.
    pub fn answer_call(&self, caller: u32, token: u32, num_headers: usize, body_size: usize) {
        self.callers.forget_if(token, caller);
        self.deliver(caller, token, num_headers, body_size);
    }

    /// Hand the answer to `token` to its caller, a stream or else a root.
    fn deliver(&self, caller: u32, token: u32, num_headers: usize, body_size: usize) {
        let for_stream = self.with_stream(caller, false, |stream| {
            stream.on_call_response(token, num_headers, body_size);
            true
        });
        if !for_stream {
            self.with_root(caller, (), |root| {
                root.on_call_response(token, num_headers, body_size)
            });
        }
    }

    /// The answer to the call `token`, delivered to `context_id`.
    pub fn call_response(&self, context_id: u32, token: u32, num_headers: usize, body_size: usize) {
        // ngx_wasm_module names the context that made the call (and numbers tokens per context);
        // Envoy names the root context for every answer (and numbers tokens per VM), so a
        // request's answer is found by its token.
        let named_stream = self.has_stream(context_id);
        let named_root_call = !named_stream && self.with_root(context_id, false, |r| r.sent(token));
        let caller = if named_stream || named_root_call {
            self.callers.forget(token);
            context_id
        } else {
            self.callers.take(token).unwrap_or(context_id)
        };
        // The caller must be current before it can read the answer or resume itself (Envoy;
        // nginx ignores this call, its current context is the caller already).
        if caller != context_id {
            let _ = self.host.set_effective_context(caller);
        }
        self.deliver(caller, token, num_headers, body_size);
    }
}
