//! Global concurrency: at most N requests of a key in flight across every Envoy sharing the quota
//! service, by leases of slots — held, renewed, given back, and lost by a proxy that dies or is
//! cut off. The upstream (tollgate-testbed) counts what it has in flight itself.

use crate::harness::{eventually, load, Envoy, Options, Quota, Redis, Upstream};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const IN_FLIGHT: &str = "tollgate_rule_in_flight{tollgate_rule=\"tenant\"}";

fn plugin(instances: u64) -> Value {
    json!({
        "rules": [{"name": "tenant", "scope": "global", "algorithm": "concurrency",
                   "match": {"path_prefix": "/app"}, "key": ["header:x-user"],
                   "limit": {"concurrent": 10}}],
        "quota_service": {"upstream": "quota", "instances_hint": instances,
                          "failure_mode": "deny"}
    })
}

fn envoy(app: &Upstream, quota_port: u16, instances: u64) -> Envoy {
    Envoy::start_with(
        &plugin(instances),
        &Options {
            app_port: Some(app.port),
            quota_port: Some(quota_port),
            ..Options::default()
        },
    )
}

/// Open-loop load of tenant `u` on each Envoy at once: `rate` per second each, for `seconds`.
fn load_all(envoys: &[&Envoy], rate: u32, seconds: f64, bucket_ms: Option<u64>) -> Vec<Value> {
    std::thread::scope(|s| {
        let handles: Vec<_> = envoys
            .iter()
            .map(|e| {
                let url = e.url("/app");
                s.spawn(move || {
                    let (rate, seconds) = (rate.to_string(), seconds.to_string());
                    let mut args = vec![
                        "--rate",
                        &rate,
                        "--seconds",
                        &seconds,
                        "--class",
                        "u:100:x-user=u",
                    ];
                    let bucket = bucket_ms.map(|b| b.to_string());
                    if let Some(b) = &bucket {
                        args.extend(["--bucket-ms", b]);
                    }
                    load(&url, &args)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn in_flight(envoys: &[&Envoy]) -> i64 {
    envoys.iter().map(|e| e.prometheus(IN_FLIGHT)).sum()
}

#[test]
fn three_envoys_keep_a_key_within_its_limit_and_a_killed_one_gives_its_slots_back() {
    // Each request holds the upstream 1.5 s; a lease lasts 4 s unless renewed.
    let app = Upstream::start(&["--capacity", "1000", "--service-ms", "1500"]);
    let quota = Quota::start(&["--lease-ttl-ms", "4000"]);
    let (a, b) = (envoy(&app, quota.port, 3), envoy(&app, quota.port, 3));
    let mut c = envoy(&app, quota.port, 3);
    // 8/s on each Envoy: 12 in flight wanted by each, 36 in all, for a limit of 10.
    let results = load_all(&[&a, &b, &c], 8, 5.0, None);
    let admitted: u64 = results
        .iter()
        .map(|r| r["all"]["ok"].as_u64().unwrap())
        .sum();
    let most = app.max_at_once();
    eprintln!("3 Envoys: upstream held at most {most}, {admitted} admitted: {results:?}");
    assert!(most <= 10, "the upstream had {most} in flight");
    assert!(most >= 9, "the limit was not used: at most {most}");
    // Fair shares: each Envoy got a fair part of what was admitted.
    for r in &results {
        assert!(
            r["all"]["ok"].as_u64().unwrap() * 5 >= admitted,
            "{results:?}"
        );
    }
    assert!(quota
        .metrics()
        .contains("tollgate_quota_slots_held{rule=\"tenant\""));
    // Load on all three again; C dies holding slots; A and B take them once C's lease ends.
    let started = Instant::now();
    let recovered = std::thread::scope(|s| {
        let loads = s.spawn(|| load_all(&[&a, &b], 8, 12.0, None));
        let c_url = c.url("/app");
        let c_load = s.spawn(move || {
            let args = ["--rate", "8", "--seconds", "3", "--class", "u:100:x-user=u"];
            load(&c_url, &[&args[..], &["--timeout", "2"]].concat())
        });
        while started.elapsed() < Duration::from_secs(3) && c.prometheus(IN_FLIGHT) == 0 {
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(1_500));
        let held_by_c = c.prometheus(IN_FLIGHT);
        let killed = Instant::now();
        c.kill();
        let _ = c_load.join();
        // The others reach the whole limit again.
        let back = || in_flight(&[&a, &b]) >= 10;
        assert!(
            eventually(Duration::from_secs(10), back),
            "C's slots never came back"
        );
        let took = killed.elapsed();
        let _ = loads.join();
        (held_by_c, took)
    });
    let most = app.max_at_once();
    eprintln!(
        "C held {} in flight when killed; A and B had all 10 after {:?}; upstream at most {most}",
        recovered.0, recovered.1
    );
    assert!(recovered.0 > 0, "C held nothing");
    assert!(recovered.1 < Duration::from_millis(4_000 + 2_500));
    assert!(most <= 10, "the upstream had {most} in flight");
}

/// A TCP relay to `to` that can be cut: then it forwards nothing either way (calls time out).
struct Relay {
    port: u16,
    cut: Arc<AtomicBool>,
}

impl Relay {
    fn start(to: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let cut = Arc::new(AtomicBool::new(false));
        let flag = cut.clone();
        std::thread::spawn(move || {
            for inbound in listener.incoming().flatten() {
                let Ok(outbound) = TcpStream::connect(("127.0.0.1", to)) else {
                    continue;
                };
                for (mut from, mut into) in [
                    (inbound.try_clone().unwrap(), outbound.try_clone().unwrap()),
                    (outbound, inbound),
                ] {
                    let cut = flag.clone();
                    std::thread::spawn(move || {
                        let mut buf = [0u8; 16 * 1024];
                        while let Ok(n) = from.read(&mut buf) {
                            if n == 0 {
                                break;
                            }
                            if !cut.load(Ordering::SeqCst) && into.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                    });
                }
            }
        });
        Self { port, cut }
    }
}

#[test]
fn an_envoy_cut_off_from_the_quota_service_stops_admitting_when_its_lease_ends() {
    let app = Upstream::start(&["--capacity", "1000", "--service-ms", "1000"]);
    let quota = Quota::start(&["--lease-ttl-ms", "3000"]);
    let relay = Relay::start(quota.port);
    let a = envoy(&app, quota.port, 2);
    let cut_off = envoy(&app, relay.port, 2);
    let cut_at = 3_000;
    let results = std::thread::scope(|s| {
        let loads = s.spawn(|| load_all(&[&a, &cut_off], 10, 10.0, Some(500)));
        std::thread::sleep(Duration::from_millis(cut_at));
        relay.cut.store(true, Ordering::SeqCst);
        loads.join().unwrap()
    });
    // Once its renewal fails the cut-off Envoy admits nothing (failure_mode deny), its requests in
    // flight end within the rest of its term, and after the term the other one has the whole
    // limit.
    let timeline = |r: &Value| r["timeline"].as_array().unwrap().clone();
    let ok = |b: &Value| b["200"].as_u64().unwrap_or(0);
    let after = ((cut_at + 3_000 + 500) / 500) as usize;
    let late_cut: u64 = timeline(&results[1])[after..].iter().map(ok).sum();
    let late_other: u64 = timeline(&results[0])[after..].iter().map(ok).sum();
    let most = app.max_at_once();
    eprintln!(
        "cut off: {late_cut} admitted after its lease ended, the other {late_other}; upstream at most {most}: {results:?}"
    );
    assert_eq!(late_cut, 0);
    assert!(late_other > 0);
    assert!(most <= 10, "the upstream had {most} in flight");
    assert!(cut_off.counter("tenant", "limited") > 0);
}

/// Run `cut` `cut_at_ms` into an open-loop load on `envoy` (10/s of one tenant, 100 ms buckets),
/// watch for the Envoy's first failed quota call, and return the requests it admitted that were
/// sent more than one bucket after that failure, and the failure's time (ms into the load).
fn admitted_after_the_first_failure(
    envoy: &Envoy,
    cut_at_ms: u64,
    cut: impl FnOnce(),
) -> (u64, u64) {
    let started = Instant::now();
    let (result, failed_at) = std::thread::scope(|s| {
        let load = s.spawn(|| load_all(&[envoy], 10, 8.0, Some(100)));
        std::thread::sleep(Duration::from_millis(cut_at_ms));
        cut();
        let failed = || envoy.prometheus("tollgate_quota_failures{}") > 0;
        assert!(
            eventually(Duration::from_secs(5), failed),
            "no quota call failed"
        );
        let failed_at = started.elapsed().as_millis() as u64;
        (load.join().unwrap().remove(0), failed_at)
    });
    let timeline = result["timeline"].as_array().unwrap().clone();
    let from = (failed_at / 100 + 2) as usize;
    let admitted = timeline
        .iter()
        .skip(from)
        .map(|b| b["200"].as_u64().unwrap_or(0))
        .sum();
    (admitted, failed_at)
}

#[test]
fn after_a_failed_call_under_deny_a_proxy_admits_nothing_new() {
    // Requests hold the upstream 1 s; a term of 3 s, renewed halfway: the first renewal after the
    // cut fails within 1.5 s, the lease then still has half a term, and `retry` (1 s) comes due
    // before it ends. Nothing new may be admitted from that first failure on.
    let app = Upstream::start(&["--capacity", "1000", "--service-ms", "1000"]);
    // A partition: a relay that drops the proxy's traffic both ways.
    let quota = Quota::start(&["--lease-ttl-ms", "3000"]);
    let relay = Relay::start(quota.port);
    let cut_off = envoy(&app, relay.port, 1);
    let (admitted, failed_at) = admitted_after_the_first_failure(&cut_off, 2_000, || {
        relay.cut.store(true, Ordering::SeqCst)
    });
    eprintln!("partitioned: first failure at {failed_at} ms, {admitted} admitted after it");
    assert_eq!(
        admitted, 0,
        "admitted after the failed call (at {failed_at} ms)"
    );
    assert!(cut_off.counter("tenant", "limited") > 0);
    // A hung service (SIGSTOP).
    let hung = Quota::start(&["--lease-ttl-ms", "3000"]);
    let e = envoy(&app, hung.port, 1);
    let (admitted, failed_at) = admitted_after_the_first_failure(&e, 2_000, || hung.pause());
    hung.resume();
    eprintln!("service stopped: first failure at {failed_at} ms, {admitted} admitted after it");
    assert_eq!(
        admitted, 0,
        "admitted after the failed call (at {failed_at} ms)"
    );
}

#[test]
fn a_quota_service_restart_admits_no_more_than_the_limit() {
    let app = Upstream::start(&["--capacity", "1000", "--service-ms", "1500"]);
    // A restart forgets every holding; the first renewal after it carries the proxy's evidence
    // (the slots it holds), and then holders declare what they keep, nothing new for a term. The
    // service's default cold start: a new deployment gets its slots at once.
    let mut quota = Quota::start(&["--lease-ttl-ms", "3000"]);
    let (a, b) = (envoy(&app, quota.port, 2), envoy(&app, quota.port, 2));
    std::thread::scope(|s| {
        let loads = s.spawn(|| load_all(&[&a, &b], 10, 9.0, None));
        std::thread::sleep(Duration::from_millis(3_000));
        quota.restart();
        loads.join().unwrap()
    });
    let most = app.max_at_once();
    eprintln!("across a quota service restart the upstream had at most {most} in flight");
    assert!(most <= 10, "the upstream had {most} in flight");
    assert!(most >= 8, "the limit was not used: {most}");
}

#[test]
fn two_quota_service_replicas_on_one_redis_serve_one_limit() {
    let app = Upstream::start(&["--capacity", "1000", "--service-ms", "1500"]);
    let redis = Redis::start();
    let args = ["--redis", &redis.url(), "--lease-ttl-ms", "4000"];
    let (one, two) = (Quota::start(&args), Quota::start(&args));
    let (a, b) = (envoy(&app, one.port, 3), envoy(&app, one.port, 3));
    let c = envoy(&app, two.port, 3);
    let results = load_all(&[&a, &b, &c], 8, 5.0, None);
    let admitted: u64 = results
        .iter()
        .map(|r| r["all"]["ok"].as_u64().unwrap())
        .sum();
    let most = app.max_at_once();
    eprintln!("3 Envoys, 2 replicas on Redis: upstream held at most {most}, {admitted} admitted");
    assert!(most <= 10, "the upstream had {most} in flight");
    assert!(most >= 9, "the limit was not used: at most {most}");
    assert!(two
        .metrics()
        .contains("tollgate_quota_slot_calls_total{outcome=\"ok\"}"));
}

/// Issue 33, item 2, for global concurrency: the memory quota service killed and started again
/// (it forgot every holding) while two Envoys keep about 9 of the limit's 10 in flight. Each
/// Envoy's renewal brings its holding back by its evidence — not only what it has in flight — so
/// traffic under the limit is never refused across the loss, and the upstream never has more
/// than the limit.
#[test]
fn a_quota_service_that_lost_its_holdings_refuses_nothing_under_the_limit() {
    let app = Upstream::start(&["--capacity", "1000", "--service-ms", "1500"]);
    let mut quota = Quota::start(&["--lease-ttl-ms", "3000"]);
    let (a, b) = (envoy(&app, quota.port, 2), envoy(&app, quota.port, 2));
    let results = std::thread::scope(|s| {
        // 3 a second each, 1.5 s upstream: about 4.5 in flight each, 9 in all.
        let loads = s.spawn(|| load_all(&[&a, &b], 3, 9.0, Some(500)));
        std::thread::sleep(Duration::from_millis(3_000));
        quota.kill();
        std::thread::sleep(Duration::from_millis(300));
        quota.restart();
        loads.join().unwrap()
    });
    let refused: u64 = results
        .iter()
        .map(|r| r["all"]["statuses"]["429"].as_u64().unwrap_or(0))
        .sum();
    let most = app.max_at_once();
    eprintln!(
        "across a memory store's loss: {refused} refused, the upstream held at most {most}: {}",
        results
            .iter()
            .map(|r| r["timeline"].to_string())
            .collect::<Vec<_>>()
            .join(" | ")
    );
    assert_eq!(
        refused, 0,
        "traffic under the limit refused across the loss"
    );
    assert!(most <= 10, "the upstream had {most} in flight");
}
