//! What a worker knows of its paused streams at Envoy: each one's filter and scheduler, and the
//! work the tick queued for it (done on the stream's worker when its scheduled event comes).

use crate::abi;
use rustc_hash::FxHashMap;
use smallvec::SmallVec;
use std::cell::RefCell;

/// Something the tick did to a stream from the main thread, to carry out on its worker.
pub enum Op {
    Continue,
    ContinueResponse,
    Respond {
        status: u32,
        headers: Vec<u8>,
        body: Vec<u8>,
    },
    /// The lifecycle's own work for the stream ([`tollgate::lifecycle::Contexts::stream_work`]).
    Work,
}

/// One paused stream at Envoy.
struct Link {
    filter: abi::FilterEnvoy,
    scheduler: abi::Scheduler,
    ops: SmallVec<[Op; 1]>,
    /// An event is committed and has not run yet.
    posted: bool,
}

/// Why work could not be queued.
#[derive(Debug, PartialEq, Eq)]
pub enum Unreachable {
    /// The stream never paused (or is gone): nothing reaches it from the tick.
    NotLinked,
    /// The table is being changed by the caller (a re-entered call).
    Busy,
}

/// The streams of one worker that paused, by id. Streams that never pause are never here.
#[derive(Default)]
pub struct Links(RefCell<FxHashMap<u32, Link>>);

impl Links {
    /// Stream `id` paused (on its worker, in one of its hooks): the tick can reach it from now on.
    pub fn pause(&self, id: u32, filter: abi::FilterEnvoy) {
        if let Ok(mut links) = self.0.try_borrow_mut() {
            links.entry(id).or_insert_with(|| Link {
                filter,
                // SAFETY: the stream's own filter, in one of its hooks on its worker.
                scheduler: unsafe { abi::filter_scheduler_new(filter) },
                ops: SmallVec::new(),
                posted: false,
            });
        }
    }

    /// The filter of linked stream `id`.
    pub fn filter(&self, id: u32) -> Option<abi::FilterEnvoy> {
        self.0.try_borrow().ok()?.get(&id).map(|l| l.filter)
    }

    /// Queue `op` for stream `id` and make sure an event will come for it.
    pub fn queue(&self, id: u32, op: Op) -> Result<(), Unreachable> {
        let mut links = self.0.try_borrow_mut().map_err(|_| Unreachable::Busy)?;
        let link = links.get_mut(&id).ok_or(Unreachable::NotLinked)?;
        link.ops.push(op);
        if !link.posted {
            link.posted = true;
            // SAFETY: the stream's live scheduler (deleted only on its worker, which the tick
            // holds off); commit may come from any thread.
            unsafe { abi::filter_scheduler_commit(link.scheduler, u64::from(id)) };
        }
        Ok(())
    }

    /// The work queued for stream `id` (its scheduled event came).
    pub fn take(&self, id: u32) -> SmallVec<[Op; 1]> {
        let Ok(mut links) = self.0.try_borrow_mut() else {
            return SmallVec::new();
        };
        match links.get_mut(&id) {
            Some(link) => {
                link.posted = false;
                std::mem::take(&mut link.ops)
            }
            None => SmallVec::new(),
        }
    }

    /// Stream `id` is gone at Envoy: its scheduler too.
    pub fn unlink(&self, id: u32) {
        let link = self.0.try_borrow_mut().ok().and_then(|mut l| l.remove(&id));
        if let Some(link) = link {
            // SAFETY: made by filter_scheduler_new for this stream, deleted once.
            unsafe { abi::filter_scheduler_delete(link.scheduler) };
        }
    }
}
