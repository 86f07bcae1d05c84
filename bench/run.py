#!/usr/bin/env python3
"""tollgate benchmarks: the proxy's CPU per request, throughput and latency, side by side with what
users would pick instead, in one run on this machine. Writes docs/benchmarks.md and
docs/benchmarks.png. Run through `make bench` (it builds and installs what this needs).

Every figure is the median of interleaved rounds. The CPU figure (user+sys of the proxy process
over the run, divided by requests) is the one to trust on a noisy shared machine.
"""
import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENVOY = REPO / ".venv/bin/envoy"
TOLLGATE = REPO / "dist/release/tollgate.wasm"
NOOP = REPO / "bench/noop/target/wasm32-wasip1/release/tollgate_bench_noop.wasm"
QUOTA = REPO / "target/release/tollgate-quota"
CLK_TCK = os.sysconf("SC_CLK_TCK")
HUGE = 1_000_000_000  # a limit nobody reaches: every request allowed
# The proxy on one core and the load on the other: far less noise than letting them compete.
CORES = os.cpu_count() or 1
PROXY_CPU = ["taskset", "-c", "0"] if CORES >= 2 else []
LOAD_CPU = ["taskset", "-c", f"1-{CORES - 1}"] if CORES >= 2 else []
LOAD_THREADS = max(1, CORES - 1)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url, timeout=1).read()
            return
        except Exception:
            time.sleep(0.05)
    raise RuntimeError(f"{url} not ready")


def wait_port(port, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"port {port} not ready")


def cpu_ticks(pids):
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime + stime
    return total


class Proc:
    """A child process, stopped on exit."""

    def __init__(self, args, **kw):
        self.p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True, **kw)

    def stop(self):
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()


# ---------------------------------------------------------------- Envoy configurations

def envoy_config(port, admin, http_filters, extra_clusters=(), route_extra=None):
    route = {"match": {"prefix": "/"}, "direct_response": {"status": 200, "body": {"inline_string": "ok\n"}}}
    if route_extra:
        route.update(route_extra)
    return {
        "static_resources": {
            "listeners": [{
                "name": "bench",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "bench",
                        "use_remote_address": True,
                        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [route]}]},
                        "http_filters": list(http_filters) + [{
                            "name": "envoy.filters.http.router",
                            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
                        }],
                    },
                }]}],
            }],
            "clusters": list(extra_clusters),
        },
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
    }


def wasm_filter(path, plugin):
    return {
        "name": "envoy.filters.http.wasm",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": {
                "root_id": "tollgate",
                "vm_config": {"vm_id": "tollgate", "runtime": "envoy.wasm.runtime.v8",
                              "code": {"local": {"filename": str(path)}}},
                "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue",
                                  "value": json.dumps(plugin)},
            },
        },
    }


def native_local_ratelimit(tokens):
    """Envoy's local_ratelimit with one bucket per client address (dynamic descriptors)."""
    bucket = {"max_tokens": tokens, "tokens_per_fill": tokens, "fill_interval": "60s"}
    return {
        "name": "envoy.filters.http.local_ratelimit",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
            "stat_prefix": "local",
            "token_bucket": {"max_tokens": HUGE, "tokens_per_fill": HUGE, "fill_interval": "1s"},
            "filter_enabled": {"runtime_key": "le", "default_value": {"numerator": 100, "denominator": "HUNDRED"}},
            "filter_enforced": {"runtime_key": "lf", "default_value": {"numerator": 100, "denominator": "HUNDRED"}},
            "descriptors": [{"entries": [{"key": "remote_address"}], "token_bucket": bucket}],
            "max_dynamic_descriptors": 100000,
            "rate_limits": [{"actions": [{"remote_address": {}}]}],
        },
    }


