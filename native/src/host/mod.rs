//! The lifecycle's `Host` on Envoy's dynamic-module ABI, for one worker: every call into Envoy
//! made safe (what Envoy lends is read in place, every status an `Option` or a `Result`, nothing
//! panics), and what the tick does to a stream from Envoy's main thread queued for the stream's
//! own worker. The calls themselves are in `calls.rs`.

mod calls;

use crate::abi::{self, EnvoyBuffer};
use crate::config::ModuleConfig;
use crate::links::{Links, Op};
use rustc_hash::FxHashMap;
use smallvec::SmallVec;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::{Arc, LazyLock};
use tollgate::lifecycle::{Host, Status};
use tollgate_core::AtomicStore;

/// Every worker's state, in the process's own memory.
pub static STORE: LazyLock<AtomicStore> = LazyLock::new(AtomicStore::new);

/// Envoy has nothing for this call here (a stream's data read off its worker, a call without a
/// context).
const UNAVAILABLE: Status = Status(12);

/// The context Envoy entered, or the tick made current.
#[derive(Clone, Copy, Debug)]
enum Current {
    Nothing,
    Root(u32),
    Stream { id: u32, filter: abi::FilterEnvoy },
}

/// A callout's answer, lent by Envoy for its done hook.
#[derive(Clone, Copy)]
struct Answer {
    headers: *const abi::EnvoyHeader,
    headers_size: usize,
    chunks: *const EnvoyBuffer,
    chunks_size: usize,
}

/// One worker's side of the ABI; the lifecycle holds clones of it.
#[derive(Clone)]
pub struct NativeHost(Rc<WorkerHost>);

pub struct WorkerHost {
    /// The worker's index at Envoy.
    index: u32,
    current: Cell<Current>,
    /// Set while Envoy's main thread works on this worker's contexts (the tick, a
    /// configuration's answers, its making and its end): stream calls are queued then.
    away: Cell<bool>,
    links: Links,
    roots: RefCell<FxHashMap<u32, Arc<ModuleConfig>>>,
    answer: Cell<Option<Answer>>,
    /// Set while a hook's lifecycle call runs: what would complete or resume a stream at once
    /// waits in `held` until the call has returned.
    holding: Cell<bool>,
    held: RefCell<SmallVec<[(u32, abi::FilterEnvoy, Op); 1]>>,
}

/// Ends a hold ([`NativeHost::hold`]): the outermost carries out what was held.
pub struct Held<'h> {
    host: &'h NativeHost,
    outer: bool,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if self.outer {
            return;
        }
        self.host.0.holding.set(false);
        loop {
            let next = {
                let Ok(mut held) = self.host.0.held.try_borrow_mut() else {
                    return;
                };
                if held.is_empty() {
                    return;
                }
                held.remove(0)
            };
            let (id, filter, op) = next;
            self.host.carry_out(id, filter, op);
        }
    }
}

/// Restores the context current before a hook (hooks nest: a local reply completes its stream
/// inside the call that sent it).
pub struct Entered<'h> {
    host: &'h WorkerHost,
    current: Current,
    away: bool,
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        self.host.current.set(self.current);
        self.host.away.set(self.away);
    }
}

impl NativeHost {
    pub fn new(index: u32) -> Self {
        Self(Rc::new(WorkerHost {
            index,
            current: Cell::new(Current::Nothing),
            away: Cell::new(false),
            links: Links::default(),
            roots: RefCell::default(),
            answer: Cell::new(None),
            holding: Cell::new(false),
            held: RefCell::default(),
        }))
    }

