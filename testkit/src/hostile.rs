//! Hostile requests and the configurations the Envoy and nginx suites share.

use crate::http::{raw, statuses, Client};
use crate::process::eventually;
use crate::quota::Quota;
use serde_json::{json, Value};
use std::time::Duration;

/// The configuration the hostile-bytes checks run with (both proxies).
pub fn hostile_plugin() -> Value {
    json!({
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
    })
}

/// One request for each header the filter reads with bytes that are not UTF-8: a keyed header, a
/// matched header, the cost header, a query key, the host and the forwarded-for address a
/// trusted hop reads. (A proxy may refuse raw bytes in the request line with 400 itself.)
pub fn hostile_requests() -> Vec<Vec<u8>> {
    vec![
        raw(b"/", &[b"x-user: caf\xe9"]),
        raw(b"/", &[b"x-user: \xff\xfe\xfd"]),
        raw(b"/", &[b"x-tier: fr\xe9e", b"x-user: t"]),
        raw(b"/q?q=%ff%fe&x=%e9", &[b"x-user: q"]),
        raw(b"/q?\xe9=\xe9", &[b"x-user: r", b"host: h\xe9st"]),
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
    ]
}

/// A plugin configuration with one rule.
/// A per-IP rule behind one trusted hop (so tests can send any client address) with the default
/// prefixes, and CIDR overrides: allowed, blocked, and an own limit.
pub fn client_networks_plugin() -> Value {
    json!({
        "rules": [{"name": "per-ip", "key": ["client_ip"], "limit": {"requests": 2, "per": "1h"},
                   "overrides": [{"values": ["10.0.0.0/8"], "unlimited": true},
                                 {"values": ["192.0.2.0/24"], "block": true},
                                 {"values": ["2001:db8:aaaa::/48"], "limit": {"requests": 4, "per": "1h"}}]}],
        "client_ip": {"trusted_hops": 1}
    })
}

/// What [`client_networks_plugin`] does, asked of a proxy at `url`.
pub fn check_client_networks(url: &str) {
    let from = |ip: &'static str, n| statuses(url, &[("x-forwarded-for", ip)], n);
    // Addresses of one /64 share one bucket of 2; the next /64 has its own.
    assert_eq!(from("2001:db8:1:2::1", 1), (1, 0));
    assert_eq!(from("2001:db8:1:2::ffff", 1), (1, 0));
    assert_eq!(from("2001:db8:1:2:8000::1", 1), (0, 1));
    assert_eq!(from("2001:db8:1:3::1", 3), (2, 1));
    // IPv4 clients are their address.
    assert_eq!(from("203.0.113.1", 3), (2, 1));
    assert_eq!(from("203.0.113.2", 3), (2, 1));
    // Ranges: allowed, blocked, and 4 per client /64 inside 2001:db8:aaaa::/48.
    assert_eq!(from("10.20.30.40", 10), (10, 0));
    assert_eq!(from("192.0.2.77", 2), (0, 2));
    assert_eq!(from("2001:db8:aaaa:1::1", 6), (4, 2));
    assert_eq!(from("2001:db8:aaaa:2::1", 6), (4, 2));
}

pub fn one_rule(rule: Value) -> Value {
    json!({"rules": [rule]})
}

/// Strict mode with a per-user global limit (5 an hour) and a per-team one (1 an hour), the quota
/// service at `upstream` as the proxy names it.
pub fn strict_give_back_plugin(upstream: &str) -> Value {
    json!({
        "rules": [
            {"name": "user", "scope": "global", "key": ["header:x-user"],
             "limit": {"requests": 5, "per": "1h"}},
            {"name": "team", "scope": "global", "key": ["header:x-team"],
             "limit": {"requests": 1, "per": "1h"}}
        ],
        "quota_service": {"upstream": upstream, "mode": "strict"}
    })
}

/// What [`strict_give_back_plugin`] does, asked of a proxy at `url` whose quota service is
/// `quota`: the team's limit is spent, so its requests are refused after their calls granted the
/// user's token, which goes back.
pub fn check_strict_give_back(url: &str, quota: &Quota) {
    let c = Client::new();
    let status = |team: &str| c.get(url, &[("x-user", "u"), ("x-team", team)]).status;
    // Admitted by its call's answer, with the headers every admitted response has (the dynamic
    // module once resumed it inside the answer's hook and its response hooks found it busy).
    let first = c.get(url, &[("x-user", "u"), ("x-team", "t0")]);
    assert_eq!(first.status, 200);
    assert!(
        first
            .header("ratelimit")
            .is_some_and(|h| h.starts_with("\"team\";r=0")),
        "{:?}",
        first.header("ratelimit")
    );
    for _ in 0..10 {
        assert_eq!(status("t0"), 429);
    }
    // What the refused requests were granted (a user token each, unless the user's bucket was
    // empty until earlier give-backs came in) goes back on the workers' next ticks: in the end
    // only the admitted request's 2 tokens stay out.
    let out = || {
        quota.metric("tollgate_quota_tokens_granted_total")
            - quota.metric("tollgate_quota_tokens_given_back_total")
    };
    assert!(
        eventually(Duration::from_secs(5), || out() == 2),
        "{}",
        out()
    );
    assert!(quota.metric("tollgate_quota_tokens_given_back_total") >= 4);
    // The user still has 4 of its 5 (before: none — the refusals had spent them).
    let fresh_teams: Vec<u16> = (1..=5).map(|t| status(&format!("t{t}"))).collect();
    assert_eq!(fresh_teams, [200, 200, 200, 200, 429]);
}
