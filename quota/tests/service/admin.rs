//! The admin API as run: closed without `--admin-token` and to every proxy's token (and the
//! admin token leases nothing); a bucket's
//! state and its reset on the memory store, one Redis and a Redis Cluster; the busiest keys.

use super::*;
use testkit::{Client, Quota, RedisCluster};

const ADMIN: &str = "Bearer admin-token-0123456789";
const PROXY: &str = "Bearer aaaaaaaaaaaaaaaa";
const SHARED: &str = "Bearer shared-token-abcdefgh";

fn args<'a>(store: &'a [&'a str]) -> Vec<&'a str> {
    let mut a = vec![
        "--admin-token",
        "admin-token-0123456789",
        "--proxy-token",
        "edge-a=aaaaaaaaaaaaaaaa",
        "--token",
        "shared-token-abcdefgh",
    ];
    a.extend_from_slice(store);
    a
}

fn lease(q: &Quota, items: Vec<LeaseItem>) -> Vec<LeaseGrant> {
    let reply = Client::new().post(
        &format!("http://127.0.0.1:{}/v1/lease", q.port),
        &[
            ("content-type", "application/json"),
            ("authorization", PROXY),
        ],
        lease_body("p1", items).as_bytes(),
    );
    assert_eq!(reply.status, 200, "{}", reply.body);
    grants(&reply.body)
}

fn admin(q: &Quota, method: &str, path: &str, auth: &str) -> (u16, serde_json::Value) {
    let url = format!("http://127.0.0.1:{}{path}", q.port);
    let reply = Client::new()
        .try_send_body(method, &url, &[("authorization", auth)], Some(b""))
        .unwrap();
    let body = serde_json::from_str(&reply.body).unwrap_or(serde_json::Value::Null);
    (reply.status, body)
}

fn limited(key: &str, wanted: u64) -> LeaseItem {
    LeaseItem {
        rule: "per-tenant".into(),
        limit_id: "lim".into(),
        key: key.into(),
        requests: 10,
        per_ms: 3_600_000,
        burst: 10,
        wanted,
        ..LeaseItem::default()
    }
}

#[test]
fn the_admin_api_is_closed_without_its_token_and_to_the_proxies_tokens() {
    let q = Quota::start(&args(&[]));
    lease(&q, vec![limited("tenant-1", 3)]);
    for auth in [PROXY, SHARED, "Bearer admin-token-012345678", "", "Bearer "] {
        for (method, path) in [
            ("GET", "/admin/v1/limits"),
            ("GET", "/admin/v1/buckets/lim.10.3600000.10/tenant-1"),
            ("POST", "/admin/v1/buckets/lim.10.3600000.10/tenant-1/reset"),
        ] {
            let (status, body) = admin(&q, method, path, auth);
            assert_eq!(status, 401, "{method} {path} with {auth:?}: {body}");
        }
    }
    let (status, body) = admin(&q, "GET", "/admin/v1/limits", ADMIN);
    assert_eq!(status, 200, "{body}");
    // Nor is the admin token a proxy's: it cannot lease.
    let reply = Client::new().post(
        &format!("http://127.0.0.1:{}/v1/lease", q.port),
        &[
            ("content-type", "application/json"),
            ("authorization", ADMIN),
        ],
        lease_body("p1", vec![limited("tenant-1", 3)]).as_bytes(),
    );
    assert_eq!(reply.status, 401, "{}", reply.body);
    assert_eq!(body["limits"][0]["rule"], "per-tenant");
    // The scheme in any case; a query or path that cannot be read: 400, in JSON.
    let lower = format!("bearer {}", &ADMIN[7..]);
    assert_eq!(admin(&q, "GET", "/admin/v1/limits", &lower).0, 200);
    for path in [
        "/admin/v1/limits?top=-1",
        "/admin/v1/limits?top=5&top=1",
        "/admin/v1/buckets/%FF/k",
    ] {
        let (status, body) = admin(&q, "GET", path, ADMIN);
        assert_eq!(status, 400, "{path}");
        assert!(body["error"].is_string(), "{path}: {body}");
    }
    // Without --admin-token there is no admin API, whatever the token.
    let closed = Quota::start(&["--token", "shared-token-abcdefgh"]);
    for auth in [SHARED, ADMIN] {
        assert_eq!(admin(&closed, "GET", "/admin/v1/limits", auth).0, 404);
    }
}

#[test]
fn an_admin_token_that_is_short_or_a_proxys_is_refused_at_startup() {
    let bin = testkit::built_artifact("TOLLGATE_QUOTA_BIN", "target/debug/tollgate-quota");
    for extra in [
        &["--admin-token", "short"][..],
        &[
            "--token",
            "same-token-0123456789",
            "--admin-token",
            "same-token-0123456789",
        ],
        &[
            "--proxy-token",
            "edge=same-token-0123456789",
            "--admin-token",
            "same-token-0123456789",
        ],
        &["--token", "", "--admin-token", "admin-token-0123456789"],
    ] {
        let out = Command::new(&bin)
            .args(["--listen", "127.0.0.1:0"])
            .args(extra)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned()
            + &String::from_utf8_lossy(&out.stdout);
        assert!(!out.status.success(), "{extra:?} started");
        assert!(
            err.contains("--admin-token") || err.contains("--token must not be empty"),
            "{extra:?}: {err}"
        );
    }
}

/// Spend a tenant's bucket, run it into debt, look at it, reset it: the next call is granted the
/// whole burst, with the holder's evidence of the empty bucket not taken for a lost store.
fn inspect_and_reset(store: &[&str]) {
    let q = Quota::start(&args(store));
    assert_eq!(lease(&q, vec![limited("tenant-1", 10)])[0].granted, 10);
    let owes = LeaseItem {
        owed: 25,
        ..limited("tenant-1", 0)
    };
    let g = lease(&q, vec![owes])[0];
    assert_eq!(g.debt, 25);
    let limit = "lim.10.3600000.10";
    let bucket = format!("/admin/v1/buckets/{limit}/tenant-1");
    let (status, b) = admin(&q, "GET", &bucket, ADMIN);
    assert_eq!(status, 200, "{b}");
    assert_eq!(
        (b["found"].clone(), b["debt"].clone()),
        (true.into(), 25.into()),
        "{b}"
    );
    assert!(b["tokens_now"].as_f64().unwrap() < -24.0, "{b}");
    assert_eq!(b["holders"][0]["instance"], "edge-a/p1", "{b}");
    assert_eq!(b["holders"][0]["outstanding"], 10, "{b}");
    assert!(b["epoch_ms"].as_u64().is_some(), "{b}");
    // A key never leased: 404, found false.
    let (status, none) = admin(
        &q,
        "GET",
        &format!("/admin/v1/buckets/{limit}/nobody"),
        ADMIN,
    );
    assert_eq!((status, none["found"].clone()), (404, false.into()));
    assert_eq!(
        admin(
            &q,
            "POST",
            &format!("/admin/v1/buckets/{limit}/nobody/reset"),
            ADMIN
        )
        .0,
        404
    );
    // Reset: pending until the next call, which is granted the whole burst.
    let (status, after) = admin(&q, "POST", &format!("{bucket}/reset"), ADMIN);
    assert_eq!(status, 200, "{after}");
    assert_eq!(
        (after["reset_pending"].clone(), after["debt"].clone()),
        (true.into(), 0.into())
    );
    assert_eq!(after["tokens_now"], 10.0, "{after}");
    let evidence = LeaseItem {
        known_ms: 50,
        known_remaining: 0,
        known_debt: 25,
        ..limited("tenant-1", 10)
    };
    let g = lease(&q, vec![evidence])[0];
    assert_eq!((g.granted, g.debt), (10, 0), "{g:?}");
    let (_, b) = admin(&q, "GET", &bucket, ADMIN);
    assert_eq!(
        (b["reset_pending"].clone(), b["lost"].clone()),
        (false.into(), false.into()),
        "{b}"
    );
    // The busiest keys: tenant-1 asked for 20 tokens, was granted 20.
    let (_, limits) = admin(
        &q,
        "GET",
        &format!("/admin/v1/limits?limit_id={limit}"),
        ADMIN,
    );
    let top = &limits["limits"][0]["keys"][0];
    assert_eq!(
        (
            top["key"].clone(),
            top["asked"].clone(),
            top["granted"].clone()
        ),
        ("tenant-1".into(), 20.into(), 20.into()),
        "{limits}"
    );
}

#[test]
fn a_bucket_is_inspected_and_reset_in_memory() {
    inspect_and_reset(&[]);
}

#[test]
fn a_bucket_is_inspected_and_reset_in_redis() {
    let redis = Redis::start();
    inspect_and_reset(&["--redis", &redis.url()]);
}

#[test]
fn a_bucket_is_inspected_and_reset_on_a_redis_cluster() {
    let cluster = RedisCluster::start();
    inspect_and_reset(&["--redis-cluster", &cluster.urls()]);
}

#[test]
fn the_busiest_keys_are_the_heavy_ones_among_many() {
    let q = Quota::start(&args(&[]));
    // 3 heavy tenants asking 50 at a time among 3 000 light ones asking 1, in calls of 100.
    let mut items = Vec::new();
    for i in 0..3_000 {
        items.push(limited(&format!("light-{i}"), 1));
        if i % 30 == 0 {
            for heavy in ["heavy-a", "heavy-b", "heavy-c"] {
                items.push(limited(heavy, 50));
            }
        }
        if items.len() >= 100 {
            lease(&q, std::mem::take(&mut items));
        }
    }
    lease(&q, items);
    let (_, limits) = admin(&q, "GET", "/admin/v1/limits?top=3", ADMIN);
    let mut top: Vec<String> = limits["limits"][0]["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["key"].as_str().unwrap().to_owned())
        .collect();
    top.sort();
    assert_eq!(top, ["heavy-a", "heavy-b", "heavy-c"], "{limits}");
}
