#!/usr/bin/env python3
"""Instructions per request of the Envoy process, counted by valgrind's callgrind: deterministic
(two runs agree within about 1%) where CPU time on this VM moves by several µs between rounds, so a
difference of a few hundred instructions (one host call, one feature) can be seen and judged.

    bench/instructions.py                 # every setup, writes its section of docs/benchmarks.md
    bench/instructions.py --requests 3000 "label=module.wasm@plugin.json" ...   # your own

Envoy (`--concurrency 1`) runs under callgrind with instrumentation off; after 300 warm-up requests
on one keep-alive connection it is switched on, the process idles for a few seconds (what its timers
and tollgate's tick cost per second, measured to be subtracted), then serves `--requests` requests one
after another. The figure is (instructions while serving − the idle rate × the time taken) /
requests; for the native module, tollgate's tick (`on_http_filter_config_scheduled`, which runs every
5 or 10 ms whatever the traffic) is left out of both, and its cost per call kept beside. Under
callgrind Envoy runs about 50× slower, so what depends on time between requests
behaves as at a much lower rate: a worker's stash of tokens (20 ms) is refilled more often than at
full load. The feature table therefore uses `worker_batch: 0` (every request visits the shared
bucket: the same path at any speed).
"""
import argparse
import glob
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

REPO = harness.REPO
HEADING = "## Instructions per request"
TOLLGATE = REPO / "dist/release/tollgate.wasm"
RAW = REPO / "bench/rawnoop/target"
RAW_PATH = RAW / "reads-path/wasm32-wasip1/release/tollgate_bench_rawnoop.wasm"
RAW_PER_IP = RAW / "per-ip-calls/wasm32-wasip1/release/tollgate_bench_rawnoop.wasm"
HUGE = harness.HUGE
WARM_UP = 300


def envoy_binary():
    """The Envoy executable itself: the venv's `envoy` is a Python script that execs it, and
    callgrind must run the binary."""
    found = glob.glob(str(REPO / ".venv/lib/python3*/site-packages/envoy/_bin/envoy"))
    if not found:
        sys.exit("no Envoy binary in .venv (make setup)")
    return found[0]


def dump_total(path):
    for _ in range(100):
        if path.exists():
            found = re.findall(r"^(?:summary|totals): (\d+)", path.read_text(errors="replace"), re.M)
            if found:
                return int(found[-1])
        time.sleep(0.1)
    sys.exit(f"callgrind wrote no {path}")


TICK_HOOK = "envoy_dynamic_module_on_http_filter_config_scheduled"


def tick_cost(path):
    """Instructions (inclusive) and calls of the native module's tick in one callgrind dump: it runs
    every few milliseconds whatever the traffic, so under callgrind (requests about 50x slower) it
    would be charged to about 50x fewer requests than at full speed."""
    text = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--tree=calling", "--threshold=100",
                           str(path)], capture_output=True, text=True).stdout
    found = re.findall(r"^\s*([\d,]+) \([^)]*\)\s+>\s+\S*:" + TICK_HOOK + r" \((\d+)x\)", text, re.M)
    return sum(int(n.replace(",", "")) for n, _ in found), sum(int(c) for _, c in found)


