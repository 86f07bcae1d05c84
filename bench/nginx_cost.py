#!/usr/bin/env python3
"""CPU per request of nginx with Kong's ngx_wasm_module: without a module, with the SDK's
do-nothing filter, with tollgate and one rule that matches no request, and with tollgate per client
IP (draft headers on) — interleaved rounds, one worker pinned, wrk on the other core; the ratios
are the medians of each round's ratio to the do-nothing filter (drift between rounds cancels).

    NGINX_BIN=/path/to/nginx-with-wasm bench/nginx_cost.py --rounds 7 --seconds 3

Prints a markdown table for docs/benchmarks.md. nginx-light (Debian) has no Wasm: build one as
docs/nginx.md says.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

REPO = harness.REPO
NOOP = REPO / "bench/noop/target/wasm32-wasip1/release/tollgate_bench_noop.wasm"
TOLLGATE = REPO / "dist/tollgate.wasm"
NEVER = {"rules": [{"name": "r", "match": {"path": "/never"},
                    "limit": {"requests": harness.HUGE, "per": "1m"}}]}


class NginxWasmServer:
    """nginx (one worker, pinned) serving a static file, with `module` as a proxy-wasm filter on
    it (none: the same binary without a filter)."""

    def __init__(self, nginx, module=None, plugin=None):
        self.port = harness.free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="tollgate-bench-nginx-wasm-"))
        wasm = filt = ""
        if module:
            wasm = f"wasm {{ module filter {module}; shm_kv * 16m eviction=none; }}"
            config = json.dumps(plugin or {}).replace("\\", "\\\\").replace("'", "\\'")
            filt = f"proxy_wasm filter '{config}';"
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
  server {{
    listen 127.0.0.1:{self.port};
    root {self.dir};
    default_type text/plain;
    location / {{ {filt} try_files /ok =404; }}
  }}
}}
""")
        (self.dir / "ok").write_text("ok\n")
        self.proc = harness.Proc(harness.PROXY_CPU + [nginx, "-c", str(self.dir / "nginx.conf"),
                                                      "-p", str(self.dir)])
        self.url = f"http://127.0.0.1:{self.port}/"
        harness.wait_port(self.port)
        self.pids = [int(p) for p in subprocess.check_output(
            ["pgrep", "-g", str(self.proc.p.pid)]).split()]

    def stop(self):
        self.proc.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seconds", type=int, default=3)
    args = ap.parse_args()
    nginx = os.environ.get("NGINX_BIN")
    if not nginx:
        sys.exit("NGINX_BIN is not set: an nginx built with ngx_wasm_module (docs/nginx.md)")
    setups = [
        ("nginx, no module", None, None),
        ("nginx + SDK do-nothing filter", NOOP, {}),
        ("nginx + tollgate, one rule that matches nothing", TOLLGATE, NEVER),
        ("nginx + tollgate per client IP, draft headers", TOLLGATE, harness.tollgate_plugin(harness.HUGE)),
    ]
    rounds = {name: [] for name, _, _ in setups}
    for r in range(args.rounds):
        order = setups if r % 2 == 0 else list(reversed(setups))
        for name, module, plugin in order:
            server = NginxWasmServer(nginx, module, plugin)
            try:
                rounds[name].append(harness.measure(server, args.seconds)["cpu_us"])
            finally:
                server.stop()
        print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in rounds.items()), flush=True)
    result = {"rounds": rounds, "order": [name for name, _, _ in setups], "seconds": args.seconds}
    path = REPO / "bench/results.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    saved["nginx_wasm"] = result
    path.write_text(json.dumps(saved, indent=1))
    lines = nginx_wasm_lines(result)
    print("\n".join(lines))
    harness.splice_section(REPO / "docs/benchmarks.md", HEADING, lines)


HEADING = "## nginx with ngx_wasm_module: what the filter adds"


def nginx_wasm_lines(result):
    """The report's section for `bench/nginx_cost.py`'s results."""
    rounds, order = result["rounds"], result["order"]
    base, noop = rounds[order[0]], rounds[order[1]]
    lines = [HEADING, "",
             f"`NGINX_BIN=… bench/nginx_cost.py` (not part of `make bench`: it needs an nginx built with "
             f"ngx_wasm_module, [nginx.md](nginx.md)): one nginx worker pinned to one core serving a static "
             f"file, wrk on the other, {len(base)} interleaved rounds of {result['seconds']} s; ratios are "
             f"the medians of each round's ratio.", "",
             "| setup | CPU µs/request (median) | vs nginx, no module | vs the SDK's do-nothing filter |",
             "|---|---|---|---|"]
    for name in order:
        values = rounds[name]
        vs_base = statistics.median(a / b for a, b in zip(values, base))
        vs_noop = statistics.median(a / b for a, b in zip(values, noop))
        lines.append(f"| {name} | {statistics.median(values):.1f} | {vs_base:.2f}× | {vs_noop:.2f}× |")
    floor = statistics.median(a / b for a, b in zip(noop, base))
    lines += ["", f"Reading: a Wasm filter that does nothing already costs {floor:.2f}× nginx alone "
              "(ngx_wasm_module's own work per request: its contexts, the callbacks it enters); tollgate's "
              "figures are on top of that floor, as in Envoy.", ""]
    return lines


if __name__ == "__main__":
    main()
