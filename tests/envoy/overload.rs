//! Overload protection against an upstream with a capacity (tollgate-testbed): adaptive
//! concurrency at 2× and 5× its capacity, priorities, fairness between flows, the success-rate
//! throttle. The bounds here are loose on purpose (a 2-core machine shared with the load); the
//! measured figures are in docs/benchmarks.md (`bench/run.py --sections overload`).

use crate::harness::{load, Envoy, Options, Upstream};
use serde_json::{json, Value};

/// The upstream: 10 at once, 50 ms each (200 requests/s).
const CAPACITY_RPS: f64 = 200.0;

fn start(plugin: Value, upstream: &[&str]) -> (Upstream, Envoy) {
    let app = Upstream::start(upstream);
    let envoy = Envoy::start_with(
        &plugin,
        &Options {
            app_port: Some(app.port),
            ..Options::default()
        },
    );
    (app, envoy)
}

fn run(envoy: &Envoy, rate: f64, seconds: f64, warmup: f64, classes: &[&str]) -> Value {
    let (rate, seconds, warmup) = (rate.to_string(), seconds.to_string(), warmup.to_string());
    let mut args = vec!["--rate", &rate, "--seconds", &seconds, "--warmup", &warmup];
    for c in classes {
        args.extend(["--class", c]);
    }
    load(&envoy.url("/app"), &args)
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
    let (_app, envoy) = start(
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
