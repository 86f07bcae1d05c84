"""What the benchmarks stand on: paths, processes, Envoy configurations, wrk, and the CPU a proxy
spends. `run.py`, the `section_*.py` modules, `ab.py` and `flood.py` use it.
"""
import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENVOY = REPO / ".venv/bin/envoy"
TOLLGATE = REPO / "dist/release/tollgate.wasm"
NOOP = REPO / "bench/noop/target/wasm32-wasip1/release/tollgate_bench_noop.wasm"
# Do-nothing modules on the raw ABI: the two callbacks Envoy needs, and every callback tollgate
# exports (as a module that also runs in nginx must).
RAW_NOOP = REPO / "bench/rawnoop/target/wasm32-wasip1/release/tollgate_bench_rawnoop.wasm"
RAW_NOOP_ALL = REPO / "bench/rawnoop/target/every-callback/wasm32-wasip1/release/tollgate_bench_rawnoop.wasm"
# tollgate built with `--features probe` (times its callbacks) and the host-call probe filter.
TOLLGATE_PROBE = REPO / "target/probe/wasm32-wasip1/release/tollgate.wasm"
HOST_PROBE = REPO / "bench/probe/target/wasm32-wasip1/release/tollgate_bench_probe.wasm"
# The dynamic modules, where Envoy finds them by name (`make bench-modules` copies them there):
# tollgate's native build (`make dist`'s libtollgate.so) and a do-nothing one (libnoop.so).
NATIVE_DIR = REPO / "target/bench-native"
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

def envoy_config(port, admin, http_filters, extra_clusters=(), upstream=None, route_extra=None):
    route = {"match": {"prefix": "/"}, "direct_response": {"status": 200, "body": {"inline_string": "ok\n"}}}
    if upstream:
        route = {"match": {"prefix": "/"}, "route": {"cluster": upstream, "timeout": "10s"}}
    route.update(route_extra or {})  # e.g. a filter's per-route configuration
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


def native_filter(plugin, module="tollgate"):
    """tollgate's native build (an Envoy dynamic module) with `plugin`; `module="noop"`: the
    do-nothing one."""
    return {
        "name": "envoy.filters.http.dynamic_modules",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.dynamic_modules.v3.DynamicModuleFilter",
            "dynamic_module_config": {"name": module},
            "filter_name": "tollgate",
            "filter_config": {"@type": "type.googleapis.com/google.protobuf.StringValue",
                              "value": json.dumps(plugin)},
        },
    }


def native_env():
    """The environment an Envoy needs to find the dynamic modules."""
    return {**os.environ, "ENVOY_DYNAMIC_MODULES_SEARCH_PATH": str(NATIVE_DIR)}


def native_local_ratelimit(tokens, action=None, entry="remote_address", max_keys=100000):
    """Envoy's local_ratelimit with one bucket per value of a descriptor entry (dynamic descriptors):
    by default per client address."""
    bucket = {"max_tokens": tokens, "tokens_per_fill": tokens, "fill_interval": "60s"}
    return {
        "name": "envoy.filters.http.local_ratelimit",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
            "stat_prefix": "local",
            "token_bucket": {"max_tokens": HUGE, "tokens_per_fill": HUGE, "fill_interval": "1s"},
            "filter_enabled": {"runtime_key": "le", "default_value": {"numerator": 100, "denominator": "HUNDRED"}},
            "filter_enforced": {"runtime_key": "lf", "default_value": {"numerator": 100, "denominator": "HUNDRED"}},
            "descriptors": [{"entries": [{"key": entry}], "token_bucket": bucket}],
            "max_dynamic_descriptors": max_keys,
            "rate_limits": [{"actions": [action or {"remote_address": {}}]}],
        },
    }


def native_one_bucket(tokens):
    """Envoy's local_ratelimit with one bucket for everyone (no descriptors)."""
    cfg = native_local_ratelimit(tokens)
    tc = cfg["typed_config"]
    for field in ("descriptors", "max_dynamic_descriptors", "rate_limits"):
        del tc[field]
    tc["token_bucket"] = {"max_tokens": tokens, "tokens_per_fill": tokens, "fill_interval": "60s"}
    return cfg


def quota_cluster(port, name="quota"):
    return {
        "name": name, "type": "STATIC", "connect_timeout": "0.25s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]},
    }


