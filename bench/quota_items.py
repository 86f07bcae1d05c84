#!/usr/bin/env python3
"""Quota service throughput per item: `tollgate-quota` pinned to core 0 (Redis there too in the
Redis case), wrk on core 1 posting lease calls of 1, 10, 100 and 1 000 items over 100 000 keys;
CPU of the service (and of Redis) per item, items per second and each call size's p99.

    bench/quota_items.py [--seconds 5] [--stores memory,redis] [--sizes 1,10,100,1000]
    bench/quota_items.py --replicas      # 1 and 3 replicas over one Redis and over a Redis Cluster

CPU per item is the figure to read: on 2 cores wrk shares the machine, so items per second are
what one service core served while the other ran the load.
"""
import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

REPO = harness.REPO
KEYS = 100_000
HEADING = "### Lease items per second and CPU per item"

# Each call: `items` items of consecutive keys, from a counter that walks all KEYS.
LUA = """
counter = 0
local items = %d
local head = '{"rule":"bench","limit_id":"00000000000000aa","requests":1000000000,"per_ms":1000,' ..
  '"burst":1000000000,"wanted":100,"used":100,"key":"'
request = function()
  local parts = {}
  for i = 1, items do
    counter = (counter + 1) %% %d
    parts[i] = head .. string.format("%%032x", counter) .. '"}'
  end
  local body = '{"instance":"bench","items":[' .. table.concat(parts, ",") .. ']}'
  return wrk.format("POST", "/v1/lease", {["content-type"] = "application/json"}, body)
end
"""


def measure(store, items, seconds, keys=KEYS):
    redis = None
    extra, store_pids = [], []
    if store == "redis":
        redis_port = harness.free_port()
        redis = harness.Proc(harness.PROXY_CPU + ["redis-server", "--port", str(redis_port), "--bind",
                                                  "127.0.0.1", "--save", "", "--appendonly", "no"])
        harness.wait_port(redis_port)
        extra, store_pids = ["--redis", f"redis://127.0.0.1:{redis_port}"], [redis.p.pid]
    port = harness.free_port()
    service = harness.Proc(harness.PROXY_CPU + [str(harness.QUOTA), "--listen", f"127.0.0.1:{port}",
                                                "--cold-start", "full"] + extra,
                           env={**os.environ, "RUST_LOG": "error"})
    try:
        harness.wait_http(f"http://127.0.0.1:{port}/healthz")
        url = f"http://127.0.0.1:{port}/v1/lease"
        lua = LUA % (items, keys)
        # Enough calls at once to keep the service's core busy, and for 1 000-item calls few enough
        # that they do not queue on the one Redis core past the storage timeout (with 8 at once
        # they did on a slow hour of this VM, every call timed out, and CPU per item said nothing).
        connections = 32 if items <= 10 else 8 if items <= 100 else 3
        harness.wrk(url, 1, connections=connections, lua=lua)
        service_pid = [service.p.pid]
        before = harness.cpu_ticks(service_pid), harness.cpu_ticks(store_pids) if store_pids else 0
        runs_before = script_runs(redis_port) if redis else 0
        r = harness.parse_wrk(harness.wrk(url, seconds, connections=connections, lua=lua))
        runs = script_runs(redis_port) - runs_before if redis else 0
        # Per item served: a call answered with an error (its storage timeout passed while it
        # queued) was not run.
        total = (r["requests"] - r["rejected"]) * items
        us = lambda pids, b: (harness.cpu_ticks(pids) - b) / harness.CLK_TCK * 1e6 / max(total, 1)
        row = {"store": store, "items": items, "calls_per_s": r["rps"],
               "items_per_s": r["rps"] * items * (r["requests"] - r["rejected"]) / max(r["requests"], 1),
               "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"], "errors": r["rejected"],
               "service_us": us(service_pid, before[0]),
               "store_us": us(store_pids, before[1]) if store_pids else 0.0,
               "items_per_run": total / runs if runs else 0.0}
    finally:
        service.stop()
        if redis:
            redis.stop()
    print(f"{store} {items}-item calls: {row['items_per_s']:.0f} items/s, service {row['service_us']:.2f} µs "
          f"CPU/item, store {row['store_us']:.2f}, p99 {row['p99_ms']:.2f} ms, errors {row['errors']}", flush=True)
    return row


