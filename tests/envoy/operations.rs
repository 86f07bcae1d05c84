//! Day-2 operations through real Envoys: an operator finds the tenant a global rule refuses
//! among the quota service's busiest keys, names its bucket with the configuration (as
//! `tollgate quota-key` does), looks at it and resets it; the tenant is admitted again, exactly a
//! burst across both Envoys.

use crate::harness::{eventually, Client, Envoy, Options, Quota};
use serde_json::{json, Value};
use std::time::Duration;

const ADMIN: &str = "Bearer operator-token-0123456789";

fn admin(quota: &Quota, method: &str, path: &str) -> (u16, Value) {
    let reply = Client::new()
        .try_send_body(
            method,
            &format!("http://127.0.0.1:{}{path}", quota.port),
            &[("authorization", ADMIN)],
            Some(b""),
        )
        .unwrap();
    (
        reply.status,
        serde_json::from_str(&reply.body).unwrap_or(Value::Null),
    )
}

#[test]
fn an_operator_finds_a_refused_tenant_inspects_and_resets_its_global_bucket() {
    let quota = Quota::start(&["--admin-token", "operator-token-0123456789"]);
    let plugin = json!({
        "rules": [{"name": "per-tenant", "scope": "global", "key": ["header:x-tenant"],
                   "limit": {"requests": 5, "per": "1h"}}],
        "quota_service": {"upstream": "quota", "instances_hint": 2, "lease_size": 1,
                          "failure_mode": "deny",
                          "key_secret": "00112233445566778899aabbccddeeff"}
    });
    let options = Options {
        quota_port: Some(quota.port),
        ..Options::default()
    };
    let envoys = [
        Envoy::start_with(&plugin, &options),
        Envoy::start_with(&plugin, &options),
    ];
    let send = |i: usize, tenant: &str| {
        Client::new()
            .get(&envoys[i % 2].url("/"), &[("x-tenant", tenant)])
            .status
    };
    // acme spends its 5 an hour over both Envoys, then is refused; globex asks once.
    let mut admitted = 0;
    for i in 0..12 {
        admitted += usize::from(send(i, "acme") == 200);
    }
    assert_eq!(admitted, 5);
    assert_eq!(send(0, "globex"), 200);

    // The operator's view: acme first among the rule's busiest keys, refused.
    let config = tollgate::config::Config::parse(plugin.to_string().as_bytes()).unwrap();
    let (limit_id, key) = config
        .service_bucket("per-tenant", &[b"acme"], &|_, _| None)
        .unwrap();
    let (status, limits) = admin(&quota, "GET", "/admin/v1/limits");
    assert_eq!(status, 200, "{limits}");
    let limit = &limits["limits"][0];
    assert_eq!(
        (limit["rule"].as_str(), limit["limit_id"].as_str()),
        (Some("per-tenant"), Some(limit_id.as_str()))
    );
    let top = &limit["keys"][0];
    assert_eq!(top["key"], key.as_str(), "{limits}");
    assert_eq!(top["granted"], 5, "{limits}");
    assert!(top["denied"].as_u64().unwrap() >= 1, "{limits}");
    let bucket = format!("/admin/v1/buckets/{limit_id}/{key}");
    let (status, b) = admin(&quota, "GET", &bucket);
    assert_eq!(status, 200, "{b}");
    assert!(b["tokens_now"].as_f64().unwrap() < 1.0, "{b}");
    assert_eq!(
        b["holders"].as_array().unwrap().len(),
        2,
        "both Envoys hold it: {b}"
    );

    // Reset: acme is admitted again within a few seconds, never more than its burst over both.
    let (status, after) = admin(&quota, "POST", &format!("{bucket}/reset"));
    assert_eq!(
        (status, after["reset_pending"].clone()),
        (200, true.into()),
        "{after}"
    );
    let mut again = 0;
    let mut i = 0;
    assert!(
        eventually(Duration::from_secs(5), || {
            i += 1;
            again += usize::from(send(i, "acme") == 200);
            again > 0
        }),
        "acme is still refused after the reset"
    );
    for j in 0..20 {
        again += usize::from(send(j, "acme") == 200);
    }
    assert_eq!(again, 5, "a reset gives back the burst, once");
    let (_, b) = admin(&quota, "GET", &bucket);
    assert_eq!(
        (b["lost"].clone(), b["reset_pending"].clone()),
        (false.into(), false.into()),
        "{b}"
    );
}

