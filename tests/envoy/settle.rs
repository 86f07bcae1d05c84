//! Costs known after the response: failed logins, an LLM stream's usage, response bytes.

use crate::harness::{build, parallel, Build, Client, Envoy, Options, Upstream};
use serde_json::{json, Value};
use std::time::Instant;

/// A direct response on `path` with `status`, `body` and a content type.
fn answer(path: &str, status: u16, body: &str, content_type: &str) -> Value {
    json!({"match": {"prefix": path},
           "direct_response": {"status": status, "body": {"inline_string": body}},
           "response_headers_to_add": [{"header": {"key": "content-type", "value": content_type},
                                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]})
}

/// An Envoy whose `/v1/chat` answers a JSON usage of 1 000, with `plugin`, reading request bodies
/// (`allow_on_headers_stop_iteration`).
fn chat_envoy(plugin: &Value) -> Envoy {
    let opts = Options {
        routes: vec![answer("/v1/chat", 200, USAGE_1000, "application/json")],
        body_readable: true,
        ..Options::default()
    };
    Envoy::start_with(plugin, &opts)
}

#[test]
fn the_sixth_failed_login_is_refused_before_the_upstream_and_successes_cost_nothing() {
    let mut right = answer("/login", 200, "welcome\n", "text/plain");
    right["match"]["headers"] = json!([{"name": "x-password", "string_match": {"exact": "right"}}]);
    let opts = Options {
        routes: vec![right, answer("/login", 401, "no\n", "text/plain")],
        ..Options::default()
    };
    let envoy = Envoy::start_with(
        &json!({"rules": [{"name": "logins", "match": {"path_prefix": "/login"},
            "key": ["client_ip"], "limit": {"requests": 5, "per": "15m"},
            "settle": {"statuses": [401, 403]}}]}),
        &opts,
    );
    let client = Client::new();
    let url = envoy.url("/login");
    for _ in 0..20 {
        let reply = client.get(&url, &[("x-password", "right")]);
        assert_eq!(reply.status, 200, "a success costs nothing");
    }
    for n in 0..5 {
        let reply = client.get(&url, &[("x-password", "wrong")]);
        assert_eq!(reply.status, 401, "failure {n} reaches the upstream");
    }
    let sixth = client.get(&url, &[("x-password", "wrong")]);
    assert_eq!(sixth.status, 429, "the 6th failure within the window");
    assert!(sixth.header("retry-after").is_some());
    // Refused before the upstream: even the right password waits for the window.
    assert_eq!(client.get(&url, &[("x-password", "right")]).status, 429);
    assert_eq!(envoy.counter("logins", "refunded"), 20);
    assert_eq!(envoy.counter("logins", "settled"), 5);
}

const STREAM: &str = "data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n\
    data: {\"choices\":[],\"usage\":{\"prompt_tokens\":100,\"completion_tokens\":200,\"total_tokens\":300}}\n\n\
    data: [DONE]\n\n";

#[test]
fn a_streamed_usage_beyond_the_reservation_is_owed_and_refused_until_repaid() {
    let opts = Options {
        routes: vec![answer("/v1/chat", 200, STREAM, "text/event-stream")],
        ..Options::default()
    };
    // 1 000 tokens a minute per key; a request reserves its x-max-tokens (default 100).
    let envoy = Envoy::start_with(
        &json!({"rules": [{"name": "llm", "key": ["header:x-api-key"],
            "limit": {"requests": 1000, "per": "1m"},
            "cost": {"header": "x-max-tokens", "default": 100, "max": 1000},
            "settle": {"usage": "total"}}]}),
        &opts,
    );
    let client = Client::new();
    let url = envoy.url("/v1/chat");
    let key = [("x-api-key", "team-a")];
    for n in 0..4 {
        let reply = client.get(&url, &key);
        assert_eq!(reply.status, 200, "request {n}");
        assert!(
            reply.body.contains("total_tokens"),
            "the stream passes whole"
        );
    }
    // 4 × 300 = 1 200 of 1 000: 200 owed, and a reservation of 100 after it: 18 s.
    let refused = client.get(&url, &key);
    assert_eq!(refused.status, 429);
    assert_eq!(refused.header("retry-after"), Some("18"));
    // A request that reserves what it may use is refused as exactly.
    let big = client.get(&url, &[("x-api-key", "team-b"), ("x-max-tokens", "1000")]);
    assert_eq!(big.status, 200, "another key is another budget");
    assert_eq!(envoy.counter("llm", "charged"), 800);
    assert_eq!(envoy.counter("llm", "refunded"), 700);
    // 4 × 300 of 1 000: 200 past the bucket's bottom, less what refilled meanwhile (17 a second).
    let debt = envoy.counter("llm", "debt");
    assert!((180..=200).contains(&debt), "debt {debt}");
}

#[test]
fn a_byte_quota_counts_the_bytes_each_response_sent() {
    let body = "x".repeat(1_000);
    let opts = Options {
        routes: vec![answer("/files", 200, &body, "application/octet-stream")],
        ..Options::default()
    };
    // 5 000 bytes a minute per client; a request reserves 1 000.
    let envoy = Envoy::start_with(
        &json!({"rules": [{"name": "bytes", "key": ["client_ip"],
            "limit": {"requests": 5000, "per": "1m"}, "cost": 1000,
            "settle": {"body_bytes": true}}]}),
        &opts,
    );
    let client = Client::new();
    let statuses: Vec<u16> = (0..7)
        .map(|_| client.get(&envoy.url("/files"), &[]).status)
        .collect();
    assert_eq!(statuses, [200, 200, 200, 200, 200, 429, 429]);
    assert_eq!(envoy.counter("bytes", "settled"), 5_000);
}

/// Tokens a request of the concurrent-streams test uses: 300 to 2 000, spread by `i`.
fn usage_of(i: usize) -> (u64, u64) {
    let total = 300 + (i as u64 * 7_919) % 1_701;
    (total / 4, total - total / 4)
}

/// 20 concurrent streams of one key (`usage_of` tokens each), spread over `urls`, each reserving
/// `reserve` (none: the rule's default): the ones admitted, the tokens they used, and the seconds
/// the run took. Every stream is admitted whole (with its usage) or refused.
fn send_streams(urls: &[String], reserve: Option<&str>) -> (Vec<usize>, u64, f64) {
    let started = Instant::now();
    let statuses = parallel(20, |i| {
        let (input, output) = usage_of(i);
        let (input, output) = (input.to_string(), output.to_string());
        let mut headers = vec![
            ("x-api-key", "team-a"),
            ("x-stream", "1"),
            ("x-events", "10"),
            ("x-event-ms", "30"),
            ("x-usage-input", input.as_str()),
            ("x-usage-output", output.as_str()),
        ];
        if let Some(r) = reserve {
            headers.push(("x-max-tokens", r));
        }
        let reply = Client::new().get(&urls[i % urls.len()], &headers);
        if reply.status == 200 {
            assert!(reply.body.contains("total_tokens"), "{}", reply.body);
        }
        reply.status
    });
    let seconds = started.elapsed().as_secs_f64();
    assert!(
        statuses.iter().all(|&s| s == 200 || s == 429),
        "{statuses:?}"
    );
    let admitted: Vec<usize> = (0..20).filter(|&i| statuses[i] == 200).collect();
    let used = admitted
        .iter()
        .map(|&i| usage_of(i).0 + usage_of(i).1)
        .sum();
    (admitted, used, seconds)
}

/// 20 concurrent streams of one key against 10 000 tokens a minute, each reserving `reserve`
/// (none: the rule's default of 500): what was admitted, the tokens they used, and the seconds
/// the run took.
fn concurrent_streams(reserve: Option<&str>) -> (Envoy, Vec<usize>, u64, f64) {
    let app = Upstream::start(&["--capacity", "100"]);
    let opts = Options {
        app_port: Some(app.port),
        ..Options::default()
    };
    let envoy = Envoy::start_with(
        &json!({"rules": [{"name": "llm", "key": ["header:x-api-key"],
            "limit": {"requests": 10000, "per": "1m"},
            "cost": {"header": "x-max-tokens", "default": 500, "max": 2000},
            "settle": {"usage": "total"}}]}),
        &opts,
    );
    let (admitted, used, seconds) = send_streams(&[envoy.url("/app/llm/chat")], reserve);
    drop(app);
    (envoy, admitted, used, seconds)
}

#[test]
fn concurrent_streams_that_reserve_their_maximum_never_overshoot_the_budget() {
    let (envoy, admitted, used, seconds) = concurrent_streams(Some("2000"));
    // The bound with reservations that are maxima: burst + rate × t.
    let bound = 10_000.0 + 10_000.0 * seconds / 60.0;
    eprintln!(
        "{} of 20 admitted, {used} tokens used in {seconds:.2} s (bound {bound:.0})",
        admitted.len()
    );
    assert!(used as f64 <= bound, "{used} > {bound}");
    assert!(admitted.len() >= 5, "the budget holds five maxima at once");
    assert!(admitted.len() < 20, "the budget cannot hold every stream");
    // Settled exactly what the streams reported.
    assert_eq!(envoy.counter("llm", "settled"), used);
}

#[test]
fn concurrent_streams_that_reserve_less_overshoot_by_their_excess_at_most_then_owe_it() {
    let (envoy, admitted, used, seconds) = concurrent_streams(None);
    // Each reserved 500: the bound adds the excess of those in flight over their reservations.
    let excess: u64 = admitted
        .iter()
        .map(|&i| (usage_of(i).0 + usage_of(i).1).saturating_sub(500))
        .sum();
    let bound = 10_000.0 + 10_000.0 * seconds / 60.0 + excess as f64;
    eprintln!(
        "{} of 20 admitted, {used} tokens used (excess {excess}) in {seconds:.2} s (bound {bound:.0})",
        admitted.len()
    );
    assert!(used as f64 <= bound, "{used} > {bound}");
    assert_eq!(envoy.counter("llm", "settled"), used);
    // What was used beyond the budget is owed: the key is refused until it has refilled.
    if used > 10_000 {
        let refused = Client::new().get(&envoy.url("/app/llm/chat"), &[("x-api-key", "team-a")]);
        assert_eq!(refused.status, 429);
        let retry: u64 = refused.header("retry-after").unwrap().parse().unwrap();
        assert!(
            retry * 10_000 / 60 >= used - 10_000,
            "retry after {retry} s for {used}"
        );
    }
}

#[test]
fn a_stream_cut_short_settles_what_it_reported_else_its_reservation() {
    let app = Upstream::start(&["--capacity", "10"]);
    let opts = Options {
        app_port: Some(app.port),
        ..Options::default()
    };
    let envoy = Envoy::start_with(
        &json!({"rules": [{"name": "llm", "key": ["header:x-api-key"],
            "limit": {"requests": 10000, "per": "1m"}, "cost": 700,
            "settle": {"usage": "total"}}]}),
        &opts,
    );
    // The whole answer as the client gets it, however it ends (the upstream cuts it short).
    let read_all = |lines: &[&[u8]]| {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", envoy.port)).unwrap();
        stream
            .write_all(&testkit::raw(b"/app/llm/chat", lines))
            .unwrap();
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer);
        String::from_utf8_lossy(&answer).into_owned()
    };
    // Anthropic reports the input (and one output token) at the start: a stream cut after it
    // settles its reservation, not that much (before: 121)…
    let cut = read_all(&[
        b"x-api-key: k",
        b"x-stream: 1",
        b"x-format: anthropic",
        b"x-usage-input: 120",
        b"x-usage-output: 900",
        b"x-cut-after: 2",
    ]);
    assert!(
        cut.contains("message_start") && !cut.contains("message_delta"),
        "{cut}"
    );
    let settled = |n| {
        testkit::eventually(std::time::Duration::from_secs(5), || {
            envoy.counter("llm", "settled") == n
        })
    };
    assert!(settled(700), "settled {}", envoy.counter("llm", "settled"));
    // …an OpenAI stream cut before its usage too…
    let cut = read_all(&[b"x-api-key: k", b"x-stream: 1", b"x-cut-after: 2"]);
    assert!(!cut.contains("usage"), "{cut}");
    assert!(
        settled(1_400),
        "settled {}",
        envoy.counter("llm", "settled")
    );
    // …and one that reported more than the reservation before it was cut settles that.
    let cut = read_all(&[
        b"x-api-key: k",
        b"x-stream: 1",
        b"x-format: anthropic",
        b"x-usage-input: 750",
        b"x-cut-after: 2",
    ]);
    assert!(cut.contains("message_start"), "{cut}");
    assert!(
        settled(2_151),
        "settled {}",
        envoy.counter("llm", "settled")
    );
}

