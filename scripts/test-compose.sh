#!/usr/bin/env bash
# `make test-compose`: the Docker demo as a user runs it, checked. Builds the module and the quota
# service image, `docker compose up -d --build`, runs the walk-through (demo/curl.sh, which waits
# for readiness) and checks every step's status codes and rule names, then: published ports are
# on 127.0.0.1 only, the quota service refuses calls without its token, `docker compose restart
# redis` loses no budget and makes no request fall back, and `docker compose restart quota` (the
# service restarted in front of the same Redis) under light load within the /search limit, through
# both Envoys, refuses none of it and decides none by the failure mode, the limit still refusing
# past its quota after it. Ends with `docker compose down -v`, also on failure. Needs Docker
# (Engine and Compose v2 `docker compose` or v1 `docker-compose`) and the images the compose file
# names (pulled, or built locally). Runs with the `monitoring` profile: Prometheus must scrape both
# Envoys and the quota service and load every alerting rule (its image pulled, or built from
# Debian's package by scripts/standin-prometheus.sh where no registry answers).
set -euo pipefail
cd "$(dirname "$0")/.."
export COMPOSE_PROFILES=monitoring

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
if ! docker image inspect prom/prometheus:v2.42.0 >/dev/null 2>&1; then
  docker pull -q prom/prometheus:v2.42.0 2>/dev/null || scripts/standin-prometheus.sh
fi
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

