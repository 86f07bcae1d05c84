//! The hooks driven as Envoy drives them, against the fake Envoy: configurations made and
//! refused, requests decided, the tick reaching paused streams from the main thread, panics
//! caught, and hostile bytes everywhere a client reaches.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use crate::abi::fake::{self as fake_envoy, new_config, new_stream, stream};
use crate::abi::{self, EnvoyBuffer};
use crate::hooks::thread_panics;
use crate::hooks::*;
use proptest::prelude::*;
use std::ffi::c_void;

fn buffer(bytes: &[u8]) -> EnvoyBuffer {
    EnvoyBuffer {
        ptr: bytes.as_ptr(),
        length: bytes.len(),
    }
}

/// A configuration made from `json`: (Envoy's pointer, the module's), or the module's null.
fn configure(json: &str) -> (*mut c_void, *const c_void) {
    assert!(!envoy_dynamic_module_on_program_init().is_null());
    let envoy = new_config();
    let module = envoy_dynamic_module_on_http_filter_config_new(
        envoy,
        buffer(b"tollgate"),
        buffer(json.as_bytes()),
    );
    (envoy, module)
}

/// One request through its hooks, as far as the module lets it: its request-headers status and
/// what Envoy recorded of it.
fn request(
    config: *const c_void,
    headers: &[(&str, &str)],
    source: &str,
) -> (u32, fake_envoy::Stream) {
    let filter = new_stream(0, headers, source);
    let module = envoy_dynamic_module_on_http_filter_new(config, filter);
    assert!(!module.is_null());
    let status = envoy_dynamic_module_on_http_filter_request_headers(filter, module, true);
    if status == abi::HEADERS_CONTINUE {
        envoy_dynamic_module_on_http_filter_response_headers(filter, module, false);
    }
    envoy_dynamic_module_on_http_filter_stream_complete(filter, module);
    envoy_dynamic_module_on_http_filter_destroy(module);
    (status, stream(filter))
}

const PER_IP: &str =
    r#"{"rules":[{"name":"per-ip","key":["client_ip"],"limit":{"requests":3,"per":"1m"}}]}"#;

