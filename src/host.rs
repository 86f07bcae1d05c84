//! The lifecycle's `Host` on the proxy-wasm ABI: every call into the host made safe — what the host
//! returns is bytes (never assumed to be UTF-8), every status is handed back as a `Result` or
//! `Option`, and nothing here panics. The logger and the last-resort panic hook live here too.

use crate::abi;
use crate::config::HostCaps;
use crate::lifecycle::{Host, MetricKind, Status};
use crate::request::Value;
use std::borrow::Cow;
use std::cell::OnceCell;
use tollgate_core::{CasStore, StoreError};

fn check(status: u32) -> Result<(), Status> {
    if status == abi::OK {
        Ok(())
    } else {
        Err(Status(status))
    }
}

/// Take ownership of bytes the host allocated through `proxy_on_memory_allocate`.
fn take(data: *mut u8, size: usize) -> Vec<u8> {
    if data.is_null() || size == 0 {
        return Vec::new();
    }
    // SAFETY: the host filled `size` bytes it allocated with `proxy_on_memory_allocate(size)`,
    // a boxed slice of exactly that length: ours to own and free.
    unsafe { Vec::from_raw_parts(data, size, size) }
}

/// A call that returns data: its bytes, `None` if the host has none (not found), or its status.
fn returned(call: impl FnOnce(*mut *mut u8, *mut usize) -> u32) -> Result<Option<Vec<u8>>, Status> {
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    match call(&mut data, &mut size) {
        abi::OK => Ok(Some(take(data, size))),
        abi::NOT_FOUND => Ok(None),
        other => Err(Status(other)),
    }
}

pub fn log(level: u32, message: &str) {
    // SAFETY: the message is valid for its length. A failed log has nowhere to go.
    let _ = unsafe { abi::proxy_log(level, message.as_ptr(), message.len()) };
}

/// Nanoseconds since the Unix epoch, if the host gives a time.
fn now_ns() -> Option<u64> {
    let mut t: u64 = 0;
    // SAFETY: the host writes one u64.
    check(unsafe { abi::proxy_get_current_time_nanoseconds(&mut t) }).ok()?;
    Some(t)
}

fn set_tick_period(ms: u32) -> Result<(), Status> {
    // SAFETY: plain value.
    check(unsafe { abi::proxy_set_tick_period_milliseconds(ms) })
}

/// The plugin configuration's bytes (empty if there is none).
fn plugin_configuration() -> Result<Vec<u8>, Status> {
    returned(|data, size| {
        // SAFETY: out-pointers valid for one write each.
        unsafe {
            abi::proxy_get_buffer_bytes(abi::BUFFER_PLUGIN_CONFIGURATION, 0, usize::MAX, data, size)
        }
    })
    .map(Option::unwrap_or_default)
}

fn map_value(map: u32, name: &str) -> Option<Vec<u8>> {
    returned(|data, size| {
        // SAFETY: the name is valid for its length; out-pointers valid for one write each.
        unsafe { abi::proxy_get_header_map_value(map, name.as_ptr(), name.len(), data, size) }
    })
    .ok()
    .flatten()
}

/// A request header (or pseudo-header) by lower-case name, as the client sent it.
fn request_header(name: &str) -> Option<Vec<u8>> {
    map_value(abi::MAP_HTTP_REQUEST_HEADERS, name)
}

/// A response header (or `:status`) by lower-case name, read in the response callback.
fn response_header(name: &str) -> Option<Vec<u8>> {
    map_value(abi::MAP_HTTP_RESPONSE_HEADERS, name)
}

/// A header of the answer to an HTTP call, read in its response callback.
fn call_response_header(name: &str) -> Option<Vec<u8>> {
    map_value(abi::MAP_HTTP_CALL_RESPONSE_HEADERS, name)
}

/// The first `size` bytes of a buffer the current callback may read (`abi::BUFFER_*`).
fn buffer(kind: u32, size: usize) -> Option<Vec<u8>> {
    returned(|data, out_size| {
        // SAFETY: out-pointers valid for one write each.
        unsafe { abi::proxy_get_buffer_bytes(kind, 0, size, data, out_size) }
    })
    .ok()
    .flatten()
}

fn add_response_header(name: &str, value: &str) -> Result<(), Status> {
    // SAFETY: both strings are valid for their lengths.
    check(unsafe {
        abi::proxy_add_header_map_value(
            abi::MAP_HTTP_RESPONSE_HEADERS,
            name.as_ptr(),
            name.len(),
            value.as_ptr(),
            value.len(),
        )
    })
}

