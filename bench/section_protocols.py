"""Envoy's own protocols from the quota service: RLS (Envoy's `ratelimit` filter asking per request)
against the envoyproxy/ratelimit stand-in `bench/rls.py`, both on Redis; and RLQS (Envoy's
`rate_limit_quota` filter) against tollgate's own lease protocol — CPU per decision, p99, calls per
1 000 requests and accuracy when offered far more than the limit.

Part of `make bench` (`bench/sections.py` lists the sections)."""
import os
import sys
import tempfile
import time
import urllib.request

import harness
from harness import (QUOTA, REPO, CLK_TCK, EnvoyServer, Proc, cpu_ticks, free_port, parse_wrk, quota_cluster,
                     tollgate_plugin, wait_http, wait_port, wasm_filter, wrk)
from section_common import TESTBED, answered_2xx, tollgate_module, upstream_cluster
from section_llm import grpc_cluster

LIMIT = 200  # a second: wrk through one Envoy offers ten times this and more
SECONDS = 10


def ratelimit_filter(domain="bench"):
    return {"name": "envoy.filters.http.ratelimit", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit",
        "domain": domain, "failure_mode_deny": True, "timeout": "1s",
        "rate_limit_service": {"transport_api_version": "V3",
                               "grpc_service": {"envoy_grpc": {"cluster_name": "rate_limit_service"}}}}}


def quota_filter(domain="bench"):
    settings = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaBucketSettings",
        "bucket_id_builder": {"bucket_id_builder": {"name": {"string_value": "all"}}},
        "reporting_interval": "5s",
        "no_assignment_behavior": {"fallback_rate_limit": {"blanket_rule": "DENY_ALL"}},
        "expired_assignment_behavior": {"fallback_rate_limit": {"blanket_rule": "DENY_ALL"},
                                        "expired_assignment_behavior_timeout": "300s"}}
    return {"name": "envoy.filters.http.rate_limit_quota", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaFilterConfig",
        "domain": domain, "rlqs_server": {"envoy_grpc": {"cluster_name": "rate_limit_service"}},
        "bucket_matchers": {"on_no_match": {"action": {"name": "rate_limit_quota", "typed_config": settings}}}}}


# The route to the app, asking about one descriptor, (generic_key, all), per request.
ONE_BUCKET = {"route": {"cluster": "app", "timeout": "10s",
                        "rate_limits": [{"actions": [{"generic_key": {"descriptor_value": "all"}}]}]}}


def limits_file(unit="second"):
    f = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
    f.write(f"domain: bench\ndescriptors:\n  - key: generic_key\n    value: all\n"
            f"    rate_limit: {{ unit: {unit}, requests_per_unit: {LIMIT} }}\n"
            f"  - key: name\n    value: all\n    rate_limit: {{ unit: {unit}, requests_per_unit: {LIMIT} }}\n")
    f.close()
    return f.name


def metric(port, name):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    return 0.0


def run(server, services, seconds, decisions):
    """wrk against `server` for `seconds`: its figures, the services' CPU per decision (µs) and
    what was admitted against the bound `LIMIT × (1 + t)`."""
    wrk(server.url, 1)  # warm-up: connections; the bucket is spent meanwhile
    before_ok, before_n = answered_2xx(server), decisions()
    before = {name: cpu_ticks([pid]) for name, pid in services}
    started = time.monotonic()
    r = parse_wrk(wrk(server.url, seconds))
    elapsed = time.monotonic() - started
    cpu = {name: (cpu_ticks([pid]) - before[name]) / CLK_TCK * 1e6 for name, pid in services}
    n = max(decisions() - before_n, 1)
    admitted = answered_2xx(server) - before_ok
    return {"requests": r["requests"], "rps": r["rps"], "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"],
            "decisions": n, "cpu_us": {k: v / n for k, v in cpu.items()},
            "admitted": admitted, "seconds": elapsed, "bound": LIMIT * elapsed,
            "overload": r["rps"] / LIMIT}