#[test]
fn a_limit_admits_its_burst_then_refuses_with_the_headers_a_client_reads() {
    let (_, config) = configure(PER_IP);
    assert!(!config.is_null());
    for i in 0..3 {
        let (status, s) = request(config, &[(":path", "/")], "10.1.0.1:4000");
        assert_eq!(status, abi::HEADERS_CONTINUE, "request {i}");
        assert!(s.sent.is_none());
        let policy = s
            .response_headers
            .iter()
            .find(|(k, _)| k == b"ratelimit-policy");
        assert_eq!(policy.unwrap().1, br#""per-ip";q=3;w=60"#);
    }
    let (status, s) = request(config, &[(":path", "/")], "10.1.0.1:4000");
    assert_eq!(status, abi::HEADERS_STOP_ITERATION);
    let (code, headers, body) = s.sent.unwrap();
    assert_eq!((code, body.as_slice()), (429, &b"rate limited\n"[..]));
    assert!(headers
        .iter()
        .any(|(k, v)| k == b"retry-after" && !v.is_empty()));
    // Another client has its own bucket.
    assert_eq!(
        request(config, &[], "10.1.0.2:4000").0,
        abi::HEADERS_CONTINUE
    );
}

#[test]
fn a_refused_configuration_or_another_filter_name_is_not_made() {
    let (_, config) = configure(r#"{"rules":[{"name":"r","limit":{"requests":1,"per":"5x"}}]}"#);
    assert!(config.is_null());
    let logged = fake_envoy::with(|f| f.logs.iter().any(|(_, l)| l.contains("rules[0].limit.per")));
    assert!(logged, "the refusal names the field");
    let envoy = new_config();
    let other = envoy_dynamic_module_on_http_filter_config_new(
        envoy,
        buffer(b"other"),
        buffer(PER_IP.as_bytes()),
    );
    assert!(other.is_null());
    // Metadata below a namespace's own fields is refused, naming the build.
    let (_, nested) = configure(
        r#"{"rules":[{"name":"r","key":["metadata:ns/a/b"],"limit":{"requests":1,"per":"1s"}}]}"#,
    );
    assert!(nested.is_null());
    let logged = fake_envoy::with(|f| {
        f.logs
            .iter()
            .any(|(_, l)| l.contains("Envoy (dynamic module)"))
    });
    assert!(logged);
}

#[test]
fn stats_are_one_labelled_metric_per_rule_stat_handed_over_on_the_tick() {
    let (envoy, config) =
        configure(r#"{"rules":[{"name":"tick-stats","limit":{"requests":1,"per":"1m"}}]}"#);
    request(config, &[], "10.2.0.1:1");
    request(config, &[], "10.2.0.1:1");
    envoy_dynamic_module_on_http_filter_config_scheduled(envoy, config, 0);
    let value = |stat: &str| {
        fake_envoy::with(|f| {
            let (&(_, _, id), _) = f
                .metrics
                .iter()
                .find(|((c, labelled, _), (name, _))| {
                    *c == envoy as usize && *labelled && name == stat
                })
                .unwrap();
            f.values
                .get(&(envoy as usize, id, b"tick-stats".to_vec()))
                .copied()
        })
    };
    assert_eq!(value("tollgate.rule.allowed"), Some(1));
    assert_eq!(value("tollgate.rule.limited"), Some(1));
}

#[test]
fn metadata_keys_read_a_namespace_field_as_a_string_or_a_number() {
    let (_, config) = configure(
        r#"{"rules":[{"name":"plan","key":["metadata:auth/sub"],"missing_key":"skip","limit":{"requests":1,"per":"1m"}}]}"#,
    );
    let with_meta = |value: Result<Vec<u8>, f64>| {
        let filter = new_stream(0, &[], "10.3.0.1:1");
        fake_envoy::with(|f| {
            let s = f.streams.get_mut(&(filter as usize)).unwrap();
            s.metadata
                .insert((b"auth".to_vec(), b"sub".to_vec()), value);
        });
        let module = envoy_dynamic_module_on_http_filter_new(config, filter);
        let status = envoy_dynamic_module_on_http_filter_request_headers(filter, module, true);
        envoy_dynamic_module_on_http_filter_stream_complete(filter, module);
        envoy_dynamic_module_on_http_filter_destroy(module);
        status
    };
    assert_eq!(with_meta(Ok(b"alice".to_vec())), abi::HEADERS_CONTINUE);
    assert_eq!(
        with_meta(Ok(b"alice".to_vec())),
        abi::HEADERS_STOP_ITERATION
    );
    assert_eq!(with_meta(Err(7.0)), abi::HEADERS_CONTINUE);
    assert_eq!(with_meta(Err(7.0)), abi::HEADERS_STOP_ITERATION);
    // No metadata: skipped by the rule.
    assert_eq!(request(config, &[], "10.3.0.1:1").0, abi::HEADERS_CONTINUE);
}

/// A request that waits for a global rule's first lease is paused; the tick (Envoy's main
/// thread) sends the refill as a configuration callout, and its answer admits the request on its
/// own worker, through the stream's scheduler.
#[test]
fn a_waiting_request_is_resumed_on_its_worker_by_the_answer_the_tick_asked_for() {
    let json = r#"{"rules":[{"name":"g","scope":"global","limit":{"requests":100,"per":"1s"}}],
                   "quota_service":{"upstream":"quota","timeout":"1s"}}"#;
    let (envoy, config) = configure(json);
    let filter = new_stream(0, &[(":path", "/")], "10.4.0.1:1");
    let module = envoy_dynamic_module_on_http_filter_new(config, filter);
    let status = envoy_dynamic_module_on_http_filter_request_headers(filter, module, true);
    assert_eq!(status, abi::HEADERS_STOP_ITERATION);
    envoy_dynamic_module_on_http_filter_config_scheduled(envoy, config, 0);
    let call = fake_envoy::with(|f| {
        f.callouts
            .iter()
            .rev()
            .find(|c| c.from == envoy as usize)
            .cloned()
    });
    let call = call.expect("the tick's refill call");
    assert_eq!(call.cluster, "quota");
    assert!(call
        .headers
        .iter()
        .any(|(k, v)| k == b":path" && v == b"/v1/lease"));
    assert!(call.headers.iter().any(|(k, _)| k == b"host"));
    let asked: serde_json::Value = serde_json::from_slice(&call.body).unwrap();
    assert_eq!(asked["items"].as_array().map(Vec::len), Some(1));
    let answer = serde_json::json!({"items": [{"granted": 10, "remaining": 90, "ttl_ms": 10000,
                                               "reset_ms": 100}]});
    answer_config_call(envoy, config, call.id, &answer);
    // The next tick decides the waiting request: queued for its worker, not done off it.
    envoy_dynamic_module_on_http_filter_config_scheduled(envoy, config, 0);
    assert_eq!(stream(filter).decoding_continued, 0);
    let events = fake_envoy::with(|f| {
        f.schedulers
            .values_mut()
            .filter(|(owner, _)| *owner == filter as usize)
            .flat_map(|(_, e)| std::mem::take(e))
            .collect::<Vec<_>>()
    });
    assert_eq!(
        events.len(),
        1,
        "one event committed to the stream's scheduler"
    );
    envoy_dynamic_module_on_http_filter_scheduled(filter, module, events[0]);
    let s = stream(filter);
    assert_eq!((s.decoding_continued, s.sent.is_none()), (1, true));
    envoy_dynamic_module_on_http_filter_stream_complete(filter, module);
    envoy_dynamic_module_on_http_filter_destroy(module);
    let gone = fake_envoy::with(|f| !f.schedulers.values().any(|(o, _)| *o == filter as usize));
    assert!(gone, "the stream's scheduler is deleted with it");
}

#[test]
fn a_hook_that_panics_answers_its_request_503_and_the_next_one_is_served() {
    let (_, config) = configure(PER_IP);
    let before = thread_panics();
    let (status, s) = request(config, &[("x-tollgate-panic", "1")], "10.5.0.1:1");
    assert_eq!(status, abi::HEADERS_STOP_ITERATION);
    assert_eq!(s.sent.map(|(code, ..)| code), Some(503));
    assert!(thread_panics() > before);
    assert_eq!(request(config, &[], "10.5.0.1:1").0, abi::HEADERS_CONTINUE);
}

proptest! {
    /// Whatever bytes a client sends — header names and values, the address Envoy reports —
    /// every hook answers a status of the ABI's and nothing panics.
    #[test]
    fn hostile_requests_never_panic(
        headers in proptest::collection::vec((".{0,12}", proptest::collection::vec(any::<u8>(), 0..40)), 0..8),
        source in proptest::collection::vec(any::<u8>(), 0..40),
    ) {
        use std::sync::OnceLock;
        static CONFIG: OnceLock<usize> = OnceLock::new();
        let config = *CONFIG.get_or_init(|| {
            configure(r#"{"rules":[
                {"name":"ip","key":["client_ip"],"limit":{"requests":2,"per":"1m"}},
                {"name":"h","key":["header:x-user","query:q","host","path","method"],"limit":{"requests":2,"per":"1m"}},
                {"name":"c","algorithm":"concurrency","key":["header:x-user"],"limit":{"concurrent":1}}
              ],"rate_limit_headers":"both"}"#).1 as usize
        }) as *const c_void;
        let filter = fake_envoy::new_stream(0, &[], "");
        fake_envoy::with(|f| {
            let s = f.streams.get_mut(&(filter as usize)).unwrap();
            s.request_headers = headers.iter().map(|(k, v)| (k.as_bytes().to_vec(), v.clone())).collect();
            s.source = Some(source.clone());
        });
        let before = thread_panics();
        let module = envoy_dynamic_module_on_http_filter_new(config, filter);
        prop_assert!(!module.is_null());
        let status = envoy_dynamic_module_on_http_filter_request_headers(filter, module, false);
        prop_assert!(status == abi::HEADERS_CONTINUE || status == abi::HEADERS_STOP_ITERATION);
        let body = envoy_dynamic_module_on_http_filter_request_body(filter, module, true);
        prop_assert!(body <= abi::BODY_STOP_AND_WATERMARK);
        envoy_dynamic_module_on_http_filter_response_headers(filter, module, true);
        envoy_dynamic_module_on_http_filter_stream_complete(filter, module);
        envoy_dynamic_module_on_http_filter_destroy(module);
        // (Other tests' panics are on purpose; a hostile request's may be none.)
        let panicked = headers.iter().any(|(k, _)| k == "x-tollgate-panic");
        prop_assert!(panicked || thread_panics() == before
            || cfg!(feature = "probe"));
    }
}

fn bytes_of(max: usize) -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 0..max)
}

