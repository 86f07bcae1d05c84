//! The lifecycle's `Host` calls on the ABI for one worker: reading what Envoy lends (headers, the
//! client address, metadata, bodies, a callout's answer), answering, resuming, calling out, stats.

use super::{Current, NativeHost, STORE, UNAVAILABLE};
use crate::abi::{self, EnvoyBuffer, ModuleBuffer, ModuleHeader};
use crate::links::Op;
use crate::metrics;
use smallvec::SmallVec;
use std::borrow::Cow;
use std::sync::atomic::Ordering;
use tollgate::config::HostCaps;
use tollgate::header_map;
use tollgate::lifecycle::{Host, MetricKind, Status};
use tollgate::request::Value;
use tollgate_core::{CasStore, StoreError};

impl NativeHost {
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

    /// Resume the current stream with `go` now, once the lifecycle returns (held), or from its
    /// worker when the tick asked (queued as `op`).
    fn resume(&self, op: fn() -> Op, go: impl FnOnce(abi::FilterEnvoy)) -> Result<(), Status> {
        if self.held_back(op) {
            return Ok(());
        }
        match self.here() {
            Some(filter) => go(filter),
            None => return self.queue(op()),
        }
        Ok(())
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

    fn read_then_write<W: AsRef<[u8]>, R>(
        &self,
        key: &str,
        f: impl FnOnce(Option<(&[u8], u32)>) -> (Option<W>, R),
    ) -> Result<(R, Option<Result<(), StoreError>>), StoreError> {
        STORE.read_then_write(key, f)
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
        let respond = || Op::Respond {
            status,
            headers: headers.to_vec(),
            body: body.to_vec(),
        };
        if self.held_back(respond) {
            return Ok(());
        }
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
        // a busy stream's unless the call was held back until the lifecycle returned.)
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
        // SAFETY: the stream's filter in its hook, on its worker.
        self.resume(
            || Op::Continue,
            |filter| unsafe { abi::continue_decoding(filter) },
        )
    }

    fn continue_response(&self) -> Result<(), Status> {
        // SAFETY: the stream's filter in its hook, on its worker.
        self.resume(
            || Op::ContinueResponse,
            |filter| unsafe { abi::continue_encoding(filter) },
        )
    }

    fn set_effective_context(&self, context_id: u32) -> Result<(), Status> {
        if let Some(filter) = self.0.links.filter(context_id) {
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
