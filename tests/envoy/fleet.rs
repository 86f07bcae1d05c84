//! Global limits one step further out than one proxy and a polite client: a settlement's debt
//! every Envoy sees, the quota service losing its state under load, Envoys that join a busy key.

use crate::harness::{parallel, Client, Envoy, Options, Quota, Upstream};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// A request's status, when it was answered (ms after `started`).
#[derive(Debug, Clone, Copy)]
struct Sent {
    at_ms: u64,
    status: u16,
}

/// `per_s` requests a second to `url` with `headers` from `started` for `span`, spread over
/// `connections` connections (each one request after another, evenly spaced: open loop as long as
/// answers come faster than requests are due).
fn paced(
    url: &str,
    headers: &[(&str, &str)],
    per_s: f64,
    connections: usize,
    started: Instant,
    span: Duration,
) -> Vec<Sent> {
    let gap = Duration::from_secs_f64(connections as f64 / per_s);
    let mut all: Vec<Sent> = parallel(connections, |i| {
        let client = Client::new();
        let mut sent = Vec::new();
        let mut due = started + gap.mul_f64(i as f64 / connections as f64);
        while due < started + span {
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
            let reply = client.get(url, headers);
            sent.push(Sent {
                at_ms: started.elapsed().as_millis() as u64,
                status: reply.status,
            });
            due += gap;
        }
        sent
    })
    .into_iter()
    .flatten()
    .collect();
    all.sort_by_key(|s| s.at_ms);
    all
}

fn admitted(sent: &[Sent], from_ms: u64, until_ms: u64) -> usize {
    sent.iter()
        .filter(|s| s.status == 200 && (from_ms..until_ms).contains(&s.at_ms))
        .count()
}

fn global_rule(rule: Value, quota: &Quota, service: Value) -> (Value, Options) {
    let mut qs = json!({"upstream": "quota", "timeout": "200ms"});
    for (k, v) in service.as_object().unwrap() {
        qs[k] = v.clone();
    }
    let plugin = json!({"rules": [rule], "quota_service": qs});
    let opts = Options {
        quota_port: Some(quota.port),
        ..Options::default()
    };
    (plugin, opts)
}

/// The LLM budget of docs/llm-budgets.md, global: 10 000 tokens a minute per API key, each
/// request reserving `x-max-tokens` and settled at the usage its stream reports.
fn llm_budget(quota: &Quota, app: &Upstream) -> (Value, Options) {
    let (plugin, opts) = global_rule(
        json!({"name": "llm", "scope": "global", "key": ["header:x-api-key"],
               "limit": {"requests": 10000, "per": "1m"},
               "cost": {"header": "x-max-tokens", "default": 500, "max": 2000},
               "settle": {"usage": "total"}}),
        quota,
        json!({"instances_hint": 3, "lease_size": 2500}),
    );
    (
        plugin,
        Options {
            app_port: Some(app.port),
            ..opts
        },
    )
}

/// A stream reserving 300 tokens that reports `total` (a quarter of it input), at its end about
/// a second after it began (so that streams started together are all admitted first).
fn stream(envoy: &Envoy, total: u64) -> u16 {
    let (input, output) = ((total / 4).to_string(), (total - total / 4).to_string());
    Client::new()
        .get(
            &envoy.url("/app/llm/chat"),
            &[
                ("x-api-key", "team-a"),
                ("x-max-tokens", "300"),
                ("x-stream", "1"),
                ("x-events", "4"),
                ("x-event-ms", "250"),
                ("x-usage-input", &input),
                ("x-usage-output", &output),
            ],
        )
        .status
}

/// One request reserving 300 tokens: its status and `Retry-After`.
fn ask(envoy: &Envoy) -> (u16, Option<u64>) {
    let reply = Client::new().get(
        &envoy.url("/app/llm/chat"),
        &[("x-api-key", "team-a"), ("x-max-tokens", "300")],
    );
    let retry = reply.header("retry-after").and_then(|v| v.parse().ok());
    (reply.status, retry)
}

