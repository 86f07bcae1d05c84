//! Global limits on a Redis Cluster: buckets spread over its masters, a master's failover under
//! load, and three service replicas over it.

use crate::harness::{eventually, parallel, Client, Envoy, Options, Quota, RedisCluster};
use serde_json::json;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// A lease call of `n` items for new keys, straight to the service: its status and time.
fn lease_call(quota: &Quota, n: usize) -> (u16, Duration) {
    let items: Vec<_> = (0..n)
        .map(|i| {
            json!({"rule": "r", "limit_id": "cluster", "key": format!("key-{i}"),
                   "requests": 100, "per_ms": 1000, "burst": 100, "wanted": 25, "used": 0,
                   "demand": 50.0})
        })
        .collect();
    let body = json!({"instance": "probe", "items": items}).to_string();
    let started = Instant::now();
    let status = match ureq::post(&format!("http://127.0.0.1:{}/v1/lease", quota.port))
        .set("content-type", "application/json")
        .send_string(&body)
    {
        Ok(r) => r.status(),
        Err(ureq::Error::Status(s, _)) => s,
        Err(e) => panic!("{e}"),
    };
    (status, started.elapsed())
}

#[test]
fn a_cluster_holds_the_buckets_on_all_its_masters_and_survives_a_failover() {
    let mut cluster = RedisCluster::start();
    let urls = cluster.urls();
    // A storage timeout for a debug build (the release build's figures are in docs/quota-api.md).
    let quota = Quota::start(&[
        "--redis-cluster",
        &urls,
        "--lease-ttl-ms",
        "1000",
        "--storage-timeout-ms",
        "500",
    ]);

    // 1 000 keys in one call: one script per slot, sent together.
    let (status, took) = lease_call(&quota, 1_000);
    eprintln!("1000 new keys on a 3-master cluster: {status} in {took:?}");

    assert_eq!(status, 200);
    // Under a loaded machine a replica may take over a master that missed its 1 s node timeout;
    // both say "master" until the old one learns it: wait for the cluster to settle on three.
    let mut spread = Vec::new();
    let settled = eventually(Duration::from_secs(10), || {
        spread = cluster.masters_with("{tg:cluster.*}:b");
        spread.len() == 3
    });
    assert!(settled, "{spread:?}");
    assert!(spread.iter().all(|(_, keys)| *keys > 200), "{spread:?}");

    // One Envoy under load on a global key; its master is killed.
    let plugin = json!({
        "rules": [{"name": "g", "scope": "global", "limit": {"requests": 100, "per": "1s"}, "burst": 100}],
        "quota_service": {"upstream": "quota", "failure_mode": "deny", "instances_hint": 1,
                          "timeout": "100ms", "retry": "200ms"}
    });
    let e = Envoy::start_with(
        &plugin,
        &Options {
            quota_port: Some(quota.port),
            ..Options::default()
        },
    );
    let started = Instant::now();
    let c = Client::new();
    let mut statuses = Vec::new();
    let mut slowest = Duration::ZERO;
    let mut send = |statuses: &mut Vec<u16>, span: Duration| {
        let until = Instant::now() + span;
        while Instant::now() < until {
            let sent = Instant::now();
            statuses.push(c.get(&e.url("/"), &[]).status);
            slowest = slowest.max(sent.elapsed());
        }
    };
    send(&mut statuses, Duration::from_millis(1_000));
    // The Envoy's bucket: its limit id is 16 hex digits, bound by the service to the limit it
    // states (100 per 1 000 ms, burst 100; the probe's limit id is "cluster").
    let holder = cluster
        .masters_with("{tg:????????????????.100.1000.100:*}:b")
        .into_iter()
        .find(|(_, keys)| *keys > 0)
        .map(|(i, _)| i)
        .expect("a master holds the Envoy's bucket");
    let granted_before = e.prometheus("tollgate_quota_granted{}");
    cluster.kill(holder);
    let killed = Instant::now();
    // During the failover: the failure mode (deny), never a request held past the timeout.
    while e.counter("g", "fallback") == 0 {
        assert!(
            killed.elapsed() < Duration::from_secs(10),
            "no failure mode"
        );
        send(&mut statuses, Duration::from_millis(100));
    }
    let failure_seen = killed.elapsed();
    cluster.wait_ok();
    let promoted = killed.elapsed();
    // Then grants resume.
    let resume_deadline = Instant::now() + Duration::from_secs(10);
    loop {
        send(&mut statuses, Duration::from_millis(200));
        let leased = e.prometheus("tollgate_quota_granted{}") > granted_before
            || statuses.iter().rev().take(20).any(|s| *s == 200);
        if leased && e.counter("g", "fallback") > 0 {
            break;
        }
        assert!(
            Instant::now() < resume_deadline,
            "grants did not resume: last {:?}, quota: {}",
            &statuses[statuses.len().saturating_sub(10)..],
            quota
                .metrics()
                .lines()
                .filter(|l| l.starts_with("tollgate_quota_lease_calls_total"))
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
    let resumed = killed.elapsed();
    send(&mut statuses, Duration::from_millis(1_000));
    let elapsed = started.elapsed().as_secs_f64();
    let admitted = statuses.iter().filter(|s| **s == 200).count() as i64;
    let bound = 100 + (100.0 * elapsed).ceil() as i64;
    eprintln!(
        "failover: failure mode after {failure_seen:?}, cluster ok after {promoted:?}, 200s again \
         after {resumed:?}; {admitted} admitted in {elapsed:.1} s (bound {bound}), slowest {slowest:?}"
    );
    assert!(statuses.iter().all(|s| *s == 200 || *s == 429), "no 5xx");
    assert!(slowest < Duration::from_millis(500), "slowest {slowest:?}");
    assert!(admitted <= bound, "{admitted} admitted, bound {bound}");
}

/// Issue 36, item 3: three `tollgate-quota` replicas behind each Envoy's quota cluster (round
/// robin, health-checked), over a 3-master cluster with a replica each; two Envoys send six
/// users' requests, each user about 10× over its limit (20/s). One second in, the master holding the most
/// buckets is killed (its replica takes over) and a service replica is SIGKILLed. Every user
/// stays within its bound (a lease per Envoy on top: replication is asynchronous, so a failover
/// may lose the last grants, which docs/quota-api.md states), no bucket is on two masters, no 5xx.
#[test]
fn three_replicas_over_a_cluster_keep_each_bound_across_a_failover_and_a_killed_replica() {
    const USERS: usize = 6;
    const RATE: f64 = 20.0;
    const BURST: f64 = 20.0;
    const LEASE: f64 = 2.0; // the default lease size: 20 / (4 × instances_hint 2), rounded down
    let mut cluster = RedisCluster::start();
    let urls = cluster.urls();
    let args = ["--redis-cluster", &urls, "--storage-timeout-ms", "500"];
    let q1 = Quota::start(&args);
    let mut q2 = Quota::start(&args);
    let q3 = Quota::start(&args);
    // `deny`: what a failure mode admits would come on top of the bound and hide a grant made
    // twice.
    let plugin = json!({
        "rules": [{"name": "u", "scope": "global", "key": ["header:x-user"],
                   "limit": {"requests": 20, "per": "1s"}, "burst": 20}],
        "quota_service": {"upstream": "quota", "failure_mode": "deny", "instances_hint": 2,
                          "timeout": "200ms", "retry": "100ms"}
    });
    let start = || {
        Envoy::start_with(
            &plugin,
            &Options {
                quota_port: Some(q1.port),
                quota_replicas: vec![q2.port, q3.port],
                ..Options::default()
            },
        )
    };
    let (a, b) = (start(), start());
    let started = Instant::now();
    let deadline = started + Duration::from_secs(5);
    let mut failed_over = None;
    let counts = std::thread::scope(|scope| {
        let load = scope.spawn(|| {
            // Each thread sends every user's requests in turn, 2 ms apart.
            parallel(4, |i| {
                let envoy = [&a, &b][i % 2];
                let c = Client::new();
                let mut per_user = [(0usize, 0usize); USERS];
                let mut n = i;
                while Instant::now() < deadline {
                    let user = n % USERS;
                    n += 1;
                    let status = c
                        .get(&envoy.url("/"), &[("x-user", &format!("user-{user}"))])
                        .status;
                    match status {
                        200 => per_user[user].0 += 1,
                        429 => per_user[user].1 += 1,
                        s => panic!("unexpected status {s}"),
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                per_user
            })
        });
        std::thread::sleep(Duration::from_millis(1_000));
        let busiest = cluster
            .masters_with("{tg:*}:b")
            .into_iter()
            .max_by_key(|(_, keys)| *keys)
            .expect("a master with buckets");
        cluster.kill(busiest.0);
        q2.kill();
        failed_over = Some(busiest);
        load.join().unwrap()
    });
    let elapsed = started.elapsed().as_secs_f64();
    cluster.wait_ok();
    let mut admitted = [0usize; USERS];
    let mut refused = [0usize; USERS];
    for thread in &counts {
        for (u, (ok, no)) in thread.iter().enumerate() {
            admitted[u] += ok;
            refused[u] += no;
        }
    }
    let failures =
        a.prometheus("tollgate_quota_failures{}") + b.prometheus("tollgate_quota_failures{}");
    let bound = BURST + RATE * elapsed;
    eprintln!(
        "3 replicas over a cluster, master {:?} and a replica killed: admitted {admitted:?}, \
         refused {refused:?} in {elapsed:.1} s (bound {bound:.0} each), {failures} failed calls",
        failed_over
    );
    for u in 0..USERS {
        assert!(
            admitted[u] as f64 <= bound + 2.0 * LEASE,
            "user-{u}: {} admitted, bound {bound:.0}",
            admitted[u]
        );
        // Over its limit throughout: refused, and admitted most of its limit (the failover
        // denies for a few seconds at most on the killed master's keys).
        assert!(
            refused[u] > 0 && admitted[u] as f64 >= bound / 3.0,
            "user-{u}: {admitted:?}"
        );
    }
    // Every bucket on one master only, all six there.
    let mut homes: HashMap<String, usize> = HashMap::new();
    for (master, keys) in cluster.keys_on_masters("{tg:*}:b") {
        for key in keys {
            assert!(
                homes.insert(key.clone(), master).is_none(),
                "{key} on two masters"
            );
        }
    }
    assert_eq!(homes.len(), USERS, "{homes:?}");
}
