#!/usr/bin/env python3
"""The native lease target alone: Envoy without filters, Envoy's local_ratelimit per client IP and
the native build's global lease path (memory store), in interleaved rounds of the cost section's
harness, more rounds than `make bench` gives them; prints both paired medians over Envoy alone and
the paired median of the lease path minus local_ratelimit, round by round.

    .venv/bin/python bench/lease_pair.py [rounds]     # default 21; needs `make bench`'s set-up
"""
import argparse
import os
import statistics
import sys

import report_native as RN
import run
from harness import QUOTA, Proc, free_port, wait_http

WANT = {(RN.NONE, "allowed"), (RN.LOCAL_RL, "allowed"), (RN.NATIVE_LEASE, "allowed")}


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 21
    every = run.setups
    run.setups = lambda qp, qrp: [s for s in every(qp, qrp) if (s[0], s[1]) in WANT]
    qp = free_port()
    quota = Proc([str(QUOTA), "--listen", f"127.0.0.1:{qp}"], env={**os.environ, "RUST_LOG": "error"})
    wait_http(f"http://127.0.0.1:{qp}/healthz")
    try:
        # (No Redis setup is kept: the Redis port is never dialled.)
        rows = run.cost(argparse.Namespace(rounds=rounds, seconds=3, only=None), qp, qp)
    finally:
        quota.stop()
    get = {(r["setup"], r["path"]): r for r in rows}
    lease, local = RN.paired(get, RN.NATIVE_LEASE, RN.NONE), RN.paired(get, RN.LOCAL_RL, RN.NONE)
    diff = [a["cpu_us"] - b["cpu_us"] for a, b in
            zip(get[(RN.NATIVE_LEASE, "allowed")]["per_round"], get[(RN.LOCAL_RL, "allowed")]["per_round"])]
    print(f"Envoy alone {get[(RN.NONE, 'allowed')]['cpu_us']:.2f} µs; over it, paired: lease {lease:+.2f}, "
          f"local_ratelimit {local:+.2f}; lease minus local_ratelimit, paired: {statistics.median(diff):+.2f} µs "
          f"(rounds: {', '.join(f'{d:.1f}' for d in sorted(diff))})")


if __name__ == "__main__":
    sys.exit(main())
