#!/bin/sh
# make fuzz: the property-test fuzz targets with FUZZ_CASES cases each, then each `cargo fuzz`
# target (coverage-guided, libFuzzer with AddressSanitizer) for FUZZ_SECONDS. Installs a nightly
# compiler and cargo-fuzz when missing. Each target's last libFuzzer status line (runs, coverage
# `cov`, features `ft`, corpus) is printed at the end; crashes are kept in fuzz/artifacts/.
set -eu
cd "$(dirname "$0")/.."
cases=${FUZZ_CASES:-50000}
seconds=${FUZZ_SECONDS:-60}
targets=${FUZZ_TARGETS:-configuration requests quota_answers call_bodies native_hooks}

PROPTEST_CASES=$cases cargo test -p tollgate --lib -- fuzz_ every_configuration_seed_parses \
    arbitrary_header_bytes_are_handled keys_are_unambiguous any_lease_answer_is_read_safely
PROPTEST_CASES=$cases cargo test -p tollgate-quota --test service -- fuzz_
# The dynamic module's hooks against Rust's stand-in for Envoy.
PROPTEST_CASES=$cases cargo test --release -p tollgate-native --lib -- fuzz_ hostile_
# The fleet's bound: a simulated fleet over the real lease code, checked at every admission.
PROPTEST_CASES=$cases cargo test --release -p tollgate-core --test fleet -- bound::

rustc +nightly --version >/dev/null 2>&1 || rustup toolchain install nightly --profile minimal
command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked

# Seeds: the configuration examples of the docs (the configuration target) and a request through
# each of them (the requests target); libFuzzer adds what it finds to the same directories.
corpus=target/fuzz-corpus
mkdir -p "$corpus/configuration" "$corpus/requests" "$corpus/quota_answers" "$corpus/call_bodies" \
    "$corpus/native_hooks"
python3 - "$corpus" <<'PY'
import json, pathlib, sys
corpus = pathlib.Path(sys.argv[1])
docs = pathlib.Path("docs/configuration.md").read_text()
blocks = [b.split("```")[0] for b in docs.split("```json")[1:] if '"rules"' in b]
for i, block in enumerate(blocks):
    (corpus / "configuration" / f"docs-{i}").write_text(block)
    (corpus / "requests" / f"docs-{i}").write_bytes(bytes([i]) + b"10.0.0.1:4000\n\x00u1\n\x02/api")
lease = {"items": [{"granted": 5, "ttl_ms": 10000, "remaining": 7, "reset_ms": 1000, "rate": 0.5,
                    "debt": 3, "revoked": 1}]}
slots = {"items": [{"held": 2, "share": 2, "free": 3, "ttl_ms": 10000}]}
(corpus / "quota_answers" / "ok").write_bytes(
    b"200\x00" + json.dumps(lease).encode() + b"\x00" + json.dumps(slots).encode() + b"\x0010.0.0.1\n\x00u")
item = {"rule": "r", "limit_id": "l", "key": "k", "requests": 10, "per_ms": 1000, "burst": 20,
        "wanted": 5, "used": 1, "demand": 2.5, "known_ms": 100, "known_remaining": 3, "returned": 1,
        "owed": 7, "held": 2, "share": 2.5, "share_ms": 900}
(corpus / "call_bodies" / "lease").write_bytes(b"\x00" + json.dumps({"instance": "p", "items": [item]}).encode())
slot = {"rule": "r", "limit_id": "l", "key": "k", "concurrent": 10, "wanted": 2, "keep": 1, "known_held": 1}
(corpus / "call_bodies" / "slots").write_bytes(b"\x01" + json.dumps({"instance": "p", "items": [slot]}).encode())
# The dynamic module's hooks: fields split by 0xff, pairs by 0xfe (native/src/fuzz_harness.rs).
sep, pair = b"\xff", b"\xfe"
request = pair.join([b":path", b"/api?q=1", b"x-user", b"u1", b"x-forwarded-for", b"10.1.1.1"])
answer = pair.join([b":status", b"200"]) + sep + json.dumps(lease).encode()
for config in range(4):
    for strict in (0, 1):
        (corpus / "native_hooks" / f"c{config}-{strict}").write_bytes(
            bytes([config, strict, 0, 0, 0]) + sep + request + sep + b"10.0.0.1:4000" + sep + pair.join([b"k", b"v"])
            + sep + b'{"model":"a","max_tokens":7}' + sep + pair.join([b":status", b"200"]) + sep
            + b'{"usage":{"total_tokens":3}}' + sep + answer + sep + answer)
PY

summary=""
for t in $targets; do
    log="target/fuzz-$t.log"
    cargo +nightly fuzz run --fuzz-dir fuzz "$t" "$corpus/$t" -- \
        -max_total_time="$seconds" -rss_limit_mb=2048 -print_final_stats=1 >"$log" 2>&1 || {
        tail -40 "$log"
        echo "fuzz: $t failed (log: $log; the input is in fuzz/artifacts/$t/)"
        exit 1
    }
    last=$(grep -E '^#[0-9]+' "$log" | tail -1)
    summary="$summary
$t: $last"
done
echo "cargo fuzz, $seconds s each:$summary"
