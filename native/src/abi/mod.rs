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
pub use self::fake::callbacks::*;

/// The callbacks, as Envoy exports them.
#[cfg(not(any(test, feature = "fake-envoy")))]
mod envoy;
/// Rust's stand-in for Envoy's side (the crate's tests and fuzz targets).
#[cfg(any(test, feature = "fake-envoy"))]
pub mod fake;
