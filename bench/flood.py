#!/usr/bin/env python3
"""The key-flood scenario of docs/algorithms.md against Envoy (--concurrency 2): one rule keyed on a
header, max_keys 1000, 5 per hour; a key that is being limited; 8 s of random keys from wrk
(16 connections); then the limited key again and a key never seen before.

    .venv/bin/python bench/flood.py                       # dist/tollgate.wasm
    .venv/bin/python bench/flood.py a=one.wasm b=two.wasm # side by side

Needs wrk (`make bench` installs it) and `make build`.
"""
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tempfile  # noqa: E402

import harness  # noqa: E402

PLUGIN = {"rules": [{"name": "per-key", "key": ["header:x-key"], "max_keys": 1000,
                     "limit": {"requests": 5, "per": "1h"}}]}
LUA = """
math.randomseed(os.time() + tonumber(tostring({}):sub(8), 16))
request = function()
  wrk.headers["x-key"] = string.format("%x%x", math.random(0, 0x7fffffff), math.random(0, 0x7fffffff))
  return wrk.format("GET", "/")
end
"""


def status(url, key):
    try:
        return urllib.request.urlopen(urllib.request.Request(url, headers={"x-key": key}), timeout=5).status
    except urllib.error.HTTPError as e:
        return e.code


def main():
    variants = [a.split("=", 1) for a in sys.argv[1:]] or [("tollgate", "dist/tollgate.wasm")]
    script = Path(tempfile.mkdtemp()) / "flood.lua"
    script.write_text(LUA)
    for label, module in variants:
        server = harness.EnvoyServer([harness.wasm_filter(Path(module).resolve(), PLUGIN)], concurrency=2, pin=False)
        try:
            limited = [status(server.url, "limited") for _ in range(6)]
            rss0 = server.rss_kib()
            out = subprocess.run(["wrk", "-t2", "-c16", "-d8s", "-s", str(script), server.url],
                                 capture_output=True, text=True, check=True).stdout
            flood = next((l.strip() for l in out.splitlines() if "requests in" in l), "?")
            after = [status(server.url, "limited") for _ in range(3)]
            hot = [status(server.url, "hot") for _ in range(7)]
            stat = lambda s: server.stat(f"wasmcustom.tollgate.rule.per-key.{s}")  # noqa: E731
            print(f"{label}: limited key before {limited}; flood {flood}; limited key after {after}; "
                  f"new key {hot} ({hot.count(200)} of 7 admitted); slot_evicted {stat('slot_evicted')}, "
                  f"slot_shared {stat('slot_shared')}; RSS {rss0} -> {server.rss_kib()} KiB")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