fn pairs_of() -> impl Strategy<Value = Vec<(Vec<u8>, Vec<u8>)>> {
    proptest::collection::vec((bytes_of(12), bytes_of(40)), 0..6)
}

fn case() -> impl Strategy<Value = crate::fuzz_harness::Case> {
    let names = proptest::sample::select(vec![
        &b":path"[..],
        b":method",
        b":authority",
        b"host",
        b"x-user",
        b"x-forwarded-for",
        b"content-length",
        b"content-type",
        b":status",
        b"authorization",
    ]);
    let known = proptest::collection::vec((names.prop_map(<[u8]>::to_vec), bytes_of(40)), 0..6);
    let headers = (known, pairs_of()).prop_map(|(mut a, b)| {
        a.extend(b);
        a
    });
    let body = proptest::collection::vec(bytes_of(64), 0..3);
    let json_body = proptest::collection::vec(
        proptest::sample::select(vec![
            br#"{"model":"a","max_tokens":7}"#.to_vec(),
            br#"{"usage":{"total_tokens":12}}"#.to_vec(),
            br#"{"items":[{"granted":5,"ttl_ms":1000,"remaining":3,"reset_ms":10}]}"#.to_vec(),
            b"not json".to_vec(),
        ]),
        0..2,
    );
    let answer = (
        0u32..4,
        pairs_of(),
        proptest::collection::vec(bytes_of(64), 0..2),
    );
    (
        (0u8..4, any::<bool>(), headers, bytes_of(40)),
        proptest::collection::vec((bytes_of(6), bytes_of(12)), 0..3),
        (body, json_body),
        (pairs_of(), proptest::collection::vec(bytes_of(64), 0..3)),
        proptest::collection::vec(answer, 0..4),
    )
        .prop_map(
            |((config, strict, headers, source), meta, (mut body, json), (rh, rb), answers)| {
                body.extend(json);
                crate::fuzz_harness::Case {
                    config,
                    strict,
                    headers,
                    source,
                    metadata: meta
                        .into_iter()
                        .map(|(k, v)| (b"ns".to_vec(), k, Ok(v)))
                        .collect(),
                    body,
                    response_headers: rh,
                    response_body: rb,
                    answers,
                }
            },
        )
}

