//! A filter configuration's life in the process: made in every worker's contexts (a root each,
//! on Envoy's main thread, where Envoy takes its stats), ticked, and retired.

use crate::abi;
use crate::config::ModuleConfig;
use crate::metrics;
use crate::metronome;
use crate::worker::worker;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Make configuration `bytes` in every worker; `None` if it is refused (logged with the field).
pub fn make_config(envoy: abi::ConfigEnvoy, bytes: Vec<u8>) -> Option<Arc<ModuleConfig>> {
    let config = Arc::new(ModuleConfig::new(envoy, bytes));
    #[cfg(feature = "probe")]
    crate::probe::define(envoy);
    // SAFETY: called on the main thread (config_new).
    let workers = unsafe { abi::get_concurrency() }.max(1);
    let mut roots = Vec::new();
    for index in 0..workers {
        let made = worker(index).with(|w| {
            let root = w.new_root();
            w.host().add_root(root, Arc::clone(&config));
            w.contexts.create(root, 0);
            let _entered = w.host().enter_root_away(root);
            if w.contexts.configure(root) {
                return Some(root);
            }
            w.contexts.delete(root);
            w.host().remove_root(root);
            None
        });
        match made {
            Some(root) => roots.push(root),
            None => {
                retire(&config, &roots);
                return None;
            }
        }
    }
    config.defining.store(false, Ordering::Release);
    let _ = config.roots.set(roots);
    config.start_scheduler();
    metronome::watch(&config);
    Some(config)
}

/// Run the configuration's tick in every worker (on the main thread).
pub fn tick(config: &ModuleConfig) {
    config.tick_pending.store(false, Ordering::Release);
    for (index, &root) in config.roots.get().into_iter().flatten().enumerate() {
        let index = u32::try_from(index).unwrap_or(u32::MAX);
        worker(index).with(|w| {
            let _entered = w.host().enter_root_away(root);
            w.contexts.tick(root);
        });
    }
}

/// The configuration goes away (reload, shutdown): its roots hand over their stats and let their
/// requests go, and its tick stops.
pub fn end_config(config: &Arc<ModuleConfig>) {
    config.stop_scheduler();
    retire(config, config.roots.get().map_or(&[][..], Vec::as_slice));
    config.callouts.lock().clear();
    log::info!(
        "configuration removed ({} worker(s))",
        config.roots.get().map_or(0, Vec::len)
    );
}

fn retire(config: &ModuleConfig, roots: &[u32]) {
    for (index, &root) in roots.iter().enumerate() {
        let index = u32::try_from(index).unwrap_or(u32::MAX);
        worker(index).with(|w| {
            let _entered = w.host().enter_root_away(root);
            w.contexts.delete(root);
            w.host().remove_root(root);
        });
    }
    metrics::forget(config.envoy.0);
}
