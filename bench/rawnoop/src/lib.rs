//! A module that does nothing on the raw proxy-wasm ABI, with no SDK and no per-request context
//! object. By default it exports only what Envoy needs to run an HTTP filter, so Envoy enters it
//! twice per request: Envoy with it minus Envoy without it is the floor of any Wasm filter. With
//! `every-callback` it exports every callback tollgate does (as a module that also runs in nginx
//! must), so Envoy enters it as often as tollgate: tollgate minus it is tollgate's own work.
//! With `reads-path` it also reads `:path` (what a rule that matches no request must read), and
//! with `per-ip-calls` it makes exactly the host calls tollgate's per-client-IP rule makes per
//! request (the client address, the time, two response headers) and nothing else: the floor
//! of those setups, set by the host.

#[no_mangle]
pub extern "C" fn proxy_abi_version_0_2_1() {}

/// The host copies data it hands over (the configuration) into memory it asks for here.
#[no_mangle]
pub extern "C" fn proxy_on_memory_allocate(size: usize) -> *mut u8 {
    // A boxed slice of exactly `size` bytes, so that it can be freed as one.
    Box::into_raw(vec![0u8; size].into_boxed_slice()) as *mut u8
}

#[no_mangle]
pub extern "C" fn proxy_on_context_create(_context_id: u32, _parent_id: u32) {}

#[no_mangle]
pub extern "C" fn proxy_on_request_headers(_context_id: u32, _headers: usize, _end: u32) -> u32 {
    #[cfg(feature = "reads-path")]
    host::drop_returned(|data, size| unsafe {
        host::proxy_get_header_map_value(0, ":path".as_ptr(), 5, data, size)
    });
    #[cfg(feature = "per-ip-calls")]
    {
        let path = b"source\0address";
        host::drop_returned(|data, size| unsafe {
            host::proxy_get_property(path.as_ptr(), path.len(), data, size)
        });
        let mut now = 0u64;
        unsafe { host::proxy_get_current_time_nanoseconds(&mut now) };
        std::hint::black_box(now);
    }
    0
}

#[cfg(any(feature = "reads-path", feature = "per-ip-calls"))]
#[allow(dead_code)] // each feature uses some of these
mod host {
    extern "C" {
        pub fn proxy_get_header_map_value(
            map: u32,
            key: *const u8,
            key_size: usize,
            value: *mut *mut u8,
            value_size: *mut usize,
        ) -> u32;
        pub fn proxy_get_property(
            path: *const u8,
            path_size: usize,
            value: *mut *mut u8,
            value_size: *mut usize,
        ) -> u32;
        pub fn proxy_get_current_time_nanoseconds(time: *mut u64) -> u32;
        pub fn proxy_add_header_map_value(
            map: u32,
            key: *const u8,
            key_size: usize,
            value: *const u8,
            value_size: usize,
        ) -> u32;
    }

    /// Make a call that returns data and free what the host allocated for it.
    pub fn drop_returned(call: impl FnOnce(*mut *mut u8, *mut usize) -> u32) {
        let mut data: *mut u8 = std::ptr::null_mut();
        let mut size = 0usize;
        if call(&mut data, &mut size) == 0 && !data.is_null() && size > 0 {
            // SAFETY: allocated by `proxy_on_memory_allocate` as a boxed slice of `size` bytes.
            drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(data, size)) });
        }
    }
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
        // The two draft headers, as long as tollgate's for the benchmark's rule.
        #[cfg(feature = "per-ip-calls")]
        for (name, value) in [
            ("ratelimit-policy", "\"bench\";q=1000000000;w=60"),
            ("ratelimit", "\"bench\";r=999999999;t=0"),
        ] {
            unsafe {
                super::host::proxy_add_header_map_value(
                    2,
                    name.as_ptr(),
                    name.len(),
                    value.as_ptr(),
                    value.len(),
                )
            };
        }
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
