//! The lifecycle's `Host` on Envoy's dynamic-module ABI, for one worker: every call into Envoy
//! made safe (what Envoy lends is read in place, every status an `Option` or a `Result`, nothing
//! panics), and what the tick does to a stream from Envoy's main thread queued for the stream's
//! own worker.

use crate::abi::{self, EnvoyBuffer, ModuleBuffer, ModuleHeader};
use crate::config::ModuleConfig;
use crate::metrics;
use rustc_hash::FxHashMap;
use smallvec::SmallVec;
use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::{Arc, LazyLock};
use tollgate::config::HostCaps;
use tollgate::header_map;
use tollgate::lifecycle::{Host, MetricKind, Status};
use tollgate::request::Value;
use tollgate_core::{AtomicStore, CasStore, StoreError};

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

/// What the module knows of a stream at Envoy.
struct StreamLink {
    filter: abi::FilterEnvoy,
    /// Made when the stream first pauses: the tick reaches it through this.
    scheduler: abi::Scheduler,
    ops: SmallVec<[Op; 1]>,
    /// An event is committed and has not run yet.
    posted: bool,
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
    streams: RefCell<FxHashMap<u32, StreamLink>>,
    roots: RefCell<FxHashMap<u32, Arc<ModuleConfig>>>,
    answer: Cell<Option<Answer>>,
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
            streams: RefCell::default(),
            roots: RefCell::default(),
            answer: Cell::new(None),
        }))
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

    /// Stream `id` is gone at Envoy: its scheduler too.
    pub fn unlink(&self, id: u32) {
        let link = self
            .0
            .streams
            .try_borrow_mut()
            .ok()
            .and_then(|mut s| s.remove(&id));
        if let Some(link) = link {
            if !link.scheduler.is_null() {
                // SAFETY: made by filter_scheduler_new for this stream, deleted once.
                unsafe { abi::filter_scheduler_delete(link.scheduler) };
            }
        }
    }

    /// Stream `id` paused (on its worker, in one of its hooks): the tick can reach it from now
    /// on (streams that never pause are never linked).
    pub fn paused(&self, id: u32) {
        let Current::Stream { filter, .. } = self.0.current.get() else {
            return;
        };
        let Ok(mut streams) = self.0.streams.try_borrow_mut() else {
            return;
        };
        streams.entry(id).or_insert_with(|| StreamLink {
            filter,
            // SAFETY: the stream's own filter, in one of its hooks on its worker.
            scheduler: unsafe { abi::filter_scheduler_new(filter) },
            ops: SmallVec::new(),
            posted: false,
        });
    }

    /// The work queued for stream `id` (its scheduled event came).
    pub fn take_ops(&self, id: u32) -> SmallVec<[Op; 1]> {
        let Ok(mut streams) = self.0.streams.try_borrow_mut() else {
            return SmallVec::new();
        };
        match streams.get_mut(&id) {
            Some(link) => {
                link.posted = false;
                std::mem::take(&mut link.ops)
            }
            None => SmallVec::new(),
        }
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
        let mut streams = self.0.streams.try_borrow_mut().map_err(|_| UNAVAILABLE)?;
        let link = streams.get_mut(&id).ok_or(Status::NOT_FOUND)?;
        if link.scheduler.is_null() {
            log::warn!("stream {id} cannot be reached from the tick (it never paused)");
            return Err(UNAVAILABLE);
        }
        link.ops.push(op);
        if !link.posted {
            link.posted = true;
            // SAFETY: the stream's live scheduler (deleted only on its worker, which the tick
            // holds off); commit may come from any thread.
            unsafe { abi::filter_scheduler_commit(link.scheduler, u64::from(id)) };
        }
        Ok(())
    }

    fn header(&self, map: u32, name: &str) -> Option<Value<'_>> {
        let filter = self.here()?;
        let mut out = EnvoyBuffer::default();
        // SAFETY: the stream's filter in its hook; the name outlives the call; Envoy writes one
        // buffer and nothing to a null size.
        let found = unsafe {
            abi::get_header(
                filter,
                map,
                ModuleBuffer::of(name.as_bytes()),
                &mut out,
                0,
                std::ptr::null_mut(),
            )
        };
        // SAFETY: Envoy keeps the value until the hook returns or a header of that map is set;
        // the lifecycle reads and uses it within the callback.
        found.then(|| Cow::Borrowed(unsafe { out.bytes() }))
    }

    /// The first `size` bytes of the chunk the current body hook received.
    fn received(&self, body: u32, size: usize) -> Option<Vec<u8>> {
        let filter = self.here()?;
        // SAFETY: the stream's filter in its body hook.
        let count = unsafe { abi::get_body_chunks_size(filter, body) };
        let mut chunks: SmallVec<[EnvoyBuffer; 8]> = SmallVec::new();
        chunks.resize(count, EnvoyBuffer::default());
        // SAFETY: room for `count` buffers, as Envoy said.
        if count > 0 && !unsafe { abi::get_body_chunks(filter, body, chunks.as_mut_ptr()) } {
            return None;
        }
        let mut out = Vec::with_capacity(size);
        for chunk in &chunks {
            // SAFETY: Envoy keeps the chunks until the hook returns.
            let bytes = unsafe { chunk.bytes() };
            let room = size - out.len();
            out.extend_from_slice(&bytes[..bytes.len().min(room)]);
            if out.len() == size {
                break;
            }
        }
        Some(out)
    }

    /// The size of the chunk the current body hook received.
    pub fn received_size(filter: abi::FilterEnvoy, body: u32) -> usize {
        // SAFETY: the stream's filter in its body hook.
        unsafe { abi::get_body_size(filter, body) }
    }

    fn callout(
        &self,
        cluster: &str,
        headers: &[u8],
        body: &[u8],
        timeout_ms: u32,
    ) -> Result<u32, Status> {
        let pairs = header_map::deserialize(headers).ok_or(Status::BAD_ARGUMENT)?;
        // Envoy's callouts name the authority `host`.
        let module: SmallVec<[ModuleHeader; 8]> = pairs
            .iter()
            .map(|&(k, v)| ModuleHeader::of(if k == b":authority" { b"host" } else { k }, v))
            .collect();
        let mut headers = module;
        let mut id = 0u64;
        let (cluster, body) = (ModuleBuffer::of(cluster.as_bytes()), ModuleBuffer::of(body));
        let timeout = u64::from(timeout_ms);
        let result = match (self.0.current.get(), self.here()) {
            (_, Some(filter)) => {
                // SAFETY: the stream's filter in its hook; every buffer outlives the call.
                unsafe {
                    abi::filter_callout(
                        filter,
                        &mut id,
                        cluster,
                        headers.as_mut_ptr(),
                        headers.len(),
                        body,
                        timeout,
                    )
                }
            }
            (Current::Root(_), None) => {
                let config = self.root_config().ok_or(UNAVAILABLE)?;
                // SAFETY: a live configuration (its roots go before it), on the main thread
                // (the tick); every buffer outlives the call.
                let result = unsafe {
                    abi::config_callout(
                        config.envoy.0,
                        &mut id,
                        cluster,
                        headers.as_mut_ptr(),
                        headers.len(),
                        body,
                        timeout,
                    )
                };
                if result == abi::CALLOUT_SUCCESS {
                    config.callouts.lock().insert(id, self.0.index);
                }
                result
            }
            _ => return Err(UNAVAILABLE),
        };
        match result {
            abi::CALLOUT_SUCCESS => u32::try_from(id).map_err(|_| Status::BAD_ARGUMENT),
            other => Err(Status(200 + other)),
        }
    }

    fn metadata(&self, path: &[u8]) -> Option<Value<'_>> {
        let filter = self.here()?;
        let mut segments = path.split(|&b| b == 0);
        let (Some(b"metadata"), Some(b"filter_metadata"), Some(ns), Some(key), None) = (
            segments.next(),
            segments.next(),
            segments.next(),
            segments.next(),
            segments.next(),
        ) else {
            return None;
        };
        let (ns, key) = (ModuleBuffer::of(ns), ModuleBuffer::of(key));
        let mut text = EnvoyBuffer::default();
        // SAFETY: the stream's filter in its hook; Envoy writes one buffer.
        if unsafe { abi::get_metadata_string(filter, abi::METADATA_DYNAMIC, ns, key, &mut text) } {
            // SAFETY: valid until the hook returns (no metadata is set meanwhile).
            return Some(Cow::Borrowed(unsafe { text.bytes() }));
        }
        let mut number = 0f64;
        // SAFETY: as above; Envoy writes one double.
        let found = unsafe {
            abi::get_metadata_number(filter, abi::METADATA_DYNAMIC, ns, key, &mut number)
        };
        // As the Wasm ABI hands a number over: its double's 8 bytes.
        found.then(|| Cow::Owned(number.to_le_bytes().to_vec()))
    }
}

