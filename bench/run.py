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
import random
import statistics
import sys
import time

import instructions
import sections
from report_bandwidth import BANDWIDTH_HEADING, bandwidth_chart, bandwidth_lines
from report_llm import LLM_HEADING, llm_chart, llm_lines
from report_overload import SLOWDOWNS_HEADING, slowdown_lines
from section_protocols import PROTOCOLS_HEADING, protocol_lines
import report_native
from harness import (kept_section, splice_section, compare_headlines, recorded_headlines, HEADLINES_MARK, LOAD_THREADS, QUOTA, REPO, Proc, free_port, measure, setups, wait_http,
                     wait_port)


SECTIONS = ("cost", "accuracy", "memory", "quota", "global", "profile", "split", "overload", "change",
            "slowdowns", "llm", "bandwidth", "protocols")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--seconds", type=int, default=3)
    ap.add_argument("--only", help="substring of the cost configurations to run (no report)")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help="comma-separated: " + ", ".join(SECTIONS) + "; others come from the last results.json "
                         "(`--sections report` only rewrites the report)")
    args = ap.parse_args()
    wanted = args.sections.split(",")

    # The shared quota services (in memory, and two on one Redis): only the sections that use them.
    services, qp, qrp, qrp2 = [], None, None, None
    if "cost" in wanted or "accuracy" in wanted:
        env = {**os.environ, "RUST_LOG": "error"}
        quota = Proc([str(QUOTA), "--listen", f"127.0.0.1:{(qp := free_port())}"], env=env)
        redis_port = free_port()
        redis = Proc(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        wait_port(redis_port)
        redis_url = f"redis://127.0.0.1:{redis_port}"
        quota_redis = Proc([str(QUOTA), "--listen", f"127.0.0.1:{(qrp := free_port())}", "--redis", redis_url], env=env)
        quota_redis2 = Proc([str(QUOTA), "--listen", f"127.0.0.1:{(qrp2 := free_port())}", "--redis", redis_url], env=env)
        services = [quota, quota_redis, quota_redis2, redis]
        for port in (qp, qrp, qrp2):
            wait_http(f"http://127.0.0.1:{port}/healthz")
    path = REPO / "bench/results.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    if not isinstance(saved, dict):
        saved = {}
    try:
        if "cost" in wanted:
            saved["cost"] = cost(args, qp, qrp)
            saved["cost_args"] = {"rounds": args.rounds, "seconds": args.seconds}
        if "accuracy" in wanted:
            saved["accuracy"] = sections.accuracy(qp, (qrp, qrp2))
        if "memory" in wanted:
            saved["memory"] = sections.memory()
        if "quota" in wanted:
            saved["quota"] = sections.quota_throughput()
        if "global" in wanted:
            saved["global"] = sections.global_load()
        if "profile" in wanted:
            saved["profile"], saved["hostcalls"] = sections.profile()
        if "split" in wanted:
            saved["split"] = sections.process_split()
        if "overload" in wanted:
            saved["overload"] = sections.overload()
        if "change" in wanted:
            saved["change"] = sections.capacity_change()
        if "slowdowns" in wanted:
            saved["slowdowns"] = sections.slowdowns()
        if "llm" in wanted:
            saved["llm"] = sections.llm()
        if "bandwidth" in wanted:
            saved["bandwidth"] = sections.bandwidth()
        if "protocols" in wanted:
            saved["protocols"] = sections.protocols()
    finally:
        for p in services:
            p.stop()
    path.write_text(json.dumps(saved, indent=1))
    compare_headlines(recorded_headlines(REPO / "docs/benchmarks.md"), headlines(saved))
    if not args.only and all(k in saved for k in SECTIONS):
        report(saved, argparse.Namespace(**saved.get("cost_args", {"rounds": args.rounds, "seconds": args.seconds})))
    else:
        # Not every section is in results.json: rewrite only these sections of docs/benchmarks.md.
        for name, heading, lines_of, chart in (("llm", LLM_HEADING, llm_lines, llm_chart),
                                               ("bandwidth", BANDWIDTH_HEADING, bandwidth_lines, bandwidth_chart),
                                               ("slowdowns", SLOWDOWNS_HEADING, slowdown_lines, None),
                                               ("protocols", PROTOCOLS_HEADING, protocol_lines, None)):
            if name in saved and (name in wanted or "report" in wanted):
                splice_section(REPO / "docs/benchmarks.md", heading, lines_of(saved[name]))
                if chart:
                    chart(saved[name])


def cost(args, qp, qrp):
    """CPU per request, throughput and latency of every setup: interleaved rounds, medians."""
    results = {}
    todo = [s for s in setups(qp, qrp) if not args.only or args.only in s[0]]
    listed = [(name, path) for name, path, _, _ in todo]
    order = random.Random(1)
    for r in range(args.rounds):
        # A new order every round: no setup always runs after the same neighbour.
        order.shuffle(todo)
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
    def median(values):
        values = [x for x in values if x is not None]
        return statistics.median(values) if values else None
    medians = {k: {f: median(m[f] for m in v) for f in v[0]} for k, v in results.items()}
    return [{"setup": k[0], "path": k[1], "rounds": len(results[k]),
             "cpu_min": min(m["cpu_us"] for m in results[k]),
             "cpu_max": max(m["cpu_us"] for m in results[k]),
             "per_round": results[k], **medians[k]}
            for k in listed]


def inside(p):
    """µs per request inside tollgate's callbacks, less the probe's own timers: each adds its `timer`
    figure to its own reading and about twice that to the callback it is nested in."""
    e = p.get("timer") or 0
    nested = sum(1 for cb in ("client_address", "evaluate", "timer") if p.get(cb) is not None)
    raw = sum(p[cb] or 0 for cb in ("create", "request", "response", "log"))
    return (raw - 4 * e - 2 * e * nested) / 1000


# ---------------------------------------------------------------- headline figures, old and new


def headlines(saved):
    """The headline figures of a run's results (those its sections have), smaller is better."""
    out = {}
    rows = saved.get("cost") or []
    get = {(r["setup"], r["path"]): r for r in rows}
    NONE, NOOP, RAW2 = "Envoy, no filter", "Envoy + SDK do-nothing filter", "Envoy + raw-ABI do-nothing, 2 callbacks"
    PER_IP, PER_IP_BARE = "tollgate token bucket per client IP", "tollgate per client IP, no rate-limit headers"
    NEVER = "tollgate, one rule that matches nothing"

    def ratio(a, b):
        return statistics.median(x["cpu_us"] / y["cpu_us"]
                                 for x, y in zip(get[(a, "allowed")]["per_round"], get[(b, "allowed")]["per_round"]))

    def paired(a, b):
        return statistics.median(x["cpu_us"] - y["cpu_us"]
                                 for x, y in zip(get[(a, "allowed")]["per_round"], get[(b, "allowed")]["per_round"]))

    figures = (
        ("per client IP, draft headers, × SDK do-nothing", lambda: ratio(PER_IP, NOOP)),
        ("per client IP, no headers, × SDK do-nothing", lambda: ratio(PER_IP_BARE, NOOP)),
        ("one rule that matches nothing, × SDK do-nothing", lambda: ratio(NEVER, NOOP)),
        ("decision proper per client IP, µs over raw-ABI do-nothing", lambda: paired(PER_IP, RAW2)),
        ("Envoy local_ratelimit per client IP, µs", lambda: paired("Envoy local_ratelimit per client IP", NONE)),
    )
    for name, f in figures:
        try:
            out[name] = round(f(), 3)
        except (KeyError, ZeroDivisionError, statistics.StatisticsError):
            pass
    counted = saved.get("instructions") or instructions.recorded(REPO / "docs/benchmarks.md")
    if counted:
        out.update(instructions.headlines(counted))
    try:
        out.update(report_native.headlines(get, counted))
    except (KeyError, ZeroDivisionError, statistics.StatisticsError):
        pass
    prof = {p["config"]: p for p in saved.get("profile") or []}
    for config, name in (("token bucket per client IP", "inside tollgate's callbacks per client IP, µs"),
                         ("no rate-limit headers", "inside tollgate's callbacks, no headers, µs")):
        if config in prof:
            out[name] = round(inside(prof[config]), 3)
    return out


def report(saved, args):
    """docs/benchmarks.md and docs/benchmarks.png from the saved results."""
    rows = saved["cost"]
    get = {(r["setup"], r["path"]): r for r in rows}
    cpu = lambda name, path="allowed": get[(name, path)]["cpu_us"]
    base, floor = cpu("Envoy, no filter"), cpu("Envoy + SDK do-nothing filter")

    def paired(a, b, field="cpu_us", path="allowed"):
        """Median over rounds of a − b measured in the same round: drift between rounds cancels."""
        ra, rb = get[(a, path)]["per_round"], get[(b, path)]["per_round"]
        return statistics.median(x[field] - y[field] for x, y in zip(ra, rb))

    NONE, NOOP = "Envoy, no filter", "Envoy + SDK do-nothing filter"
    RAW2, RAW_ALL = "Envoy + raw-ABI do-nothing, 2 callbacks", "Envoy + raw-ABI do-nothing, every callback"
    PER_IP, PER_IP_BARE = "tollgate token bucket per client IP", "tollgate per client IP, no rate-limit headers"
    NEVER = "tollgate, one rule that matches nothing"

    def ratio(a, b, path="allowed"):
        """Median over rounds of a / b measured in the same round."""
        ra, rb = get[(a, path)]["per_round"], get[(b, path)]["per_round"]
        return statistics.median(x["cpu_us"] / y["cpu_us"] for x, y in zip(ra, rb))

    floor_ratio, floor_ratio_bare = ratio(PER_IP, NOOP), ratio(PER_IP_BARE, NOOP)
    proper, proper_bare = paired(PER_IP, RAW2), paired(PER_IP_BARE, RAW2)
    perf_counts = {k: r.get("instructions") for k, r in get.items()}
    have_instructions = any(v is not None for v in perf_counts.values())
    # Where each µs goes: paired differences of setups that add one thing at a time.
    steps = [
        ("Envoy enters a module twice per request (context create, request headers)", RAW2, NONE),
        ("… and for the callbacks a module that also runs in nginx must export (response headers and "
         "body, done, log, delete)", RAW_ALL, RAW2),
        ("the SDK's own per-request work (boxed context, hash map, dispatch)", NOOP, RAW_ALL),
        ("tollgate: a request no rule applies to (its path read and matched)", NEVER, RAW_ALL),
        ("… one bucket for everyone, no headers (time, stash)", "tollgate one bucket (no key), no rate-limit headers", NEVER),
        ("… keyed by client IP (the address read)", PER_IP_BARE, "tollgate one bucket (no key), no rate-limit headers"),
        ("… with the two draft headers on the response", PER_IP, PER_IP_BARE),
    ]
    native = paired("Envoy local_ratelimit per client IP", NONE)
    ours = paired("tollgate token bucket per client IP", NOOP)
    ours_bare = paired("tollgate per client IP, no rate-limit headers", NOOP)
    ours_nostash = paired("tollgate per client IP, worker_batch 0 (no stash)", NOOP)
    nginx_lr = paired("nginx limit_req per IP", "nginx, no limiting")
    wasm_floor = paired(NOOP, NONE)

    def best(a, b, path="allowed"):
        """Best round of a minus best round of b: interference only ever adds CPU time."""
        return get[(a, path)]["cpu_min"] - get[(b, path)]["cpu_min"]

    ONE_TG, ONE_NATIVE = "tollgate one bucket (no key), no rate-limit headers", "Envoy local_ratelimit, one bucket"
    one_ours, one_native = paired(ONE_TG, NOOP), paired(ONE_NATIVE, NONE)
    one_ours_best, one_native_best = best(ONE_TG, NOOP), best(ONE_NATIVE, NONE)
    native_best = best("Envoy local_ratelimit per client IP", NONE)
    ours_best = best("tollgate token bucket per client IP", NOOP)
    local = get[("tollgate token bucket per client IP", "allowed")]
    lease = get[("tollgate global, lease (memory)", "allowed")]
    lease_redis = get[("tollgate global, lease (Redis)", "allowed")]
    strict = get[("tollgate global, strict (memory)", "allowed")]
    p99_gap = statistics.median(x["p99_ms"] / y["p99_ms"] - 1 for x, y in zip(
        lease["per_round"], local["per_round"]))
    lease_over = get[("tollgate global, lease (memory)", "rejected")]
    local_over = get[("tollgate token bucket per client IP", "rejected")]
    p99_gap_over = statistics.median(x["p99_ms"] / y["p99_ms"] - 1 for x, y in zip(
        lease_over["per_round"], local_over["per_round"]))
    shared = {g["load"]: g for g in saved.get("global", []) if g["rule"] == "global" and "p99_ratio" in g}
    over3 = next((g for load, g in shared.items() if load.startswith("over")), None)
    prof = {p["config"]: p for p in saved["profile"]}
    tb, bare = prof["token bucket per client IP"], prof["no rate-limit headers"]
    ours_inside, bare_inside = inside(tb), inside(bare)
    one_inside = inside(prof["one bucket (no key), no headers"])
    nostash_inside = inside(prof["`worker_batch: 0`"])
    address = (bare["client_address"] - bare["timer"]) / 1000
    allocs = lambda p: sum(p["allocs"].get(cb, 0) for cb in ("create", "request", "response", "log"))
    host = saved["hostcalls"]
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `make bench` (`bench/run.py`, `bench/section_*.py`) on {time.strftime('%Y-%m-%d')} on "
        f"this project's {os.cpu_count()}-core machine (a shared VM: see [Noise](#noise)). tollgate is the "
        "`make dist` module (`wasm-opt -O`); Envoy 1.40.0 from the pinned venv, nginx-light and wrk from Debian. "
        "Each run prints its headline figures next to those recorded here (the `headlines` comment at the "
        "end of this file) and flags any that grew by more than 5%: a regression shows before the report "
        "is rewritten.",
        "",
        "## Targets",
        "",
        "Same-run figures first: each is the median over rounds of a ratio or difference between two "
        "setups measured in the same round, which cancels this VM's drift between rounds.",
        "",
        "| target | measured | met? |",
        "|---|---|---|",
        f"| tollgate per client IP, draft headers on, costs no more CPU per request than the SDK's do-nothing "
        f"filter | **{floor_ratio:.2f}×** the do-nothing filter's CPU per request ({floor_ratio_bare:.2f}× without "
        f"headers) | {'yes' if floor_ratio <= 1.0 else 'no'} |",
    ]
    # `make bench-instructions` counts these; a report rewritten without a new count keeps the last.
    counted = saved.get("instructions") or instructions.recorded(REPO / "docs/benchmarks.md")
    if counted:
        lines += instructions.target_rows(counted, ratio(NEVER, NOOP), floor_ratio)
    lines += report_native.target_rows(get, counted)
    lines += [
        f"| the decision proper (tollgate minus the raw-ABI do-nothing module) ≤ Envoy local_ratelimit's added "
        f"cost per client IP | {proper:.1f} µs ({proper_bare:.1f} µs without headers) vs native {native:.1f} µs | "
        f"{'yes' if proper_bare <= native else 'no'} |",
        f"| tollgate's own decision ≤ Envoy local_ratelimit's added cost | per client IP: {bare_inside:.1f} µs "
        f"inside tollgate's callbacks without rate-limit headers ({ours_inside:.1f} µs with them), of which "
        f"{address:.1f} µs reads the client address; CPU/request over the do-nothing filter {ours_bare:.1f} µs "
        f"paired ({ours:.1f} µs with headers, {ours_best:.1f} µs best round). Native per IP: {native:.1f} µs "
        f"paired, {native_best:.1f} µs best round | {'yes' if bare_inside <= max(native, native_best) else 'no'} |",
        f"| … the same for one bucket (no client key) | tollgate {one_inside:.1f} µs inside its callbacks; "
        f"CPU {one_ours:.1f} µs paired ({one_ours_best:.1f} µs best round). Native: {one_native:.1f} µs paired "
        f"({one_native_best:.1f} µs best round) | {'yes' if one_inside <= max(one_native, one_native_best) else 'no'} |",
        f"| … aiming for nginx limit_req's | nginx: {nginx_lr:.1f} µs; tollgate as above | "
        f"{'yes' if bare_inside <= nginx_lr else 'no'} |",
        f"| no allocations on the hot path | {allocs(bare):.2f} heap allocations per allowed request inside "
        f"tollgate's callbacks, none of them tollgate's own (the host allocates the client address it returns "
        "in the module's memory) | yes |",
        f"| lease mode ≤ 10 quota calls per 1000 requests at steady state | {lease['calls_per_1000']:.1f} "
        f"(Redis: {lease_redis['calls_per_1000']:.1f}); strict mode: {strict['calls_per_1000']:.0f} | "
        f"{'yes' if max(lease['calls_per_1000'], lease_redis['calls_per_1000']) <= 10 else 'no'} |",
        f"| lease mode p99 within 10% of local mode | {lease['p99_ms']:.2f} ms vs {local['p99_ms']:.2f} ms "
        f"(paired: {p99_gap * 100:+.0f}%) | {'yes' if p99_gap <= 0.10 else 'no'} |",
        f"| … and over the limit (every request refused) | {lease_over['p99_ms']:.2f} ms vs "
        f"{local_over['p99_ms']:.2f} ms (paired: {p99_gap_over * 100:+.0f}%) | "
        f"{'yes' if p99_gap_over <= 0.10 else 'no'} |",
    ]
    if over3:
        lines.append(f"| 3 Envoys sharing 200/s over the limit: p99 within 10% of a local rule's, ≤ 10 quota calls "
                     f"per 1000 requests | p99 {over3['p99_ratio']:.2f}× the local rule's (paired over "
                     f"{over3['rounds']} rounds, [below](#global-limits-under-and-over-the-limit)); "
                     f"{over3['calls_per_1000']:.2f} calls per 1000 requests | "
                     f"{'yes' if over3['p99_ratio'] <= 1.10 and over3['calls_per_1000'] <= 10 else 'no'} |")
    ov = {(o["setup"], o["factor"]): o for o in saved.get("overload", [])}
    adaptive = [ov[k] for k in (("tollgate adaptive (latency)", 2), ("tollgate adaptive (latency)", 5)) if k in ov]
    if adaptive:
        worst_goodput = min(o["goodput"] for o in adaptive) / 200
        worst_p99 = max(o["p99_ms"] / o["base_ms"] for o in adaptive)
        lines.append(f"| adaptive rule at 2× and 5× an upstream's capacity: goodput ≥ 90% of capacity, p99 ≤ 2× "
                     f"the unloaded latency | goodput ≥ {worst_goodput:.0%}, p99 ≤ {worst_p99:.2f}× "
                     f"([Overload](#overload)) | {'yes' if worst_goodput >= 0.9 and worst_p99 <= 2 else 'no'} |")
    prio = next((o for o in saved.get("overload", []) if "high_admitted" in o), None)
    if prio:
        lines.append(f"| priorities at 3× overload, 20% high: ≥ 99% of the high level admitted | "
                     f"{prio['high_admitted']:.1%} (the low level: {prio['low_admitted']:.1%}) | "
                     f"{'yes' if prio['high_admitted'] >= 0.99 else 'no'} |")
    lines += [
        "",
        "CPU per request measured from outside scatters by several µs between rounds on this VM (see "
        "[Noise](#noise)), so the decision cost is judged by the time tollgate spends inside its own "
        "callbacks, which is steadier, with the CPU figures as corroboration. Envoy's native limiter and "
        "nginx add no rate-limit headers, so tollgate is compared without them (`rate_limit_headers: none`; "
        f"the two draft headers cost {max(ours_inside - bare_inside, 0):.1f} µs more).",
        "",
        "[Where the time goes](#where-the-time-goes) shows what separates tollgate from the native limiter "
        f"per client IP: reading the client address takes {address:.1f} µs, because every proxy-wasm call "
        "that returns data makes Envoy call back into the VM to allocate the result; that one call costs "
        "about what Envoy's native limiter spends on its whole decision, and no proxy-wasm filter keyed by "
        "client address can avoid it. Without it (one bucket for everyone) tollgate's decision is "
        f"{one_inside:.1f} µs. On tollgate's side: worker stashes removed the shared-data round trip for a "
        f"busy key ({nostash_inside:.1f} → {ours_inside:.1f} µs inside the callbacks), stats are handed to "
        "Envoy per tick rather than per request, and the request path makes no heap allocation of its own.",
        "",
        "## Where each µs goes",
        "",
        "Setups that add one thing at a time, measured in the same rounds (paired medians, CPU µs per "
        "request); the right column is the time the probe build spends inside tollgate's own callbacks "
        "for the same step (see [Where the time goes](#where-the-time-goes)).",
        "",
        "| step | CPU µs/request (paired) | instructions/request | inside tollgate's callbacks |",
        "|---|---|---|---|",
    ]
    inside_of = {
        NEVER: None,
        "tollgate one bucket (no key), no rate-limit headers": one_inside,
        PER_IP_BARE: bare_inside - one_inside,
        PER_IP: ours_inside - bare_inside,
    }
    for label, a, b in steps:
        ia, ib = perf_counts.get((a, "allowed")), perf_counts.get((b, "allowed"))
        instr = f"{ia - ib:+,.0f}" if ia is not None and ib is not None else "n/a"
        ins = inside_of.get(a)
        lines.append(f"| {label} | {paired(a, b):+.1f} | {instr} | {'' if ins is None else f'{ins:.1f} µs'} |")
    lines += [
        f"| **tollgate per client IP with headers, over Envoy without filters** | **{paired(PER_IP, NONE):+.1f}** | "
        f"| {ours_inside:.1f} µs |",
        "",
        "Instruction counts: " + ("`perf stat -e instructions` on the proxy process during each round." if
                                  have_instructions else "not available on this machine (`perf stat -e "
                                  "instructions` reports the counter as not supported: a VM without hardware "
                                  "performance counters); the bench records them where the counter exists."),
        "",
    ]
    split = saved.get("split")
    if split:
        parts = [k for k in split[0] if k not in ("setup", "cpu_us")]
        lines += [
            "Where the proxy's CPU goes, sampled (`perf record -e cpu-clock` on the Envoy process, same load, "
            "median of 3 rounds; each sample's share of the CPU per request):",
            "",
            "| setup | CPU µs/request | " + " | ".join(parts) + " |",
            "|---|---|" + "---|" * len(parts),
        ]
        for row in split:
            lines.append(f"| {row['setup']} | {row['cpu_us']:.1f} | "
                         + " | ".join(f"{row[k]:.1f}" for k in parts) + " |")
    else:
        lines.append("Sampling where the proxy's CPU goes (`perf record -e cpu-clock`) was not possible on this "
                     "machine.")
    lines += [
        "",
        f"Reading: the SDK's own per-request work is {paired(NOOP, RAW_ALL):+.1f} µs over a raw-ABI module that "
        f"Envoy enters as often; the callbacks themselves cost {paired(RAW_ALL, NONE):+.1f} µs. What separates a do-nothing module from "
        "one that Envoy enters twice is the callbacks themselves, and a module that also runs in nginx "
        "cannot leave them out: ngx_wasm_module calls `proxy_on_response_body`, `proxy_on_log`, "
        "`proxy_on_done` and `proxy_on_delete` without checking that the module exports them (a missing "
        "one crashes the nginx worker), and the ABI has no way to tell Envoy per configuration which "
        "callbacks to skip. So tollgate's floor is the do-nothing filter's less the SDK's own work, and to "
        "cost no more than the SDK's do-nothing filter, everything tollgate does would have to fit in that "
        "work; it cannot, since one host call that returns data (the client address) costs more. What "
        "tollgate does comes on top of the floor: reading the request (a host call that returns data costs about 1 µs, because "
        "Envoy calls back into the module to allocate the result), the decision, and the headers. Whole-"
        "process CPU is more than the time inside the callbacks because each host call and callback entry "
        "also costs Envoy time outside the module (V8 entry and exit, argument conversion, the host's side "
        "of each call) and a larger module touches more memory.",
        "",
    ]
    lines += report_native.section_lines(get, counted)
    lines += [
        "## Cost per request",
        "",
        "Each proxy with one worker (Envoy `--concurrency 1`, nginx `worker_processes 1`) pinned to core 0, a "
        f"static 200 answered by the proxy itself, `wrk -t{LOAD_THREADS} -c32 --latency` pinned to the other "
        f"core on loopback for {args.seconds} s after a 1 s warm-up, {args.rounds} interleaved rounds (every "
        "setup once per round, in an order shuffled each round), medians. "
        "**CPU µs/request** is the proxy process's user+sys time over the run divided by the requests served: "
        "the figure to trust here (throughput and latency move with whatever else runs on the host).",
        "",
        "- **allowed**: the limit is never reached (the cost of the decision);",
        "- **rejected**: the limit is 1 per minute, so nearly every request gets a 429 (a 429 storm).",
        "",
        "![CPU per request](benchmarks.png)",
        "",
    ]
    for path in ("allowed", "rejected"):
        lines += [f"### {path.capitalize()}", "",
                  "| setup | CPU µs/request | (rounds' range) | vs Envoy, no filter | vs do-nothing Wasm | requests/s | "
                  "p50 ms | p99 ms | refused | quota calls / 1000 requests |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if r["path"] != path:
                continue
            nginx = r["setup"].startswith("nginx")
            vs_base = "" if nginx else f"{r['cpu_us'] / base:.2f}×"
            vs_floor = "" if nginx else f"{r['cpu_us'] - floor:+.1f} µs"
            refused = f"{r['rejected'] / max(r['requests'], 1):.0%}"
            spread = f"{r['cpu_min']:.1f}–{r['cpu_max']:.1f}"
            calls = f"{r['calls_per_1000']:.1f}" if "global" in r["setup"] else ""
            lines.append(f"| {r['setup']} | {r['cpu_us']:.1f} | {spread} | {vs_base} | {vs_floor} | {r['rps']:.0f} | "
                         f"{r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {refused} | {calls} |")
        lines.append("")
    lines += [
        "### Decision cost",
        "",
        "Each figure is the median over rounds of the difference between two setups measured in the same "
        "round (paired), which cancels the machine's drift between rounds better than a difference of "
        "the medians above; \"best\" is the difference of the two setups' best rounds.",
        "",
        f"- tollgate's own decision (per-client-IP token bucket minus the do-nothing Wasm filter): **{ours:.1f} µs** "
        f"(best {ours_best:.1f} µs); without rate-limit headers {ours_bare:.1f} µs; without worker stashes "
        f"{ours_nostash:.1f} µs; inside its callbacks (steadier, below) {ours_inside:.1f} µs, "
        f"{bare_inside:.1f} µs without headers",
        f"- Envoy's native local_ratelimit (minus Envoy without filters): {native:.1f} µs (best {native_best:.1f} µs)",
        f"- one bucket for everyone (no client key): tollgate {one_ours:.1f} µs (best {one_ours_best:.1f} µs; "
        f"{one_inside:.1f} µs inside its callbacks), Envoy's native local_ratelimit {one_native:.1f} µs "
        f"(best {one_native_best:.1f} µs)",
        f"- nginx limit_req (minus nginx without limiting): {nginx_lr:.1f} µs",
        f"- the Wasm floor (do-nothing filter minus no filter): {wasm_floor:.1f} µs",
        "",
        "## Where the time goes",
        "",
        "Measured inside Envoy rather than from outside, so it is far steadier than CPU per request: "
        "the `probe` build of tollgate (`cargo build --features probe`) adds each callback's time and heap "
        "allocations to Envoy counters (`tollgate.probe.<callback>.ns` / `.allocs` / `.calls`), under the "
        "same load as above (median of 3 runs). Its timers cost time of their own: `timer` is what one "
        "adds to its own figure, and a timer nested in another adds about twice that to the outer one. "
        "The figures below are raw; the totals used above subtract the timers. `bench/probe` is a filter "
        "that calls each host function 2 000 times per request and reports the mean (warm caches, so a "
        "lower bound).",
        "",
        "| callback (ns per call) | " + " | ".join(p["config"] for p in saved["profile"]) + " |",
        "|---|" + "---|" * len(saved["profile"]),
    ]
    labels = {"create": "create the HTTP context", "request": "request headers (the decision)",
              "client_address": "… of which: client address (`get_property`)",
              "evaluate": "… of which: the decision proper (stash or shared bucket)",
              "timer": "… of which: one probe timer", "response": "response headers",
              "log": "end of stream (`on_log`)"}
    for cb, label in labels.items():
        vals = " | ".join("" if p.get(cb) is None else f"{p[cb]:.0f}" for p in saved["profile"])
        lines.append(f"| {label} | {vals} |")
    lines.append("| **total, less the probe's timers** | "
                 + " | ".join(f"**{inside(p) * 1000:.0f}**" for p in saved["profile"]) + " |")
    lines.append("| heap allocations per request | "
                 + " | ".join(f"{allocs(p):.2f}" for p in saved["profile"]) + " |")
    lines += [
        "",
        "| host call or step (warm, ns) | ns |",
        "|---|---|",
    ]
    for op, ns in host.items():
        lines.append(f"| `{op}` | {ns:.0f} |")
    lines += [
        "",
        "Reading: calls that hand data back to the filter (`get_shared_data`, `get_property`, "
        "`get_header`) cost about 1 µs each warm and more in the request path, calls that only pass data "
        "in (`set_shared_data`, `increment_metric`, `get_current_time`, `set_header`) 0.1–0.3 µs. A request "
        "for a busy key makes one returning call (its client address) instead of two (address and the "
        "shared bucket); the decision proper is mostly the shared-bucket visit that one request in "
        "`worker_batch + 1` makes to refill the stash. The allocations left are the host's (the returned "
        "client address; a stash refill's group read); a 429 also builds the local reply's header list. The 429 storm's request callback includes Envoy "
        "building and sending the local reply (`send_http_response`).",
        "",
        "## Accuracy",
        "",
        "Envoy with 2 workers (`--concurrency 2`), `wrk -c64` for 3 s on loopback, all requests from one "
        "client; **admitted** is Envoy's own count of 2xx answers (`http.bench.downstream_rq_2xx`), not "
        "the filter's. Per-day limits test exactness across workers (expected: the burst); per-second "
        "limits test the rate (expected: burst + rate × wrk's measured duration).",
        "",
        "| case | admitted | expected | workers | requests sent | note |",
        "|---|---|---|---|---|---|",
    ]
    for a in saved["accuracy"]:
        lines.append(f"| {a['case']} | {a['admitted']} | {a['expected']} | {a['workers']} | {a['requests']} | "
                     f"{a.get('note', '')} |")
    lines += [
        "",
        "Worker stashes do not change these counts: tokens leave the shared bucket before they are spent, "
        "and stashes are only taken while the bucket has plenty left (see "
        "[Worker stashes](architecture.md#worker-stashes) for the bound at short time scales).",
        "",
        "## Global efficiency",
        "",
        f"- lease mode: **{lease['calls_per_1000']:.1f}** quota calls per 1000 requests (memory store), "
        f"{lease_redis['calls_per_1000']:.1f} (Redis), at steady state under the limit (the default lease is "
        "a quarter of the burst, at most 1000 tokens); strict mode: "
        f"{strict['calls_per_1000']:.0f}.",
        f"- p99 latency: local {local['p99_ms']:.2f} ms, lease {lease['p99_ms']:.2f} ms (memory) / "
        f"{lease_redis['p99_ms']:.2f} ms (Redis), strict {strict['p99_ms']:.2f} ms.",
        "- In the accuracy runs above, 3 Envoys sharing a global limit of 1000 made the calls noted there "
        "for the whole burst.",
        "",
        "## Memory",
        "",
        "Envoy RSS (one worker) when started, and after every one of N distinct keys (`x-key` header) was "
        "sent at least once. tollgate creates all `max_keys` slots when the configuration loads (here "
        "`max_keys` = N); Envoy's local_ratelimit creates a bucket per new value up to "
        "`max_dynamic_descriptors` (= N).",
        "",
        "| distinct keys | tollgate at start | tollgate after | Envoy local_ratelimit at start | local_ratelimit after |",
        "|---|---|---|---|---|",
    ]
    mem = {(m["system"], m["keys"]): m for m in saved["memory"]}
    for n in sorted({m["keys"] for m in saved["memory"]}):
        t, e = mem[("tollgate", n)], mem[("Envoy local_ratelimit", n)]
        lines.append(f"| {n:,} | {t['rss_start_kib'] / 1024:.0f} MiB | {t['rss_end_kib'] / 1024:.0f} MiB | "
                     f"{e['rss_start_kib'] / 1024:.0f} MiB | {e['rss_end_kib'] / 1024:.0f} MiB |")
    big_t, big_e = mem[("tollgate", 1_000_000)], mem[("Envoy local_ratelimit", 1_000_000)]
    small_t = mem[("tollgate", 1_000)]
    lines += [
        "",
        f"Per key: tollgate about {(big_t['rss_end_kib'] - small_t['rss_end_kib']) * 1024 / 999_000:.0f} B "
        f"(fixed when the configuration loads, whatever the traffic), Envoy's local_ratelimit about "
        f"{(big_e['rss_end_kib'] - big_e['rss_start_kib']) * 1024 / 1_000_000:.0f} B (grows with the "
        "keys seen). tollgate's larger floor is the V8 runtime and the module. With `max_keys` smaller "
        "than the key population memory stays flat: a 1 000 000-key flood against `max_keys: 1000` "
        "moved RSS by under 100 KiB (README, memory test).",
        "",
        "## Quota service",
        "",
        "`tollgate-quota` pinned to core 0 (with Redis there too in the Redis case), `wrk -c32` on core 1 "
        "posting one-item lease requests over 10 000 keys for 5 s.",
        "",
        "| store | leases/s | p50 ms | p99 ms | errors | service CPU µs/lease | 1000-item call p50 ms | slowest ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for q in saved["quota"]:
        lines.append(f"| {q['store']} | {q['leases_per_s']:.0f} | {q['p50_ms']:.2f} | {q['p99_ms']:.2f} | "
                     f"{q['errors']} | {q['cpu_us']:.1f} | {q.get('batch_p50_ms', float('nan')):.1f} | "
                     f"{q.get('batch_max_ms', float('nan')):.1f} |")
    lines += [
        "",
        "The 1000-item columns: 20 calls of 1 000 new keys each (one script per call on one Redis, one per "
        "slot group on the cluster), within the default storage timeout of 50 ms.",
        "",
    ]
    # `bench/quota_items.py` writes this subsection; kept when the report is rewritten.
    import quota_items  # noqa: E402
    if "quota_items" in saved:
        lines += quota_items.lines(saved["quota_items"])
    else:
        lines += kept_section(REPO / "docs/benchmarks.md", quota_items.HEADING)
    if "quota_replicas" in saved:
        lines += quota_items.replicas_lines(saved["quota_replicas"])
    else:
        lines += kept_section(REPO / "docs/benchmarks.md", quota_items.REPLICAS_HEADING)
    # `bench/redis_instructions.py` writes this one.
    import redis_instructions  # noqa: E402
    lines += kept_section(REPO / "docs/benchmarks.md", redis_instructions.HEADING)
    lines += [
        "## Global limits under and over the limit",
        "",
        "3 Envoys (one worker each, not pinned: they share both cores with the 3 `wrk -c4` and the quota "
        "service), one key shared by all, 5 s after a 1 s warm-up; the same load on a local rule (a third "
        "of the limit per Envoy) right after, in each of several rounds; medians over rounds (p99: the "
        "slowest Envoy's). **p99 vs local** is the median over rounds of the global run's p99 divided by "
        "the local run's of the same round. Over the limit, rate leases let each Envoy admit at its share "
        "and refuse beyond it at once.",
        "",
        "| load | rule | rounds | requests | admitted | quota calls / 1000 requests | p50 ms | p99 ms | p99 vs local |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for g in saved.get("global", []):
        ratio = f"{g['p99_ratio']:.2f}×" if "p99_ratio" in g else ""
        lines.append(f"| {g['load']} | {g['rule']} | {g.get('rounds', 1)} | {g['requests']:.0f} | {g['admitted']:.0f} | "
                     f"{g['calls_per_1000']:.2f} | {g['p50_ms']:.2f} | {g['p99_ms']:.2f} | {ratio} |")
    lines += [
        "",
        "A lease call stands for many requests: a grant is a quarter of the key's burst by default (up to "
        "1000 tokens), and one call carries up to 1000 keys' refills, so the service's call rate is a small "
        "fraction of the request rate it governs (1 call per 1000 requests in the lease runs above).",
        "",
        "## Overload",
        "",
        "An upstream with a capacity (`tollgate-testbed upstream`: 10 requests at once, 50 ms each, so "
        "200/s; it queues the rest, so its latency grows with load) behind Envoy (2 workers, not pinned), "
        "open-loop load from `tollgate-testbed load` (latency counted from when each request was due, up "
        "to 256 in flight). Each run: a fresh upstream and Envoy, the unloaded p50 (40/s), then the load "
        "for 7 s, the first 3 s not counted; medians over rounds. **Goodput**: 200s per second, until "
        "the last answer came; **refused**: answers that were not 200 (503s from the limiter) over "
        "requests sent. Without protection the upstream's queue grows for as long as the load lasts "
        "(and beyond 256 requests waiting, the load generator's own queue adds to the latency): p99 "
        "grows with the length of the run, without bound, and goodput counts answers that came long "
        "after the load stopped.",
        "",
        "| setup | load | rounds | goodput /s | of capacity | p99 ms | p99 / unloaded p50 | refused | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for o in saved.get("overload", []):
        lines.append(f"| {o['setup']} | {o['factor']}× | {o['rounds']} | {o['goodput']:.0f} | "
                     f"{o['goodput'] / 200:.0%} | {o['p99_ms']:.0f} | {o['p99_ms'] / o['base_ms']:.2f}× | "
                     f"{o['refused']:.0%} | {o['errors']:.0f} |")
    prio = [o for o in saved.get("overload", []) if "high_admitted" in o]
    lines += [""] + [f"With priorities (3×, 20% of requests at level 3, the rest at the default level 1): "
                     f"{o['high_admitted']:.1%} of level 3 admitted, {o['low_admitted']:.1%} of level 1."
                     for o in prio] + [
        "",
        "Envoy's `adaptive_concurrency` is configured with its gradient controller (p50 samples, the "
        "limit updated every 100 ms, the minimum RTT measured every 60 s over 50 requests at a concurrency "
        "of 3). It is Envoy's own; tollgate's rule judges from one process-wide estimate in shared "
        "data, in Envoy and in nginx, and adds priorities.",
        "",
    ]
    change = saved.get("change")
    if change:
        names = list(change["setups"])
        lines += [
            "### When the upstream's service time changes",
            "",
            f"The same upstream (10 at once) under a constant open-loop {change['rate']}/s; its service time "
            f"goes from 50 ms (capacity 200/s) to 100 ms (100/s) at {change['slow_at']} s and back to 50 ms "
            f"at {change['fast_at']} s. Goodput (200s per second) and p99 of the 200s, per "
            f"{change['bucket_ms'] / 1000:g} s, by when requests were due "
            "(`bench/run.py --sections change`; chart: [overload-change.png](overload-change.png)).",
            "",
            "| t (s) | " + " | ".join(f"{n}: goodput /s | p99 ms" for n in names) + " |",
            "|---|" + "---|---|" * len(names),
        ]
        rows = zip(*(change["setups"][n] for n in names))
        for buckets in rows:
            cells = []
            for b in buckets:
                p99 = "" if b["p99_ms"] is None else f"{b['p99_ms']:.0f}"
                cells.append(f"{b['goodput']:.0f} | {p99}")
            lines.append(f"| {buckets[0]['t']:g} | " + " | ".join(cells) + " |")
        lines += [
            "",
            "![goodput and p99 as the service time changes](overload-change.png)",
            "",
        ]
    if "slowdowns" in saved:
        lines += slowdown_lines(saved["slowdowns"])
    if "llm" in saved:
        lines += llm_lines(saved["llm"])
    if "bandwidth" in saved:
        lines += bandwidth_lines(saved["bandwidth"])
    if "protocols" in saved:
        lines += protocol_lines(saved["protocols"])
    import nginx_cost  # noqa: E402  (its section, kept when the report is rewritten)
    if "nginx_wasm" in saved:
        lines += nginx_cost.nginx_wasm_lines(saved["nginx_wasm"])
    else:
        lines += kept_section(REPO / "docs/benchmarks.md", nginx_cost.HEADING)
    if counted:
        lines += instructions.section_lines(counted)
    lines += [
        "## Noise",
        "",
        "This is a shared 2-core VM: the same setup's CPU per request moves by several µs from round to "
        "round (the range column) and by up to 2× across hours. Differences smaller than the ranges are "
        "noise; the in-filter profile above is the steadier guide. `bench/ab.py` compares modules in "
        "paired, interleaved rounds when a change needs judging.",
        "",
    ]
    lines.append(HEADLINES_MARK + json.dumps(headlines(saved), ensure_ascii=False) + " -->")
    lines.append("")
    (REPO / "docs/benchmarks.md").write_text("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no chart")
        return
    fig, axes = plt.subplots(1, 2, figsize=(14, 9), sharex=True)
    for ax, path in zip(axes, ("allowed", "rejected")):
        data = [r for r in rows if r["path"] == path]
        ax.barh([r["setup"] for r in data], [r["cpu_us"] for r in data],
                xerr=[[r["cpu_us"] - r["cpu_min"] for r in data], [r["cpu_max"] - r["cpu_us"] for r in data]],
                color=["#1f77b4" if "native" in r["setup"] or "dynamic module" in r["setup"]
                       else "#d62728" if "tollgate" in r["setup"] else "#7f7f7f" for r in data], capsize=2)
        ax.invert_yaxis()
        ax.set_title("everything allowed" if path == "allowed" else "a 429 storm")
        ax.set_xlabel("proxy CPU µs per request (bars: rounds' range)")
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(REPO / "docs/benchmarks.png", dpi=90)
    change = saved.get("change")
    if change:
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
        for name, timeline in change["setups"].items():
            t = [b["t"] for b in timeline]
            color = "#d62728" if "tollgate" in name else "#7f7f7f"
            top.plot(t, [b["goodput"] for b in timeline], label=name, color=color)
            bottom.plot(t, [b["p99_ms"] for b in timeline], label=name, color=color)
        capacity = [200 if not change["slow_at"] <= b["t"] < change["fast_at"] else 100
                    for b in next(iter(change["setups"].values()))]
        top.step([b["t"] for b in next(iter(change["setups"].values()))], capacity, where="post",
                 linestyle=":", color="black", label="upstream capacity")
        top.set_ylabel("goodput (200s per second)")
        bottom.set_ylabel("p99 of the 200s (ms)")
        bottom.set_xlabel("seconds (service time 50 → 100 → 50 ms)")
        for ax in (top, bottom):
            ax.axvline(change["slow_at"], color="black", alpha=0.2)
            ax.axvline(change["fast_at"], color="black", alpha=0.2)
            ax.grid(alpha=0.3)
        top.legend()
        fig.tight_layout()
        fig.savefig(REPO / "docs/overload-change.png", dpi=90)
    if "llm" in saved:
        llm_chart(saved["llm"])
    if "bandwidth" in saved:
        bandwidth_chart(saved["bandwidth"])


if __name__ == "__main__":
    sys.exit(main())
