"""The parts of `make bench` beyond cost per request: accuracy at 2 workers and across proxies,
memory against distinct keys, the quota service's throughput, where tollgate's time goes, overload,
token budgets (reserve then settle against charging after the response), and bandwidth per key
(tollgate's byte limit against nginx's limit_rate and Envoy's bandwidth_limit).
Each function returns plain rows for results.json and the report."""
import asyncio
import fcntl
import json
import os
import math
import random
import re
import socket
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import harness
from harness import (HUGE, QUOTA, TOLLGATE, TOLLGATE_PROBE, HOST_PROBE, EnvoyServer, Proc, free_port,
                 parse_wrk, quota_cluster, tollgate_plugin, wait_http, wasm_filter, wrk, wrk_args)


def wrk_together(urls, seconds, connections=64, lua=None, pin=False):
    """wrk against every url at once (by default not pinned: proxies with several workers use both
    cores), each with the `lua` script if given."""
    procs = []
    for url in urls:
        args, script = wrk_args(url, seconds, connections, lua=lua, pin=pin)
        procs.append((subprocess.Popen(args, stdout=subprocess.PIPE, text=True), script))
    out = []
    for p, script in procs:
        text, _ = p.communicate(timeout=seconds + 30)
        if script:
            os.unlink(script.name)
        out.append(parse_wrk(text))
    return out


def answered_2xx(server):
    """Requests the proxy answered 200 (Envoy's own count, independent of the filter's)."""
    return server.stat("http.bench.downstream_rq_2xx")


def workers_used(server):
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.admin}/stats?filter=worker_.*downstream_cx_total",
                                  timeout=5).read().decode()
    return sum(1 for line in text.splitlines() if line.startswith("listener.") and int(line.split(": ")[1]) > 0)


# ---------------------------------------------------------------- accuracy

DAY = {"requests": 1000, "per": "1d"}
BURSTS = [
    ("token bucket (worker stashes on)", {"limit": DAY}, 1000),
    ("token bucket, `worker_batch: 0`", {"limit": DAY, "worker_batch": 0}, 1000),
    ("fixed window", {"algorithm": "fixed_window", "limit": DAY}, 1000),
    ("sliding window", {"algorithm": "sliding_window", "limit": DAY}, 1000),
    ("leaky bucket, burst 999, nodelay", {"algorithm": "leaky_bucket", "limit": {"requests": 1, "per": "1d"},
                                          "burst": 999, "delay": "nodelay"}, 1000),
]
RATE = {"requests": 500, "per": "1s"}
RATES = [
    ("token bucket 500/s (burst 500)", {"limit": RATE}, lambda t: 500 + 500 * t),
    ("token bucket 500/s, `worker_batch: 0`", {"limit": RATE, "worker_batch": 0}, lambda t: 500 + 500 * t),
    ("leaky bucket 500/s, burst 100, nodelay", {"algorithm": "leaky_bucket", "limit": RATE, "burst": 100,
                                                "delay": "nodelay"}, lambda t: 101 + 500 * t),
]


class SlowUpstream:
    """An HTTP/1.1 upstream that answers after `delay` seconds and records the most requests it
    held at once: an independent view of a concurrency limit."""

    def __init__(self, delay=0.05):
        self.port, self.inflight, self.most = free_port(), 0, 0
        self.loop = asyncio.new_event_loop()

        async def handle(reader, writer):
            try:
                while True:
                    await reader.readuntil(b"\r\n\r\n")
                    self.inflight += 1
                    self.most = max(self.most, self.inflight)
                    await asyncio.sleep(delay)
                    self.inflight -= 1
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nok\n")
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
                pass
            finally:
                try:
                    writer.close()
                except RuntimeError:  # the loop is gone: the benchmark is over
                    pass

        async def start():
            self.server = await asyncio.start_server(handle, "127.0.0.1", self.port)

        self.loop.run_until_complete(start())
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)


def accuracy(quota_port, quota_redis_ports, seconds=3):
    rows = []
    for name, rule, expected in BURSTS + RATES:
        plugin = tollgate_plugin(0, rule_extra=rule)
        server = EnvoyServer([wasm_filter(TOLLGATE, plugin)], concurrency=2, pin=False)
        try:
            r = wrk_together([server.url], seconds)[0]
            ok, workers = answered_2xx(server), workers_used(server)
        finally:
            server.stop()
        want = expected if isinstance(expected, int) else expected(r["seconds"])
        rows.append({"case": name, "admitted": ok, "expected": round(want), "workers": workers,
                     "requests": r["requests"], "seconds": r["seconds"]})
        print(f"accuracy {name}: {ok} admitted, expected {want:.0f}, {workers} workers", flush=True)

    slow = SlowUpstream()
    cluster = {"name": "slow", "type": "STATIC", "connect_timeout": "1s",
               "load_assignment": {"cluster_name": "slow", "endpoints": [{"lb_endpoints": [{"endpoint": {
                   "address": {"socket_address": {"address": "127.0.0.1", "port_value": slow.port}}}}]}]}}
    plugin = tollgate_plugin(0, rule_extra={"algorithm": "concurrency", "limit": {"concurrent": 10}})
    server = EnvoyServer([wasm_filter(TOLLGATE, plugin)], [cluster], concurrency=2, pin=False, upstream="slow")
    try:
        r = wrk_together([server.url], seconds)[0]
        workers = workers_used(server)
    finally:
        server.stop()
        slow.stop()
    rows.append({"case": "concurrency 10 (upstream holds each request 50 ms)", "admitted": slow.most,
                 "expected": 10, "workers": workers, "requests": r["requests"], "seconds": r["seconds"],
                 "note": "most requests in flight at the upstream at once"})
    print(f"accuracy concurrency: {slow.most} at once at the upstream", flush=True)

    for name, ports in (("global, 3 Envoys, quota service in memory", [quota_port] * 3),
                        ("global, 3 Envoys, 2 quota replicas on one Redis", [quota_redis_ports[0], quota_redis_ports[1],
                                                                            quota_redis_ports[0]])):
        rule = "g" + str(abs(hash(name)) % 10000)
        plugin = tollgate_plugin(1000, scope="global", per="1d", rule_extra={"name": rule})
        plugin["quota_service"]["instances_hint"] = 3
        envoys = [EnvoyServer([wasm_filter(TOLLGATE, plugin)], [quota_cluster(p)], pin=False) for p in ports]
        try:
            results = wrk_together([e.url for e in envoys], seconds, connections=32)
            ok = sum(answered_2xx(e) for e in envoys)
            calls = sum(e.stat("wasmcustom.tollgate.quota.calls") for e in envoys)
        finally:
            for e in envoys:
                e.stop()
        rows.append({"case": name, "admitted": ok, "expected": 1000, "workers": 3,
                     "requests": sum(r["requests"] for r in results), "seconds": results[0]["seconds"],
                     "note": f"{calls} quota calls"})
        print(f"accuracy {name}: {ok} admitted, {calls} calls", flush=True)
    return rows


# ---------------------------------------------------------------- memory

