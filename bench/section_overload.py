"""Overload protection against a testbed upstream: shedding, a capacity change, slowdowns.

Part of `make bench` (`bench/sections.py` lists the sections)."""
import fcntl
import json
import os
import statistics
import subprocess
import tempfile
import time
import urllib.request

import harness
from section_common import TESTBED, tollgate_module, upstream_cluster
from harness import (TOLLGATE, EnvoyServer, Proc, free_port, wasm_filter)


CAPACITY_RPS = 200  # the upstream: 10 at once × 50 ms


def adaptive_concurrency():
    """Envoy's native adaptive_concurrency (gradient controller), at its documented defaults apart from
    a 100 ms update interval (the default) and minRTT measured every 60 s over 50 requests."""
    return {"name": "envoy.filters.http.adaptive_concurrency", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.adaptive_concurrency.v3.AdaptiveConcurrency",
        "gradient_controller_config": {
            "sample_aggregate_percentile": {"value": 50},
            "concurrency_limit_params": {"concurrency_update_interval": "0.1s"},
            "min_rtt_calc_params": {"interval": "60s", "request_count": 50}}}}


def testbed_load(url, rate, seconds, warmup=0.0, classes=()):
    args = [str(TESTBED), "load", "--url", url, "--rate", str(rate), "--seconds", str(seconds),
            "--warmup", str(warmup)]
    for c in classes:
        args += ["--class", c]
    return json.loads(subprocess.run(args, check=True, capture_output=True, text=True).stdout)


def overload(seconds=7, warmup=3, rounds=3, factors=(2, 3, 5)):
    """An upstream with a capacity (tollgate-testbed: 10 at once × 50 ms, 200/s; queues the rest)
    behind Envoy (2 workers) with no protection, tollgate's adaptive rule (latency signal, and the
    upstream's ORCA CPU report), and Envoy's adaptive_concurrency; open-loop load at 2×, 3× and 5×
    its capacity. Each run gets a fresh upstream and Envoy, an unloaded baseline (40/s for 2 s), then
    the load; figures from after the warm-up; medians over rounds."""
    rule = {"name": "app", "algorithm": "adaptive"}
    setups = {
        "no protection": ([], None, []),
        "tollgate adaptive (latency)": ([wasm_filter(TOLLGATE, {"rules": [rule]})], None, []),
        "tollgate adaptive (ORCA CPU)": (
            [wasm_filter(TOLLGATE, {"rules": [{**rule, "adaptive": {"cpu": {"header": "endpoint-load-metrics"}}}]})],
            "endpoint-load-metrics", []),
        "Envoy adaptive_concurrency": ([adaptive_concurrency()], None, []),
        "tollgate adaptive, 20% at level 3": (
            [wasm_filter(TOLLGATE, {"rules": [rule], "priorities": [
                {"name": "high", "match": {"headers": {"x-tier": "high"}}, "level": 3}]})],
            None, ["high:20:x-tier=high"]),
    }
    runs = {}
    for r in range(rounds):
        for name, (filters, cpu_header, classes) in setups.items():
            for factor in factors:
                if classes and factor != 3:
                    continue
                port = free_port()
                args = [str(TESTBED), "upstream", "--port", str(port), "--capacity", "10", "--service-ms", "50"]
                if cpu_header:
                    args += ["--cpu-header", cpu_header]
                app = Proc(args)
                harness.wait_port(port)
                envoy = EnvoyServer(filters, [upstream_cluster(port)], concurrency=2, pin=False, upstream="app")
                try:
                    base = testbed_load(envoy.url, 40, 2, 0.5)["all"]["p50_ms"]
                    out = testbed_load(envoy.url, CAPACITY_RPS * factor, seconds, warmup, classes)
                finally:
                    envoy.stop()
                    app.stop()
                a = out["all"]
                m = {"goodput": a["ok_per_s"], "p99_ms": a["p99_ms"], "p50_ms": a["p50_ms"], "base_ms": base,
                     "refused": sum(n for s, n in a["statuses"].items() if s != "200") / max(a["sent"], 1),
                     "errors": a["errors"]}
                if "high" in out:
                    m["high_admitted"] = out["high"]["ok"] / max(out["high"]["sent"], 1)
                    m["low_admitted"] = out["other"]["ok"] / max(out["other"]["sent"], 1)
                runs.setdefault((name, factor), []).append(m)
                print(f"overload round {r + 1}, {name}, {factor}x: goodput {m['goodput']:.0f}/s, "
                      f"p99 {m['p99_ms']:.0f} ms (unloaded {base:.0f}), refused {m['refused']:.0%}", flush=True)
    return [{"setup": name, "factor": factor, "rounds": len(ms),
             **{f: statistics.median(x[f] for x in ms) for f in ms[0]}}
            for (name, factor), ms in runs.items()]


