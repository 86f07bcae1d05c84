#!/usr/bin/env bash
# Native demo, the docker-compose topology without Docker: a trivial upstream, the quota service
# (on a redis-server of its own if one is installed, else in memory), two Envoy replicas with the
# tollgate module, then the curl walk-through (demo/curl.sh). Stops everything it started, also on
# Ctrl-C. With DEMO_KEEP=1 it keeps everything running after the walk-through until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."

ENVOY=${ENVOY_BIN:-.venv/bin/envoy}
QUOTA=${TOLLGATE_QUOTA_BIN:-target/release/tollgate-quota}
for f in "$ENVOY" "$QUOTA" dist/tollgate.wasm; do
  [ -e "$f" ] || { echo "missing $f: run 'make demo'" >&2; exit 1; }
done

ports=(8081 8090 9901 9902 10000 10001)
command -v redis-server >/dev/null && ports+=(6390)
for port in "${ports[@]}"; do
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

wait_for() { # url what
  for _ in $(seq 1 300); do
    curl -fs -o /dev/null "$1" && return 0
    sleep 0.1
  done
  echo "$2 did not start; see .tmp/demo-*.log" >&2
  exit 1
}

python3 demo/upstream.py 8081 &
pids+=($!)

if command -v redis-server >/dev/null; then
  redis-server --port 6390 --bind 127.0.0.1 --save '' --appendonly no >.tmp/demo-redis.log 2>&1 &
  pids+=($!)
  for _ in $(seq 1 100); do (exec 3<>/dev/tcp/127.0.0.1/6390) 2>/dev/null && break; sleep 0.1; done
  storage=(--redis redis://127.0.0.1:6390)
  echo "quota service: buckets in Redis (redis-server on :6390)"
else
  storage=()
  echo "quota service: buckets in memory (install redis-server to use Redis)"
fi
# The service's defaults: a new deployment serves its limits at once (docs/quota-api.md).
RUST_LOG=warn "$QUOTA" --listen 127.0.0.1:8090 --token tollgate-demo-token "${storage[@]}" \
  >.tmp/demo-quota.log 2>&1 &
pids+=($!)

sed -e 's/port_value: 10000/port_value: 10001/' -e 's/port_value: 9901/port_value: 9902/' \
  envoy/envoy.yaml >.tmp/demo-envoy-b.yaml
"$ENVOY" -c envoy/envoy.yaml --concurrency 2 --disable-hot-restart --base-id 11 -l info \
  --log-path .tmp/demo-envoy-a.log &
pids+=($!)
"$ENVOY" -c .tmp/demo-envoy-b.yaml --concurrency 2 --disable-hot-restart --base-id 12 -l info \
  --log-path .tmp/demo-envoy-b.log &
pids+=($!)

wait_for http://127.0.0.1:8081/ upstream
wait_for http://127.0.0.1:8090/healthz "quota service"
wait_for http://127.0.0.1:9901/ready "Envoy A"
wait_for http://127.0.0.1:9902/ready "Envoy B"
echo "Envoy A on :10000 (admin :9901) and Envoy B on :10001 (admin :9902), 2 workers each,"
echo "in front of the upstream on :8081; quota service on :8090. Logs: .tmp/demo-*.log"

TOLLGATE_URL_B=http://127.0.0.1:10001 TOLLGATE_ADMIN_B=http://127.0.0.1:9902 \
  QUOTA_METRICS=http://127.0.0.1:8090/metrics demo/curl.sh

if [ -n "${DEMO_KEEP:-}" ]; then
  echo "Still running, try your own curl requests. Press Ctrl-C to stop everything."
  while true; do sleep 0.2; done
fi
