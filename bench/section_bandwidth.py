"""Bandwidth per key: tollgate's byte limit against nginx's limit_rate and Envoy's bandwidth_limit.

Part of `make bench` (`bench/sections.py` lists the sections)."""
import os
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request

import harness
from section_common import TESTBED, rule_stat, tollgate_module, upstream_cluster, workers_used
from harness import (EnvoyServer, Proc, free_port, wasm_filter)


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