def quota_cluster(port):
    return {
        "name": "quota", "type": "STATIC", "connect_timeout": "0.25s",
        "load_assignment": {"cluster_name": "quota", "endpoints": [{"lb_endpoints": [{"endpoint": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]},
    }


def tollgate_plugin(requests, key=("client_ip",), scope=None, mode=None):
    rule = {"name": "bench", "key": list(key), "limit": {"requests": requests, "per": "1m"}}
    plugin = {"rules": [rule]}
    if scope:
        rule["scope"] = scope
        rule["max_keys"] = 20000
        plugin["quota_service"] = {"upstream": "quota", "timeout": "200ms", "mode": mode or "lease"}
    elif len(key) == 1 and key[0].startswith("header:"):
        rule["max_keys"] = 20000
    return plugin


class EnvoyServer:
    def __init__(self, filters, clusters=(), concurrency=1):
        self.port, self.admin = free_port(), free_port()
        self.dir = tempfile.mkdtemp(prefix="tollgate-bench-")
        cfg = Path(self.dir) / "envoy.json"
        cfg.write_text(json.dumps(envoy_config(self.port, self.admin, filters, clusters)))
        self.proc = Proc(PROXY_CPU + [str(ENVOY), "-c", str(cfg), "--concurrency", str(concurrency),
                          "--disable-hot-restart", "-l", "error", "--base-id", str(free_port())])
        wait_http(f"http://127.0.0.1:{self.admin}/ready")
        self.url = f"http://127.0.0.1:{self.port}/"
        self.pids = [self.proc.p.pid]

    def rss_kib(self):
        for line in open(f"/proc/{self.proc.p.pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    def stop(self):
        self.proc.stop()


class NginxServer:
    def __init__(self, limit):
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="tollgate-bench-nginx-"))
        zone = ""
        apply = ""
        if limit == "allowed":
            zone = "limit_req_zone $binary_remote_addr zone=perip:10m rate=1000000r/s;"
            apply = "limit_req zone=perip burst=100000 nodelay; limit_req_status 429;"
        elif limit == "rejected":
            zone = "limit_req_zone $binary_remote_addr zone=perip:10m rate=1r/m;"
            apply = "limit_req zone=perip burst=1 nodelay; limit_req_status 429;"
        (self.dir / "nginx.conf").write_text(f"""
worker_processes 1;
daemon off;
pid {self.dir}/nginx.pid;
error_log {self.dir}/error.log error;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_body_temp_path {self.dir};
  proxy_temp_path {self.dir};
  fastcgi_temp_path {self.dir};
  uwsgi_temp_path {self.dir};
  scgi_temp_path {self.dir};
  {zone}
  server {{
    listen 127.0.0.1:{self.port};
    root {self.dir};
    default_type text/plain;
    # A static file (content phase): `return` would answer before limit_req runs.
    location / {{ {apply} try_files /ok =404; }}
  }}
}}
""")
        (self.dir / "ok").write_text("ok\n")
        self.proc = Proc(PROXY_CPU + ["nginx", "-c", str(self.dir / "nginx.conf"), "-p", str(self.dir)])
        self.url = f"http://127.0.0.1:{self.port}/"
        wait_port(self.port)
        self.pids = [int(p) for p in subprocess.check_output(
            ["pgrep", "-g", str(self.proc.p.pid)]).split()]

    def stop(self):
        self.proc.stop()


# ---------------------------------------------------------------- load

WRK_KEYS = """
counter = 0
request = function()
  counter = counter + 1
  return wrk.format(nil, nil, {["x-key"] = "k" .. (counter % %d)})
end
"""


def wrk(url, seconds, connections=32, keys=None):
    args = LOAD_CPU + ["wrk", f"-t{LOAD_THREADS}", f"-c{connections}", f"-d{seconds}s", "--latency"]
    script = None
    if keys:
        script = tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False)
        script.write(WRK_KEYS.replace("%d", str(keys)))
        script.close()
        args += ["-s", script.name]
    out = subprocess.run(args + [url], capture_output=True, text=True, timeout=seconds + 30).stdout
    if script:
        os.unlink(script.name)
    return out


def parse_wrk(out):
    def latency(label):
        m = re.search(rf"^\s+{label}%\s+([\d.]+)(us|ms|s)", out, re.M)
        if not m:
            return float("nan")
        v, unit = float(m.group(1)), m.group(2)
        return v / 1000 if unit == "us" else v * 1000 if unit == "s" else v
    requests = int(re.search(r"(\d+) requests in", out).group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"requests": requests, "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
            "p50_ms": latency("50"), "p99_ms": latency("99"),
            "rejected": int(non2xx.group(1)) if non2xx else 0}


def measure(server, seconds, keys=None):
    wrk(server.url, 1, keys=keys)  # warm-up: connections, JIT, caches
    before = cpu_ticks(server.pids)
    out = wrk(server.url, seconds, keys=keys)
    after = cpu_ticks(server.pids)
    r = parse_wrk(out)
    r["cpu_us"] = (after - before) / CLK_TCK * 1e6 / max(r["requests"], 1)
    return r


# ---------------------------------------------------------------- the comparison

def setups(quota_port, quota_redis_port):
    """(name, path, factory, wrk keys) for every configuration compared."""
    def envoy(filters, clusters=()):
        return lambda: EnvoyServer(filters, clusters)
    tg = lambda plugin, clusters=(): envoy([wasm_filter(TOLLGATE, plugin)], clusters)
    out = []
    for path, limit in (("allowed", HUGE), ("rejected", 1)):
        out += [
            ("Envoy, no filter", path, envoy([]), None) if path == "allowed" else None,
            ("Envoy + do-nothing Wasm filter", path, envoy([wasm_filter(NOOP, {})]), None) if path == "allowed" else None,
            ("Envoy local_ratelimit per client IP", path, envoy([native_local_ratelimit(limit)]), None),
            ("tollgate token bucket per client IP", path, tg(tollgate_plugin(limit)), None),
            ("tollgate, 10 000 active keys", path, tg(tollgate_plugin(limit, key=("header:x-key",))), 10000),
            ("nginx, no limiting", path, lambda: NginxServer(None), None) if path == "allowed" else None,
            ("nginx limit_req per IP", path, lambda path=path: NginxServer(path), None),
            ("tollgate global, lease (memory)", path, tg(tollgate_plugin(limit, scope="global"), [quota_cluster(quota_port)]), None),
            ("tollgate global, lease (Redis)", path, tg(tollgate_plugin(limit, scope="global"), [quota_cluster(quota_redis_port)]), None),
            ("tollgate global, strict (memory)", path, tg(tollgate_plugin(limit, scope="global", mode="strict"), [quota_cluster(quota_port)]), None),
        ]
    return [s for s in out if s]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=int, default=4)
    ap.add_argument("--only", help="substring of the configurations to run")
    args = ap.parse_args()

    quota = Proc([str(QUOTA), "--listen", f"127.0.0.1:{(qp := free_port())}"], env={**os.environ, "RUST_LOG": "error"})
    redis_port = free_port()
    redis = Proc(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
    time.sleep(0.3)
    quota_redis = Proc([str(QUOTA), "--listen", f"127.0.0.1:{(qrp := free_port())}", "--redis",
                        f"redis://127.0.0.1:{redis_port}"], env={**os.environ, "RUST_LOG": "error"})
    wait_http(f"http://127.0.0.1:{qp}/healthz")
    wait_http(f"http://127.0.0.1:{qrp}/healthz")
    results = {}
    try:
        todo = [s for s in setups(qp, qrp) if not args.only or args.only in s[0]]
        for r in range(args.rounds):
            for name, path, factory, keys in todo:
                server = factory()
                try:
                    m = measure(server, args.seconds, keys)
                finally:
                    server.stop()
                results.setdefault((name, path), []).append(m)
                print(f"round {r + 1} {name} [{path}]: {m['cpu_us']:.1f} us/req, {m['rps']:.0f} req/s, "
                      f"p50 {m['p50_ms']:.2f} ms, p99 {m['p99_ms']:.2f} ms, rejected {m['rejected']}/{m['requests']}",
                      flush=True)
    finally:
        for p in (quota, quota_redis, redis):
            p.stop()
    medians = {k: {f: statistics.median(m[f] for m in v) for f in v[0]} for k, v in results.items()}
    rows = [{"setup": k[0], "path": k[1], "rounds": len(results[k]),
             "cpu_min": min(m["cpu_us"] for m in results[k]),
             "cpu_max": max(m["cpu_us"] for m in results[k]), **v}
            for k, v in medians.items()]
    Path(REPO / "bench/results.json").write_text(json.dumps(rows, indent=1))
    if not args.only:
        report(rows, args)


def report(rows, args):
    """docs/benchmarks.md and docs/benchmarks.png from the medians."""
    get = {(r["setup"], r["path"]): r for r in rows}
    base = get[("Envoy, no filter", "allowed")]["cpu_us"]
    floor = get[("Envoy + do-nothing Wasm filter", "allowed")]["cpu_us"]
    ng = get[("nginx, no limiting", "allowed")]["cpu_us"]
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `make bench` (`bench/run.py`) on {time.strftime('%Y-%m-%d')}, on this project's "
        f"{os.cpu_count()}-core machine: each proxy with one worker (Envoy `--concurrency 1`, nginx "
        "`worker_processes 1`) pinned to core 0, a static 200 answered by the proxy itself, "
        f"`wrk -t{LOAD_THREADS} -c32 --latency` pinned to the other core(s) on "
        f"loopback for {args.seconds} s after a 1 s warm-up, {args.rounds} interleaved rounds, medians. "
        "**CPU µs/request** is the proxy process's user+sys time over the run divided by the requests "
        "served: the figure to trust on a shared machine (throughput and latency move with whatever "
        "else runs). tollgate is the `make dist` module (`wasm-opt -O`).",
        "",
        "- **allowed**: the limit is never reached (the cost of the decision);",
        "- **rejected**: the limit is 1 per minute, so nearly every request gets a 429 (a 429 storm).",
        "",
        "![CPU per request](benchmarks.png)",
        "",
    ]
    for path in ("allowed", "rejected"):
        lines += [f"## {path.capitalize()}", "",
                  "| setup | CPU µs/request | (rounds' range) | vs Envoy, no filter | vs do-nothing Wasm | requests/s | p50 ms | p99 ms | refused |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if r["path"] != path:
                continue
            nginx = r["setup"].startswith("nginx")
            vs_base = "" if nginx else f"{r['cpu_us'] / base:.2f}×"
            vs_floor = "" if nginx else f"{r['cpu_us'] - floor:+.1f} µs"
            refused = f"{r['rejected'] / max(r['requests'], 1):.0%}"
            spread = f"{r.get('cpu_min', r['cpu_us']):.1f}–{r.get('cpu_max', r['cpu_us']):.1f}"
            lines.append(f"| {r['setup']} | {r['cpu_us']:.1f} | {spread} | {vs_base} | {vs_floor} | {r['rps']:.0f} | "
                         f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {refused} |")
        lines.append("")
    native = get[("Envoy local_ratelimit per client IP", "allowed")]["cpu_us"] - base
    ours = get[("tollgate token bucket per client IP", "allowed")]["cpu_us"] - floor
    nginx_lr = get[("nginx limit_req per IP", "allowed")]["cpu_us"] - ng
    lines += [
        "## Decision cost",
        "",
        f"- tollgate's own decision (per-client-IP token bucket minus the do-nothing Wasm filter): **{ours:.1f} µs**",
        f"- Envoy's native local_ratelimit (minus Envoy without filters): {native:.1f} µs",
        f"- nginx limit_req (minus nginx without limiting): {nginx_lr:.1f} µs",
        f"- the Wasm floor (do-nothing filter minus no filter): {floor - base:.1f} µs",
        "",
        "Read differences of a few µs against the rounds' range: on this shared machine one setup's "
        "CPU per request moves by several µs from round to round (the range column), so a difference "
        "smaller than the ranges is noise, not a result.",
        "",
    ]
    (REPO / "docs/benchmarks.md").write_text("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no chart")
        return
    fig, axes = plt.subplots(1, 2, figsize=(14, 6), sharex=True)
    for ax, path in zip(axes, ("allowed", "rejected")):
        data = [r for r in rows if r["path"] == path]
        ax.barh([r["setup"] for r in data], [r["cpu_us"] for r in data],
                color=["#d62728" if "tollgate" in r["setup"] else "#7f7f7f" for r in data])
        ax.invert_yaxis()
        ax.set_title("everything allowed" if path == "allowed" else "a 429 storm")
        ax.set_xlabel("proxy CPU µs per request (lower is better)")
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(REPO / "docs/benchmarks.png", dpi=90)


if __name__ == "__main__":
    sys.exit(main())
