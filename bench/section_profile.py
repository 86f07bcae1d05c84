"""Where tollgate's time goes: the process's CPU split, and each callback's share.

Part of `make bench` (`bench/sections.py` lists the sections)."""
import os
import statistics
import subprocess
import tempfile
import urllib.request

import harness
from harness import (HUGE, TOLLGATE, TOLLGATE_PROBE, HOST_PROBE, EnvoyServer, tollgate_plugin, wasm_filter)


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