/// Read a streamed answer to `lines` from `port` until `events` events have come whole, then
/// reset the connection (all of it if `events` is more than it has). Returns what came.
pub(crate) fn read_events_then_cut(port: u16, lines: &[&[u8]], events: usize) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    stream
        .write_all(&testkit::raw(b"/app/llm/chat", lines))
        .unwrap();
    let mut answer = Vec::new();
    let mut buf = [0; 4096];
    loop {
        let text = String::from_utf8_lossy(&answer);
        let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        if body.matches("\n\n").count() >= events {
            break;
        }
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
        }
    }
    // A reset, not a polite close: the client is gone mid-stream.
    testkit::reset(stream);
    String::from_utf8_lossy(&answer).into_owned()
}

/// Issue 34, item 1: a client that resets the connection after any event of a stream, in every
/// format, is charged at least what the stream delivered — the reservation (2 500: the input and
/// the most output), unless the provider's last usage event came (then the usage, 2 100). Before:
/// an Anthropic stream cut before `message_delta` paid its input and one output token, a Gemini
/// stream its running count.
#[test]
fn a_client_that_cuts_a_stream_at_any_event_pays_at_least_what_it_got() {
    let app = Upstream::start(&[]);
    let opts = Options {
        app_port: Some(app.port),
        ..Options::default()
    };
    let envoy = Envoy::start_with(
        &json!({"rules": [{"name": "llm", "key": ["header:x-api-key"],
            "limit": {"requests": 10000000, "per": "1m"}, "cost": 2500,
            "settle": {"usage": "total"}}]}),
        &opts,
    );
    let mut settled = 0;
    for format in ["openai", "responses", "anthropic", "gemini"] {
        let format_line = format!("x-format: {format}");
        let lines: [&[u8]; 7] = [
            b"x-api-key: k",
            b"x-stream: 1",
            format_line.as_bytes(),
            b"x-usage-input: 100",
            b"x-usage-output: 2000",
            b"x-events: 4",
            b"x-event-ms: 40",
        ];
        // Every event of the stream, and past its end (read whole).
        for events in 0..=8 {
            let got = read_events_then_cut(envoy.port, &lines, events);
            let done = testkit::eventually(std::time::Duration::from_secs(5), || {
                envoy.counter("llm", "settled") > settled
            });
            assert!(done, "{format}, cut after {events} events: never settled");
            let now = envoy.counter("llm", "settled");
            let this = now - settled;
            settled = now;
            // What the client saw of the last usage event decides nothing: the filter may have
            // passed an event or two more than the client read before its reset (a slow client).
            let whole = got.contains("0\r\n\r\n");
            assert!(
                this == 2_500 || (this == 2_100 && events >= 3),
                "{format}, cut after {events} events: settled {this}"
            );
            if whole {
                assert_eq!(this, 2_100, "{format}: read whole");
            }
        }
    }
}

