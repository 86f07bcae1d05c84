# tollgate — `make demo` runs the demo, `make test` runs every test. Both set up what is missing.
WASM := dist/tollgate.wasm
NATIVE := dist/libtollgate.so
ENVOY := .venv/bin/envoy
CARGO_WASM := target/wasm32-wasip1/release/tollgate.wasm
CARGO_NATIVE := target/native/libtollgate_native.so

.PHONY: setup setup-rust build probe quota check schema test test-nginx test-compose lint dist bench bench-modules bench-instructions bench-scale demo demo-keep clean fuzz

setup:
	@scripts/setup.sh

setup-rust:
	@scripts/setup.sh --rust-only

# Both builds: the Wasm module and the Envoy dynamic module (docs/envoy-native.md), from one engine.
build: setup
	cargo build --release --target wasm32-wasip1 -p tollgate --lib
	cargo build --profile native -p tollgate-native
	@mkdir -p dist && cp $(CARGO_WASM) $(WASM) && cp $(CARGO_NATIVE) $(NATIVE)
	@echo "built $(WASM): $$(wc -c < $(WASM)) bytes; $(NATIVE): $$(wc -c < $(NATIVE)) bytes"

lint: setup
	cargo fmt --all -- --check
	python3 scripts/import-cycles.py
	python3 scripts/check-links.py
	cargo clippy --workspace --all-targets -- -D warnings
	cargo clippy -p tollgate --test nginx -- -D warnings
	cargo clippy --target wasm32-wasip1 -p tollgate -- -D warnings
	cargo clippy --target wasm32-wasip1 -p tollgate --features probe -- -D warnings
	cargo clippy -p tollgate-native --features probe -- -D warnings

quota:
	cargo build -p tollgate-quota -p tollgate-testbed

# The fast loop while changing code: formatting, import cycles, clippy on both targets, and every
# test that needs no proxy, Redis or network (it installs only the Rust parts of setup).
check: setup-rust
	cargo fmt --all -- --check
	python3 scripts/import-cycles.py
	python3 scripts/check-links.py
	cargo clippy --workspace --all-targets -- -D warnings
	cargo clippy --target wasm32-wasip1 -p tollgate -- -D warnings
	cargo test --workspace --lib -q
	cargo test -p tollgate-core --test fleet -q

# Regenerate schema/tollgate.schema.json from the configuration types.
schema:
	UPDATE_SCHEMA=1 cargo test --lib the_committed_schema_is_current

# Unit and property tests of the core and the host-independent filter code, the quota service's
# tests, and the real-Envoy tests twice — the `envoy` binary against the Wasm module, the
# `envoy_native` binary against the dynamic module (all but the slow engine-level tests:
# .config/nextest.toml) — in one cargo-nextest run; then the slowest tests of each build, also
# when some failed.
test: build probe lint quota
	@status=0; \
	TOLLGATE_WASM=$(abspath $(WASM)) ENVOY_BIN=$(abspath $(ENVOY)) TOLLGATE_PROBE_WASM=$(abspath $(PROBE_WASM)) \
	TOLLGATE_NATIVE=$(abspath $(NATIVE)) TOLLGATE_PROBE_NATIVE=$(abspath $(PROBE_NATIVE)) \
	TOLLGATE_QUOTA_BIN=$(abspath target/debug/tollgate-quota) \
	TOLLGATE_TESTBED_BIN=$(abspath target/debug/tollgate-testbed) \
	cargo nextest run --workspace || status=$$?; \
	python3 scripts/slowest-tests.py target/nextest/default/junit.xml 10 --not envoy_native; \
	python3 scripts/slowest-tests.py target/nextest/default/junit.xml 5 --only envoy_native; \
	exit $$status

# The behaviour checks in nginx with Kong's ngx_wasm_module, against the nginx binary NGINX_BIN
# names (docs/nginx.md says how to build one). Not part of `make test`: CI has no such nginx.
test-nginx: build quota
	@if [ -z "$(NGINX_BIN)" ]; then \
		echo "test-nginx: skipped: NGINX_BIN is not set (an nginx built with ngx_wasm_module; see docs/nginx.md)"; \
		exit 0; fi; \
	TOLLGATE_WASM=$(abspath $(WASM)) NGINX_BIN=$(abspath $(NGINX_BIN)) \
	TOLLGATE_QUOTA_BIN=$(abspath target/debug/tollgate-quota) \
	TOLLGATE_TESTBED_BIN=$(abspath target/debug/tollgate-testbed) cargo test --test nginx -- --test-threads 2

# Fuzzing (not part of `make test`, which runs the property tests with 256 cases each): the
# property tests with FUZZ_CASES cases each, then each `cargo fuzz` target for FUZZ_SECONDS
# (scripts/fuzz.sh). docs/security.md says what each covers and what a run found.
FUZZ_CASES ?= 50000
FUZZ_SECONDS ?= 60
fuzz: setup
	@FUZZ_CASES=$(FUZZ_CASES) FUZZ_SECONDS=$(FUZZ_SECONDS) scripts/fuzz.sh