/// A property by path (segments separated by NUL bytes).
fn property(path: &[u8]) -> Option<Vec<u8>> {
    returned(|data, size| {
        // SAFETY: the path is valid for its length; out-pointers valid for one write each.
        unsafe { abi::proxy_get_property(path.as_ptr(), path.len(), data, size) }
    })
    .ok()
    .flatten()
}

fn define_metric(kind: MetricKind, name: &str) -> Result<u32, Status> {
    let mut id = 0;
    let kind = match kind {
        MetricKind::Counter => abi::METRIC_COUNTER,
        MetricKind::Gauge => abi::METRIC_GAUGE,
    };
    // SAFETY: the name is valid for its length; the host writes one u32.
    check(unsafe { abi::proxy_define_metric(kind, name.as_ptr(), name.len(), &mut id) })?;
    Ok(id)
}

fn increment_metric(id: u32, by: i64) -> Result<(), Status> {
    // SAFETY: plain values.
    check(unsafe { abi::proxy_increment_metric(id, by) })
}

fn record_metric(id: u32, value: u64) -> Result<(), Status> {
    // SAFETY: plain values.
    check(unsafe { abi::proxy_record_metric(id, value) })
}

/// Start an HTTP call; its answer arrives in the calling context's call-response callback.
/// `headers` is a serialized header map ([`crate::header_map`]).
fn http_call(upstream: &str, headers: &[u8], body: &[u8], timeout_ms: u32) -> Result<u32, Status> {
    const NO_TRAILERS: [u8; 4] = [0; 4];
    let mut token = 0;
    // SAFETY: every buffer is valid for its length; the host writes one u32.
    check(unsafe {
        abi::proxy_http_call(
            upstream.as_ptr(),
            upstream.len(),
            headers.as_ptr(),
            headers.len(),
            body.as_ptr(),
            body.len(),
            NO_TRAILERS.as_ptr(),
            NO_TRAILERS.len(),
            timeout_ms,
            &mut token,
        )
    })?;
    Ok(token)
}

/// Answer the current request locally. `headers` is a serialized header map.
fn send_local_response(status: u32, headers: &[u8], body: &[u8]) -> Result<(), Status> {
    // SAFETY: every buffer is valid for its length.
    check(unsafe {
        abi::proxy_send_local_response(
            status,
            std::ptr::null(),
            0,
            body.as_ptr(),
            body.len(),
            headers.as_ptr(),
            headers.len(),
            -1,
        )
    })
}

/// Let the current (paused) request go on.
fn continue_request() -> Result<(), Status> {
    // SAFETY: plain value.
    check(unsafe { abi::proxy_continue_stream(abi::STREAM_HTTP_REQUEST) })
}

/// Make another context current (to resume it from the plugin's timer; Envoy only).
fn set_effective_context(context_id: u32) -> Result<(), Status> {
    // SAFETY: plain value.
    check(unsafe { abi::proxy_set_effective_context(context_id) })
}

/// The host the module runs in, through the proxy-wasm ABI; its shared data is the store.
#[derive(Clone, Copy)]
pub struct WasmHost;

impl CasStore for WasmHost {
    fn read(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        let mut cas: u32 = 0;
        let result = returned(|data, size| {
            // SAFETY: the key is valid for its length; out-pointers valid for one write each.
            unsafe { abi::proxy_get_shared_data(key.as_ptr(), key.len(), data, size, &mut cas) }
        });
        match result {
            Ok(value) => Ok(value.map(|v| (v, cas))),
            Err(status) => Err(StoreError::Unavailable(status.to_string())),
        }
    }

    fn write(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
        // SAFETY: key and value are valid for their lengths.
        let status = unsafe {
            abi::proxy_set_shared_data(key.as_ptr(), key.len(), value.as_ptr(), value.len(), cas)
        };
        match status {
            abi::OK => Ok(()),
            abi::CAS_MISMATCH => Err(StoreError::CasMismatch),
            other => Err(StoreError::Unavailable(Status(other).to_string())),
        }
    }
}

thread_local! {
    static CAPS: OnceCell<HostCaps> = const { OnceCell::new() };
}

/// Which host this is, told by how its shared data treats a blind write: Envoy writes over an
/// existing key when no CAS is given, ngx_wasm_module refuses (CAS mismatch). Anything else is
/// treated as the more limited host.
fn caps() -> HostCaps {
    CAPS.with(|c| {
        *c.get_or_init(|| {
            const KEY: &str = "tollgate.host";
            if let Ok(None) = WasmHost.read(KEY) {
                // Whether this or another worker creates it does not matter.
                let _ = WasmHost.write(KEY, b"1", 0);
            }
            match WasmHost.write(KEY, b"1", 0) {
                Ok(()) => HostCaps::ENVOY,
                Err(StoreError::CasMismatch) => HostCaps::NGINX,
                Err(e) => {
                    log(
                        abi::LOG_WARN,
                        &format!("shared data: {e:?}; assuming a limited host"),
                    );
                    HostCaps::NGINX
                }
            }
        })
    })
}

