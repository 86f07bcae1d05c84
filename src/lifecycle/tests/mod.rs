//! Requests from headers to log through the whole lifecycle, on a mock host of each kind: holds
//! released from the tick, lease waits answered and failed, seats given back on abort.

mod host_calls;
mod mock;
mod pace;
mod request_body;

use super::Action;
use crate::config::HostCaps;
use mock::{Proxy, SentCall};
use serde_json::json;

const BOTH: [HostCaps; 2] = [HostCaps::ENVOY, HostCaps::NGINX];

const GLOBAL: &str = r#"{"rules":[{"name":"g","scope":"global","key":["header:x-user"],
    "limit":{"requests":100,"per":"1m"},"burst":40,"worker_batch":0}],
  "quota_service":{"upstream":"quota","failure_mode":"FAILURE","first_lease":"wait"}}"#;

fn grant(granted: u64) -> serde_json::Value {
    json!({"items":[{"granted":granted,"ttl_ms":10_000,"remaining":granted,"reset_ms":30_000,
        "rate":0.0,"retry_ms":0,"returned":0}],"errors":[]})
}

fn one_call(proxy: &Proxy) -> SentCall {
    let mut calls = proxy.take_calls();
    assert_eq!(calls.len(), 1, "{calls:?}");
    calls.remove(0)
}

/// The lease call a waiting request causes: made by the tick from the root context where the
/// host resumes requests from the timer (Envoy), by the request itself elsewhere (nginx).
fn lease_call_for(proxy: &Proxy, caps: HostCaps, id: u32) -> SentCall {
    if caps.resume_from_timer {
        assert!(
            proxy.take_calls().is_empty(),
            "the request itself calls nothing"
        );
        proxy.tick();
        let call = one_call(proxy);
        assert_ne!(call.caller, id, "sent by the root context");
        call
    } else {
        // The tick may refill keys from the root context as well; the request's is its own.
        let calls = proxy.take_calls();
        let own = calls.iter().find(|c| c.caller == id);
        own.cloned()
            .unwrap_or_else(|| panic!("no call of request {id}'s own: {calls:?}"))
    }
}

#[test]
fn a_request_waiting_for_its_first_lease_goes_on_when_the_answer_grants_tokens() {
    for caps in BOTH {
        let mut proxy = Proxy::new(caps, &GLOBAL.replace("FAILURE", "allow"));
        let (id, action) = proxy.request(&[("x-user", "alice")]);
        assert_eq!(action, Action::Pause, "{}", caps.name);
        let call = lease_call_for(&proxy, caps, id);
        assert_eq!(call.path, "/v1/lease");
        assert_eq!(
            call.body["items"][0]["rule"], "g",
            "{}: {}",
            caps.name, call.body
        );
        proxy.answer(&call, Some((200, grant(10))));
        if caps.resume_from_timer {
            assert!(
                !proxy.resumed(id),
                "decided on the next tick, not in the answer"
            );
            proxy.tick();
        }
        assert!(proxy.resumed(id), "{}", caps.name);
        assert!(proxy.local_response(id).is_none(), "{}", caps.name);
        assert_eq!(proxy.upstream_answers(id, 200), Action::Continue);
        proxy.end(id);
        proxy.tick();
        assert_eq!(proxy.metric("tollgate.quota.waiting"), 0, "{}", caps.name);
    }
}

#[test]
fn a_failed_lease_call_decides_the_waiting_request_by_the_failure_mode() {
    // Envoy refuses by the failure mode; nginx cannot refuse after a failed call of the
    // request's own and takes only `allow` (checked at load), so the request goes on.
    let cases = [
        (HostCaps::ENVOY, "deny", Some(429)),
        (HostCaps::ENVOY, "allow", None),
        (HostCaps::NGINX, "allow", None),
    ];
    for (caps, mode, refused) in cases {
        let what = format!("{} {mode}", caps.name);
        let mut proxy = Proxy::new(caps, &GLOBAL.replace("FAILURE", mode));
        let (id, action) = proxy.request(&[("x-user", "alice")]);
        assert_eq!(action, Action::Pause, "{what}");
        let call = lease_call_for(&proxy, caps, id);
        proxy.answer(&call, None);
        if caps.resume_from_timer {
            proxy.tick();
        }
        match refused {
            Some(status) => {
                let local = proxy.local_response(id).unwrap_or_else(|| panic!("{what}"));
                assert_eq!(local.status, status, "{what}");
                assert!(!proxy.resumed(id), "{what}");
            }
            None => {
                assert!(proxy.resumed(id), "{what}");
                assert!(proxy.local_response(id).is_none(), "{what}");
            }
        }
    }
    assert!(
        Proxy::try_new(HostCaps::NGINX, &GLOBAL.replace("FAILURE", "deny")).is_none(),
        "nginx refuses a failure mode it cannot carry out"
    );
}

