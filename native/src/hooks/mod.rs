//! The hooks Envoy calls (`envoy_dynamic_module_on_*`): each finds its worker and hands its
//! arguments to the lifecycle's `Contexts`, turning the answer into the ABI's numbers. Every hook
//! is guarded: a panic is caught, logged and counted, and the request it was deciding is answered
//! 503 (as the Wasm build's `fail_open: false` does when its VM fails), never unwound into Envoy.

use crate::abi::{self, EnvoyBuffer, FilterEnvoy};
use crate::config::ModuleConfig;
use crate::links::Op;
use crate::worker::{known_worker, this_worker, Worker};
use std::ffi::{c_char, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use tollgate::lifecycle::Action;

mod config;
mod unused;

// (Envoy finds the hooks by their symbols; the crate's tests and fuzz harness call them.)
#[cfg(any(test, feature = "fake-envoy"))]
pub use config::*;

/// The filter name Envoy's `filter_name` must give.
const FILTER_NAME: &[u8] = b"tollgate";

/// Panics caught in hooks (each also logged at critical level).
pub static PANICS: AtomicU64 = AtomicU64::new(0);

#[cfg(test)]
thread_local! {
    static THREAD_PANICS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Panics caught on this thread (tests run side by side).
#[cfg(test)]
pub fn thread_panics() -> u64 {
    THREAD_PANICS.with(std::cell::Cell::get)
}

/// Run `f`, or on a panic count it and return `on_panic()`.
fn guarded<R>(on_panic: impl FnOnce() -> R, f: impl FnOnce() -> R) -> R {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(_) => {
            PANICS.fetch_add(1, Ordering::Relaxed);
            #[cfg(test)]
            THREAD_PANICS.with(|p| p.set(p.get() + 1));
            on_panic()
        }
    }
}

/// Panic if the request asks for it (`x-tollgate-panic`): the guard's own tests (the crate's,
/// and in Envoy with the `probe` build).
#[cfg(any(test, feature = "probe"))]
fn panic_if_asked(host: &crate::host::NativeHost) {
    use tollgate::lifecycle::Host;
    if host.request_header("x-tollgate-panic").is_some() {
        #[allow(clippy::panic)]
        {
            panic!("asked to by x-tollgate-panic");
        }
    }
}

/// Answer a request whose hook failed: 503, as a failed Wasm VM with `fail_open: false`.
fn refuse_after_panic(filter: FilterEnvoy) {
    let _ = catch_unwind(|| {
        // SAFETY: the stream's filter in its hook; Envoy copies the body and details.
        unsafe {
            abi::send_response(
                filter,
                503,
                std::ptr::null_mut(),
                0,
                abi::ModuleBuffer::of(b"tollgate: internal error\n"),
                abi::ModuleBuffer::of(b"tollgate_panic"),
            )
        }
    });
}

/// What the module gives Envoy for a stream: its id (the low 32 bits, from 2^20 up: never null)
/// and its configuration's root context in its worker (the high bits). Nothing is made for a
/// stream until its request headers come.
fn stream_handle(root: u32, id: u32) -> *const c_void {
    ((u64::from(root) << 32) | u64::from(id)) as usize as *const c_void
}

fn stream_id(module: *const c_void) -> u32 {
    (module as usize as u64 & u64::from(u32::MAX)) as u32
}

fn stream_root(module: *const c_void) -> u32 {
    ((module as usize as u64) >> 32) as u32
}

/// Run `f` for stream `module` on its worker, entered as its current context.
fn on_stream<R>(
    filter: FilterEnvoy,
    module: *const c_void,
    neutral: R,
    f: impl FnOnce(&Worker, u32) -> R,
) -> R {
    let id = stream_id(module);
    match known_worker() {
        Some(cell) => cell.with(|w| {
            let _entered = w.host().enter_stream(id, filter);
            f(w, id)
        }),
        None => neutral,
    }
}

/// [`on_stream`] for a hook that has nothing to do for a stream with no work left (forgotten once
/// its response headers left it nothing to do: most streams), which returns `neutral` before
/// asking Envoy anything.
fn on_known_stream<R: Copy>(
    filter: FilterEnvoy,
    module: *const c_void,
    neutral: R,
    f: impl FnOnce(&Worker, u32) -> R,
) -> R {
    on_stream(filter, module, neutral, |w, id| {
        if w.contexts.has_work(id) {
            f(w, id)
        } else {
            neutral
        }
    })
}

/// Run the lifecycle's `f` with the calls that complete a stream held until it returns
/// ([`crate::host::NativeHost::hold`]). (The request headers are not held: the stream is in no
/// table while they are decided, so a refusal sent at once finds nothing busy, and holding it
/// would copy the response.)
fn held<R>(w: &Worker, f: impl FnOnce(&Worker) -> R) -> R {
    let _held = w.host().hold();
    f(w)
}

/// A hook's action, noting a pause (the tick must be able to reach the stream).
fn noting_pause(w: &Worker, id: u32, action: Action) -> Action {
    if action != Action::Continue {
        w.host().paused(id);
    }
    action
}

fn headers_status(action: Action) -> u32 {
    match action {
        Action::Continue => abi::HEADERS_CONTINUE,
        // Body callbacks keep coming while the headers wait: the lifecycle holds the body back
        // or reads it (rules that read the request body), as the Wasm build with
        // `allow_on_headers_stop_iteration`.
        Action::Pause | Action::HoldBody => abi::HEADERS_STOP_ITERATION,
    }
}

fn body_status(action: Action) -> u32 {
    match action {
        Action::Continue => abi::BODY_CONTINUE,
        Action::Pause => abi::BODY_STOP_AND_BUFFER,
        Action::HoldBody => abi::BODY_STOP_AND_WATERMARK,
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const c_char {
    guarded(std::ptr::null, || {
        crate::log::install();
        stay_loaded();
        abi::ABI_VERSION.as_ptr().cast()
    })
}

/// Keep the library loaded for the process's life (as `do_not_close` would): its tick thread and
/// the workers' state outlive any one configuration, and Envoy closes a module once no
/// configuration uses it.
fn stay_loaded() {
    // SAFETY: dladdr reads the address of a function of this library and writes one Dl_info;
    // dlopen with RTLD_NOLOAD only takes another reference to the library already loaded.
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        let here = envoy_dynamic_module_on_program_init as *const c_void;
        if libc::dladdr(here, &mut info) == 0 || info.dli_fname.is_null() {
            log::warn!("cannot pin the module: removing every tollgate filter may unload it");
            return;
        }
        let flags = libc::RTLD_NOW | libc::RTLD_NOLOAD | libc::RTLD_NODELETE;
        if libc::dlopen(info.dli_fname, flags).is_null() {
            log::warn!("cannot pin the module: removing every tollgate filter may unload it");
        }
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(
    config: *const c_void,
    filter: FilterEnvoy,
) -> *const c_void {
    #[cfg(feature = "probe")]
    let _t = crate::probe::start(crate::probe::Hook::Create);
    guarded(std::ptr::null, || {
        // SAFETY: a live configuration (Envoy destroys it after its filters).
        let config = unsafe { &*config.cast::<ModuleConfig>() };
        // SAFETY: the new stream's filter, on its worker.
        let cell = this_worker(|| unsafe { abi::get_worker_index(filter) });
        cell.with(|w| {
            let Some(root) = config.root(w.index) else {
                log::error!("no configuration for worker {}", w.index);
                return std::ptr::null();
            };
            let id = w.new_stream(|id| w.contexts.has_work(id));
            stream_handle(root, id)
        })
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    filter: FilterEnvoy,
    module: *const c_void,
    end_of_stream: bool,
) -> u32 {
    #[cfg(feature = "probe")]
    let _t = crate::probe::start(crate::probe::Hook::Request);
    let panicked = || {
        refuse_after_panic(filter);
        abi::HEADERS_STOP_ITERATION
    };
    guarded(panicked, || {
        on_stream(filter, module, abi::HEADERS_CONTINUE, |w, id| {
            #[cfg(any(test, feature = "probe"))]
            panic_if_asked(w.host());
            let action = w
                .contexts
                .begin_request(id, stream_root(module), end_of_stream);
            headers_status(noting_pause(w, id, action))
        })
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    filter: FilterEnvoy,
    module: *const c_void,
    end_of_stream: bool,
) -> u32 {
    let panicked = || {
        refuse_after_panic(filter);
        abi::BODY_STOP_AND_BUFFER
    };
    guarded(panicked, || {
        on_known_stream(filter, module, abi::BODY_CONTINUE, |w, id| {
            let size = crate::host::NativeHost::received_size(filter, abi::RECEIVED_REQUEST_BODY);
            let action = held(w, |w| w.contexts.request_body(id, size, end_of_stream));
            body_status(noting_pause(w, id, action))
        })
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
    filter: FilterEnvoy,
    module: *const c_void,
) -> u32 {
    let panicked = || {
        refuse_after_panic(filter);
        abi::TRAILERS_STOP_ITERATION
    };
    guarded(panicked, || {
        on_stream(
            filter,
            module,
            abi::TRAILERS_CONTINUE,
            |w, id| match noting_pause(w, id, held(w, |w| w.contexts.request_trailers(id))) {
                Action::Continue => abi::TRAILERS_CONTINUE,
                _ => abi::TRAILERS_STOP_ITERATION,
            },
        )
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    filter: FilterEnvoy,
    module: *const c_void,
    _end_of_stream: bool,
) -> u32 {
    #[cfg(feature = "probe")]
    let _t = crate::probe::start(crate::probe::Hook::Response);
    guarded(
        || abi::HEADERS_CONTINUE,
        || {
            on_stream(filter, module, abi::HEADERS_CONTINUE, |w, id| {
                headers_status(noting_pause(
                    w,
                    id,
                    held(w, |w| w.contexts.response_headers(id)),
                ))
            })
        },
    )
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    filter: FilterEnvoy,
    module: *const c_void,
    end_of_stream: bool,
) -> u32 {
    guarded(
        || abi::BODY_CONTINUE,
        || {
            on_known_stream(filter, module, abi::BODY_CONTINUE, |w, id| {
                let size =
                    crate::host::NativeHost::received_size(filter, abi::RECEIVED_RESPONSE_BODY);
                let action = held(w, |w| w.contexts.response_body(id, size, end_of_stream));
                body_status(noting_pause(w, id, action))
            })
        },
    )
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
    _filter: FilterEnvoy,
    _module: *const c_void,
) -> u32 {
    abi::TRAILERS_CONTINUE
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    filter: FilterEnvoy,
    module: *const c_void,
) {
    #[cfg(feature = "probe")]
    let _t = crate::probe::start(crate::probe::Hook::Log);
    guarded(
        || (),
        || on_known_stream(filter, module, (), |w, id| held(w, |w| w.contexts.log(id))),
    );
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_destroy(module: *const c_void) {
    guarded(
        || (),
        || {
            let id = stream_id(module);
            if let Some(cell) = known_worker() {
                cell.with(|w| {
                    let _entered = w.host().enter_nothing();
                    w.contexts.delete(id);
                    w.host().unlink(id);
                });
            }
        },
    );
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_http_callout_done(
    filter: FilterEnvoy,
    module: *const c_void,
    callout_id: u64,
    result: u32,
    headers: *const abi::EnvoyHeader,
    headers_size: usize,
    chunks: *const EnvoyBuffer,
    chunks_size: usize,
) {
    guarded(
        || refuse_after_panic(filter),
        || {
            on_stream(filter, module, (), |w, id| {
                answer(
                    w,
                    id,
                    callout_id,
                    result,
                    (headers, headers_size),
                    (chunks, chunks_size),
                );
            })
        },
    );
}

/// Deliver a callout's answer to context `id` (a stream, or a root for the tick's calls).
fn answer(
    w: &Worker,
    id: u32,
    callout_id: u64,
    result: u32,
    (headers, headers_size): (*const abi::EnvoyHeader, usize),
    (chunks, chunks_size): (*const EnvoyBuffer, usize),
) {
    // A failed callout (reset, too large) has no headers: the lifecycle takes it as failed.
    let headers_size = match result {
        abi::CALLOUT_RESULT_SUCCESS if !headers.is_null() => headers_size,
        _ => 0,
    };
    let body_size = (0..if chunks.is_null() { 0 } else { chunks_size })
        // SAFETY: Envoy lends `chunks_size` chunks for the done hook, which is running.
        .map(|i| unsafe { (*chunks.add(i)).length })
        .sum();
    w.host()
        .answering(headers, headers_size, chunks, chunks_size);
    let token = u32::try_from(callout_id).unwrap_or(0);
    {
        let _held = w.host().hold();
        w.contexts.answer_call(id, token, headers_size, body_size);
        w.host().answered();
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(
    filter: FilterEnvoy,
    module: *const c_void,
    _event_id: u64,
) {
    guarded(
        || (),
        || {
            on_stream(filter, module, (), |w, id| {
                for op in w.host().take_ops(id) {
                    match op {
                        Op::Work => held(w, |w| w.contexts.stream_work(id)),
                        op => w.host().carry_out(id, filter, op),
                    }
                }
            })
        },
    );
}
