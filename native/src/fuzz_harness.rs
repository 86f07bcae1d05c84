//! The ABI layer under arbitrary input, against the fake Envoy: a request of any bytes (headers,
//! address, metadata, body chunks, response headers) through every hook of a few configurations,
//! and answers of any bytes to the calls they make (a request's own, and the tick's refills).
//! Run by the crate's property test and the `native_hooks` `cargo fuzz` target; a panic caught in
//! a hook counts as a failure.

// Test support: a broken harness may panic (the hooks must not).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::abi::fake::{self as fake_envoy, Metadata};
use crate::abi::{EnvoyBuffer, EnvoyHeader};
use crate::hooks::*;
use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::sync::OnceLock;

/// The configurations every case runs against: what reads the headers, the address, metadata,
/// the body, and what calls the quota service (its own call, and the tick's refills).
const CONFIGS: [&str; 5] = [
    r#"{"rules":[
        {"name":"ip","key":["client_ip"],"limit":{"requests":2,"per":"1m"}},
        {"name":"h","key":["header:x-user","query:q","host","path","method"],"limit":{"requests":2,"per":"1m"}},
        {"name":"c","algorithm":"concurrency","key":["header:x-user"],"limit":{"concurrent":1}}
      ],"rate_limit_headers":"both","client_ip":{"trusted_hops":1}}"#,
    r#"{"rules":[{"name":"m","key":["metadata:ns/k"],"limit_from":{"metadata":"ns/plan","max":10},
        "limit":{"requests":2,"per":"1m"}}]}"#,
    r#"{"rules":[{"name":"llm","key":["body:model"],"limit":{"requests":1000,"per":"1m"},
        "cost":{"body":["max_tokens"],"max":500},"settle":{"usage":"total"}}]}"#,
    r#"{"rules":[
        {"name":"g","scope":"global","key":["header:x-user"],"limit":{"requests":100,"per":"1m"}},
        {"name":"s","scope":"global","algorithm":"concurrency","key":["header:x-user"],"limit":{"concurrent":3}}
      ],"quota_service":{"upstream":"quota","timeout":"1s"}}"#,
    r#"{"rules":[{"name":"g","scope":"global","key":["header:x-user"],"limit":{"requests":100,"per":"1m"}}],
        "quota_service":{"upstream":"quota","timeout":"1s","mode":"strict"}}"#,
];

/// An answer to a call: its result code, headers and body chunks.
pub type Answer = (u32, Vec<(Vec<u8>, Vec<u8>)>, Vec<Vec<u8>>);

/// One request and the answers it meets.
#[derive(Debug, Clone, Default)]
pub struct Case {
    pub config: u8,
    pub strict: bool,
    pub headers: Vec<(Vec<u8>, Vec<u8>)>,
    pub source: Vec<u8>,
    pub metadata: Vec<(Vec<u8>, Vec<u8>, Metadata)>,
    pub body: Vec<Vec<u8>>,
    pub response_headers: Vec<(Vec<u8>, Vec<u8>)>,
    pub response_body: Vec<Vec<u8>>,
    /// Answers to the calls made, in turn: a result code, headers, body chunks.
    pub answers: Vec<Answer>,
}

fn buffer(bytes: &[u8]) -> EnvoyBuffer {
    EnvoyBuffer {
        ptr: bytes.as_ptr(),
        length: bytes.len(),
    }
}

/// The configurations, made once per process: (Envoy's pointer, the module's).
fn configs() -> &'static [(usize, usize)] {
    static MADE: OnceLock<Vec<(usize, usize)>> = OnceLock::new();
    MADE.get_or_init(|| {
        envoy_dynamic_module_on_program_init();
        let mut made = Vec::new();
        for (i, json) in CONFIGS.iter().enumerate() {
            for mode in if i == 3 {
                &["lease", "strict"][..]
            } else {
                &["lease"][..]
            } {
                let json = json.replace("MODE", mode);
                let envoy = fake_envoy::new_config();
                let module = envoy_dynamic_module_on_http_filter_config_new(
                    envoy,
                    buffer(b"tollgate"),
                    buffer(json.as_bytes()),
                );
                assert!(
                    !module.is_null(),
                    "the harness's configuration {i} is refused"
                );
                made.push((envoy as usize, module as usize));
            }
        }
        made
    })
}

/// Answer every call made since `seen` (calls of `from`, a stream or a configuration).
fn answer_calls(
    case: &Case,
    answers: &mut usize,
    seen: usize,
    mut deliver: impl FnMut(&fake_envoy::Callout, u32, &[EnvoyHeader], &[EnvoyBuffer]),
) {
    let calls: Vec<fake_envoy::Callout> = fake_envoy::with(|f| f.callouts[seen..].to_vec());
    for call in calls {
        let (result, headers, body) = case.answers.get(*answers).cloned().unwrap_or_default();
        *answers += 1;
        let headers: Vec<EnvoyHeader> = headers
            .iter()
            .map(|(k, v)| EnvoyHeader {
                key_ptr: k.as_ptr(),
                key_length: k.len(),
                value_ptr: v.as_ptr(),
                value_length: v.len(),
            })
            .collect();
        let chunks: Vec<EnvoyBuffer> = body.iter().map(|c| buffer(c)).collect();
        deliver(&call, result % 3, &headers, &chunks);
    }
}

/// Deliver the events committed to the stream's scheduler.
fn scheduled(filter: *mut c_void, module: *const c_void) {
    let events: Vec<u64> = fake_envoy::with(|f| {
        f.schedulers
            .values_mut()
            .filter(|(owner, _)| *owner == filter as usize)
            .flat_map(|(_, e)| std::mem::take(e))
            .collect()
    });
    for event in events {
        envoy_dynamic_module_on_http_filter_scheduled(filter, module, event);
    }
}