def count(filters, requests, idle_s=3.0, method="GET", body=None):
    """Instructions per request of Envoy with `filters`, the idle rate subtracted."""
    port, admin = harness.free_port(), harness.free_port()
    work = Path(tempfile.mkdtemp(prefix="tollgate-callgrind-"))
    clusters = [harness.quota_cluster(QUOTA_PORT)] if "quota_service" in json.dumps(filters) else []
    (work / "envoy.json").write_text(json.dumps(harness.envoy_config(port, admin, filters, clusters)))
    out = work / "callgrind.out"
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
         "--smc-check=all-non-file", envoy_binary(), "-c", str(work / "envoy.json"),
         "--concurrency", "1", "--disable-hot-restart", "-l", "error",
         "--base-id", str(harness.free_port())],
        stdout=subprocess.DEVNULL, stderr=(work / "valgrind.log").open("w"), env=harness.native_env())
    try:
        harness.wait_http(f"http://127.0.0.1:{admin}/ready", timeout=600)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        headers = {"content-type": "application/json"} if body else {}

        def serve(n):
            for _ in range(n):
                conn.request(method, "/", body=body, headers=headers)
                answer = conn.getresponse()
                answer.read()
                if answer.status != 200:
                    sys.exit(f"answered {answer.status}: a setup must admit every request")

        control = ["callgrind_control"]
        serve(WARM_UP)
        subprocess.run(control + ["-i", "on", str(proc.pid)], check=True, stdout=subprocess.DEVNULL)
        start = time.monotonic()
        time.sleep(idle_s)
        subprocess.run(control + ["-d", str(proc.pid)], check=True, stdout=subprocess.DEVNULL)
        idle_s = time.monotonic() - start
        idle_rate = dump_total(Path(f"{out}.1")) / idle_s
        start = time.monotonic()
        serve(requests)
        busy_s = time.monotonic() - start
        subprocess.run(control + ["-d", str(proc.pid)], check=True, stdout=subprocess.DEVNULL)
        busy = dump_total(Path(f"{out}.2"))
        result = {"per_request": (busy - idle_rate * busy_s) / requests, "idle_per_s": idle_rate}
        busy_tick, ticks = tick_cost(Path(f"{out}.2"))
        if ticks:
            # The tick is time's cost, not the request's: left out, and reported per call.
            idle_tick, _ = tick_cost(Path(f"{out}.1"))
            result.update({
                "with_tick": result["per_request"],
                "per_request": (busy - busy_tick - (idle_rate - idle_tick / idle_s) * busy_s) / requests,
                "tick_per_call": busy_tick / ticks, "ticks_per_request": ticks / requests,
            })
        return result
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)


def wasm(path, plugin, reads_body=False):
    f = harness.wasm_filter(path, plugin)
    if reads_body:  # what a rule that reads the body needs in Envoy (docs/configuration.md)
        f["typed_config"]["config"]["allow_on_headers_stop_iteration"] = True
    return [f]


def per_ip(rule_extra=None, extra=None, more_rules=()):
    """Per client IP, never refused, no rate-limit headers, every request at the shared bucket."""
    plugin = harness.tollgate_plugin(HUGE, rule_extra={"worker_batch": 0, **(rule_extra or {})},
                                     extra={"rate_limit_headers": "none", **(extra or {})})
    plugin["rules"] += list(more_rules)
    return plugin


# The quota service the global (lease) setups lease from: started by `main` for the floors.
QUOTA_PORT = harness.free_port()
LEASE = harness.tollgate_plugin(HUGE, scope="global")

NEVER = {"name": "never", "match": {"path": "/never"}, "limit": {"requests": 1, "per": "1m"}}