impl CasStore for NativeHost {
    fn read(&self, key: &str) -> Result<Option<(Vec<u8>, u32)>, StoreError> {
        STORE.read(key)
    }

    fn write(&self, key: &str, value: &[u8], cas: u32) -> Result<(), StoreError> {
        STORE.write(key, value, cas)
    }

    fn read_with<R>(
        &self,
        key: &str,
        f: impl FnOnce(Option<(&[u8], u32)>) -> R,
    ) -> Result<R, StoreError> {
        STORE.read_with(key, f)
    }
}

impl Host for NativeHost {
    fn caps(&self) -> HostCaps {
        HostCaps::ENVOY_MODULE
    }

    fn now_ns(&self) -> Option<u64> {
        let since = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .ok()?;
        u64::try_from(since.as_nanos()).ok()
    }

    fn plugin_configuration(&self) -> Result<Vec<u8>, Status> {
        self.root_config()
            .map(|c| c.bytes.clone())
            .ok_or(Status::NOT_FOUND)
    }

    fn set_tick_period(&self, ms: u32) -> Result<(), Status> {
        let config = self.root_config().ok_or(UNAVAILABLE)?;
        config.tick_ms.fetch_min(ms.max(1), Ordering::AcqRel);
        Ok(())
    }

    fn request_header(&self, name: &str) -> Option<Value<'_>> {
        self.header(abi::REQUEST_HEADER, name)
    }

    fn source_address(&self) -> Option<Value<'_>> {
        let filter = self.here()?;
        let mut out = EnvoyBuffer::default();
        // SAFETY: the stream's filter in its hook; Envoy writes one buffer.
        let found =
            unsafe { abi::get_attribute_string(filter, abi::ATTRIBUTE_SOURCE_ADDRESS, &mut out) };
        // SAFETY: the address Envoy keeps for the connection, valid until the hook returns.
        found.then(|| Cow::Borrowed(unsafe { out.bytes() }))
    }

    fn property(&self, path: &[u8]) -> Option<Value<'_>> {
        self.metadata(path)
    }

    fn response_header(&self, name: &str) -> Option<Value<'_>> {
        self.header(abi::RESPONSE_HEADER, name)
    }

    fn response_body(&self, size: usize) -> Option<Vec<u8>> {
        self.received(abi::RECEIVED_RESPONSE_BODY, size)
    }

    fn request_body(&self, size: usize) -> Option<Vec<u8>> {
        self.received(abi::RECEIVED_REQUEST_BODY, size)
    }

    fn add_response_header(&self, name: &str, value: &str) -> Result<(), Status> {
        let filter = self.here().ok_or(UNAVAILABLE)?;
        let (name, value) = (
            ModuleBuffer::of(name.as_bytes()),
            ModuleBuffer::of(value.as_bytes()),
        );
        // SAFETY: the stream's filter in its hook; Envoy copies both.
        let added = unsafe { abi::add_header(filter, abi::RESPONSE_HEADER, name, value) };
        added.then_some(()).ok_or(Status::NOT_FOUND)
    }

    fn send_local_response(&self, status: u32, headers: &[u8], body: &[u8]) -> Result<(), Status> {
        let Some(filter) = self.here() else {
            return self.queue(Op::Respond {
                status,
                headers: headers.to_vec(),
                body: body.to_vec(),
            });
        };
        let pairs = header_map::pairs(headers).ok_or(Status::BAD_ARGUMENT)?;
        let mut module: SmallVec<[ModuleHeader; 8]> =
            pairs.map(|(k, v)| ModuleHeader::of(k, v)).collect();
        // SAFETY: the stream's filter in its hook; Envoy copies everything. (Envoy may complete
        // the stream inside this call: its hooks come back into the module, which takes them as
        // a busy stream's.)
        unsafe {
            abi::send_response(
                filter,
                status,
                module.as_mut_ptr(),
                module.len(),
                ModuleBuffer::of(body),
                ModuleBuffer::of(b"tollgate"),
            )
        };
        Ok(())
    }

    fn continue_request(&self) -> Result<(), Status> {
        match self.here() {
            // SAFETY: the stream's filter in its hook, on its worker.
            Some(filter) => unsafe { abi::continue_decoding(filter) },
            None => return self.queue(Op::Continue),
        }
        Ok(())
    }

    fn continue_response(&self) -> Result<(), Status> {
        match self.here() {
            // SAFETY: the stream's filter in its hook, on its worker.
            Some(filter) => unsafe { abi::continue_encoding(filter) },
            None => return self.queue(Op::ContinueResponse),
        }
        Ok(())
    }

    fn set_effective_context(&self, context_id: u32) -> Result<(), Status> {
        if let Some(filter) = self
            .0
            .streams
            .try_borrow()
            .ok()
            .and_then(|s| s.get(&context_id).map(|l| l.filter))
        {
            self.0.current.set(Current::Stream {
                id: context_id,
                filter,
            });
            return Ok(());
        }
        if self
            .0
            .roots
            .try_borrow()
            .is_ok_and(|r| r.contains_key(&context_id))
        {
            self.0.current.set(Current::Root(context_id));
            return Ok(());
        }
        Err(Status::NOT_FOUND)
    }

    fn http_call(
        &self,
        upstream: &str,
        headers: &[u8],
        body: &[u8],
        timeout_ms: u32,
    ) -> Result<u32, Status> {
        self.callout(upstream, headers, body, timeout_ms)
    }

    fn call_response_header(&self, name: &str) -> Option<Value<'_>> {
        let answer = self.0.answer.get()?;
        (0..answer.headers_size).find_map(|i| {
            // SAFETY: Envoy lent `headers_size` headers for the done hook, which is running.
            let h = unsafe { *answer.headers.add(i) };
            let key = unsafe {
                EnvoyBuffer {
                    ptr: h.key_ptr,
                    length: h.key_length,
                }
                .bytes()
            };
            let value = unsafe {
                EnvoyBuffer {
                    ptr: h.value_ptr,
                    length: h.value_length,
                }
                .bytes()
            };
            key.eq_ignore_ascii_case(name.as_bytes())
                .then_some(Cow::Borrowed(value))
        })
    }

    fn call_response_body(&self, size: usize) -> Option<Vec<u8>> {
        let answer = self.0.answer.get()?;
        let mut out = Vec::with_capacity(size);
        for i in 0..answer.chunks_size {
            // SAFETY: Envoy lent `chunks_size` chunks for the done hook, which is running.
            let bytes = unsafe { (*answer.chunks.add(i)).bytes() };
            out.extend_from_slice(&bytes[..bytes.len().min(size - out.len())]);
        }
        Some(out)
    }

    fn defer_stream_work(&self, context_id: u32) -> bool {
        if !self.0.away.get() {
            return false;
        }
        let before = self.0.current.get();
        if self.set_effective_context(context_id).is_ok() {
            // A stream the tick cannot reach waits for its next hook: nothing of a stream is
            // done off its worker.
            let _ = self.queue(Op::Work);
        }
        self.0.current.set(before);
        true
    }

    fn define_metric(&self, kind: MetricKind, name: &str) -> Result<u32, Status> {
        let config = self.root_config().ok_or(UNAVAILABLE)?;
        metrics::define(
            config.envoy.0,
            config.defining.load(Ordering::Acquire),
            kind,
            name,
        )
    }

    fn increment_metric(&self, id: u32, by: i64) -> Result<(), Status> {
        match u64::try_from(by) {
            Ok(by) if by > 0 => metrics::update(id, by),
            _ => Ok(()),
        }
    }

    fn record_metric(&self, id: u32, value: u64) -> Result<(), Status> {
        metrics::update(id, value)
    }
}