/// Issue 33, item 1: one Envoy's streams use twice the budget; the debt reaches the quota
/// service's bucket within a tick, so every Envoy refuses the key — with the true wait — and goes
/// on refusing it past every lease term and across the owing Envoy's restart.
#[test]
fn a_settlement_debt_is_seen_by_every_envoy_with_the_true_wait() {
    // Leases of 4 s: the debt must outlive several.
    let quota = Quota::start(&["--lease-ttl-ms", "4000"]);
    let app = Upstream::start(&["--capacity", "100"]);
    let (plugin, opts) = llm_budget(&quota, &app);
    let envoys: Vec<Envoy> = (0..3).map(|_| Envoy::start_with(&plugin, &opts)).collect();
    // Envoy 1's ten streams reserve 300 each and report 2 000 each: 20 000 of a 10 000 budget.
    let started = Instant::now();
    let statuses = parallel(10, |_| stream(&envoys[1], 2_000));
    assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");
    let owed = envoys[1].counter("llm", "debt");
    assert!(owed > 0, "some of it past what its leases held");
    // Within a tick and a call, the service's bucket has all Envoy 1 used (checked after what
    // the Envoys answer: that is the promise): the 20 000 tokens are what it granted, what the
    // calls said was owed, and what Envoy 1's rate lease accrued meanwhile — tokens the service
    // reserved for it, at most the whole rate (167 a second) since the streams began. (Envoy 1's
    // own debt counter is no measure: a lease granted after an excess was charged repays it
    // there — a loaded run saw a 2 500-token grant do so. Under a loaded machine's slower
    // streams the accrual was 12-15 s of the rate, 2 000-2 500 tokens.)
    let accrued = |s: f64| (10_000.0 / 60.0 * s).ceil() as u64;
    let known = || {
        quota.metric("tollgate_quota_tokens_owed_total") as u64
            + quota.metric("tollgate_quota_tokens_granted_total") as u64
    };
    let charged = testkit::eventually(Duration::from_secs(2), || {
        known() + accrued(started.elapsed().as_secs_f64()) >= 20_000
    });
    // The budget, refilled from empty at 10 000 a minute, must cover 20 000 and the request's own
    // 300 before anyone is admitted again: about 62 s from the start.
    let repaid_s = (20_300.0 - 10_000.0) / (10_000.0 / 60.0);
    for (n, e) in envoys.iter().enumerate() {
        for _ in 0..5 {
            let (status, retry) = ask(e);
            let since = started.elapsed().as_secs_f64();
            assert_eq!(status, 429, "Envoy {n} admitted the key while it owed");
            let retry = retry.expect("Retry-After") as f64;
            // The true wait, never shorter (rounded up to seconds, and the streams took a while).
            assert!(
                retry + since >= repaid_s - 1.0 && retry + since <= repaid_s + 8.0,
                "Envoy {n}: Retry-After {retry} at {since:.1} s (repaid at {repaid_s:.1} s)"
            );
        }
    }
    eprintln!(
        "Envoy 1's debt {owed}; the service charged {} and granted {} ({:.1} s after the \
         streams began)",
        quota.metric("tollgate_quota_tokens_owed_total"),
        quota.metric("tollgate_quota_tokens_granted_total"),
        started.elapsed().as_secs_f64()
    );
    assert!(
        charged,
        "the service knows of {} of the 20 000 used, short by more than Envoy 1's lease accrued",
        known()
    );
    // Past two lease terms, still refused everywhere (before: back after one).
    std::thread::sleep(Duration::from_millis(8_500));
    for (n, e) in envoys.iter().enumerate() {
        assert_eq!(ask(e).0, 429, "Envoy {n}, 8 s later");
    }
    // The owing Envoy restarted: the debt is the service's, and stays.
    let mut envoys = envoys;
    envoys[1].kill();
    let again = Envoy::start_with(&plugin, &opts);
    let (status, retry) = ask(&again);
    assert_eq!(status, 429, "a restarted Envoy admitted the key");
    let retry = retry.unwrap() as f64;
    let since = started.elapsed().as_secs_f64();
    assert!(retry + since >= repaid_s - 1.0, "{retry} at {since:.1} s");
    eprintln!(
        "debt {owed} tokens past the leases; every Envoy refused the key with Retry-After to \
         {repaid_s:.0} s after the start, {since:.1} s in"
    );
}

/// Per 100 ms from `from_ms`, what `sent` admitted.
fn per_100ms(sent: &[Sent], from_ms: u64, until_ms: u64) -> Vec<usize> {
    (from_ms..until_ms)
        .step_by(100)
        .map(|t| admitted(sent, t, t + 100))
        .collect()
}

