//! Overload protection against an upstream with a capacity (tollgate-testbed): adaptive
//! concurrency at 2× and 5× its capacity, priorities, fairness between flows, the success-rate
//! throttle. The bounds here are loose on purpose (a 2-core machine shared with the load); the
//! measured figures are in docs/benchmarks.md (`bench/run.py --sections overload`).

use crate::harness::{load, Envoy, MachineLock, MachineTimes, Options, Upstream};
use serde_json::{json, Value};
use std::time::Duration;

/// The upstream: 10 at once, 50 ms each (200 requests/s).
const CAPACITY_RPS: f64 = 200.0;

/// One load at a time on the machine: these tests measure latency on 2 cores.
fn start(plugin: Value, upstream: &[&str]) -> (MachineLock, Upstream, Envoy) {
    let turn = MachineLock::take("overload");
    let app = Upstream::start(upstream);
    let envoy = Envoy::start_with(
        &plugin,
        &Options {
            app_port: Some(app.port),
            ..Options::default()
        },
    );
    (turn, app, envoy)
}

/// The adaptive rule on the CPU signal, before an upstream of 10 at once × 50 ms that reports
/// its CPU in `endpoint-load-metrics`.
fn start_reporting_cpu() -> (MachineLock, Upstream, Envoy) {
    start(
        json!({"rules": [{"name": "app", "algorithm": "adaptive", "match": {"path_prefix": "/app"},
                          "adaptive": {"cpu": {"header": "endpoint-load-metrics"}}}]}),
        &[
            "--capacity",
            "10",
            "--service-ms",
            "50",
            "--cpu-header",
            "endpoint-load-metrics",
        ],
    )
}

fn run(envoy: &Envoy, rate: f64, seconds: f64, warmup: f64, classes: &[&str]) -> Value {
    let (rate, seconds, warmup) = (rate.to_string(), seconds.to_string(), warmup.to_string());
    let mut args = vec!["--rate", &rate, "--seconds", &seconds, "--warmup", &warmup];
    for c in classes {
        args.extend(["--class", c]);
    }
    with_machine_times(|| load(&envoy.url("/app"), &args))
}

/// `measure`'s result with what the machine did meanwhile under "machine": in every assertion's
/// message, whether the machine gave the time to something else.
fn with_machine_times(measure: impl FnOnce() -> Value) -> Value {
    let before = MachineTimes::now();
    let mut r = measure();
    r["machine"] = before.since().into();
    r
}

fn f(v: &Value, path: &[&str]) -> f64 {
    path.iter().fold(v, |v, k| &v[*k]).as_f64().unwrap_or(0.0)
}

fn status(v: &Value, class: &str, code: &str) -> f64 {
    f(v, &[class, "statuses", code])
}

const ADAPTIVE: &str = "app";

fn adaptive_rule() -> Value {
    json!({"name": ADAPTIVE, "algorithm": "adaptive", "match": {"path_prefix": "/app"}})
}

#[test]
fn adaptive_concurrency_keeps_goodput_and_latency_at_2x_and_5x_overload_and_lets_go_after() {
    let (_turn, _app, envoy) = start(
        json!({"rules": [adaptive_rule()]}),
        &["--capacity", "10", "--service-ms", "50"],
    );
    let unloaded = run(&envoy, 40.0, 2.0, 0.5, &[]);
    let base = f(&unloaded, &["all", "p50_ms"]);
    assert_eq!(status(&unloaded, "all", "503"), 0.0, "{unloaded}");
    for factor in [2.0, 5.0] {
        let r = run(&envoy, CAPACITY_RPS * factor, 7.0, 3.0, &[]);
        let (goodput, p99) = (f(&r, &["all", "ok_per_s"]), f(&r, &["all", "p99_ms"]));
        eprintln!(
            "{factor}x: goodput {goodput:.0}/s, p99 {p99:.0} ms (unloaded p50 {base:.0} ms): {r}"
        );
        assert!(
            goodput >= 0.7 * CAPACITY_RPS,
            "{factor}x: goodput {goodput}: {r}"
        );
        assert!(
            p99 <= 3.0 * base,
            "{factor}x: p99 {p99} ms, unloaded {base} ms: {r}"
        );
        assert!(status(&r, "all", "503") > 0.0, "nothing shed: {r}");
    }
    assert!(envoy.counter(ADAPTIVE, "limited") > 0);
    assert!(envoy.prometheus("tollgate_rule_estimate{tollgate_rule=\"app\"}") > 0);
    // Load back to half the capacity: after 2 s nothing is refused.
    let calm = run(&envoy, CAPACITY_RPS / 2.0, 4.0, 2.0, &[]);
    assert_eq!(status(&calm, "all", "503"), 0.0, "{calm}");
    assert_eq!(
        f(&calm, &["all", "ok"]),
        f(&calm, &["all", "sent"]),
        "{calm}"
    );
}

