#!/usr/bin/env python3
"""The fleet simulator's table: 10, 100 and 1 000 proxies (2 workers each) over the real lease code
(`tollgate-fleet`, virtual time, seeded), each workload for 20 simulated seconds; then the capacity
grid (proxies × active keys × lease TTL, 40 s each) priced with the service's measured CPU per item;
writes docs/scale.md's tables and its chart (false refusals per 100 ms as demand shifts).

    make bench-scale        # or: bench/scale.py [--proxies 10,100,1000] [--seconds 20]
"""
import argparse
import json
import math
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FLEET = REPO / "target/release/tollgate-fleet"
DOC = REPO / "docs/scale.md"
HOT = ["--keys", "hot", "--rate", "10000", "--burst", "10000"]

# (name, what it is, arguments): the fleet sends 20 000 requests a second in all.
WORKLOADS = [
    ("uniform", "10 000 keys alike, each 5/s (burst 10): 2/s each, under the limit",
     ["--keys", "uniform", "--key-count", "10000", "--rate", "5", "--burst", "10"]),
    ("zipf", "Zipf(1.1) over 100 000 keys, each 100/s (burst 100): the busiest 18× over, the tail under",
     ["--keys", "zipf", "--key-count", "100000", "--rate", "100", "--burst", "100"]),
    ("hot key", "one key for every request, 10 000/s (burst 10 000): 2× over", HOT),
    ("shift", "the hot key; every 5 s half the proxies send 4× what the other half does, and the halves swap",
     HOT + ["--shift-ms", "5000"]),
    ("bursts", "the hot key; every 5 s the fleet sends 4× its rate for half a second",
     HOT + ["--bursts-ms", "5000"]),
    ("crash", "the hot key; 10% of the proxies restart halfway", HOT + ["--crash", "0.1"]),
    ("store loss", "the hot key; the service loses every bucket halfway", HOT + ["--store-loss"]),
    ("partition", "the hot key; 10% of the proxies cannot reach the service for the middle fifth",
     HOT + ["--partition", "0.1"]),
    ("lossy network", "the Zipf keys over a network of 10 to 50 ms round trips (uniform) that loses 2% of the calls",
     ["--keys", "zipf", "--key-count", "100000", "--rate", "100", "--burst", "100",
      "--rtt-ms", "10", "--rtt-jitter-ms", "40", "--call-loss", "0.02"]),
]


# The capacity grid: every key at 40% of its limit (burst 2 s of it), 20 000 requests a second.
GRID_PROXIES = [10, 100, 1000]
GRID_KEYS = [1, 1000, 10000]
GRID_TTL_MS = [5000, 10000, 30000]
# Longer than the longest TTL: every lease is renewed at least once.
GRID_SECONDS = 40

# CPU per item by items per call, measured by bench/quota_items.py (docs/benchmarks.md, "Lease
# items per second and CPU per item"): the memory store's service, and on Redis the service's and
# Redis's. Between the measured call sizes, interpolated over log(items per call).
COST_US = {
    "memory": {1: 16.50, 10: 3.65, 100: 2.51, 1000: 2.38},
    "redis service": {1: 23.06, 10: 6.45, 100: 5.29, 1000: 3.42},
    "redis": {1: 32.26, 10: 19.10, 100: 21.44, 1000: 9.87},
}
# A Redis master is one core; sized to run at most this busy.
MASTER_LOAD = 0.7


def cost_us(kind, per_call):
    points = sorted(COST_US[kind].items())
    x = math.log10(min(max(per_call, 1), 1000))
    for (a, ca), (b, cb) in zip(points, points[1:]):
        la, lb = math.log10(a), math.log10(b)
        if x <= lb:
            return ca + (cb - ca) * (x - la) / (lb - la)
    return points[-1][1]


def grid_args(proxies, keys, ttl_ms, seconds):
    rate = max(1, round(20000 / keys / 0.4))
    args = ["--keys", "hot"] if keys == 1 else ["--keys", "uniform", "--key-count", str(keys)]
    return args + ["--rate", str(rate), "--burst", str(2 * rate), "--proxies", str(proxies),
                   "--ttl-ms", str(ttl_ms), "--seconds", str(seconds)]


