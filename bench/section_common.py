"""What the bench's sections share: load with wrk, what a server answered, the testbed upstream,
the module and its counters."""
import os
import subprocess
import urllib.request
from pathlib import Path

import harness
from harness import (TOLLGATE, parse_wrk, wrk_args)


def wrk_together(urls, seconds, connections=64, lua=None, pin=False):
    """wrk against every url at once (by default not pinned: proxies with several workers use both
    cores), each with the `lua` script if given."""
    procs = []
    for url in urls:
        args, script = wrk_args(url, seconds, connections, lua=lua, pin=pin)
        procs.append((subprocess.Popen(args, stdout=subprocess.PIPE, text=True), script))
    out = []
    for p, script in procs:
        text, _ = p.communicate(timeout=seconds + 30)
        if script:
            os.unlink(script.name)
        out.append(parse_wrk(text))
    return out


def answered_2xx(server):
    """Requests the proxy answered 200 (Envoy's own count, independent of the filter's)."""
    return server.stat("http.bench.downstream_rq_2xx")


def workers_used(server):
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.admin}/stats?filter=worker_.*downstream_cx_total",
                                  timeout=5).read().decode()
    return sum(1 for line in text.splitlines() if line.startswith("listener.") and int(line.split(": ")[1]) > 0)


TESTBED = harness.REPO / "target/release/tollgate-testbed"


def upstream_cluster(port):
    return {"name": "app", "type": "STATIC", "connect_timeout": "1s",
            "circuit_breakers": {"thresholds": [{"max_connections": 100000, "max_pending_requests": 100000,
                                                 "max_requests": 100000}]},
            "load_assignment": {"cluster_name": "app", "endpoints": [{"lb_endpoints": [{
                "endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]}}


def tollgate_module():
    """The tollgate module: the newer of `make dist`'s optimised build and `make build`'s (or the one
    TOLLGATE_WASM names, as for the Envoy tests)."""
    if os.environ.get("TOLLGATE_WASM"):
        return Path(os.environ["TOLLGATE_WASM"])
    found = [p for p in (TOLLGATE, harness.REPO / "dist/tollgate.wasm") if p.exists()]
    if not found:
        raise RuntimeError("no tollgate module: run `make build` (or `make dist`)")
    return max(found, key=lambda p: p.stat().st_mtime)


def rule_stat(server, rule, name):
    """A tollgate rule's counter from Envoy's /stats/prometheus (with or without tag extraction)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.admin}/stats/prometheus", timeout=5).read().decode()
    for series in (f'tollgate_rule_{name}{{tollgate_rule="{rule}"}}', f"tollgate_rule_{rule}_{name}{{}}"):
        for line in text.splitlines():
            if line.startswith(series + " "):
                return int(float(line.split()[-1]))
    return None
