//! One Envoy worker's contexts — the lifecycle's `Contexts` with this worker's host — behind a
//! lock of its own: the worker's hooks take it, and so does Envoy's main thread when it runs the
//! worker's tick. No lock is shared by two workers.

use crate::host::NativeHost;
use parking_lot::lock_api::RawMutex as _;
use parking_lot::{Mutex, RawMutex};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use tollgate::lifecycle::Contexts;

/// Stream ids start above the roots' (a worker's roots are few: one per configuration made).
const FIRST_STREAM: u32 = 1 << 20;

pub struct Worker {
    pub index: u32,
    pub contexts: Contexts<NativeHost>,
    next_root: Cell<u32>,
    next_stream: Cell<u32>,
}

impl Worker {
    pub fn host(&self) -> &NativeHost {
        self.contexts.host()
    }

    pub fn new_root(&self) -> u32 {
        let id = self.next_root.get();
        self.next_root
            .set(id.wrapping_add(1).clamp(1, FIRST_STREAM - 1));
        id
    }

    /// A stream id no live stream of this worker has.
    pub fn new_stream(&self, in_use: impl Fn(u32) -> bool) -> u32 {
        loop {
            let id = self.next_stream.get();
            let next = id.checked_add(1).unwrap_or(FIRST_STREAM);
            self.next_stream.set(next);
            if !in_use(id) {
                return id;
            }
        }
    }
}

/// A worker's state behind a lock that its thread may take again while it holds it (a hook inside
/// a callback into Envoy). `lock_api`'s reentrant mutex asks for the thread's id on every lock,
/// a lazily made thread-local: this one uses the address of [`MINE`], which the hooks read anyway.
pub struct WorkerCell {
    raw: RawMutex,
    /// The holding thread's [`thread_token`], 0 when free. Only the holder writes its own token,
    /// so a thread reading its own token here holds the lock.
    owner: AtomicUsize,
    worker: Worker,
}

// SAFETY: everything in a `Worker` (the lifecycle's `Rc`s and `RefCell`s) is reached only
// through `with`, while this thread holds `raw`; no reference to it outlives the call, and
// nothing of it is kept outside (the hooks and the tick copy out ids and Envoy pointers only).
unsafe impl Sync for WorkerCell {}
// SAFETY: as above: the worker moves between threads only inside its lock.
unsafe impl Send for WorkerCell {}

impl WorkerCell {
    /// Run `f` with the worker held: re-entered on the same thread, the lock is already ours.
    pub fn with<R>(&self, f: impl FnOnce(&Worker) -> R) -> R {
        let me = thread_token();
        if self.owner.load(Ordering::Relaxed) == me {
            return f(&self.worker);
        }
        self.raw.lock();
        self.owner.store(me, Ordering::Relaxed);
        let _release = Release(self);
        f(&self.worker)
    }
}

/// Lets go of a [`WorkerCell`] this thread locked, when `with` returns or unwinds.
struct Release<'a>(&'a WorkerCell);

impl Drop for Release<'_> {
    fn drop(&mut self) {
        self.0.owner.store(0, Ordering::Relaxed);
        // SAFETY: made only in `with`, right after this thread locked `raw`.
        unsafe { self.0.raw.unlock() };
    }
}

/// This thread's token: the address of its [`MINE`], never 0 and no other live thread's.
fn thread_token() -> usize {
    MINE.with(|mine| std::ptr::from_ref(mine) as usize)
}

/// Every worker the process has seen, by index. Workers live as long as the process (Envoy
/// keeps the library loaded), so each is made once and leaked.
static WORKERS: Mutex<Vec<&'static WorkerCell>> = Mutex::new(Vec::new());

thread_local! {
    /// This thread's worker, once its first stream named it.
    static MINE: Cell<Option<&'static WorkerCell>> = const { Cell::new(None) };
}

/// Worker `index`, made if it is new.
pub fn worker(index: u32) -> &'static WorkerCell {
    let mut workers = WORKERS.lock();
    // Envoy's workers are numbered from 0 up to its concurrency.
    let i = usize::from(u16::try_from(index).unwrap_or(u16::MAX));
    while workers.len() <= i {
        let next = u32::try_from(workers.len()).unwrap_or(u32::MAX);
        workers.push(Box::leak(Box::new(WorkerCell {
            raw: RawMutex::INIT,
            owner: AtomicUsize::new(0),
            worker: Worker {
                index: next,
                contexts: Contexts::new(NativeHost::new(next)),
                next_root: Cell::new(1),
                next_stream: Cell::new(FIRST_STREAM),
            },
        })));
    }
    workers[i]
}

/// The worker this thread is, told by `index` the first time.
pub fn this_worker(index: impl FnOnce() -> u32) -> &'static WorkerCell {
    MINE.with(|mine| match mine.get() {
        Some(w) => w,
        None => {
            let w = worker(index());
            mine.set(Some(w));
            make_parking_record();
            w
        }
    })
}

/// Make this thread's parking record now, in its first stream's set-up. parking_lot makes it (and,
/// for the process's first, its wait table: two heap allocations) the first time the thread waits
/// for a lock; a worker waits when the main thread holds its lock for the tick, which happens at a
/// random request long after set-up, and would then allocate on that request's path.
fn make_parking_record() {
    // SAFETY: a park that validates false never sleeps; parking_lot makes the thread's record,
    // then returns `Invalid`. The key is a static's address, which no lock uses.
    static KEY: u8 = 0;
    let _ = unsafe {
        parking_lot_core::park(
            std::ptr::addr_of!(KEY) as usize,
            || false,
            || {},
            |_, _| {},
            parking_lot_core::DEFAULT_PARK_TOKEN,
            None,
        )
    };
}

/// The worker the current thread entered before (a hook that has no filter to tell it).
pub fn known_worker() -> Option<&'static WorkerCell> {
    MINE.with(Cell::get)
}