# (label, filters, method, body): the floors, then tollgate.
FLOORS = [
    ("Envoy, no filter", [], "GET", None),
    ("Envoy + SDK do-nothing filter", wasm(harness.NOOP, {}), "GET", None),
    ("raw-ABI do-nothing, every callback", wasm(harness.RAW_NOOP_ALL, {}), "GET", None),
    ("raw-ABI: reads `:path`, nothing else", wasm(RAW_PATH, {}), "GET", None),
    ("raw-ABI: the host calls of a per-IP rule with draft headers, nothing else", wasm(RAW_PER_IP, {}),
     "GET", None),
    ("Envoy local_ratelimit per client IP", [harness.native_local_ratelimit(HUGE)], "GET", None),
    ("tollgate, one rule that matches nothing", wasm(TOLLGATE, {"rules": [NEVER]}), "GET", None),
    ("tollgate per client IP, draft headers (defaults)", wasm(TOLLGATE, harness.tollgate_plugin(HUGE)),
     "GET", None),
    ("tollgate per client IP, no rate-limit headers", wasm(TOLLGATE, harness.tollgate_plugin(
        HUGE, extra={"rate_limit_headers": "none"})), "GET", None),
    ("tollgate global, lease (memory)", wasm(TOLLGATE, LEASE), "GET", None),
    ("Envoy + do-nothing dynamic module", [harness.native_filter({}, module="noop")], "GET", None),
    ("tollgate native, one rule that matches nothing", [harness.native_filter({"rules": [NEVER]})], "GET", None),
    ("tollgate native per client IP, draft headers (defaults)",
     [harness.native_filter(harness.tollgate_plugin(HUGE))], "GET", None),
    ("tollgate native per client IP, no rate-limit headers",
     [harness.native_filter(harness.tollgate_plugin(HUGE, extra={"rate_limit_headers": "none"}))], "GET", None),
    ("tollgate native global, lease (memory)", [harness.native_filter(LEASE)], "GET", None),
]
BASE = "per client IP, `worker_batch: 0`, no headers"
FEATURES = [
    (BASE, wasm(TOLLGATE, per_ip()), "GET", None),
    ("… + a second rule that matches nothing", wasm(TOLLGATE, per_ip(more_rules=[NEVER])), "GET", None),
    ("… + the draft headers", wasm(TOLLGATE, per_ip(extra={"rate_limit_headers": "draft"})), "GET", None),
    ("… + a cost from a request header", wasm(TOLLGATE, per_ip(
        {"cost": {"header": "x-cost", "default": 1, "max": 100}})), "GET", None),
    ("… + settled from a response header", wasm(TOLLGATE, per_ip(
        {"settle": {"header": "x-usage"}})), "GET", None),
    ("… + a byte limit on responses (a second rule)", wasm(TOLLGATE, per_ip(more_rules=[
        {"name": "bytes", "key": ["client_ip"], "limit": {"bytes": HUGE, "per": "1s"}}])), "GET", None),
    ("… + a concurrency rule (a second rule)", wasm(TOLLGATE, per_ip(more_rules=[
        {"name": "seats", "key": ["client_ip"], "algorithm": "concurrency",
         "limit": {"concurrent": 1000}}])), "GET", None),
    ("… + an adaptive overload rule (a second rule)", wasm(TOLLGATE, per_ip(more_rules=[
        {"name": "overload", "algorithm": "adaptive"}])), "GET", None),
    ("… + priorities (with the adaptive rule)", wasm(TOLLGATE, per_ip(
        extra={"priorities": [{"name": "batch", "match": {"headers": {"x-batch": "1"}}, "level": 0}]},
        more_rules=[{"name": "overload", "algorithm": "adaptive"}])), "GET", None),
    ("POST with a JSON body: per client IP, `worker_batch: 0`, no headers",
     wasm(TOLLGATE, per_ip(), reads_body=True), "POST", b'{"n": 3}'),
    ("… + a cost from the JSON body", wasm(TOLLGATE, per_ip({"cost": {"body": ["n"], "max": 100}}),
                                            reads_body=True), "POST", b'{"n": 3}'),
]


def run(setups, requests):
    results = {}
    for label, filters, method, body in setups:
        r = count(filters, requests, method=method, body=body)
        results[label] = r
        print(f"{label}: {r['per_request']:.0f} instructions/request (idle {r['idle_per_s'] / 1e3:.0f}k/s)",
              flush=True)
    return results


NOOP_LABEL = "Envoy + SDK do-nothing filter"
NEVER_LABEL = "tollgate, one rule that matches nothing"
NEVER_FLOOR = "raw-ABI: reads `:path`, nothing else"
PER_IP_LABEL = "tollgate per client IP, draft headers (defaults)"
PER_IP_FLOOR = "raw-ABI: the host calls of a per-IP rule with draft headers, nothing else"


def headlines(result):
    """Headline figures for `make bench`'s comparison: deterministic, so any growth is real."""
    f = {k: v["per_request"] for k, v in result["floors"].items()}
    noop = f[NOOP_LABEL]
    out = {
        "one rule that matches nothing, instructions × SDK do-nothing": round(f[NEVER_LABEL] / noop, 4),
        "per client IP, draft headers, instructions × SDK do-nothing": round(f[PER_IP_LABEL] / noop, 4),
    }
    features = {k: v["per_request"] for k, v in result["features"].items()}
    if BASE in features:
        out["per client IP, worker_batch 0, no headers, instructions over SDK do-nothing"] = round(
            features[BASE] - noop)
    return out