#[test]
fn a_request_that_goes_away_while_waiting_is_neither_resumed_nor_counted() {
    for caps in BOTH {
        let mut proxy = Proxy::new(caps, &GLOBAL.replace("FAILURE", "allow"));
        let (id, _) = proxy.request(&[("x-user", "alice")]);
        let call = lease_call_for(&proxy, caps, id);
        proxy.abort(id);
        proxy.answer(&call, Some((200, grant(10))));
        proxy.tick();
        proxy.tick();
        assert!(!proxy.resumed(id), "{}", caps.name);
        assert_eq!(proxy.metric("tollgate.quota.waiting"), 0, "{}", caps.name);
        // The key's tokens serve the next request.
        let (next, action) = proxy.request(&[("x-user", "alice")]);
        if caps.resume_from_timer {
            assert_eq!(action, Action::Continue, "{}", caps.name);
        } else {
            // The answer was for the request that left: the next one calls again.
            assert_eq!(action, Action::Pause, "{}", caps.name);
            let call = lease_call_for(&proxy, caps, next);
            proxy.answer(&call, Some((200, grant(10))));
            assert!(proxy.resumed(next), "{}", caps.name);
        }
    }
}

#[test]
fn a_held_request_is_resumed_from_the_tick_when_it_is_due() {
    let config = r#"{"rules":[{"name":"lb","algorithm":"leaky_bucket",
        "limit":{"requests":10,"per":"1s"},"burst":5}]}"#;
    let mut proxy = Proxy::new(HostCaps::ENVOY, config);
    let (first, action) = proxy.request(&[]);
    assert_eq!(action, Action::Continue);
    let (held, action) = proxy.request(&[]);
    assert_eq!(action, Action::Pause, "spaced 100 ms after the first");
    let (gone, action) = proxy.request(&[]);
    assert_eq!(action, Action::Pause);
    proxy.tick();
    assert!(!proxy.resumed(held), "not due yet");
    assert_eq!(proxy.metric("tollgate.queue.held"), 2);
    proxy.abort(gone);
    proxy.tick();
    assert_eq!(
        proxy.metric("tollgate.queue.held"),
        1,
        "the aborted one left the queue"
    );
    proxy.advance_ms(100);
    proxy.tick();
    assert!(proxy.resumed(held), "due after 100 ms");
    proxy.advance_ms(100);
    proxy.tick();
    assert!(
        !proxy.resumed(gone),
        "a request that went away is not resumed"
    );
    assert_eq!(proxy.metric("tollgate.queue.held"), 0);
    for id in [first, held] {
        assert_eq!(proxy.upstream_answers(id, 200), Action::Continue);
        proxy.end(id);
    }
    // nginx cannot resume from the timer: it refuses delays at load, and without them the
    // request beyond the burst is refused at once.
    assert!(Proxy::try_new(HostCaps::NGINX, config).is_none());
    let nodelay = config.replace(r#""burst":5"#, r#""burst":0,"delay":"nodelay""#);
    let mut nginx = Proxy::new(HostCaps::NGINX, &nodelay);
    assert_eq!(nginx.request(&[]).1, Action::Continue);
    let (refused, action) = nginx.request(&[]);
    assert_eq!(action, Action::Pause);
    let local = nginx.local_response(refused).expect("refused");
    assert_eq!(local.status, 429);
    assert!(local.headers.iter().any(|(n, _)| n == "retry-after"));
}