/// Run one case; the panics the hooks caught (none, unless the module has a bug).
pub fn run(case: &Case) -> u64 {
    let made = configs();
    let index = match usize::from(case.config) % 4 {
        3 if case.strict => 4,
        i => i,
    };
    let (envoy, config) = made[index];
    let (envoy, config) = (envoy as *mut c_void, config as *const c_void);
    let before = PANICS.load(Ordering::Relaxed);
    let filter = fake_envoy::new_stream(0, &[], "");
    fake_envoy::with(|f| {
        let s = f
            .streams
            .get_mut(&(filter as usize))
            .unwrap_or_else(|| unreachable!());
        s.request_headers = case.headers.clone();
        s.source = Some(case.source.clone());
        for (ns, key, value) in &case.metadata {
            s.metadata.insert((ns.clone(), key.clone()), value.clone());
        }
    });
    let seen = fake_envoy::with(|f| f.callouts.len());
    let module = envoy_dynamic_module_on_http_filter_new(config, filter);
    if module.is_null() {
        return PANICS.load(Ordering::Relaxed) - before;
    }
    envoy_dynamic_module_on_http_filter_request_headers(filter, module, case.body.is_empty());
    for (i, chunk) in case.body.iter().enumerate() {
        fake_envoy::with(|f| {
            if let Some(s) = f.streams.get_mut(&(filter as usize)) {
                s.received = vec![chunk.clone()];
            }
        });
        envoy_dynamic_module_on_http_filter_request_body(filter, module, i + 1 == case.body.len());
    }
    let mut answers = 0;
    // The request's own calls, then the tick's (twice: a refill's answer, then the waiting
    // request decided), answered with the case's bytes.
    answer_calls(case, &mut answers, seen, |call, result, headers, chunks| {
        if call.from == filter as usize {
            envoy_dynamic_module_on_http_filter_http_callout_done(
                filter,
                module,
                call.id,
                result,
                headers.as_ptr(),
                headers.len(),
                chunks.as_ptr(),
                chunks.len(),
            );
        }
    });
    for _ in 0..2 {
        let seen = fake_envoy::with(|f| f.callouts.len());
        envoy_dynamic_module_on_http_filter_config_scheduled(envoy, config, 0);
        answer_calls(case, &mut answers, seen, |call, result, headers, chunks| {
            if call.from == envoy as usize {
                envoy_dynamic_module_on_http_filter_config_http_callout_done(
                    envoy,
                    config,
                    call.id,
                    result,
                    headers.as_ptr(),
                    headers.len(),
                    chunks.as_ptr(),
                    chunks.len(),
                );
            }
        });
        scheduled(filter, module);
    }
    fake_envoy::with(|f| {
        if let Some(s) = f.streams.get_mut(&(filter as usize)) {
            s.response_headers = case.response_headers.clone();
        }
    });
    envoy_dynamic_module_on_http_filter_response_headers(
        filter,
        module,
        case.response_body.is_empty(),
    );
    for (i, chunk) in case.response_body.iter().enumerate() {
        fake_envoy::with(|f| {
            if let Some(s) = f.streams.get_mut(&(filter as usize)) {
                s.received = vec![chunk.clone()];
            }
        });
        let end = i + 1 == case.response_body.len();
        envoy_dynamic_module_on_http_filter_response_body(filter, module, end);
    }
    envoy_dynamic_module_on_http_filter_stream_complete(filter, module);
    envoy_dynamic_module_on_http_filter_destroy(module);
    fake_envoy::with(|f| f.streams.remove(&(filter as usize)));
    PANICS.load(Ordering::Relaxed) - before
}

/// A case from arbitrary bytes (the `cargo fuzz` target's input): fields split by a 0xff byte,
/// pairs by 0xfe.
pub fn case_of(data: &[u8]) -> Case {
    let mut fields = data.split(|&b| b == 0xff);
    let mut next = || fields.next().unwrap_or_default();
    let head = next();
    let pairs = |bytes: &[u8]| -> Vec<(Vec<u8>, Vec<u8>)> {
        bytes
            .split(|&b| b == 0xfe)
            .collect::<Vec<_>>()
            .chunks(2)
            .map(|p| {
                (
                    p[0].to_vec(),
                    p.get(1).map_or_else(Vec::new, |v| v.to_vec()),
                )
            })
            .collect()
    };
    let chunks = |bytes: &[u8]| -> Vec<Vec<u8>> {
        bytes
            .split(|&b| b == 0xfe)
            .filter(|c| !c.is_empty())
            .map(<[u8]>::to_vec)
            .collect()
    };
    let headers = pairs(next());
    let source = next().to_vec();
    let metadata = pairs(next())
        .into_iter()
        .map(|(k, v)| (b"ns".to_vec(), k, Ok(v)))
        .collect();
    let body = chunks(next());
    let response_headers = pairs(next());
    let response_body = chunks(next());
    let answers = (0..3)
        .map(|i| {
            (
                u32::from(head.get(2 + i).copied().unwrap_or(0)),
                pairs(next()),
                chunks(next()),
            )
        })
        .collect();
    Case {
        config: head.first().copied().unwrap_or(0),
        strict: head.get(1).is_some_and(|b| b & 1 == 1),
        headers,
        source,
        metadata,
        body,
        response_headers,
        response_body,
        answers,
    }
}
