//! The callbacks the host enters, dispatched to root contexts (one per configuration and worker)
//! and HTTP contexts (one per request). A context the host names that is unknown, or one that is
//! busy (a re-entered callback), gets the neutral answer: nothing here can panic.

mod calls;
mod http;
mod root;

use crate::{abi, host};
use http::Http;
use log::debug;
use root::Root;
use rustc_hash::FxHashMap;
use std::cell::RefCell;

// Context ids are the host's small integers, never a client's: a fast hash (several lookups per
// request) needs no protection against chosen keys.
thread_local! {
    static ROOTS: RefCell<FxHashMap<u32, Root>> = RefCell::new(FxHashMap::default());
    /// Requests in progress. The map keeps its capacity: a new request allocates nothing.
    static STREAMS: RefCell<FxHashMap<u32, Http>> = RefCell::new(FxHashMap::default());
}

fn with_root<R>(id: u32, default: R, f: impl FnOnce(&mut Root) -> R) -> R {
    ROOTS.with(|r| match r.try_borrow_mut() {
        Ok(mut roots) => roots.get_mut(&id).map_or(default, f),
        Err(_) => {
            debug!("root context {id} entered again while busy");
            default
        }
    })
}

fn with_stream<R>(id: u32, default: R, f: impl FnOnce(&mut Http) -> R) -> R {
    STREAMS.with(|s| match s.try_borrow_mut() {
        Ok(mut streams) => streams.get_mut(&id).map_or(default, f),
        Err(_) => {
            debug!("context {id} entered again while busy");
            default
        }
    })
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
    if parent_id == 0 {
        ROOTS.with(|r| {
            if let Ok(mut roots) = r.try_borrow_mut() {
                roots.insert(context_id, Root::new());
            }
        });
        return;
    }
    let plugin = with_root(parent_id, None, |root| root.plugin());
    #[cfg(feature = "probe")]
    let _t = crate::probe::start("create");
    STREAMS.with(|s| {
        if let Ok(mut streams) = s.try_borrow_mut() {
            streams.insert(context_id, Http::new(context_id, plugin));
        }
    });
}

#[no_mangle]
pub extern "C" fn proxy_on_vm_start(_root_id: u32, _vm_configuration_size: usize) -> u32 {
    1
}

#[no_mangle]
pub extern "C" fn proxy_on_configure(root_id: u32, _configuration_size: usize) -> u32 {
    u32::from(with_root(root_id, false, Root::configure))
}

#[no_mangle]
pub extern "C" fn proxy_on_tick(root_id: u32) {
    with_root(root_id, (), Root::tick);
}

#[no_mangle]
pub extern "C" fn proxy_on_request_headers(
    context_id: u32,
    _num_headers: usize,
    _end_of_stream: u32,
) -> u32 {
    with_stream(context_id, abi::ACTION_CONTINUE, Http::on_request_headers)
}

#[no_mangle]
pub extern "C" fn proxy_on_response_headers(
    context_id: u32,
    _num_headers: usize,
    _end_of_stream: u32,
) -> u32 {
    with_stream(context_id, abi::ACTION_CONTINUE, Http::on_response_headers)
}

#[no_mangle]
pub extern "C" fn proxy_on_log(context_id: u32) {
    #[cfg(feature = "probe")]
    let _t = crate::probe::start("log");
    with_stream(context_id, (), Http::end_of_stream);
}

#[no_mangle]
pub extern "C" fn proxy_on_done(context_id: u32) -> u32 {
    with_root(context_id, (), Root::done);
    1
}

#[no_mangle]
pub extern "C" fn proxy_on_delete(context_id: u32) {
    let stream = STREAMS.with(|s| s.try_borrow_mut().ok()?.remove(&context_id));
    if let Some(mut stream) = stream {
        stream.end_of_stream();
        return;
    }
    let root = ROOTS.with(|r| r.try_borrow_mut().ok()?.remove(&context_id));
    if let Some(mut root) = root {
        root.done();
    }
}

#[no_mangle]
pub extern "C" fn proxy_on_http_call_response(
    context_id: u32,
    token: u32,
    num_headers: usize,
    body_size: usize,
    _num_trailers: usize,
) {
    // ngx_wasm_module names the context that made the call (and numbers tokens per context);
    // Envoy names the root context for every answer (and numbers tokens per VM), so a request's
    // answer is found by its token.
    let named_stream = STREAMS.with(|s| s.try_borrow().is_ok_and(|m| m.contains_key(&context_id)));
    let named_root_call = !named_stream && with_root(context_id, false, |r| r.sent(token));
    let caller = if named_stream || named_root_call {
        calls::forget(token);
        context_id
    } else {
        calls::take(token).unwrap_or(context_id)
    };
    // The caller must be current before it can read the answer or resume itself (Envoy; nginx
    // ignores this call, its current context is the caller already).
    if caller != context_id {
        let _ = host::set_effective_context(caller);
    }
    let for_stream = with_stream(caller, false, |stream| {
        stream.on_call_response(token, num_headers, body_size);
        true
    });
    if !for_stream {
        with_root(caller, (), |root| {
            root.on_call_response(token, num_headers, body_size)
        });
    }
}

// Callbacks tollgate has no use for. ngx_wasm_module calls some of them without checking that
// the module exports them (a missing `proxy_on_response_body` crashes the nginx worker), so
// every HTTP callback is exported and lets the stream go on.

#[no_mangle]
pub extern "C" fn proxy_on_request_body(_context_id: u32, _size: usize, _end: u32) -> u32 {
    abi::ACTION_CONTINUE
}

#[no_mangle]
pub extern "C" fn proxy_on_request_trailers(_context_id: u32, _trailers: usize) -> u32 {
    abi::ACTION_CONTINUE
}

#[no_mangle]
pub extern "C" fn proxy_on_response_body(_context_id: u32, _size: usize, _end: u32) -> u32 {
    abi::ACTION_CONTINUE
}

#[no_mangle]
pub extern "C" fn proxy_on_response_trailers(_context_id: u32, _trailers: usize) -> u32 {
    abi::ACTION_CONTINUE
}

#[no_mangle]
pub extern "C" fn proxy_on_queue_ready(_root_id: u32, _queue_id: u32) {}
