"""Token budgets: reserve then settle against charging after the response, and native Envoy limits.

Part of `make bench` (`bench/sections.py` lists the sections)."""
import asyncio
import json
import random
import re
import statistics
import subprocess
import time

import harness
from section_common import TESTBED, rule_stat, tollgate_module, upstream_cluster
from harness import (HUGE, EnvoyServer, Proc, free_port, parse_wrk, wasm_filter, wrk)


LLM_BUDGET = 10_000  # tokens a minute for the key (burst the same)
LLM_RATE = LLM_BUDGET / 60  # tokens a second
LLM_MAX = 2_000  # the most a request can use (its max_tokens plus its input): what it reserves
LLM_KEY = "team-a"
LLM_PATH = "/llm/chat"  # tollgate-testbed answers paths with /llm like an LLM API
LLM_STREAMS, LLM_WAVES, LLM_EVERY = 20, 7, 2.0  # 20 concurrent streams every 2 s, 7 times
RESERVE_MAX = {"header": "x-max-tokens", "default": LLM_MAX, "max": LLM_MAX}
RLS_DOMAIN = "llm"
# The usage reaches Envoy's rate limit filter as dynamic metadata: a Lua filter reads the stream as it
# passes (chunk by chunk: `bodyChunks()` does not buffer) and keeps the last `total_tokens` it saw
# (OpenAI's last event with `stream_options.include_usage`); the rate limit filter's stream-done
# call adds it to the key's counter.
LLM_LUA = """\
function envoy_on_response(handle)
  local total
  local tail = ""
  for chunk in handle:bodyChunks() do
    local text = tail .. chunk:getBytes(0, chunk:length())
    for n in string.gmatch(text, '"total_tokens":%s*(%d+)') do
      total = n
    end
    tail = string.sub(text, -64)
  end
  if total then
    handle:streamInfo():dynamicMetadata():set("llm", "total_tokens", total)
  end
end
"""


def llm_plugin(cost, settle=True, limit=LLM_BUDGET, extra_rules=(), **rule_extra):
    """One token_bucket rule per `x-api-key`: `limit` tokens a minute; `cost` is what a request
    takes when it arrives, and with `settle` the difference to its reported usage is settled."""
    rule = {"name": "llm", "key": ["header:x-api-key"], "limit": {"requests": limit, "per": "1m"},
            "cost": cost, **rule_extra}
    if settle:
        rule["settle"] = {"usage": "total"}
    return {"rules": [rule, *extra_rules]}


def grpc_cluster(name, port):
    return {"name": name, "type": "STATIC", "connect_timeout": "1s",
            "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}},
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]}}


def llm_native():
    """Envoy's own admit-then-charge token budget, as Envoy AI Gateway configures it: the global
    rate limit filter (fail closed) checks the key at the request (hits_addend 0: refused once the
    counter has reached the budget) and adds the response's usage when the stream is done
    (`apply_on_stream_done`, hits_addend from the Lua filter's dynamic metadata). The HTTP filters
    and the route's per-filter configuration. (In Envoy 1.40 a route's own `rate_limits` accept
    `hits_addend` but the rate limit filter sends no hits from them; the filter's per-route
    `RateLimitPerRoute.rate_limits` send both.)"""
    key = {"request_headers": {"header_name": "x-api-key", "descriptor_key": "api_key"}}
    filters = [
        {"name": "envoy.filters.http.ratelimit", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit",
            "domain": RLS_DOMAIN, "failure_mode_deny": True, "timeout": "1s",
            "rate_limit_service": {"grpc_service": {"envoy_grpc": {"cluster_name": "rls"}},
                                   "transport_api_version": "V3"}}},
        {"name": "envoy.filters.http.lua", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": LLM_LUA}}},
    ]
    route_extra = {"typed_per_filter_config": {"envoy.filters.http.ratelimit": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute",
        "rate_limits": [
            {"actions": [key], "hits_addend": {"number": 0}},
            {"actions": [key], "hits_addend": {"format": "%DYNAMIC_METADATA(llm:total_tokens)%"},
             "apply_on_stream_done": True},
        ]}}}
    return filters, route_extra