    /// Hold back, until the guard goes, the calls that would make Envoy complete or resume a
    /// stream inside this one (a resumed request's response and end come at once, into a
    /// lifecycle still busy with the call that resumed it): as Envoy's Wasm host runs them
    /// after the module's callback has returned, so both builds see the same callbacks.
    pub fn hold(&self) -> Held<'_> {
        Held {
            host: self,
            outer: self.0.holding.replace(true),
        }
    }

    /// Keep `op` for the current stream if calls are held; false if it must be made now.
    fn held_back(&self, op: impl FnOnce() -> Op) -> bool {
        if !self.0.holding.get() {
            return false;
        }
        let (Current::Stream { id, filter }, false) = (self.0.current.get(), self.0.away.get())
        else {
            return false;
        };
        match self.0.held.try_borrow_mut() {
            Ok(mut held) => {
                held.push((id, filter, op()));
                true
            }
            Err(_) => false,
        }
    }

    fn enter_as(&self, current: Current, away: bool) -> Entered<'_> {
        Entered {
            host: &self.0,
            current: self.0.current.replace(current),
            away: self.0.away.replace(away),
        }
    }

    /// A hook of stream `id` on its worker.
    pub fn enter_stream(&self, id: u32, filter: abi::FilterEnvoy) -> Entered<'_> {
        self.enter_as(Current::Stream { id, filter }, false)
    }

    /// A hook with no stream to act on (the filter is detached: its destroy).
    pub fn enter_nothing(&self) -> Entered<'_> {
        self.enter_as(Current::Nothing, false)
    }

    /// The main thread works on root `id` of this worker.
    pub fn enter_root_away(&self, id: u32) -> Entered<'_> {
        self.enter_as(Current::Root(id), true)
    }

    /// Stream `id` is gone at Envoy.
    pub fn unlink(&self, id: u32) {
        self.0.links.unlink(id);
    }

    /// Stream `id` paused (on its worker, in one of its hooks): the tick can reach it from now
    /// on (streams that never pause are never linked).
    pub fn paused(&self, id: u32) {
        if let Current::Stream { filter, .. } = self.0.current.get() {
            self.0.links.pause(id, filter);
        }
    }

    /// The work queued for stream `id` (its scheduled event came).
    pub fn take_ops(&self, id: u32) -> SmallVec<[Op; 1]> {
        self.0.links.take(id)
    }

    /// Carry out `op` for stream `id` (on its worker).
    pub fn carry_out(&self, id: u32, filter: abi::FilterEnvoy, op: Op) {
        let _entered = self.enter_stream(id, filter);
        let _ = match op {
            Op::Continue => self.continue_request(),
            Op::ContinueResponse => self.continue_response(),
            Op::Respond {
                status,
                headers,
                body,
            } => self.send_local_response(status, &headers, &body),
            // The caller does the lifecycle's work.
            Op::Work => Ok(()),
        };
    }

    pub fn add_root(&self, id: u32, config: Arc<ModuleConfig>) {
        if let Ok(mut roots) = self.0.roots.try_borrow_mut() {
            roots.insert(id, config);
        }
    }

    pub fn remove_root(&self, id: u32) {
        if let Ok(mut roots) = self.0.roots.try_borrow_mut() {
            roots.remove(&id);
        }
    }

    /// A callout's answer, readable until [`Self::answered`].
    pub fn answering(
        &self,
        headers: *const abi::EnvoyHeader,
        headers_size: usize,
        chunks: *const EnvoyBuffer,
        chunks_size: usize,
    ) {
        self.0.answer.set(Some(Answer {
            headers,
            headers_size: if headers.is_null() { 0 } else { headers_size },
            chunks,
            chunks_size: if chunks.is_null() { 0 } else { chunks_size },
        }));
    }

    pub fn answered(&self) {
        self.0.answer.set(None);
    }

    fn root_config(&self) -> Option<Arc<ModuleConfig>> {
        let Current::Root(id) = self.0.current.get() else {
            return None;
        };
        self.0.roots.try_borrow().ok()?.get(&id).cloned()
    }

    /// The current stream's filter, if this is its worker in one of its hooks.
    fn here(&self) -> Option<abi::FilterEnvoy> {
        match self.0.current.get() {
            Current::Stream { filter, .. } if !self.0.away.get() => Some(filter),
            _ => None,
        }
    }

    /// Queue `op` for the current stream (the main thread's tick acts on it).
    fn queue(&self, op: Op) -> Result<(), Status> {
        let Current::Stream { id, .. } = self.0.current.get() else {
            return Err(UNAVAILABLE);
        };
        self.0.links.queue(id, op).map_err(|e| {
            log::warn!("stream {id} cannot be reached from the tick: {e:?}");
            UNAVAILABLE
        })
    }
}