proptest! {
    /// Any request and any answers to the calls it makes, through every hook of configurations
    /// that read headers, the address, metadata and the body and call the quota service:
    /// nothing panics (the `native_hooks` `cargo fuzz` target runs the same harness).
    #[test]
    fn fuzz_hooks_never_panic_whatever_the_request_and_the_answers(case in case()) {
        prop_assert_eq!(crate::fuzz_harness::run(&case), 0, "a hook panicked on {:?}", case);
    }
}

/// `body` as a callout's answer with `:status: 200`, handed to `deliver` as Envoy lends it.
fn with_answer(
    body: &serde_json::Value,
    deliver: impl FnOnce(&[abi::EnvoyHeader], &[EnvoyBuffer]),
) {
    let body = serde_json::to_vec(body).unwrap();
    let (k, v) = (b":status", b"200");
    let headers = [abi::EnvoyHeader {
        key_ptr: k.as_ptr(),
        key_length: k.len(),
        value_ptr: v.as_ptr(),
        value_length: v.len(),
    }];
    deliver(&headers, &[buffer(&body)]);
}

/// A callout-done hook: the stream's or the configuration's (the same signature).
type CalloutDone = extern "C" fn(
    *mut c_void,
    *const c_void,
    u64,
    u32,
    *const abi::EnvoyHeader,
    usize,
    *const abi::EnvoyBuffer,
    usize,
);

/// Deliver `body` through `done` as the answer to call `id` of `envoy`'s `ours`.
fn answer_call(
    done: CalloutDone,
    envoy: *mut c_void,
    ours: *const c_void,
    id: u64,
    body: &serde_json::Value,
) {
    with_answer(body, |headers, chunks| {
        done(
            envoy,
            ours,
            id,
            abi::CALLOUT_RESULT_SUCCESS,
            headers.as_ptr(),
            headers.len(),
            chunks.as_ptr(),
            chunks.len(),
        );
    });
}