#[test]
fn under_overload_the_lowest_level_is_shed_first() {
    let (_turn, _app, envoy) = start(
        json!({
            "rules": [adaptive_rule()],
            "priorities": [{"name": "checkout", "match": {"headers": {"x-tier": "high"}},
                            "level": 3}]
        }),
        &["--capacity", "10", "--service-ms", "50"],
    );
    // 3x: 20% high, 80% of the default level.
    let r = run(
        &envoy,
        CAPACITY_RPS * 3.0,
        7.0,
        3.0,
        &["high:20:x-tier=high"],
    );
    eprintln!("priorities: {r}");
    let high_ok = f(&r, &["high", "ok"]) / f(&r, &["high", "sent"]);
    assert!(high_ok >= 0.95, "high level admitted {high_ok}: {r}");
    assert!(status(&r, "other", "503") > 0.0, "{r}");
    assert!(f(&r, &["all", "ok_per_s"]) >= 0.7 * CAPACITY_RPS, "{r}");
    // Per-level metrics (the warm-up included).
    let (high_allowed, high_shed) = (
        envoy.counter(ADAPTIVE, "level_3_allowed"),
        envoy.counter(ADAPTIVE, "level_3_shed"),
    );
    let low_shed = envoy.counter(ADAPTIVE, "level_1_shed");
    eprintln!("level 3: {high_allowed} allowed, {high_shed} shed; level 1: {low_shed} shed");
    assert!(high_allowed >= 480 && low_shed >= 1_000);
}

/// A `placement_secret` that puts the tenants `names` in distinct fairness flows: with the
/// random one of each process, two tenants share one of the 16 flows (and its part) in 1 run of 16.
fn secret_separating(names: &[&str]) -> String {
    use tollgate_core::slot::KeyPlacement;
    let flow = |secret: &str, name: &str| {
        let key = tollgate::key::encode_key(std::iter::once(Some(name.as_bytes())));
        KeyPlacement::from_secret(secret.as_bytes()).hash(&key)
            % tollgate_core::overload::adaptive::FLOWS as u128
    };
    (0..)
        .map(|n| format!("flows-apart-secret-{n}"))
        .find(|secret| {
            let flows: std::collections::HashSet<u128> =
                names.iter().map(|name| flow(secret, name)).collect();
            flows.len() == names.len()
        })
        .unwrap()
}

#[test]
fn flows_of_a_level_share_it_equally() {
    let (_turn, _app, envoy) = start(
        json!({"rules": [{"name": "app", "algorithm": "adaptive", "match": {"path_prefix": "/app"},
                          "adaptive": {"fair_key": ["header:x-tenant"]}}],
               "placement_secret": secret_separating(&["a", "b"])}),
        &["--capacity", "10", "--service-ms", "50"],
    );
    // 3x from two tenants, one sending 3 times as much as the other (both over half).
    let r = run(
        &envoy,
        CAPACITY_RPS * 3.0,
        7.0,
        3.0,
        &["a:75:x-tenant=a", "b:25:x-tenant=b"],
    );
    eprintln!("fairness: {r}");
    let (a, b) = (f(&r, &["a", "ok"]), f(&r, &["b", "ok"]));
    assert!(a / b < 1.3 && b / a < 1.3, "tenants a {a}, b {b}: {r}");
    assert!(f(&r, &["all", "ok_per_s"]) >= 0.7 * CAPACITY_RPS, "{r}");
}

#[test]
fn the_cpu_the_upstream_reports_is_the_signal() {
    let (_turn, _app, envoy) = start_reporting_cpu();
    // The gauge is read while the overload lasts: once the load stops, the upstream's last
    // answers report its queue draining (less and less in use), and the smoothed CPU follows.
    let done = std::sync::atomic::AtomicBool::new(false);
    let (r, samples) = std::thread::scope(|s| {
        let sampler = s.spawn(|| {
            let mut samples = Vec::new();
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                std::thread::sleep(std::time::Duration::from_millis(250));
                samples.push(envoy.prometheus_now("tollgate_rule_signal{tollgate_rule=\"app\"}"));
            }
            samples
        });
        let r = run(&envoy, CAPACITY_RPS * 3.0, 6.0, 3.0, &[]);
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        (r, sampler.join().unwrap())
    });
    eprintln!("cpu: {r}; signal samples {samples:?}");
    assert!(f(&r, &["all", "ok_per_s"]) >= 0.7 * CAPACITY_RPS, "{r}");
    assert!(f(&r, &["all", "p99_ms"]) <= 150.0, "{r}");
    // While overloaded (the second half of the run), the upstream reports its capacity in use
    // and more: the signal is that CPU, smoothed (thousandths).
    let mut overloaded = samples[samples.len() / 2..].to_vec();
    overloaded.sort_unstable();
    let median = overloaded[overloaded.len() / 2];
    assert!(median >= 800, "signal {samples:?}");
}

