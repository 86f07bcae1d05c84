//! A module that does nothing on the raw proxy-wasm ABI, with no SDK and no per-request context
//! object. By default it exports only what Envoy needs to run an HTTP filter, so Envoy enters it
//! twice per request: Envoy with it minus Envoy without it is the floor of any Wasm filter. With
//! `every-callback` it exports every callback tollgate does (as a module that also runs in nginx
//! must), so Envoy enters it as often as tollgate: tollgate minus it is tollgate's own work.

#[no_mangle]
pub extern "C" fn proxy_abi_version_0_2_1() {}

/// The host copies data it hands over (the configuration) into memory it asks for here.
#[no_mangle]
pub extern "C" fn proxy_on_memory_allocate(size: usize) -> *mut u8 {
    let mut buffer = Vec::<u8>::with_capacity(size);
    let pointer = buffer.as_mut_ptr();
    std::mem::forget(buffer);
    pointer
}

#[no_mangle]
pub extern "C" fn proxy_on_context_create(_context_id: u32, _parent_id: u32) {}

#[no_mangle]
pub extern "C" fn proxy_on_request_headers(_context_id: u32, _headers: usize, _end: u32) -> u32 {
    0
}

#[cfg(feature = "every-callback")]
mod every_callback {
    #[no_mangle]
    pub extern "C" fn proxy_on_vm_start(_root_id: u32, _size: usize) -> u32 {
        1
    }

    #[no_mangle]
    pub extern "C" fn proxy_on_configure(_root_id: u32, _size: usize) -> u32 {
        1
    }

    #[no_mangle]
    pub extern "C" fn proxy_on_tick(_root_id: u32) {}

    #[no_mangle]
    pub extern "C" fn proxy_on_request_body(_context_id: u32, _size: usize, _end: u32) -> u32 {
        0
    }

    #[no_mangle]
    pub extern "C" fn proxy_on_request_trailers(_context_id: u32, _trailers: usize) -> u32 {
        0
    }

    #[no_mangle]
    pub extern "C" fn proxy_on_response_headers(
        _context_id: u32,
        _headers: usize,
        _end: u32,
    ) -> u32 {
        0
    }

    #[no_mangle]
    pub extern "C" fn proxy_on_response_body(_context_id: u32, _size: usize, _end: u32) -> u32 {
        0
    }

    #[no_mangle]
    pub extern "C" fn proxy_on_response_trailers(_context_id: u32, _trailers: usize) -> u32 {
        0
    }

    #[no_mangle]
    pub extern "C" fn proxy_on_log(_context_id: u32) {}

    #[no_mangle]
    pub extern "C" fn proxy_on_done(_context_id: u32) -> u32 {
        1
    }

    #[no_mangle]
    pub extern "C" fn proxy_on_delete(_context_id: u32) {}

    #[no_mangle]
    pub extern "C" fn proxy_on_http_call_response(
        _context_id: u32,
        _token: u32,
        _headers: usize,
        _body: usize,
        _trailers: usize,
    ) {
    }

    #[no_mangle]
    pub extern "C" fn proxy_on_queue_ready(_root_id: u32, _queue_id: u32) {}
}