# The Docker demo for real (not part of `make test`: it needs a Docker Engine and the images the
# compose file names): scripts/test-compose.sh says what it checks.
test-compose:
	@scripts/test-compose.sh

# The module with `--features probe` (time and heap allocations per callback, as Envoy counters):
# the allocation test and the benchmark's profile use it.
PROBE_WASM := target/probe/wasm32-wasip1/release/tollgate.wasm
PROBE_NATIVE := dist/probe/libtollgate.so
probe: setup
	cargo build --release --target wasm32-wasip1 -p tollgate --lib --features probe --target-dir target/probe
	@# (In the main target directory, after `build` copied the plain library: only the crate itself
	@# is built again, where a directory of its own built every dependency again on a fresh clone.)
	cargo build --profile native -p tollgate-native --features probe
	@mkdir -p dist/probe && cp $(CARGO_NATIVE) $(PROBE_NATIVE)

# The release artifacts: the Wasm module optimised by binaryen's wasm-opt -O (about 15% smaller,
# no measurable speed change; docs/release.md), the Envoy dynamic module, and their sha256s, in
# dist/release/.
WASM_FEATURES := --enable-bulk-memory --enable-sign-ext --enable-nontrapping-float-to-int \
	--enable-mutable-globals --enable-multivalue --enable-reference-types
dist: build
	@command -v wasm-opt >/dev/null || { apt_get=apt-get; [ "$$(id -u)" -eq 0 ] || apt_get="sudo apt-get"; \
		$$apt_get update -qq && $$apt_get install -y -qq binaryen >/dev/null; }
	@mkdir -p dist/release
	wasm-opt $(WASM_FEATURES) -O $(WASM) -o dist/release/tollgate.wasm
	cp $(NATIVE) dist/release/libtollgate.so
	cd dist/release && sha256sum tollgate.wasm > tollgate.wasm.sha256 && sha256sum libtollgate.so > libtollgate.so.sha256
	@echo "dist/release/tollgate.wasm: $$(wc -c < dist/release/tollgate.wasm) bytes (plain release: $$(wc -c < $(WASM))); dist/release/libtollgate.so: $$(wc -c < dist/release/libtollgate.so) bytes"
	@cat dist/release/tollgate.wasm.sha256 dist/release/libtollgate.so.sha256

demo: build
	cargo build --release -p tollgate-quota
	demo/run.sh

# Benchmarks (not part of `make test`): writes docs/benchmarks.md and docs/benchmarks.png.
bench: dist
	@for pkg in wrk nginx-light; do dpkg -s $$pkg >/dev/null 2>&1 || { apt_get=apt-get; \
		[ "$$(id -u)" -eq 0 ] || apt_get="sudo apt-get"; $$apt_get install -y -qq $$pkg >/dev/null; }; done
	.venv/bin/pip install --quiet --disable-pip-version-check matplotlib grpcio redis
	cargo build --release -p tollgate-quota -p tollgate-testbed
	$(MAKE) bench-modules
	cd bench/probe && cargo build --release --target wasm32-wasip1
	$(MAKE) probe
	.venv/bin/python bench/run.py

# The do-nothing modules the benchmarks compare tollgate with (Wasm and dynamic module), and the
# raw-ABI floors (a module that makes the host calls a setup needs and nothing else); the dynamic
# modules where the benchmarks' Envoys find them (target/bench-native).
bench-modules:
	cd bench/noop && cargo build --release --target wasm32-wasip1
	cd bench/noop-native && cargo build --release
	@mkdir -p target/bench-native && cp bench/noop-native/target/release/libnoop.so target/bench-native/ \
		&& cp $(NATIVE) target/bench-native/libtollgate.so
	cd bench/rawnoop && cargo build --release --target wasm32-wasip1 \
		&& for f in every-callback reads-path per-ip-calls; do \
			cargo build --release --target wasm32-wasip1 --features $$f --target-dir target/$$f || exit 1; done

# Instructions per request under valgrind's callgrind (deterministic, unlike CPU time on a shared
# VM): the floors set by the host and what each feature adds. About 8 minutes; writes its section
# of docs/benchmarks.md.
bench-instructions: dist bench-modules
	@command -v valgrind >/dev/null || { apt_get=apt-get; [ "$$(id -u)" -eq 0 ] || apt_get="sudo apt-get"; \
		$$apt_get install -y -qq valgrind >/dev/null; }
	cargo build --release -p tollgate-quota
	.venv/bin/python bench/instructions.py

# The same, left running for your own requests until Ctrl-C.
demo-keep: build
	cargo build --release -p tollgate-quota
	DEMO_KEEP=1 demo/run.sh

clean:
	cargo clean
	rm -rf dist .venv

# The fleet simulator's table (not part of `make test`, which runs a small version): 10, 100 and
# 1 000 simulated proxies over the real lease code; writes docs/scale.md and docs/scale.png.
bench-scale:
	cargo build --release -p tollgate-fleet
	.venv/bin/pip install --quiet --disable-pip-version-check matplotlib
	.venv/bin/python bench/scale.py