/// Three Envoys sharing one global budget of 10 000 tokens a minute through the quota service,
/// and 20 concurrent streams spread over them, each reserving `reserve`.
/// (The quota service is returned too: without it the failure mode would decide.)
fn global_streams(reserve: &str) -> (Vec<Envoy>, crate::harness::Quota, u64, f64, usize) {
    global_streams_of(json!({"requests": 10000, "per": "1m"}), reserve)
}

/// The same with another `limit`.
fn global_streams_of(
    limit: Value,
    reserve: &str,
) -> (Vec<Envoy>, crate::harness::Quota, u64, f64, usize) {
    let quota = crate::harness::Quota::start(&[]);
    let app = Upstream::start(&["--capacity", "100"]);
    let plugin = json!({"rules": [{"name": "llm", "scope": "global", "key": ["header:x-api-key"],
            "limit": limit,
            "cost": {"header": "x-max-tokens", "default": 500, "max": 2000},
            "settle": {"usage": "total"}}],
        "quota_service": {"upstream": "quota", "instances_hint": 3, "lease_size": 2500}});
    let opts = Options {
        quota_port: Some(quota.port),
        app_port: Some(app.port),
        ..Options::default()
    };
    let envoys: Vec<Envoy> = (0..3).map(|_| Envoy::start_with(&plugin, &opts)).collect();
    let urls: Vec<String> = envoys.iter().map(|e| e.url("/app/llm/chat")).collect();
    let (admitted, used, seconds) = send_streams(&urls, Some(reserve));
    let settled: u64 = envoys.iter().map(|e| e.counter("llm", "settled")).sum();
    assert_eq!(settled, used, "settled exactly what the streams reported");
    drop(app);
    (envoys, quota, used, seconds, admitted.len())
}