def native_keyed(max_keys):
    """Envoy's local_ratelimit with one bucket per `x-key` value, up to `max_keys` buckets."""
    action = {"request_headers": {"header_name": "x-key", "descriptor_key": "key"}}
    return harness.native_local_ratelimit(HUGE, action, "key", max_keys)


def memory(counts=(1_000, 10_000, 100_000, 1_000_000)):
    rows = []
    for n in counts:
        for system, filters in (
                ("tollgate", [wasm_filter(TOLLGATE, tollgate_plugin(HUGE, key=("header:x-key",),
                                                                     rule_extra={"max_keys": n}))]),
                ("Envoy local_ratelimit", [native_keyed(n)])):
            server = EnvoyServer(filters)
            try:
                start = server.rss_kib()
                sent = 0
                while sent < n:  # every key at least once
                    r = parse_wrk(wrk(server.url, max(2, math.ceil((n - sent) / 12_000)), keys=n))
                    sent += r["requests"]
                end = server.rss_kib()
            finally:
                server.stop()
            rows.append({"keys": n, "system": system, "rss_start_kib": start, "rss_end_kib": end,
                         "requests": sent})
            print(f"memory {system} {n} keys: {start} -> {end} KiB after {sent} requests", flush=True)
    return rows


# ---------------------------------------------------------------- the quota service

LEASE_LUA = """
counter = 0
request = function()
  counter = counter + 1
  local body = string.format('{"instance":"bench","items":[{"rule":"bench","limit_id":"00000000000000aa",' ..
    '"key":"%032x","requests":1000000000,"per_ms":1000,"burst":1000000000,"wanted":100,"used":100}]}',
    counter % 10000)
  return wrk.format("POST", "/v1/lease", {["content-type"] = "application/json"}, body)
end
"""


class RedisCluster:
    """3 masters and 3 replicas on loopback, as the cluster test starts them."""

    def __init__(self):
        import tempfile
        self.dir = tempfile.mkdtemp(prefix="tollgate-bench-cluster-")
        self.ports = []
        while len(self.ports) < 6:
            p = free_port()
            if p < 55000 and p not in self.ports:
                self.ports.append(p)
        self.procs = [Proc(harness.PROXY_CPU + [
            "redis-server", "--port", str(p), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
            "--cluster-node-timeout", "1000", "--cluster-config-file", f"nodes-{p}.conf",
            "--repl-diskless-sync-delay", "0", "--save", "", "--appendonly", "no", "--dir", self.dir])
            for p in self.ports]
        for p in self.ports:
            harness.wait_port(p)
        subprocess.run(["redis-cli", "--cluster", "create"] + [f"127.0.0.1:{p}" for p in self.ports]
                       + ["--cluster-replicas", "1", "--cluster-yes"], capture_output=True, check=True)
        deadline = time.time() + 30
        for p in self.ports:
            while "cluster_state:ok" not in subprocess.run(["redis-cli", "-p", str(p), "cluster", "info"],
                                                           capture_output=True, text=True).stdout:
                assert time.time() < deadline, "cluster not ok"
                time.sleep(0.05)
        self.urls = ",".join(f"redis://127.0.0.1:{p}" for p in self.ports)

    def pids(self):
        return [p.p.pid for p in self.procs]

    def stop(self):
        for p in self.procs:
            p.stop()


def batch_latency(port, calls=20, items=1000):
    """Milliseconds each of `calls` lease calls of `items` new keys takes (p50, slowest)."""
    took = []
    for c in range(calls):
        body = json.dumps({"instance": "bench", "items": [
            {"rule": "bench", "limit_id": "00000000000000bb", "key": f"{c:08x}{i:024x}", "requests": 100,
             "per_ms": 1000, "burst": 100, "wanted": 25, "used": 0, "demand": 50.0} for i in range(items)]})
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/lease", data=body.encode(),
                                     headers={"content-type": "application/json"})
        start = time.perf_counter()
        try:
            urllib.request.urlopen(req, timeout=10).read()
            took.append((time.perf_counter() - start) * 1000)
        except urllib.error.HTTPError:
            took.append(float("inf"))
    took.sort()
    return took[len(took) // 2], took[-1], sum(1 for t in took if t == float("inf"))


def quota_throughput(seconds=5):
    rows = []
    redis_port = free_port()
    redis = Proc(harness.PROXY_CPU + ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1",
                                  "--save", "", "--appendonly", "no"])
    harness.wait_port(redis_port)
    cluster = RedisCluster()
    try:
        for name, extra, store_pids in (
                ("memory", [], []),
                ("Redis", ["--redis", f"redis://127.0.0.1:{redis_port}"], [redis.p.pid]),
                ("Redis Cluster (3 masters, 3 replicas)", ["--redis-cluster", cluster.urls], cluster.pids())):
            port = free_port()
            service = Proc(harness.PROXY_CPU + [str(QUOTA), "--listen", f"127.0.0.1:{port}", "--cold-start", "full"]
                           + extra, env={**os.environ, "RUST_LOG": "error"})
            try:
                wait_http(f"http://127.0.0.1:{port}/healthz")
                url = f"http://127.0.0.1:{port}/v1/lease"
                wrk(url, 1, lua=LEASE_LUA)
                pids = [service.p.pid] + store_pids
                before = harness.cpu_ticks(pids)
                r = parse_wrk(wrk(url, seconds, lua=LEASE_LUA))
                cpu = (harness.cpu_ticks(pids) - before) / harness.CLK_TCK * 1e6 / max(r["requests"], 1)
                batch_p50, batch_max, batch_errors = batch_latency(port)
            finally:
                service.stop()
            rows.append({"store": name, "leases_per_s": r["rps"], "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"],
                         "errors": r["rejected"], "cpu_us": cpu, "batch_p50_ms": batch_p50,
                         "batch_max_ms": batch_max, "batch_errors": batch_errors})
            print(f"quota {name}: {r['rps']:.0f} leases/s, p99 {r['p99_ms']:.2f} ms, {cpu:.1f} us CPU/lease; "
                  f"1000-item calls: p50 {batch_p50:.1f} ms, slowest {batch_max:.1f} ms", flush=True)
    finally:
        redis.stop()
        cluster.stop()
    return rows


