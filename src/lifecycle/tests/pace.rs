//! Byte limits: a key's bodies held until its byte bucket covers them, `after`, dry run.

use super::mock::Proxy;
use crate::config::HostCaps;
use crate::lifecycle::Action;

/// 1 000 bytes a second per user, burst 1 000.
const PER_USER: &str = r#"{"rules":[{"name":"dl","key":["header:x-user"],
    "limit":{"bytes":1000,"per":"1s"}}]}"#;

#[test]
fn a_byte_limit_holds_a_keys_response_bodies_until_its_bucket_covers_them() {
    let mut proxy = Proxy::new(HostCaps::ENVOY, PER_USER);
    let user = [("x-user", "u")];
    let (a, action) = proxy.request(&user);
    assert_eq!(action, Action::Continue, "byte limits never refuse");
    let (b, _) = proxy.request(&user);
    proxy.response_headers(a, &[]);
    // The burst goes at once; 500 more wait half a second.
    assert_eq!(proxy.response_chunk(a, &[0; 1000], false), Action::Continue);
    assert_eq!(proxy.response_chunk(a, &[0; 500], false), Action::HoldBody);
    // More data while held: held longer, its new bytes charged once.
    assert_eq!(proxy.response_chunk(a, &[0; 500], false), Action::HoldBody);
    proxy.advance_ms(999);
    proxy.tick();
    assert_eq!(proxy.response_continued(a), 0);
    proxy.advance_ms(1);
    proxy.tick();
    assert_eq!(
        proxy.response_continued(a),
        1,
        "1 000 bytes beyond the burst: 1 s"
    );
    // The key's other response shares the rate: it waits behind the first's bytes.
    proxy.response_headers(b, &[]);
    assert_eq!(proxy.response_chunk(b, &[0; 100], true), Action::HoldBody);
    proxy.advance_ms(99);
    proxy.tick();
    assert_eq!(proxy.response_continued(b), 0);
    proxy.advance_ms(1);
    proxy.tick();
    assert_eq!(proxy.response_continued(b), 1);
    // Another key is not slowed.
    let (c, _) = proxy.request(&[("x-user", "v")]);
    proxy.response_headers(c, &[]);
    assert_eq!(proxy.response_chunk(c, &[0; 1000], true), Action::Continue);
    // A client that goes away while held leaves nothing held.
    assert_eq!(proxy.response_chunk(a, &[0; 5000], false), Action::HoldBody);
    proxy.abort(a);
    proxy.advance_ms(10_000);
    proxy.tick();
    assert_eq!(proxy.response_continued(a), 1);
    assert_eq!(proxy.metric("tollgate.rule.dl.paced_bytes"), 8_100);
    // Held 1 s, 0.1 s, and 5 s more as scheduled when the client went away.
    assert_eq!(proxy.metric("tollgate.rule.dl.held_ms"), 6_100);
}

#[test]
fn a_byte_limits_after_passes_the_first_bytes_of_each_body_unpaced() {
    let config = r#"{"rules":[{"name":"dl","limit":{"bytes":1000,"per":"1s"},"burst":100,
        "after":500}]}"#;
    let mut proxy = Proxy::new(HostCaps::ENVOY, config);
    for _ in 0..2 {
        let (id, _) = proxy.request(&[]);
        proxy.response_headers(id, &[]);
        assert_eq!(proxy.response_chunk(id, &[0; 500], false), Action::Continue);
        proxy.end(id);
    }
    let (id, _) = proxy.request(&[]);
    proxy.response_headers(id, &[]);
    // 600: 500 free, 100 within the burst; 100 more wait 0.1 s.
    assert_eq!(proxy.response_chunk(id, &[0; 600], false), Action::Continue);
    assert_eq!(proxy.response_chunk(id, &[0; 100], true), Action::HoldBody);
    proxy.tick();
    assert_eq!(proxy.metric("tollgate.rule.dl.paced_bytes"), 200);
    // nginx cannot pace: refused at load.
    assert!(Proxy::try_new(HostCaps::NGINX, config).is_none());
}

#[test]
fn a_dry_run_byte_limit_holds_nothing_and_counts_what_it_would_have_held() {
    let config = r#"{"rules":[{"name":"dl","limit":{"bytes":1000,"per":"1s"},"dry_run":true}]}"#;
    let mut proxy = Proxy::new(HostCaps::ENVOY, config);
    let (id, _) = proxy.request(&[]);
    proxy.response_headers(id, &[]);
    assert_eq!(
        proxy.response_chunk(id, &[0; 1000], false),
        Action::Continue
    );
    assert_eq!(proxy.response_chunk(id, &[0; 500], true), Action::Continue);
    proxy.tick();
    assert_eq!(proxy.metric("tollgate.rule.dl.dry_run_limited"), 1);
    assert_eq!(proxy.metric("tollgate.rule.dl.paced_bytes"), 1_500);
    // A byte limit decides no requests.
    assert_eq!(proxy.metric("tollgate.rule.dl.allowed"), 0);
}

#[test]
fn bytes_held_for_a_stream_that_ends_go_back_to_its_key() {
    let mut proxy = Proxy::new(HostCaps::ENVOY, PER_USER);
    let user = [("x-user", "u")];
    // Ten streams of the key each push 1 000 bytes past the burst and reset while held
    // (before: 10 s of the key's rate charged for bytes that never left).
    let (first, _) = proxy.request(&user);
    proxy.response_headers(first, &[]);
    assert_eq!(
        proxy.response_chunk(first, &[0; 1000], false),
        Action::Continue
    );
    for _ in 0..10 {
        let (id, _) = proxy.request(&user);
        proxy.response_headers(id, &[]);
        assert_eq!(
            proxy.response_chunk(id, &[0; 1000], false),
            Action::HoldBody
        );
        proxy.abort(id);
    }
    proxy.tick();
    // The key's next stream waits only for what the first one passed on: its 500 bytes go
    // within half a second of the burst's refill.
    proxy.advance_ms(1_000);
    let (next, _) = proxy.request(&user);
    proxy.response_headers(next, &[]);
    assert_eq!(
        proxy.response_chunk(next, &[0; 500], true),
        Action::Continue
    );
    // Bytes that went on stay charged: a held body whose hold ended is not given back.
    let (a, _) = proxy.request(&user);
    proxy.response_headers(a, &[]);
    assert_eq!(proxy.response_chunk(a, &[0; 1000], false), Action::HoldBody);
    proxy.advance_ms(1_000);
    proxy.tick();
    assert_eq!(proxy.response_continued(a), 1);
    proxy.abort(a);
    let (b, _) = proxy.request(&user);
    proxy.response_headers(b, &[]);
    // (a's 1 000 still count: 500 of the bucket's 1 000 are left, so 600 wait.)
    assert_eq!(proxy.response_chunk(b, &[0; 600], true), Action::HoldBody);
}
