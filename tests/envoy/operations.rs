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
    let (limit_id, key) = config.service_bucket("per-tenant", &[b"acme"]).unwrap();
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
