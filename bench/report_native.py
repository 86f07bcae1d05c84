"""The native build's part of docs/benchmarks.md: its targets (against Envoy's local_ratelimit),
its section (every setup of the cost table, Wasm and native side by side) and its headline figures
(which `make bench` compares with the last run's to flag a regression)."""
import statistics

from harness import NATIVE
from instructions import ADD_HEADER

NATIVE_HEADING = "## The native build"
NONE, NOOP_DM = "Envoy, no filter", "Envoy + do-nothing dynamic module"
LOCAL_RL = "Envoy local_ratelimit per client IP"
NATIVE_PER_IP = NATIVE + " token bucket per client IP"
NATIVE_NEVER = NATIVE + ", one rule that matches nothing"
NATIVE_LEASE = NATIVE + " global, lease (memory)"
# The callgrind floors (bench/instructions.py) of the same setups.
I_NONE, I_NOOP_DM, I_LOCAL_RL = "Envoy, no filter", "Envoy + do-nothing dynamic module", "Envoy local_ratelimit per client IP"
I_PER_IP = "tollgate native per client IP, draft headers (defaults)"
I_PER_IP_BARE = "tollgate native per client IP, no rate-limit headers"
I_NEVER = "tollgate native, one rule that matches nothing"
I_WASM_PER_IP = "tollgate per client IP, draft headers (defaults)"
I_LEASE = "tollgate native global, lease (memory)"



# From a callgrind profile of the native build (kept as measured; `make bench` does not redo it).
PROFILE = (
    "Where the native per-IP request goes (callgrind profile of 2 000 requests with the draft headers, a "
    "build with symbols, 2026-12-04): tollgate's hooks take 7,502 instructions a request (10,637 on "
    "2026-12-02, 8,009 on 2026-12-03) — the request-headers hook 4,249, of which the decision 3,764 "
    "(the shared slot's read, decision and compare-and-swap 1,645; the client key 550 and its hash 195; "
    "the stats and report 222; the time 124), the response-headers hook 2,703 (Envoy's two header "
    "insertions 1,831 of it, the headers' text 462), the other hooks about 550; the global lease path "
    "7,583. What cut it: one check that no worker stash serves (every rule of the native build by "
    "default) is admitted without the per-check vectors, its plan made in place, and its slot group "
    "read and compare-and-swapped in one call of the store (one lookup of the key, not one for the read "
    "and one for the write); the plans of a request are read by reference; a rule's own "
    "`RateLimit-Policy` value and the start of its `RateLimit` value are rendered when the configuration "
    "loads; a slot group's name is made in one buffer and decoded where it is read; the IPv4 peer "
    "address is cut in one pass; a request whose only work left is its response's headers is kept as "
    "its report (a few words) rather than as a stream of several hundred bytes moved into and out of "
    "the worker's table; the worker's lock knows its holder by a thread-local the hooks read anyway, "
    "not by asking for the thread's id; and a stream with nothing left to do returns from its body and "
    "log hooks at once. What is left is spread thin: beyond the slot's read and write, the key and the "
    "headers' text, no part of tollgate's own costs more than about 200."
)

def paired(get, a, b, path="allowed"):
    """Median over rounds of a − b measured in the same round."""
    ra, rb = get[(a, path)]["per_round"], get[(b, path)]["per_round"]
    return statistics.median(x["cpu_us"] - y["cpu_us"] for x, y in zip(ra, rb))


def floors(counted):
    """Instructions per request of the callgrind floors, if they were counted."""
    if not counted:
        return {}
    return {k: v["per_request"] for k, v in counted.get("floors", {}).items()}


