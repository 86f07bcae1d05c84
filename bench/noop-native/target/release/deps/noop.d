/work/main/bench/noop-native/target/release/deps/noop.d: src/lib.rs

/work/main/bench/noop-native/target/release/deps/libnoop.so: src/lib.rs

src/lib.rs:
