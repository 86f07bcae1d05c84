//! The callbacks the host enters: each export hands its arguments to the lifecycle's [`Contexts`]
//! (host-independent) with the wasm host, and turns the answer into the ABI's numbers. No
//! decision is made here.

use crate::abi;
use crate::host::{self, WasmHost};
use crate::lifecycle::{Action, Contexts};

thread_local! {
    static CONTEXTS: Contexts<WasmHost> = Contexts::new(WasmHost);
}

fn action(a: Action) -> u32 {
    match a {
        Action::Continue => abi::ACTION_CONTINUE,
        Action::Pause => abi::ACTION_PAUSE,
        Action::HoldBody => abi::ACTION_HOLD_BODY,
    }
}

#[cfg(target_os = "wasi")]
extern "C" {
    fn __wasm_call_ctors();
}

/// The reactor's entry: run static constructors, then set up logging and the panic hook.
#[no_mangle]
pub extern "C" fn _initialize() {
    #[cfg(target_os = "wasi")]
    // SAFETY: called once, by the host, before any other export.
    unsafe {
        __wasm_call_ctors()
    };
    host::install_logger();
}

#[no_mangle]
pub extern "C" fn proxy_on_context_create(context_id: u32, parent_id: u32) {
    #[cfg(feature = "probe")]
    let _t = (parent_id != 0).then(|| crate::probe::start("create"));
    CONTEXTS.with(|c| c.create(context_id, parent_id));
}

#[no_mangle]
pub extern "C" fn proxy_on_vm_start(_root_id: u32, _vm_configuration_size: usize) -> u32 {
    1
}

#[no_mangle]
pub extern "C" fn proxy_on_configure(root_id: u32, _configuration_size: usize) -> u32 {
    u32::from(CONTEXTS.with(|c| c.configure(root_id)))
}

#[no_mangle]
pub extern "C" fn proxy_on_tick(root_id: u32) {
    CONTEXTS.with(|c| c.tick(root_id));
}

#[no_mangle]
pub extern "C" fn proxy_on_request_headers(
    context_id: u32,
    _num_headers: usize,
    end_of_stream: u32,
) -> u32 {
    #[cfg(feature = "probe")]
    let _t = crate::probe::start("request");
    // What a timer adds of its own: subtracted by the benchmark report.
    #[cfg(feature = "probe")]
    drop(crate::probe::start("timer"));
    action(CONTEXTS.with(|c| c.request_headers(context_id, end_of_stream != 0)))
}

#[no_mangle]
pub extern "C" fn proxy_on_response_headers(
    context_id: u32,
    _num_headers: usize,
    _end_of_stream: u32,
) -> u32 {
    #[cfg(feature = "probe")]
    let _t = crate::probe::start("response");
    action(CONTEXTS.with(|c| c.response_headers(context_id)))
}

#[no_mangle]
pub extern "C" fn proxy_on_request_trailers(context_id: u32, _trailers: usize) -> u32 {
    action(CONTEXTS.with(|c| c.request_trailers(context_id)))
}

#[no_mangle]
pub extern "C" fn proxy_on_request_body(context_id: u32, size: usize, end: u32) -> u32 {
    action(CONTEXTS.with(|c| c.request_body(context_id, size, end != 0)))
}

#[no_mangle]
pub extern "C" fn proxy_on_response_body(context_id: u32, size: usize, end: u32) -> u32 {
    action(CONTEXTS.with(|c| c.response_body(context_id, size, end != 0)))
}

#[no_mangle]
pub extern "C" fn proxy_on_log(context_id: u32) {
    #[cfg(feature = "probe")]
    let _t = crate::probe::start("log");
    CONTEXTS.with(|c| c.log(context_id));
}

#[no_mangle]
pub extern "C" fn proxy_on_done(context_id: u32) -> u32 {
    CONTEXTS.with(|c| c.done(context_id));
    1
}

#[no_mangle]
pub extern "C" fn proxy_on_delete(context_id: u32) {
    CONTEXTS.with(|c| c.delete(context_id));
}

#[no_mangle]
pub extern "C" fn proxy_on_http_call_response(
    context_id: u32,
    token: u32,
    num_headers: usize,
    body_size: usize,
    _num_trailers: usize,
) {
    CONTEXTS.with(|c| c.call_response(context_id, token, num_headers, body_size));
}

// Callbacks tollgate has no use for. ngx_wasm_module calls some of them without checking that
// the module exports them (a missing `proxy_on_response_body` crashes the nginx worker), so
// every HTTP callback is exported and lets the stream go on.

#[no_mangle]
pub extern "C" fn proxy_on_response_trailers(_context_id: u32, _trailers: usize) -> u32 {
    abi::ACTION_CONTINUE
}

#[no_mangle]
pub extern "C" fn proxy_on_queue_ready(_root_id: u32, _queue_id: u32) {}