def _yaml_scalar(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(v)
    s = str(v)
    plain = (re.fullmatch(r"[A-Za-z_./][A-Za-z0-9_./-]*", s) and s not in ("true", "false", "null", "yes", "no",
                                                                          "on", "off", "y", "n"))
    return s if plain else json.dumps(s)


def to_yaml(value, indent=0):
    """Enough YAML for an Envoy configuration: mappings, lists, scalars, and multi-line strings as
    block literals."""
    pad = "  " * indent
    if isinstance(value, dict):
        if not value:
            return "{}"
        lines = []
        for k, v in value.items():
            key = _yaml_scalar(k)
            if isinstance(v, (dict, list)) and v:
                lines.append(f"{pad}{key}:\n{to_yaml(v, indent + 1)}")
            elif isinstance(v, str) and "\n" in v:
                body = "\n".join(f"{pad}  {line}" if line else "" for line in v.rstrip("\n").split("\n"))
                lines.append(f"{pad}{key}: |\n{body}")
            else:
                lines.append(f"{pad}{key}: {to_yaml(v) if isinstance(v, (dict, list)) else _yaml_scalar(v)}")
        return "\n".join(lines)
    if isinstance(value, list):
        if not value:
            return "[]"
        lines = []
        for v in value:
            if isinstance(v, dict) and v:
                lines.append(f"{pad}- {to_yaml(v, indent + 1)[len(pad) + 2:]}")
            elif isinstance(v, (dict, list)):
                lines.append(f"{pad}- {to_yaml(v)}")
            else:
                lines.append(f"{pad}- {_yaml_scalar(v)}")
        return "\n".join(lines)
    return _yaml_scalar(value)


NATIVE_YAML = harness.REPO / "bench/envoy-llm-native.yaml"


def write_native_yaml():
    """bench/envoy-llm-native.yaml: the native setup's whole Envoy configuration as the benchmark
    runs it (there on free ports; here on fixed ones), checked by Envoy's `--mode validate`."""
    filters, route_extra = llm_native()
    cfg = harness.envoy_config(10000, 9901, filters, [upstream_cluster(8000), grpc_cluster("rls", 8081)],
                               upstream="app", route_extra=route_extra)
    cfg["static_resources"]["listeners"][0]["name"] = "llm"
    text = ("# Envoy 1.40's own token budget charged after the response (bench/run.py --sections llm):\n"
            "# 10 000 tokens a minute per x-api-key, counted by a rate limit service on 127.0.0.1:8081\n"
            "# (bench/rls.py: fixed window, counter += hits); the LLM API on 127.0.0.1:8000.\n"
            "# Generated by bench/sections.py (llm_native); `envoy --mode validate -c` accepts it.\n"
            + to_yaml(cfg) + "\n")
    NATIVE_YAML.write_text(text)
    check = subprocess.run([str(harness.ENVOY), "--mode", "validate", "-c", str(NATIVE_YAML)],
                           capture_output=True, text=True, timeout=60)
    if check.returncode != 0:
        raise RuntimeError(f"{NATIVE_YAML} does not validate: {check.stdout[-2000:]} {check.stderr[-2000:]}")


def llm_plan(seed=1):
    """The workload, the same for every setup: waves of concurrent streams of one key, each using
    300 to 2 000 tokens (100 of them input) over 10 events 100 to 200 ms apart (1 to 2 s)."""
    rng = random.Random(seed)
    plan = []
    for w in range(LLM_WAVES):
        for _ in range(LLM_STREAMS):
            total = rng.randint(300, LLM_MAX)
            plan.append({"at": w * LLM_EVERY, "tokens": total, "headers": {
                "x-api-key": LLM_KEY, "x-stream": "1", "x-events": "10", "x-event-ms": str(rng.randint(100, 200)),
                "x-usage-input": "100", "x-usage-output": str(total - 100), "x-max-tokens": str(LLM_MAX)}})
    return plan


async def _llm_request(port, item, started):
    await asyncio.sleep(max(0.0, started + item["at"] - time.monotonic()))
    sent = time.monotonic() - started
    status, usage = None, None
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            head = [f"GET {LLM_PATH} HTTP/1.1", "host: llm", "connection: close"]
            head += [f"{k}: {v}" for k, v in item["headers"].items()]
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
            await writer.drain()
            status = int((await asyncio.wait_for(reader.readline(), 30)).split()[1])
            body = await asyncio.wait_for(reader.read(), 30)
            found = re.findall(rb'"total_tokens":(\d+)', body)
            usage = int(found[-1]) if found else None
        finally:
            writer.close()
    except (OSError, asyncio.TimeoutError, ValueError, IndexError):
        pass
    return {"sent": sent, "done": time.monotonic() - started, "status": status, "usage": usage,
            "tokens": item["tokens"]}


def llm_run(port, plan):
    async def run():
        started = time.monotonic()
        return await asyncio.gather(*(_llm_request(port, item, started) for item in plan))
    return asyncio.run(run())


def llm_summary(results):
    """Tokens admitted against the budget: at each admission t (from the first request sent), the
    usage of every stream admitted so far against burst + rate × t; the largest excess, and the
    excess when the last request was sent."""
    t0 = min(r["sent"] for r in results)
    ok = sorted((r for r in results if r["status"] == 200), key=lambda r: r["sent"])
    admitted, peak, timeline = 0, (float("-inf"), 0.0, LLM_BUDGET), []
    for r in ok:
        admitted += r["usage"] if r["usage"] is not None else r["tokens"]
        t = r["sent"] - t0
        budget = LLM_BUDGET + LLM_RATE * t
        timeline.append([round(t, 3), admitted])
        if admitted - budget > peak[0]:
            peak = (admitted - budget, t, budget)
    end = max(r["sent"] for r in results) - t0
    end_budget = LLM_BUDGET + LLM_RATE * end
    return {"admitted": len(ok), "refused": sum(1 for r in results if r["status"] == 429),
            "errors": sum(1 for r in results if r["status"] not in (200, 429)),
            "incomplete": sum(1 for r in ok if r["usage"] != r["tokens"]),
            "tokens": admitted, "offered": sum(r["tokens"] for r in results), "seconds": end,
            "budget": end_budget, "over": admitted - end_budget, "over_pct": (admitted - end_budget) / end_budget,
            "peak_over": peak[0], "peak_at": peak[1], "peak_pct": peak[0] / peak[2],
            "timeline": timeline}


LLM_SETUPS = ("tollgate, reserve then settle", "tollgate, charge after the response",
              "Envoy ratelimit + Lua, charge after the response")


def llm_overshoot(plan):
    """The three setups under the same workload (Envoy with 2 workers, not pinned)."""
    from rls import RateLimitService
    module = tollgate_module()
    out = {}
    for name in LLM_SETUPS:
        app_port = free_port()
        app = Proc([str(TESTBED), "upstream", "--port", str(app_port)])
        harness.wait_port(app_port)
        rls, route_extra, clusters = None, None, [upstream_cluster(app_port)]
        if name.startswith("Envoy"):
            rls_port = free_port()
            rls = RateLimitService(rls_port, LLM_BUDGET, window_s=60.0)
            filters, route_extra = llm_native()
            clusters.append(grpc_cluster("rls", rls_port))
        else:
            cost = RESERVE_MAX if "reserve" in name else 1
            filters = [wasm_filter(module, llm_plugin(cost))]
        envoy = EnvoyServer(filters, clusters, concurrency=2, pin=False, upstream="app", route_extra=route_extra)
        try:
            results = llm_run(envoy.port, plan)
            time.sleep(0.2)  # the last settlements and stream-done calls
            settled = None if rls else rule_stat(envoy, "llm", "settled")
        finally:
            envoy.stop()
            app.stop()
            if rls:
                rls.stop()
        row = {"setup": name, **llm_summary(results), "settled": settled}
        if rls:
            row["rls_checks"] = sum(1 for c in rls.calls if c[2] == 0)
            row["rls_charges"] = sum(1 for c in rls.calls if c[2] > 0)
            row["rls_charged"] = sum(c[2] for c in rls.calls)
        out[name] = row
        print(f"llm {name}: {row['admitted']} admitted, {row['refused']} refused, {row['errors']} errors, "
              f"{row['tokens']} tokens in {row['seconds']:.1f} s against {row['budget']:.0f} "
              f"({row['over']:+.0f}, {row['over_pct']:+.0%}); peak over {row['peak_over']:.0f} at "
              f"{row['peak_at']:.1f} s; settled {settled}"
              + (f"; RLS {row['rls_checks']} checks, {row['rls_charges']} charges of {row['rls_charged']}"
                 if rls else ""), flush=True)
    return module, out


LLM_WRK = """
wrk.headers["x-api-key"] = "k"
wrk.headers["x-stream"] = "1"
wrk.headers["x-events"] = "10"
wrk.headers["x-event-ms"] = "1"
wrk.headers["x-usage-input"] = "100"
wrk.headers["x-usage-output"] = "900"
wrk.headers["x-max-tokens"] = "2000"
"""


def llm_cpu(module, seconds=1, rounds=16):
    """Envoy's CPU per request (one worker pinned to core 0; wrk and the LLM upstream on core 1)
    for a streamed answer of 10 events 1 ms apart (each its own chunk) with its usage: (a) the rule
    with `settle` against the same rule without it (and without it at `worker_batch: 0`, settle's
    own default); (b) a request no settle rule applies to, with a settle rule on another path,
    against the same two rules without settle (and against the one rule alone). One Envoy per
    setup for the whole run (warmed up once), measured in many short interleaved rounds in a
    shuffled order (short, so that the two runs of a pair are close in time); paired medians."""
    other = {"name": "elsewhere", "match": {"path_prefix": "/v1/"}, "key": ["header:x-api-key"],
             "limit": {"requests": LLM_BUDGET, "per": "1m"}, "cost": RESERVE_MAX, "settle": {"usage": "total"}}
    setups = [
        ("settle usage", llm_plugin(RESERVE_MAX, limit=HUGE)),
        ("no settle", llm_plugin(RESERVE_MAX, settle=False, limit=HUGE)),
        ("no settle, worker_batch 0", llm_plugin(RESERVE_MAX, settle=False, limit=HUGE, worker_batch=0)),
        ("no settle, a settle rule on another path", llm_plugin(RESERVE_MAX, settle=False, limit=HUGE,
                                                                extra_rules=[other])),
        ("no settle, the same rule on another path without settle",
         llm_plugin(RESERVE_MAX, settle=False, limit=HUGE, extra_rules=[{k: v for k, v in other.items() if k != "settle"}])),
    ]
    names = [name for name, _ in setups]
    app_port = free_port()
    app = Proc(harness.LOAD_CPU + [str(TESTBED), "upstream", "--port", str(app_port)])
    servers = {}
    runs = {}
    order = random.Random(2)
    try:
        harness.wait_port(app_port)
        for name, plugin in setups:
            servers[name] = EnvoyServer([wasm_filter(module, plugin)], [upstream_cluster(app_port)], upstream="app")
        for server in servers.values():
            wrk(server.url + LLM_PATH.lstrip("/"), 1, lua=LLM_WRK)  # warm-up: JIT, caches
        for r in range(rounds):
            order.shuffle(setups)
            for name, _ in setups:
                server = servers[name]
                url = server.url + LLM_PATH.lstrip("/")
                time.sleep(0.05)  # the filter hands its counts to Envoy on its 10 ms tick
                settled = rule_stat(server, "llm", "settled") or 0
                before = harness.cpu_ticks(server.pids)
                m = parse_wrk(wrk(url, seconds, lua=LLM_WRK))
                m["cpu_us"] = (harness.cpu_ticks(server.pids) - before) / harness.CLK_TCK * 1e6 / max(m["requests"], 1)
                time.sleep(0.05)
                m["settled_per_request"] = ((rule_stat(server, "llm", "settled") or 0) - settled) / max(m["requests"], 1)
                runs.setdefault(name, []).append(m)
                print(f"llm cpu round {r + 1} {name}: {m['cpu_us']:.1f} us/req, {m['rps']:.0f} req/s, "
                      f"non-2xx {m['rejected']}, settled {m['settled_per_request']:.0f} tokens/req", flush=True)
    finally:
        for server in servers.values():
            server.stop()
        app.stop()
    rows = {name: {"cpu_us": statistics.median(m["cpu_us"] for m in ms),
                   "cpu_min": min(m["cpu_us"] for m in ms), "cpu_max": max(m["cpu_us"] for m in ms),
                   "rps": statistics.median(m["rps"] for m in ms), "rejected": sum(m["rejected"] for m in ms),
                   "settled_per_request": statistics.median(m["settled_per_request"] for m in ms),
                   "per_round": [m["cpu_us"] for m in ms]}
            for name, ms in ((n, runs[n]) for n in names)}

    def paired(a, b):
        """The median over rounds of a − b measured in the same round, and the quartiles of those
        differences (the middle half of the rounds)."""
        d = [x - y for x, y in zip(rows[a]["per_round"], rows[b]["per_round"])]
        q1, _, q3 = statistics.quantiles(d, n=4)
        return {"median": statistics.median(d), "q1": q1, "q3": q3, "min": min(d), "max": max(d)}
    return {"rounds": rounds, "seconds": seconds, "setups": rows,
            "settle_vs_none": paired("settle usage", "no settle"),
            "settle_vs_batch0": paired("settle usage", "no settle, worker_batch 0"),
            "elsewhere_vs_none": paired("no settle, a settle rule on another path",
                                        "no settle, the same rule on another path without settle"),
            "elsewhere_vs_one_rule": paired("no settle, a settle rule on another path", "no settle")}


def llm(seed=1):
    """Token budgets: the overshoot of reserve-then-settle, of charging after the response (tollgate
    and Envoy's own), and the CPU that settlement adds."""
    write_native_yaml()
    plan = llm_plan(seed)
    module, setups = llm_overshoot(plan)
    cpu = llm_cpu(module)
    return {"module": str(module.relative_to(harness.REPO)), "budget": LLM_BUDGET, "max": LLM_MAX,
            "streams": LLM_STREAMS, "waves": LLM_WAVES, "every": LLM_EVERY, "seed": seed,
            "setups": setups, "cpu": cpu}


# ---------------------------------------------------------------- bandwidth per key
