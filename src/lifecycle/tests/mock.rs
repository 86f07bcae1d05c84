//! A host in memory, Envoy-like or nginx-like, and a proxy around the lifecycle's contexts that
//! enters callbacks as such a host would.

use crate::config::HostCaps;
use crate::header_map;
use crate::lifecycle::{Action, Contexts, Host, MetricKind, Status};
use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use tollgate_core::{CasStore, StoreError};

pub const MS: u64 = 1_000_000;
pub const NOW: u64 = 1_700_000_000_000 * MS;
const ROOT: u32 = 1;

type Headers = Vec<(String, Vec<u8>)>;

/// A call the filter made, as the host saw it.
#[derive(Debug, Clone)]
pub struct SentCall {
    pub token: u32,
    /// The context current when it was made.
    pub caller: u32,
    pub path: String,
    pub body: serde_json::Value,
}

/// A local response the filter sent.
#[derive(Debug, Clone)]
pub struct Local {
    pub context: u32,
    pub status: u32,
    pub headers: Headers,
}

#[derive(Default)]
struct State {
    caps: Option<HostCaps>,
    now: Cell<u64>,
    shared: RefCell<HashMap<String, (Vec<u8>, u32)>>,
    next_cas: Cell<u32>,
    configuration: RefCell<Vec<u8>>,
    tick_ms: Cell<Option<u32>>,
    current: Cell<u32>,
    /// Streams the host knows (can be made current).
    live: RefCell<HashSet<u32>>,
    request_headers: RefCell<HashMap<u32, Headers>>,
    response_headers: RefCell<HashMap<u32, Headers>>,
    locals: RefCell<Vec<Local>>,
    continued: RefCell<Vec<u32>>,
    calls: RefCell<Vec<SentCall>>,
    next_token: Cell<u32>,
    /// The request body the host buffered.
    request_body: RefCell<Vec<u8>>,
    /// The response body chunk being delivered.
    body_chunk: RefCell<Vec<u8>>,
    /// Streams whose held response the filter continued.
    continued_responses: RefCell<Vec<u32>>,
    /// The answer being delivered: headers and body.
    answer: RefCell<Option<(Headers, Vec<u8>)>>,
    metric_names: RefCell<Vec<String>>,
    metrics: RefCell<HashMap<String, i64>>,
    /// Every host call the filter made, by name (a header's name with it), in order.
    host_calls: RefCell<Vec<String>>,
}

#[derive(Clone)]
pub struct MockHost(Rc<State>);

fn find(headers: Option<&Headers>, name: &str) -> Option<Vec<u8>> {
    headers?
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.clone())
}

impl MockHost {
    fn note(&self, call: &str) {
        self.0.host_calls.borrow_mut().push(call.to_string());
    }

    fn caps_or_envoy(&self) -> HostCaps {
        self.0.caps.unwrap_or(HostCaps::ENVOY)
    }

    /// The current context, if the host still knows it (else what Envoy answers).
    fn live_current(&self) -> Result<u32, Status> {
        let context = self.0.current.get();
        if self.0.live.borrow().contains(&context) {
            Ok(context)
        } else {
            Err(Status::BAD_ARGUMENT)
        }
    }
}

impl CasStore for MockHost {
    fn read(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        self.note("get_shared_data");
        Ok(self.0.shared.borrow().get(key).cloned())
    }

    fn write(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
        self.note("set_shared_data");
        let mut shared = self.0.shared.borrow_mut();
        let current = shared.get(key).map(|(_, c)| *c);
        // Envoy writes over an existing key when no CAS is given; nginx refuses.
        let blind_ok = cas == 0 && self.caps_or_envoy().resume_from_timer;
        match current {
            Some(c) if c != cas && !blind_ok => return Err(StoreError::CasMismatch),
            None if cas != 0 => return Err(StoreError::CasMismatch),
            _ => {}
        }
        let next = self.0.next_cas.get() + 1;
        self.0.next_cas.set(next);
        shared.insert(key.to_string(), (value.to_vec(), next));
        Ok(())
    }
}

