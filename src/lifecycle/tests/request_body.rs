//! Rules that read the request body: the decision waits for it (Envoy pauses the headers, nginx
//! reads the body before forwarding), reservations from its fields, keys from them.

use super::mock::Proxy;
use super::BOTH;
use crate::config::HostCaps;
use crate::lifecycle::Action;

const LLM: &str = r#"{"rules":[{"name":"llm","key":["header:x-api-key"],
    "limit":{"requests":10000,"per":"1m"},
    "cost":{"body":["max_tokens","max_completion_tokens"],"input_bytes_per_token":4,"max":8000},
    "settle":{"usage":"total"}}]}"#;

const USAGE_1000: &[u8] =
    br#"{"usage":{"prompt_tokens":100,"completion_tokens":900,"total_tokens":1000}}"#;

/// What a body callback answers for a body kept back: under flow control in Envoy, paused in
/// nginx.
fn kept_back(caps: HostCaps) -> Action {
    if caps.request_end_known {
        Action::HoldBody
    } else {
        Action::Pause
    }
}

/// What the headers callback answers when a rule waits for the body.
fn paused_for_body(caps: HostCaps) -> Action {
    if caps.request_end_known {
        Action::Pause
    } else {
        Action::Continue
    }
}

#[test]
fn a_reservation_is_the_bodys_largest_maximum_plus_its_input_and_settles_after() {
    let key = ("x-api-key", "k");
    for caps in BOTH {
        let mut proxy = Proxy::new(caps, LLM);
        // 28 bytes: 7 tokens of input; the larger of the two maxima.
        let body: &[u8] = br#"{"max_tokens":10,"max_completion_tokens":6000}"#;
        let (first, action) = proxy.request_with_body(&[key], &[&body[..20], &body[20..]]);
        assert_eq!(action, Action::Continue, "{}", caps.name);
        let reserved = 6_000 + (body.len() as u64).div_ceil(4);
        // 10 000 − 6 012 left: a second such request does not fit.
        let (second, action) = proxy.request_with_body(&[key], &[body]);
        assert_eq!(action, kept_back(caps), "{}", caps.name);
        let refused = proxy.local_response(second).expect("refused");
        assert_eq!(refused.status, 429, "{}", caps.name);
        // The first used 1 000: the rest comes back, and the second fits now.
        proxy.upstream_streams(
            first,
            200,
            &[("content-type", "application/json")],
            &[USAGE_1000],
        );
        let (_, action) = proxy.request_with_body(&[key], &[body]);
        assert_eq!(action, Action::Continue, "{}", caps.name);
        proxy.tick();
        assert_eq!(
            proxy.metric("tollgate.rule.llm.reserved"),
            2 * reserved as i64,
            "{}",
            caps.name
        );
        assert_eq!(
            proxy.metric("tollgate.rule.llm.refunded"),
            reserved as i64 - 1_000,
            "{}",
            caps.name
        );
    }
}

#[test]
fn the_headers_wait_for_the_body_only_where_a_rule_reads_it() {
    let config = r#"{"rules":[{"name":"llm","match":{"path_prefix":"/v1/"},
        "limit":{"requests":10000,"per":"1m"},"cost":{"body":["max_tokens"],"max":100}}]}"#;
    for caps in BOTH {
        let mut proxy = Proxy::new(caps, config);
        // No body: decided on the headers, at the default (`max`).
        let (_, action) = proxy.request(&[(":path", "/v1/models")]);
        assert_eq!(action, Action::Continue, "{}", caps.name);
        // A body on a path no such rule matches: decided on the headers too.
        let (_, action) = proxy.request_with_body(&[(":path", "/health")], &[b"{}"]);
        assert_eq!(action, Action::Continue, "{}", caps.name);
        let (_, action) =
            proxy.request_headers(&[(":path", "/v1/chat"), ("content-length", "2")], false);
        assert_eq!(action, paused_for_body(caps), "{}", caps.name);
        proxy.tick();
        // Only the request without a body was decided.
        assert_eq!(
            proxy.metric("tollgate.rule.llm.allowed"),
            1,
            "{}",
            caps.name
        );
    }
}

