//! Two filter configurations in one VM (`vm_id`): each keeps its own rules, queues, stashes and
//! lease calls.

use crate::harness::{parallel, Client, Envoy, Options};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A quota service that grants every item what it asks for and records the rules it was asked
/// about.
fn recording_quota() -> (u16, Arc<Mutex<Vec<String>>>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let record = record.clone();
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 8192];
                // One request per connection is enough: read until the JSON body is complete.
                let body = loop {
                    let Ok(n) = stream.read(&mut chunk) else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    let text = String::from_utf8_lossy(&buf).into_owned();
                    if let Some((_, body)) = text.split_once("\r\n\r\n") {
                        if serde_json::from_str::<Value>(body).is_ok() {
                            break body.to_string();
                        }
                    }
                };
                let call: Value = serde_json::from_str(&body).unwrap();
                let items: Vec<Value> = call["items"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|item| {
                        record
                            .lock()
                            .unwrap()
                            .push(item["rule"].as_str().unwrap().to_string());
                        json!({"granted": item["wanted"], "ttl_ms": 10000, "remaining": 100,
                               "reset_ms": 0})
                    })
                    .collect();
                let answer = json!({ "items": items }).to_string();
                let _ = stream.write_all(
                    format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{answer}",
                        answer.len()
                    )
                    .as_bytes(),
                );
            });
        }
    });
    (port, seen)
}

#[test]
fn two_configurations_sharing_a_vm_never_mix_their_state() {
    let (quota_port, seen) = recording_quota();
    let service = json!({"upstream": "quota", "timeout": "1s", "failure_mode": "deny"});
    // Rule indexes line up on purpose: with per-VM queues, one configuration's tick would send
    // the other's refills under its own rule names.
    let first = json!({
        "rules": [{"name": "first-global", "scope": "global", "key": ["header:x-user"],
                   "limit": {"requests": 1000, "per": "1m"}}],
        "quota_service": service
    });
    let second = json!({
        "rules": [
            {"name": "second-global", "scope": "global", "key": ["header:x-user"],
             "match": {"path": "/global"}, "limit": {"requests": 1000, "per": "1m"}},
            {"name": "second-held", "algorithm": "leaky_bucket", "match": {"path": "/held"},
             "limit": {"requests": 20, "per": "1s"}, "burst": 10}
        ],
        "quota_service": service
    });
    let envoy = Envoy::start_with(
        &first,
        &Options {
            quota_port: Some(quota_port),
            second_plugin: Some(second),
            ..Options::default()
        },
    );
    // 40 new keys on the first listener: each waits for its first lease, sent by the first
    // configuration's tick and granted under its own rule's name.
    let statuses = parallel(8, |i| {
        let c = Client::new();
        (0..5)
            .map(|n| {
                c.get(&envoy.url("/"), &[("x-user", &format!("u{i}-{n}"))])
                    .status
            })
            .collect::<Vec<_>>()
    })
    .concat();
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let rules = seen.lock().unwrap().clone();
    assert!(!rules.is_empty());
    assert!(
        rules.iter().all(|r| r == "first-global"),
        "the quota service was asked about {rules:?}"
    );
    assert_eq!(envoy.counter("first-global", "fallback"), 0);
    assert_eq!(envoy.counter("first-global", "allowed"), 40);
    // The second configuration holds excess requests in its own queue and its own tick releases
    // them at its rate: 10 concurrent requests, the last one 450 ms after the first.
    let started = Instant::now();
    let held = parallel(10, |_| Client::new().get(&envoy.url2("/held"), &[]).status);
    assert!(held.iter().all(|s| *s == 200), "{held:?}");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(400) && took < Duration::from_secs(3),
        "{took:?}"
    );
    assert_eq!(envoy.counter("second-held", "delayed"), 9);
    // And its global rule leases under its own name.
    let c = Client::new();
    assert_eq!(
        c.get(&envoy.url2("/global"), &[("x-user", "z")]).status,
        200
    );
    assert!(seen.lock().unwrap().iter().any(|r| r == "second-global"));
    assert_eq!(envoy.counter("second-global", "fallback"), 0);
}
