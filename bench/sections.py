"""The parts of `make bench` beyond cost per request: accuracy at 2 workers and across proxies,
memory against distinct keys, the quota service's throughput, and where tollgate's time goes.
Each function returns plain rows for results.json and the report."""
import asyncio
import json
import os
import math
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request

import harness
from harness import (HUGE, QUOTA, TOLLGATE, TOLLGATE_PROBE, HOST_PROBE, EnvoyServer, Proc, free_port,
                 parse_wrk, quota_cluster, tollgate_plugin, wait_http, wasm_filter, wrk, wrk_args)


def wrk_together(urls, seconds, connections=64):
    """wrk against every url at once (not pinned: proxies with several workers use both cores)."""
    procs = []
    for url in urls:
        args, script = wrk_args(url, seconds, connections, pin=False)
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
        port = free_port()
        app = Proc([str(TESTBED), "upstream", "--port", str(port), "--capacity", "10", "--service-ms", "50"])
        harness.wait_port(port)
        envoy = EnvoyServer(filters, [upstream_cluster(port)], concurrency=2, pin=False, upstream="app")
        load = subprocess.Popen([str(TESTBED), "load", "--url", envoy.url, "--rate", str(rate),
                                 "--seconds", str(seconds), "--bucket-ms", str(bucket_ms)],
                                stdout=subprocess.PIPE, text=True)
        try:
            started = time.monotonic()
            for at, ms in ((slow_at, 100), (fast_at, 50)):
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
        out[name] = timeline
        print(f"capacity change, {name}: " + " ".join(f"{x['goodput']:.0f}" for x in timeline), flush=True)
    return {"rate": rate, "slow_at": slow_at, "fast_at": fast_at, "bucket_ms": bucket_ms, "setups": out}