impl Host for MockHost {
    fn caps(&self) -> HostCaps {
        self.caps_or_envoy()
    }
    fn now_ns(&self) -> Option<u64> {
        self.note("get_current_time");
        Some(self.0.now.get())
    }
    fn plugin_configuration(&self) -> Result<Vec<u8>, Status> {
        Ok(self.0.configuration.borrow().clone())
    }
    fn set_tick_period(&self, ms: u32) -> Result<(), Status> {
        self.0.tick_ms.set(Some(ms));
        Ok(())
    }
    fn request_header(&self, name: &str) -> Option<crate::request::Value<'_>> {
        self.note(&format!("get_request_header {name}"));
        find(
            self.0.request_headers.borrow().get(&self.0.current.get()),
            name,
        )
        .map(Cow::Owned)
    }
    fn source_address(&self) -> Option<crate::request::Value<'_>> {
        self.note("get_property source.address");
        Some(Cow::Borrowed(b"10.0.0.1:4000"))
    }
    fn response_header(&self, name: &str) -> Option<crate::request::Value<'_>> {
        self.note(&format!("get_response_header {name}"));
        find(
            self.0.response_headers.borrow().get(&self.0.current.get()),
            name,
        )
        .map(Cow::Owned)
    }
    fn property(&self, path: &[u8]) -> Option<crate::request::Value<'_>> {
        self.note("get_property");
        // The metadata a filter before tollgate set: `x-mock-metadata-<last segment>` headers.
        let last = path.rsplit(|&b| b == 0).next()?;
        let name = format!("x-mock-metadata-{}", String::from_utf8_lossy(last));
        self.request_header(&name)
            .map(|v| Cow::Owned(v.into_owned()))
    }
    fn request_body(&self, size: usize) -> Option<Vec<u8>> {
        self.note("get_request_body");
        let body = self.0.request_body.borrow();
        Some(body[..size.min(body.len())].to_vec())
    }
    fn response_body(&self, size: usize) -> Option<Vec<u8>> {
        self.note("get_response_body");
        let chunk = self.0.body_chunk.borrow();
        Some(chunk[..size.min(chunk.len())].to_vec())
    }
    fn continue_response(&self) -> Result<(), Status> {
        self.note("continue_response");
        let context = self.live_current()?;
        self.0.continued_responses.borrow_mut().push(context);
        Ok(())
    }
    fn add_response_header(&self, name: &str, value: &str) -> Result<(), Status> {
        self.note(&format!("add_response_header {name}"));
        self.0
            .response_headers
            .borrow_mut()
            .entry(self.0.current.get())
            .or_default()
            .push((name.to_string(), value.as_bytes().to_vec()));
        Ok(())
    }
    fn send_local_response(&self, status: u32, headers: &[u8], _body: &[u8]) -> Result<(), Status> {
        self.note("send_local_response");
        let context = self.live_current()?;
        let headers = header_map::deserialize(headers)
            .unwrap_or_default()
            .into_iter()
            .map(|(n, v)| (String::from_utf8_lossy(n).into_owned(), v.to_vec()))
            .collect();
        self.0.locals.borrow_mut().push(Local {
            context,
            status,
            headers,
        });
        Ok(())
    }
    fn continue_request(&self) -> Result<(), Status> {
        self.note("continue_request");
        let context = self.live_current()?;
        self.0.continued.borrow_mut().push(context);
        Ok(())
    }
    fn set_effective_context(&self, context_id: u32) -> Result<(), Status> {
        self.note("set_effective_context");
        if context_id != ROOT && !self.0.live.borrow().contains(&context_id) {
            return Err(Status::BAD_ARGUMENT);
        }
        self.0.current.set(context_id);
        Ok(())
    }
    fn http_call(
        &self,
        _upstream: &str,
        headers: &[u8],
        body: &[u8],
        _timeout_ms: u32,
    ) -> Result<u32, Status> {
        let token = self.0.next_token.get() + 1;
        self.0.next_token.set(token);
        let path = header_map::deserialize(headers)
            .unwrap_or_default()
            .into_iter()
            .find(|(n, _)| *n == b":path")
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
            .unwrap_or_default();
        self.0.calls.borrow_mut().push(SentCall {
            token,
            caller: self.0.current.get(),
            path,
            body: serde_json::from_slice(body).unwrap_or_default(),
        });
        Ok(token)
    }
    fn call_response_header(&self, name: &str) -> Option<crate::request::Value<'_>> {
        find(self.0.answer.borrow().as_ref().map(|(h, _)| h), name).map(Cow::Owned)
    }
    fn call_response_body(&self, size: usize) -> Option<Vec<u8>> {
        let answer = self.0.answer.borrow();
        let body = &answer.as_ref()?.1;
        Some(body[..size.min(body.len())].to_vec())
    }
    fn define_metric(&self, _kind: MetricKind, name: &str) -> Result<u32, Status> {
        let mut names = self.0.metric_names.borrow_mut();
        names.push(name.to_string());
        Ok(u32::try_from(names.len() - 1).unwrap_or(u32::MAX))
    }
    fn increment_metric(&self, id: u32, by: i64) -> Result<(), Status> {
        self.note("increment_metric");
        let name = self.metric_name(id)?;
        *self.0.metrics.borrow_mut().entry(name).or_default() += by;
        Ok(())
    }
    fn record_metric(&self, id: u32, value: u64) -> Result<(), Status> {
        self.note("record_metric");
        let name = self.metric_name(id)?;
        self.0
            .metrics
            .borrow_mut()
            .insert(name, i64::try_from(value).unwrap_or(i64::MAX));
        Ok(())
    }
}