# Prometheus (profile monitoring) scrapes both Envoys and the quota service, and loaded every
# alerting rule of monitoring/prometheus/alerts.yml.
prometheus_ok() {
  curl -s http://127.0.0.1:9090/api/v1/targets | python3 -c '
import json, sys
targets = json.load(sys.stdin)["data"]["activeTargets"]
up = sorted(t["labels"]["job"] + "/" + t["labels"]["instance"] for t in targets if t["health"] == "up")
print(" ".join(up))
sys.exit(0 if len(up) == 3 else 1)' 2>/dev/null
}
for _ in $(seq 1 120); do targets=$(prometheus_ok) && break; sleep 0.5; done
prometheus_ok >/dev/null || fail "Prometheus does not scrape all three targets: $(curl -s http://127.0.0.1:9090/api/v1/targets | head -c 2000)"
rules=$(curl -s http://127.0.0.1:9090/api/v1/rules | python3 -c '
import json, sys
groups = json.load(sys.stdin)["data"]["groups"]
rules = [r for g in groups for r in g["rules"]]
bad = [r["name"] for r in rules if r.get("health") not in ("ok", "unknown")]
print(str(len(rules)) + "|" + " ".join(bad))')
expected=$(grep -c -- '- alert:' monitoring/prometheus/alerts.yml)
[ "${rules%%|*}" = "$expected" ] || fail "Prometheus loaded ${rules%%|*} alerting rules, not $expected"
[ -z "${rules#*|}" ] || fail "alerting rules that fail to evaluate: ${rules#*|}"
series=$(curl -s http://127.0.0.1:9090/api/v1/query --data-urlencode \
  'query=count(tollgate_rule_limited{tollgate_rule="per-ip"})' | python3 -c '
import json, sys; r = json.load(sys.stdin)["data"]["result"]; print(r[0]["value"][1] if r else 0)')
[ "$series" = 2 ] || fail "Prometheus has $series per-ip series, not one per Envoy"
echo "test-compose: Prometheus scrapes $targets; $expected alerting rules loaded"

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
last_search_ms=$(date +%s%3N)
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

# A quota service restart under light load: `docker compose restart quota` stops the service
# (SIGTERM: it stops listening and lets calls in progress finish) and starts it again in front of
# the same Redis, while the proxies hold leases of /search and evidence of its bucket. The load is
# under the limit (6 a minute: a token every 10 s): one request every 11 s, alternating Envoys (A,
# B, A, B, restart, A, B), once the bucket has refilled to 5 tokens or more (50 s without a /search
# request), as light traffic leaves it. Both proxies' last answer for /search had nothing (the
# walk-through and the Redis check spent the bucket): their first requests are those of clients
# that come back when told. The limit allows every one of these: none may be refused, none decided
# by the failure mode (`allow` here: the `fallback` counters must not move), and the limit must
# still refuse past its quota after the restart.
now_ms() { date +%s%3N; }
sleep_until_ms() {
  local wait=$(($1 - $(now_ms)))
  if [ "$wait" -gt 0 ]; then sleep "$((wait / 1000)).$(printf '%03d' $((wait % 1000)))"; fi
}
clock() { date -u +%H:%M:%S.%3N; } # UTC, as the quota service logs
search_stat() { # a /search counter, summed over both Envoys
  local total=0 n admin
  for admin in http://127.0.0.1:9901 http://127.0.0.1:9902; do
    n=$(curl -s "$admin/stats/prometheus" \
      | awk -v name="tollgate_rule_$1{tollgate_rule=\"search\"}" '$1 == name {print $2}')
    total=$((total + ${n:-0}))
  done
  echo "$total"
}
quota_failures() {
  local total=0 n admin
  for admin in http://127.0.0.1:9901 http://127.0.0.1:9902; do
    n=$(curl -s "$admin/stats/prometheus" | awk '/^tollgate_quota_failures\{\}/ {print $2}')
    total=$((total + ${n:-0}))
  done
  echo "$total"
}
quota_started() { docker inspect -f '{{.State.StartedAt}}' "$(compose ps -q quota)"; }
envoy_url() { if [ "$1" = A ]; then echo http://127.0.0.1:10000; else echo http://127.0.0.1:10001; fi; }
fallbacks_before=$(search_stat fallback)
failures_before=$(quota_failures)
quota_start_before=$(quota_started)
first_ms=$((last_search_ms + 45000))
echo "test-compose: /search under its limit across \`docker compose restart quota\`:"
refused=""
i=0
# offset (ms after the first):Envoy, or restart
for step in 0:A 500:B 11000:A 22000:B 27500:restart 33000:A 44000:B; do
  IFS=: read -r offset what <<<"$step"
  sleep_until_ms $((first_ms + offset))
  at=$(clock)
  if [ "$what" = restart ]; then
    t=$(now_ms)
    compose restart quota >/dev/null 2>&1 || fail "docker compose restart quota failed"
    echo "    $at quota restarted ($(($(now_ms) - t)) ms)"
    continue
  fi
  code=$(curl -s -o /dev/null --max-time 10 -w '%{http_code}' "$(envoy_url "$what")/search?q=quota-$offset")
  i=$((i + 1))
  echo "    $at $what $code"
  [ "$code" = 200 ] || refused="$refused $at:$what:$code"
done
[ "$(quota_started)" != "$quota_start_before" ] || fail "the quota service did not restart"
fallbacks=$(($(search_stat fallback) - fallbacks_before))
failures=$(($(quota_failures) - failures_before))
[ -z "$refused" ] || fail "the quota restart: /search under its limit not admitted:$refused ($fallbacks fallbacks, $failures failed quota calls)"
[ "$fallbacks" = 0 ] || fail "the quota restart: $fallbacks /search requests decided by the failure mode ($failures failed quota calls)"
items=$(curl -s http://127.0.0.1:8090/metrics | awk '/^tollgate_quota_lease_items_total/ {print $2}')
[ "${items:-0}" -gt 0 ] || fail "the restarted quota service served no lease item: nothing was checked"
# Past its quota: 8 requests back to back, right after the last one.
burst_admitted=0
burst_refused=0
for envoy in A B A B A B A B; do
  code=$(curl -s -o /dev/null --max-time 10 -w '%{http_code}' "$(envoy_url $envoy)/search?q=burst")
  case $code in
    200) burst_admitted=$((burst_admitted + 1)) ;;
    429) burst_refused=$((burst_refused + 1)) ;;
    *) fail "a /search request past the quota after the quota restart got $code" ;;
  esac
done
[ "$burst_refused" -gt 0 ] || fail "after the quota restart, 8 /search requests back to back: none refused"
# The global limit over the whole run: the bucket (6) and a token per 10 s since the walk-through
# began (a second more for the rounding of $SECONDS).
elapsed=$((SECONDS - started))
admitted_all=$(search_stat allowed)
bound=$((6 + (elapsed + 1) / 10))
[ "$admitted_all" -le "$bound" ] || fail "the global limit: $admitted_all /search admitted in ${elapsed}s (bound $bound)"
fallbacks=$(($(search_stat fallback) - fallbacks_before))
[ "$fallbacks" = 0 ] || fail "after the quota restart: $fallbacks /search requests decided by the failure mode"
echo "test-compose: quota restarted: $i of $i /search under the limit admitted, 0 fallbacks ($failures failed quota calls); then $burst_admitted of 8 back to back admitted; $admitted_all admitted in all in ${elapsed}s (bound $bound); the restarted service served $items lease items"

compose down -v --remove-orphans
trap - EXIT
echo "test-compose: passed"
