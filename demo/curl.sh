#!/usr/bin/env bash
# A walk through tollgate with curl, against the demo topology (native: `make demo`; Docker:
# `docker compose up -d`, then this script):
#   per-ip:   5 requests a minute per client address on /api/        (local to each Envoy)
#   per-user: 3 requests per 10 s per x-user header on /api/          (local to each Envoy)
#   search:   6 requests a minute on /search, shared by both Envoys   (global, quota service)
#   reports:  2 slow requests in flight on /reports, across both Envoys (global concurrency)
#   llm-tokens: 1 000 tokens a minute per x-user on /llm, reserved then settled from the usage the
#             (LLM-like) upstream reports at the end of its stream          (local to each Envoy)
# It first waits (up to a minute) until both Envoys and the quota service are ready, and exits
# non-zero, saying what failed, if one never is or if a request gets no answer.
set -uo pipefail
URL=${TOLLGATE_URL:-http://127.0.0.1:10000}
ADMIN=${TOLLGATE_ADMIN:-http://127.0.0.1:9901}
URL_B=${TOLLGATE_URL_B:-http://127.0.0.1:10001}
ADMIN_B=${TOLLGATE_ADMIN_B:-http://127.0.0.1:9902}
QUOTA_METRICS=${QUOTA_METRICS:-http://127.0.0.1:8090/metrics}
QUOTA_HEALTH=${QUOTA_METRICS%/metrics}/healthz
failures=0

bold() { if [ -t 1 ]; then printf '\n\033[1m%s\033[0m\n' "$*"; else printf '\n%s\n' "$*"; fi; }

# Wait until every URL answers 200 (Envoy's /ready says LIVE once its listeners serve).
wait_ready() {
  local deadline=$((SECONDS + ${TOLLGATE_READY_TIMEOUT:-60}))
  local url
  for url in "$@"; do
    until curl -fs -o /dev/null --max-time 2 "$url"; do
      if [ "$SECONDS" -ge "$deadline" ]; then
        echo "not ready: $url does not answer 200 (is the demo running? docker compose ps)" >&2
        exit 1
      fi
      sleep 0.2
    done
  done
}

# One request: the status line and the rate-limit headers; a request that gets no answer is
# reported and counted.
show() {
  local user=$1 path=${2:-/api/hello} base=${3:-$URL} out
  printf '$ curl -i %s%s -H "x-user: %s"\n' "$base" "$path" "$user"
  if ! out=$(curl -sS --max-time 10 -o /dev/null -D - -H "x-user: $user" "$base$path" 2>&1); then
    echo "    FAILED: $out"
    failures=$((failures + 1))
    return
  fi
  printf '%s\n' "$out" \
    | tr -d '\r' \
    | grep -iE '^(HTTP/|ratelimit|x-ratelimit|retry-after|x-tollgate-rule)' \
    | sed 's/^/    /'
}

wait_ready "$ADMIN/ready" "$ADMIN_B/ready" "$QUOTA_HEALTH" "$URL/health" "$URL_B/health"

bold "1. Under the limit: 200, with the quota of the most restrictive rule in RateLimit headers"
show alice
show alice
show alice

bold "2. Over the limit: alice's 4th request in 10 s gets 429, Retry-After, and the rule's name"
show alice

bold "3. Per-key isolation: bob has his own per-user bucket"
show bob

bold "4. Rules combine: per-ip (5/min for this address) charged only for admitted requests"
echo "   alice's refused request did not count against per-ip: 4 used so far, one left."
show carol
show dave

bold "5. Paths outside /api/ are not limited"
show dave /health

bold "6. A global limit: /search allows 6 a minute across BOTH Envoys (A on :10000, B on :10001)"
for i in 1 2 3 4; do
  show erin /search "$URL"
  show erin /search "$URL_B"
done

bold "7. Global concurrency: /reports allows 2 in flight across BOTH Envoys (each takes 1 s)"
echo "   4 reports at once, 2 on each Envoy:"
for base in "$URL" "$URL" "$URL_B" "$URL_B"; do
  curl -sS --max-time 10 -o /dev/null -w "    %{http_code} from $base\n" "$base/reports/q3" &
done
wait
echo "   (when they end, their slots are free again here at once; the quota service hears of it"
echo "   at the next renewal, so its slots_held below may still count them; a proxy that dies"
echo "   loses its slots after the quota service's lease term)"

bold "8. A token budget settled from the response: /llm allows frank 1 000 tokens a minute"
echo "   Each request reserves 400 (x-max-tokens, default 400); the stream's last event says what"
echo "   it used, and the difference is settled: 300 used gives 100 back, 900 used owes 500."
llm() {
  local used=$1 out
  printf '$ curl -i %s/llm/chat -H "x-user: frank" -H "x-demo-usage: %s"\n' "$URL" "$used"
  if ! out=$(curl -sS --max-time 10 -o /dev/null -D - -H "x-user: frank" -H "x-demo-usage: $used" \
      "$URL/llm/chat" 2>&1); then
    echo "    FAILED: $out"
    failures=$((failures + 1))
    return
  fi
  printf '%s\n' "$out" | tr -d '\r' | grep -iE '^(HTTP/|ratelimit:|retry-after|x-tollgate-rule)' \
    | sed 's/^/    /'
}
llm 300
llm 900
echo "   1 200 used of 1 000: frank owes 200, and his next reservation waits until it is repaid:"
llm 300
curl -s "$ADMIN/stats/prometheus" \
  | grep -E '^tollgate_rule_(reserved|settled|refunded|charged)\{tollgate_rule="llm-tokens"' \
  | sed 's/^/    A /'

bold "9. Metrics, per rule, at $ADMIN/stats/prometheus (and $ADMIN_B for B)"
curl -s "$ADMIN/stats/prometheus" | grep -E '^tollgate_rule_(allowed|limited)' | sed 's/^/    A /'
curl -s "$ADMIN_B/stats/prometheus" | grep -E '^tollgate_rule_(allowed|limited)\{tollgate_rule="search"' | sed 's/^/    B /'
curl -s "$ADMIN/stats/prometheus" | grep -E '^tollgate_quota_(calls|granted)' | sed 's/^/    A /'
echo "  and the quota service's at $QUOTA_METRICS:"
curl -s "$QUOTA_METRICS" | grep -E '^tollgate_quota_(tokens_granted|denials)_total|^tollgate_quota_slots_held' | sed 's/^/    /'
echo
if [ "$failures" -gt 0 ]; then
  echo "$failures request(s) got no answer (see FAILED above)" >&2
  exit 1
fi
