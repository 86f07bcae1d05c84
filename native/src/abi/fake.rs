//! A stand-in for Envoy's side of the ABI, in Rust, for the crate's own tests and the fuzz
//! targets: streams with the headers, address, metadata and bodies a test gives them, and a record
//! of what the module did (responses, continues, callouts, scheduled events, stats, logs). Envoy
//! pointers are plain numbers here; the module never reads through them.

// Test support: a broken expectation may panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
// The unit tests read parts of the record the fuzz harness has no use for.
#![cfg_attr(not(test), allow(dead_code))]

use parking_lot::Mutex;
use std::collections::HashMap;
use std::ffi::c_void;

/// Header pairs as bytes.
pub type Headers = Vec<(Vec<u8>, Vec<u8>)>;
/// A metadata value: a string's bytes, or a number.
pub type Metadata = Result<Vec<u8>, f64>;

/// A stream as the fake Envoy keeps it.
#[derive(Default, Clone)]
pub struct Stream {
    pub request_headers: Headers,
    pub response_headers: Headers,
    pub source: Option<Vec<u8>>,
    /// Dynamic metadata: (namespace, key) → a string, or a number.
    pub metadata: HashMap<(Vec<u8>, Vec<u8>), Metadata>,
    /// The chunk the current body hook received.
    pub received: Vec<Vec<u8>>,
    pub worker: u32,
    /// What the module did to it.
    pub sent: Option<(u32, Headers, Vec<u8>)>,
    pub decoding_continued: u32,
    pub encoding_continued: u32,
}

/// A callout the module started.
#[derive(Clone, Debug)]
pub struct Callout {
    /// The stream (its filter pointer) or the configuration that made it.
    pub from: usize,
    pub id: u64,
    pub cluster: String,
    pub headers: Vec<(Vec<u8>, Vec<u8>)>,
    pub body: Vec<u8>,
}

#[derive(Default)]
pub struct Fake {
    pub concurrency: u32,
    pub streams: HashMap<usize, Stream>,
    /// Schedulers by pointer: what they are for (a stream or a configuration) and the events
    /// committed to them and not yet delivered.
    pub schedulers: HashMap<usize, (usize, Vec<u64>)>,
    pub callouts: Vec<Callout>,
    /// Metrics by (configuration, labelled, id): name and kind ("counter", "gauge").
    pub metrics: HashMap<(usize, bool, usize), (String, &'static str)>,
    /// Values by metric and label value.
    pub values: HashMap<(usize, usize, Vec<u8>), u64>,
    pub logs: Vec<(u32, String)>,
    pub frozen: std::collections::HashSet<usize>,
    next: usize,
}

pub static FAKE: Mutex<Option<Fake>> = Mutex::new(None);

/// Run `f` on the fake Envoy (made on first use, with two workers).
pub fn with<R>(f: impl FnOnce(&mut Fake) -> R) -> R {
    let mut fake = FAKE.lock();
    let fake = fake.get_or_insert_with(|| Fake {
        concurrency: 2,
        next: 0x1000,
        ..Fake::default()
    });
    f(fake)
}

impl Fake {
    /// A fresh pointer-sized number, never handed out before.
    pub fn pointer(&mut self) -> usize {
        self.next += 16;
        self.next
    }
}

fn bytes(b: crate::abi::ModuleBuffer) -> Vec<u8> {
    if b.ptr.is_null() {
        return Vec::new();
    }
    // SAFETY: the module hands over `length` readable bytes for the call.
    unsafe { std::slice::from_raw_parts(b.ptr, b.length) }.to_vec()
}

fn lend(value: &[u8], out: *mut crate::abi::EnvoyBuffer) {
    // SAFETY: the module passes room for one buffer.
    unsafe {
        *out = crate::abi::EnvoyBuffer {
            ptr: value.as_ptr(),
            length: value.len(),
        }
    };
}

fn headers(list: *mut crate::abi::ModuleHeader, n: usize) -> Vec<(Vec<u8>, Vec<u8>)> {
    (0..n)
        .map(|i| {
            // SAFETY: the module hands over `n` headers for the call.
            let h = unsafe { *list.add(i) };
            let k = crate::abi::ModuleBuffer {
                ptr: h.key_ptr,
                length: h.key_length,
            };
            let v = crate::abi::ModuleBuffer {
                ptr: h.value_ptr,
                length: h.value_length,
            };
            (bytes(k), bytes(v))
        })
        .collect()
}

/// The callbacks, with the signatures `abi` declares for Envoy's.
#[allow(clippy::missing_safety_doc)]
pub mod callbacks {
    use super::*;
    use crate::abi::{
        ConfigEnvoy, EnvoyBuffer, FilterEnvoy, ModuleBuffer, ModuleHeader, Scheduler,
    };