#[test]
fn three_envoys_keep_one_global_token_budget_under_concurrent_streams() {
    let (_envoys, _quota, used, seconds, admitted) = global_streams("2000");
    let bound = 10_000.0 + 10_000.0 * seconds / 60.0;
    eprintln!("global: {admitted} of 20 admitted, {used} tokens used in {seconds:.2} s (bound {bound:.0})");
    assert!(used as f64 <= bound, "{used} > {bound}");
    assert!(admitted >= 1);
}

#[test]
fn three_envoys_with_small_reservations_overshoot_by_their_excess_at_most() {
    let (envoys, _quota, used, seconds, admitted) = global_streams("300");
    // Every admitted stream reserved 300: the bound adds their excess over it.
    let excess: u64 = (0..20)
        .map(|i| (usage_of(i).0 + usage_of(i).1).saturating_sub(300))
        .sum();
    let bound = 10_000.0 + 10_000.0 * seconds / 60.0 + excess as f64;
    eprintln!("global, reserving 300: {admitted} of 20 admitted, {used} tokens used in {seconds:.2} s (bound {bound:.0})");
    assert!(used as f64 <= bound, "{used} > {bound}");
    let charged: u64 = envoys.iter().map(|e| e.counter("llm", "charged")).sum();
    assert_eq!(
        charged,
        used - 300 * admitted as u64,
        "every excess charged"
    );
    // Some of it went beyond what the proxies' allowances held.
    let debt: u64 = envoys.iter().map(|e| e.counter("llm", "debt")).sum();
    assert!(
        debt > 0 && debt <= charged,
        "debt {debt} of {charged} charged"
    );
    // What was used beyond the budget is owed, and repaid from the next leases first: no proxy
    // admits the key meanwhile.
    for e in &envoys {
        let reply = Client::new().get(
            &e.url("/app/llm/chat"),
            &[("x-api-key", "team-a"), ("x-max-tokens", "300")],
        );
        assert_eq!(reply.status, 429, "{}", reply.body);
    }
}

#[test]
fn three_envoys_keep_a_monthly_token_budget_and_its_debt_under_concurrent_streams() {
    // 10 000 tokens a calendar month: nothing refills it, so what the streams used is bounded by
    // the budget and what they used beyond their reservations, whatever the time.
    let monthly = json!({"requests": 10000, "per": "month", "calendar": {"time_zone": "UTC"}});
    let (envoys, _quota, used, _, admitted) = global_streams_of(monthly, "300");
    let excess: u64 = (0..20)
        .map(|i| (usage_of(i).0 + usage_of(i).1).saturating_sub(300))
        .sum();
    eprintln!("monthly, reserving 300: {admitted} of 20 admitted, {used} tokens used");
    assert!(used <= 10_000 + excess, "{used} > 10 000 + {excess}");
    let charged: u64 = envoys.iter().map(|e| e.counter("llm", "charged")).sum();
    assert_eq!(
        charged,
        used - 300 * admitted as u64,
        "every excess charged"
    );
    // The month's budget is spent and owed beyond: every Envoy refuses, told to come back when
    // the month ends (not when a token would refill).
    for e in &envoys {
        let reply = Client::new().get(
            &e.url("/app/llm/chat"),
            &[("x-api-key", "team-a"), ("x-max-tokens", "300")],
        );
        assert_eq!(reply.status, 429, "{}", reply.body);
        let wait: u64 = reply.header("retry-after").unwrap().parse().unwrap();
        assert!(wait > 60, "retry-after {wait}: the month's end");
    }
}

const USAGE_1000: &str =
    r#"{"usage":{"prompt_tokens":100,"completion_tokens":900,"total_tokens":1000}}"#;