def target_rows(result, cpu_never, cpu_per_ip):
    """The report's target rows for the two ratios to the do-nothing filter: CPU (same-run median)
    beside instructions, and the floor the host's calls alone set."""
    f = {k: v["per_request"] for k, v in result["floors"].items()}
    noop = f[NOOP_LABEL]
    rows = []
    for target, bound, cpu, label, floor, what in (
            ("a plugin whose rules match no request costs ≤ 1.05× the SDK's do-nothing filter", 1.05,
             cpu_never, NEVER_LABEL, NEVER_FLOOR, "only reads `:path`"),
            ("tollgate per client IP with the draft headers ≤ 1.20× the SDK's do-nothing filter", 1.20,
             cpu_per_ip, PER_IP_LABEL, PER_IP_FLOOR,
             "only makes the four host calls of that rule (client address, time, two headers)")):
        ours, least = f[label] / noop, f[floor] / noop
        if ours <= bound and (cpu is None or cpu <= bound):
            met = "yes"
        elif least > bound:
            met = "no: the host's calls alone cost more"
        elif least > bound - 0.01:
            met = (f"no: the host's calls alone leave {(bound - least) * 100:.1f}% of the do-nothing "
                   "filter's request for all of tollgate's own work")
        else:
            met = "no"
        cpu_text = f"CPU {cpu:.2f}×; " if cpu is not None else ""
        rows.append(f"| {target} | {cpu_text}instructions {ours:.3f}× ([callgrind](#instructions-per-request)); "
                    f"a module that {what} and nothing else: {least:.3f}× | {met} |")
    return rows


RESULT_MARK = "<!-- instructions: "


def recorded(doc):
    """The results this section of `doc` was written from (kept in it as a comment), if any: a
    report rewritten without a new count keeps its figures and target rows."""
    text = doc.read_text() if doc.exists() else ""
    for line in text.splitlines():
        if line.startswith(RESULT_MARK):
            try:
                return json.loads(line[len(RESULT_MARK):].removesuffix("-->").strip())
            except json.JSONDecodeError:
                return None
    return None


# Refactorings judged by this count (measured by hand, with the command each names): kept in the
# section whenever it is written again.
CHANGE_CHECKS = [
    "**The engine pipeline (issue 38).** `Engine::decide` making a request's whole decision, the "
    "queues keeping their own gauges and a request's holdings let go of once did not grow the "
    "request's cost: per client IP with `worker_batch: 0` and the draft headers, 2 000 requests, "
    "`bench/instructions.py --requests 2000 \"old=OLD.wasm@perip.json\" \"new=NEW.wasm@perip.json\"`: "
    "136 476 instructions per request at c759375 (before), 136 527 after (+0.04%, within the 1% two "
    "runs of one module differ by). Then one `carry_out` for the stream and the tick, the GCRA "
    "decision folded into the algorithms' `Decision` and key naming moved to the core (for the "
    "quota service's RLS): 137 333 at 4fb3e70, 137 319 after (−0.01%; the same command, another "
    "day's toolchain).",
    "",
]


# Envoy's own instructions per `http_add_header` call (callgrind's inclusive count of the callback,
# 2 000 requests with the draft headers, 2026-12-01).
ADD_HEADER = 911


def native_reading(floors):
    """What the native rows say, from their counts (nothing if they were not counted)."""
    f = {k: v["per_request"] for k, v in floors.items()}
    names = ("Envoy, no filter", "Envoy + do-nothing dynamic module", "Envoy local_ratelimit per client IP",
             "tollgate native, one rule that matches nothing", "tollgate native per client IP, draft headers (defaults)",
             "tollgate native per client IP, no rate-limit headers", "tollgate native global, lease (memory)")
    if not all(n in f for n in names):
        return []
    base, noop, local, never, per_ip, bare, lease = (f[n] - f[names[0]] for n in names)
    return [
        "The native rows, over Envoy alone: a dynamic module that does nothing adds "
        f"{noop:,.0f} instructions (Envoy makes a filter object per request and calls it at every hook), "
        f"Envoy's own local_ratelimit per client IP {local:,.0f} (compiled in: no module to call). tollgate's "
        f"native build adds {never:,.0f} for a rule that matches nothing ({never - noop:,.0f} above the "
        f"do-nothing module), {bare:,.0f} per client IP without headers ({bare - noop:,.0f} above it) and "
        f"{per_ip:,.0f} with the draft headers ({(per_ip - bare) / 2:,.0f} a header: its text, and an "
        f"insertion into Envoy's header map, about {ADD_HEADER:,} of Envoy's own in a callgrind profile of "
        f"`http_add_header`). A global rule's lease path: {lease:,.0f}. "
        + tick_text(floors) + "The floor of a per-client-IP rule "
        "with the draft headers in a dynamic module is the do-nothing module and two insertions, "
        f"{noop + 2 * ADD_HEADER:,.0f}: " + ("above" if noop + 2 * ADD_HEADER > local else "below")
        + f" local_ratelimit's {local:,.0f}, before any work of the rule's own.",
        "",
    ]


