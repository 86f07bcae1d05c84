#!/usr/bin/env python3
"""A quota service that loses its state under load, before and after issue 33 item 2: what the fleet
admits around the loss. Draws docs/store-loss.png.

The scenario of the Envoy test `a_quota_service_that_lost_its_state_under_load_serves_the_limit_again_at_once`
(tests/envoy/fleet.rs): two Envoys (`--concurrency 2`) with one global token_bucket rule of 50 requests
a second (burst 50) leased from one `tollgate-quota` on the memory store (default flags),
`failure_mode: deny`, `instances_hint: 2`, calls timing out after 200 ms. Each Envoy is sent 50
requests a second over two keep-alive connections (the fleet's demand is twice the limit; the four
connections are spaced 10 ms apart). `--kill-at` seconds in, the quota service is SIGKILLed and
started again on the same port `--outage` later (it forgot everything); the load goes on to
`--seconds` (by default 16 s: past a lease TTL, 10 s, after the restart). Every request's send
time, answer time and status is recorded.

Each variant (`after`: this tree's `make build quota`; `before`: the module and service given by
`--before-module` and `--before-quota`) is run `--runs` times, interleaved, each once the machine's
load average is below its cores (or after a minute); the chart shows the run whose admissions in the
3 s after the restart are the median of its variant's (`--pick` chooses another). Measurements go to
target/store-loss.json; `--plot-only` redraws from it. The chart needs matplotlib (`make bench`
installs it in .venv).

    .venv/bin/python bench/store_loss.py --before-module /path/to/old/tollgate.wasm \\
        --before-quota /path/to/old/tollgate-quota      # measure both, then draw
    .venv/bin/python bench/store_loss.py --plot-only    # redraw from target/store-loss.json

Not part of `make test` or `make bench`. The load is light (100 requests a second, loopback only).
"""
import argparse
import http.client
import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, EnvoyServer, Proc, free_port, quota_cluster, wait_http, wait_port, wasm_filter  # noqa: E402
from sections import quiet_machine  # noqa: E402

RATE, BURST = 50, 50  # the rule: 50 requests a second, burst 50
PER_ENVOY = 50.0  # requests a second sent to each Envoy
CONNECTIONS = 2  # per Envoy
BUCKET_MS = 100
RESULTS = REPO / "target/store-loss.json"
CHART = REPO / "docs/store-loss.png"
COLORS = {"before": "#7f7f7f", "after": "#d62728"}


def plugin():
    return {"rules": [{"name": "r", "scope": "global", "limit": {"requests": RATE, "per": "1s"}}],
            "quota_service": {"upstream": "quota", "timeout": "200ms", "failure_mode": "deny",
                              "instances_hint": 2}}


def load(port, offsets_ms, t0, seconds, out):
    """One thread per offset: a keep-alive connection to `port` sending a request every
    CONNECTIONS / PER_ENVOY s from t0 + offset until `seconds` (open loop while answers come in time).
    Appends [sent_ms, answered_ms, status] to `out` (status 0: the connection failed)."""
    gap = CONNECTIONS / PER_ENVOY

    def one(offset_ms):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        due = t0 + offset_ms / 1000
        mine = []
        while due < t0 + seconds:
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            sent = time.monotonic()
            try:
                conn.request("GET", "/")
                reply = conn.getresponse()
                reply.read()
                status = reply.status
            except (OSError, http.client.HTTPException):
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                status = 0
            mine.append([round((sent - t0) * 1000, 2), round((time.monotonic() - t0) * 1000, 2), status])
            due += gap
        conn.close()
        out.extend(mine)

    threads = [threading.Thread(target=one, args=(o,)) for o in offsets_ms]
    for t in threads:
        t.start()
    return threads


def scenario(module, quota_bin, seconds, kill_at, outage):
    """One run: the requests (sorted by send time, ms after the load began), when the service was
    killed and when it accepted connections again (ms)."""
    env = {**os.environ, "RUST_LOG": "warn"}
    port = free_port()
    args = [str(quota_bin), "--listen", f"127.0.0.1:{port}"]
    quota = Proc(args, env=env)
    envoys = []
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz")
        filters = [wasm_filter(module, plugin())]
        envoys = [EnvoyServer(filters, [quota_cluster(port)], concurrency=2, pin=False) for _ in range(2)]
        sent = []
        t0 = time.monotonic() + 0.2
        gap_ms = 1000 * CONNECTIONS / PER_ENVOY
        # The fleet's four connections evenly spaced: Envoy e's connection c at (2c + e) × 10 ms.
        threads = []
        for e, envoy in enumerate(envoys):
            offsets = [(c * len(envoys) + e) * gap_ms / (CONNECTIONS * len(envoys)) for c in range(CONNECTIONS)]
            threads += load(envoy.port, offsets, t0, seconds, sent)
        time.sleep(max(0.0, t0 + kill_at - time.monotonic()))
        killed = (time.monotonic() - t0) * 1000
        os.killpg(quota.p.pid, signal.SIGKILL)
        quota.p.wait()
        time.sleep(max(0.0, killed / 1000 + outage - (time.monotonic() - t0)))
        quota = Proc(args, env=env)
        wait_port(port, timeout=30)
        back = (time.monotonic() - t0) * 1000
        for t in threads:
            t.join()
    finally:
        for envoy in envoys:
            envoy.stop()
        quota.stop()
    sent.sort()
    return {"requests": sent, "killed_ms": round(killed, 1), "back_ms": round(back, 1)}