#[test]
fn a_reservation_from_the_request_body_refuses_what_does_not_fit_and_settles_the_rest() {
    let opts = Options {
        routes: vec![answer("/v1/chat", 200, USAGE_1000, "application/json")],
        body_readable: true,
        ..Options::default()
    };
    // 10 000 tokens a minute per key; a request reserves the largest of its maxima plus its
    // body's bytes / 4.
    let envoy = Envoy::start_with(
        &json!({"rules": [{"name": "llm", "key": ["header:x-api-key"],
            "limit": {"requests": 10000, "per": "1m"},
            "cost": {"body": ["max_tokens", "max_completion_tokens", "max_output_tokens"],
                     "input_bytes_per_token": 4, "max": 10000},
            "settle": {"usage": "total"}}]}),
        &opts,
    );
    let client = Client::new();
    let url = envoy.url("/v1/chat");
    let key = [
        ("x-api-key", "team-a"),
        ("content-type", "application/json"),
    ];
    let body = |fields: &str| format!(r#"{{"model":"m",{fields},"messages":[]}}"#);
    let first = client.post(&url, &key, body(r#""max_tokens":6000"#).as_bytes());
    assert_eq!(first.status, 200);
    assert!(first.body.contains("total_tokens"));
    // 1 000 used: 9 000 left, and 9 500 plus the input does not fit, however it is spelt.
    for fields in [
        r#""max_tokens":9500"#,
        r#""max_tokens":10,"max_completion_tokens":9500"#,
    ] {
        let refused = client.post(&url, &key, body(fields).as_bytes());
        assert_eq!(refused.status, 429, "{fields}");
        assert!(refused.header("retry-after").is_some());
    }
    assert_eq!(
        client
            .post(&url, &key, body(r#""max_output_tokens":8000"#).as_bytes())
            .status,
        200
    );
    // Without a body: decided on the headers, at the default (`max`): 8 000 left is too little.
    assert_eq!(client.get(&url, &key).status, 429);
    let reserved = 6_000
        + (body(r#""max_tokens":6000"#).len() as u64).div_ceil(4)
        + 8_000
        + (body(r#""max_output_tokens":8000"#).len() as u64).div_ceil(4);
    assert_eq!(envoy.counter("llm", "reserved"), reserved);
    assert_eq!(envoy.counter("llm", "settled"), 2_000);
}

#[test]
fn keys_from_a_body_field_and_a_body_larger_than_the_buffer_goes_through() {
    let envoy = chat_envoy(&json!({"rules": [
            {"name": "per-model", "key": ["body:model"], "limit": {"requests": 2, "per": "1h"}},
            {"name": "budget", "limit": {"requests": 1000000, "per": "1h"},
             "cost": {"body": ["max_tokens"], "default": 50, "max": 7000},
             "settle": {"usage": "total"}}]}));
    let client = Client::new();
    let url = envoy.url("/v1/chat");
    let post = |body: &str| client.post(&url, &[], body.as_bytes()).status;
    assert_eq!(post(r#"{"model":"a","max_tokens":1}"#), 200);
    assert_eq!(post(r#"{"model":"a","max_tokens":1}"#), 200);
    assert_eq!(post(r#"{"model":"a","max_tokens":1}"#), 429);
    assert_eq!(post(r#"{"model":"b"}"#), 200);
    // 2 MiB, more than the default 256 KiB read, and than Envoy's 1 MiB buffer limit: decided once
    // 256 KiB came, at `max`, and the per-model rule counts it as the "unreadable" model (2 an
    // hour, as any); held under flow control meanwhile, never answered 413.
    let big = format!(
        r#"{{"model":"a","max_tokens":1,"pad":"{}"}}"#,
        "x".repeat(2 << 20)
    );
    let statuses: Vec<u16> = (0..5).map(|_| post(&big)).collect();
    assert_eq!(statuses, [200, 200, 429, 429, 429]);
    // (A refused request is charged to no rule.)
    assert_eq!(envoy.counter("budget", "reserved"), 1 + 1 + 50 + 2 * 7_000);
}

#[test]
fn without_allow_on_headers_stop_iteration_a_body_is_never_read_and_the_log_says_what_to_set() {
    // Envoy's default for a Wasm filter: a request paused on its headers gets no body callback.
    // The dynamic module has no such setting: it always reads the body, at once.
    let opts = Options {
        routes: vec![answer("/v1/chat", 200, USAGE_1000, "application/json")],
        ..Options::default()
    };
    let envoy = Envoy::start_with(
        &json!({"rules": [{"name": "llm", "limit": {"requests": 10000, "per": "1m"},
            "cost": {"body": ["max_tokens"], "max": 6000}, "settle": {"usage": "total"}}]}),
        &opts,
    );
    let client = Client::new();
    let started = Instant::now();
    let reply = client.post(&envoy.url("/v1/chat"), &[], br#"{"max_tokens":10}"#);
    assert_eq!(reply.status, 200);
    let waited = started.elapsed().as_secs_f64();
    if build() == Build::Native {
        assert!(waited < 1.0, "the body is read at once ({waited} s)");
        assert_eq!(envoy.counter("llm", "reserved"), 10);
        assert!(!envoy.log().contains("allow_on_headers_stop_iteration"));
        return;
    }
    // Decided without its body: at max, which fits.
    assert!(waited >= 1.9, "after the 2 s wait ({waited} s)");
    assert!(envoy.log_shows("allow_on_headers_stop_iteration"));
    assert_eq!(envoy.counter("llm", "reserved"), 6_000);
}

#[test]
fn the_llm_guides_envoy_configuration_works_as_written() {
    let guide =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/llm-budgets.md"))
            .unwrap();
    let yaml = guide
        .split("```yaml")
        .nth(1)
        .unwrap()
        .split("```")
        .next()
        .unwrap();
    let app = Upstream::start(&[]);
    // Only where it runs changes: the module's path, the ports, the upstream's address.
    let yaml = yaml
        .replace(
            "/etc/envoy/tollgate.wasm",
            &crate::harness::wasm_path().display().to_string(),
        )
        .replace("port_value: 10000", "port_value: 0")
        .replace("port_value: 8000", &format!("port_value: {}", app.port));
    let envoy = Envoy::start_bootstrap(serde_yaml_ng::from_str(&yaml).unwrap());
    let client = Client::new();
    let url = envoy.url("/v1/llm/chat");
    let ask = |key: &str, body: &str, output: &str| {
        client.post(
            &url,
            &[
                ("x-api-key", key),
                ("x-usage-input", "100"),
                ("x-usage-output", output),
            ],
            body.as_bytes(),
        )
    };
    // Reserves 6 000 and its bytes, uses 1 100.
    let first = ask("team-a", r#"{"model":"m","max_tokens":6000}"#, "1000");
    assert_eq!(first.status, 200, "{}", first.body);
    assert!(first.body.contains("total_tokens"));
    // 8 900 left: a request that may use 9 000 is refused, however it names it.
    let refused = ask(
        "team-a",
        r#"{"max_tokens":1,"max_completion_tokens":9000}"#,
        "1",
    );
    assert_eq!(refused.status, 429);
    assert!(refused.header("retry-after").is_some());
    assert_eq!(
        ask("team-b", r#"{"max_completion_tokens":9000}"#, "1").status,
        200
    );
    assert_eq!(
        ask("team-a", r#"{"max_output_tokens":8000}"#, "1").status,
        200
    );
    // The guide's stats, labelled as it says.
    assert_eq!(
        envoy.counter("tokens-per-key", "settled"),
        1_100 + 101 + 101
    );
}

#[test]
fn a_cost_from_a_field_of_the_upstreams_json_answer() {
    let opts = Options {
        routes: vec![answer(
            "/convert",
            200,
            r#"{"id":"job-1","billing":{"credits":40}}"#,
            "application/json",
        )],
        ..Options::default()
    };
    // 100 credits an hour per user; a job reserves 10 and costs what the answer says.
    let envoy = Envoy::start_with(
        &json!({"rules": [{"name": "credits", "key": ["header:x-user"],
            "limit": {"requests": 100, "per": "1h"}, "cost": 10,
            "settle": {"body_field": "billing.credits"}}]}),
        &opts,
    );
    let client = Client::new();
    let user = [("x-user", "u")];
    let statuses: Vec<u16> = (0..4)
        .map(|_| client.get(&envoy.url("/convert"), &user).status)
        .collect();
    // 40 + 40 used; the third reserves 10 of the 20 left and is charged 30 more (debt 10).
    assert_eq!(statuses, [200, 200, 200, 429]);
    assert_eq!(envoy.counter("credits", "settled"), 120);
}

#[test]
fn usage_settles_in_every_format_json_and_streamed_and_from_a_response_header() {
    let app = Upstream::start(&[]);
    let mut header_route = answer("/metered", 200, "done\n", "text/plain");
    header_route["response_headers_to_add"] = json!([{"header": {"key": "x-usage-tokens", "value": "7"},
        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]);
    let opts = Options {
        app_port: Some(app.port),
        routes: vec![header_route],
        ..Options::default()
    };
    let envoy = Envoy::start_with(
        &json!({"rules": [
            {"name": "llm", "match": {"path_prefix": "/app/llm"}, "key": ["header:x-api-key"],
             "limit": {"requests": 100000, "per": "1m"}, "cost": 2000,
             "settle": {"usage": {"input": 1, "output": 2}}},
            {"name": "metered", "match": {"path_prefix": "/metered"},
             "limit": {"requests": 100, "per": "1m"}, "cost": 50,
             "settle": {"header": "x-usage-tokens"}}]}),
        &opts,
    );
    let client = Client::new();
    let mut want = 0;
    for format in ["openai", "responses", "anthropic", "gemini"] {
        for stream in ["0", "1"] {
            let reply = client.get(
                &envoy.url("/app/llm/chat"),
                &[
                    ("x-api-key", "k"),
                    ("x-format", format),
                    ("x-stream", stream),
                    ("x-usage-input", "30"),
                    ("x-usage-output", "100"),
                ],
            );
            assert_eq!(reply.status, 200, "{format} {stream}");
            // Input once, output twice.
            want += 230;
            let settled = testkit::eventually(std::time::Duration::from_secs(5), || {
                envoy.counter("llm", "settled") == want
            });
            assert!(
                settled,
                "{format}, stream {stream}: {}",
                envoy.counter("llm", "settled")
            );
        }
    }
    for _ in 0..3 {
        assert_eq!(client.get(&envoy.url("/metered"), &[]).status, 200);
    }
    assert_eq!(envoy.counter("metered", "settled"), 21);
    assert_eq!(envoy.counter("metered", "refunded"), 3 * 43);
}

#[test]
fn a_body_larger_than_envoy_holds_is_decided_when_it_stops_coming() {
    let envoy = chat_envoy(
        &json!({"rules": [{"name": "per-model", "key": ["body:model"],
            "limit": {"requests": 1, "per": "1h"}, "missing_key": "limit"}],
            "max_request_body_bytes": 4 << 20}),
    );
    let client = Client::new();
    // 3 MiB with the model at its end: more than Envoy's 1 MiB buffer limit holds, so the client
    // is stopped before the end; 0.5 s later the request is decided as one too long to read
    // (the model absent: with missing_key "limit", one shared bucket) — never a 413, never stuck.
    let body = |model: &str| format!(r#"{{"pad":"{}","model":"{model}"}}"#, "x".repeat(3 << 20));
    let url = envoy.url("/v1/chat");
    let started = Instant::now();
    assert_eq!(client.post(&url, &[], body("a").as_bytes()).status, 200);
    assert!(started.elapsed().as_secs_f64() >= 0.5);
    assert_eq!(client.post(&url, &[], body("b").as_bytes()).status, 429);
}

/// Numbers past each end of the range, from the upstream: a usage of 10³⁰ (as a float or as
/// digits) or a cost header past 64 bits is the largest charge — a debt that refuses the key with
/// a Retry-After of years — never ignored; a negative count is no count, and the others stand.
#[test]
fn a_usage_too_large_for_64_bits_is_a_debt_and_a_negative_count_is_none() {
    let json = "application/json";
    let mut header_route = answer("/header", 200, "done\n", "text/plain");
    header_route["response_headers_to_add"] = json!([{"header": {"key": "x-usage-tokens",
        "value": "99999999999999999999999"}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]);
    let opts = Options {
        routes: vec![
            answer("/u/float", 200, r#"{"usage":{"total_tokens":1e30}}"#, json),
            answer(
                "/u/digits",
                200,
                r#"{"usage":{"total_tokens":1000000000000000000000000000000}}"#,
                json,
            ),
            answer(
                "/u/negative",
                200,
                r#"{"usage":{"prompt_tokens":-5,"completion_tokens":40}}"#,
                json,
            ),
            header_route,
        ],
        ..Options::default()
    };
    let envoy = Envoy::start_with(
        &json!({"rules": [
            {"name": "llm", "match": {"path_prefix": "/u/"},
             "key": ["header:x-api-key"], "limit": {"requests": 1000, "per": "1m"}, "cost": 100,
             "settle": {"usage": "total"}},
            {"name": "metered", "match": {"path_prefix": "/header"}, "key": ["header:x-api-key"],
             "limit": {"requests": 1000, "per": "1m"}, "cost": 100,
             "settle": {"header": "x-usage-tokens"}}]}),
        &opts,
    );
    let client = Client::new();
    let key = [("x-api-key", "negative")];
    assert_eq!(client.get(&envoy.url("/u/negative"), &key).status, 200);
    assert_eq!(
        envoy.counter("llm", "settled"),
        40,
        "the negative input is no count; the output stands"
    );
    for path in ["/u/float", "/u/digits", "/header"] {
        let key = [("x-api-key", path)];
        assert_eq!(client.get(&envoy.url(path), &key).status, 200, "{path}");
        let refused = client.get(&envoy.url(path), &key);
        assert_eq!(refused.status, 429, "{path}: the huge charge is a debt");
        let retry: u64 = refused
            .header("retry-after")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{path}: a Retry-After"));
        assert!(retry > 10_000_000, "{path}: Retry-After {retry}");
        // Another key is another budget.
        let other = format!("someone else on {path}");
        let other = [("x-api-key", other.as_str())];
        assert_eq!(client.get(&envoy.url(path), &other).status, 200, "{path}");
    }
}

/// Send `head` and the first `first` bytes of a body of `length`, then one byte every `every`
/// until `stop` is set or the body is whole; returns the response's status line, or "" if none
/// came.
fn drip(
    port: u16,
    length: usize,
    first: usize,
    every: std::time::Duration,
    stop: &std::sync::atomic::AtomicBool,
) -> (String, f64) {
    use std::io::{Read, Write};
    use std::sync::atomic::Ordering;
    let started = Instant::now();
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(std::time::Duration::from_millis(50)))
        .unwrap();
    let head = format!(
        "POST /v1/chat HTTP/1.1\r\nHost: h\r\nx-api-key: k\r\ncontent-type: application/json\r\n\
         content-length: {length}\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).unwrap();
    stream.write_all(&vec![b' '; first]).unwrap();
    let mut sent = first;
    let mut answer = Vec::new();
    let mut buf = [0; 1024];
    let mut next = Instant::now() + every;
    while !stop.load(Ordering::Relaxed) && started.elapsed().as_secs() < 60 {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                answer.extend_from_slice(&buf[..n]);
                if answer.windows(4).any(|w| w == b"\r\n\r\n") {
                    break;
                }
            }
            Err(_) => {}
        }
        if Instant::now() >= next && sent < length {
            if stream.write_all(b" ").is_err() {
                break;
            }
            sent += 1;
            next += every;
        }
    }
    let text = String::from_utf8_lossy(&answer);
    let status = text.lines().next().unwrap_or("").to_string();
    (status, started.elapsed().as_secs_f64())
}

/// Issue 34, item 2: a body dripped a byte every 0.4 s never stops coming for 0.5 s; with every
/// default it is decided at its most at the 5 s `request_body_timeout` (before: when its last
/// byte came, 12 s here, and never with a longer body).
#[test]
fn a_dripped_body_is_decided_at_its_deadline() {
    let envoy = chat_envoy(
        &json!({"rules": [{"name": "llm", "key": ["header:x-api-key"],
            "limit": {"requests": 100000, "per": "1m"},
            "cost": {"body": ["max_tokens"], "max": 8000}}]}),
    );
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (status, secs) = drip(
        envoy.port,
        30,
        1,
        std::time::Duration::from_millis(400),
        &stop,
    );
    eprintln!("answered {status:?} after {secs:.1} s");
    assert!(status.contains("200"), "{status:?}");
    assert!((4.9..7.0).contains(&secs), "answered after {secs:.1} s");
    assert_eq!(envoy.counter("llm", "allowed"), 1);
    assert_eq!(envoy.await_prometheus("tollgate_bodies_unread{}", 1), 1);
}

/// Issue 34, item 2: 100 uploads of 300 kB that send 200 kB and then drip. The bodies a worker
/// keeps stay within `max_waiting_body_bytes` (8 MiB): uploads beyond it are decided at once,
/// unread; the rest at the deadline; nothing is kept once they end, and Envoy's memory comes
/// back down (before: every body kept to its end, Envoy's RSS 110 → 403 MB for 500 uploads).
#[test]
fn a_flood_of_slow_uploads_keeps_a_bounded_memory() {
    let envoy = chat_envoy(
        &json!({"rules": [{"name": "llm", "key": ["header:x-api-key"],
            "limit": {"requests": 10000000, "per": "1m"},
            "cost": {"body": ["max_tokens"], "max": 8000}}]}),
    );
    let before = envoy.rss_kib();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let mut peak_kept = 0;
    let answers: Vec<(String, f64)> = std::thread::scope(|s| {
        let uploads: Vec<_> = (0..100)
            .map(|_| {
                s.spawn(|| {
                    drip(
                        envoy.port,
                        300_000,
                        200_000,
                        std::time::Duration::from_millis(400),
                        &stop,
                    )
                })
            })
            .collect();
        for _ in 0..20 {
            std::thread::sleep(std::time::Duration::from_millis(200));
            peak_kept = peak_kept.max(envoy.prometheus("tollgate_bodies_kept_bytes{}"));
        }
        uploads.into_iter().map(|u| u.join().unwrap()).collect()
    });
    let during = envoy.rss_kib();
    let early = answers.iter().filter(|(_, secs)| *secs < 2.0).count();
    let late = answers.iter().filter(|(_, secs)| *secs >= 2.0).count();
    eprintln!(
        "answered at once {early}, at the deadline {late}; at most {peak_kept} bytes kept; \
         Envoy RSS {before} KiB before, {during} KiB after"
    );
    let statuses: Vec<&str> = answers.iter().map(|(s, _)| s.as_str()).collect();
    assert!(statuses.iter().all(|s| s.contains("200")), "{statuses:?}");
    assert!(answers.iter().all(|(_, secs)| *secs < 7.0));
    // Two workers, 8 MiB each at most.
    assert!(peak_kept <= 2 * (8 << 20), "{peak_kept} bytes kept");
    assert!(
        early > 0 && late > 0,
        "{early} at once, {late} at the deadline"
    );
    assert_eq!(envoy.await_prometheus("tollgate_bodies_kept_bytes{}", 0), 0);
    assert_eq!(envoy.await_prometheus("tollgate_bodies_unread{}", 100), 100);
}

/// Issue 34, item 4: bodies an upstream may read though the filter's strict JSON cannot (`NaN`,
/// `1e400`, a byte-order mark, a trailing comma) reserve the most, and a `body:model` key counts
/// them as one "unreadable" model — limited, with its RateLimit headers — rather than skipping
/// the rule (before: ~1 090 reserved where Python reads max_tokens 50 000, and 6 of 6 admitted
/// on a rule of 3 an hour, with no RateLimit header).
#[test]
fn bodies_only_a_lenient_upstream_reads_reserve_the_most_and_are_limited() {
    let envoy = chat_envoy(&json!({"rules": [
            {"name": "budget", "key": ["header:x-api-key"], "limit": {"requests": 10000000, "per": "1d"},
             "cost": {"body": ["max_tokens"], "input_bytes_per_token": 4, "max": 50000}},
            {"name": "per-model", "key": ["body:model"], "limit": {"requests": 3, "per": "1h"}}]}));
    let client = Client::new();
    let bodies: [&[u8]; 6] = [
        br#"{"model":"gpt","max_tokens":NaN}"#,
        br#"{"model":"gpt","max_tokens":1e400}"#,
        b"\xef\xbb\xbf{\"model\":\"gpt\",\"max_tokens\":50000}",
        br#"{"model":"gpt","max_tokens":50000,}"#,
        br#"{"model":"gpt","max_tokens":50000} x"#,
        br#"{'model':'gpt','max_tokens':50000}"#,
    ];
    let mut statuses = Vec::new();
    for body in bodies {
        let reply = client.post(&envoy.url("/v1/chat"), &[("x-api-key", "k")], body);
        if reply.status == 200 {
            assert!(reply.header("ratelimit").is_some(), "{:?}", reply.headers);
        }
        statuses.push(reply.status);
    }
    assert_eq!(
        statuses,
        [200, 200, 200, 429, 429, 429],
        "3 an hour for unreadable bodies"
    );
    // Each admitted one reserved the most (refused ones were charged to no rule).
    assert_eq!(envoy.counter("budget", "allowed"), 3);
    assert_eq!(envoy.counter("per-model", "limited"), 3);
    let reply = client.post(
        &envoy.url("/v1/chat"),
        &[("x-api-key", "k")],
        br#"{"model":"gpt","max_tokens":100}"#,
    );
    assert_eq!(reply.status, 200, "a readable model has its own bucket");
    // Without a body the per-model rule does not apply, and the headers state the budget: 3 ×
    // 50 000 reserved by the unreadable bodies, 100 and its input, and this one's 50 000 (less
    // the refill meanwhile: 116 a second).
    let reply = client.get(&envoy.url("/v1/chat"), &[("x-api-key", "k")]);
    let r = reply.header("ratelimit").unwrap_or_default().to_string();
    let left: u64 = r
        .split("\"budget\";r=")
        .nth(1)
        .and_then(|rest| rest.split(';').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the budget's remaining in {r}"));
    assert!(left <= 10_000_000 - 200_000, "{r}");
}
