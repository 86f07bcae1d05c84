#!/usr/bin/env python3
"""A/B comparison of Wasm modules (or plugin configurations) under the same load: short interleaved
rounds, the median of each round's difference against the first variant. For development: deciding
whether a change to the hot path is worth it needs paired rounds on a noisy machine.

    bench/ab.py --rounds 12 base=dist/release/tollgate.wasm new=/tmp/new.wasm
    bench/ab.py noop=bench/noop/target/wasm32-wasip1/release/tollgate_bench_noop.wasm tg=dist/release/tollgate.wasm

A variant may add `@plugin.json` to use its own plugin configuration. With `--probe` the variants are
`probe` builds (`cargo build --features probe`) and the figure compared is the time inside their
callbacks (steadier than CPU measured from outside).
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--seconds", type=int, default=2)
    ap.add_argument("--limit", type=int, default=harness.HUGE, help="requests per minute (default: never reached)")
    ap.add_argument("--probe", action="store_true", help="compare time inside the callbacks (probe builds)")
    ap.add_argument("variants", nargs="+", help="label=module.wasm[@plugin.json]")
    args = ap.parse_args()
    variants = []
    for v in args.variants:
        label, spec = v.split("=", 1)
        path, _, plugin = spec.partition("@")
        cfg = json.loads(Path(plugin).read_text()) if plugin else harness.tollgate_plugin(args.limit)
        variants.append((label, Path(path).resolve(), cfg))
    cpu = {label: [] for label, _, _ in variants}
    allocs = {label: [] for label, _, _ in variants}
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else list(reversed(variants))
        for label, path, cfg in order:
            server = harness.EnvoyServer([harness.wasm_filter(path, cfg)])
            try:
                m = harness.measure(server, args.seconds)
                if args.probe:
                    us, n = inside(server)
                    cpu[label].append(us)
                    allocs[label].append(n)
                else:
                    cpu[label].append(m["cpu_us"])
            finally:
                server.stop()
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in cpu.items()), flush=True)
    base = variants[0][0]
    for label, values in cpu.items():
        diffs = [a - b for a, b in zip(values, cpu[base])]
        print(f"{label}: median {statistics.median(values):.2f} us/req, vs {base} "
              f"{statistics.median(diffs):+.2f} us (paired diffs {min(diffs):+.2f}..{max(diffs):+.2f})"
              + (f", {statistics.median(allocs[label]):.2f} allocations/request" if args.probe else ""))


def inside(server):
    """Microseconds and heap allocations per request inside the callbacks of a probe build (the
    client address is timed inside the request callback, so it is not added again)."""
    us = allocs = 0.0
    for cb in ("create", "request", "response", "log"):
        calls = server.stat(f"wasmcustom.tollgate.probe.{cb}.calls")
        if calls:
            us += server.stat(f"wasmcustom.tollgate.probe.{cb}.ns") / calls / 1000
            allocs += (server.stat(f"wasmcustom.tollgate.probe.{cb}.allocs") or 0) / calls
    return us, allocs


if __name__ == "__main__":
    main()
