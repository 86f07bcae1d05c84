//! Profiling builds (`--features probe`): nanoseconds spent and heap allocations made in each
//! callback, flushed to host counters `tollgate.probe.<callback>.{ns,allocs,calls}` every 1000
//! calls.

use crate::abi;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

/// Heap allocations so far, the host's buffers for returned data included (the host allocates
/// them through `proxy_on_memory_allocate`, i.e. this allocator).
static ALLOCS: AtomicU64 = AtomicU64::new(0);

struct Counting;

// SAFETY: forwards to the system allocator unchanged; only counts calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract is passed on as is.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Sums since the last flush and the metric ids: ns, allocations, calls.
struct Sums {
    ns: u64,
    allocs: u64,
    calls: u64,
    ids: [u32; 3],
}

thread_local! {
    static SUMS: RefCell<HashMap<&'static str, Sums>> = RefCell::new(HashMap::new());
}

pub struct Timer(&'static str, u64, u64);

pub fn start(name: &'static str) -> Timer {
    let allocs = ALLOCS.load(Ordering::Relaxed);
    Timer(name, now_ns().unwrap_or(0), allocs)
}

impl Drop for Timer {
    fn drop(&mut self) {
        let spent = now_ns().unwrap_or(0).saturating_sub(self.1);
        let allocs = ALLOCS.load(Ordering::Relaxed).saturating_sub(self.2);
        SUMS.with(|s| {
            let mut s = s.borrow_mut();
            let e = s.entry(self.0).or_insert_with(|| {
                let id = |stat: &str| {
                    let name = format!("tollgate.probe.{}.{stat}", self.0);
                    define_counter(&name)
                };
                Sums {
                    ns: 0,
                    allocs: 0,
                    calls: 0,
                    ids: [id("ns"), id("allocs"), id("calls")],
                }
            });
            e.ns += spent;
            e.allocs += allocs;
            e.calls += 1;
            if e.calls == 1000 {
                for (id, n) in e.ids.into_iter().zip([e.ns, e.allocs, e.calls]) {
                    // SAFETY: plain values; a lost count is only a lost count.
                    let _ = unsafe { abi::proxy_increment_metric(id, n as i64) };
                }
                (e.ns, e.allocs, e.calls) = (0, 0, 0);
            }
        });
    }
}

/// The host's time, straight from the ABI (the probe sits below the host layer it measures).
fn now_ns() -> Option<u64> {
    let mut t = 0;
    // SAFETY: the host writes one u64.
    (unsafe { abi::proxy_get_current_time_nanoseconds(&mut t) } == abi::OK).then_some(t)
}

fn define_counter(name: &str) -> u32 {
    let mut id = 0;
    // SAFETY: the name is valid for its length; the host writes one u32.
    unsafe { abi::proxy_define_metric(abi::METRIC_COUNTER, name.as_ptr(), name.len(), &mut id) };
    id
}
