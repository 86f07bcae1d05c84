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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

REPO = harness.REPO
NOOP = REPO / "bench/noop/target/wasm32-wasip1/release/tollgate_bench_noop.wasm"
TOLLGATE = REPO / "dist/tollgate.wasm"
NEVER = {"rules": [{"name": "r", "match": {"path": "/never"},
                    "limit": {"requests": harness.HUGE, "per": "1m"}}]}


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
            server = harness.NginxServer(None, nginx, module, plugin)
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