def admitted(requests, from_ms, until_ms, field=0):
    return sum(1 for r in requests if r[2] == 200 and from_ms <= r[field] < until_ms)


def summary(run, seconds):
    """The figures of one run (times by when requests were sent; the bound also by when answered)."""
    reqs, back, killed = run["requests"], run["back_ms"], run["killed_ms"]
    end = seconds * 1000

    def excess(field):
        # The most the admissions up to a moment ever exceeded burst + rate × t (t from the load's
        # start), and when (ms after the restart).
        worst, at, count = float("-inf"), 0.0, 0
        for r in sorted((r for r in reqs if r[2] == 200), key=lambda r: r[field]):
            count += 1
            over = count - (BURST + RATE * r[field] / 1000)
            if over > worst:
                worst, at = over, r[field] - back
        return round(worst, 1), round(at)

    statuses = {}
    for r in reqs:
        statuses[str(r[2])] = statuses.get(str(r[2]), 0) + 1
    steady_from = 1000.0  # the leases settled: from 1 s in to the kill
    return {
        "first_second": [admitted(reqs, back + t, back + t + BUCKET_MS) for t in range(0, 1000, BUCKET_MS)],
        "three_seconds": admitted(reqs, back, back + 3000),
        "outage": admitted(reqs, killed, back),
        "steady_per_s": round(admitted(reqs, steady_from, killed) / ((killed - steady_from) / 1000), 1),
        "after_1s_per_s": round(admitted(reqs, back + 1000, end) / ((end - back - 1000) / 1000), 1),
        "total": admitted(reqs, 0, end),
        "bound_at_end": BURST + RATE * seconds,
        "excess_sent": excess(0),
        "excess_answered": excess(1),
        "slowest_ms": round(max(r[1] - r[0] for r in reqs), 1),
        "statuses": statuses,
    }


