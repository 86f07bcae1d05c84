"""The report's section on bandwidth per key, and its chart."""
import json

from harness import (REPO)


BANDWIDTH_HEADING = "## Bandwidth per key: tollgate, nginx limit_rate, Envoy bandwidth_limit"
BW_TOLLGATE, BW_NATIVE = "Envoy + tollgate byte limit per key", "Envoy + bandwidth_limit on the route"
BW_LIMIT_RATE = "nginx + limit_rate per request"
BW_BASELINES = {"Envoy, no filter": (BW_TOLLGATE, BW_NATIVE), "nginx, no limit_rate": (BW_LIMIT_RATE,)}
BW_COLORS = {BW_TOLLGATE: "#d62728", BW_NATIVE: "#7f7f7f", BW_LIMIT_RATE: "#1f77b4"}


def _bw_expected(bw, name, r):
    """What a setup should let through in all in a case, bytes a second: tollgate per key, nginx per
    request, Envoy's bandwidth_limit per route."""
    rate = bw["configured"][name]
    return rate * (r["users"] if name == BW_TOLLGATE else r["connections"] if name == BW_LIMIT_RATE else 1)


def _bw_step(r):
    """The most bytes the client got in one 50 ms step of the timeline (all connections)."""
    t = r["timeline"]
    return max((b - a for (_, a), (_, b) in zip(t, t[1:])), default=0)


