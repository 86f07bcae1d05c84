//! Hostile bytes: raw requests (a socket, not an HTTP library) with bytes that are not UTF-8 in
//! every header the filter reads. None may stop the filter, and limits stay exact afterwards.

use crate::harness::{raw_status, statuses, Client, Envoy};
use serde_json::json;

/// A raw HTTP/1.1 request closing its connection, with extra header lines.
fn raw(path: &[u8], lines: &[&[u8]]) -> Vec<u8> {
    let mut r = b"GET ".to_vec();
    r.extend_from_slice(path);
    r.extend_from_slice(b" HTTP/1.1\r\nHost: h\r\nConnection: close\r\n");
    for line in lines {
        r.extend_from_slice(line);
        r.extend_from_slice(b"\r\n");
    }
    r.extend_from_slice(b"\r\n");
    r
}

#[test]
fn bytes_that_are_not_utf8_in_any_header_read_never_stop_the_filter() {
    let envoy = Envoy::start(&json!({
        "client_ip": {"trusted_hops": 1},
        "rules": [
            {"name": "user", "key": ["header:x-user"], "limit": {"requests": 2, "per": "1h"},
             "worker_batch": 0},
            {"name": "tier", "match": {"headers": {"x-tier": "free"}}, "key": ["client_ip"],
             "limit": {"requests": 1000, "per": "1h"}},
            {"name": "query", "match": {"path_prefix": "/q"}, "key": ["query:q", "host"],
             "limit": {"requests": 1000, "per": "1h"}},
            {"name": "cost", "match": {"path": "/cost"}, "limit": {"requests": 1, "per": "1h"},
             "burst": 8, "cost": {"header": "x-cost", "default": 3, "max": 5}, "worker_batch": 0}
        ]
    }));
    let port = envoy.port;
    // One of each: a keyed header, a matched header, the cost header, a query key, the host and
    // the forwarded-for address a trusted hop reads, each with bytes that are not UTF-8. (Envoy
    // itself refuses raw bytes in the request line with 400, before any filter.)
    let hostile: Vec<Vec<u8>> = vec![
        raw(b"/", &[b"x-user: caf\xe9"]),
        raw(b"/", &[b"x-user: \xff\xfe\xfd"]),
        raw(b"/", &[b"x-tier: fr\xe9e", b"x-user: t"]),
        raw(b"/q?q=%ff%fe&x=%e9", &[b"x-user: q"]),
        raw(b"/q?\xe9=\xe9", &[b"x-user: r"]),
        raw(b"/cost", &[b"x-cost: \xff3", b"x-user: c"]),
        raw(
            b"/cost",
            &[b"x-cost: 99999999999999999999999", b"x-user: d"],
        ),
        raw(
            b"/",
            &[b"x-forwarded-for: 1.2.3.4, \xff\xfe::1", b"x-user: f"],
        ),
        raw(b"/", &[b"x-forwarded-for: \xc3\x28", b"x-tier: free"]),
    ];
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
