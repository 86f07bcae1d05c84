//! Envoy's dynamic-module ABI as this module sees it: the types and the callbacks it calls, written
//! from the header of ABI "v0.2.0" (envoyproxy/envoy `source/extensions/dynamic_modules/abi/abi.h`),
//! whose every callback the pinned Envoy 1.40.0 exports. Only what the module uses is declared: a
//! callback declared here that an Envoy lacks makes loading fail (the library is linked with
//! `-z now`), never a call into nothing. Enums are plain integers, so no value Envoy returns can be
//! an invalid Rust enum.

use std::ffi::c_void;

/// The ABI version this module is written against (logged by Envoy; a mismatch only warns).
pub const ABI_VERSION: &[u8] = b"v0.2.0\0";

pub type ConfigEnvoy = *mut c_void;
pub type FilterEnvoy = *mut c_void;
pub type Scheduler = *mut c_void;

/// Bytes Envoy owns, valid as each callback says (at most until the current hook returns).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyBuffer {
    pub ptr: *const u8,
    pub length: usize,
}

impl Default for EnvoyBuffer {
    fn default() -> Self {
        Self {
            ptr: std::ptr::null(),
            length: 0,
        }
    }
}

impl EnvoyBuffer {
    /// The bytes, borrowed for as long as the caller says Envoy keeps them.
    ///
    /// # Safety
    /// `ptr` must point at `length` bytes (or be null) that outlive `'a`.
    pub unsafe fn bytes<'a>(&self) -> &'a [u8] {
        if self.ptr.is_null() || self.length == 0 {
            return &[];
        }
        // SAFETY: the caller's promise.
        unsafe { std::slice::from_raw_parts(self.ptr, self.length) }
    }
}

/// Bytes the module owns, read by Envoy during the call.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ModuleBuffer {
    pub ptr: *const u8,
    pub length: usize,
}

impl ModuleBuffer {
    pub fn of(bytes: &[u8]) -> Self {
        Self {
            ptr: bytes.as_ptr(),
            length: bytes.len(),
        }
    }
}

/// A header the module hands to Envoy (copied during the call).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ModuleHeader {
    pub key_ptr: *const u8,
    pub key_length: usize,
    pub value_ptr: *const u8,
    pub value_length: usize,
}

impl ModuleHeader {
    pub fn of(key: &[u8], value: &[u8]) -> Self {
        Self {
            key_ptr: key.as_ptr(),
            key_length: key.len(),
            value_ptr: value.as_ptr(),
            value_length: value.len(),
        }
    }
}

/// A header Envoy hands to the module (an HTTP callout's answer).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct EnvoyHeader {
    pub key_ptr: *const u8,
    pub key_length: usize,
    pub value_ptr: *const u8,
    pub value_length: usize,
}

// envoy_dynamic_module_type_log_level
pub const LOG_TRACE: u32 = 0;
pub const LOG_DEBUG: u32 = 1;
pub const LOG_INFO: u32 = 2;
pub const LOG_WARN: u32 = 3;
pub const LOG_ERROR: u32 = 4;
pub const LOG_CRITICAL: u32 = 5;

// envoy_dynamic_module_type_http_header_type
pub const REQUEST_HEADER: u32 = 0;
pub const RESPONSE_HEADER: u32 = 2;

// envoy_dynamic_module_type_http_body_type
pub const RECEIVED_REQUEST_BODY: u32 = 0;
pub const RECEIVED_RESPONSE_BODY: u32 = 2;

// envoy_dynamic_module_type_metadata_source
pub const METADATA_DYNAMIC: u32 = 0;

// envoy_dynamic_module_type_attribute_id
pub const ATTRIBUTE_SOURCE_ADDRESS: u32 = 24;

// envoy_dynamic_module_type_http_callout_init_result
pub const CALLOUT_SUCCESS: u32 = 0;
// envoy_dynamic_module_type_http_callout_result
pub const CALLOUT_RESULT_SUCCESS: u32 = 0;

// envoy_dynamic_module_type_metrics_result
pub const METRICS_SUCCESS: u32 = 0;

// The hooks' statuses are Envoy's own: FilterHeadersStatus, FilterDataStatus, FilterTrailersStatus.
pub const HEADERS_CONTINUE: u32 = 0;
pub const HEADERS_STOP_ITERATION: u32 = 1;
pub const BODY_CONTINUE: u32 = 0;
pub const BODY_STOP_AND_BUFFER: u32 = 1;
pub const BODY_STOP_AND_WATERMARK: u32 = 2;
pub const TRAILERS_CONTINUE: u32 = 0;
pub const TRAILERS_STOP_ITERATION: u32 = 1;

#[cfg(not(any(test, feature = "fake-envoy")))]
pub use self::envoy::*;
#[cfg(any(test, feature = "fake-envoy"))]
pub use crate::fake_envoy::callbacks::*;

/// The callbacks, as Envoy exports them.
#[cfg(not(any(test, feature = "fake-envoy")))]
mod envoy {
    use super::*;