    pub unsafe fn log(level: u32, message: ModuleBuffer, _file: ModuleBuffer, _line: u32) {
        let text = String::from_utf8_lossy(&bytes(message)).into_owned();
        with(|f| f.logs.push((level, text)));
    }
    pub unsafe fn log_enabled(_level: u32) -> bool {
        true
    }
    pub unsafe fn get_concurrency() -> u32 {
        with(|f| f.concurrency)
    }

    pub unsafe fn get_header(
        filter: FilterEnvoy,
        header_type: u32,
        key: ModuleBuffer,
        result: *mut EnvoyBuffer,
        index: usize,
        _optional_size: *mut usize,
    ) -> bool {
        let key = bytes(key);
        with(|f| {
            let Some(s) = f.streams.get(&(filter as usize)) else {
                return false;
            };
            let map = match header_type {
                crate::abi::REQUEST_HEADER => &s.request_headers,
                _ => &s.response_headers,
            };
            match map.iter().filter(|(k, _)| *k == key).nth(index) {
                Some((_, v)) => {
                    lend(v, result);
                    true
                }
                None => false,
            }
        })
    }
    pub unsafe fn add_header(
        filter: FilterEnvoy,
        header_type: u32,
        key: ModuleBuffer,
        value: ModuleBuffer,
    ) -> bool {
        let (key, value) = (bytes(key), bytes(value));
        with(|f| match f.streams.get_mut(&(filter as usize)) {
            Some(s) if header_type == crate::abi::RESPONSE_HEADER => {
                s.response_headers.push((key, value));
                true
            }
            _ => false,
        })
    }
    pub unsafe fn send_response(
        filter: FilterEnvoy,
        status: u32,
        list: *mut ModuleHeader,
        n: usize,
        body: ModuleBuffer,
        _details: ModuleBuffer,
    ) {
        let (h, b) = (headers(list, n), bytes(body));
        with(|f| {
            if let Some(s) = f.streams.get_mut(&(filter as usize)) {
                s.sent = Some((status, h, b));
            }
        });
    }
    pub unsafe fn continue_decoding(filter: FilterEnvoy) {
        with(|f| {
            if let Some(s) = f.streams.get_mut(&(filter as usize)) {
                s.decoding_continued += 1;
            }
        });
    }
    pub unsafe fn continue_encoding(filter: FilterEnvoy) {
        with(|f| {
            if let Some(s) = f.streams.get_mut(&(filter as usize)) {
                s.encoding_continued += 1;
            }
        });
    }

    pub unsafe fn get_body_size(filter: FilterEnvoy, _body_type: u32) -> usize {
        with(|f| {
            f.streams
                .get(&(filter as usize))
                .map_or(0, |s| s.received.iter().map(Vec::len).sum())
        })
    }
    pub unsafe fn get_body_chunks_size(filter: FilterEnvoy, _body_type: u32) -> usize {
        with(|f| {
            f.streams
                .get(&(filter as usize))
                .map_or(0, |s| s.received.len())
        })
    }
    pub unsafe fn get_body_chunks(
        filter: FilterEnvoy,
        _body_type: u32,
        result: *mut EnvoyBuffer,
    ) -> bool {
        with(|f| {
            let Some(s) = f.streams.get(&(filter as usize)) else {
                return false;
            };
            for (i, chunk) in s.received.iter().enumerate() {
                lend(chunk, result.add(i));
            }
            true
        })
    }