def changing_upstream(filters, rate, seconds, bucket_ms, changes):
    """A fresh upstream (10 at once, 50 ms) behind a fresh Envoy (2 workers) with `filters`, under an
    open-loop load of `rate`/s for `seconds`; at each of `changes` (seconds from the start, service
    time in ms) the upstream's service time changes. Goodput and p99 of the 200s, and refusals, per
    `bucket_ms`, by when requests were due."""
    port = free_port()
    app = Proc([str(TESTBED), "upstream", "--port", str(port), "--capacity", "10", "--service-ms", "50"])
    harness.wait_port(port)
    envoy = EnvoyServer(filters, [upstream_cluster(port)], concurrency=2, pin=False, upstream="app")
    load = subprocess.Popen([str(TESTBED), "load", "--url", envoy.url, "--rate", str(rate),
                             "--seconds", str(seconds), "--bucket-ms", str(bucket_ms)],
                            stdout=subprocess.PIPE, text=True)
    try:
        started = time.monotonic()
        for at, ms in changes:
            time.sleep(max(0.0, started + at - time.monotonic()))
            urllib.request.urlopen(f"http://127.0.0.1:{port}/__set?service_ms={ms}", timeout=5).read()
        result = json.loads(load.communicate()[0])
    finally:
        envoy.stop()
        app.stop()
    timeline = []
    for i, b in enumerate(result["timeline"]):
        ok = sorted(b.get("ok_ms", []))
        timeline.append({"t": i * bucket_ms / 1000, "goodput": len(ok) * 1000 / bucket_ms,
                         "p99_ms": ok[len(ok) * 99 // 100] if ok else None,
                         "refused": sum(v for k, v in b.items() if k not in ("200", "ok_ms")) * 1000 / bucket_ms})
    return timeline


def capacity_change(rate=300, seconds=22, slow_at=6, fast_at=14, bucket_ms=500):
    """The same upstream (10 at once) whose service time goes 50 → 100 → 50 ms under a constant
    open-loop load of 300/s (1.5×, then 3×, then 1.5× its capacity), behind tollgate's adaptive rule
    and behind Envoy's adaptive_concurrency: goodput and p99 of the 200s per half second."""
    setups = {
        "tollgate adaptive (latency)": [wasm_filter(TOLLGATE, {"rules": [{"name": "app", "algorithm": "adaptive"}]})],
        "Envoy adaptive_concurrency": [adaptive_concurrency()],
    }
    out = {}
    for name, filters in setups.items():
        out[name] = changing_upstream(filters, rate, seconds, bucket_ms, ((slow_at, 100), (fast_at, 50)))
        print(f"capacity change, {name}: " + " ".join(f"{x['goodput']:.0f}" for x in out[name]), flush=True)
    return {"rate": rate, "slow_at": slow_at, "fast_at": fast_at, "bucket_ms": bucket_ms, "setups": out}


def machine_lock(name):
    """The lock the Envoy tests take (testkit's MachineLock, a flock in the temporary directory): one
    timed load at a time on the machine, across worktrees. Held until the returned file is closed."""
    lock = open(os.path.join(tempfile.gettempdir(), f"tollgate-tests-{name}.lock"), "a")
    fcntl.flock(lock, fcntl.LOCK_EX)
    return lock


def quiet_machine(cores=2, within_s=300):
    """Wait (up to `within_s`) until the machine's 1-minute load average is below its cores: other
    work on a shared machine starves the upstream and the proxy, and a timed run would measure that.
    The load average when it stopped waiting."""
    deadline = time.monotonic() + within_s
    while os.getloadavg()[0] >= cores and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def slowdowns(runs=20, rate=300, seconds=12, slow_at=4, bucket_ms=500):
    """Issue 33's scenario, `runs` times: the upstream (10 at once) under 300/s whose service time goes
    from 50 to 100 ms (capacity 200/s to 100/s) `slow_at` s in, behind tollgate's adaptive rule (latency
    signal), a fresh upstream and Envoy each run (each once the machine is quiet, under the Envoy
    tests' machine lock). Per run, from the change to the end: the least goodput of any half-second and of
    any second (by when requests were due), the half-seconds below half the new capacity, and the
    machine's load average before and after."""
    module = tollgate_module()
    filters = [wasm_filter(module, {"rules": [{"name": "app", "algorithm": "adaptive"}]})]
    first, end = int(slow_at * 1000 / bucket_ms), int(seconds * 1000 / bucket_ms)
    out = []
    for r in range(runs):
        load_before = quiet_machine()
        with machine_lock("overload"):
            timeline = changing_upstream(filters, rate, seconds, bucket_ms, ((slow_at, 100),))
        after = [b["goodput"] for b in timeline[first:end]]
        seconds_after = [(a + b) / 2 for a, b in zip(after[0::2], after[1::2])]
        run = {"goodput": [b["goodput"] for b in timeline[:end]],
               "refused": [b["refused"] for b in timeline[:end]], "least_half": min(after),
               "least_second": min(seconds_after), "halves_below": sum(g < 50 for g in after),
               "load": [round(load_before, 1), round(os.getloadavg()[0], 1)]}
        out.append(run)
        print(f"slowdown run {r + 1} (load {run['load'][0]} → {run['load'][1]}): least {run['least_half']:.0f}/s "
              f"per half-second, {run['least_second']:.0f}/s per second; after the change: "
              + " ".join(f"{g:.0f}" for g in after), flush=True)
    return {"rate": rate, "seconds": seconds, "slow_at": slow_at, "bucket_ms": bucket_ms,
            "module": str(module.relative_to(harness.REPO)) if module.is_relative_to(harness.REPO) else str(module),
            "runs": out}


# ---------------------------------------------------------------- token budgets: reserve then settle
