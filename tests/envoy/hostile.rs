//! Hostile bytes: raw requests (a socket, not an HTTP library) with bytes that are not UTF-8 in
//! every header the filter reads. None may stop the filter, and limits stay exact afterwards.

use crate::harness::{hostile_plugin, hostile_requests, raw, raw_status, statuses, Client, Envoy};

#[test]
fn bytes_that_are_not_utf8_in_any_header_read_never_stop_the_filter() {
    let envoy = Envoy::start(&hostile_plugin());
    let port = envoy.port;
    let hostile = hostile_requests();
    for request in &hostile {
        let status = raw_status(port, request);
        assert!(
            matches!(status, Some(200 | 429 | 400)),
            "{status:?} for {}",
            String::from_utf8_lossy(request)
        );
    }
    // A key of raw bytes is a key like any other, and differs from its UTF-8 look-alike.
    let latin1 = raw(b"/", &[b"x-user: caf\xe9"]);
    let utf8 = raw(b"/", &["x-user: café".as_bytes()]);
    let statuses_of = |request: &[u8], n: usize| -> Vec<Option<u16>> {
        (0..n).map(|_| raw_status(port, request)).collect()
    };
    assert_eq!(
        statuses_of(&latin1, 2),
        [Some(200), Some(429)],
        "one left after the first hostile request"
    );
    assert_eq!(statuses_of(&utf8, 3), [Some(200), Some(200), Some(429)]);
    // The filter is alive for everyone: a normal client is served and limited exactly.
    assert_eq!(statuses(&envoy.url("/"), &[("x-user", "bob")], 3), (2, 1));
    assert_eq!(envoy.counter("user", "limited"), 3);
    assert_eq!(envoy.counter("user", "allowed"), 12);
    // The matched header compared its bytes: "fr\xe9e" is not "free".
    assert_eq!(envoy.counter("tier", "allowed"), 1);
    assert_eq!(envoy.counter("query", "allowed"), 1);
    // The cost header: not a number → the default (3); too large a number → the maximum (5):
    // the bucket of 8 is empty.
    assert_eq!(envoy.counter("cost", "allowed"), 2);
    let c = Client::new();
    assert_eq!(c.get(&envoy.url("/cost"), &[("x-cost", "1")]).status, 429);
    assert!(!envoy.log().contains("panicked"));
}