REPLICAS_HEADING = "### Replicas and Redis masters"


def script_runs(port):
    """Script runs (EVALSHA) the Redis on `port` has served since it started."""
    out = subprocess.run(["redis-cli", "-p", str(port), "INFO", "commandstats"], capture_output=True,
                         text=True).stdout
    m = re.search(r"cmdstat_evalsha:calls=(\d+)", out)
    return int(m.group(1)) if m else 0


def measure_replicas(replicas, cluster, seconds, items=10):
    """`replicas` services over one Redis or over a 3-master cluster (3 replicas of its own), each
    loaded by its own wrk (the load split evenly, as Envoy's round robin would): CPU per item of the
    services together and of every Redis process together."""
    import sections  # noqa: E402  (its RedisCluster)
    store = sections.RedisCluster() if cluster else None
    single = None
    if not cluster:
        port = harness.free_port()
        single = harness.Proc(harness.PROXY_CPU + ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                                                   "--save", "", "--appendonly", "no"])
        harness.wait_port(port)
    store_args = ["--redis-cluster", store.urls] if cluster else ["--redis", f"redis://127.0.0.1:{port}"]
    store_pids = store.pids() if cluster else [single.p.pid]
    services = []
    try:
        for _ in range(replicas):
            sport = harness.free_port()
            services.append((sport, harness.Proc(
                harness.PROXY_CPU + [str(harness.QUOTA), "--listen", f"127.0.0.1:{sport}", "--cold-start", "full"]
                + store_args, env={**os.environ, "RUST_LOG": "error"})))
        for sport, _ in services:
            harness.wait_http(f"http://127.0.0.1:{sport}/healthz")
        lua = LUA % (items, KEYS)
        connections = max(8 // replicas, 2)

        urls = [f"http://127.0.0.1:{sport}/v1/lease" for sport, _ in services]

        def load(duration):
            return sections.wrk_together(urls, duration, connections, lua=lua, pin=True)

        load(1)
        service_pids = [p.p.pid for _, p in services]
        before = harness.cpu_ticks(service_pids), harness.cpu_ticks(store_pids)
        results = load(seconds)
        total = sum(r["requests"] for r in results) * items
        us = lambda pids, b: (harness.cpu_ticks(pids) - b) / harness.CLK_TCK * 1e6 / max(total, 1)
        row = {"replicas": replicas, "store": "Redis Cluster (3 masters, 3 replicas)" if cluster else "one Redis",
               "items": items, "items_per_s": sum(r["rps"] for r in results) * items,
               "p99_ms": max(r["p99_ms"] for r in results), "errors": sum(r["rejected"] for r in results),
               "service_us": us(service_pids, before[0]), "store_us": us(store_pids, before[1])}
    finally:
        for _, p in services:
            p.stop()
        if store:
            store.stop()
        if single:
            single.stop()
    print(f"{replicas} replica(s) over {row['store']}: {row['items_per_s']:.0f} items/s, services "
          f"{row['service_us']:.2f} µs/item, Redis {row['store_us']:.2f} µs/item, p99 {row['p99_ms']:.1f} ms, "
          f"errors {row['errors']}", flush=True)
    return row


def replicas_lines(rows):
    out = [
        REPLICAS_HEADING,
        "",
        "`bench/quota_items.py --replicas`: 1 and 3 `tollgate-quota` replicas over one Redis and over a Redis "
        "Cluster of 3 masters (each with a replica), lease calls of 10 items over "
        f"{KEYS:,} keys, each replica loaded by its own wrk (the load split evenly, as Envoy's round robin "
        "does); every service and Redis process pinned to core 0, the load on core 1. On 2 cores wall-clock "
        "scaling cannot show: CPU per item is the figure, summed over the replicas and over every Redis "
        "process.",
        "",
        "| replicas | store | items/s | services' CPU µs/item | Redis CPU µs/item | p99 ms | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(f"| {r['replicas']} | {r['store']} | {r['items_per_s']:,.0f} | {r['service_us']:.2f} | "
                   f"{r['store_us']:.2f} | {r['p99_ms']:.1f} | {r['errors']} |")
    out += [
        "",
        "Reading: replicas hold nothing of their own (every bucket is in Redis), so they add service "
        "cores, but not for free: sharing one core here, three replicas spent more CPU per item than one "
        "(each runs its own runtime and Redis connections, and each wakes up for fewer calls). A key "
        "lives on one master, so masters add Redis cores for many keys, never for one hot key; the "
        "cluster costs more Redis CPU per item than one Redis (a script run per master a call's keys "
        "fall on, and the writes replicated to each master's replica, all counted here).",
        "",
    ]
    return out


def lines(rows):
    out = [
        HEADING,
        "",
        "`bench/quota_items.py`: `tollgate-quota` pinned to core 0 (Redis there too), wrk on core 1 posting "
        f"lease calls of 1, 10, 100 and 1 000 items over {KEYS:,} keys; CPU per item of the service and of "
        "Redis (the figure to read: items per second are one service core's while the other runs the load).",
        "",
        "| store | items per call | items/s | service CPU µs/item | items/s per service core | Redis CPU µs/item "
        "| items/s per Redis core | items per script run | p50 ms | p99 ms | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r["items_per_s"]:
            out.append(f"| {r['store']} | {r['items']} | 0 | — | — | — | — | — | {r['p50_ms']:.2f} | "
                       f"{r['p99_ms']:.2f} | {r['errors']} |")
            continue
        per_core = 1e6 / r["service_us"] if r["service_us"] else float("nan")
        redis = (f"{r['store_us']:.2f} | {1e6 / r['store_us']:,.0f} | {r.get('items_per_run', 0):.1f}"
                 if r["store"] == "redis" and r["store_us"] else " | | ")
        out.append(f"| {r['store']} | {r['items']} | {r['items_per_s']:,.0f} | {r['service_us']:.2f} | "
                   f"{per_core:,.0f} | {redis} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['errors']} |")
    out += [
        "",
        "Reading (profiled with `perf record -e cpu-clock` on the service and callgrind on Redis): "
        "most of a small call's cost is per call, not per item, and more than half of a one-item call's is "
        "the kernel's TCP work for one HTTP/1.1 request and answer; the filter sends each worker's items "
        "together, once per tick, so calls of one item are the exception. On Redis, a script run has a "
        "fixed cost as large as a few items' (see the instructions below), so lease calls that come while "
        "a run is out go together in the next (the items per script run: wrk's 32 connections of one-item "
        "calls make runs of about a dozen items). Calls of 1 000 items are sent 3 at a time (1 and 10: 32; "
        "100: 8): with 8 at once they queued on the single Redis core past the 100 ms storage timeout "
        "on a slow hour of this VM (the errors column: calls answered with an error, whose proxies fall "
        "back as configured; the CPU columns are per item served, so a row that served none shows none). This VM moves every CPU figure here by up "
        "to 2× from one run to the next: judge a change by the instructions below.",
        "",
    ]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--stores", default="memory,redis")
    ap.add_argument("--sizes", default="1,10,100,1000")
    ap.add_argument("--keys", type=int, default=KEYS)
    ap.add_argument("--replicas", action="store_true", help="1 and 3 replicas over one Redis and a cluster")
    args = ap.parse_args()
    if args.replicas:
        rows = [measure_replicas(n, cluster, args.seconds) for cluster in (False, True) for n in (1, 3)]
        publish("quota_replicas", REPLICAS_HEADING, replicas_lines(rows), rows)
        return
    rows = [measure(store, int(n), args.seconds, args.keys)
            for store in args.stores.split(",") for n in args.sizes.split(",")]
    publish("quota_items", HEADING, lines(rows), rows)


def publish(name, heading, section, rows):
    """Keep `rows` in bench/results.json under `name`, print the section and write it into
    docs/benchmarks.md under `heading`."""
    path = REPO / "bench/results.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    saved[name] = rows
    path.write_text(json.dumps(saved, indent=1))
    print("\n".join(section))
    harness.splice_section(REPO / "docs/benchmarks.md", heading, section)

if __name__ == "__main__":
    main()