def bandwidth_lines(bw):
    """The section "Bandwidth per key: tollgate, nginx limit_rate, Envoy bandwidth_limit" of
    docs/benchmarks.md."""
    setups = bw["setups"]
    mb = lambda v: f"{v / 1e6:.3f}"
    lines = [
        BANDWIDTH_HEADING,
        "",
        "Download rate achieved against the rate configured, for tollgate's byte limit per key "
        "([algorithms.md](algorithms.md#byte-limits-bandwidth-per-key)), nginx's `limit_rate` and Envoy's "
        "`bandwidth_limit` filter, each set to 1 MB/s as nearly as its units allow, in one run on this "
        "machine. Each proxy (Envoy 1.40 with `--concurrency 2`, nginx-light with 2 workers, neither pinned) "
        "is in front of `tollgate-testbed upstream`, which writes `/bytes/N` as fast as the connection "
        "takes it. The client (Python, a thread per connection, every body read whole) runs three cases "
        f"per setup, each with a fresh `x-user` and after a rest of at least a second: **1 connection** "
        f"downloading {bw['setups'][BW_TOLLGATE]['cases']['1 connection']['bytes'] / 1e6:g} MB; **4 "
        "connections** of the same user at once, a quarter each; **2 clients** at once (users `alice` "
        "and `bob`, from 127.0.0.1 and 127.0.0.2), half each. **Achieved**: all bytes ÷ (last byte − "
        "first request sent); **past the burst**: (bytes − what the limiter lets through at once) ÷ the "
        f"same time — tollgate's `burst` ({bw['burst']:,} bytes) per key, and for Envoy the second's worth "
        "its route bucket holds (it starts full after a rest); nginx sends no burst. **First byte**: "
        "the first body byte, from the first request sent; **longest pause**: the longest time a "
        "connection got no body bytes, from its response head on; **largest 50 ms step**: the most "
        f"bytes the client got in one 50 ms slice. tollgate is `{bw['module']}`. `bench/run.py "
        "--sections bandwidth`; chart: [bandwidth.png](bandwidth.png).",
        "",
        "| setup | case | configured | expected in all | achieved in all | past the burst | achieved ÷ "
        "expected | per client | first byte | longest pause | largest 50 ms step | connections done at |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    per = {BW_TOLLGATE: "per key", BW_NATIVE: "per route", BW_LIMIT_RATE: "per request"}
    for name in (BW_TOLLGATE, BW_LIMIT_RATE, BW_NATIVE):
        for case, r in setups[name]["cases"].items():
            want = _bw_expected(bw, name, r)
            paced = "—" if r["paced_rate"] is None else f"{mb(r['paced_rate'])} MB/s"
            clients = ", ".join(f"{u.split('-')[0]} {mb(v)}" for u, v in r["per_user"].items()) if r["users"] > 1 else ""
            done = ", ".join(f"{e['seconds']:.2f}" for e in sorted(r["each"], key=lambda e: e["seconds"]))
            lines.append(f"| {name} | {case} | {mb(bw['configured'][name])} MB/s {per[name]} | {mb(want)} MB/s | "
                         f"**{mb(r['rate'])} MB/s** | {paced} | {r['rate'] / want:.2f} | {clients} | "
                         f"{r['first_byte_s']:.2f} s | {r['stall_s']:.2f} s | {_bw_step(r) / 1e6:.2f} MB | {done} s |")
    lines += ["", "Without a limit, the same paths (the baselines of the CPU table below):", "",
              "| setup | case | bytes | achieved |", "|---|---|---|---|"]
    for base in BW_BASELINES:
        for case, r in setups[base]["cases"].items():
            lines.append(f"| {base} | {case} | {r['bytes'] / 1e6:g} MB | {r['rate'] / 1e6:,.0f} MB/s |")

    def base_net(base):
        cases = setups[base]["cases"].values()
        return sum(r["cpu_net_ms_per_mb"] for r in cases) / len(cases)
    lines += [
        "",
        "### Proxy CPU per MB",
        "",
        "User+sys CPU of the proxy process (every thread: `/proc/PID/task/*/schedstat`; nginx: master and "
        "workers) over each transfer, divided by the MB transferred. A paced transfer lasts seconds, so "
        "what the proxy spends doing nothing over as long counts in it: **idle** is the proxy's CPU per "
        "second while nothing passes (measured in the rests between the cases, 2 s and more in all), and "
        "**less idle** takes idle × the transfer's duration off. The baselines move their bytes at full "
        "speed (larger downloads, so that their CPU is measurable); **over the baseline** is the less-idle "
        "figure minus the same proxy's baseline (the mean of its two cases). One run, not repeated: "
        "read differences under about 1 ms/MB as noise.",
        "",
        "| setup | case | MB | seconds | CPU ms | CPU ms/MB | idle CPU ms/s | ms/MB less idle | over the baseline |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for base, limited in BW_BASELINES.items():
        b = base_net(base)
        for name in (base, *limited):
            row = setups[name]
            for case, r in row["cases"].items():
                over = "" if name == base else f"{r['cpu_net_ms_per_mb'] - b:+.2f}"
                lines.append(f"| {name} | {case} | {r['bytes'] / 1e6:g} | {r['seconds']:.2f} | {r['cpu_ms']:.1f} | "
                             f"{r['cpu_ms_per_mb']:.2f} | {row['idle_ms_per_s']:.2f} | {r['cpu_net_ms_per_mb']:.2f} | "
                             f"{over} |")
    if "idle_requests_rule_ms_per_s" in bw:
        lines += ["", f"For comparison, the same Envoy and module with a rule of requests instead of bytes "
                  f"spends {bw['idle_requests_rule_ms_per_s']:.1f} ms CPU a second idle "
                  f"({setups[BW_TOLLGATE]['idle_ms_per_s']:.1f} ms with the byte limit, "
                  f"{setups['Envoy, no filter']['idle_ms_per_s']:.1f} ms without a filter)."]

    # Reading.
    tg, ng, nv = (setups[n]["cases"] for n in (BW_TOLLGATE, BW_LIMIT_RATE, BW_NATIVE))
    t1, t4, t2 = tg["1 connection"], tg["4 connections"], tg["2 clients"]
    n1, n4 = ng["1 connection"], ng["4 connections"]
    v1, v4, v2 = nv["1 connection"], nv["4 connections"], nv["2 clients"]
    within = lambda r, want, tol=0.05: abs(r / want - 1) <= tol
    tg_ok = all(within(r["paced_rate"], _bw_expected(bw, BW_TOLLGATE, r)) for r in tg.values())
    nv_ok = all(within(r["paced_rate"], _bw_expected(bw, BW_NATIVE, r)) for r in nv.values())
    ng_ok = all(within(r["rate"], _bw_expected(bw, BW_LIMIT_RATE, r), 0.1) for r in ng.values())
    done = lambda r: ", ".join(f"{d:.1f}" for d in sorted(e["seconds"] for e in r["each"]))
    whole = all(e["seconds"] - e["first_byte_s"] < 0.1 for e in t4["each"])
    charged = [r.get("paced_bytes") for r in tg.values()]
    tg_net = [r["cpu_net_ms_per_mb"] for r in tg.values()]
    nv_net = [r["cpu_net_ms_per_mb"] for r in nv.values()]
    ng_net = [r["cpu_net_ms_per_mb"] for r in ng.values()]
    span = lambda v: f"{min(v):.1f} to {max(v):.1f}"
    tg_idle = setups[BW_TOLLGATE]["idle_ms_per_s"]
    workers = {setups[n].get("workers") for n in (BW_TOLLGATE, BW_NATIVE)}
    lines += [
        "",
        "Reading: " + ("**on average each limiter keeps the rate it is set to, in its own unit.** "
                       if tg_ok and nv_ok and ng_ok else "") +
        f"tollgate held one key to {mb(t1['paced_rate'])} MB/s past its burst over one connection and "
        f"{mb(t4['paced_rate'])} MB/s over four at once (configured 1.000"
        + (", Envoy's two workers both serving" if workers == {2} else "") +
        "), two keys downloading at once got " + " and ".join(mb(v) for v in t2["per_user"].values()) +
        " MB/s each" + (", and its `paced_bytes` counted every byte sent (" + f"{charged[0]:,}" + " a case)"
                        if all(c == r["bytes"] for c, r in zip(charged, tg.values())) else "") +
        f"; nginx's `limit_rate` paces each request, so one client's four connections got "
        f"{n4['rate'] / n1['rate']:.1f}× what one did ({mb(n4['rate'])} against {mb(n1['rate'])} MB/s); "
        f"Envoy's `bandwidth_limit` keeps one bucket for the route: {mb(v1['paced_rate'])} MB/s past its "
        f"burst over one connection, {mb(v4['paced_rate'])} over four, {mb(v2['paced_rate'])} for two "
        f"clients together, who shared it unevenly (done at {done(v2)} s; four connections: {done(v4)} s) — "
        "Envoy's stream rate limiter notes that with a shared bucket it favours one stream at a time. "
        "**How the bytes arrive differs.** tollgate's delivery is coarse: "
        f"over one connection the client got no body byte for {t1['first_byte_s']:.1f} s, then steps of up to "
        f"{_bw_step(t1) / 1048576:.1f} MiB with pauses of up to {t1['stall_s']:.1f} s between them; "
        + (f"four connections of one key each got their whole quarter at once, one after another (done at "
           f"{done(t4)} s); " if whole else f"four connections of one key were done at {done(t4)} s, the "
           f"longest pause {t4['stall_s']:.1f} s; ") +
        f"two keys at once, a pause of up to {t2['stall_s']:.1f} s. A held body is passed on only once "
        "every chunk charged while it was held is covered (each one extends the hold), so what is let "
        "through comes in steps of what Envoy buffers meanwhile (with the default 1 MiB buffer limits, a "
        "chunk read at once on top of a full buffer). The average stays within the bound, but a client "
        "with a read timeout of a second or two, or a player that needs bytes as they come, would "
        "notice: lower the listener's and the cluster's `per_connection_buffer_limit_bytes` (64 KiB "
        "gave steps of about 131 KB every 0.13 s, [algorithms.md](algorithms.md#byte-limits-bandwidth-per-key)). "
        f"nginx writes a little at a time (longest pause "
        f"{n1['stall_s'] * 1000:.0f} ms, at most {_bw_step(n1) / 1e6:.2f} MB in any 50 ms over one "
        f"connection); Envoy's filter passes a slice every 50 ms `fill_interval` (longest pause "
        f"{v1['stall_s'] * 1000:.0f} ms), after sending a second's worth at once when its bucket has "
        f"rested full ({_bw_step(v1) / 1e6:.1f} MB in the first 50 ms), so over five seconds its average "
        f"ran {v1['rate'] / _bw_expected(bw, BW_NATIVE, v1) - 1:.0%} above the limit. **CPU.** Moving a MB "
        f"without a limit costs Envoy {base_net('Envoy, no filter'):.2f} ms and nginx "
        f"{base_net('nginx, no limit_rate'):.2f} ms. Paced at 1 MB/s, less idle: tollgate's Envoy "
        f"{span(tg_net)} ms/MB" + (" (below zero: within the noise of the idle estimate)" if min(tg_net) < 0 else "")
        + f", Envoy's filter {span(nv_net)}, nginx {span(ng_net)}: moving the bytes in a few large steps costs "
        f"tollgate's Envoy little. What stands out is tollgate's idle cost: {tg_idle:.1f} ms CPU a second with "
        "the byte limit, "
        f"against {setups['Envoy, no filter']['idle_ms_per_s']:.1f} ms for Envoy alone"
        + (f" and {bw['idle_requests_rule_ms_per_s']:.1f} ms for tollgate with a rule of requests"
           if "idle_requests_rule_ms_per_s" in bw else "") +
        f" — over the {t1['seconds']:.1f} s one-connection transfer, idle at that rate comes to "
        f"{tg_idle * t1['seconds']:.0f} ms of the {t1['cpu_ms']:.0f} ms it spent"
        + (", so the gross CPU per MB of a paced transfer is mostly what the module spends idle."
           if tg_idle * t1["seconds"] > t1["cpu_ms"] / 2 else "."),
        "",
        "![bytes received over time](bandwidth.png)",
        "",
        "Configurations (the whole of each is in `bench/section_bandwidth.py`, `bandwidth_setup`):",
        "",
        "- tollgate (Envoy's wasm filter, the route to the upstream):",
        "",
        "  ```json",
        "  " + json.dumps(bw["plugin"]),
        "  ```",
        "",
        "- Envoy `bandwidth_limit`: in the HTTP filters, `{\"name\": \"envoy.filters.http.bandwidth_limit\", "
        "\"typed_config\": {\"@type\": \"…BandwidthLimit\", \"stat_prefix\": \"bandwidth_default\"}}` (disabled: "
        "`enable_mode` defaults to `DISABLED`), and on the route:",
        "",
        "  ```json",
        "  " + json.dumps({"typed_per_filter_config": {"envoy.filters.http.bandwidth_limit": bw["route"]}}),
        "  ```",
        "",
        f"  `limit_kbps` is KiB/s: {bw['kbps']} × 1024 = {bw['kbps'] * 1024:,} bytes/s; `fill_interval` "
        "left at its default, 50 ms. One bucket for the route, shared by every client and worker: Envoy "
        "1.40 has no bucket per client (it refuses `named_bucket_selector`, which Envoy's main branch "
        "adds: buckets by name, or by client certificate CN under mTLS).",
        "",
        "- nginx (`worker_processes 2`, otherwise defaults, `proxy_buffering` on):",
        "",
        "  ```nginx",
        "  " + bw["nginx_location"],
        "  ```",
        "",
        f"  `{bw['nginx_rate']}` is 1,048,576 bytes/s, per request; the baseline is the same without "
        "`limit_rate`.",
        "",
    ]
    return lines


def bandwidth_chart(bw):
    """docs/bandwidth.png: bytes received over time in each case, per limited setup."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no chart")
        return
    setups = bw["setups"]
    cases = list(setups[BW_TOLLGATE]["cases"])
    fig, axes = plt.subplots(1, len(cases), figsize=(15, 5), sharey=True)
    for ax, case in zip(axes, cases):
        end = 0
        for name in (BW_TOLLGATE, BW_LIMIT_RATE, BW_NATIVE):
            r = setups[name]["cases"][case]
            t = [p[0] for p in r["timeline"]]
            ax.step(t, [p[1] / 1e6 for p in r["timeline"]], where="post", color=BW_COLORS[name], label=name,
                    linewidth=2)
            end = max(end, t[-1])
        ax.plot([0, end], [0, end], color="black", linestyle=":", label="1 MB/s")
        users = setups[BW_TOLLGATE]["cases"][case]["users"]
        if users > 1:  # tollgate: a bucket per key
            ax.plot([0, end / users], [0, end], color=BW_COLORS[BW_TOLLGATE], linestyle=":", alpha=0.6,
                    label=f"{users} MB/s (tollgate, {users} keys)")
            ax.legend(loc="lower right", fontsize=9)
        ax.set_title(case)
        ax.set_xlabel("seconds from the first request")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("MB received (all connections)")
    axes[0].legend(loc="upper left", fontsize=9)
    fig.tight_layout()
    fig.savefig(REPO / "docs/bandwidth.png", dpi=80)

