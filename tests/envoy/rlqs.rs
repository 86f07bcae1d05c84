//! Envoy 1.40's rate limit quota filter (`envoy.filters.http.rate_limit_quota`) against the quota
//! service's RLQS: the configuration of docs/quota-api.md as written, the bound over two Envoys,
//! and a killed service that leaves Envoys to their fallback behaviours.

use crate::harness::{free_port, Client, Envoy, Quota};
use crate::rls::envoy_from_docs as envoy;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use testkit::Upstream;

/// The two fenced blocks of docs/quota-api.md's RLQS section: the limits and the Envoy.
fn documented() -> (String, String) {
    crate::rls::documented_in("## Envoy's rate limit quota service (RLQS)")
}

fn service(grpc: u16, limits: &str, args: &[&str]) -> Quota {
    let path = testkit::scratch_dir("rlqs").join("limits.yaml");
    std::fs::write(&path, limits).unwrap();
    let listen = format!("127.0.0.1:{grpc}");
    let path = path.display().to_string();
    let mut all = vec![
        "--grpc-listen",
        listen.as_str(),
        "--rls-config",
        path.as_str(),
    ];
    all.extend_from_slice(args);
    Quota::start(&all)
}

/// Send `per_second` requests a second for `tenant` to each Envoy in turn for `span`: the
/// statuses each got.
fn load(envoys: &[&Envoy], tenant: &str, per_second: f64, span: Duration) -> Vec<Vec<u16>> {
    let client = Client::new();
    let started = Instant::now();
    let mut got = vec![Vec::new(); envoys.len()];
    let mut n = 0u32;
    while started.elapsed() < span {
        let due = started + Duration::from_secs_f64(f64::from(n) / per_second);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let i = n as usize % envoys.len();
        got[i].push(
            client
                .get(&envoys[i].url("/"), &[("x-tenant", tenant)])
                .status,
        );
        n += 1;
    }
    got
}

fn admitted(statuses: &[u16]) -> usize {
    statuses.iter().filter(|s| **s == 200).count()
}