def tick_text(floors):
    """What the native rows left out: tollgate's tick, per call while requests were served."""
    ticks = [(k, v) for k, v in floors.items() if "tick_per_call" in v]
    if not ticks:
        return ""
    parts = ", ".join(f"{k.removeprefix('tollgate native').lstrip(', ')} {v['tick_per_call']:,.0f} "
                      f"({v['ticks_per_request'] * v['tick_per_call']:,.0f} a request here)" for k, v in ticks)
    return ("Left out of these rows, tollgate's tick while requests came, instructions a call: "
            f"{parts}. It is called 100 times a second (200 with a global or delaying rule), "
            f"whatever the traffic: at most {200 * max(v['tick_per_call'] for _, v in ticks) / 1e6:.1f} "
            "million instructions a second a worker, shared by all its requests. ")


def own(floors, label, floor):
    """Instructions of `label` above its host floor, to the hundred."""
    per = lambda k: floors[k]["per_request"] if k in floors else 0.0
    return round((per(label) - per(floor)) / 100) * 100


def section_lines(result):
    floors, features = result["floors"], result["features"]
    noop = floors["Envoy + SDK do-nothing filter"]["per_request"]
    lines = [
        HEADING,
        "",
        f"`make bench-instructions` (`bench/instructions.py`): Envoy 1.40 (`--concurrency 1`) under valgrind's "
        f"callgrind, {result['requests']} requests one after another on one connection after "
        f"{WARM_UP} to warm up, instructions of the whole process per request with the idle rate "
        "(timers, tollgate's tick) subtracted; in the native rows tollgate's tick is left out while "
        "requests are served too (it runs every 5 or 10 ms whatever the traffic, and under callgrind "
        "would be charged to about a fiftieth of the requests it is shared by at full speed: its cost "
        "per call is given below them). Two runs of one setup agree within about 1%, where CPU "
        "time on this VM moves by several µs between rounds: this is the figure to judge a change by. "
        "Instructions are not time (a host call's instructions run faster than a cold module's), but "
        "the ratios follow the CPU figures above.",
        "",
        "| setup | instructions/request | × SDK do-nothing |",
        "|---|---|---|",
    ]
    for label, r in floors.items():
        lines.append(f"| {label} | {r['per_request']:,.0f} | {r['per_request'] / noop:.3f}× |")
    lines += [
        "",
        "Reading: in Envoy 1.40 every call into the host costs instructions of its own (about 1 200 for "
        "one that passes data in, such as the time), and a call that hands data back (a header, a "
        "property, shared data) makes Envoy call into the module again to allocate the result: about "
        "10 500 instructions, more than a tenth of the do-nothing filter's whole request. A module "
        "that only reads `:path` and does nothing else already costs about 1.10× the do-nothing "
        "filter, and one that only makes the four calls of a per-client-IP rule with the draft headers "
        "(the client address, the time, two response headers) about 1.20×: the host, not the filter, "
        "sets these floors. tollgate's own work is what it costs above them: about "
        f"{own(floors, NEVER_LABEL, NEVER_FLOOR):,.0f} instructions for a request no rule applies to, about "
        f"{own(floors, PER_IP_LABEL, PER_IP_FLOOR):,.0f} per client IP with the draft headers (the key, "
        "the bucket, the two headers' text, and a visit to the shared bucket once per `worker_batch` "
        "requests). The per-IP rows with the default `worker_batch` are upper bounds: under callgrind a "
        "request takes milliseconds, so a worker's stash (20 ms) serves fewer requests before it is "
        "refilled than at full load.",
        "",
    ] + native_reading(floors) + CHANGE_CHECKS + [
        "### What each feature costs",
        "",
        "Per client IP with `worker_batch: 0` (every request visits the shared bucket, so the count does "
        "not depend on time between requests) and no rate-limit headers; each row adds one feature. "
        "A feature a configuration does not use adds nothing per request: no host call (the engine "
        "tests assert the host calls per request of each configuration), no body callback doing work, "
        "no queue or stats work.",
        "",
        "| setup | instructions/request | added by the feature |",
        "|---|---|---|",
    ]
    base = None
    for label, r in features.items():
        if not label.startswith("…"):
            base = r["per_request"]
            lines.append(f"| {label} | {base:,.0f} | |")
            continue
        lines.append(f"| {label} | {r['per_request']:,.0f} | {r['per_request'] - base:+,.0f} |")
    lines += [
        "",
        "Reading: most of what a feature adds is host calls (the engine tests list them). A rule "
        "matched on the path makes the request's first `:path` read (one call that hands data back); "
        "a cost from a header reads that header; settling reads the response's `:status` and header, "
        "then the time, and visits the bucket again; a byte limit reads the time and visits its "
        "bucket for each chunk of the response body; a concurrency rule visits its bucket when the "
        "request comes and again when it ends; an adaptive rule visits its window in shared data when "
        "the request comes and when its answer does, reading the time and `:status`; priorities read "
        "the header their classes match. A cost from the JSON "
        "body makes Envoy hold the request until its body has come and hand it over once, which here "
        "costs Envoy less than answering before the body is read (the row without the rule): the "
        "difference is Envoy's, not the feature's.",
        "",
        RESULT_MARK + json.dumps(result, ensure_ascii=False) + " -->",
        "",
    ]
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--report", action="store_true", help="write the section from bench/results.json, measure nothing")
    ap.add_argument("variants", nargs="*", help="label=module.wasm[@plugin.json]: count these only")
    args = ap.parse_args()
    path = REPO / "bench/results.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    if args.report:
        return write_report(saved["instructions"])
    if not shutil.which("valgrind"):
        sys.exit("valgrind is not installed (apt-get install valgrind)")
    if args.variants:
        setups = []
        for v in args.variants:
            label, spec = v.split("=", 1)
            path, _, plugin = spec.partition("@")
            cfg = json.loads(Path(plugin).read_text()) if plugin else harness.tollgate_plugin(HUGE)
            setups.append((label, wasm(Path(path).resolve(), cfg), "GET", None))
        run(setups, args.requests)
        return
    quota = harness.Proc([str(harness.QUOTA), "--listen", f"127.0.0.1:{QUOTA_PORT}"],
                         env={**os.environ, "RUST_LOG": "error"})
    try:
        harness.wait_http(f"http://127.0.0.1:{QUOTA_PORT}/healthz")
        floors = run(FLOORS, args.requests)
    finally:
        quota.stop()
    result = {"requests": args.requests, "floors": floors, "features": run(FEATURES, args.requests)}
    saved["instructions"] = result
    path.write_text(json.dumps(saved, indent=1))
    write_report(result)


def write_report(result):
    """This section of docs/benchmarks.md, and the recorded headlines with this run's figures."""
    lines = section_lines(result)
    print("\n".join(lines))
    doc = REPO / "docs/benchmarks.md"
    recorded = harness.recorded_headlines(doc)
    harness.compare_headlines(recorded, headlines(result))
    harness.splice_section(doc, HEADING, lines)
    # The recorded headlines take this run's figures (the others stay as `make bench` wrote them).
    text = doc.read_text()
    mark = next((line for line in text.splitlines() if line.startswith(harness.HEADLINES_MARK)), None)
    if mark:
        merged = {**recorded, **headlines(result)}
        doc.write_text(text.replace(mark, harness.HEADLINES_MARK + json.dumps(merged, ensure_ascii=False) + " -->"))


if __name__ == "__main__":
    main()
