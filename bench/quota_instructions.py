#!/usr/bin/env python3
"""Instructions per lease call of `tollgate-quota` (memory store), deterministic: the service under
valgrind's callgrind, counters zeroed after a warm-up, then N calls on one keep-alive connection;
the user-space instructions of the whole process divided by N (the kernel's TCP work is not
counted). A do-nothing call (`GET /healthz`) is the server's own floor.

    bench/quota_instructions.py [--calls 2000]    # a few minutes; needs valgrind

CPU time per call on this VM moves by up to 2× from hour to hour; this does not, so it judges a
change to the service's per-call or per-item work.
"""
import argparse
import glob
import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--binary", default=str(harness.QUOTA), help="the tollgate-quota to measure")
    args = ap.parse_args()
    out = tempfile.mkdtemp(prefix="tollgate-cg-")
    port = harness.free_port()
    service = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/cg.%p.%n", args.binary,
         "--listen", f"127.0.0.1:{port}", "--cold-start", "full"],
        env={**os.environ, "RUST_LOG": "error"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        harness.wait_http(f"http://127.0.0.1:{port}/healthz", timeout=120)
        conn = http.client.HTTPConnection("127.0.0.1", port)

        def lease(first, n):
            items = [{"rule": "bench", "limit_id": "00000000000000aa", "requests": 1000000000,
                      "per_ms": 1000, "burst": 1000000000, "wanted": 100, "used": 100,
                      "key": "%032x" % (first + j)} for j in range(n)]
            body = json.dumps({"instance": "bench", "items": items})
            conn.request("POST", "/v1/lease", body, {"content-type": "application/json"})
            r = conn.getresponse()
            r.read()
            assert r.status == 200, r.status

        def health(_):
            conn.request("GET", "/healthz")
            conn.getresponse().read()

        def measure(label, call, n):
            for i in range(100):
                call(10_000_000 + i)
            subprocess.run(["callgrind_control", "-z", str(service.pid)], capture_output=True)
            for i in range(n):
                call(i)
            subprocess.run(["callgrind_control", "-d", label, str(service.pid)], capture_output=True)
            time.sleep(1)
            dumps = sorted(glob.glob(f"{out}/cg.{service.pid}.*"), key=os.path.getmtime)
            text = Path(dumps[-1]).read_text(errors="replace")
            ir = int(re.search(r"^(?:summary|totals):\s+(\d+)", text, re.M).group(1))
            return ir / n

        calls = args.calls
        rows = [("GET /healthz (the floor)", 1, measure("healthz", health, calls)),
                ("lease, 1 item", 1, measure("lease1", lambda i: lease(i * 1, 1), calls)),
                ("lease, 1 item of a key leased before", 1,
                 measure("lease1again", lambda i: lease(5_000_000 + i % 100, 1), calls)),
                ("lease, 10 items", 10, measure("lease10", lambda i: lease(1_000_000 + i * 10, 10), calls // 4))]
        print("| call | instructions per call | per item |")
        print("|---|---|---|")
        for label, items, ir in rows:
            print(f"| {label} | {ir:,.0f} | {ir / items:,.0f} |")
    finally:
        service.terminate()
        service.wait()


if __name__ == "__main__":
    main()