impl MockHost {
    fn metric_name(&self, id: u32) -> Result<String, Status> {
        self.0
            .metric_names
            .borrow()
            .get(id as usize)
            .cloned()
            .ok_or(Status::NOT_FOUND)
    }
}

/// A proxy with one worker and one configuration, entering the lifecycle's callbacks in the order
/// its host does.
pub struct Proxy {
    pub contexts: Contexts<MockHost>,
    host: MockHost,
    next_id: u32,
}

impl Proxy {
    /// A proxy of the kind `caps` with `config` loaded; `None` if it refuses the configuration.
    pub fn try_new(caps: HostCaps, config: &str) -> Option<Self> {
        let host = MockHost(Rc::new(State {
            caps: Some(caps),
            ..State::default()
        }));
        host.0.now.set(NOW);
        *host.0.configuration.borrow_mut() = config.as_bytes().to_vec();
        let contexts = Contexts::new(host.clone());
        contexts.create(ROOT, 0);
        host.0.current.set(ROOT);
        contexts.configure(ROOT).then_some(Self {
            contexts,
            host,
            next_id: ROOT + 1,
        })
    }

    pub fn new(caps: HostCaps, config: &str) -> Self {
        Self::try_new(caps, config).unwrap_or_else(|| panic!("{} refused {config}", caps.name))
    }

    fn caps(&self) -> HostCaps {
        self.host.caps_or_envoy()
    }

    /// The host calls made since the last time this was asked.
    pub fn take_host_calls(&self) -> Vec<String> {
        std::mem::take(&mut *self.host.0.host_calls.borrow_mut())
    }

    pub fn advance_ms(&self, ms: u64) {
        self.host.0.now.set(self.host.0.now.get() + ms * MS);
    }

    /// A new request with `headers` and no body: its context id and what its headers callback
    /// answered.
    pub fn request(&mut self, headers: &[(&str, &str)]) -> (u32, Action) {
        // ngx_wasm_module never says that no body follows.
        let end = self.caps().request_end_known;
        self.request_headers(headers, end)
    }

