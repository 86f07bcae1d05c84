//! Profiling and test builds (`--features probe`): nanoseconds spent and heap allocations made in
//! each hook, handed to Envoy counters `tollgate.probe.<hook>.{ns,allocs,calls}` every 1000 calls;
//! and (in `hooks`) a request header, `x-tollgate-panic`, that makes the request hook panic.

use crate::abi;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

thread_local! {
    /// Heap allocations this thread made (the module's own: Envoy's allocator is not this one).
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

struct Counting;

// SAFETY: forwards to the system allocator unchanged; only counts calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|a| a.set(a.get() + 1));
        // SAFETY: the caller's contract is passed on as is.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCS.try_with(|a| a.set(a.get() + 1));
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

#[derive(Clone, Copy)]
pub enum Hook {
    Create,
    Request,
    Response,
    Log,
}

const HOOKS: [&str; 4] = ["create", "request", "response", "log"];

/// Per hook: the Envoy ids of its three counters, and the sums since the last hand-over.
struct Sums {
    ids: [AtomicUsize; 3],
    ns: AtomicU64,
    allocs: AtomicU64,
    calls: AtomicU64,
}

#[allow(clippy::declare_interior_mutable_const)]
const SUMS_INIT: Sums = Sums {
    ids: [
        AtomicUsize::new(0),
        AtomicUsize::new(0),
        AtomicUsize::new(0),
    ],
    ns: AtomicU64::new(0),
    allocs: AtomicU64::new(0),
    calls: AtomicU64::new(0),
};
static SUMS: [Sums; 4] = [SUMS_INIT; 4];
/// The configuration whose counters they are (the first one made).
static CONFIG: AtomicUsize = AtomicUsize::new(0);

/// Define the probe's counters for `config` (in config_new, where Envoy takes definitions).
pub fn define(config: abi::ConfigEnvoy) {
    if CONFIG
        .compare_exchange(0, config as usize, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        return;
    }
    for (hook, sums) in HOOKS.iter().zip(&SUMS) {
        for (stat, id) in ["ns", "allocs", "calls"].iter().zip(&sums.ids) {
            let name = format!("tollgate.probe.{hook}.{stat}");
            let mut out = 0;
            // SAFETY: the name outlives the call; Envoy writes one id.
            unsafe {
                abi::define_counter(
                    config,
                    abi::ModuleBuffer::of(name.as_bytes()),
                    std::ptr::null_mut(),
                    0,
                    &mut out,
                )
            };
            id.store(out, Ordering::Release);
        }
    }
}

pub struct Timer(Hook, Instant, u64);

pub fn start(hook: Hook) -> Timer {
    Timer(hook, Instant::now(), ALLOCS.with(Cell::get))
}

impl Drop for Timer {
    fn drop(&mut self) {
        let spent = u64::try_from(self.1.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let allocs = ALLOCS.with(Cell::get).saturating_sub(self.2);
        let sums = &SUMS[self.0 as usize];
        sums.ns.fetch_add(spent, Ordering::Relaxed);
        sums.allocs.fetch_add(allocs, Ordering::Relaxed);
        if sums.calls.fetch_add(1, Ordering::AcqRel) + 1 < 1000 {
            return;
        }
        let taken = [
            sums.ns.swap(0, Ordering::AcqRel),
            sums.allocs.swap(0, Ordering::AcqRel),
            sums.calls.swap(0, Ordering::AcqRel),
        ];
        let config = CONFIG.load(Ordering::Acquire) as abi::ConfigEnvoy;
        for (id, n) in sums.ids.iter().zip(taken) {
            let id = id.load(Ordering::Acquire);
            // SAFETY: plain values; a lost count is only a lost count.
            let _ = unsafe { abi::increment_counter(config, id, std::ptr::null_mut(), 0, n) };
        }
    }
}