def global_load(seconds=5, rounds=5):
    """3 Envoys under and over a shared limit: quota calls per 1000 requests and p99, against the
    same load on a local rule (no quota service), in interleaved rounds (global, then local, in
    each round) so that the p99 ratio is taken between runs made side by side."""
    port = free_port()
    service = Proc([str(QUOTA), "--listen", f"127.0.0.1:{port}", "--cold-start", "full"],
                   env={**os.environ, "RUST_LOG": "error"})
    wait_http(f"http://127.0.0.1:{port}/healthz")
    runs = {}
    try:
        for r in range(rounds):
            for load, requests in (("under the limit", HUGE), ("over the limit (200/s shared)", 200)):
                for scope in ("global", "local"):
                    plugin = tollgate_plugin(requests, key=(), per="1s",
                                             scope="global" if scope == "global" else None)
                    if scope == "global":
                        plugin["quota_service"]["instances_hint"] = 3
                    else:
                        plugin["rules"][0]["limit"]["requests"] = max(requests // 3, 1)
                    envoys = [EnvoyServer([wasm_filter(TOLLGATE, plugin)],
                                          [quota_cluster(port)] if scope == "global" else [], pin=False)
                              for _ in range(3)]
                    try:
                        # Warm-up: connections, JIT, and the first leases.
                        wrk_together([e.url for e in envoys], 1, connections=4)
                        before = [(answered_2xx(e), e.stat("wasmcustom.tollgate.quota.calls")) for e in envoys]
                        results = wrk_together([e.url for e in envoys], seconds, connections=4)
                        ok = sum(answered_2xx(e) - b[0] for e, b in zip(envoys, before))
                        calls = sum(e.stat("wasmcustom.tollgate.quota.calls") - b[1] for e, b in zip(envoys, before))
                    finally:
                        for e in envoys:
                            e.stop()
                    total = sum(x["requests"] for x in results)
                    m = {"requests": total, "admitted": ok, "calls_per_1000": calls * 1000 / max(total, 1),
                         "p50_ms": max(x["p50_ms"] for x in results), "p99_ms": max(x["p99_ms"] for x in results),
                         "seconds": results[0]["seconds"]}
                    runs.setdefault((load, scope), []).append(m)
                    print(f"global load round {r + 1}, {load}, {scope} rule: {total} requests, {ok} admitted, "
                          f"{m['calls_per_1000']:.2f} calls/1000, p99 {m['p99_ms']:.2f} ms", flush=True)
    finally:
        service.stop()
    rows = []
    for (load, scope), ms in runs.items():
        row = {"load": load, "rule": scope, "rounds": len(ms),
               **{f: statistics.median(m[f] for m in ms) for f in ms[0]}}
        if scope == "global":
            local = runs[(load, "local")]
            row["p99_ratio"] = statistics.median(g["p99_ms"] / l["p99_ms"] for g, l in zip(ms, local))
        rows.append(row)
    return rows


# ---------------------------------------------------------------- where the time goes

def perf_samples_cpu():
    """True if `perf record` can sample this machine's CPU clock (a software event: VMs have it)."""
    try:
        return subprocess.run(["perf", "record", "-e", "cpu-clock", "-o", "/dev/null", "true"],
                              capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def dso_shares(data):
    """Shares of samples by where the code ran: the module's JIT code, Envoy's binary (the host and
    V8's runtime), the kernel, and the rest (libc, vdso)."""
    out = subprocess.run(["perf", "report", "-i", data, "--no-children", "--sort", "dso", "-g", "none",
                          "--stdio"], capture_output=True, text=True, timeout=120).stdout
    shares = {"module (JIT code)": 0.0, "Envoy (host and V8 runtime)": 0.0, "kernel": 0.0, "other": 0.0}
    for line in out.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "%" not in line:
            continue
        pct, _, dso = line.partition("%")
        try:
            share = float(pct) / 100
        except ValueError:
            continue
        dso = dso.strip()
        if dso.startswith("[JIT]") or dso.startswith("perf-") or dso == "[unknown]":
            shares["module (JIT code)"] += share
        elif dso == "envoy":
            shares["Envoy (host and V8 runtime)"] += share
        elif dso.startswith("[kernel"):
            shares["kernel"] += share
        else:
            shares["other"] += share
    return shares


def process_split(seconds=4, rounds=3):
    """Where the proxy's CPU per request goes, by sampling it (`perf record -e cpu-clock`): the
    module's code, Envoy's own, the kernel. `None` where perf cannot sample."""
    if not perf_samples_cpu():
        print("process split: perf cannot sample here; skipped", flush=True)
        return None
    setups = [
        ("Envoy, no filter", []),
        ("Envoy + raw-ABI do-nothing, 2 callbacks", [wasm_filter(harness.RAW_NOOP, {})]),
        ("Envoy + raw-ABI do-nothing, every callback", [wasm_filter(harness.RAW_NOOP_ALL, {})]),
        ("Envoy + SDK do-nothing filter", [wasm_filter(harness.NOOP, {})]),
        ("tollgate token bucket per client IP", [wasm_filter(TOLLGATE, tollgate_plugin(HUGE))]),
    ]
    found = {}
    for _ in range(rounds):
        for name, filters in setups:
            server = EnvoyServer(filters)
            data = tempfile.mktemp(prefix="tollgate-perf-")
            try:
                cpu_us = harness.measure(server, seconds, record=data)["cpu_us"]
                shares = dso_shares(data)
                found.setdefault(name, []).append({k: v * cpu_us for k, v in shares.items()} | {"cpu_us": cpu_us})
            finally:
                server.stop()
                if os.path.exists(data):
                    os.unlink(data)
    rows = []
    for name, _ in setups:
        ms = found[name]
        rows.append({"setup": name, **{k: statistics.median(m[k] for m in ms) for k in ms[0]}})
        print(f"process split {name}: {rows[-1]}", flush=True)
    return rows



CALLBACKS = ("create", "request", "client_address", "evaluate", "timer", "response", "log")


def profile(seconds=4, rounds=3):
    """Time and heap allocations inside tollgate's callbacks (the `probe` build), and the cost of
    each host call."""
    rows = []
    for name, plugin in (("token bucket per client IP", tollgate_plugin(HUGE)),
                         ("no rate-limit headers", tollgate_plugin(HUGE, extra={"rate_limit_headers": "none"})),
                         ("one bucket (no key), no headers",
                          tollgate_plugin(HUGE, key=(), extra={"rate_limit_headers": "none"})),
                         ("`worker_batch: 0`", tollgate_plugin(HUGE, rule_extra={"worker_batch": 0})),
                         ("429 storm", tollgate_plugin(1))):
        per = {cb: [] for cb in CALLBACKS}
        allocs = {cb: [] for cb in CALLBACKS}
        for _ in range(rounds):
            server = EnvoyServer([wasm_filter(TOLLGATE_PROBE, plugin)])
            try:
                harness.measure(server, seconds)
                for cb in CALLBACKS:
                    calls = server.stat(f"wasmcustom.tollgate.probe.{cb}.calls")
                    if calls:
                        per[cb].append(server.stat(f"wasmcustom.tollgate.probe.{cb}.ns") / calls)
                        allocs[cb].append(server.stat(f"wasmcustom.tollgate.probe.{cb}.allocs") / calls)
            finally:
                server.stop()
        row = {"config": name, **{cb: statistics.median(v) if v else None for cb, v in per.items()}}
        row["allocs"] = {cb: statistics.median(v) for cb, v in allocs.items() if v}
        rows.append(row)
        print(f"profile {name}: {rows[-1]}", flush=True)
    hostcalls = {}
    server = EnvoyServer([wasm_filter(HOST_PROBE, {})])
    try:
        for _ in range(9):
            body = urllib.request.urlopen(server.url, timeout=30).read().decode()
            for line in body.splitlines():
                op, ns = line.split()
                hostcalls.setdefault(op, []).append(float(ns))
    finally:
        server.stop()
    return rows, {op: statistics.median(v) for op, v in hostcalls.items()}


# ---------------------------------------------------------------- overload protection

TESTBED = harness.REPO / "target/release/tollgate-testbed"
CAPACITY_RPS = 200  # the upstream: 10 at once × 50 ms


def upstream_cluster(port):
    return {"name": "app", "type": "STATIC", "connect_timeout": "1s",
            "circuit_breakers": {"thresholds": [{"max_connections": 100000, "max_pending_requests": 100000,
                                                 "max_requests": 100000}]},
            "load_assignment": {"cluster_name": "app", "endpoints": [{"lb_endpoints": [{
                "endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]}}


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

LLM_BUDGET = 10_000  # tokens a minute for the key (burst the same)
LLM_RATE = LLM_BUDGET / 60  # tokens a second
LLM_MAX = 2_000  # the most a request can use (its max_tokens plus its input): what it reserves
LLM_KEY = "team-a"
LLM_PATH = "/llm/chat"  # tollgate-testbed answers paths with /llm like an LLM API
LLM_STREAMS, LLM_WAVES, LLM_EVERY = 20, 7, 2.0  # 20 concurrent streams every 2 s, 7 times
RESERVE_MAX = {"header": "x-max-tokens", "default": LLM_MAX, "max": LLM_MAX}
RLS_DOMAIN = "llm"
# The usage reaches Envoy's rate limit filter as dynamic metadata: a Lua filter reads the stream as it
# passes (chunk by chunk: `bodyChunks()` does not buffer) and keeps the last `total_tokens` it saw
# (OpenAI's last event with `stream_options.include_usage`); the rate limit filter's stream-done
# call adds it to the key's counter.
LLM_LUA = """\
function envoy_on_response(handle)
  local total
  local tail = ""
  for chunk in handle:bodyChunks() do
    local text = tail .. chunk:getBytes(0, chunk:length())
    for n in string.gmatch(text, '"total_tokens":%s*(%d+)') do
      total = n
    end
    tail = string.sub(text, -64)
  end
  if total then
    handle:streamInfo():dynamicMetadata():set("llm", "total_tokens", total)
  end
end
"""


def tollgate_module():
    """The tollgate module: the newer of `make dist`'s optimised build and `make build`'s (or the one
    TOLLGATE_WASM names, as for the Envoy tests)."""
    if os.environ.get("TOLLGATE_WASM"):
        return Path(os.environ["TOLLGATE_WASM"])
    found = [p for p in (TOLLGATE, harness.REPO / "dist/tollgate.wasm") if p.exists()]
    if not found:
        raise RuntimeError("no tollgate module: run `make build` (or `make dist`)")
    return max(found, key=lambda p: p.stat().st_mtime)


def llm_plugin(cost, settle=True, limit=LLM_BUDGET, extra_rules=(), **rule_extra):
    """One token_bucket rule per `x-api-key`: `limit` tokens a minute; `cost` is what a request
    takes when it arrives, and with `settle` the difference to its reported usage is settled."""
    rule = {"name": "llm", "key": ["header:x-api-key"], "limit": {"requests": limit, "per": "1m"},
            "cost": cost, **rule_extra}
    if settle:
        rule["settle"] = {"usage": "total"}
    return {"rules": [rule, *extra_rules]}


def grpc_cluster(name, port):
    return {"name": name, "type": "STATIC", "connect_timeout": "1s",
            "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}},
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]}}


def llm_native():
    """Envoy's own admit-then-charge token budget, as Envoy AI Gateway configures it: the global
    rate limit filter (fail closed) checks the key at the request (hits_addend 0: refused once the
    counter has reached the budget) and adds the response's usage when the stream is done
    (`apply_on_stream_done`, hits_addend from the Lua filter's dynamic metadata). The HTTP filters
    and the route's per-filter configuration. (In Envoy 1.40 a route's own `rate_limits` accept
    `hits_addend` but the rate limit filter sends no hits from them; the filter's per-route
    `RateLimitPerRoute.rate_limits` send both.)"""
    key = {"request_headers": {"header_name": "x-api-key", "descriptor_key": "api_key"}}
    filters = [
        {"name": "envoy.filters.http.ratelimit", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit",
            "domain": RLS_DOMAIN, "failure_mode_deny": True, "timeout": "1s",
            "rate_limit_service": {"grpc_service": {"envoy_grpc": {"cluster_name": "rls"}},
                                   "transport_api_version": "V3"}}},
        {"name": "envoy.filters.http.lua", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": LLM_LUA}}},
    ]
    route_extra = {"typed_per_filter_config": {"envoy.filters.http.ratelimit": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute",
        "rate_limits": [
            {"actions": [key], "hits_addend": {"number": 0}},
            {"actions": [key], "hits_addend": {"format": "%DYNAMIC_METADATA(llm:total_tokens)%"},
             "apply_on_stream_done": True},
        ]}}}
    return filters, route_extra


def _yaml_scalar(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(v)
    s = str(v)
    plain = (re.fullmatch(r"[A-Za-z_./][A-Za-z0-9_./-]*", s) and s not in ("true", "false", "null", "yes", "no",
                                                                          "on", "off", "y", "n"))
    return s if plain else json.dumps(s)


def to_yaml(value, indent=0):
    """Enough YAML for an Envoy configuration: mappings, lists, scalars, and multi-line strings as
    block literals."""
    pad = "  " * indent
    if isinstance(value, dict):
        if not value:
            return "{}"
        lines = []
        for k, v in value.items():
            key = _yaml_scalar(k)
            if isinstance(v, (dict, list)) and v:
                lines.append(f"{pad}{key}:\n{to_yaml(v, indent + 1)}")
            elif isinstance(v, str) and "\n" in v:
                body = "\n".join(f"{pad}  {line}" if line else "" for line in v.rstrip("\n").split("\n"))
                lines.append(f"{pad}{key}: |\n{body}")
            else:
                lines.append(f"{pad}{key}: {to_yaml(v) if isinstance(v, (dict, list)) else _yaml_scalar(v)}")
        return "\n".join(lines)
    if isinstance(value, list):
        if not value:
            return "[]"
        lines = []
        for v in value:
            if isinstance(v, dict) and v:
                lines.append(f"{pad}- {to_yaml(v, indent + 1)[len(pad) + 2:]}")
            elif isinstance(v, (dict, list)):
                lines.append(f"{pad}- {to_yaml(v)}")
            else:
                lines.append(f"{pad}- {_yaml_scalar(v)}")
        return "\n".join(lines)
    return _yaml_scalar(value)


NATIVE_YAML = harness.REPO / "bench/envoy-llm-native.yaml"


def write_native_yaml():
    """bench/envoy-llm-native.yaml: the native setup's whole Envoy configuration as the benchmark
    runs it (there on free ports; here on fixed ones), checked by Envoy's `--mode validate`."""
    filters, route_extra = llm_native()
    cfg = harness.envoy_config(10000, 9901, filters, [upstream_cluster(8000), grpc_cluster("rls", 8081)],
                               upstream="app", route_extra=route_extra)
    cfg["static_resources"]["listeners"][0]["name"] = "llm"
    text = ("# Envoy 1.40's own token budget charged after the response (bench/run.py --sections llm):\n"
            "# 10 000 tokens a minute per x-api-key, counted by a rate limit service on 127.0.0.1:8081\n"
            "# (bench/rls.py: fixed window, counter += hits); the LLM API on 127.0.0.1:8000.\n"
            "# Generated by bench/sections.py (llm_native); `envoy --mode validate -c` accepts it.\n"
            + to_yaml(cfg) + "\n")
    NATIVE_YAML.write_text(text)
    check = subprocess.run([str(harness.ENVOY), "--mode", "validate", "-c", str(NATIVE_YAML)],
                           capture_output=True, text=True, timeout=60)
    if check.returncode != 0:
        raise RuntimeError(f"{NATIVE_YAML} does not validate: {check.stdout[-2000:]} {check.stderr[-2000:]}")


def llm_plan(seed=1):
    """The workload, the same for every setup: waves of concurrent streams of one key, each using
    300 to 2 000 tokens (100 of them input) over 10 events 100 to 200 ms apart (1 to 2 s)."""
    rng = random.Random(seed)
    plan = []
    for w in range(LLM_WAVES):
        for _ in range(LLM_STREAMS):
            total = rng.randint(300, LLM_MAX)
            plan.append({"at": w * LLM_EVERY, "tokens": total, "headers": {
                "x-api-key": LLM_KEY, "x-stream": "1", "x-events": "10", "x-event-ms": str(rng.randint(100, 200)),
                "x-usage-input": "100", "x-usage-output": str(total - 100), "x-max-tokens": str(LLM_MAX)}})
    return plan


async def _llm_request(port, item, started):
    await asyncio.sleep(max(0.0, started + item["at"] - time.monotonic()))
    sent = time.monotonic() - started
    status, usage = None, None
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            head = [f"GET {LLM_PATH} HTTP/1.1", "host: llm", "connection: close"]
            head += [f"{k}: {v}" for k, v in item["headers"].items()]
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
            await writer.drain()
            status = int((await asyncio.wait_for(reader.readline(), 30)).split()[1])
            body = await asyncio.wait_for(reader.read(), 30)
            found = re.findall(rb'"total_tokens":(\d+)', body)
            usage = int(found[-1]) if found else None
        finally:
            writer.close()
    except (OSError, asyncio.TimeoutError, ValueError, IndexError):
        pass
    return {"sent": sent, "done": time.monotonic() - started, "status": status, "usage": usage,
            "tokens": item["tokens"]}


def llm_run(port, plan):
    async def run():
        started = time.monotonic()
        return await asyncio.gather(*(_llm_request(port, item, started) for item in plan))
    return asyncio.run(run())


def rule_stat(server, rule, name):
    """A tollgate rule's counter from Envoy's /stats/prometheus (with or without tag extraction)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.admin}/stats/prometheus", timeout=5).read().decode()
    for series in (f'tollgate_rule_{name}{{tollgate_rule="{rule}"}}', f"tollgate_rule_{rule}_{name}{{}}"):
        for line in text.splitlines():
            if line.startswith(series + " "):
                return int(float(line.split()[-1]))
    return None


def llm_summary(results):
    """Tokens admitted against the budget: at each admission t (from the first request sent), the
    usage of every stream admitted so far against burst + rate × t; the largest excess, and the
    excess when the last request was sent."""
    t0 = min(r["sent"] for r in results)
    ok = sorted((r for r in results if r["status"] == 200), key=lambda r: r["sent"])
    admitted, peak, timeline = 0, (float("-inf"), 0.0, LLM_BUDGET), []
    for r in ok:
        admitted += r["usage"] if r["usage"] is not None else r["tokens"]
        t = r["sent"] - t0
        budget = LLM_BUDGET + LLM_RATE * t
        timeline.append([round(t, 3), admitted])
        if admitted - budget > peak[0]:
            peak = (admitted - budget, t, budget)
    end = max(r["sent"] for r in results) - t0
    end_budget = LLM_BUDGET + LLM_RATE * end
    return {"admitted": len(ok), "refused": sum(1 for r in results if r["status"] == 429),
            "errors": sum(1 for r in results if r["status"] not in (200, 429)),
            "incomplete": sum(1 for r in ok if r["usage"] != r["tokens"]),
            "tokens": admitted, "offered": sum(r["tokens"] for r in results), "seconds": end,
            "budget": end_budget, "over": admitted - end_budget, "over_pct": (admitted - end_budget) / end_budget,
            "peak_over": peak[0], "peak_at": peak[1], "peak_pct": peak[0] / peak[2],
            "timeline": timeline}


LLM_SETUPS = ("tollgate, reserve then settle", "tollgate, charge after the response",
              "Envoy ratelimit + Lua, charge after the response")


def llm_overshoot(plan):
    """The three setups under the same workload (Envoy with 2 workers, not pinned)."""
    from rls import RateLimitService
    module = tollgate_module()
    out = {}
    for name in LLM_SETUPS:
        app_port = free_port()
        app = Proc([str(TESTBED), "upstream", "--port", str(app_port)])
        harness.wait_port(app_port)
        rls, route_extra, clusters = None, None, [upstream_cluster(app_port)]
        if name.startswith("Envoy"):
            rls_port = free_port()
            rls = RateLimitService(rls_port, LLM_BUDGET, window_s=60.0)
            filters, route_extra = llm_native()
            clusters.append(grpc_cluster("rls", rls_port))
        else:
            cost = RESERVE_MAX if "reserve" in name else 1
            filters = [wasm_filter(module, llm_plugin(cost))]
        envoy = EnvoyServer(filters, clusters, concurrency=2, pin=False, upstream="app", route_extra=route_extra)
        try:
            results = llm_run(envoy.port, plan)
            time.sleep(0.2)  # the last settlements and stream-done calls
            settled = None if rls else rule_stat(envoy, "llm", "settled")
        finally:
            envoy.stop()
            app.stop()
            if rls:
                rls.stop()
        row = {"setup": name, **llm_summary(results), "settled": settled}
        if rls:
            row["rls_checks"] = sum(1 for c in rls.calls if c[2] == 0)
            row["rls_charges"] = sum(1 for c in rls.calls if c[2] > 0)
            row["rls_charged"] = sum(c[2] for c in rls.calls)
        out[name] = row
        print(f"llm {name}: {row['admitted']} admitted, {row['refused']} refused, {row['errors']} errors, "
              f"{row['tokens']} tokens in {row['seconds']:.1f} s against {row['budget']:.0f} "
              f"({row['over']:+.0f}, {row['over_pct']:+.0%}); peak over {row['peak_over']:.0f} at "
              f"{row['peak_at']:.1f} s; settled {settled}"
              + (f"; RLS {row['rls_checks']} checks, {row['rls_charges']} charges of {row['rls_charged']}"
                 if rls else ""), flush=True)
    return module, out


LLM_WRK = """
wrk.headers["x-api-key"] = "k"
wrk.headers["x-stream"] = "1"
wrk.headers["x-events"] = "10"
wrk.headers["x-event-ms"] = "1"
wrk.headers["x-usage-input"] = "100"
wrk.headers["x-usage-output"] = "900"
wrk.headers["x-max-tokens"] = "2000"
"""


def llm_cpu(module, seconds=1, rounds=16):
    """Envoy's CPU per request (one worker pinned to core 0; wrk and the LLM upstream on core 1)
    for a streamed answer of 10 events 1 ms apart (each its own chunk) with its usage: (a) the rule
    with `settle` against the same rule without it (and without it at `worker_batch: 0`, settle's
    own default); (b) a request no settle rule applies to, with a settle rule on another path,
    against the same two rules without settle (and against the one rule alone). One Envoy per
    setup for the whole run (warmed up once), measured in many short interleaved rounds in a
    shuffled order (short, so that the two runs of a pair are close in time); paired medians."""
    other = {"name": "elsewhere", "match": {"path_prefix": "/v1/"}, "key": ["header:x-api-key"],
             "limit": {"requests": LLM_BUDGET, "per": "1m"}, "cost": RESERVE_MAX, "settle": {"usage": "total"}}
    setups = [
        ("settle usage", llm_plugin(RESERVE_MAX, limit=HUGE)),
        ("no settle", llm_plugin(RESERVE_MAX, settle=False, limit=HUGE)),
        ("no settle, worker_batch 0", llm_plugin(RESERVE_MAX, settle=False, limit=HUGE, worker_batch=0)),
        ("no settle, a settle rule on another path", llm_plugin(RESERVE_MAX, settle=False, limit=HUGE,
                                                                extra_rules=[other])),
        ("no settle, the same rule on another path without settle",
         llm_plugin(RESERVE_MAX, settle=False, limit=HUGE, extra_rules=[{k: v for k, v in other.items() if k != "settle"}])),
    ]
    names = [name for name, _ in setups]
    app_port = free_port()
    app = Proc(harness.LOAD_CPU + [str(TESTBED), "upstream", "--port", str(app_port)])
    servers = {}
    runs = {}
    order = random.Random(2)
    try:
        harness.wait_port(app_port)
        for name, plugin in setups:
            servers[name] = EnvoyServer([wasm_filter(module, plugin)], [upstream_cluster(app_port)], upstream="app")
        for server in servers.values():
            wrk(server.url + LLM_PATH.lstrip("/"), 1, lua=LLM_WRK)  # warm-up: JIT, caches
        for r in range(rounds):
            order.shuffle(setups)
            for name, _ in setups:
                server = servers[name]
                url = server.url + LLM_PATH.lstrip("/")
                time.sleep(0.05)  # the filter hands its counts to Envoy on its 10 ms tick
                settled = rule_stat(server, "llm", "settled") or 0
                before = harness.cpu_ticks(server.pids)
                m = parse_wrk(wrk(url, seconds, lua=LLM_WRK))
                m["cpu_us"] = (harness.cpu_ticks(server.pids) - before) / harness.CLK_TCK * 1e6 / max(m["requests"], 1)
                time.sleep(0.05)
                m["settled_per_request"] = ((rule_stat(server, "llm", "settled") or 0) - settled) / max(m["requests"], 1)
                runs.setdefault(name, []).append(m)
                print(f"llm cpu round {r + 1} {name}: {m['cpu_us']:.1f} us/req, {m['rps']:.0f} req/s, "
                      f"non-2xx {m['rejected']}, settled {m['settled_per_request']:.0f} tokens/req", flush=True)
    finally:
        for server in servers.values():
            server.stop()
        app.stop()
    rows = {name: {"cpu_us": statistics.median(m["cpu_us"] for m in ms),
                   "cpu_min": min(m["cpu_us"] for m in ms), "cpu_max": max(m["cpu_us"] for m in ms),
                   "rps": statistics.median(m["rps"] for m in ms), "rejected": sum(m["rejected"] for m in ms),
                   "settled_per_request": statistics.median(m["settled_per_request"] for m in ms),
                   "per_round": [m["cpu_us"] for m in ms]}
            for name, ms in ((n, runs[n]) for n in names)}

    def paired(a, b):
        """The median over rounds of a − b measured in the same round, and the quartiles of those
        differences (the middle half of the rounds)."""
        d = [x - y for x, y in zip(rows[a]["per_round"], rows[b]["per_round"])]
        q1, _, q3 = statistics.quantiles(d, n=4)
        return {"median": statistics.median(d), "q1": q1, "q3": q3, "min": min(d), "max": max(d)}
    return {"rounds": rounds, "seconds": seconds, "setups": rows,
            "settle_vs_none": paired("settle usage", "no settle"),
            "settle_vs_batch0": paired("settle usage", "no settle, worker_batch 0"),
            "elsewhere_vs_none": paired("no settle, a settle rule on another path",
                                        "no settle, the same rule on another path without settle"),
            "elsewhere_vs_one_rule": paired("no settle, a settle rule on another path", "no settle")}


def llm(seed=1):
    """Token budgets: the overshoot of reserve-then-settle, of charging after the response (tollgate
    and Envoy's own), and the CPU that settlement adds."""
    write_native_yaml()
    plan = llm_plan(seed)
    module, setups = llm_overshoot(plan)
    cpu = llm_cpu(module)
    return {"module": str(module.relative_to(harness.REPO)), "budget": LLM_BUDGET, "max": LLM_MAX,
            "streams": LLM_STREAMS, "waves": LLM_WAVES, "every": LLM_EVERY, "seed": seed,
            "setups": setups, "cpu": cpu}


# ---------------------------------------------------------------- bandwidth per key

BW_RATE = 1_000_000  # bytes a second the three limiters are set to (as near as each one's units allow)
BW_BURST = 65_536  # tollgate's burst in bytes
BW_TOTAL = 5_000_000  # bytes each rate case downloads in all
BW_KBPS = round(BW_RATE / 1024)  # Envoy's limit_kbps is KiB/s: 977 → 1 000 448 bytes/s
NGINX_RATE = "1m"  # nginx: 1m = 1 048 576 bytes/s
BW_PLUGIN = {"rules": [{"name": "downloads", "key": ["header:x-user"], "limit": {"bytes": BW_RATE, "per": "1s"},
                        "burst": BW_BURST}]}
BW_ROUTE = {  # Envoy's bandwidth_limit on the route: one bucket for everyone on it
    "@type": "type.googleapis.com/envoy.extensions.filters.http.bandwidth_limit.v3.BandwidthLimit",
    "stat_prefix": "bandwidth", "enable_mode": "RESPONSE", "limit_kbps": BW_KBPS}
# (rate setups) the cases: (name, [(bytes, user, source address)] downloaded at once)
BW_CASES = (
    ("1 connection", [(BW_TOTAL, "alice", "127.0.0.1")]),
    ("4 connections", [(BW_TOTAL // 4, "alice", "127.0.0.1")] * 4),
    ("2 clients", [(BW_TOTAL // 2, "alice", "127.0.0.1"), (BW_TOTAL // 2, "bob", "127.0.0.2")]),
)
# (baselines, no limit) the same shapes, larger: enough bytes for the proxy's CPU to be measured
BW_BASE_CASES = (
    ("1 connection", [(200_000_000, "alice", "127.0.0.1")]),
    ("4 connections", [(50_000_000, "alice", "127.0.0.1")] * 4),
)
BW_ENVOY, BW_TOLLGATE, BW_NATIVE = ("Envoy, no filter", "Envoy + tollgate byte limit per key",
                                   "Envoy + bandwidth_limit on the route")
BW_NGINX, BW_LIMIT_RATE = "nginx, no limit_rate", "nginx + limit_rate per request"
BW_SETUPS = (BW_ENVOY, BW_TOLLGATE, BW_NATIVE, BW_NGINX, BW_LIMIT_RATE)
# Idle only, for comparison: tollgate with a rule of requests instead of bytes.
BW_REQUESTS_PLUGIN = {"rules": [{"name": "requests", "key": ["header:x-user"], "limit": {"requests": 100, "per": "1s"}}]}


def cpu_ns(pids):
    """User+sys CPU of these processes, every thread, in ns (/proc/…/task/*/schedstat: finer than
    the 10 ms ticks of /proc/…/stat, which a 5 s transfer at 1 MB/s barely moves)."""
    total = 0
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError):
                pass  # a thread gone meanwhile
    return total


def nginx_proxy_config(directory, port, upstream_port, limit_rate=None):
    """nginx (2 workers, defaults otherwise: proxy_buffering on) proxying to the upstream, with
    `limit_rate` or without."""
    temp = "\n".join(f"  {k}_temp_path {directory}/{k};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    rate = f"limit_rate {limit_rate}; " if limit_rate else ""
    return f"""
worker_processes 2;
daemon off;
pid {directory}/nginx.pid;
error_log {directory}/error.log error;
events {{ worker_connections 1024; }}
http {{
  access_log off;
{temp}
  upstream app {{ server 127.0.0.1:{upstream_port}; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{ {rate}proxy_pass http://app; }}
  }}
}}
"""


class NginxProxy:
    def __init__(self, upstream_port, limit_rate=None):
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="tollgate-bench-nginx-")
        os.chmod(self.dir, 0o755)  # run as root, the workers are `nobody`: their temp files go in here
        with open(f"{self.dir}/nginx.conf", "w") as f:
            f.write(nginx_proxy_config(self.dir, self.port, upstream_port, limit_rate))
        self.proc = Proc(["nginx", "-c", f"{self.dir}/nginx.conf", "-p", self.dir])
        harness.wait_port(self.port)
        deadline = time.time() + 5
        while True:  # the master and both workers
            self.pids = [int(p) for p in subprocess.check_output(["pgrep", "-g", str(self.proc.p.pid)]).split()]
            if len(self.pids) >= 3 or time.time() > deadline:
                break
            time.sleep(0.05)

    def stop(self):
        self.proc.stop()


def _download(port, size, user, source, start, out):
    """GET /bytes/<size> with `x-user`, from `source`: the whole body read, with the times the
    request was sent, its first body byte came and its last, and (time, bytes so far) every 10 ms."""
    try:
        s = socket.socket()
        s.settimeout(30)
        s.bind((source, 0))
        s.connect(("127.0.0.1", port))
        request = (f"GET /bytes/{size} HTTP/1.1\r\nhost: bench\r\nx-user: {user}\r\n"
                   "connection: close\r\n\r\n").encode()
        start.wait()
        sent = time.monotonic()
        s.sendall(request)
        head = bytearray()
        while (end := head.find(b"\r\n\r\n")) < 0:
            chunk = s.recv(65536)
            if not chunk:
                raise OSError("closed before the response head")
            head += chunk
        now = time.monotonic()
        lines = bytes(head[:end]).decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        length = next((int(v) for k, _, v in (l.partition(":") for l in lines[1:])
                       if k.strip().lower() == "content-length"), None)
        headers = now
        got = len(head) - end - 4
        first = now if got else None
        samples = [[now, got]]
        last, stall = now, 0.0  # the last read with bytes (or the head); the longest time without any
        view = bytearray(1 << 20)
        while length is None or got < length:
            n = s.recv_into(view)
            if not n:
                break
            now = time.monotonic()
            if first is None:
                first = now
            stall = max(stall, now - last)
            if now - samples[-1][0] >= 0.01:
                if last > samples[-1][0]:
                    samples.append([last, got])  # where the step starts
                samples.append([now, got + n])
            got += n
            last = now
        done = time.monotonic()
        samples.append([done, got])
        s.close()
        out.update(status=status, length=length, bytes=got, sent=sent, headers=headers, first=first, done=done,
                   stall=stall, samples=samples, user=user, source=source)
    except Exception as e:  # noqa: BLE001 - reported with the case
        out.update(error=repr(e))


def bandwidth_case(port, downloads, pids, burst_of=None, grid=0.05):
    """The downloads at once (a thread each); the proxy's CPU over them; the aggregate rate, and
    the rate past the burst the limiter grants up front ((bytes − burst) / (last byte − request sent))."""
    start = threading.Barrier(len(downloads) + 1)
    outs = [{} for _ in downloads]
    threads = [threading.Thread(target=_download, args=(port, size, user, source, start, out))
               for (size, user, source), out in zip(downloads, outs)]
    for t in threads:
        t.start()
    before = cpu_ns(pids)
    start.wait()
    for t in threads:
        t.join(60)
    cpu = cpu_ns(pids) - before
    errors = [o.get("error") or f"status {o['status']}, {o['bytes']} of {o['length']} bytes"
              for o in outs if o.get("error") or o["status"] != 200 or o["bytes"] != o["length"]]
    if errors:
        raise RuntimeError(f"bandwidth: {errors}")
    t0 = min(o["sent"] for o in outs)
    first, last = min(o["first"] for o in outs), max(o["done"] for o in outs)
    total = sum(o["bytes"] for o in outs)
    burst = burst_of(outs) if burst_of else 0
    # The bytes all downloads had at each point of a 50 ms grid (for the chart).
    def at(o, t):
        got = 0
        for ts, b in o["samples"]:
            if ts - t0 > t:
                break
            got = b
        return got
    timeline = [[round(k * grid, 3), sum(at(o, k * grid) for o in outs)] for k in range(int((last - t0) / grid) + 1)]
    timeline.append([round(last - t0, 3), total])
    return {"connections": len(outs), "users": len({o["user"] for o in outs}), "bytes": total,
            "seconds": last - t0, "first_byte_s": first - t0, "rate": total / (last - t0),
            "headers_s": max(o["headers"] for o in outs) - t0, "stall_s": max(o["stall"] for o in outs),
            "burst": burst, "paced_rate": (total - burst) / (last - t0) if burst else None,
            "cpu_ms": cpu / 1e6, "cpu_ms_per_mb": cpu / 1e6 / (total / 1e6),
            "each": [{"user": o["user"], "bytes": o["bytes"], "first_byte_s": o["first"] - t0, "stall_s": o["stall"],
                      "seconds": o["done"] - t0, "rate": o["bytes"] / (o["done"] - o["sent"])} for o in outs],
            "per_user": {u: sum(o["bytes"] for o in outs if o["user"] == u) /
                         (max(o["done"] for o in outs if o["user"] == u) - t0)
                         for u in sorted({o["user"] for o in outs})},
            "timeline": timeline}


def bandwidth_setup(name, app_port, module):
    """A proxy for one of BW_SETUPS in front of the upstream: (server, port, pids, limited, burst_of)."""
    route, filters = None, []
    if name in (BW_NGINX, BW_LIMIT_RATE):
        server = NginxProxy(app_port, NGINX_RATE if name == BW_LIMIT_RATE else None)
        # No burst to take off: nginx grants `limit_rate × (seconds since the request began + 1)`
        # less what it sent, but after each write it also waits as long as that write takes at the
        # rate, so the second's allowance does not go out at once.
        return server, server.port, server.pids, name == BW_LIMIT_RATE, None
    if name == BW_TOLLGATE:
        filters = [wasm_filter(module, BW_PLUGIN)]
        burst = lambda outs: BW_BURST * len({o["user"] for o in outs})  # one bucket per key, full
    elif name == BW_NATIVE:
        # The filter in the chain disabled; on the route, enabled with its limit (a bucket of its own,
        # shared by every request on the route and every worker).
        filters = [{"name": "envoy.filters.http.bandwidth_limit", "typed_config": {
            "@type": BW_ROUTE["@type"], "stat_prefix": "bandwidth_default"}}]
        route = {"typed_per_filter_config": {"envoy.filters.http.bandwidth_limit": BW_ROUTE}}
        burst = lambda outs: BW_KBPS * 1024  # its bucket holds a second's worth and starts full
    else:
        burst = None
    server = EnvoyServer(filters, [upstream_cluster(app_port)], concurrency=2, pin=False, upstream="app",
                         route_extra=route)
    return server, server.port, server.pids, name != BW_ENVOY, burst


def bandwidth(idle_s=2.0, rest_s=1.2):
    """Achieved download rate against configured, side by side: tollgate's byte limit per key
    (Envoy), nginx's `limit_rate` (per request) and Envoy's `bandwidth_limit` (per route), each
    1 MB/s (as near as the units allow) over one connection, four connections of one key, and two
    clients at once; and the proxy's CPU per MB against the same proxy without a limit. One proxy
    per setup, 2 workers, not pinned; `tollgate-testbed upstream` answers /bytes/N at full speed."""
    module = tollgate_module()
    app_port = free_port()
    app = Proc([str(TESTBED), "upstream", "--port", str(app_port)])
    out = {"module": str(module.relative_to(harness.REPO)), "rate": BW_RATE, "burst": BW_BURST, "kbps": BW_KBPS,
           "nginx_rate": NGINX_RATE, "plugin": BW_PLUGIN, "route": BW_ROUTE,
           "nginx_location": f"location / {{ limit_rate {NGINX_RATE}; proxy_pass http://app; }}",
           "configured": {"Envoy + tollgate byte limit per key": BW_RATE,
                          "Envoy + bandwidth_limit on the route": BW_KBPS * 1024,
                          "nginx + limit_rate per request": 1_048_576},
           "setups": {}}
    try:
        harness.wait_port(app_port)
        for name in BW_SETUPS:
            server, port, pids, limited, burst = bandwidth_setup(name, app_port, module)
            row = {"cases": {}}
            idle = [0, 0.0]  # the proxy's CPU while nothing passes (ns), over how long (s)

            def rest(seconds):
                time.sleep(0.1)
                before, started = cpu_ns(pids), time.monotonic()
                time.sleep(seconds)
                idle[0] += cpu_ns(pids) - before
                idle[1] += time.monotonic() - started
            try:
                # Warm-up (connections, the module's JIT) with another key; then the proxy idle, for
                # the CPU it spends doing nothing (and again in each rest between the cases, which
                # lets the buckets fill up again).
                bandwidth_case(port, [(100_000, "warm-up", "127.0.0.1")], pids)
                rest(idle_s)
                paced = lambda: rule_stat(server, "downloads", "paced_bytes") or 0
                for case, downloads in (BW_CASES if limited else BW_BASE_CASES):
                    # A key of its own in each case (tollgate's buckets start full).
                    downloads = [(size, f"{user}-{len(row['cases'])}", source) for size, user, source in downloads]
                    charged = paced() if "tollgate" in name else None
                    r = bandwidth_case(port, downloads, pids, burst)
                    if charged is not None:
                        time.sleep(0.05)  # the filter hands its counts to Envoy on its tick
                        r["paced_bytes"] = paced() - charged
                    row["cases"][case] = r
                    print(f"bandwidth {name}, {case}: {r['bytes']} bytes in {r['seconds']:.2f} s = "
                          f"{r['rate'] / 1e6:.3f} MB/s" + (f" ({r['paced_rate'] / 1e6:.3f} MB/s past the burst "
                                                           f"of {r['burst']})" if r["paced_rate"] else "")
                          + f"; per user {', '.join(f'{u} {v / 1e6:.3f}' for u, v in r['per_user'].items())}; "
                          f"first byte {r['first_byte_s']:.2f} s, longest pause {r['stall_s']:.2f} s; "
                          f"CPU {r['cpu_ms']:.1f} ms = {r['cpu_ms_per_mb']:.2f} ms/MB", flush=True)
                    rest(rest_s)
                if isinstance(server, EnvoyServer):
                    row["workers"] = workers_used(server)
            finally:
                server.stop()
            row["idle_ms_per_s"] = idle[0] / 1e6 / idle[1]
            for r in row["cases"].values():
                # Less what the proxy spends idle over as long: what moving the bytes took.
                r["cpu_net_ms_per_mb"] = (r["cpu_ms"] - row["idle_ms_per_s"] * r["seconds"]) / (r["bytes"] / 1e6)
            print(f"bandwidth {name}: idle {row['idle_ms_per_s']:.2f} ms CPU/s, workers {row.get('workers')}; "
                  + ", ".join(f"{c} {r['cpu_net_ms_per_mb']:.2f} ms/MB less idle" for c, r in row["cases"].items()),
                  flush=True)
            out["setups"][name] = row
        # Idle only: the same Envoy and module with a rule of requests, not bytes.
        server = EnvoyServer([wasm_filter(module, BW_REQUESTS_PLUGIN)], [upstream_cluster(app_port)], concurrency=2,
                             pin=False, upstream="app")
        try:
            urllib.request.urlopen(server.url + "bytes/1000", timeout=5).read()
            time.sleep(0.1)
            before, started = cpu_ns(server.pids), time.monotonic()
            time.sleep(idle_s * 2)
            out["idle_requests_rule_ms_per_s"] = (cpu_ns(server.pids) - before) / 1e6 / (time.monotonic() - started)
        finally:
            server.stop()
        print(f"bandwidth Envoy + tollgate, a rule of requests: idle {out['idle_requests_rule_ms_per_s']:.2f} ms CPU/s",
              flush=True)
    finally:
        app.stop()
    return out
