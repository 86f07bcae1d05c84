//! The proxy-wasm ABI 0.2.1 as the module sees it: the host functions it imports (only those
//! Envoy and ngx_wasm_module both implement with this signature) and the exports every host
//! needs. Statuses are plain `u32`: a value the host returns can never be an invalid enum.
//! Only `host` (and the `probe` build's timers) call the imports; `callbacks` has the callbacks.

use std::mem::MaybeUninit;

pub const OK: u32 = 0;
pub const NOT_FOUND: u32 = 1;
pub const CAS_MISMATCH: u32 = 8;

pub const LOG_TRACE: u32 = 0;
pub const LOG_DEBUG: u32 = 1;
pub const LOG_INFO: u32 = 2;
pub const LOG_WARN: u32 = 3;
pub const LOG_ERROR: u32 = 4;
pub const LOG_CRITICAL: u32 = 5;

pub const BUFFER_HTTP_REQUEST_BODY: u32 = 0;
pub const BUFFER_HTTP_RESPONSE_BODY: u32 = 1;
pub const BUFFER_HTTP_CALL_RESPONSE_BODY: u32 = 4;
pub const BUFFER_PLUGIN_CONFIGURATION: u32 = 7;

pub const MAP_HTTP_REQUEST_HEADERS: u32 = 0;
pub const MAP_HTTP_RESPONSE_HEADERS: u32 = 2;
pub const MAP_HTTP_CALL_RESPONSE_HEADERS: u32 = 6;

pub const STREAM_HTTP_REQUEST: u32 = 0;
pub const STREAM_HTTP_RESPONSE: u32 = 1;

pub const METRIC_COUNTER: u32 = 0;
pub const METRIC_GAUGE: u32 = 1;

pub const ACTION_CONTINUE: u32 = 0;
pub const ACTION_PAUSE: u32 = 1;
/// Body callbacks: stop passing data on; the host buffers it under flow control (Envoy's
/// StopIterationAndWatermark: its buffer limit pauses the reads, never fails the stream).
pub const ACTION_HOLD_BODY: u32 = 2;

#[link(wasm_import_module = "env")]
extern "C" {
    pub fn proxy_log(level: u32, message: *const u8, size: usize) -> u32;
    pub fn proxy_get_current_time_nanoseconds(time: *mut u64) -> u32;
    pub fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
    pub fn proxy_get_buffer_bytes(
        buffer: u32,
        start: usize,
        max_size: usize,
        data: *mut *mut u8,
        size: *mut usize,
    ) -> u32;
    pub fn proxy_get_header_map_value(
        map: u32,
        key: *const u8,
        key_size: usize,
        value: *mut *mut u8,
        value_size: *mut usize,
    ) -> u32;
    pub fn proxy_add_header_map_value(
        map: u32,
        key: *const u8,
        key_size: usize,
        value: *const u8,
        value_size: usize,
    ) -> u32;
    pub fn proxy_get_property(
        path: *const u8,
        path_size: usize,
        value: *mut *mut u8,
        value_size: *mut usize,
    ) -> u32;
    pub fn proxy_get_shared_data(
        key: *const u8,
        key_size: usize,
        value: *mut *mut u8,
        value_size: *mut usize,
        cas: *mut u32,
    ) -> u32;
    pub fn proxy_set_shared_data(
        key: *const u8,
        key_size: usize,
        value: *const u8,
        value_size: usize,
        cas: u32,
    ) -> u32;
    pub fn proxy_define_metric(kind: u32, name: *const u8, name_size: usize, id: *mut u32) -> u32;
    pub fn proxy_increment_metric(id: u32, offset: i64) -> u32;
    pub fn proxy_record_metric(id: u32, value: u64) -> u32;
    pub fn proxy_http_call(
        upstream: *const u8,
        upstream_size: usize,
        headers: *const u8,
        headers_size: usize,
        body: *const u8,
        body_size: usize,
        trailers: *const u8,
        trailers_size: usize,
        timeout_ms: u32,
        token: *mut u32,
    ) -> u32;
    pub fn proxy_send_local_response(
        status: u32,
        details: *const u8,
        details_size: usize,
        body: *const u8,
        body_size: usize,
        headers: *const u8,
        headers_size: usize,
        grpc_status: i32,
    ) -> u32;
    pub fn proxy_set_effective_context(context_id: u32) -> u32;
    pub fn proxy_continue_stream(stream: u32) -> u32;
}

/// The ABI version this module speaks.
#[no_mangle]
pub extern "C" fn proxy_abi_version_0_2_1() {}

/// Memory for data the host hands over; the host layer takes ownership of it as a `Vec<u8>` of
/// exactly `size` bytes (see `host::take`).
#[no_mangle]
pub extern "C" fn proxy_on_memory_allocate(size: usize) -> *mut u8 {
    let mut buffer: Vec<MaybeUninit<u8>> = Vec::with_capacity(size);
    // SAFETY: MaybeUninit needs no initialisation; the host writes the bytes before we read them.
    unsafe { buffer.set_len(size) };
    Box::into_raw(buffer.into_boxed_slice()) as *mut u8
}