#[test]
fn the_success_rate_throttle_refuses_as_its_formula_says() {
    let (_turn, _app, envoy) = start(
        json!({"rules": [{"name": "flaky", "algorithm": "sre_throttle",
                          "match": {"path_prefix": "/app"},
                          "sre_throttle": {"k": 1.5, "window": "2s"},
                          "response": {"status": 429}}]}),
        &[
            "--capacity",
            "100",
            "--service-ms",
            "5",
            "--fail-percent",
            "50",
        ],
    );
    let r = load(
        &envoy.url("/app"),
        &["--rate", "200", "--seconds", "8", "--bucket-ms", "100"],
    );
    let timeline = r["timeline"].as_array().unwrap();
    let count = |b: &Value, k: &str| b[k].as_f64().unwrap_or(0.0);
    let sent = |b: &Value| {
        b.as_object()
            .unwrap()
            .values()
            .filter_map(Value::as_f64)
            .sum::<f64>()
    };
    // For each 100 ms after the first window, the formula over the 2 s before it: requests R
    // (every attempt), accepts A (the 200s); expected refusals = p × requests of the bucket.
    let (mut expected, mut refused, mut total) = (0.0, 0.0, 0.0);
    for i in 20..timeline.len() {
        let window = &timeline[i - 20..i];
        let requests: f64 = window.iter().map(sent).sum();
        let accepts: f64 = window.iter().map(|b| count(b, "200")).sum();
        let p = ((requests - 1.5 * accepts) / (requests + 1.0)).max(0.0);
        expected += p * sent(&timeline[i]);
        refused += count(&timeline[i], "429");
        total += sent(&timeline[i]);
    }
    eprintln!("throttle: refused {refused} of {total}, formula {expected:.0}");
    assert!(
        (refused - expected).abs() <= 0.03 * total,
        "refused {refused} of {total}, the formula says {expected:.0}: {r}"
    );
    assert!(expected > 0.5 * total, "{r}");
    assert!(envoy.counter("flaky", "limited") as f64 >= refused);
}

#[test]
fn a_dry_run_sheds_nothing_and_counts_what_it_would_shed() {
    let (_turn, _app, envoy) = start(
        json!({"rules": [{"name": "app", "algorithm": "adaptive", "match": {"path_prefix": "/app"},
                          "dry_run": true}]}),
        &["--capacity", "10", "--service-ms", "50"],
    );
    let r = run(&envoy, CAPACITY_RPS * 2.0, 4.0, 1.0, &[]);
    assert_eq!(status(&r, "all", "503"), 0.0, "{r}");
    assert_eq!(f(&r, &["all", "ok"]), f(&r, &["all", "sent"]), "{r}");
    let would = envoy.counter("app", "dry_run_limited");
    assert!(would > 0, "{r}");
    assert_eq!(envoy.counter("app", "limited"), 0);
}

/// Change the testbed upstream's service time or capacity while it runs.
fn set_upstream(app: &Upstream, what: &str) {
    let reply = crate::harness::Client::new()
        .get(&format!("http://127.0.0.1:{}/__set?{what}", app.port), &[]);
    assert_eq!(reply.status, 204);
}

/// Open-loop load at 300/s for `seconds` in 0.5 s buckets, changing the upstream at each of
/// `changes` (seconds after the start, what to set); the load generator's report.
fn load_while_changing(
    envoy: &Envoy,
    app: &Upstream,
    seconds: u64,
    changes: &[(u64, &str)],
) -> Value {
    let secs = seconds.to_string();
    with_machine_times(|| {
        std::thread::scope(|s| {
            let load = s.spawn(|| {
                load(
                    &envoy.url("/app"),
                    &["--rate", "300", "--seconds", &secs, "--bucket-ms", "500"],
                )
            });
            let mut at = 0;
            for &(when, what) in changes {
                std::thread::sleep(Duration::from_secs(when - at));
                set_upstream(app, what);
                at = when;
            }
            load.join().unwrap()
        })
    })
}

