#!/usr/bin/env bash
# `make test-compose`: the Docker demo as a user runs it, checked. Builds the module and the quota
# service image, `docker compose up -d --build`, runs the walk-through (demo/curl.sh, which waits
# for readiness) and checks every step's status codes and rule names, then: published ports are
# on 127.0.0.1 only, the quota service refuses calls without its token, and `docker compose
# restart redis` loses no budget and makes no request fall back. Ends with `docker compose down -v`,
# also on failure. Needs Docker (Engine and Compose v2 `docker compose` or v1 `docker-compose`)
# and the images the compose file names (pulled, or built locally).
set -euo pipefail
cd "$(dirname "$0")/.."

fail() { echo "test-compose: FAILED: $*" >&2; exit 1; }
command -v docker >/dev/null || fail "docker is not installed"
docker info >/dev/null 2>&1 || fail "the Docker daemon is not running (start it: dockerd)"
if docker compose version >/dev/null 2>&1; then
  compose() { docker compose "$@"; }
elif command -v docker-compose >/dev/null; then
  compose() { docker-compose "$@"; }
else
  fail "neither 'docker compose' nor 'docker-compose' is installed"
fi

# The demo's fixed ports: not while the native demo's test runs (tests/common: MachineLock).
exec 9>"${TMPDIR:-/tmp}/tollgate-tests-demo-ports.lock"
flock 9

make build
compose down -v --remove-orphans >/dev/null 2>&1 || true
trap 'compose logs --no-color --tail 30 quota >&2 || true; compose down -v --remove-orphans >/dev/null 2>&1 || true' EXIT
compose up -d --build

started=$SECONDS
out=$(demo/curl.sh) || { echo "$out"; fail "the walk-through failed"; }
echo "$out"

expect() { grep -qF -- "$1" <<<"$out" || fail "the walk-through lacks: $1"; }
count() { grep -cF -- "$1" <<<"$out" || true; }
# 1-2: alice gets 3 × 200 then 429 from per-user, with the policy and Retry-After.
[ "$(count 'HTTP/1.1 200 OK')" -ge 6 ] || fail "fewer than 6 admitted requests"
expect 'ratelimit: "per-user";r=2;'
expect 'HTTP/1.1 429 Too Many Requests'
expect 'x-tollgate-rule: per-user'
expect 'retry-after: '
# 4: the per-ip limit (5 a minute) refuses dave's second request.
expect 'x-tollgate-rule: per-ip'
# 6: 6 of 8 /search requests across both Envoys, then the global rule refuses.
expect 'x-tollgate-rule: search'
expect 'tollgate_quota_tokens_granted_total 6'
# 7: 2 of 4 slow reports at once across both Envoys.
[ "$(count '    200 from ')" -eq 2 ] || fail "step 7: not 2 reports admitted"
[ "$(count '    429 from ')" -eq 2 ] || fail "step 7: not 2 reports refused"
expect 'tollgate_quota_slots_held{rule="reports"'
# 8: the token budget settled from the stream's usage, then owed.
expect 'x-tollgate-rule: llm-tokens'
expect 'tollgate_rule_settled{tollgate_rule="llm-tokens"} 1200'
expect 'tollgate_rule_charged{tollgate_rule="llm-tokens"} 500'
expect 'tollgate_rule_limited{tollgate_rule="per-ip"} 1'
echo "test-compose: the walk-through: every step as expected"

# Published ports: loopback only.
ports=$(compose ps)
echo "$ports"
grep -q '127.0.0.1:10000->' <<<"$ports" || fail "Envoy A is not published on 127.0.0.1:10000"
if grep -qE '(0\.0\.0\.0|:::?)[0-9]+->' <<<"$ports"; then fail "a port is published beyond loopback"; fi
echo "test-compose: published ports are on 127.0.0.1 only"

# The quota service requires its token.
body='{"instance":"x","items":[]}'
code=$(curl -s -o /dev/null -w '%{http_code}' -X POST -H 'content-type: application/json' \
  --data "$body" http://127.0.0.1:8090/v1/lease)
[ "$code" = 401 ] || fail "a call without the token got $code, not 401"
code=$(curl -s -o /dev/null -w '%{http_code}' -X POST -H 'content-type: application/json' \
  -H 'authorization: Bearer tollgate-demo-token' --data "$body" http://127.0.0.1:8090/v1/lease)
[ "$code" = 200 ] || fail "a call with the token got $code, not 200"
echo "test-compose: the quota service refuses calls without its token (401)"

# A Redis restart: the budget of /search (6 a minute, spent) is kept (append-only file), the
# service reconnects, and no request falls back.
quota_calls() {
  local total=0 n admin
  for admin in http://127.0.0.1:9901 http://127.0.0.1:9902; do
    n=$(curl -s "$admin/stats/prometheus" | awk '/^tollgate_quota_calls\{\}/ {print $2}')
    total=$((total + ${n:-0}))
  done
  echo "$total"
}
compose restart redis
calls_before=$(quota_calls)
admitted=0
for i in 1 2 3 4 5 6; do
  for url in http://127.0.0.1:10000 http://127.0.0.1:10001; do
    # A second apart: a proxy whose last answer had nothing asks again within a second.
    code=$(curl -s -o /dev/null -w '%{http_code}' "$url/search?q=$i")
    case $code in
      200) admitted=$((admitted + 1)) ;;
      429) ;;
      *) fail "a /search request after the Redis restart got $code" ;;
    esac
  done
  sleep 0.5
done
elapsed=$((SECONDS - started))
# 6 a minute: since the walk-through began, at most one more per 10 s could have come back.
allowed=$((elapsed / 10 + 1))
echo "test-compose: after the Redis restart: $admitted of 12 /search admitted ($allowed may, ${elapsed}s in)"
[ "$admitted" -le "$allowed" ] || fail "the Redis restart gave the budget back: $admitted admitted"
for admin in http://127.0.0.1:9901 http://127.0.0.1:9902; do
  fallbacks=$(curl -s "$admin/stats/prometheus" \
    | awk '/^tollgate_rule_fallback\{tollgate_rule="search"\}/ {print $2}')
  [ "${fallbacks:-0}" = 0 ] || fail "$admin: $fallbacks /search requests fell back"
done
errors=$(curl -s http://127.0.0.1:8090/metrics | awk '/^tollgate_quota_storage_errors_total/ {print $2}')
[ "${errors:-0}" = 0 ] || fail "the quota service had $errors storage errors"
calls=$(( $(quota_calls) - calls_before ))
[ "$calls" -gt 0 ] || fail "no quota call after the Redis restart: nothing was checked"
echo "test-compose: Redis restarted: no budget lost, 0 fallbacks, 0 storage errors ($calls calls after it)"

compose down -v --remove-orphans
trap - EXIT
echo "test-compose: passed"
