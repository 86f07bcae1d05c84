#!/usr/bin/env bash
# A walk through tollgate with curl, against the demo topology (envoy/envoy.yaml):
#   per-ip:   5 requests a minute per client address on /api/
#   per-user: 3 requests per 10 s per x-user header on /api/
set -euo pipefail
URL=${TOLLGATE_URL:-http://127.0.0.1:10000}
ADMIN=${TOLLGATE_ADMIN:-http://127.0.0.1:9901}

bold() { if [ -t 1 ]; then printf '\n\033[1m%s\033[0m\n' "$*"; else printf '\n%s\n' "$*"; fi; }

# One request: the status line and the rate-limit headers.
show() {
  local user=$1 path=${2:-/api/hello}
  printf '$ curl -i %s%s -H "x-user: %s"\n' "$URL" "$path" "$user"
  curl -s -o /dev/null -D - -H "x-user: $user" "$URL$path" \
    | tr -d '\r' \
    | grep -iE '^(HTTP/|ratelimit|x-ratelimit|retry-after|x-tollgate-rule)' \
    | sed 's/^/    /'
}

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

bold "6. Metrics, per rule, at $ADMIN/stats/prometheus"
curl -s "$ADMIN/stats/prometheus" | grep -E '^tollgate_rule_(allowed|limited)' | sed 's/^/    /'
echo
