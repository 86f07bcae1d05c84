//! The hooks of a filter configuration: made (in every worker, or refused naming the field),
//! destroyed, ticked on Envoy's main thread, and answered for the calls its tick made.

use super::{answer, guarded, FILTER_NAME};
use crate::abi::{self, EnvoyBuffer};
use crate::config::ModuleConfig;
use crate::worker::worker;
use std::ffi::c_void;
use std::sync::Arc;

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    config_envoy: abi::ConfigEnvoy,
    name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> *const c_void {
    guarded(std::ptr::null, || {
        // SAFETY: Envoy lends both for this call.
        let (name, bytes) = unsafe { (name.bytes(), config.bytes()) };
        if name != FILTER_NAME {
            log::error!(
                "invalid configuration: filter_name {:?}: this module's filter is \"tollgate\"",
                String::from_utf8_lossy(name)
            );
            return std::ptr::null();
        }
        match crate::filters::make_config(config_envoy, bytes.to_vec()) {
            Some(config) => Arc::into_raw(config).cast(),
            None => std::ptr::null(),
        }
    })
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config: *const c_void) {
    guarded(
        || (),
        || {
            // SAFETY: the pointer config_new made from an `Arc`, handed back once.
            let config = unsafe { Arc::from_raw(config.cast::<ModuleConfig>()) };
            crate::filters::end_config(&config);
        },
    );
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(
    _config_envoy: abi::ConfigEnvoy,
    config: *const c_void,
    _event_id: u64,
) {
    guarded(
        || (),
        || {
            // SAFETY: a live configuration (its scheduler goes before it).
            let config = unsafe { &*config.cast::<ModuleConfig>() };
            crate::filters::tick(config);
        },
    );
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn envoy_dynamic_module_on_http_filter_config_http_callout_done(
    _config_envoy: abi::ConfigEnvoy,
    config: *const c_void,
    callout_id: u64,
    result: u32,
    headers: *const abi::EnvoyHeader,
    headers_size: usize,
    chunks: *const EnvoyBuffer,
    chunks_size: usize,
) {
    guarded(
        || (),
        || {
            // SAFETY: a live configuration (Envoy cancels its callouts before it goes).
            let config = unsafe { &*config.cast::<ModuleConfig>() };
            let Some(index) = config.callouts.lock().remove(&callout_id) else {
                return;
            };
            let Some(root) = config.root(index) else {
                return;
            };
            worker(index).with(|w| {
                let _entered = w.host().enter_root_away(root);
                answer(
                    w,
                    root,
                    callout_id,
                    result,
                    (headers, headers_size),
                    (chunks, chunks_size),
                );
            });
        },
    );
}