#[test]
fn a_concurrency_seat_is_given_back_when_the_client_goes_away() {
    let config = r#"{"rules":[{"name":"c","algorithm":"concurrency","limit":{"concurrent":1}}]}"#;
    for caps in BOTH {
        let mut proxy = Proxy::new(caps, config);
        let (a, action) = proxy.request(&[]);
        assert_eq!(action, Action::Continue, "{}", caps.name);
        let (b, action) = proxy.request(&[]);
        assert_eq!(action, Action::Pause, "{}", caps.name);
        assert_eq!(proxy.local_response(b).map(|l| l.status), Some(429));
        proxy.abort(a);
        let (c, action) = proxy.request(&[]);
        assert_eq!(
            action,
            Action::Continue,
            "{}: the seat came back",
            caps.name
        );
        proxy.end(c);
        let (_, action) = proxy.request(&[]);
        assert_eq!(action, Action::Continue, "{}", caps.name);
    }
}

#[test]
fn an_overload_rules_seat_is_left_on_abort_and_learns_from_an_answer() {
    let config = r#"{"rules":[{"name":"api","algorithm":"adaptive"}]}"#;
    for caps in BOTH {
        let mut proxy = Proxy::new(caps, config);
        let (a, action) = proxy.request(&[]);
        assert_eq!(action, Action::Continue, "{}", caps.name);
        let (b, _) = proxy.request(&[]);
        proxy.tick();
        assert_eq!(
            proxy.metric("tollgate.rule.api.in_flight"),
            2,
            "{}",
            caps.name
        );
        proxy.abort(a);
        proxy.advance_ms(20);
        assert_eq!(proxy.upstream_answers(b, 200), Action::Continue);
        proxy.end(b);
        proxy.tick();
        assert_eq!(
            proxy.metric("tollgate.rule.api.in_flight"),
            0,
            "{}",
            caps.name
        );
    }
}

/// One bucket of five requests a minute.
const FIVE_A_MINUTE: &str =
    r#"{"rules":[{"name":"t","limit":{"requests":5,"per":"1m"},"burst":5}]}"#;

#[test]
fn admitted_responses_carry_the_rate_limit_headers() {
    let config = FIVE_A_MINUTE;
    for caps in BOTH {
        let mut proxy = Proxy::new(caps, config);
        let (id, action) = proxy.request(&[]);
        assert_eq!(action, Action::Continue);
        proxy.upstream_answers(id, 200);
        let header = proxy.response_header(id, "ratelimit");
        assert!(
            header.as_deref().is_some_and(|h| h.contains("r=4")),
            "{}: {header:?}",
            caps.name
        );
        proxy.end(id);
    }
}

#[test]
fn a_request_whose_only_work_left_is_its_headers_is_kept_as_its_report_until_it_ends() {
    let config = FIVE_A_MINUTE;
    for caps in BOTH {
        let mut proxy = Proxy::new(caps, config);
        let (answered, action) = proxy.request(&[]);
        assert_eq!(action, Action::Continue);
        // Not a stream any more: an answer's token naming it finds no stream.
        assert!(!proxy.contexts.has_stream(answered), "{}", caps.name);
        assert!(proxy.contexts.has_work(answered), "{}", caps.name);
        proxy.upstream_answers(answered, 200);
        assert!(proxy
            .response_header(answered, "ratelimit-policy")
            .is_some());
        assert!(!proxy.contexts.has_work(answered), "{}", caps.name);
        proxy.end(answered);
        // Cut before any answer, or ended without one: nothing is left of it.
        for end in [Proxy::abort, Proxy::end] {
            let (id, _) = proxy.request(&[]);
            assert!(proxy.contexts.has_work(id));
            end(&proxy, id);
            assert!(!proxy.contexts.has_work(id), "{}", caps.name);
        }
    }
}

