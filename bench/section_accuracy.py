"""Accuracy at 2 workers and across proxies, and memory against distinct keys; the load helpers the other sections share.

Part of `make bench` (`bench/sections.py` lists the sections)."""
import asyncio
import math
import threading

import harness
from section_common import answered_2xx, workers_used, wrk_together
from harness import (HUGE, TOLLGATE, EnvoyServer, free_port, parse_wrk, quota_cluster, tollgate_plugin, wasm_filter, wrk)


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
