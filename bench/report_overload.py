"""The report's lines for the twenty slowdowns (`sections.slowdowns`)."""



SLOWDOWNS_HEADING = "### Twenty slowdowns"


def slowdown_lines(s):
    """The report's table of the slowdown runs (`sections.slowdowns`)."""
    runs = s["runs"]
    capacity = 100  # 10 at once × 100 ms
    lines = [
        SLOWDOWNS_HEADING,
        "",
        f"Issue 33's scenario, {len(runs)} times: the same upstream (10 at once) under {s['rate']}/s, its service "
        f"time from 50 ms (capacity 200/s) to 100 ms ({capacity}/s) {s['slow_at']} s into each run of "
        f"{s['seconds']} s, a fresh upstream and Envoy each time, tollgate's adaptive rule (latency signal) "
        f"in `{s['module']}`. Goodput by when requests were due, from the change to the end of the run "
        "(`bench/run.py --sections slowdowns`; each run holds the overload tests' machine lock and starts "
        "once the machine's 1-minute load average is below its 2 cores, waiting up to 5 minutes).",
        "",
        f"| run | least goodput per {s['bucket_ms'] / 1000:g} s | least per second | "
        f"half-seconds below {capacity // 2}/s | goodput per {s['bucket_ms'] / 1000:g} s from the change | "
        "load average (1 min, to a tenth) before → after |",
        "|---|---|---|---|---|---|",
    ]
    first = int(s["slow_at"] * 1000 / s["bucket_ms"])
    for i, r in enumerate(runs, 1):
        lines.append(f"| {i} | {r['least_half']:.0f}/s | {r['least_second']:.0f}/s | {r['halves_below']} | "
                     + " ".join(f"{g:.0f}" for g in r["goodput"][first:])
                     + f" | {r['load'][0]:g} → {r['load'][1]:g} |")
    least = min(r["least_half"] for r in runs)
    lines += [
        "",
        f"Least of all runs: {least:.0f}/s per half-second ({least / capacity:.0%} of the new capacity), "
        f"{min(r['least_second'] for r in runs):.0f}/s per second.",
        "",
    ]
    return lines