/// Over the timeline's buckets `from..to`: answers per second and the p99 response time (ms) of
/// the 200s, from buckets of `bucket_ms`.
fn window(timeline: &[Value], from: usize, to: usize, bucket_ms: u64) -> (f64, u64) {
    let mut ok: Vec<u64> = timeline[from..to]
        .iter()
        .flat_map(|b| {
            b["ok_ms"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap())
        })
        .collect();
    ok.sort_unstable();
    let per_s = ok.len() as f64 * 1_000.0 / ((to - from) as u64 * bucket_ms) as f64;
    (per_s, ok.get(ok.len() * 99 / 100).copied().unwrap_or(0))
}

#[test]
fn a_slower_then_faster_upstream_is_followed_within_seconds() {
    // 10 at once, 50 ms (200/s), offered 300/s. At 6 s the service time doubles (100/s), at 14 s
    // it is back to 50 ms. From 3 s after each change: goodput at least half the new capacity
    // and p99 within 2.5 times the new service time. (The bug this guards against gave 20/s for
    // 15 s; measured figures, which vary with the machine, are in docs/algorithms.md — bounds at
    // twice the service time and 80% failed on this 2-core machine without a change of code.)
    // Once fast again: the p99 of before the slowdown, within a quarter.
    let (_turn, app, envoy) = start(
        json!({"rules": [adaptive_rule()]}),
        &["--capacity", "10", "--service-ms", "50"],
    );
    let bucket_ms = 500;
    let r = load_while_changing(
        &envoy,
        &app,
        22,
        &[(6, "service_ms=100"), (14, "service_ms=50")],
    );
    let timeline = r["timeline"].as_array().unwrap();
    let per_s: Vec<String> = timeline
        .iter()
        .map(|b| {
            format!(
                "{}:{}",
                b["200"].as_u64().unwrap_or(0) * 2,
                b["503"].as_u64().unwrap_or(0) * 2
            )
        })
        .collect();
    eprintln!("ok:refused per second, by 0.5 s: {per_s:?}");
    let (before, before_p99) = window(timeline, 6, 12, bucket_ms);
    let (slow, slow_p99) = window(timeline, 18, 28, bucket_ms);
    let (fast, fast_p99) = window(timeline, 34, 44, bucket_ms);
    eprintln!(
        "50 ms: {before:.0}/s p99 {before_p99} ms; 100 ms (from 3 s after): {slow:.0}/s p99 \
         {slow_p99} ms; 50 ms again (from 3 s after): {fast:.0}/s p99 {fast_p99} ms"
    );
    assert!(
        slow >= 50.0 && slow_p99 <= 250,
        "slow: {slow}/s, p99 {slow_p99} ms"
    );
    // Back to what it was before the slowdown, measured in the same run: the p99 at 50 ms is
    // itself about 2.5 times the service time here (91-149 ms over runs), so a fixed 125 ms
    // failed one run in several whatever the rule did (a run kept: 127 ms before, 149 after).
    assert!(
        fast >= 100.0 && fast_p99 <= before_p99 * 5 / 4 + 10,
        "fast again: {fast}/s, p99 {fast_p99} ms (before the slowdown: {before_p99} ms)"
    );
}

#[test]
fn shedding_stops_once_the_upstream_reports_room() {
    // 10 at once, 50 ms, reporting its CPU; offered 300/s (1.5×). At 4 s it scales out to 20
    // (400/s): it reports 75% and less, but now and then a burst of arrivals puts it at 80% for
    // a moment, and the rule sheds as the upstream then says. Two seconds later little is
    // refused: at most 5% (the bug this guards against refused 11–26% there, in every
    // half-second). How much depends on the machine: on this VM, 10 runs of 2026-12-03 refused
    // 0–5 of 1 200 with 0.5–2.7 s of the 20 CPU-seconds stolen by the hypervisor, 14–22 with
    // 5 s stolen (the load generator, descheduled, sends its late requests at once: a burst at
    // the threshold); one run of 58 (4.8%) before steal was printed.
    let (_turn, app, envoy) = start_reporting_cpu();
    let r = load_while_changing(&envoy, &app, 10, &[(4, "capacity=20")]);
    let timeline = r["timeline"].as_array().unwrap();
    let refused: Vec<u64> = timeline
        .iter()
        .map(|b| b["503"].as_u64().unwrap_or(0))
        .collect();
    eprintln!("refused by 0.5 s: {refused:?}; {}", r["machine"]);
    assert!(
        refused[2..8].iter().sum::<u64>() > 0,
        "it shed while overloaded"
    );
    let late: u64 = refused[12..].iter().sum();
    let answered: u64 = timeline[12..]
        .iter()
        .map(|b| b["200"].as_u64().unwrap_or(0) + b["503"].as_u64().unwrap_or(0))
        .sum();
    assert!(
        late * 100 <= 5 * answered,
        "refused {late} of {answered} from 2 s after the upstream scaled out: {refused:?}; {}",
        r["machine"]
    );
}