def tollgate_plugin(requests, key=("client_ip",), scope=None, mode=None, rule_extra=None, extra=None, per="1m"):
    rule = {"name": "bench", "key": list(key), "limit": {"requests": requests, "per": per}}
    plugin = {"rules": [rule]}
    if scope:
        rule["scope"] = scope
        rule["max_keys"] = 20000
        plugin["quota_service"] = {"upstream": "quota", "timeout": "200ms", "mode": mode or "lease"}
    elif len(key) == 1 and key[0].startswith("header:"):
        rule["max_keys"] = 20000
    rule.update(rule_extra or {})
    plugin.update(extra or {})
    return plugin


class EnvoyServer:
    def __init__(self, filters, clusters=(), concurrency=1, pin=True, upstream=None, route_extra=None):
        self.port, self.admin = free_port(), free_port()
        self.dir = tempfile.mkdtemp(prefix="tollgate-bench-")
        cfg = Path(self.dir) / "envoy.json"
        cfg.write_text(json.dumps(envoy_config(self.port, self.admin, filters, clusters, upstream, route_extra)))
        self.proc = Proc((PROXY_CPU if pin else []) + [str(ENVOY), "-c", str(cfg), "--concurrency", str(concurrency),
                          "--disable-hot-restart", "-l", "error", "--base-id", str(free_port())],
                         env=native_env())
        wait_http(f"http://127.0.0.1:{self.admin}/ready")
        self.url = f"http://127.0.0.1:{self.port}/"
        self.pids = [self.proc.p.pid]

    def stat(self, name):
        """A stat's value (0 if absent); the filter's own stats carry Envoy's `wasmcustom.` prefix
        (the dynamic module's, `dynamicmodulescustom.`: both are asked for)."""
        if name.startswith("wasmcustom."):
            return self.stat_named(name) + self.stat_named("dynamicmodulescustom." + name[len("wasmcustom."):])
        return self.stat_named(name)

    def stat_named(self, name):
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/stats?filter={re.escape(name)}$",
                                      timeout=5).read().decode()
        for line in text.splitlines():
            k, _, v = line.partition(": ")
            if k == name:
                return int(v)
        return 0

    def rss_kib(self):
        for line in open(f"/proc/{self.proc.p.pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    def stop(self):
        self.proc.stop()


class NginxServer:
    """nginx (one worker, pinned) serving a static file: with `limit_req` per IP (`limit`
    "allowed" or "rejected"), or — with `binary` an nginx built with ngx_wasm_module — with
    `module` as a proxy-wasm filter configured by `plugin`."""

    def __init__(self, limit, binary="nginx", module=None, plugin=None):
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="tollgate-bench-nginx-"))
        zone = ""
        apply = ""
        wasm = ""
        if module:
            wasm = f"wasm {{ module filter {module}; shm_kv * 16m eviction=none; }}"
            config = json.dumps(plugin or {}).replace("\\", "\\\\").replace("'", "\\'")
            apply = f"proxy_wasm filter '{config}';"
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
{wasm}
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
        self.proc = Proc(PROXY_CPU + [binary, "-c", str(self.dir / "nginx.conf"), "-p", str(self.dir)])
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


def wrk_args(url, seconds, connections=32, keys=None, lua=None, pin=True):
    """The wrk command line, and a script file to delete afterwards (or None)."""
    args = (LOAD_CPU if pin else []) + ["wrk", f"-t{LOAD_THREADS if pin else 1}", f"-c{connections}",
                                        f"-d{seconds}s", "--latency"]
    script = None
    if keys or lua:
        script = tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False)
        script.write(lua or WRK_KEYS.replace("%d", str(keys)))
        script.close()
        args += ["-s", script.name]
    return args + [url], script


def wrk(url, seconds, connections=32, keys=None, lua=None, pin=True):
    args, script = wrk_args(url, seconds, connections, keys, lua, pin)
    out = subprocess.run(args, capture_output=True, text=True, timeout=seconds + 30).stdout
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
    m = re.search(r"requests in ([\d.]+)(ms|s|m),", out)
    took = float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60}[m.group(2)] if m else float("nan")
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"requests": requests, "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
            "p50_ms": latency("50"), "p99_ms": latency("99"),
            "rejected": int(non2xx.group(1)) if non2xx else 0, "seconds": took}


def perf_counts_instructions():
    """True if `perf stat` can count retired instructions here (not in most VMs)."""
    try:
        out = subprocess.run(["perf", "stat", "-x,", "-e", "instructions", "true"],
                             capture_output=True, text=True, timeout=10).stderr
    except (OSError, subprocess.TimeoutExpired):
        return False
    return any(line.split(",")[0].strip().isdigit() for line in out.splitlines())


PERF_INSTRUCTIONS = perf_counts_instructions()