#[test]
fn the_documented_rlqs_configuration_bounds_two_envoys_as_one_budget() {
    let (limits, yaml) = documented();
    let app = Upstream::start(&[]);
    let grpc = free_port();
    let quota = service(grpc, &limits, &[]);
    let a = envoy(&yaml, app.port, grpc, |_| {});
    let b = envoy(&yaml, app.port, grpc, |_| {});
    // 6 a second over both for 12 s (72 requests) against 20 a minute.
    let span = Duration::from_secs(12);
    let started = Instant::now();
    let got = load(&[&a, &b], "acme", 6.0, span);
    let elapsed = started.elapsed().as_secs_f64();
    let (na, nb) = (admitted(&got[0]), admitted(&got[1]));
    let bound = 20.0 * (1.0 + elapsed / 60.0);
    eprintln!(
        "RLQS: {na} + {nb} admitted of {} in {elapsed:.1} s; bound {bound:.1}",
        got[0].len() + got[1].len()
    );
    assert!((na + nb) as f64 <= bound.floor(), "{na} + {nb} > {bound}");
    assert!(
        na >= 2 && nb >= 2,
        "each Envoy was assigned tokens: {na}, {nb}"
    );
    assert!(na + nb >= 10, "assignments follow the demand: {na} + {nb}");
    // Every refusal is Envoy's own 429, never an error.
    assert!(
        got.iter().flatten().all(|s| *s == 200 || *s == 429),
        "{got:?}"
    );
    let metrics = quota.metrics();
    assert!(
        metrics.contains(r#"tollgate_quota_rlqs_streams_total{outcome="ok"} 2"#),
        "{metrics}"
    );
    assert!(
        metrics.contains("tollgate_quota_rlqs_assignments_total{outcome=\"token_bucket\"}"),
        "{metrics}"
    );
    // Another tenant has its own 20.
    let other = load(&[&a], "globex", 4.0, Duration::from_secs(1));
    assert!(admitted(&other[0]) >= 1, "{other:?}");
}

#[test]
fn a_killed_service_leaves_envoys_to_their_expired_and_no_assignment_behaviours() {
    let (limits, yaml) = documented();
    let app = Upstream::start(&[]);
    let grpc = free_port();
    let mut quota = service(grpc, &limits, &["--lease-ttl-ms", "7000"]);
    // The documented Envoy, but allowing buckets without an assignment.
    let allow_unassigned = |b: &mut Value| {
        let settings = &mut b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
            ["typed_config"]["http_filters"][0]["typed_config"]["bucket_matchers"]["matcher_list"]
            ["matchers"][0]["on_match"]["action"]["typed_config"];
        settings["no_assignment_behavior"] =
            json!({"fallback_rate_limit": {"blanket_rule": "ALLOW_ALL"}});
    };
    let e = envoy(&yaml, app.port, grpc, allow_unassigned);
    let first = load(&[&e], "acme", 4.0, Duration::from_secs(2));
    assert!(admitted(&first[0]) >= 1, "{first:?}");
    quota.kill();
    // Within the assignment's TTL (7 s less 250 ms) Envoy enforces what it was given; after it,
    // expired_assignment_behavior: DENY_ALL.
    std::thread::sleep(Duration::from_secs(8));
    let expired = load(&[&e], "acme", 4.0, Duration::from_secs(1));
    assert!(expired[0].iter().all(|s| *s == 429), "{expired:?}");
    // A bucket that never had an assignment: no_assignment_behavior (ALLOW_ALL here).
    let fresh = load(&[&e], "initech", 4.0, Duration::from_secs(1));
    assert!(fresh[0].iter().all(|s| *s == 200), "{fresh:?}");
    // The service back: Envoy's stream comes back and assignments resume.
    quota.restart();
    let client = Client::new();
    let back = testkit::eventually(Duration::from_secs(15), || {
        client.get(&e.url("/"), &[("x-tenant", "umbrella")]).status == 200
            && quota
                .metrics()
                .contains("tollgate_quota_rlqs_assignments_total")
    });
    assert!(back, "assignments resumed after the restart");
}

#[test]
fn an_rlqs_bucket_and_an_rls_descriptor_with_the_same_entries_are_one_bucket() {
    let (limits, rlqs_yaml) = documented();
    let app = Upstream::start(&[]);
    let grpc = free_port();
    let _quota = service(grpc, &limits, &[]);
    let rlqs_envoy = envoy(&rlqs_yaml, app.port, grpc, |_| {});
    // The RLS section's Envoy, asking for (tenant) in domain `api`.
    let (_, rls_yaml) = crate::rls::documented_in("## Envoy's rate limit service (RLS)");
    let rls_envoy = envoy(&rls_yaml, app.port, grpc, |b| {
        let hcm = &mut b["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
            ["typed_config"];
        hcm["http_filters"][0]["typed_config"]["domain"] = json!("api");
        hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["rate_limits"] = json!([
            {"actions": [{"request_headers": {"header_name": "x-tenant", "descriptor_key": "tenant"}}]}
        ]);
    });
    let started = Instant::now();
    let got = load(
        &[&rlqs_envoy, &rls_envoy],
        "acme",
        8.0,
        Duration::from_secs(7),
    );
    let elapsed = started.elapsed().as_secs_f64();
    let (q, r) = (admitted(&got[0]), admitted(&got[1]));
    let bound = 20.0 * (1.0 + elapsed / 60.0);
    eprintln!("RLQS Envoy {q} + RLS Envoy {r} admitted in {elapsed:.1} s; bound {bound:.1}");
    assert!((q + r) as f64 <= bound.floor(), "{q} + {r} > {bound}");
    assert!(q >= 1 && r >= 1, "both took from the bucket: {q}, {r}");
}

#[test]
fn a_tenant_header_that_is_not_utf8_goes_by_no_assignment_behavior_and_breaks_nothing() {
    let (limits, yaml) = documented();
    let app = Upstream::start(&[]);
    let grpc = free_port();
    let quota = service(grpc, &limits, &[]);
    let e = envoy(&yaml, app.port, grpc, |_| {});
    let bad = testkit::raw(b"/", &[b"x-tenant: bad\xff\xfe"]);
    // Its bucket cannot be answered: the documented no_assignment_behavior (DENY_ALL) refuses it.
    for _ in 0..10 {
        assert_eq!(testkit::raw_status(e.port, &bad), Some(429));
        std::thread::sleep(Duration::from_millis(20));
    }
    // The stream lives on: another tenant is assigned tokens.
    let good = load(&[&e], "good", 10.0, Duration::from_secs(1));
    assert!(admitted(&good[0]) >= 1, "{good:?}");
    let metrics = quota.metrics();
    assert!(
        metrics.contains(r#"tollgate_quota_rlqs_streams_total{outcome="ok"} 1"#),
        "{metrics}"
    );
    assert!(metrics.contains("unanswered_not_utf8"), "{metrics}");
}