/// Deliver `body` as the answer to stream `filter`'s call `id`.
fn answer_stream_call(
    filter: *mut c_void,
    module: *const c_void,
    id: u64,
    body: &serde_json::Value,
) {
    let done: CalloutDone = envoy_dynamic_module_on_http_filter_http_callout_done;
    answer_call(done, filter, module, id, body);
}

/// Deliver `body` as the answer to configuration `config`'s call `id`.
fn answer_config_call(
    envoy: *mut c_void,
    config: *const c_void,
    id: u64,
    body: &serde_json::Value,
) {
    let done: CalloutDone = envoy_dynamic_module_on_http_filter_config_http_callout_done;
    answer_call(done, envoy, config, id, body);
}

#[test]
fn an_answer_reaches_the_caller_envoy_names_though_another_call_has_its_number() {
    // Envoy numbers callouts per filter and per configuration from 1: a request's call and the
    // tick's give-back are both 1. Before, the tick's answer went to the waiting request that
    // had registered 1, which read it as its own, failed its call and let every request through.
    let json = r#"{"rules":[
        {"name":"user","scope":"global","key":["header:x-user"],"limit":{"requests":5,"per":"1h"}},
        {"name":"team","scope":"global","key":["header:x-team"],"limit":{"requests":1,"per":"1h"}}],
        "quota_service":{"upstream":"quota","mode":"strict"}}"#;
    let (envoy, config) = configure(json);
    let start = |team: &str| {
        let filter = new_stream(
            0,
            &[(":path", "/"), ("x-user", "u"), ("x-team", team)],
            "10.5.0.1:1",
        );
        let module = envoy_dynamic_module_on_http_filter_new(config, filter);
        let status = envoy_dynamic_module_on_http_filter_request_headers(filter, module, true);
        assert_eq!(status, abi::HEADERS_STOP_ITERATION, "waits for its call");
        let id = fake_envoy::with(|f| {
            f.callouts
                .iter()
                .rfind(|c| c.from == filter as usize)
                .map(|c| c.id)
        });
        assert_eq!(id, Some(1), "a stream's first callout is 1");
        (filter, module)
    };
    let item = |granted: u32| serde_json::json!({"granted": granted, "remaining": 0, "ttl_ms": 10000, "reset_ms": 3_600_000});
    // A refused by the team: the user's token it was granted goes back on the tick.
    let (a, a_module) = start("t0");
    answer_stream_call(
        a,
        a_module,
        1,
        &serde_json::json!({"items": [item(1), item(0)]}),
    );
    assert_eq!(stream(a).sent.as_ref().map(|s| s.0), Some(429));
    envoy_dynamic_module_on_http_filter_stream_complete(a, a_module);
    envoy_dynamic_module_on_http_filter_destroy(a_module);
    // B waits for its own call 1 while the tick's give-back, also 1, is answered.
    let (b, b_module) = start("t1");
    let seen = fake_envoy::with(|f| f.callouts.len());
    envoy_dynamic_module_on_http_filter_config_scheduled(envoy, config, 0);
    let give_back = fake_envoy::with(|f| {
        f.callouts[seen..]
            .iter()
            .find(|c| c.from == envoy as usize)
            .cloned()
    });
    let give_back = give_back.expect("the tick gives the user's token back");
    assert_eq!(give_back.id, 1);
    answer_config_call(envoy, config, 1, &serde_json::json!({"items": [item(0)]}));
    let s = stream(b);
    assert_eq!(
        (s.decoding_continued, s.sent.is_none()),
        (0, true),
        "B still waits for its own answer"
    );
    answer_stream_call(
        b,
        b_module,
        1,
        &serde_json::json!({"items": [item(1), item(1)]}),
    );
    let s = stream(b);
    assert_eq!(
        (s.decoding_continued, s.sent.is_none()),
        (1, true),
        "B admitted by its answer"
    );
    envoy_dynamic_module_on_http_filter_stream_complete(b, b_module);
    envoy_dynamic_module_on_http_filter_destroy(b_module);
}