/// Two Envoys sent 50 requests a second each on a global limit of 50 a second (burst 50); the
/// memory quota service is killed 3 s in and started again 300 ms later (it forgot everything).
/// Returns the requests each Envoy sent, the restart's time (ms) and when the run ended.
fn store_loss_under_load(failure_mode: &str) -> (Vec<Sent>, u64, u64) {
    let mut quota = Quota::start(&[]);
    let (plugin, opts) = global_rule(
        json!({"name": "r", "scope": "global", "limit": {"requests": 50, "per": "1s"}}),
        &quota,
        json!({"failure_mode": failure_mode, "instances_hint": 2}),
    );
    let envoys = [
        Envoy::start_with(&plugin, &opts),
        Envoy::start_with(&plugin, &opts),
    ];
    let started = Instant::now();
    let span = Duration::from_secs(8);
    let (killed_ms, back_ms) = (3_000, 3_300);
    let sent = std::thread::scope(|s| {
        let loads: Vec<_> = envoys
            .iter()
            .map(|e| s.spawn(|| paced(&e.url("/"), &[], 50.0, 2, started, span)))
            .collect();
        std::thread::sleep(Duration::from_millis(killed_ms));
        quota.kill();
        std::thread::sleep(Duration::from_millis(back_ms - killed_ms));
        quota.restart();
        let back = started.elapsed().as_millis() as u64;
        let sent: Vec<Sent> = loads.into_iter().flat_map(|l| l.join().unwrap()).collect();
        (sent, back)
    });
    let (mut sent, back) = sent;
    sent.sort_by_key(|s| s.at_ms);
    assert!(
        sent.iter().all(|s| s.status == 200 || s.status == 429),
        "{:?}",
        sent.iter().find(|s| s.status != 200 && s.status != 429)
    );
    (sent, back, span.as_millis() as u64)
}

/// Issue 33, item 2: the memory quota service killed and started again under load. From a second
/// after it answers again the fleet admits at least 90% of the limit's rate — whatever the
/// failure mode — and, counting every admission, never more than `burst + rate × t`.
#[test]
fn a_quota_service_that_lost_its_state_under_load_serves_the_limit_again_at_once() {
    for mode in ["deny", "allow", "local"] {
        let (sent, back, end) = store_loss_under_load(mode);
        let series = per_100ms(&sent, back, end);
        let after = admitted(&sent, back + 1_000, end);
        let rate = 50.0 * (end - back - 1_000) as f64 / 1_000.0;
        eprintln!(
            "{mode}: restarted at {back} ms; admitted per 100 ms from then: {series:?}; \
             {after} from 1 s after ({:.0}% of the limit's rate)",
            100.0 * after as f64 / rate
        );
        assert!(after as f64 >= 0.9 * rate, "{mode}: {after} of {rate}");
        if mode == "deny" {
            // Every admission came from the service's grants: within the bound, across the loss.
            let total = admitted(&sent, 0, end);
            let bound = 50 + 50 * end / 1_000;
            assert!(total as u64 <= bound, "{total} admitted, bound {bound}");
        }
    }
}

/// Issue 33, item 2, where it is hardest: the store lost while the proxies' demands are still
/// being measured (half a second into the key's traffic), three Envoys at 90% of the limit between
/// them. Each renewing proxy takes its part of the rate held for the holders of before — the first
/// no more than half as much again as its share — so nobody is refused (before: the last to renew
/// refused 11 requests, 0.8 to 1.3 s in).
#[test]
fn a_store_loss_in_the_first_second_refuses_no_envoy_under_the_limit() {
    let mut quota = Quota::start(&[]);
    let (plugin, opts) = global_rule(
        json!({"name": "r", "scope": "global", "limit": {"requests": 60, "per": "1s"}}),
        &quota,
        json!({"instances_hint": 3}),
    );
    let envoys: Vec<Envoy> = (0..3).map(|_| Envoy::start_with(&plugin, &opts)).collect();
    let started = Instant::now();
    let span = Duration::from_secs(5);
    let sent: Vec<Vec<Sent>> = std::thread::scope(|s| {
        let loads: Vec<_> = envoys
            .iter()
            .map(|e| s.spawn(|| paced(&e.url("/"), &[], 18.0, 2, started, span)))
            .collect();
        std::thread::sleep(Duration::from_millis(500));
        quota.kill();
        std::thread::sleep(Duration::from_millis(100));
        quota.restart();
        loads.into_iter().map(|l| l.join().unwrap()).collect()
    });
    for (n, sent) in sent.iter().enumerate() {
        let refused: Vec<(u64, u16)> = sent
            .iter()
            .filter(|s| s.status != 200)
            .map(|s| (s.at_ms, s.status))
            .collect();
        eprintln!(
            "Envoy {n}: {} of {} admitted; not admitted: {refused:?}",
            sent.len() - refused.len(),
            sent.len()
        );
        assert!(refused.is_empty(), "Envoy {n} refused under the limit");
    }
}

