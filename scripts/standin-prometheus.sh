#!/usr/bin/env bash
# Builds a local image named prom/prometheus:v2.42.0 from Debian's prometheus package (2.42.0, the
# same version) for machines whose Docker cannot reach a registry: the compose demo's
# `--profile monitoring` then runs unchanged. Where the registry is reachable, `docker compose`
# pulls the official image instead and this is not needed.
# The base image: local/bookworm:base (built by the Docker stand-ins of this machine's tools) if
# present, else debian:bookworm-slim.
set -euo pipefail
tag=prom/prometheus:v2.42.0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download -qq prometheus 2>/dev/null) || {
  echo "standin-prometheus: 'apt-get download prometheus' failed (run apt-get update?)" >&2; exit 1; }
dpkg-deb -x "$work"/prometheus_*.deb "$work/root"
cp "$work/root/usr/bin/prometheus" "$work/prometheus"
base=debian:bookworm-slim
docker image inspect local/bookworm:base >/dev/null 2>&1 && base=local/bookworm:base
cat >"$work/Dockerfile" <<DOCKERFILE
FROM $base
COPY prometheus /bin/prometheus
RUN mkdir -p /prometheus /etc/prometheus && chown nobody:nogroup /prometheus
USER nobody
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
DOCKERFILE
DOCKER_BUILDKIT=0 docker build -q -t "$tag" "$work" >/dev/null
echo "standin-prometheus: built $tag from $(basename "$work"/prometheus_*.deb) on $base"