#[test]
fn a_strict_requests_own_call_finds_it_however_the_host_delivers_the_answer() {
    // Envoy delivers the answer to the root context: the request is found by the call's token.
    let config = GLOBAL
        .replace("FAILURE", "allow")
        .replace(r#""first_lease":"wait""#, r#""mode":"strict""#);
    for caps in BOTH {
        let mut proxy = Proxy::new(caps, &config);
        let (id, action) = proxy.request(&[("x-user", "alice")]);
        assert_eq!(action, Action::Pause, "{}", caps.name);
        let calls = proxy.take_calls();
        let call = calls.iter().find(|c| c.caller == id).expect("its own call");
        assert_eq!(
            call.body["items"][0]["wanted"], 1,
            "{}: {}",
            caps.name, call.body
        );
        proxy.answer(call, Some((200, grant(1))));
        assert!(proxy.resumed(id), "{}", caps.name);
        let (refused, _) = proxy.request(&[("x-user", "bob")]);
        let calls = proxy.take_calls();
        let call = calls
            .iter()
            .find(|c| c.caller == refused)
            .expect("its own call");
        proxy.answer(call, Some((200, grant(0))));
        assert_eq!(
            proxy.local_response(refused).map(|l| l.status),
            Some(429),
            "{}",
            caps.name
        );
    }
}

#[test]
fn failed_logins_cost_their_reservation_and_successful_ones_nothing() {
    let config = r#"{"rules":[{"name":"logins","key":["client_ip"],
        "limit":{"requests":5,"per":"15m"},"settle":{"statuses":[401,403]}}]}"#;
    for caps in BOTH {
        let mut proxy = Proxy::new(caps, config);
        for _ in 0..20 {
            let (id, action) = proxy.request(&[]);
            assert_eq!(
                action,
                Action::Continue,
                "{}: successes are free",
                caps.name
            );
            proxy.upstream_streams(id, 200, &[], &[b"welcome"]);
        }
        for n in 0..5 {
            let (id, action) = proxy.request(&[]);
            assert_eq!(action, Action::Continue, "{}: failure {n}", caps.name);
            proxy.upstream_streams(id, 401, &[], &[b"no"]);
        }
        let (id, action) = proxy.request(&[]);
        assert_eq!(action, Action::Pause, "{}: the 6th attempt", caps.name);
        assert_eq!(proxy.local_response(id).map(|l| l.status), Some(429));
    }
}

#[test]
fn a_streamed_usage_beyond_the_reservation_is_debt_that_refuses_until_repaid() {
    // 1 000 tokens a minute; each request reserves 100 and its stream says 300.
    let config = r#"{"rules":[{"name":"llm","key":["header:x-api-key"],
        "limit":{"requests":1000,"per":"1m"},"cost":100,"settle":{"usage":"total"}}]}"#;
    let stream: [&[u8]; 3] = [
        b"data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\ndata: {\"choi",
        b"ces\":[],\"usage\":{\"prompt_tokens\":100,\"completion_tokens\":200,\"total_tokens\":300}}\n\n",
        b"data: [DONE]\n\n",
    ];
    for caps in BOTH {
        let mut proxy = Proxy::new(caps, config);
        let key = [("x-api-key", "k")];
        for n in 0..4 {
            let (id, action) = proxy.request(&key);
            assert_eq!(action, Action::Continue, "{}: request {n}", caps.name);
            proxy.upstream_streams(id, 200, &[("content-type", "text/event-stream")], &stream);
        }
        // 1 200 used of 1 000: 200 owed, so the next reservation of 100 waits 18 s.
        let (id, action) = proxy.request(&key);
        assert_eq!(action, Action::Pause, "{}", caps.name);
        let local = proxy.local_response(id).expect("refused");
        let retry = local.headers.iter().find(|(n, _)| n == "retry-after");
        assert_eq!(
            retry.map(|(_, v)| String::from_utf8_lossy(v).into_owned()),
            Some("18".to_string()),
            "{}",
            caps.name
        );
        proxy.advance_ms(18_000);
        assert_eq!(proxy.request(&key).1, Action::Continue, "{}", caps.name);
        proxy.tick();
        assert_eq!(
            proxy.metric("tollgate.rule.llm.charged"),
            800,
            "{}",
            caps.name
        );
        assert_eq!(
            proxy.metric("tollgate.rule.llm.settled"),
            1_200,
            "{}",
            caps.name
        );
        // Of the 800 charged beyond reservations, 200 went past the bucket's bottom.
        assert_eq!(proxy.metric("tollgate.rule.llm.debt"), 200, "{}", caps.name);
    }
}

