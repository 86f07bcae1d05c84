#!/usr/bin/env python3
"""The fleet simulator's table: 10, 100 and 1 000 proxies (2 workers each) over the real lease code
(`tollgate-fleet`, virtual time, seeded), each workload for 20 simulated seconds; writes
docs/scale.md's tables and its chart (false refusals per 100 ms as demand shifts).

    make bench-scale        # or: bench/scale.py [--proxies 10,100,1000] [--seconds 20]
"""
import argparse
import json
import subprocess
import sys
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
]


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
    rows = []
    for name, what, wargs in WORKLOADS:
        for n in [int(x) for x in args.proxies.split(",")]:
            r = simulate(wargs + ["--proxies", str(n), "--seconds", str(args.seconds)])
            rep = r["report"]
            rows.append({"workload": name, "proxies": n, "report": rep})
            print(f"{name} x {n}: admitted {rep['admitted']}, false refusals {rep['false_refusals']}, "
                  f"worst excess {rep['worst_excess']:.1f}, {rep['items_per_s']:.0f} items/s", flush=True)
    write(rows, args.seconds)


def write(rows, seconds):
    lines = [
        "# A fleet of 1 000 proxies, simulated",
        "",
        "`make bench-scale` (`bench/scale.py`, the `tollgate-fleet` simulator in `fleet/`): N proxies of 2 "
        "workers each decide every request with the filter's own lease code (`LeaseAllowance`, one per "
        "proxy and key, claims sent on the workers' ticks every 5 ms, 200 ms timeout, 500 ms retry, the "
        "default lease size with `instances_hint` set to the fleet's size, `burst / (4 × N)`), against the service's own buckets and fair shares "
        "(`GlobalBucket`, as the memory store keeps them, 10 s lease TTL), over a 2 ms round trip, in "
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
    DOC.write_text("\n".join(lines) + "\n" + tail())
    chart(rows)


def tail():
    """The hand-written part of docs/scale.md (after the generated tables), kept as it is."""
    text = DOC.read_text() if DOC.exists() else ""
    at = text.find("\n## ")
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