def protocols():
    rows = []
    redis_port = free_port()
    redis = Proc(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
    wait_port(redis_port)
    redis_url = f"redis://127.0.0.1:{redis_port}"
    app_port = free_port()
    # An app that is never the bottleneck: the admitted requests are all answered at once.
    app = Proc(harness.LOAD_CPU + [str(TESTBED), "upstream", "--port", str(app_port), "--capacity", "10000",
                                   "--service-ms", "0"])
    wait_port(app_port)
    env_quiet = {"RUST_LOG": "error"}
    limits = limits_file()
    try:
        # RLS: the stand-in (fixed windows of a second, INCRBY + EXPIRE on Redis) and tollgate-quota.
        for system in ("envoyproxy/ratelimit stand-in (bench/rls.py, Python) + Redis", "tollgate-quota RLS + Redis"):
            grpc, http = free_port(), free_port()
            if system.startswith("envoy"):
                svc = Proc([sys.executable, str(REPO / "bench/rls.py"), "--port", str(grpc), "--limit", str(LIMIT),
                            "--window", "1", "--redis", redis_url])
                wait_port(grpc)
            else:
                svc = Proc([str(QUOTA), "--listen", f"127.0.0.1:{http}", "--redis", redis_url,
                            "--grpc-listen", f"127.0.0.1:{grpc}", "--rls-config", limits],
                           env={**os.environ, **env_quiet})
                wait_http(f"http://127.0.0.1:{http}/healthz")
            server = EnvoyServer([ratelimit_filter()], [grpc_cluster("rate_limit_service", grpc), upstream_cluster(app_port)],
                                 concurrency=1, upstream="app", route_extra=ONE_BUCKET)

            def decisions(server=server):
                # Envoy's own count of its calls to the service, the same for both.
                return server.stat("cluster.rate_limit_service.upstream_rq_total")
            try:
                r = run(server, [("service", svc.p.pid), ("redis", redis.p.pid)], SECONDS, decisions)
            finally:
                server.stop()
                svc.stop()
            row = {"protocol": "RLS", "system": system, **r}
            rows.append(row)
            print(f"protocols {system}: {r['decisions']} decisions, service {r['cpu_us']['service']:.0f} us + redis "
                  f"{r['cpu_us']['redis']:.0f} us each, p99 {r['p99_ms']:.2f} ms, admitted {r['admitted']} "
                  f"(bound {r['bound']:.0f}, offered {r['overload']:.0f}x)", flush=True)

        # RLQS against tollgate's lease protocol: one Envoy each, the same limit and quota service.
        for system in ("Envoy rate_limit_quota (RLQS)", "tollgate lease protocol"):
            grpc, http = free_port(), free_port()
            svc = Proc([str(QUOTA), "--listen", f"127.0.0.1:{http}", "--redis", redis_url,
                        "--grpc-listen", f"127.0.0.1:{grpc}", "--rls-config", limits],
                       env={**os.environ, **env_quiet})
            wait_http(f"http://127.0.0.1:{http}/healthz")
            if system.startswith("Envoy"):
                server = EnvoyServer([quota_filter()], [grpc_cluster("rate_limit_service", grpc), upstream_cluster(app_port)],
                                     concurrency=1, upstream="app")

                def decisions(http=http):
                    return int(metric(http, "tollgate_quota_rlqs_reports_total"))
            else:
                plugin = tollgate_plugin(LIMIT, scope="global", per="1s", key=())
                server = EnvoyServer([wasm_filter(tollgate_module(), plugin)],
                                     [quota_cluster(http), upstream_cluster(app_port)], concurrency=1, upstream="app")

                def decisions(server=server):
                    return server.stat("wasmcustom.tollgate.quota.calls")
            try:
                r = run(server, [("service", svc.p.pid), ("redis", redis.p.pid)], SECONDS + 5, decisions)
            finally:
                server.stop()
                svc.stop()
            r["calls_per_1000"] = r["decisions"] * 1000 / max(r["requests"], 1)
            r["calls_per_1000_admitted"] = r["decisions"] * 1000 / max(r["admitted"], 1)
            rows.append({"protocol": "RLQS vs lease", "system": system, **r})
            print(f"protocols {system}: {r['decisions']} calls for {r['requests']} requests "
                  f"({r['calls_per_1000']:.2f} per 1 000), admitted {r['admitted']} of a bound of {r['bound']:.0f}",
                  flush=True)
    finally:
        app.stop()
        redis.stop()
        os.unlink(limits)
    return rows


def protocol_lines(rows):
    """The report's section: a table per comparison and what they show."""
    out = [PROTOCOLS_HEADING, "", "Envoy's own rate limit protocols served by `tollgate-quota` (`--grpc-listen`, docs/quota-api.md), "
           f"one Envoy (1 worker) under wrk (closed loop, as fast as it answers: {LIMIT}/s is exceeded "
           "many times over), one limit of "
           f"{LIMIT} a second, Redis behind each service, {SECONDS} s measured after a 1 s warm-up. "
           "`bench/section_protocols.py`.", "",
           "**RLS** (Envoy's `ratelimit` filter, one call per request). envoyproxy/ratelimit itself cannot be "
           "built here (no Go module proxy is reachable), so its stand-in is `bench/rls.py`: a Python gRPC "
           "service that counts as envoyproxy/ratelimit's Redis cache does (a pipeline of INCRBY and EXPIRE per "
           "descriptor, fixed windows of a second). Its CPU figure is Python's, not Go's: compare the p99, the "
           "throughput and the accuracy, not the CPU.", "",
           "| system | decisions | service CPU per decision | Redis CPU per decision | p50 | p99 | requests/s | offered × limit | admitted | bound `limit × t` |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["protocol"] != "RLS":
            continue
        out.append(f"| {r['system']} | {r['decisions']} | {r['cpu_us']['service']:.0f} µs | "
                   f"{r['cpu_us']['redis']:.0f} µs | {r['p50_ms']:.2f} ms | {r['p99_ms']:.2f} ms | {r['rps']:.0f} | "
                   f"{r['overload']:.0f}× | {r['admitted']} | {r['bound']:.0f} |")
    out += ["", "**RLQS against tollgate's lease protocol** (the same limit; RLQS's Envoy reports every 5 s, "
            f"so this run is {SECONDS + 5} s). Calls: RLQS usage reports received, tollgate's lease calls.", "",
            "| system | requests | calls | calls per 1 000 requests | calls per 1 000 admitted | admitted | bound `limit × t` | admitted ÷ bound |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["protocol"] == "RLS":
            continue
        per_admitted = r["decisions"] * 1000 / max(r["admitted"], 1)
        out.append(f"| {r['system']} | {r['requests']} | {r['decisions']} | {r['calls_per_1000']:.2f} | "
                   f"{per_admitted:.1f} | {r['admitted']} | {r['bound']:.0f} | {r['admitted'] / max(r['bound'], 1):.2f} |")
    rls = {r["system"].split()[0]: r for r in rows if r["protocol"] == "RLS"}
    quota = [r for r in rows if r["protocol"] != "RLS"]
    if len(rls) == 2 and len(quota) == 2:
        a, b = rls["envoyproxy/ratelimit"], rls["tollgate-quota"]
        out += ["", f"Both RLS services admit what the limit allows within a request ({a['admitted']} and "
                f"{b['admitted']} of {a['bound']:.0f} and {b['bound']:.0f}); tollgate-quota answers "
                f"{b['rps'] / max(a['rps'], 1):.1f}× as many decisions a second with a p99 of "
                f"{b['p99_ms']:.1f} ms against {a['p99_ms']:.1f} ms (the stand-in's being Python weighs on "
                "its side). Its token bucket never admits twice the limit across a window's edge, which "
                "envoyproxy/ratelimit's fixed windows can. RLQS asks the service "
                f"{quota[0]['decisions'] * 1000 / max(quota[0]['admitted'], 1):.1f} times per 1 000 admitted requests "
                "and admits "
                f"{quota[0]['admitted'] / max(quota[0]['bound'], 1):.0%} of what the limit allows: Envoy "
                "reports every 5 s, so an assignment follows demand 5 s late, a new bucket waits for its "
                "first assignment, and tokens a replaced bucket still held are dropped (docs/quota-api.md "
                "says why). tollgate's leases ask "
                f"{quota[1]['decisions'] * 1000 / max(quota[1]['admitted'], 1):.1f} times per 1 000 admitted (their "
                "renewals keep the refill flowing without a gap) and admit "
                f"{quota[1]['admitted'] / max(quota[1]['bound'], 1):.0%}.", ""]
    return out


PROTOCOLS_HEADING = "## RLS and RLQS"

if __name__ == "__main__":
    import json
    result = protocols()
    path = REPO / "bench/results.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    saved["protocols"] = result
    path.write_text(json.dumps(saved, indent=1))
    print("\n".join(protocol_lines(result)))