    extern "C" {
        #[link_name = "envoy_dynamic_module_callback_log_v2"]
        pub fn log(level: u32, message: ModuleBuffer, source_file: ModuleBuffer, source_line: u32);
        #[link_name = "envoy_dynamic_module_callback_log_enabled"]
        pub fn log_enabled(level: u32) -> bool;
        #[link_name = "envoy_dynamic_module_callback_get_concurrency"]
        pub fn get_concurrency() -> u32;

        #[link_name = "envoy_dynamic_module_callback_http_get_header"]
        pub fn get_header(
            filter: FilterEnvoy,
            header_type: u32,
            key: ModuleBuffer,
            result: *mut EnvoyBuffer,
            index: usize,
            optional_size: *mut usize,
        ) -> bool;
        #[link_name = "envoy_dynamic_module_callback_http_add_header"]
        pub fn add_header(
            filter: FilterEnvoy,
            header_type: u32,
            key: ModuleBuffer,
            value: ModuleBuffer,
        ) -> bool;
        #[link_name = "envoy_dynamic_module_callback_http_send_response"]
        pub fn send_response(
            filter: FilterEnvoy,
            status_code: u32,
            headers: *mut ModuleHeader,
            headers_size: usize,
            body: ModuleBuffer,
            details: ModuleBuffer,
        );
        #[link_name = "envoy_dynamic_module_callback_http_filter_continue_decoding"]
        pub fn continue_decoding(filter: FilterEnvoy);
        #[link_name = "envoy_dynamic_module_callback_http_filter_continue_encoding"]
        pub fn continue_encoding(filter: FilterEnvoy);

        #[link_name = "envoy_dynamic_module_callback_http_get_body_size"]
        pub fn get_body_size(filter: FilterEnvoy, body_type: u32) -> usize;
        #[link_name = "envoy_dynamic_module_callback_http_get_body_chunks_size"]
        pub fn get_body_chunks_size(filter: FilterEnvoy, body_type: u32) -> usize;
        #[link_name = "envoy_dynamic_module_callback_http_get_body_chunks"]
        pub fn get_body_chunks(
            filter: FilterEnvoy,
            body_type: u32,
            result: *mut EnvoyBuffer,
        ) -> bool;

        #[link_name = "envoy_dynamic_module_callback_http_get_metadata_string"]
        pub fn get_metadata_string(
            filter: FilterEnvoy,
            source: u32,
            namespace: ModuleBuffer,
            key: ModuleBuffer,
            result: *mut EnvoyBuffer,
        ) -> bool;
        #[link_name = "envoy_dynamic_module_callback_http_get_metadata_number"]
        pub fn get_metadata_number(
            filter: FilterEnvoy,
            source: u32,
            namespace: ModuleBuffer,
            key: ModuleBuffer,
            result: *mut f64,
        ) -> bool;
        #[link_name = "envoy_dynamic_module_callback_http_filter_get_attribute_string"]
        pub fn get_attribute_string(filter: FilterEnvoy, id: u32, result: *mut EnvoyBuffer)
            -> bool;
        #[link_name = "envoy_dynamic_module_callback_http_filter_get_worker_index"]
        pub fn get_worker_index(filter: FilterEnvoy) -> u32;

        #[link_name = "envoy_dynamic_module_callback_http_filter_scheduler_new"]
        pub fn filter_scheduler_new(filter: FilterEnvoy) -> Scheduler;
        #[link_name = "envoy_dynamic_module_callback_http_filter_scheduler_commit"]
        pub fn filter_scheduler_commit(scheduler: Scheduler, event_id: u64);
        #[link_name = "envoy_dynamic_module_callback_http_filter_scheduler_delete"]
        pub fn filter_scheduler_delete(scheduler: Scheduler);
        #[link_name = "envoy_dynamic_module_callback_http_filter_config_scheduler_new"]
        pub fn config_scheduler_new(config: ConfigEnvoy) -> Scheduler;
        #[link_name = "envoy_dynamic_module_callback_http_filter_config_scheduler_commit"]
        pub fn config_scheduler_commit(scheduler: Scheduler, event_id: u64);
        #[link_name = "envoy_dynamic_module_callback_http_filter_config_scheduler_delete"]
        pub fn config_scheduler_delete(scheduler: Scheduler);

        #[link_name = "envoy_dynamic_module_callback_http_filter_http_callout"]
        pub fn filter_callout(
            filter: FilterEnvoy,
            callout_id: *mut u64,
            cluster: ModuleBuffer,
            headers: *mut ModuleHeader,
            headers_size: usize,
            body: ModuleBuffer,
            timeout_ms: u64,
        ) -> u32;
        #[link_name = "envoy_dynamic_module_callback_http_filter_config_http_callout"]
        pub fn config_callout(
            config: ConfigEnvoy,
            callout_id: *mut u64,
            cluster: ModuleBuffer,
            headers: *mut ModuleHeader,
            headers_size: usize,
            body: ModuleBuffer,
            timeout_ms: u64,
        ) -> u32;

        #[link_name = "envoy_dynamic_module_callback_http_filter_config_define_counter"]
        pub fn define_counter(
            config: ConfigEnvoy,
            name: ModuleBuffer,
            label_names: *mut ModuleBuffer,
            label_names_length: usize,
            id: *mut usize,
        ) -> u32;
        #[link_name = "envoy_dynamic_module_callback_http_filter_config_define_gauge"]
        pub fn define_gauge(
            config: ConfigEnvoy,
            name: ModuleBuffer,
            label_names: *mut ModuleBuffer,
            label_names_length: usize,
            id: *mut usize,
        ) -> u32;
        #[link_name = "envoy_dynamic_module_callback_http_filter_config_increment_counter"]
        pub fn increment_counter(
            config: ConfigEnvoy,
            id: usize,
            label_values: *mut ModuleBuffer,
            label_values_length: usize,
            value: u64,
        ) -> u32;
        #[link_name = "envoy_dynamic_module_callback_http_filter_config_set_gauge"]
        pub fn set_gauge(
            config: ConfigEnvoy,
            id: usize,
            label_values: *mut ModuleBuffer,
            label_values_length: usize,
            value: u64,
        ) -> u32;
    }
}