#[test]
fn each_tenant_gets_the_limit_its_plan_header_says_within_the_maximum() {
    let config = r#"{"rules":[{"name":"plans","key":["header:x-tenant"],
        "limit":{"requests":3,"per":"1h"},"limit_from":{"header":"x-plan","max":10}}]}"#;
    for caps in BOTH {
        let mut proxy = Proxy::new(caps, config);
        let mut admitted = |headers: &[(&str, &str)], n: usize| {
            (0..n)
                .filter(|_| proxy.request(headers).1 == Action::Continue)
                .count()
        };
        assert_eq!(
            admitted(&[("x-tenant", "small"), ("x-plan", "2")], 4),
            2,
            "{}",
            caps.name
        );
        assert_eq!(
            admitted(&[("x-tenant", "big"), ("x-plan", " 7 ")], 9),
            7,
            "{}",
            caps.name
        );
        // Above the maximum: the maximum. Without a plan: the rule's own limit.
        assert_eq!(
            admitted(&[("x-tenant", "greedy"), ("x-plan", "5000")], 12),
            10
        );
        assert_eq!(admitted(&[("x-tenant", "none")], 5), 3);
        assert_eq!(admitted(&[("x-tenant", "odd"), ("x-plan", "-1")], 5), 3);
        // A new plan is a fresh bucket.
        assert_eq!(admitted(&[("x-tenant", "small"), ("x-plan", "4")], 5), 4);
        // The headers state the tenant's own limit.
        let (id, _) = proxy.request(&[("x-tenant", "fresh"), ("x-plan", "6")]);
        proxy.upstream_answers(id, 200);
        let policy = proxy.response_header(id, "ratelimit-policy");
        assert!(
            policy.as_deref().is_some_and(|p| p.contains("q=6")),
            "{}: {policy:?}",
            caps.name
        );
    }
}

#[test]
fn an_overrides_own_limit_comes_before_a_plan_from_the_request() {
    let config = r#"{"rules":[{"name":"plans","key":["header:x-tenant"],
        "limit":{"requests":3,"per":"1h"},"limit_from":{"header":"x-plan","max":10},
        "overrides":[{"values":["vip"],"limit":{"requests":1,"per":"1h"}}]}]}"#;
    let mut proxy = Proxy::new(HostCaps::ENVOY, config);
    let vip = [("x-tenant", "vip"), ("x-plan", "8")];
    assert_eq!(proxy.request(&vip).1, Action::Continue);
    assert_eq!(
        proxy.request(&vip).1,
        Action::Pause,
        "the override's 1 an hour"
    );
}

#[test]
fn a_cost_from_a_field_of_the_json_answer_or_of_a_streams_last_event() {
    let config = r#"{"rules":[{"name":"credits","key":["header:x-user"],
        "limit":{"requests":100,"per":"1h"},"cost":10,
        "settle":{"body_field":"billing.credits"}}]}"#;
    for caps in BOTH {
        let mut proxy = Proxy::new(caps, config);
        let user = [("x-user", "u")];
        let json = [("content-type", "application/json")];
        let (id, _) = proxy.request(&user);
        proxy.upstream_streams(id, 200, &json, &[br#"{"billing":{"cr"#, br#"edits":45}}"#]);
        let (id, _) = proxy.request(&user);
        let events: [&[u8]; 2] = [
            b"data: {\"billing\":{\"credits\":3}}\n\ndata: {\"x\":1}\n\n",
            b"data: {\"billing\":{\"credits\":\"40\"}}\n\n",
        ];
        proxy.upstream_streams(id, 200, &[("content-type", "text/event-stream")], &events);
        // No such field: the reservation stands.
        let (id, _) = proxy.request(&user);
        proxy.upstream_streams(id, 200, &json, &[b"{}"]);
        proxy.tick();
        assert_eq!(
            proxy.metric("tollgate.rule.credits.settled"),
            45 + 40 + 10,
            "{}",
            caps.name
        );
    }
}
