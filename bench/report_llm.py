"""The report's section on token budgets: reserve then settle against charging after the response, and its chart."""

from harness import (REPO)


LLM_HEADING = "## Token budgets: reserve then settle vs charge after"
LLM_NAMES = {  # the setups' names in results.json, and what the report calls them
    "tollgate, reserve then settle": "tollgate: reserve the request's maximum, settle its usage",
    "tollgate, charge after the response": "tollgate: admit while a token is left (`cost: 1`), charge the usage after",
    "Envoy ratelimit + Lua, charge after the response": "Envoy 1.40: global `ratelimit` + Lua, usage added when "
                                                         "the stream is done",
}


def _waves(r, llm):
    """How many of a setup's admissions were in the first wave, and how many later."""
    first = sum(1 for t, _ in r["timeline"] if t < llm["every"] / 2)
    return first, r["admitted"] - first


def charge_after(after, native, llm):
    """What admitting while the budget is above zero and charging after the response did."""
    fa, la = _waves(after, llm)
    fn, ln = _waves(native, llm)
    wave = ("the whole first wave through" if fa == fn == llm["streams"] else
            f"{fa} (tollgate) and {fn} (Envoy) of the first wave's {llm['streams']} streams through")
    later = ("both then refused the key for the rest of the run (tollgate while the debt refills, "
             "Envoy's service until its window ends)" if la == ln == 0 else
             f"later waves added {la} (tollgate) and {ln} (Envoy) more")
    return (f"admitting while the budget is above zero and charging after the response let {wave}: "
            f"{after['tokens']:,} and {native['tokens']:,} tokens in all, at most "
            f"{after['peak_over']:+,.0f} and {native['peak_over']:+,.0f} tokens over the budget "
            f"({after['peak_pct']:+.0%}, {native['peak_pct']:+.0%}); {later}.")


def reserved(reserve):
    """What reserving each request's maximum did."""
    if reserve["peak_over"] <= 0:
        held = max(-reserve["over"], 0)
        return (f"Reserving each request's maximum admitted {reserve['admitted']} streams, "
                f"{reserve['tokens']:,} tokens, and never went over (largest excess "
                f"{reserve['peak_over']:+,.0f} tokens): streams were admitted while their maxima fitted, "
                "and the unused part of each reservation came back when its stream ended. What it gives "
                "up: a request is admitted only when its whole maximum fits, so while streams are in flight "
                "their unused reservations are not available, and up to one maximum of the budget can stay "
                "unspent while requests wait for a whole one to refill: "
                f"{held:,.0f} tokens ({held / reserve['budget']:.0%}) of the budget were not used by the end.")
    return (f"Reserving each request's maximum admitted {reserve['admitted']} streams, "
            f"{reserve['tokens']:,} tokens, and went over the budget by at most {reserve['peak_over']:,.0f} "
            f"tokens ({reserve['peak_pct']:.1%}) where the bound allows none: a finding to look into (the "
            "budget here is reckoned from the client's send times, a little before the admissions).")


