//! One filter configuration as Envoy created it: its JSON, its copy in every worker (a root
//! context each), its tick and the calls it makes without a request.

use crate::abi;
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::OnceLock;

/// An Envoy pointer that other threads may hand back to Envoy (Envoy says which thread may use
/// it; the module keeps to that).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct EnvoyPtr(pub *mut std::ffi::c_void);

// SAFETY: only an address; every use goes through a callback Envoy allows on that thread.
unsafe impl Send for EnvoyPtr {}
// SAFETY: as above.
unsafe impl Sync for EnvoyPtr {}

impl EnvoyPtr {
    pub const NULL: Self = Self(std::ptr::null_mut());
}

pub struct ModuleConfig {
    pub envoy: EnvoyPtr,
    /// The plugin JSON, as `filter_config` gave it.
    pub bytes: Vec<u8>,
    /// Each worker's root context of this configuration, by worker index.
    pub roots: OnceLock<Vec<u32>>,
    /// Envoy still accepts stat definitions (the configuration is being created).
    pub defining: AtomicBool,
    /// The tick the roots asked for, in ms (the shortest).
    pub tick_ms: AtomicU32,
    /// Set when the tick has been asked of the main thread and has not run yet.
    pub tick_pending: AtomicBool,
    /// The main thread's scheduler for this configuration (null once it goes away).
    scheduler: Mutex<EnvoyPtr>,
    /// Calls sent without a request (the tick's refills), by callout id: the worker whose root
    /// sent it.
    pub callouts: Mutex<FxHashMap<u64, u32>>,
}

impl ModuleConfig {
    pub fn new(envoy: abi::ConfigEnvoy, bytes: Vec<u8>) -> Self {
        Self {
            envoy: EnvoyPtr(envoy),
            bytes,
            roots: OnceLock::new(),
            defining: AtomicBool::new(true),
            tick_ms: AtomicU32::new(u32::MAX),
            tick_pending: AtomicBool::new(false),
            scheduler: Mutex::new(EnvoyPtr::NULL),
            callouts: Mutex::default(),
        }
    }

    /// The root context of this configuration in worker `index`.
    pub fn root(&self, index: u32) -> Option<u32> {
        self.roots.get()?.get(usize::try_from(index).ok()?).copied()
    }

    /// Make the main thread's scheduler (on the main thread, while the configuration is made).
    pub fn start_scheduler(&self) {
        // SAFETY: the configuration pointer Envoy handed to config_new, on the main thread.
        let scheduler = unsafe { abi::config_scheduler_new(self.envoy.0) };
        *self.scheduler.lock() = EnvoyPtr(scheduler);
    }

    /// Ask the main thread for a tick (from the metronome's thread), unless one is pending.
    pub fn ask_for_tick(&self) {
        if self.tick_pending.swap(true, Ordering::AcqRel) {
            return;
        }
        let scheduler = self.scheduler.lock();
        if scheduler.0.is_null() {
            return;
        }
        // SAFETY: a live scheduler (deleted under the same lock); commit may come from any thread.
        unsafe { abi::config_scheduler_commit(scheduler.0, 0) };
    }

    /// The configuration goes away: no tick is asked for any more.
    pub fn stop_scheduler(&self) {
        let mut scheduler = self.scheduler.lock();
        if !scheduler.0.is_null() {
            // SAFETY: made by config_scheduler_new and not deleted yet.
            unsafe { abi::config_scheduler_delete(scheduler.0) };
            *scheduler = EnvoyPtr::NULL;
        }
    }
}
