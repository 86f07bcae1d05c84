//! Every call into the host, made safe: what the host returns is bytes (never assumed to be
//! UTF-8), every status is handled and handed back as a `Result` or `Option`, and nothing here
//! panics. The logger and the last-resort panic hook live here too.

use crate::abi;
use crate::config::{HostCaps, LogLevel};
use crate::request::RequestView;
use std::cell::OnceCell;
use std::fmt;
use tollgate_core::{CasStore, StoreError};

/// A status other than OK, as the host returned it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Status(pub u32);

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
pub fn now_ns() -> Option<u64> {
    let mut t: u64 = 0;
    // SAFETY: the host writes one u64.
    check(unsafe { abi::proxy_get_current_time_nanoseconds(&mut t) }).ok()?;
    Some(t)
}

pub fn set_tick_period(ms: u32) -> Result<(), Status> {
    // SAFETY: plain value.
    check(unsafe { abi::proxy_set_tick_period_milliseconds(ms) })
}

/// The plugin configuration's bytes (empty if there is none).
pub fn plugin_configuration() -> Result<Vec<u8>, Status> {
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
pub fn request_header(name: &str) -> Option<Vec<u8>> {
    map_value(abi::MAP_HTTP_REQUEST_HEADERS, name)
}

/// A response header (or `:status`) by lower-case name, read in the response callback.
pub fn response_header(name: &str) -> Option<Vec<u8>> {
    map_value(abi::MAP_HTTP_RESPONSE_HEADERS, name)
}

/// A header of the answer to an HTTP call, read in its response callback.
pub fn call_response_header(name: &str) -> Option<Vec<u8>> {
    map_value(abi::MAP_HTTP_CALL_RESPONSE_HEADERS, name)
}

/// The body of the answer to an HTTP call, read in its response callback.
pub fn call_response_body(size: usize) -> Option<Vec<u8>> {
    returned(|data, out_size| {
        // SAFETY: out-pointers valid for one write each.
        unsafe {
            abi::proxy_get_buffer_bytes(
                abi::BUFFER_HTTP_CALL_RESPONSE_BODY,
                0,
                size,
                data,
                out_size,
            )
        }
    })
    .ok()
    .flatten()
}

pub fn add_response_header(name: &str, value: &str) -> Result<(), Status> {
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
pub fn property(path: &[u8]) -> Option<Vec<u8>> {
    returned(|data, size| {
        // SAFETY: the path is valid for its length; out-pointers valid for one write each.
        unsafe { abi::proxy_get_property(path.as_ptr(), path.len(), data, size) }
    })
    .ok()
    .flatten()
}

pub fn define_metric(kind: u32, name: &str) -> Result<u32, Status> {
    let mut id = 0;
    // SAFETY: the name is valid for its length; the host writes one u32.
    check(unsafe { abi::proxy_define_metric(kind, name.as_ptr(), name.len(), &mut id) })?;
    Ok(id)
}

pub fn increment_metric(id: u32, by: i64) -> Result<(), Status> {
    // SAFETY: plain values.
    check(unsafe { abi::proxy_increment_metric(id, by) })
}

pub fn record_metric(id: u32, value: u64) -> Result<(), Status> {
    // SAFETY: plain values.
    check(unsafe { abi::proxy_record_metric(id, value) })
}

/// Start an HTTP call; its answer arrives in the calling context's call-response callback.
/// `headers` is a serialized header map ([`crate::header_map`]).
pub fn http_call(
    upstream: &str,
    headers: &[u8],
    body: &[u8],
    timeout_ms: u32,
) -> Result<u32, Status> {
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
pub fn send_local_response(status: u32, headers: &[u8], body: &[u8]) -> Result<(), Status> {
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
pub fn continue_request() -> Result<(), Status> {
    // SAFETY: plain value.
    check(unsafe { abi::proxy_continue_stream(abi::STREAM_HTTP_REQUEST) })
}

/// Make another context current (to resume it from the plugin's timer; Envoy only).
pub fn set_effective_context(context_id: u32) -> Result<(), Status> {
    // SAFETY: plain value.
    check(unsafe { abi::proxy_set_effective_context(context_id) })
}

/// The host's shared data, seen through the core's store trait.
pub struct SharedData;

impl CasStore for SharedData {
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
pub fn caps() -> HostCaps {
    CAPS.with(|c| {
        *c.get_or_init(|| {
            const KEY: &str = "tollgate.host";
            if let Ok(None) = SharedData.read(KEY) {
                // Whether this or another worker creates it does not matter.
                let _ = SharedData.write(KEY, b"1", 0);
            }
            match SharedData.write(KEY, b"1", 0) {
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

/// The request as the host shows it.
pub struct HostRequest {
    pub caps: HostCaps,
}

impl RequestView for HostRequest {
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        request_header(name)
    }

    fn source_address(&self) -> Option<Vec<u8>> {
        #[cfg(feature = "probe")]
        let _t = crate::probe::start("client_address");
        property(b"source\0address")
    }

    fn authority(&self) -> Option<Vec<u8>> {
        let (first, then) = if self.caps.authority_is_request_host {
            (":authority", "host")
        } else {
            ("host", ":authority")
        };
        request_header(first).or_else(|| request_header(then))
    }
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

/// The filter's own level: messages below it are never formatted. One per VM: the last
/// configuration loaded sets it.
pub fn set_log_level(level: LogLevel) {
    log::set_max_level(match level {
        LogLevel::Error => log::LevelFilter::Error,
        LogLevel::Warn => log::LevelFilter::Warn,
        LogLevel::Info => log::LevelFilter::Info,
        LogLevel::Debug => log::LevelFilter::Debug,
    });
}
