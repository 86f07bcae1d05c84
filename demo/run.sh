#!/usr/bin/env bash
# Native demo: a trivial upstream, Envoy with envoy/envoy.yaml and the tollgate module, then the
# curl walk-through (demo/curl.sh). Stops everything it started, also on Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."

ENVOY=${ENVOY_BIN:-.venv/bin/envoy}
[ -x "$ENVOY" ] || { echo "no Envoy at $ENVOY: run 'make demo'" >&2; exit 1; }
[ -f dist/tollgate.wasm ] || { echo "no dist/tollgate.wasm: run 'make demo'" >&2; exit 1; }

for port in 8081 9901 10000; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "port $port is already in use on 127.0.0.1; stop what uses it and retry" >&2
    exit 1
  fi
done

mkdir -p .tmp
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM

python3 demo/upstream.py 8081 &
pids+=($!)
"$ENVOY" -c envoy/envoy.yaml --concurrency 2 --disable-hot-restart -l info \
  --log-path .tmp/demo-envoy.log &
pids+=($!)

ready=""
for _ in $(seq 1 300); do
  if curl -fs -o /dev/null http://127.0.0.1:9901/ready && curl -s -o /dev/null http://127.0.0.1:8081/; then
    ready=1
    break
  fi
  kill -0 "${pids[1]}" 2>/dev/null || break
  sleep 0.1
done
if [ -z "$ready" ]; then
  echo "Envoy did not start; its log (.tmp/demo-envoy.log):" >&2
  tail -20 .tmp/demo-envoy.log >&2
  exit 1
fi
echo "Envoy is up on :10000 (admin :9901) in front of the upstream on :8081, 2 workers."
echo "Its log is in .tmp/demo-envoy.log."
echo

demo/curl.sh