#[test]
fn keys_from_a_body_field_and_a_body_too_large_to_read_reserves_the_most() {
    let config = r#"{"rules":[{"name":"per-model","key":["body:model"],
        "limit":{"requests":2,"per":"1h"}},
        {"name":"budget","limit":{"requests":100000,"per":"1h"},
         "cost":{"body":["max_tokens"],"default":50,"max":7000},"settle":{"statuses":["5xx"]}}],
        "max_request_body_bytes":64}"#;
    for caps in BOTH {
        let mut proxy = Proxy::new(caps, config);
        let mut send = |body: &str| proxy.request_with_body(&[], &[body.as_bytes()]).1;
        assert_eq!(send(r#"{"model":"a","max_tokens":1}"#), Action::Continue);
        assert_eq!(send(r#"{"model":"a","max_tokens":1}"#), Action::Continue);
        assert_eq!(
            send(r#"{"model":"a","max_tokens":1}"#),
            kept_back(caps),
            "{}",
            caps.name
        );
        assert_eq!(send(r#"{"model":"b"}"#), Action::Continue, "{}", caps.name);
        // No model: the per-model rule does not apply (`missing_key: skip`).
        assert_eq!(
            send(r#"{"max_tokens":1}"#),
            Action::Continue,
            "{}",
            caps.name
        );
        // 80 bytes, more than the 64 read: its fields go unread, it reserves `max`, and Envoy
        // decides as soon as 64 are buffered.
        let padding = "x".repeat(40);
        let big = format!(r#"{{"model":"a","max_tokens":1,"pad":"{padding}"}}"#);
        let (id, action) = proxy.request_with_body(
            &[],
            &[
                &big.as_bytes()[..40],
                &big.as_bytes()[40..70],
                &big.as_bytes()[70..],
            ],
        );
        assert_eq!(action, Action::Continue, "{}", caps.name);
        assert!(proxy.local_response(id).is_none(), "{}", caps.name);
        proxy.tick();
        // 1 + 1 (the third, refused by the other rule, keeps nothing) + 50 + 1 + 7 000
        assert_eq!(
            proxy.metric("tollgate.rule.budget.reserved"),
            7_053,
            "{}",
            caps.name
        );
    }
}

#[test]
fn a_request_decided_before_its_body_ended_keeps_the_rest_back_while_it_is_held() {
    // (A body too long to read counts as no model here, as a request without a body: one
    // bucket for both.)
    let config = r#"{"rules":[{"name":"lb","algorithm":"leaky_bucket","key":["body:model"],
        "missing_key":"limit","unreadable_body":"skip","limit":{"requests":10,"per":"1s"},"burst":5}],
        "max_request_body_bytes":64}"#;
    let mut proxy = Proxy::new(HostCaps::ENVOY, config);
    assert_eq!(proxy.request(&[]).1, Action::Continue);
    let (held, action) = proxy.request_headers(&[("content-length", "100")], false);
    assert_eq!(action, Action::Pause, "waits for the body");
    assert_eq!(
        proxy.request_body(held, &[b' '; 40], false),
        Action::HoldBody
    );
    // 70 of 100 bytes: decided (held 100 ms behind the first); the rest stays back.
    assert_eq!(
        proxy.request_body(held, &[b' '; 30], false),
        Action::HoldBody
    );
    assert_eq!(
        proxy.request_body(held, &[b' '; 10], false),
        Action::HoldBody
    );
    proxy.advance_ms(100);
    proxy.tick();
    assert!(proxy.resumed(held));
    assert_eq!(
        proxy.request_body(held, &[b' '; 20], true),
        Action::Continue
    );
}

#[test]
fn without_body_callbacks_a_paused_request_is_decided_at_its_most_after_two_seconds() {
    // Envoy without `allow_on_headers_stop_iteration` holds the body of a request paused on its
    // headers back from the filter: no body callback ever comes.
    let config = r#"{"rules":[{"name":"llm","limit":{"requests":10000,"per":"1m"},
        "cost":{"body":["max_tokens"],"max":6000},"settle":{"statuses":["5xx"]}}]}"#;
    let mut proxy = Proxy::new(HostCaps::ENVOY, config);
    let (first, action) = proxy.request_headers(&[("content-length", "20")], false);
    assert_eq!(action, Action::Pause);
    proxy.advance_ms(1_000);
    proxy.tick();
    assert!(!proxy.resumed(first), "not yet");
    let (second, _) = proxy.request_headers(&[("content-length", "20")], false);
    proxy.advance_ms(1_000);
    proxy.tick();
    assert!(proxy.resumed(first), "decided without its body after 2 s");
    assert!(!proxy.resumed(second));
    proxy.advance_ms(1_000);
    proxy.tick();
    // 6 000 each: the second does not fit any more.
    assert!(!proxy.resumed(second));
    assert_eq!(proxy.local_response(second).map(|l| l.status), Some(429));
    assert_eq!(proxy.metric("tollgate.rule.llm.reserved"), 6_000);
    // Once a body callback came, requests wait for theirs however long it takes.
    let (third, _) = proxy.request_headers(&[("content-length", "2")], false);
    assert_eq!(proxy.request_body(third, b"{", false), Action::HoldBody);
    let (fourth, _) = proxy.request_headers(&[("content-length", "2")], false);
    proxy.advance_ms(5_000);
    proxy.tick();
    assert!(!proxy.resumed(fourth));
}

#[test]
fn the_body_of_a_request_waiting_for_quota_stays_back_until_it_is_admitted() {
    // With `allow_on_headers_stop_iteration`, Envoy hands over body chunks of a request paused
    // on its headers: going on there would forward it undecided.
    let config = super::GLOBAL.replace("FAILURE", "deny");
    let mut proxy = Proxy::new(HostCaps::ENVOY, &config);
    let (id, action) = proxy.request_headers(&[("x-user", "u"), ("content-length", "4")], false);
    assert_eq!(action, Action::Pause, "waits for its first lease");
    assert_eq!(proxy.request_body(id, b"ab", false), Action::HoldBody);
    let call = super::lease_call_for(&proxy, HostCaps::ENVOY, id);
    proxy.answer(&call, Some((200, super::grant(40))));
    proxy.tick();
    assert!(proxy.resumed(id));
    assert_eq!(proxy.request_body(id, b"cd", true), Action::Continue);
}

#[test]
fn a_dry_run_budget_admits_everything_and_counts_what_it_would_refuse() {
    let config = LLM.replace(
        r#""settle":{"usage":"total"}}"#,
        r#""settle":{"usage":"total"},"dry_run":true}"#,
    );
    for caps in BOTH {
        let mut proxy = Proxy::new(caps, &config);
        let body: &[u8] = br#"{"max_tokens":6000}"#;
        // Three at once: 6 005 each of 10 000, so two would have been refused.
        let ids: Vec<u32> = (0..3)
            .map(|_| {
                let (id, action) = proxy.request_with_body(&[("x-api-key", "k")], &[body]);
                assert_eq!(action, Action::Continue, "{}", caps.name);
                id
            })
            .collect();
        for id in ids {
            proxy.upstream_streams(
                id,
                200,
                &[("content-type", "application/json")],
                &[USAGE_1000],
            );
        }
        proxy.tick();
        assert_eq!(
            proxy.metric("tollgate.rule.llm.dry_run_limited"),
            2,
            "{}",
            caps.name
        );
        // Only the one that would have been admitted reserved, and settles.
        assert_eq!(
            proxy.metric("tollgate.rule.llm.reserved"),
            6_005,
            "{}",
            caps.name
        );
        assert_eq!(
            proxy.metric("tollgate.rule.llm.settled"),
            1_000,
            "{}",
            caps.name
        );
    }
}

#[test]
fn a_body_that_ends_with_trailers_is_decided_on_them_at_its_most() {
    let mut proxy = Proxy::new(HostCaps::ENVOY, LLM);
    let key = ("x-api-key", "k");
    let (id, action) = proxy.request_headers(&[key, ("content-type", "application/grpc")], false);
    assert_eq!(action, Action::Pause);
    assert_eq!(
        proxy.request_body(id, b"{\"max_tokens\":5}", false),
        Action::HoldBody
    );
    assert_eq!(proxy.request_trailers(id), Action::Continue);
    proxy.tick();
    assert_eq!(proxy.metric("tollgate.rule.llm.reserved"), 8_000);
    // Trailers of a request decided already change nothing.
    let (id, _) = proxy.request_with_body(&[key], &[b"{\"max_tokens\":5}"]);
    assert_eq!(proxy.request_trailers(id), Action::Continue);
}

#[test]
fn a_body_that_stops_coming_is_decided_without_it_after_half_a_second() {
    let mut proxy = Proxy::new(HostCaps::ENVOY, LLM);
    let (id, _) = proxy.request_headers(&[("x-api-key", "k"), ("content-length", "99")], false);
    assert_eq!(
        proxy.request_body(id, b"{\"max_tokens\":", false),
        Action::HoldBody
    );
    proxy.advance_ms(400);
    proxy.tick();
    assert!(!proxy.resumed(id));
    proxy.advance_ms(100);
    proxy.tick();
    assert!(proxy.resumed(id), "decided at its most");
    proxy.tick();
    assert_eq!(proxy.metric("tollgate.rule.llm.reserved"), 8_000);
}

/// The same rule, with the body's deadline and the worker's room for waiting bodies set small.
fn with_body_limits(timeout: &str, waiting_bytes: u64) -> String {
    LLM.trim_end_matches('}').to_string()
        + &format!(
            r#","request_body_timeout":"{timeout}","max_request_body_bytes":100,"max_waiting_body_bytes":{waiting_bytes}}}"#
        )
}

#[test]
fn a_body_dripped_a_byte_at_a_time_is_decided_at_its_deadline() {
    let mut proxy = Proxy::new(HostCaps::ENVOY, &with_body_limits("1s", 1_000));
    let (id, _) = proxy.request_headers(&[("x-api-key", "k"), ("content-length", "90")], false);
    // A byte every 0.4 s never stalls for 0.5 s (before: held for ever).
    for n in 0..2 {
        assert_eq!(proxy.request_body(id, b" ", false), Action::HoldBody, "{n}");
        proxy.advance_ms(400);
        proxy.tick();
        assert!(!proxy.resumed(id));
    }
    proxy.request_body(id, b" ", false);
    proxy.advance_ms(200);
    proxy.tick();
    assert!(
        proxy.resumed(id),
        "decided at its deadline, 1 s after its headers"
    );
    proxy.tick();
    assert_eq!(
        proxy.metric("tollgate.rule.llm.reserved"),
        8_000,
        "at its most"
    );
    assert_eq!(proxy.metric("tollgate.bodies.unread"), 1);
    assert_eq!(proxy.metric("tollgate.bodies.kept_bytes"), 0);
}

#[test]
fn bodies_past_the_workers_room_are_decided_at_once_unread_and_the_room_comes_back() {
    let mut proxy = Proxy::new(HostCaps::ENVOY, &with_body_limits("5s", 250));
    let chunk = [b' '; 60];
    let mut waiting = Vec::new();
    // Four bodies of 60 bytes each fit in 250…
    for key in ["a", "b", "c", "d"] {
        let (id, _) = proxy.request_headers(&[("x-api-key", key), ("content-length", "90")], false);
        assert_eq!(proxy.request_body(id, &chunk, false), Action::HoldBody);
        waiting.push(id);
    }
    proxy.tick();
    assert_eq!(proxy.metric("tollgate.bodies.kept_bytes"), 240);
    // …a fifth's first bytes do not: it is decided now, at its most, and keeps nothing.
    let (fifth, _) = proxy.request_headers(&[("x-api-key", "e"), ("content-length", "90")], false);
    assert_eq!(proxy.request_body(fifth, &chunk, false), Action::Continue);
    proxy.tick();
    assert_eq!(proxy.metric("tollgate.rule.llm.reserved"), 8_000);
    assert_eq!(proxy.metric("tollgate.bodies.unread"), 1);
    assert_eq!(proxy.metric("tollgate.bodies.kept_bytes"), 240);
    // One ends with its body read, one's client goes away: their bytes are free again.
    let done = br#"{"max_tokens":5}"#;
    let a = proxy.request_body(waiting[0], &done[..], true);
    assert_eq!(
        a,
        Action::Continue,
        "{:?}",
        proxy.local_response(waiting[0])
    );
    proxy.abort(waiting[1]);
    proxy.tick();
    assert_eq!(proxy.metric("tollgate.bodies.kept_bytes"), 120);
    let (sixth, _) = proxy.request_headers(&[("x-api-key", "f"), ("content-length", "90")], false);
    assert_eq!(proxy.request_body(sixth, &chunk, false), Action::HoldBody);
    for id in [waiting[2], waiting[3], sixth, fifth] {
        proxy.abort(id);
    }
    proxy.tick();
    assert_eq!(proxy.metric("tollgate.bodies.kept_bytes"), 0);
}

/// nginx calls no body callback for an empty chunked body, and hands over nothing of a body it
/// spooled to a file: both are decided as bodies that cannot be read — the most, and the
/// "unreadable" model — never left undecided, nor read as absent.
#[test]
fn in_nginx_a_chunked_request_and_a_spooled_body_are_decided_as_unreadable() {
    let config = r#"{"rules":[
        {"name":"per-ip","key":["client_ip"],"limit":{"requests":100,"per":"1m"}},
        {"name":"per-model","key":["body:model"],"limit":{"requests":1,"per":"1h"}},
        {"name":"llm","limit":{"requests":100000,"per":"1m"},
         "cost":{"body":["max_tokens"],"max":8000},"settle":{"usage":"total"}}]}"#;
    let mut proxy = Proxy::new(HostCaps::NGINX, config);
    let (chunked, action) = proxy.request_headers(&[("transfer-encoding", "chunked")], false);
    assert_eq!(action, Action::Continue, "decided on its headers: admitted");
    assert!(proxy.local_response(chunked).is_none());
    proxy.tick();
    assert_eq!(proxy.metric("tollgate.rule.per-ip.allowed"), 1);
    assert_eq!(proxy.metric("tollgate.rule.llm.reserved"), 8_000);
    // Its body, if one comes after all, changes nothing.
    assert_eq!(proxy.request_body(chunked, b"{}", true), Action::Continue);
    // A spooled body, stated by its length: the "unreadable" model's one request an hour is
    // taken already, by the chunked one.
    let (spooled, action) = proxy.request_headers(&[("content-length", "20000")], false);
    assert_eq!(action, Action::Continue);
    proxy.request_body_spooled(spooled, 20_000);
    assert!(
        proxy.local_response(spooled).is_some(),
        "refused: the unreadable model's limit"
    );
    proxy.tick();
    assert_eq!(proxy.metric("tollgate.bodies.unread"), 2);
}