def measure(server, seconds, keys=None, record=None):
    """One measured run after a warm-up; with `record`, the proxy is also sampled into that
    `perf record` file while it runs."""
    wrk(server.url, 1, keys=keys)  # warm-up: connections, JIT, caches
    calls = lambda: server.stat("wasmcustom.tollgate.quota.calls") if isinstance(server, EnvoyServer) else 0
    calls_before = calls()
    counter = None
    if PERF_INSTRUCTIONS:
        counter = subprocess.Popen(["perf", "stat", "-x,", "-e", "instructions", "-p",
                                    ",".join(str(p) for p in server.pids)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sampler = None
    if record:
        sampler = subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-o", record, "-p",
                                    ",".join(str(p) for p in server.pids)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    before = cpu_ticks(server.pids)
    out = wrk(server.url, seconds, keys=keys)
    after = cpu_ticks(server.pids)
    if sampler:
        sampler.send_signal(signal.SIGINT)
        sampler.wait(timeout=30)
    r = parse_wrk(out)
    r["cpu_us"] = (after - before) / CLK_TCK * 1e6 / max(r["requests"], 1)
    r["instructions"] = None
    if counter:
        counter.send_signal(signal.SIGINT)
        _, err = counter.communicate(timeout=10)
        counts = [int(line.split(",")[0]) for line in err.splitlines() if line.split(",")[0].strip().isdigit()]
        if counts:
            r["instructions"] = counts[0] / max(r["requests"], 1)
    r["calls_per_1000"] = (calls() - calls_before) * 1000 / max(r["requests"], 1)
    return r


# ---------------------------------------------------------------- the comparison

def setups(quota_port, quota_redis_port):
    """(name, path, factory, wrk keys) for every configuration compared."""
    def envoy(filters, clusters=()):
        return lambda: EnvoyServer(filters, clusters)
    tg = lambda plugin, clusters=(): envoy([wasm_filter(TOLLGATE, plugin)], clusters)
    tn = lambda plugin, clusters=(): envoy([native_filter(plugin)], clusters)
    out = []
    for path, limit in (("allowed", HUGE), ("rejected", 1)):
        out += [
            ("Envoy, no filter", path, envoy([]), None) if path == "allowed" else None,
            ("Envoy + SDK do-nothing filter", path, envoy([wasm_filter(NOOP, {})]), None) if path == "allowed" else None,
            ("Envoy + raw-ABI do-nothing, 2 callbacks", path, envoy([wasm_filter(RAW_NOOP, {})]), None)
            if path == "allowed" else None,
            ("Envoy + raw-ABI do-nothing, every callback", path, envoy([wasm_filter(RAW_NOOP_ALL, {})]), None)
            if path == "allowed" else None,
            ("tollgate, one rule that matches nothing", path,
             tg({"rules": [{"name": "bench", "match": {"path": "/never"}, "limit": {"requests": 1, "per": "1m"}}]}),
             None) if path == "allowed" else None,
            ("Envoy local_ratelimit per client IP", path, envoy([native_local_ratelimit(limit)]), None),
            ("tollgate token bucket per client IP", path, tg(tollgate_plugin(limit)), None),
            ("tollgate per client IP, no rate-limit headers", path,
             tg(tollgate_plugin(limit, extra={"rate_limit_headers": "none"})), None),
            ("tollgate per client IP, worker_batch 0 (no stash)", path,
             tg(tollgate_plugin(limit, rule_extra={"worker_batch": 0})), None),
            ("Envoy local_ratelimit, one bucket", path, envoy([native_one_bucket(limit)]), None)
            if path == "allowed" else None,
            ("tollgate one bucket (no key), no rate-limit headers", path,
             tg(tollgate_plugin(limit, key=(), extra={"rate_limit_headers": "none"})), None)
            if path == "allowed" else None,
            ("tollgate, 10 000 active keys", path, tg(tollgate_plugin(limit, key=("header:x-key",))), 10000),
            ("nginx, no limiting", path, lambda: NginxServer(None), None) if path == "allowed" else None,
            ("nginx limit_req per IP", path, lambda path=path: NginxServer(path), None),
            ("tollgate global, lease (memory)", path, tg(tollgate_plugin(limit, scope="global"), [quota_cluster(quota_port)]), None),
            ("tollgate global, lease (Redis)", path, tg(tollgate_plugin(limit, scope="global"), [quota_cluster(quota_redis_port)]), None),
            ("tollgate global, strict (memory)", path, tg(tollgate_plugin(limit, scope="global", mode="strict"), [quota_cluster(quota_port)]), None),
        ]
        # The native build (an Envoy dynamic module) in the same setups, and its own floor.
        out += [
            ("Envoy + do-nothing dynamic module", path, envoy([native_filter({}, module="noop")]), None)
            if path == "allowed" else None,
            (NATIVE + ", one rule that matches nothing", path,
             tn({"rules": [{"name": "bench", "match": {"path": "/never"}, "limit": {"requests": 1, "per": "1m"}}]}),
             None) if path == "allowed" else None,
            (NATIVE + " token bucket per client IP", path, tn(tollgate_plugin(limit)), None),
            (NATIVE + " per client IP, no rate-limit headers", path,
             tn(tollgate_plugin(limit, extra={"rate_limit_headers": "none"})), None),
            (NATIVE + " per client IP, worker_batch 8 (stash)", path,
             tn(tollgate_plugin(limit, rule_extra={"worker_batch": 8})), None),
            (NATIVE + " one bucket (no key), no rate-limit headers", path,
             tn(tollgate_plugin(limit, key=(), extra={"rate_limit_headers": "none"})), None)
            if path == "allowed" else None,
            (NATIVE + ", 10 000 active keys", path, tn(tollgate_plugin(limit, key=("header:x-key",))), 10000),
            (NATIVE + " global, lease (memory)", path, tn(tollgate_plugin(limit, scope="global"), [quota_cluster(quota_port)]), None),
            (NATIVE + " global, lease (Redis)", path, tn(tollgate_plugin(limit, scope="global"), [quota_cluster(quota_redis_port)]), None),
            (NATIVE + " global, strict (memory)", path, tn(tollgate_plugin(limit, scope="global", mode="strict"), [quota_cluster(quota_port)]), None),
        ]
    return [s for s in out if s]


# Setup names of the native build: the Wasm build's with this instead of "tollgate".
NATIVE = "tollgate native"


# ---------------------------------------------------------------- the report's sections

def kept_section(path, heading):
    """The lines of the section under `heading` of a Markdown file as it stands (none if absent):
    a section another script wrote, kept when the report is rewritten without its results."""
    text = path.read_text() if path.exists() else ""
    start = text.find(heading + "\n")
    if start < 0:
        return []
    # Up to the next heading of its level or above (a subsection keeps its own sub-headings).
    level = len(heading) - len(heading.lstrip("#"))
    after = re.search(r"\n#{1,%d} " % level, text[start + len(heading):])
    end = start + len(heading) + after.start() + 1 if after else len(text)
    return text[start:end].rstrip("\n").split("\n") + [""]


def splice_section(path, heading, lines):
    """Replace the section under `heading` (up to the next heading of its level or above) of a
    Markdown file with `lines`, or put it before `## Noise` (else at the end)."""
    text = path.read_text()
    block = "\n".join(lines).rstrip("\n") + "\n\n"
    start = text.find(heading + "\n")
    if start >= 0:
        level = len(heading) - len(heading.lstrip("#"))
        after = re.search(r"\n#{1,%d} " % level, text[start + len(heading):])
        end = start + len(heading) + after.start() if after else -1
        text = text[:start] + block + (text[end + 1:] if end >= 0 else "")
    else:
        at = text.find("\n## Noise\n")
        text = text[:at + 1] + block + text[at + 1:] if at >= 0 else text.rstrip("\n") + "\n\n" + block
    path.write_text(text)


# ---------------------------------------------------------------- headline figures

HEADLINES_MARK = "<!-- headlines: "
GROWTH_FLAG = 0.05  # a growth above this is flagged


def recorded_headlines(path):
    """The headline figures docs/benchmarks.md recorded (its `headlines` comment), if any."""
    if not path.exists():
        return {}
    for line in path.read_text().splitlines():
        if line.startswith(HEADLINES_MARK):
            try:
                return json.loads(line[len(HEADLINES_MARK):].removesuffix("-->").strip())
            except json.JSONDecodeError:
                return {}
    return {}


def compare_headlines(recorded, now):
    """Print each headline figure next to the recorded one; flag a growth above 5%. Returns the
    names of the figures that grew so."""
    grown = []
    print("\nheadline figures (recorded in docs/benchmarks.md → this run):")
    for name, value in now.items():
        before = recorded.get(name)
        if before is None:
            print(f"  {name}: {value:.2f} (none recorded)")
            continue
        growth = (value - before) / abs(before) if before else 0.0
        flag = "  <-- grew more than 5%" if growth > GROWTH_FLAG else ""
        print(f"  {name}: {before:.2f} → {value:.2f} ({growth:+.1%}){flag}")
        if flag:
            grown.append(name)
    return grown