    /// A new request with `headers` and a body in `chunks`, delivered as the host does (Envoy
    /// chunk by chunk, buffered while the filter pauses; nginx all at once): its context id and
    /// what the last body callback answered.
    pub fn request_with_body(
        &mut self,
        headers: &[(&str, &str)],
        chunks: &[&[u8]],
    ) -> (u32, Action) {
        let length = chunks.iter().map(|c| c.len()).sum::<usize>().to_string();
        let mut with_length = headers.to_vec();
        with_length.push(("content-length", &length));
        let (id, mut action) = self.request_headers(&with_length, false);
        self.host.0.request_body.borrow_mut().clear();
        if !self.caps().request_end_known {
            let whole = chunks.concat();
            *self.host.0.request_body.borrow_mut() = whole.clone();
            self.host.0.current.set(id);
            return (id, self.contexts.request_body(id, whole.len(), true));
        }
        for (n, chunk) in chunks.iter().enumerate() {
            // Under flow control Envoy hands over each chunk alone.
            *self.host.0.request_body.borrow_mut() = chunk.to_vec();
            self.host.0.current.set(id);
            action = self
                .contexts
                .request_body(id, chunk.len(), n + 1 == chunks.len());
        }
        (id, action)
    }

    /// One more chunk of request `id`'s body, handed over alone (Envoy under flow control).
    pub fn request_body(&self, id: u32, chunk: &[u8], end: bool) -> Action {
        *self.host.0.request_body.borrow_mut() = chunk.to_vec();
        self.host.0.current.set(id);
        self.contexts.request_body(id, chunk.len(), end)
    }

    /// Request `id`'s whole body of `size` bytes, which the host says came but cannot hand over
    /// (nginx spooled it to a file).
    pub fn request_body_spooled(&self, id: u32, size: usize) -> Action {
        self.host.0.request_body.borrow_mut().clear();
        self.host.0.current.set(id);
        self.contexts.request_body(id, size, true)
    }

    /// Request `id`'s trailers (its body ended with them).
    pub fn request_trailers(&self, id: u32) -> Action {
        self.host.0.current.set(id);
        self.contexts.request_trailers(id)
    }