def figures(get, counted):
    """The native build's figures: CPU µs over Envoy alone (paired) and instructions."""
    f = floors(counted)
    out = {
        "per_ip": paired(get, NATIVE_PER_IP, NONE),
        "per_ip_bare": paired(get, NATIVE + " per client IP, no rate-limit headers", NONE),
        "never": paired(get, NATIVE_NEVER, NONE),
        "lease": paired(get, NATIVE_LEASE, NONE),
        "local_rl": paired(get, LOCAL_RL, NONE),
        "noop": paired(get, NOOP_DM, NONE),
        "wasm_per_ip": paired(get, "tollgate token bucket per client IP", NONE),
        # Above the floors a dynamic module cannot go below, measured in the same rounds.
        "never_over_noop": paired(get, NATIVE_NEVER, NOOP_DM),
        "per_ip_over_noop": paired(get, NATIVE_PER_IP, NOOP_DM),
    }
    if all(k in f for k in (I_NONE, I_NOOP_DM, I_LOCAL_RL, I_PER_IP, I_NEVER)):
        base = f[I_NONE]
        out.update(i_per_ip=f[I_PER_IP] - base, i_never=f[I_NEVER] - base, i_local_rl=f[I_LOCAL_RL] - base,
                   i_noop=f[I_NOOP_DM] - base, i_per_ip_bare=f.get(I_PER_IP_BARE, base) - base,
                   i_wasm_per_ip=f.get(I_WASM_PER_IP, base) - base)
        if I_LEASE in f:
            out["i_lease"] = f[I_LEASE] - base
        # Instructions a µs on this VM: Envoy alone's count over its CPU time (both per request).
        out["i_per_us"] = base / get[(NONE, "allowed")]["cpu_us"]
    return out


def headlines(get, counted):
    """Headline figures of the native build, smaller is better."""
    n = figures(get, counted)
    out = {
        "native per client IP, draft headers, µs over Envoy alone": round(n["per_ip"], 3),
        "native, a rule that matches nothing, µs over Envoy alone": round(n["never"], 3),
        "native global lease (memory), µs over Envoy alone": round(n["lease"], 3),
    }
    if "i_per_ip" in n:
        out["native per client IP, draft headers, instructions over Envoy alone"] = round(n["i_per_ip"])
        out["native, a rule that matches nothing, instructions over Envoy alone"] = round(n["i_never"])
    return out




def target_rows(get, counted):
    """Rows of the report's target table: CPU (paired medians, noisy on a shared VM) and, where
    callgrind counted them, instructions, by which the floors are stated."""
    n = figures(get, counted)
    instr = "i_per_ip" in n
    i_text = lambda key, ref: (f"; instructions {n[key]:+,.0f} vs {n[ref]:+,.0f}" if instr else "")
    if instr:
        floor = n["i_noop"] + 2 * ADD_HEADER
        per_ip_why = (f"no. The floor of a dynamic module that adds two headers is {floor:+,.0f} instructions "
                      f"(the do-nothing module {n['i_noop']:+,.0f}, two insertions into Envoy's header map of "
                      f"about {ADD_HEADER:,} each): "
                      + ("above" if floor > n["i_local_rl"] else "below") + f" local_ratelimit's "
                      f"{n['i_local_rl']:+,.0f} before any work of the rule's own. tollgate's work above that "
                      f"floor: {n['i_per_ip'] - floor:+,.0f} instructions")
        never_why = (f"no. The do-nothing dynamic module alone: {n['i_noop']:+,.0f} instructions; tollgate's own "
                     f"above it: {n['i_never'] - n['i_noop']:+,.0f}")
    else:
        per_ip_why = (f"no. A dynamic module that does nothing adds {n['noop']:+.1f} µs and the two headers are "
                      f"two insertions in Envoy; tollgate's own work above the do-nothing module: "
                      f"{n['per_ip_over_noop']:+.1f} µs (paired)")
        never_why = f"no. tollgate's own work above the do-nothing dynamic module: {n['never_over_noop']:+.1f} µs"
    lease_i, lease_why = "", "no"
    if "i_lease" in n:
        over = n["i_lease"] - n["i_local_rl"]
        budget = 2 * n["i_per_us"]
        lease_i = (f"; instructions {n['i_lease']:+,.0f} vs local_ratelimit's {n['i_local_rl']:+,.0f}: "
                   f"{over:,.0f} more, where 2 µs is about {budget:,.0f} (Envoy alone runs about "
                   f"{n['i_per_us']:,.0f} instructions a µs)")
        lease_why = "no" if over > budget else (
            f"not shown: within it by instructions ({budget - over:,.0f} to spare at this run's rate, "
            "which moves by more than that between runs), over it by the CPU medians "
            f"({n['lease'] - n['local_rl'] - 2:.1f} µs)")
    return [
        f"| the native build per client IP with the draft headers adds no more CPU per request than Envoy's "
        f"local_ratelimit per client IP | {n['per_ip']:+.1f} µs over Envoy alone vs local_ratelimit's "
        f"{n['local_rl']:+.1f} µs (paired){i_text('i_per_ip', 'i_local_rl')}; without headers "
        f"{n['per_ip_bare']:+.1f} µs. The Wasm build: {n['wasm_per_ip']:+.1f} µs |"
        f" {'yes' if n['per_ip'] <= n['local_rl'] else per_ip_why} |",
        f"| the native build, a rule that matches nothing, adds ≤ 1 µs | {n['never']:+.1f} µs over Envoy alone "
        f"(paired){i_text('i_never', 'i_noop') + ' (the do-nothing dynamic module: the second)' if instr else ''} | "
        f"{'yes' if n['never'] <= 1.0 else never_why} |",
        f"| the native build's global lease path adds ≤ local_ratelimit's + 2 µs | {n['lease']:+.1f} µs over Envoy "
        f"alone vs {n['local_rl'] + 2:+.1f} µs{lease_i} | {'yes' if n['lease'] <= n['local_rl'] + 2 else lease_why} |",
    ]