/// Issue 33, item 3: a fresh key, Envoy A sent far more than the limit (1 200 a second against
/// 200), B and C 20 a second each — under their max-min share. B and C are never refused once
/// their first lease arrived, and the fleet admits close to `burst + rate × t`.
#[test]
fn envoys_under_their_fair_share_beside_a_busy_one_are_never_refused() {
    let quota = Quota::start(&[]);
    let (plugin, opts) = global_rule(
        json!({"name": "r", "scope": "global", "limit": {"requests": 200, "per": "1s"}}),
        &quota,
        json!({"instances_hint": 3}),
    );
    let envoys: Vec<Envoy> = (0..3).map(|_| Envoy::start_with(&plugin, &opts)).collect();
    let started = Instant::now();
    let span = Duration::from_secs(8);
    let (busy, light) = std::thread::scope(|s| {
        let busy = s.spawn(|| paced(&envoys[0].url("/"), &[], 1_200.0, 6, started, span));
        let light: Vec<_> = envoys[1..]
            .iter()
            .map(|e| s.spawn(|| paced(&e.url("/"), &[], 20.0, 1, started, span)))
            .collect();
        let light: Vec<Vec<Sent>> = light.into_iter().map(|l| l.join().unwrap()).collect();
        (busy.join().unwrap(), light)
    });
    let end = span.as_millis() as u64;
    for (n, sent) in light.iter().enumerate() {
        let first = sent.iter().position(|s| s.status == 200).expect("admitted");
        let refused: Vec<u64> = sent[first..]
            .iter()
            .filter(|s| s.status != 200)
            .map(|s| s.at_ms)
            .collect();
        eprintln!(
            "light Envoy {}: {} of {} admitted, refused after its first at {refused:?} ms",
            n + 1,
            admitted(sent, 0, end),
            sent.len()
        );
        assert!(refused.is_empty(), "refused under its fair share");
    }
    let total = admitted(&busy, 0, end) + light.iter().map(|s| admitted(s, 0, end)).sum::<usize>();
    let bound = 200.0 + 200.0 * span.as_secs_f64();
    eprintln!(
        "busy Envoy: {} of {} admitted; the fleet {total} of a bound of {bound} ({:.1}%)",
        admitted(&busy, 0, end),
        busy.len(),
        100.0 * total as f64 / bound
    );
    assert!(total as f64 <= bound, "{total} of {bound}");
    // (Measured 95–97%: docs/quota-api.md. Loose here: the load shares 2 cores with 3 Envoys.)
    assert!(total as f64 >= 0.9 * bound, "{total} of {bound}");
}

/// Issue 33, item 2: two quota service replicas on the memory store, a primary and a standby
/// behind Envoy's priority failover, restarted one after the other (the standby, then the
/// primary: calls go to the standby meanwhile, then back) while two Envoys send a key within its
/// limit. Nothing is refused and nothing fails: each replica that answers learns the leases from
/// the proxies' calls.
#[test]
fn a_rolling_restart_of_two_memory_replicas_loses_nothing_visible() {
    let mut primary = Quota::start(&[]);
    let mut standby = Quota::start(&[]);
    let (plugin, opts) = global_rule(
        json!({"name": "r", "scope": "global", "limit": {"requests": 50, "per": "1s"}}),
        &primary,
        json!({"instances_hint": 2, "failure_mode": "deny"}),
    );
    let opts = Options {
        quota_standby: Some(standby.port),
        debug_log: std::env::var("FLEET_DEBUG").is_ok(),
        ..opts
    };
    let envoys = [
        Envoy::start_with(&plugin, &opts),
        Envoy::start_with(&plugin, &opts),
    ];
    // As a deployment's readiness check would. (Even so, an Envoy worker may send its first
    // calls to the standby: then the primary learns the leases from the proxies' evidence.)
    for e in &envoys {
        e.wait_for_quota_healthy(primary.port);
    }
    let started = Instant::now();
    let span = Duration::from_secs(12);
    let sent: Vec<Sent> = std::thread::scope(|s| {
        // 20 a second from each: 40 of the limit's 50.
        let loads: Vec<_> = envoys
            .iter()
            .map(|e| s.spawn(|| paced(&e.url("/"), &[], 20.0, 1, started, span)))
            .collect();
        std::thread::sleep(Duration::from_secs(2));
        standby.kill();
        std::thread::sleep(Duration::from_millis(500));
        standby.restart();
        std::thread::sleep(Duration::from_secs(3));
        primary.kill();
        std::thread::sleep(Duration::from_millis(500));
        primary.restart();
        loads.into_iter().flat_map(|l| l.join().unwrap()).collect()
    });
    let refused: Vec<(u64, u16)> = sent
        .iter()
        .filter(|s| s.status != 200)
        .map(|s| (s.at_ms, s.status))
        .collect();
    let fallbacks: u64 = envoys.iter().map(|e| e.counter("r", "fallback")).sum();
    let calls = standby.metric("tollgate_quota_lease_items_total");
    eprintln!(
        "rolling restart: {} requests, refused or failed {refused:?}; {fallbacks} decided by the \
         failure mode; the standby served {calls} items",
        sent.len()
    );
    // A failure keeps the Envoys' counters in its log. (Under load it once refused 6-12: an
    // Envoy gave back a surplus a replica that never granted it would not take, kept it, and
    // renewed at every request at a rate measured over a few ms; the surplus is let go now.)
    if std::env::var("FLEET_DEBUG").is_ok() || !refused.is_empty() {
        for e in &envoys {
            let stats = e.admin_get("/stats");
            for l in stats
                .lines()
                .filter(|l| l.contains("tollgate") || l.contains("cluster.quota."))
            {
                if !l.ends_with(": 0") {
                    eprintln!("{l}");
                }
            }
            eprintln!("----");
        }
    }
    assert!(refused.is_empty(), "{refused:?}");
    assert!(calls > 0, "the standby served no call: nothing was checked");
}