def llm_lines(llm):
    """The section "Token budgets: reserve then settle vs charge after" of docs/benchmarks.md."""
    setups, cpu = llm["setups"], llm["cpu"]
    reserve = setups["tollgate, reserve then settle"]
    after = setups["tollgate, charge after the response"]
    native = setups["Envoy ratelimit + Lua, charge after the response"]
    budget, rate = llm["budget"], llm["budget"] / 60
    lines = [
        LLM_HEADING,
        "",
        "A budget of tokens per minute per API key, where a request's tokens are known only from its "
        "response ([llm-budgets.md](llm-budgets.md)). One workload against three setups, each Envoy 1.40 "
        "with 2 workers (not pinned) in front of `tollgate-testbed upstream`, which answers like an LLM "
        f"API: one key with **{budget:,} tokens a minute** (burst {budget:,}); every {llm['every']:g} s, "
        f"{llm['streams']} concurrent streaming requests, {llm['waves']} times; each uses between 300 and "
        f"{llm['max']:,} tokens (seeded random, 100 of them input) over 10 events 100–200 ms apart (1–2 s, "
        "OpenAI chat format, the usage in the last event) and says its maximum in `x-max-tokens: "
        f"{llm['max']}`. **Tokens admitted**: the reported usage of the streams answered 200. **Budget**: "
        f"burst + rate × t = {budget:,} + {rate:.1f} × t, t from the first request sent; **over the "
        "budget**: tokens admitted minus the budget when the last request was sent; **largest excess**: "
        "the most the tokens admitted so far exceeded the budget at any admission (negative: never over). "
        f"tollgate is `{llm['module']}`. `bench/run.py --sections llm`; chart: "
        "[llm-overshoot.png](llm-overshoot.png).",
        "",
        "| setup | admitted | refused | tokens admitted | budget at the end | over the budget at the end "
        "| largest excess (at) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, label in LLM_NAMES.items():
        r = setups[name]
        lines.append(f"| {label} | {r['admitted']} | {r['refused']} | {r['tokens']:,} | {r['budget']:,.0f} "
                     f"| {r['over']:+,.0f} ({r['over_pct']:+.0%}) | {r['peak_over']:+,.0f} ({r['peak_pct']:+.0%}, "
                     f"at {r['peak_at']:.1f} s) |")
    errors = sum(r["errors"] + r["incomplete"] for r in setups.values())
    settled_ok = reserve["settled"] == reserve["tokens"] and after["settled"] == after["tokens"]
    lines += [
        "",
        f"Reading: {charge_after(after, native, llm)} {reserved(reserve)} "
        f"tollgate's `settled` counter {'matched' if settled_ok else 'did not match'} the usage the client "
        f"read ({reserve['settled']:,} and {after['settled']:,} tokens); Envoy's rate limit service was asked "
        f"{native.get('rls_checks', 0)} times at the request and {native.get('rls_charges', 0)} times when "
        f"a stream was done, adding {native.get('rls_charged', 0):,} tokens. "
        + (f"{errors} answers were neither 200 with their usage nor 429." if errors else
           "Every answer was a 429 or a 200 with its whole stream."),
        "",
        "The Envoy setup is the strongest native one that charges the usage after the response, as Envoy "
        "AI Gateway configures it: the global rate limit filter (`failure_mode_deny: true`) checks the "
        "key when the request arrives (`hits_addend: {number: 0}`) and, with `apply_on_stream_done: "
        "true`, adds the usage when the stream is done (`hits_addend: {format: "
        "'%DYNAMIC_METADATA(llm:total_tokens)%'}`); a Lua filter reads each stream chunk by chunk as it "
        "passes (`bodyChunks()`, nothing buffered) and puts the last `total_tokens` in the dynamic "
        "metadata. The whole configuration: [bench/envoy-llm-native.yaml](../bench/envoy-llm-native.yaml). "
        "In Envoy 1.40 a route's own `rate_limits` accept `hits_addend` but the filter sends no hits from "
        "them; the filter's per-route `RateLimitPerRoute.rate_limits` send them, so the configuration "
        "uses those. The rate limit service is `bench/rls.py` (for the benchmark), counting as "
        "envoyproxy/ratelimit does — per key, a fixed window of a minute, counter += hits, over the limit "
        "when the counter passes it — with the choices most favourable to this setup: a check (0 hits) "
        "is refused once the counter has reached the budget (envoyproxy/ratelimit: only past it), and "
        "the window starts with the run (envoyproxy/ratelimit aligns it to the clock: a minute's turn "
        "during the run would reset the counter and let another whole wave through). No native setup "
        "can do better while it charges after the response: a check can only see what has already been "
        "charged, and every stream of a wave is checked before any has ended.",
        "",
        "![tokens admitted against the budget](llm-overshoot.png)",
        "",
        "### CPU that settlement adds",
        "",
        "Envoy with one worker pinned to core 0, `wrk -c32` and the LLM upstream on core 1; every request a "
        "streamed answer of 10 events 1 ms apart with its usage (1 000 tokens) in the last, admitted (a budget "
        f"nobody reaches); one Envoy per setup for the whole run, warmed up for 1 s, then {cpu['rounds']} "
        f"interleaved rounds of {cpu['seconds']} s (short, so that the two runs of a pair are close in "
        "time), setups in a shuffled order each round; CPU µs per "
        "request is the Envoy process's user+sys time over the run divided by the requests, the median "
        "over rounds. The rule reserves `x-max-tokens` per `x-api-key` in each "
        "setup; \"another path\" is a second rule matching `/v1/` only.",
        "",
        "| setup | CPU µs/request | (rounds' range) | requests/s | tokens settled per request (≈ usage) |",
        "|---|---|---|---|---|",
    ]
    for name, r in cpu["setups"].items():
        lines.append(f"| {name} | {r['cpu_us']:.1f} | {r['cpu_min']:.1f}–{r['cpu_max']:.1f} | {r['rps']:.0f} | "
                     f"{r['settled_per_request']:.0f} |")

    def diff(key):
        d = cpu[key]
        return f"**{d['median']:+.1f} µs** (middle half of the rounds: {d['q1']:+.1f} to {d['q3']:+.1f})"
    lines += [
        "",
        "Paired medians (each round's difference between two setups measured in it), with the middle "
        "half of the rounds' differences:",
        "",
        f"- settlement on a streamed answer (the rule with `settle` minus the same rule without): "
        f"{diff('settle_vs_none')}; against the rule without settle at `worker_batch: 0` (which `settle` "
        f"implies), the settlement proper: {diff('settle_vs_batch0')};",
        f"- a request no settle rule applies to (a settle rule on another path, minus the same two rules "
        f"without `settle`): {diff('elsewhere_vs_none')} — the target is nothing; against the one rule "
        f"alone (the second rule's match included): {diff('elsewhere_vs_one_rule')}.",
        "",
    ]
    return lines


def llm_chart(llm):
    """docs/llm-overshoot.png: the tokens admitted over time against the budget, per setup."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no chart")
        return
    colors = {"tollgate, reserve then settle": "#d62728", "tollgate, charge after the response": "#ff7f0e",
              "Envoy ratelimit + Lua, charge after the response": "#7f7f7f"}
    styles = {"tollgate, charge after the response": "--"}
    widths = {"Envoy ratelimit + Lua, charge after the response": 5}  # under tollgate's dashed line
    fig, ax = plt.subplots(figsize=(10, 5.5))
    end = max(r["seconds"] for r in llm["setups"].values()) + llm["every"]
    for name, r in llm["setups"].items():
        t = [0.0] + [p[0] for p in r["timeline"]] + [end]
        y = [0] + [p[1] for p in r["timeline"]] + [r["tokens"]]
        ax.step(t, y, where="post", color=colors.get(name), linestyle=styles.get(name, "-"),
                linewidth=widths.get(name, 2), alpha=0.6 if name in widths else 1,
                label=LLM_NAMES.get(name, name).replace("`", ""))
    ax.plot([0, end], [llm["budget"], llm["budget"] + llm["budget"] / 60 * end], color="black", linestyle=":",
            label=f"budget: {llm['budget']:,} + {llm['budget'] / 60:.1f} × t")
    for w in range(llm["waves"]):
        ax.axvline(w * llm["every"], color="black", alpha=0.08)
    ax.set_xlabel(f"seconds ({llm['streams']} concurrent streams of one key every {llm['every']:g} s)")
    ax.set_ylabel("tokens admitted (usage of the streams answered 200)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=9)
    fig.tight_layout()
    fig.savefig(REPO / "docs/llm-overshoot.png", dpi=90)