def section_lines(get, counted):
    """The section: every tollgate setup of the cost table, Wasm and native side by side."""
    n = figures(get, counted)
    lines = [
        NATIVE_HEADING,
        "",
        "The Envoy dynamic module ([envoy-native.md](envoy-native.md)) in every tollgate setup of the cost "
        "table, measured in the same interleaved rounds as the Wasm module (CPU µs per request, medians; "
        "\"over Envoy alone\" is the paired median of the setup minus Envoy without filters):",
        "",
        "| setup | path | Wasm | native | native over Envoy alone | native p99 ms | native requests/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for (name, path), row in get.items():
        if not name.startswith(NATIVE):
            continue
        wasm_name = "tollgate" + name[len(NATIVE):]
        wasm = get.get((wasm_name, path))
        # Envoy alone is measured on the allowed path only.
        over = paired(get, name, NONE, path) if (NONE, path) in get else None
        wasm_cpu = "" if wasm is None else f"{wasm['cpu_us']:.1f}"
        over_text = "" if over is None else f"{over:+.1f}"
        label = name[len(NATIVE):].lstrip(", ") or name
        lines.append(f"| {label} | {path} | {wasm_cpu} | {row['cpu_us']:.1f} | {over_text} | "
                     f"{row['p99_ms']:.2f} | {row['rps']:.0f} |")
    for label, name, over in (("do-nothing dynamic module (`bench/noop-native`)", NOOP_DM, n["noop"]),
                              ("Envoy local_ratelimit per client IP", LOCAL_RL, n["local_rl"])):
        row = get[(name, "allowed")]
        lines.append(f"| {label} | allowed | | {row['cpu_us']:.1f} | {over:+.1f} | {row['p99_ms']:.2f} | "
                     f"{row['rps']:.0f} |")
    lines.append("")
    if "i_per_ip" in n:
        lines += [
            "Instructions per request over Envoy alone (callgrind, [below](#instructions-per-request)): "
            f"the do-nothing dynamic module {n['i_noop']:+,.0f}, Envoy's local_ratelimit per client IP "
            f"{n['i_local_rl']:+,.0f}, the native build with a rule that matches nothing {n['i_never']:+,.0f}, "
            f"per client IP {n['i_per_ip_bare']:+,.0f} without headers and {n['i_per_ip']:+,.0f} with the draft "
            f"headers (the Wasm build: {n['i_wasm_per_ip']:+,.0f}).",
            "",
        ]
    lines += [
        "Reading: a dynamic module costs Envoy a filter object per request and a call per hook "
        "(request and response headers and body, stream end, destroy) whatever it does: the do-nothing "
        "module's row. Envoy's local_ratelimit is compiled into Envoy and pays none of that, so a "
        "dynamic module cannot cost less than the do-nothing one, and each response header it adds is an "
        "insertion into Envoy's header map, a call of its own. What tollgate adds above the do-nothing "
        "module is its decision: the client address read in place, the key's keyed hash, one read and one "
        "compare-and-swap of the slot group in the process's memory, the headers' text — with no heap "
        "allocation (`tests/envoy/hot_path.rs` counts none at all). The native instruction counts leave "
        "out tollgate's tick: it runs every 5 or 10 ms whatever the traffic (it hands the worker's stats "
        "to Envoy), and under callgrind, at about 300 requests a second, it would be charged to a "
        "fiftieth of the requests it is shared by at full load; its cost per call is stated with the "
        "counts. The CPU columns move "
        "by several µs between rounds on this VM (a paired median below zero, as the do-nothing module's "
        "can be, is that noise): judge the builds by the instruction counts.",
        "",
        PROFILE,
        "",
    ]
    return lines
