"""The quota service's throughput over memory, Redis and a Redis Cluster, and global rules under load.

Part of `make bench` (`bench/sections.py` lists the sections)."""
import json
import os
import statistics
import subprocess
import time
import urllib.request

import harness
from section_common import answered_2xx, wrk_together
from harness import (HUGE, QUOTA, TOLLGATE, EnvoyServer, Proc, free_port, parse_wrk, quota_cluster, tollgate_plugin, wait_http, wasm_filter, wrk)


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