    /// A new request's headers (`end`: no body follows, where the host says so).
    pub fn request_headers(&mut self, headers: &[(&str, &str)], end: bool) -> (u32, Action) {
        let id = self.next_id;
        self.next_id += 1;
        let mut all: Headers = vec![
            (":method".into(), b"GET".to_vec()),
            (":path".into(), b"/".to_vec()),
            (":authority".into(), b"api".to_vec()),
        ];
        // Given pseudo-headers replace the defaults.
        all.retain(|(n, _)| !headers.iter().any(|(given, _)| given == n));
        all.extend(
            headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())),
        );
        self.host.0.request_headers.borrow_mut().insert(id, all);
        self.host.0.live.borrow_mut().insert(id);
        self.contexts.create(id, ROOT);
        self.host.0.current.set(id);
        (id, self.contexts.request_headers(id, end))
    }

    /// The upstream answers request `id` with `status`: its response headers callback.
    pub fn upstream_answers(&self, id: u32, status: u32) -> Action {
        self.host.0.response_headers.borrow_mut().insert(
            id,
            vec![(":status".into(), status.to_string().into_bytes())],
        );
        self.host.0.current.set(id);
        self.contexts.response_headers(id)
    }

    /// The upstream answers request `id` with `status`, `headers` and a body in `chunks`, then
    /// the stream ends.
    pub fn upstream_streams(
        &self,
        id: u32,
        status: u32,
        headers: &[(&str, &str)],
        chunks: &[&[u8]],
    ) {
        let mut all = vec![(":status".to_string(), status.to_string().into_bytes())];
        all.extend(
            headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())),
        );
        self.host.0.response_headers.borrow_mut().insert(id, all);
        self.host.0.current.set(id);
        self.contexts.response_headers(id);
        for (n, chunk) in chunks.iter().enumerate() {
            *self.host.0.body_chunk.borrow_mut() = chunk.to_vec();
            self.host.0.current.set(id);
            let last = n + 1 == chunks.len();
            assert_eq!(
                self.contexts.response_body(id, chunk.len(), last),
                Action::Continue
            );
        }
        self.end(id);
    }

    /// One more chunk of request `id`'s response body, as Envoy delivers it while the filter
    /// holds the body back under flow control: the new chunk alone.
    pub fn response_chunk(&self, id: u32, chunk: &[u8], end: bool) -> Action {
        *self.host.0.body_chunk.borrow_mut() = chunk.to_vec();
        self.host.0.current.set(id);
        self.contexts.response_body(id, chunk.len(), end)
    }

    /// The upstream's response headers for request `id` (status 200, `headers`).
    pub fn response_headers(&self, id: u32, headers: &[(&str, &str)]) -> Action {
        let mut all = vec![(":status".to_string(), b"200".to_vec())];
        all.extend(
            headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec())),
        );
        self.host.0.response_headers.borrow_mut().insert(id, all);
        self.host.0.body_chunk.borrow_mut().clear();
        self.host.0.current.set(id);
        self.contexts.response_headers(id)
    }

    /// How many times request `id`'s held response was continued.
    pub fn response_continued(&self, id: u32) -> usize {
        self.host
            .0
            .continued_responses
            .borrow()
            .iter()
            .filter(|&&c| c == id)
            .count()
    }

    /// The stream ends normally: its log callback, then its deletion.
    pub fn end(&self, id: u32) {
        self.host.0.current.set(id);
        self.contexts.log(id);
        self.host.0.live.borrow_mut().remove(&id);
        self.contexts.delete(id);
    }

    /// The client goes away before any answer: the host deletes the context without a log.
    pub fn abort(&self, id: u32) {
        self.host.0.live.borrow_mut().remove(&id);
        self.contexts.delete(id);
    }

    pub fn tick(&self) {
        self.host.0.current.set(ROOT);
        self.contexts.tick(ROOT);
    }

    /// The calls made so far, taken.
    pub fn take_calls(&self) -> Vec<SentCall> {
        std::mem::take(&mut *self.host.0.calls.borrow_mut())
    }

    /// Deliver the answer to `call` (`None`: the call failed) as the host does: Envoy names the
    /// root context, nginx the caller.
    pub fn answer(&self, call: &SentCall, answer: Option<(u32, serde_json::Value)>) {
        let delivered_to = if self.caps().resume_from_timer {
            ROOT
        } else {
            call.caller
        };
        let (headers, body) = match answer {
            Some((status, body)) => (
                vec![(":status".into(), status.to_string().into_bytes())],
                serde_json::to_vec(&body).unwrap_or_default(),
            ),
            None => (Vec::new(), Vec::new()),
        };
        let (num_headers, body_size) = (headers.len(), body.len());
        *self.host.0.answer.borrow_mut() = Some((headers, body));
        self.host.0.current.set(delivered_to);
        self.contexts
            .call_response(delivered_to, call.token, num_headers, body_size);
        *self.host.0.answer.borrow_mut() = None;
    }

    /// True if request `id` was resumed (continued after a pause).
    pub fn resumed(&self, id: u32) -> bool {
        self.host.0.continued.borrow().contains(&id)
    }

    /// The local response sent for request `id`, if any.
    pub fn local_response(&self, id: u32) -> Option<Local> {
        self.host
            .0
            .locals
            .borrow()
            .iter()
            .find(|l| l.context == id)
            .cloned()
    }

    /// A response header the filter added to request `id`'s answer.
    pub fn response_header(&self, id: u32, name: &str) -> Option<String> {
        find(self.host.0.response_headers.borrow().get(&id), name)
            .map(|v| String::from_utf8_lossy(&v).into_owned())
    }

    /// A metric's value as the host holds it (after a tick hands stats over).
    pub fn metric(&self, name: &str) -> i64 {
        self.host.0.metrics.borrow().get(name).copied().unwrap_or(0)
    }
}