struct Logger;

static LOGGER: Logger = Logger;

impl log::Log for Logger {
    fn enabled(&self, metadata: &log::Metadata) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let level = match record.level() {
            log::Level::Error => abi::LOG_ERROR,
            log::Level::Warn => abi::LOG_WARN,
            log::Level::Info => abi::LOG_INFO,
            log::Level::Debug => abi::LOG_DEBUG,
            log::Level::Trace => abi::LOG_TRACE,
        };
        match record.args().as_str() {
            Some(text) => log(level, text),
            None => log(level, &record.args().to_string()),
        }
    }

    fn flush(&self) {}
}

/// Route the `log` macros to the host, at info until a configuration says otherwise, and log
/// any panic at critical level before the VM stops (a last line of defence: nothing relies on
/// it, the filter code does not panic).
pub fn install_logger() {
    let _ = log::set_logger(&LOGGER);
    log::set_max_level(log::LevelFilter::Info);
    std::panic::set_hook(Box::new(|info| {
        log(abi::LOG_CRITICAL, &format!("tollgate panicked: {info}"));
    }));
}

impl Host for WasmHost {
    fn caps(&self) -> HostCaps {
        caps()
    }
    fn now_ns(&self) -> Option<u64> {
        now_ns()
    }
    fn plugin_configuration(&self) -> Result<Vec<u8>, Status> {
        plugin_configuration()
    }
    fn set_tick_period(&self, ms: u32) -> Result<(), Status> {
        set_tick_period(ms)
    }
    fn request_header(&self, name: &str) -> Option<Value<'_>> {
        request_header(name).map(Cow::Owned)
    }
    fn source_address(&self) -> Option<Value<'_>> {
        #[cfg(feature = "probe")]
        let _t = crate::probe::start("client_address");
        property(b"source\0address").map(Cow::Owned)
    }
    fn response_header(&self, name: &str) -> Option<Value<'_>> {
        response_header(name).map(Cow::Owned)
    }
    fn property(&self, path: &[u8]) -> Option<Value<'_>> {
        property(path).map(Cow::Owned)
    }
    /// The current chunk of the response body, read in the body callback.
    fn response_body(&self, size: usize) -> Option<Vec<u8>> {
        buffer(abi::BUFFER_HTTP_RESPONSE_BODY, size)
    }
    /// The request body's current chunk, read in the body callback.
    fn request_body(&self, size: usize) -> Option<Vec<u8>> {
        buffer(abi::BUFFER_HTTP_REQUEST_BODY, size)
    }
    fn add_response_header(&self, name: &str, value: &str) -> Result<(), Status> {
        add_response_header(name, value)
    }
    fn send_local_response(&self, status: u32, headers: &[u8], body: &[u8]) -> Result<(), Status> {
        send_local_response(status, headers, body)
    }
    fn continue_request(&self) -> Result<(), Status> {
        continue_request()
    }
    fn continue_response(&self) -> Result<(), Status> {
        // SAFETY: plain value.
        check(unsafe { abi::proxy_continue_stream(abi::STREAM_HTTP_RESPONSE) })
    }
    fn set_effective_context(&self, context_id: u32) -> Result<(), Status> {
        set_effective_context(context_id)
    }
    fn http_call(
        &self,
        upstream: &str,
        headers: &[u8],
        body: &[u8],
        timeout_ms: u32,
    ) -> Result<u32, Status> {
        http_call(upstream, headers, body, timeout_ms)
    }
    fn call_response_header(&self, name: &str) -> Option<Value<'_>> {
        call_response_header(name).map(Cow::Owned)
    }
    /// The body of the answer to an HTTP call, read in its response callback.
    fn call_response_body(&self, size: usize) -> Option<Vec<u8>> {
        buffer(abi::BUFFER_HTTP_CALL_RESPONSE_BODY, size)
    }
    fn define_metric(&self, kind: MetricKind, name: &str) -> Result<u32, Status> {
        define_metric(kind, name)
    }
    fn increment_metric(&self, id: u32, by: i64) -> Result<(), Status> {
        increment_metric(id, by)
    }
    fn record_metric(&self, id: u32, value: u64) -> Result<(), Status> {
        record_metric(id, value)
    }
}
