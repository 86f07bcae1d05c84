//! What a request's lifecycle asks of the proxy, as one trait: the wasm layer implements it with the
//! proxy-wasm ABI, native tests with a mock. Every answer is bytes or a status, never a panic.

use crate::config::HostCaps;
use crate::request::{RequestView, Value};
use std::fmt;
use tollgate_core::CasStore;

/// A status other than OK, as the host returned it (proxy-wasm's numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Status(pub u32);

impl Status {
    pub const NOT_FOUND: Self = Self(1);
    pub const BAD_ARGUMENT: Self = Self(2);
    pub const CAS_MISMATCH: Self = Self(8);
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self.0 {
            1 => "not found",
            2 => "bad argument",
            3 => "serialization failure",
            4 => "parse failure",
            6 => "invalid memory access",
            7 => "empty",
            8 => "CAS mismatch",
            10 => "internal failure",
            12 => "unimplemented",
            _ => "unknown",
        };
        write!(f, "status {} ({name})", self.0)
    }
}

/// What a callback tells the host to do with the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Continue,
    Pause,
    /// From a body callback: keep the body's data back under the host's flow control until the
    /// stream is continued (pacing).
    HoldBody,
}

/// How the host keeps a metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
}

/// The proxy as the lifecycle sees it. Calls about "the current request" or "the current response"
/// act on the context the host entered (or made current with [`Host::set_effective_context`]).
/// Its shared data is the [`CasStore`] every worker of the process shares.
pub trait Host: CasStore {
    /// Which host this is and what it can do.
    fn caps(&self) -> HostCaps;
    /// Nanoseconds since the Unix epoch, if the host gives a time.
    fn now_ns(&self) -> Option<u64>;
    /// The plugin configuration's bytes (empty if there is none).
    fn plugin_configuration(&self) -> Result<Vec<u8>, Status>;
    fn set_tick_period(&self, ms: u32) -> Result<(), Status>;

    /// A request header (or pseudo-header) by lower-case name, as the client sent it. What the
    /// host lends is valid until the callback returns (or, for a response header, until a header
    /// is added): it is read and used, never kept.
    fn request_header(&self, name: &str) -> Option<Value<'_>>;
    /// The client's address (`source.address`), as the host gives it.
    fn source_address(&self) -> Option<Value<'_>>;
    /// A property of the current request by path (segments separated by NUL bytes).
    fn property(&self, path: &[u8]) -> Option<Value<'_>>;
    /// A response header (or `:status`) by lower-case name, read in the response callback.
    fn response_header(&self, name: &str) -> Option<Value<'_>>;
    /// The current chunk of the response body (`size` bytes), read in the body callback.
    fn response_body(&self, size: usize) -> Option<Vec<u8>>;
    /// The request body the host buffered (its first `size` bytes), read in the body callback.
    fn request_body(&self, size: usize) -> Option<Vec<u8>>;
    fn add_response_header(&self, name: &str, value: &str) -> Result<(), Status>;
    /// Answer the current request locally. `headers` is a serialized header map.
    fn send_local_response(&self, status: u32, headers: &[u8], body: &[u8]) -> Result<(), Status>;
    /// Let the current (paused) request go on.
    fn continue_request(&self) -> Result<(), Status>;
    /// Pass on a response whose body was held.
    fn continue_response(&self) -> Result<(), Status>;
    /// Make another context current (to resume it from the timer, or to read a call's answer
    /// delivered to the root context).
    fn set_effective_context(&self, context_id: u32) -> Result<(), Status>;

    /// Start an HTTP call; its answer arrives in a call-response callback. `headers` is a
    /// serialized header map.
    fn http_call(
        &self,
        upstream: &str,
        headers: &[u8],
        body: &[u8],
        timeout_ms: u32,
    ) -> Result<u32, Status>;
    /// A header of the answer to an HTTP call, read in its response callback.
    fn call_response_header(&self, name: &str) -> Option<Value<'_>>;
    /// The body of the answer to an HTTP call, read in its response callback.
    fn call_response_body(&self, size: usize) -> Option<Vec<u8>>;

    /// Take work the tick found for stream `context_id` to do on the stream's own thread, where
    /// the tick runs on another (the dynamic module's runs on Envoy's main thread): the host then
    /// calls [`super::Contexts::stream_work`] there. False: the tick does it now.
    fn defer_stream_work(&self, _context_id: u32) -> bool {
        false
    }

    fn define_metric(&self, kind: MetricKind, name: &str) -> Result<u32, Status>;
    fn increment_metric(&self, id: u32, by: i64) -> Result<(), Status>;
    fn record_metric(&self, id: u32, value: u64) -> Result<(), Status>;
}

/// The current request as the host shows it.
pub struct HostRequest<'h, H: Host> {
    pub host: &'h H,
    pub caps: HostCaps,
}

impl<H: Host> RequestView for HostRequest<'_, H> {
    fn header(&self, name: &str) -> Option<Value<'_>> {
        self.host.request_header(name)
    }

    fn source_address(&self) -> Option<Value<'_>> {
        self.host.source_address()
    }

    fn property(&self, path: &[u8]) -> Option<Value<'_>> {
        self.host.property(path)
    }

    fn authority(&self) -> Option<Value<'_>> {
        let (first, then) = if self.caps.authority_is_request_host {
            (":authority", "host")
        } else {
            ("host", ":authority")
        };
        self.host
            .request_header(first)
            .or_else(|| self.host.request_header(then))
    }
}