    pub unsafe fn get_metadata_string(
        filter: FilterEnvoy,
        _source: u32,
        ns: ModuleBuffer,
        key: ModuleBuffer,
        result: *mut EnvoyBuffer,
    ) -> bool {
        let k = (bytes(ns), bytes(key));
        with(|f| {
            match f
                .streams
                .get(&(filter as usize))
                .and_then(|s| s.metadata.get(&k))
            {
                Some(Ok(v)) => {
                    lend(v, result);
                    true
                }
                _ => false,
            }
        })
    }
    pub unsafe fn get_metadata_number(
        filter: FilterEnvoy,
        _source: u32,
        ns: ModuleBuffer,
        key: ModuleBuffer,
        result: *mut f64,
    ) -> bool {
        let k = (bytes(ns), bytes(key));
        with(|f| {
            match f
                .streams
                .get(&(filter as usize))
                .and_then(|s| s.metadata.get(&k))
            {
                Some(Err(n)) => {
                    *result = *n;
                    true
                }
                _ => false,
            }
        })
    }
    pub unsafe fn get_attribute_string(
        filter: FilterEnvoy,
        id: u32,
        result: *mut EnvoyBuffer,
    ) -> bool {
        with(|f| {
            match f
                .streams
                .get(&(filter as usize))
                .and_then(|s| s.source.as_ref())
            {
                Some(source) if id == crate::abi::ATTRIBUTE_SOURCE_ADDRESS => {
                    lend(source, result);
                    true
                }
                _ => false,
            }
        })
    }
    pub unsafe fn get_worker_index(filter: FilterEnvoy) -> u32 {
        with(|f| f.streams.get(&(filter as usize)).map_or(0, |s| s.worker))
    }

    fn scheduler_for(owner: usize) -> Scheduler {
        with(|f| {
            let p = f.pointer();
            f.schedulers.insert(p, (owner, Vec::new()));
            p as Scheduler
        })
    }
    pub unsafe fn filter_scheduler_new(filter: FilterEnvoy) -> Scheduler {
        scheduler_for(filter as usize)
    }
    pub unsafe fn filter_scheduler_commit(scheduler: Scheduler, event_id: u64) {
        with(|f| {
            if let Some((_, events)) = f.schedulers.get_mut(&(scheduler as usize)) {
                events.push(event_id);
            }
        });
    }
    pub unsafe fn filter_scheduler_delete(scheduler: Scheduler) {
        with(|f| f.schedulers.remove(&(scheduler as usize)));
    }
    pub unsafe fn config_scheduler_new(config: ConfigEnvoy) -> Scheduler {
        scheduler_for(config as usize)
    }
    pub unsafe fn config_scheduler_commit(scheduler: Scheduler, event_id: u64) {
        filter_scheduler_commit(scheduler, event_id);
    }
    pub unsafe fn config_scheduler_delete(scheduler: Scheduler) {
        filter_scheduler_delete(scheduler);
    }

    unsafe fn callout(
        from: usize,
        id_out: *mut u64,
        cluster: ModuleBuffer,
        list: *mut ModuleHeader,
        n: usize,
        body: ModuleBuffer,
    ) -> u32 {
        let call = Callout {
            from,
            id: 0,
            cluster: String::from_utf8_lossy(&bytes(cluster)).into_owned(),
            headers: headers(list, n),
            body: bytes(body),
        };
        with(|f| {
            // As Envoy numbers them: per filter and per configuration, from 1.
            let made = f.callouts.iter().filter(|c| c.from == from).count();
            let id = u64::try_from(made).unwrap() + 1;
            *id_out = id;
            f.callouts.push(Callout { id, ..call });
        });
        crate::abi::CALLOUT_SUCCESS
    }
    pub unsafe fn filter_callout(
        filter: FilterEnvoy,
        id: *mut u64,
        cluster: ModuleBuffer,
        list: *mut ModuleHeader,
        n: usize,
        body: ModuleBuffer,
        _timeout_ms: u64,
    ) -> u32 {
        callout(filter as usize, id, cluster, list, n, body)
    }
    pub unsafe fn config_callout(
        config: ConfigEnvoy,
        id: *mut u64,
        cluster: ModuleBuffer,
        list: *mut ModuleHeader,
        n: usize,
        body: ModuleBuffer,
        _timeout_ms: u64,
    ) -> u32 {
        callout(config as usize, id, cluster, list, n, body)
    }

