//! An Envoy dynamic module (ABI v0.2.0) whose HTTP filter does nothing: every hook Envoy
//! requires, each answering "continue" at once. What Envoy spends entering a dynamic module per
//! request, measured beside tollgate's native build (`make bench`).

use std::ffi::{c_char, c_void};

/// A non-null pointer for Envoy to hand back: this module keeps no state.
const SOME: *const c_void = 1 as *const c_void;

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const c_char {
    b"v0.2.0\0".as_ptr().cast()
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    _config: *mut c_void,
    _name_ptr: *const u8,
    _name_len: usize,
    _config_ptr: *const u8,
    _config_len: usize,
) -> *const c_void {
    SOME
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(_config: *const c_void) {}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(
    _config: *const c_void,
    _filter: *mut c_void,
) -> *const c_void {
    SOME
}

macro_rules! continuing {
    ($($name:ident($($arg:ident: $ty:ty),*)),* $(,)?) => {
        $(
            #[no_mangle]
            pub extern "C" fn $name($($arg: $ty),*) -> u32 {
                0
            }
        )*
    };
}

macro_rules! nothing {
    ($($name:ident($($arg:ident: $ty:ty),*)),* $(,)?) => {
        $(
            #[no_mangle]
            pub extern "C" fn $name($($arg: $ty),*) {}
        )*
    };
}

continuing!(
    envoy_dynamic_module_on_http_filter_request_headers(_f: *mut c_void, _m: *const c_void, _e: bool),
    envoy_dynamic_module_on_http_filter_request_body(_f: *mut c_void, _m: *const c_void, _e: bool),
    envoy_dynamic_module_on_http_filter_request_trailers(_f: *mut c_void, _m: *const c_void),
    envoy_dynamic_module_on_http_filter_response_headers(_f: *mut c_void, _m: *const c_void, _e: bool),
    envoy_dynamic_module_on_http_filter_response_body(_f: *mut c_void, _m: *const c_void, _e: bool),
    envoy_dynamic_module_on_http_filter_response_trailers(_f: *mut c_void, _m: *const c_void),
);

nothing!(
    envoy_dynamic_module_on_http_filter_stream_complete(_f: *mut c_void, _m: *const c_void),
    envoy_dynamic_module_on_http_filter_destroy(_m: *const c_void),
    envoy_dynamic_module_on_http_filter_http_callout_done(_f: *mut c_void, _m: *const c_void, _id: u64,
        _r: u32, _h: *const c_void, _hn: usize, _b: *const c_void, _bn: usize),
    envoy_dynamic_module_on_http_filter_http_stream_headers(_f: *mut c_void, _m: *const c_void, _id: u64,
        _h: *const c_void, _hn: usize, _e: bool),
    envoy_dynamic_module_on_http_filter_http_stream_data(_f: *mut c_void, _m: *const c_void, _id: u64,
        _d: *const c_void, _dn: usize, _e: bool),
    envoy_dynamic_module_on_http_filter_http_stream_trailers(_f: *mut c_void, _m: *const c_void, _id: u64,
        _t: *const c_void, _tn: usize),
    envoy_dynamic_module_on_http_filter_http_stream_complete(_f: *mut c_void, _m: *const c_void, _id: u64),
    envoy_dynamic_module_on_http_filter_http_stream_reset(_f: *mut c_void, _m: *const c_void, _id: u64, _r: u32),
    envoy_dynamic_module_on_http_filter_scheduled(_f: *mut c_void, _m: *const c_void, _e: u64),
    envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark(_f: *mut c_void, _m: *const c_void),
    envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark(_f: *mut c_void, _m: *const c_void),
);