/// The status path: 3 addresses flooding among 10 000 that send one request each are the 3 keys
/// on top, with their refusals; at most 32 keys are kept; the path is closed to other addresses
/// and without the token; a periodic log line names the flooders.
#[test]
fn the_status_path_shows_three_flooding_addresses_on_top_among_ten_thousand() {
    let token = "status-token-0123456789";
    let plugin = json!({
        "rules": [{"name": "per-ip", "key": ["client_ip"],
                   "limit": {"requests": 20, "per": "1m"}}],
        "client_ip": {"trusted_hops": 1},
        "status": {"path": "/tollgate/status", "token": token, "log_every": "1s"}
    });
    let envoy = Envoy::start_with(&plugin, &Options::default());
    let url = envoy.url("/");
    let normal = crate::harness::parallel(8, |t| {
        let client = Client::new();
        (0..1_250)
            .filter(|i| {
                let n = t * 1_250 + i;
                let ip = format!("10.{}.{}.{}", n / 65_536, (n / 256) % 256, n % 256);
                client.get(&url, &[("x-forwarded-for", ip.as_str())]).status == 200
            })
            .count()
    });
    assert_eq!(normal.iter().sum::<usize>(), 10_000);
    let floods = crate::harness::parallel(3, |f| {
        let client = Client::new();
        let ip = format!("192.0.2.{}", f + 1);
        (0..200)
            .filter(|_| client.get(&url, &[("x-forwarded-for", ip.as_str())]).status == 429)
            .count()
    });
    assert!(floods.iter().all(|&r| r == 180), "{floods:?}");
    let status = |from: &str, auth: Option<&str>| {
        let bearer = auth.map(|t| format!("Bearer {t}"));
        let mut headers = vec![("x-forwarded-for", from)];
        if let Some(b) = bearer.as_deref() {
            headers.push(("authorization", b));
        }
        Client::new().get(&envoy.url("/tollgate/status"), &headers)
    };
    // Counts reach shared data within a second (each worker adds its own on its tick).
    let mut shown = Value::Null;
    assert!(
        eventually(Duration::from_secs(5), || {
            let reply = status("127.0.0.1", Some(token));
            assert_eq!(reply.status, 200, "{}", reply.body);
            shown = serde_json::from_str(&reply.body).unwrap();
            shown["rules"][0]["keys"].as_array().map_or(0, Vec::len) >= 3
                && shown["rules"][0]["keys"][2]["refused"].as_u64() == Some(180)
        }),
        "{shown}"
    );
    let keys = shown["rules"][0]["keys"].as_array().unwrap();
    assert!(keys.len() <= 32, "{shown}");
    let mut top: Vec<&str> = keys[..3]
        .iter()
        .map(|k| k["key"].as_str().unwrap())
        .collect();
    top.sort();
    assert_eq!(top, ["192.0.2.1", "192.0.2.2", "192.0.2.3"], "{shown}");
    assert_eq!(shown["rules"][0]["rule"], "per-ip");
    assert_eq!(shown["host"], crate::harness::host_name());
    // Closed to other addresses, and without the token; GET only.
    assert_eq!(status("203.0.113.9", Some(token)).status, 403);
    assert_eq!(status("127.0.0.1", None).status, 401);
    assert_eq!(
        status("127.0.0.1", Some("status-token-wrong-00000")).status,
        401
    );
    // The log line names the flooders.
    assert!(
        eventually(Duration::from_secs(5), || envoy
            .log()
            .contains(r#"keys refused most: per-ip: "192.0.2."#)),
        "no log line"
    );
}

/// One local key on the status path: its state, then its reset; the key is admitted again for
/// exactly its burst over two workers. Concurrency and global rules are not reset here.
#[test]
fn the_status_path_shows_one_keys_state_and_resets_it() {
    let plugin = json!({
        "rules": [
            {"name": "per-user", "key": ["header:x-user"], "limit": {"requests": 3, "per": "1h"}},
            {"name": "uploads", "algorithm": "concurrency", "key": ["header:x-user"],
             "match": {"path": "/upload"},
             "limit": {"concurrent": 2}}
        ],
        "status": {"path": "/tollgate/status"}
    });
    let envoy = Envoy::start_with(&plugin, &Options::default());
    let send = |user: &str| {
        Client::new()
            .get(&envoy.url("/"), &[("x-user", user)])
            .status
    };
    let statuses: Vec<u16> = (0..5).map(|_| send("alice")).collect();
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
    let status = |method: &str, path: &str| {
        let reply = Client::new()
            .try_send_body(method, &envoy.url(path), &[], Some(b""))
            .unwrap();
        (
            reply.status,
            serde_json::from_str::<Value>(&reply.body).unwrap_or(Value::Null),
        )
    };
    let (code, alice) = status("GET", "/tollgate/status?rule=per-user&key=alice");
    assert_eq!(code, 200, "{alice}");
    assert_eq!(
        (
            alice["found"].clone(),
            alice["limited"].clone(),
            alice["available"].clone()
        ),
        (true.into(), true.into(), 0.into()),
        "{alice}"
    );
    assert!(alice["retry_after_s"].as_u64().unwrap() > 1_000, "{alice}");
    let (_, bob) = status("GET", "/tollgate/status?rule=per-user&key=bob");
    assert_eq!(
        (bob["found"].clone(), bob["available"].clone()),
        (false.into(), 3.into()),
        "{bob}"
    );
    // Reset: POST only; then alice has her burst again, once.
    assert_eq!(
        status("GET", "/tollgate/status/reset?rule=per-user&key=alice").0,
        405
    );
    let (code, reset) = status("POST", "/tollgate/status/reset?rule=per-user&key=alice");
    assert_eq!(
        (code, reset["reset"].clone()),
        (200, true.into()),
        "{reset}"
    );
    // Her burst again, once, over both workers (a worker that refused her in the last 20 ms
    // trusts that refusal for the rest of them: her requests for 300 ms are counted).
    let until = std::time::Instant::now() + Duration::from_millis(300);
    let mut admitted = 0;
    while std::time::Instant::now() < until {
        admitted += usize::from(send("alice") == 200);
    }
    assert_eq!(admitted, 3, "her burst again, once");
    // What cannot be reset, or named, says why.
    for (path, why) in [
        ("/tollgate/status/reset?rule=uploads&key=alice", "in flight"),
        ("/tollgate/status?rule=nope&key=alice", "no rule named"),
        (
            "/tollgate/status?rule=per-user",
            "1 key part(s), 0 value(s)",
        ),
    ] {
        let method = if path.contains("/reset") {
            "POST"
        } else {
            "GET"
        };
        let (code, body) = status(method, path);
        assert_eq!(code, 400, "{path}: {body}");
        assert!(
            body["error"].as_str().unwrap().contains(why),
            "{path}: {body}"
        );
    }
    let (_, uploads) = status("GET", "/tollgate/status?rule=uploads&key=alice");
    assert_eq!(
        (uploads["in_flight"].clone(), uploads["available"].clone()),
        (0.into(), 2.into()),
        "{uploads}"
    );
}