    unsafe fn define(
        config: ConfigEnvoy,
        kind: &'static str,
        name: ModuleBuffer,
        labels: usize,
        id: *mut usize,
    ) -> u32 {
        let name = String::from_utf8_lossy(&bytes(name)).into_owned();
        with(|f| {
            if f.frozen.contains(&(config as usize)) {
                return 3;
            }
            let labelled = labels > 0;
            let next = f
                .metrics
                .keys()
                .filter(|(c, l, _)| *c == config as usize && *l == labelled)
                .count()
                + 1;
            f.metrics
                .insert((config as usize, labelled, next), (name, kind));
            *id = next;
            crate::abi::METRICS_SUCCESS
        })
    }
    pub unsafe fn define_counter(
        config: ConfigEnvoy,
        name: ModuleBuffer,
        _labels: *mut ModuleBuffer,
        n: usize,
        id: *mut usize,
    ) -> u32 {
        define(config, "counter", name, n, id)
    }
    pub unsafe fn define_gauge(
        config: ConfigEnvoy,
        name: ModuleBuffer,
        _labels: *mut ModuleBuffer,
        n: usize,
        id: *mut usize,
    ) -> u32 {
        define(config, "gauge", name, n, id)
    }
    unsafe fn update(
        config: ConfigEnvoy,
        id: usize,
        labels: *mut ModuleBuffer,
        n: usize,
        value: u64,
        add: bool,
    ) -> u32 {
        let label = if n > 0 { bytes(*labels) } else { Vec::new() };
        with(|f| {
            if !f.metrics.contains_key(&(config as usize, n > 0, id)) {
                return 1;
            }
            let v = f.values.entry((config as usize, id, label)).or_insert(0);
            *v = if add { *v + value } else { value };
            crate::abi::METRICS_SUCCESS
        })
    }
    pub unsafe fn increment_counter(
        config: ConfigEnvoy,
        id: usize,
        labels: *mut ModuleBuffer,
        n: usize,
        value: u64,
    ) -> u32 {
        update(config, id, labels, n, value, true)
    }
    pub unsafe fn set_gauge(
        config: ConfigEnvoy,
        id: usize,
        labels: *mut ModuleBuffer,
        n: usize,
        value: u64,
    ) -> u32 {
        update(config, id, labels, n, value, false)
    }
}

/// The config pointer a test hands to `config_new`.
pub fn new_config() -> *mut c_void {
    with(|f| f.pointer()) as *mut c_void
}

/// A new stream on `worker` with `headers` from `source`: its filter pointer.
pub fn new_stream(worker: u32, headers: &[(&str, &str)], source: &str) -> *mut c_void {
    with(|f| {
        let p = f.pointer();
        f.streams.insert(
            p,
            Stream {
                request_headers: headers
                    .iter()
                    .map(|(k, v)| (k.as_bytes().to_vec(), v.as_bytes().to_vec()))
                    .collect(),
                source: Some(source.as_bytes().to_vec()),
                worker,
                ..Stream::default()
            },
        );
        p as *mut c_void
    })
}

/// The stream behind `filter`, as it is now.
pub fn stream(filter: *mut c_void) -> Stream {
    with(|f| {
        f.streams
            .get(&(filter as usize))
            .cloned()
            .unwrap_or_default()
    })
}