def pick(runs, index):
    """The run to draw: `index` if given, else the median one by admissions in the 3 s after the restart."""
    if index is not None:
        return index
    order = sorted(range(len(runs)), key=lambda i: runs[i]["summary"]["three_seconds"])
    return order[(len(order) - 1) // 2]


def chart(results, choice, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no chart")
        return

    fig, (rate_ax, cum_ax) = plt.subplots(1, 2, figsize=(10, 5), gridspec_kw={"width_ratios": [3, 2]})
    seconds = results["seconds"]
    outages = []
    for label in ("before", "after"):
        runs = results["variants"].get(label)
        if not runs:
            continue
        run = runs[choice[label]]
        reqs, back = run["requests"], run["back_ms"]
        outages.append((run["killed_ms"] - back) / 1000)
        # Buckets aligned on the restart.
        first = -int(back // BUCKET_MS)
        last = int((seconds * 1000 - back) // BUCKET_MS)
        starts = [back + k * BUCKET_MS for k in range(first, last)]
        t = [(s - back) / 1000 for s in starts]
        counts = [admitted(reqs, s, s + BUCKET_MS) for s in starts]
        s = run["summary"]
        name = results.get("labels", {}).get(label, label)
        width = 1.8 if label == "after" else 1.4
        rate_ax.step(t + [t[-1] + BUCKET_MS / 1000], counts + [counts[-1]], where="post", color=COLORS[label],
                     linewidth=width, label=f"{name}: {s['three_seconds']} admitted in the 3 s after the restart")
        ok = sorted(r[0] for r in reqs if r[2] == 200)
        cum_ax.step([(x - back) / 1000 for x in ok], range(1, len(ok) + 1), where="post", color=COLORS[label],
                    linewidth=width, label=name)
        if label == "after":
            bound_t = [-back / 1000, (seconds * 1000 - back) / 1000]
            cum_ax.plot(bound_t, [BURST, BURST + RATE * seconds], color="black", linestyle=":",
                        label=f"bound: {BURST} + {RATE} × t")
    rate_ax.axhline(RATE * BUCKET_MS / 1000, color="black", linestyle=":",
                    label=f"the limit's rate ({RATE * BUCKET_MS // 1000} per {BUCKET_MS} ms, {RATE * 3} in 3 s)")
    killed = min(outages)
    for ax in (rate_ax, cum_ax):
        ax.axvspan(killed, 0, color="black", alpha=0.12, linewidth=0)
        ax.axvline(killed, color="black", alpha=0.5, linewidth=0.8)
        ax.axvline(0, color="black", alpha=0.5, linewidth=0.8)
        ax.grid(alpha=0.3)
        ax.set_xlabel("seconds from the quota service's restart")
    # The steady state before the loss, not the first burst of the run (the right panel has it).
    rate_ax.set_xlim(killed - 2, (seconds * 1000 - min(r["back_ms"] for runs in results["variants"].values()
                                                        for r in runs)) / 1000)
    rate_ax.set_ylim(0, 12)
    rate_ax.text(killed, 11.6, "killed ", ha="right", va="top", fontsize=8)
    rate_ax.text(0, 11.6, " restarted", ha="left", va="top", fontsize=8)
    rate_ax.set_ylabel(f"requests admitted per {BUCKET_MS} ms (both Envoys)")
    rate_ax.legend(loc="lower center", bbox_to_anchor=(0.58, 0.06), fontsize=8)
    rate_ax.set_title(f"admitted per {BUCKET_MS} ms", fontsize=10)
    cum_ax.set_ylabel("requests admitted since the load began")
    cum_ax.set_title("cumulative, against burst + rate × t", fontsize=10)
    cum_ax.legend(loc="upper left", fontsize=8)
    fig.suptitle(f"A memory quota service killed under load: 2 Envoys × {PER_ENVOY:g}/s on a global limit of "
                 f"{RATE}/s (burst {BURST}), failure_mode: deny", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before-module", type=Path, help="the module from before the fix")
    ap.add_argument("--before-quota", type=Path, help="the quota service from before the fix")
    ap.add_argument("--after-module", type=Path, default=REPO / "dist/tollgate.wasm")
    ap.add_argument("--after-quota", type=Path, default=REPO / "target/debug/tollgate-quota")
    ap.add_argument("--runs", type=int, default=3, help="runs of each variant, interleaved")
    ap.add_argument("--seconds", type=float, default=16.0,
                    help="how long the load lasts (past a lease TTL, 10 s, after the restart)")
    ap.add_argument("--kill-at", type=float, default=4.0, help="when the service is killed (s)")
    ap.add_argument("--outage", type=float, default=0.3, help="how long it stays down (s)")
    ap.add_argument("--pick", type=int, help="the run to draw (0-based) instead of the median")
    ap.add_argument("--before-label", default="before", help="the before series' name in the chart")
    ap.add_argument("--after-label", default="after", help="the after series' name in the chart")
    ap.add_argument("--results", type=Path, default=RESULTS, help="where the measurements are kept")
    ap.add_argument("--chart", type=Path, default=CHART)
    ap.add_argument("--plot-only", action="store_true", help="redraw from --results")
    args = ap.parse_args()
    if args.plot_only:
        results = json.loads(args.results.read_text())
    else:
        variants = {"after": (args.after_module, args.after_quota)}
        if args.before_module and args.before_quota:
            variants = {"before": (args.before_module, args.before_quota), **variants}
        results = {"seconds": args.seconds, "kill_at": args.kill_at, "outage": args.outage,
                   "labels": {"before": args.before_label, "after": args.after_label},
                   "variants": {label: [] for label in variants}}
        for n in range(args.runs):
            for label, (module, quota_bin) in variants.items():
                load_before = quiet_machine(within_s=60)
                run = scenario(module.resolve(), quota_bin.resolve(), args.seconds, args.kill_at, args.outage)
                run["summary"] = summary(run, args.seconds)
                run["load"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
                results["variants"][label].append(run)
                s = run["summary"]
                print(f"{label} run {n}: load {run['load']}, restarted at {run['back_ms']:.0f} ms; first second "
                      f"{s['first_second']}; {s['three_seconds']} in 3 s; steady {s['steady_per_s']}/s; over the "
                      f"bound by {s['excess_sent'][0]} at most; statuses {s['statuses']}", flush=True)
        args.results.parent.mkdir(exist_ok=True)
        args.results.write_text(json.dumps(results))
    choice = {label: pick(runs, args.pick) for label, runs in results["variants"].items()}
    for label, runs in results["variants"].items():
        for n, run in enumerate(runs):
            mark = "*" if n == choice[label] else " "
            print(f"{mark} {label} {n}: {json.dumps(run['summary'])}")
        median = statistics.median(r["summary"]["three_seconds"] for r in runs)
        print(f"  {label}: admitted in the 3 s after the restart, median of the runs {median}")
    chart(results, choice, args.chart)


if __name__ == "__main__":
    main()