def simulate(args):
    out = subprocess.run([str(FLEET)] + args, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--proxies", default="10,100,1000")
    ap.add_argument("--seconds", type=int, default=20)
    args = ap.parse_args()
    if not FLEET.exists():
        sys.exit("build it first: cargo build --release -p tollgate-fleet")
    runs = [(name, n, wargs + ["--proxies", str(n), "--seconds", str(args.seconds)])
            for name, _, wargs in WORKLOADS for n in [int(x) for x in args.proxies.split(",")]]
    grid = [((n, k, ttl), grid_args(n, k, ttl, GRID_SECONDS))
            for n in GRID_PROXIES for k in GRID_KEYS for ttl in GRID_TTL_MS]
    # Two at a time: each run is one thread, and the machine has two cores.
    with ThreadPoolExecutor(2) as pool:
        reports = list(pool.map(lambda run: simulate(run[-1])["report"], runs + grid))
    rows = []
    for (name, n, _), rep in zip(runs, reports):
        rows.append({"workload": name, "proxies": n, "report": rep})
        print(f"{name} x {n}: admitted {rep['admitted']}, false refusals {rep['false_refusals']}, "
              f"worst excess {rep['worst_excess']:.1f}, {rep['items_per_s']:.0f} items/s")
    cells = [(point, rep) for (point, _), rep in zip(grid, reports[len(runs):])]
    for (n, k, ttl), rep in cells:
        assert rep["worst_excess"] <= 0, (n, k, ttl, rep["worst_excess"])
    write(rows, args.seconds, cells)


def grid_lines(cells):
    lines = [
        "## Capacity grid",
        "",
        "Generated by `make bench-scale` with the table above: the same fleet (2 workers a proxy, "
        "20 000 requests a second, 2 ms round trip), every key at 40% of its limit (burst 2 s of "
        "it: 1 key 50 000/s, 1 000 keys 50/s, 10 000 keys 5/s each), for each lease TTL "
        f"(`--lease-ttl-ms`), {GRID_SECONDS} s a run. The cores are the items a second priced at the CPU per item "
        "[benchmarks.md](benchmarks.md#lease-items-per-second-and-cpu-per-item) measured for the "
        "run's items per call (interpolated between 1, 10, 100 and 1 000); Redis masters at most "
        f"{MASTER_LOAD:.0%} busy (one core each). The bound held in every cell.",
        "",
        "| proxies | active keys | lease TTL | calls/s | items/s | items per call | false refusals | "
        "memory store: service cores | Redis: service cores | Redis: cores (masters) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (n, k, ttl), r in cells:
        items, per_call = r["items_per_s"], r["items_per_call"]
        share = r["false_refusals"] / max(r["requests"], 1) * 100
        mem = items * cost_us("memory", per_call) / 1e6
        svc = items * cost_us("redis service", per_call) / 1e6
        red = items * cost_us("redis", per_call) / 1e6
        masters = max(1, math.ceil(red / MASTER_LOAD))
        lines.append(
            f"| {n:,} | {k:,} | {ttl / 1000:g} s | {r['calls_per_s']:,.0f} | {items:,.0f} | "
            f"{per_call:.2f} | {share:.2f}% | {mem:.2f} | {svc:.2f} | {red:.2f} ({masters}) |")
    return lines + [""]


def write(rows, seconds, cells):
    lines = [
        "# A fleet of 1 000 proxies, simulated",
        "",
        "`make bench-scale` (`bench/scale.py`, the `tollgate-fleet` simulator in `fleet/`): N proxies of 2 "
        "workers each decide every request with the filter's own lease code (`LeaseAllowance`, one per "
        "proxy and key, claims sent on the workers' ticks every 5 ms, 200 ms timeout, 500 ms retry, the "
        "default lease size with `instances_hint` set to the fleet's size, `burst / (4 × N)`), against the service's own buckets and fair shares "
        "(`GlobalBucket`, as the memory store keeps them, 10 s lease TTL), over a 2 ms round trip (but for the lossy network), in "
        f"virtual time ({seconds} s a run, seeded: every run gives the same figures). The fleet sends "
        "20 000 requests a second in all, a Poisson stream at each proxy.",
        "",
        "- **admitted vs bound**: the largest excess, over every key and every admission, of what the "
        "fleet admitted of that key over `burst + rate × t` (t since the key's first request; after a "
        "store loss plus the stated slack: the reserve, a token and a call's time of refill). At most 0: "
        "the bound held.",
        "- **false refusals**: requests refused (or still waiting for a lease after the timeout) while "
        "their proxy's demand for the key was under its max-min fair share of the key's rate and the "
        "key had budget (one more admission would have kept the fleet within `burst + rate × t`).",
        "- **calls/s, items/s**: what the fleet sent the service.",
        "- **follow**: after each shift of demand, how long until false refusals are back to their level "
        "before it (per 100 ms: at most twice the median of the phase before, or 2% of the requests) "
        "for half a second, the slowest shift.",
        "",
        "| workload | proxies | requests | admitted | worst excess over the bound | false refusals | "
        "timed out waiting | fell back | calls/s | items/s | items per call | follow |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        r = row["report"]
        share = r["false_refusals"] / max(r["requests"], 1) * 100
        follow = f"{r['follow_ms']} ms" if r.get("follow_ms") is not None else ""
        lines.append(
            f"| {row['workload']} | {row['proxies']:,} | {r['requests']:,} | {r['admitted']:,} | "
            f"{r['worst_excess']:.1f} | {r['false_refusals']:,} ({share:.2f}%) | {r['timed_out']:,} | "
            f"{r['fell_back']:,} | {r['calls_per_s']:,.0f} | {r['items_per_s']:,.0f} | "
            f"{r['items_per_call']:.2f} | {follow} |")
    lines += ["", "Workloads:", ""]
    lines += [f"- **{name}**: {what}." for name, what, _ in WORKLOADS]
    lines += ["", "![false refusals per 100 ms as demand shifts, 1 000 proxies](scale.png)", ""]
    lines += grid_lines(cells)
    DOC.write_text("\n".join(lines) + "\n" + tail())
    chart(rows)


def tail():
    """The hand-written part of docs/scale.md (after the generated tables), kept as it is."""
    text = DOC.read_text() if DOC.exists() else ""
    at = text.find("\n## ", text.find("\n## Capacity grid") + 1) if "\n## Capacity grid" in text \
        else text.find("\n## ")
    return text[at + 1:] if at >= 0 else ""


def chart(rows):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: chart not drawn")
        return
    shift = [r for r in rows if r["workload"] == "shift"]
    if not shift:
        return
    fig, ax = plt.subplots(figsize=(8, 3.2))
    for row in shift:
        bins = row["report"]["bins"]
        ax.plot([i / 10 for i in range(len(bins))],
                [f / max(q, 1) * 100 for q, f in bins], label=f"{row['proxies']:,} proxies", linewidth=1)
    ax.set_xlabel("s")
    ax.set_ylabel("false refusals, % of requests")
    ax.set_title("Demand shifts every 5 s (hot key, 2x over)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(REPO / "docs/scale.png", dpi=110)


if __name__ == "__main__":
    main()