/// Issue 34, item 1, one step further out: a global LLM budget of 10 000 tokens an hour over two
/// Envoys, and a client that resets every Anthropic stream right after `message_start` (which
/// says one output token). Each cut stream is charged its reservation (2 000), on both Envoys and
/// across a restart of the memory quota service between them; so once the burst's 10 000 have
/// been charged the key is refused everywhere. Before: each cut stream paid its input and one
/// output token (101), and the key kept being admitted.
#[test]
fn cut_streams_pay_their_reservation_on_every_envoy_and_across_a_quota_restart() {
    let mut quota = Quota::start(&[]);
    let app = Upstream::start(&[]);
    let (plugin, opts) = global_rule(
        json!({"name": "llm", "scope": "global", "key": ["header:x-api-key"],
               "limit": {"requests": 10000, "per": "1h"},
               "cost": {"header": "x-max-tokens", "default": 2000, "max": 2000},
               "settle": {"usage": "total"}}),
        &quota,
        json!({"instances_hint": 2, "lease_size": 2000}),
    );
    let opts = Options {
        app_port: Some(app.port),
        ..opts
    };
    let envoys = [
        Envoy::start_with(&plugin, &opts),
        Envoy::start_with(&plugin, &opts),
    ];
    let lines: [&[u8]; 7] = [
        b"x-api-key: cheat",
        b"x-stream: 1",
        b"x-format: anthropic",
        b"x-usage-input: 100",
        b"x-usage-output: 1800",
        b"x-events: 4",
        b"x-event-ms: 50",
    ];
    let cut = |e: &Envoy| {
        let got = crate::settle::read_events_then_cut(e.port, &lines, 1);
        got.lines().next().unwrap_or_default().to_string()
    };
    let settled = || {
        envoys
            .iter()
            .map(|e| e.counter("llm", "settled"))
            .sum::<u64>()
    };
    let mut statuses = Vec::new();
    for round in 0..2 {
        for e in &envoys {
            statuses.push(cut(e));
            let want = 2_000 * statuses.len() as u64;
            assert!(
                testkit::eventually(Duration::from_secs(5), || settled() == want),
                "round {round}: settled {} of {want}",
                settled()
            );
        }
        if round == 0 {
            // The store forgets everything; the Envoys' evidence brings the bucket back.
            quota.kill();
            quota.restart();
        }
    }
    assert!(
        statuses.iter().all(|s| s.contains("200")),
        "four cut streams admitted: {statuses:?}"
    );
    // 8 000 charged of a burst of 10 000: at most one more reservation fits (a loss of the
    // store's state only ever makes the fleet stricter), then none on either Envoy.
    let more: Vec<String> = (0..4).map(|i| cut(&envoys[i % 2])).collect();
    let admitted = more.iter().filter(|s| s.contains("200")).count();
    assert!(
        admitted <= 1,
        "{admitted} more admitted past 8 000 charged: {more:?}"
    );
    for (n, e) in envoys.iter().enumerate() {
        let reply = Client::new().get(
            &e.url("/app/llm/chat"),
            &[("x-api-key", "cheat"), ("x-stream", "1")],
        );
        assert_eq!(reply.status, 429, "Envoy {n} admitted past the budget");
    }
}
